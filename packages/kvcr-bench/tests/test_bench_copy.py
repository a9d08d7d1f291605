"""`kvcr bench copy`, the copy engine's benchmark. Risks: the CLI does not reach it or drops
`--device`; the CPU run (what CI can run) breaks or stops checking the bytes it moved, or
drops a layout or run length; the block-id pattern is not the one it claims (runs of the
given length, slots with gaps); asked for CUDA where there is none it crashes or measures
the CPU instead of saying so; it needs more than torch and kvcr (scripts/gpu_check.sh runs
it where no engine is installed)."""

from __future__ import annotations

import importlib.metadata
import json
import subprocess
import sys
from pathlib import Path

import pytest
import tomllib

torch = pytest.importorskip("torch", reason="the copy engines move torch tensors")

from kvcr_bench.copy_patterns import pattern  # noqa: E402
from kvcr_core.cli import main as cli  # noqa: E402
from kvcr_core.copyengine import runs  # noqa: E402

PYPROJECT = Path(__file__).resolve().parents[1] / "pyproject.toml"


@pytest.fixture
def copy_entry_point(monkeypatch: pytest.MonkeyPatch) -> None:
    """`kvcr bench copy` as kvcr-bench's pyproject declares it (the installed console script
    knows the entry points of the kvcr-bench that was installed, maybe older than this)."""
    value = tomllib.loads(PYPROJECT.read_text())["project"]["entry-points"]["kvcr.bench"]["copy"]
    entry = importlib.metadata.EntryPoint(name="copy", value=value, group="kvcr.bench")
    monkeypatch.setattr(cli, "_bench_plugins", lambda: [entry])


@pytest.mark.unit
@pytest.mark.slow
def test_bench_copy_on_cpu_reports_every_row_and_checks_its_bytes(
        copy_entry_point: None, capsys: pytest.CaptureFixture[str]) -> None:
    """`kvcr bench copy --device cpu --quick --json`: 256 KiB blocks in runs of 1, 4, 16 and
    64, whole, paged and layer by layer, both directions, each row's bytes checked; the CPU
    engine copies run by run; no CUDA targets and no registration timing on CPU."""
    assert cli.main(["bench", "copy", "--device", "cpu", "--quick", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["device"] == "cpu" and result["engine"] == "CpuCopyEngine"
    rows = {(r["block_bytes"], r["layout"], r["run_blocks"]) for r in result["rows"]}
    assert rows == {(256 << 10, layout, run) for layout in ("whole", "paged", "layerwise")
                    for run in (1, 4, 16, 64)}
    assert all(r["checked"] and r["save_ratio"] > 0 and r["load_ratio"] > 0
               and r["auto_chose"] == {"save": ["runs"], "load": ["runs"]}
               for r in result["rows"])
    paged = {r["run_blocks"]: r["copies_run_by_run"] for r in result["rows"]
             if r["layout"] == "paged"}
    assert paged == {1: 512, 4: 128, 16: 32, 64: 8}  # 64 blocks of 8 pages
    assert result["summary"]["all_checked"] and result["meets_targets"] == {}
    assert result["registration"] is None


@pytest.mark.unit
@pytest.mark.parametrize("run", [1, 4, 16, 64])
def test_the_block_pattern_has_runs_of_the_given_length_and_slots_with_gaps(run: int) -> None:
    """Block ids and slots both come in runs of exactly `run` (so a run-by-run engine makes
    n / run copies per plane), every slot is distinct, and sorted slots still break every
    `run` (a gather cannot turn them into one copy the engine would not get)."""
    blocks, slots = pattern(64, run, seed=run)
    assert len(set(slots)) == 64 and [n for _, _, n in runs(blocks, slots)] == [run] * (64 // run)
    ordered = sorted(slots)
    assert [n for _, _, n in runs(ordered, ordered)] == [run] * (64 // run)


@pytest.mark.unit
def test_bench_copy_on_cuda_without_cuda_says_so(
        copy_entry_point: None, capsys: pytest.CaptureFixture[str]) -> None:
    """--device cuda on a machine without CUDA exits 2 with the reason, measuring nothing."""
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA: scripts/gpu_check.sh runs the CUDA bench")
    assert cli.main(["bench", "copy", "--device", "cuda", "--quick"]) == 2
    captured = capsys.readouterr()
    assert "no CUDA device" in captured.err and captured.out == ""


@pytest.mark.integration
def test_bench_copy_needs_no_engine() -> None:
    """The benchmark module imports torch and kvcr only: no vLLM, SGLang or transformers."""
    code = ("import sys, kvcr_bench.device_copy\n"
            "print(sorted({m.split('.')[0] for m in sys.modules}))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, timeout=300)
    loaded = set(json.loads(out.stdout.replace("'", '"')))
    assert "torch" in loaded and not loaded & {"vllm", "sglang", "transformers"}
