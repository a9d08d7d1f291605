"""kvcr-bench: kvcr's benchmarks, the demo and the rigs they share with the test suites.

Tooling, not product: no engine process loads it. `kvcr bench NAME` finds each benchmark
through the `kvcr.bench` entry points this package installs. Every benchmark prints a table
and ratios against a baseline measured in the same run (and `--json`).

- `copies`: copy rows shared by the pool and guard benchmarks (baseline: memcpy, same run)
- `pool`, `guard`, `peer` (+ `peer_node`): `kvcr bench pool`, `guard`, `peer`
- `vllm_ttft` (+ `vllm_probe`, `vllm_servers`, `tiny_model`): `kvcr bench vllm`; the probe,
  the servers and the tiny model also drive the end-to-end tests
- `demo`: the README's main job (`python -m kvcr_bench.demo`)
- `sglang_hicache` (+ `sglang_rig`): `kvcr bench sglang`; the rig also drives SGLang's tests
- `device_copy`: `kvcr bench copy` (the copy engine on CPU or CUDA; torch alone)
"""

from kvcr_bench._version import __version__

__all__ = ["__version__"]
