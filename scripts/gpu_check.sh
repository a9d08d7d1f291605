#!/usr/bin/env bash
# kvcr's GPU checks with torch alone (no vLLM, no SGLang): the CUDA copy-engine tests and
# `kvcr bench copy --device cuda` (run as `python -m kvcr_bench.device_copy`, so no kvcr
# install and no entry point is needed). For a GPU machine with a CUDA build of torch and
# pytest; kvcr's packages come from this checkout through PYTHONPATH. kvcr-core's own small
# dependencies must be importable too: where one is missing and the machine has no package
# index, put its wheel in .whl/ and the script installs it into a temporary folder, e.g. from
# a machine with an index, for the GPU machine's Python (3.12 here):
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 \
#       --implementation cp --platform manylinux_2_17_x86_64 -d .whl msgspec
#
# Usage: bash scripts/gpu_check.sh [OUT_DIR]
#   OUT_DIR (default: $OUT, else ./gpu-check) receives pytest.log and bench-copy.json.
# Exit status: 0 when the tests passed and the bench ran with every copy checked; 2 when a
# package is missing; 3 when torch sees no CUDA device (the tests then skip, the bench refuses).
set -uo pipefail
cd "$(dirname "$0")/.."
out=${1:-${OUT:-gpu-check}}
mkdir -p "$out"
py=${PYTHON:-python3}
PYTHONPATH="$(ls -d "$PWD"/packages/*/src | paste -sd:)${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONPATH PYTHONUNBUFFERED=1

missing() {
    "$py" -c 'import importlib.util as u
need = ["torch", "pytest", "pytest_timeout", "msgspec", "prometheus_client", "yaml", "xxhash"]
print(" ".join(n for n in need if u.find_spec(n) is None))'
}
lacking=$(missing)
if [ -n "$lacking" ] && compgen -G ".whl/*.whl" >/dev/null; then
    site=$(mktemp -d)
    "$py" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$site" \
        .whl/*.whl
    export PYTHONPATH="$PYTHONPATH:$site"
    lacking=$(missing)
fi
if [ -n "$lacking" ]; then
    echo "gpu_check: missing Python packages: $lacking (see this script's header)" >&2
    exit 2
fi

"$py" -c 'import torch
print("torch", torch.__version__, "cuda", torch.version.cuda,
      torch.cuda.get_device_name() if torch.cuda.is_available() else "NO CUDA DEVICE")'
status=0
"$py" -m pytest -q -rs -p no:cacheprovider \
    packages/kvcr-core/tests/test_copy_engine_cuda.py \
    packages/kvcr-core/tests/test_copy_engine.py \
    packages/kvcr-bench/tests/test_bench_copy.py 2>&1 | tee "$out/pytest.log" || status=1
"$py" -m kvcr_bench.device_copy --device cuda --json >"$out/bench-copy.json"
bench=$?
cat "$out/bench-copy.json"
if [ "$bench" -eq 2 ]; then
    exit 3  # no CUDA device: the bench said so on stderr
fi
[ "$bench" -eq 0 ] || status=1
exit "$status"
