#!/usr/bin/env bash
# kvcr's GPU check with torch alone (no vLLM, no SGLang): the copy-engine tests (the CUDA ones
# and the CPU ones beside them) and `kvcr bench copy --device cuda` (run as
# `python -m kvcr_bench.device_copy`, so no kvcr install and no entry point is needed), in
# under 5 minutes, merged into ONE JSON file. For a GPU machine with a CUDA build of torch and
# pytest; kvcr's packages come from this checkout through PYTHONPATH. kvcr-core's own small
# dependencies must be importable too: where one is missing and the machine has no package
# index, put its wheel in .whl/ (git-ignored; carry it along) and the script installs it into
# a temporary folder, e.g. from a machine with an index, for the GPU machine's Python (3.12):
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 \
#       --implementation cp --platform manylinux_2_17_x86_64 -d .whl msgspec
#
# Usage: bash scripts/gpu_check.sh [OUT_DIR]
#   OUT_DIR (default: $OUT, else ./gpu-check) receives gpu-check.json: the machine, each
#   test's outcome (failures with their messages, the log's tail) and the bench's JSON.
# The zero-copy strategy is timed only if its test passed (a kernel fault there would end the
# process's CUDA context and take every number with it).
# Exit status: 0 when the tests passed and the bench ran with every copy checked; 2 when a
# package is missing; 3 when torch sees no CUDA device (the tests then skip, the bench refuses).
set -uo pipefail
cd "$(dirname "$0")/.."
out=${1:-${OUT:-gpu-check}}
mkdir -p "$out"
work=$(mktemp -d)
py=${PYTHON:-python3}
started=$(date +%s)
PYTHONPATH="$(ls -d "$PWD"/packages/*/src | paste -sd:)${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONPATH PYTHONUNBUFFERED=1

missing() {
    "$py" -c 'import importlib.util as u
need = ["torch", "pytest", "pytest_timeout", "msgspec", "prometheus_client", "yaml", "xxhash"]
print(" ".join(n for n in need if u.find_spec(n) is None))'
}
lacking=$(missing)
if [ -n "$lacking" ] && compgen -G ".whl/*.whl" >/dev/null; then
    "$py" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
        --target "$work/site" .whl/*.whl
    export PYTHONPATH="$PYTHONPATH:$work/site"
    lacking=$(missing)
fi
if [ -n "$lacking" ]; then
    echo "gpu_check: missing Python packages: $lacking (see this script's header)" >&2
    exit 2
fi

timeout 120 "$py" -m pytest -q -rs -p no:cacheprovider --timeout=90 \
    --junitxml="$work/junit.xml" \
    packages/kvcr-core/tests/test_copy_engine_cuda.py \
    packages/kvcr-core/tests/test_copy_engine_gather.py \
    packages/kvcr-core/tests/test_copy_engine.py \
    packages/kvcr-core/tests/test_sealing.py \
    packages/kvcr-bench/tests/test_bench_copy.py 2>&1 | tee "$work/pytest.log"
tests=${PIPESTATUS[0]}

strategies=$("$py" - "$work/junit.xml" <<'EOF'
import sys, xml.etree.ElementTree as ET
try:
    case = next(c for c in ET.parse(sys.argv[1]).iter("testcase")
                if c.get("name") == "test_zero_copy_round_trip_byte_exactly")
    ok = not any(c.tag in ("failure", "error", "skipped") for c in case)
except (OSError, ET.ParseError, StopIteration):
    ok = False
print("runs,gather,direct,pairs,auto" if ok else "runs,gather,pairs,auto")
EOF
)
timeout 170 "$py" -m kvcr_bench.device_copy --device cuda --strategies "$strategies" \
    --json-out "$work/bench.json"
bench=$?

"$py" - "$work" "$out/gpu-check.json" "$tests" "$bench" "$started" <<'EOF'
import json, pathlib, sys, time, xml.etree.ElementTree as ET
import torch
work, target, tests, bench, started = pathlib.Path(sys.argv[1]), sys.argv[2], *map(int, sys.argv[3:])
cases = []
if (work / "junit.xml").exists():
    for case in ET.parse(work / "junit.xml").iter("testcase"):
        outcome = next((c.tag for c in case if c.tag in ("failure", "error", "skipped")), "passed")
        detail = next((c.get("message", "") for c in case if c.tag != "system-out"), "")
        cases.append({"test": f"{case.get('classname')}::{case.get('name')}",
                      "outcome": outcome, "s": float(case.get("time", 0)), "message": detail[:500]})
counts = {k: sum(c["outcome"] == k for c in cases) for k in ("passed", "failure", "error", "skipped")}
log = (work / "pytest.log").read_text() if (work / "pytest.log").exists() else ""
result = {
    "check": "scripts/gpu_check.sh", "wall_s": round(time.time() - started, 1),
    "machine": {"torch": torch.__version__, "cuda": torch.version.cuda,
                "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None},
    "tests": {"exit": tests, **counts,
              "not_passed": [c for c in cases if c["outcome"] != "passed"], "cases": cases,
              "log_tail": log[-3000:]},
    "bench_exit": bench,
    "bench": json.loads((work / "bench.json").read_text()) if (work / "bench.json").exists() else None,
}
pathlib.Path(target).write_text(json.dumps(result, indent=2))
print(f"gpu_check: {target}: tests {counts} (exit {tests}), bench exit {bench}, {result['wall_s']} s")
EOF
if [ "$bench" -eq 2 ]; then
    exit 3  # no CUDA device: the bench said so on stderr
fi
[ "$tests" -eq 0 ] && [ "$bench" -eq 0 ] || exit 1
