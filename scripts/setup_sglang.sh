#!/usr/bin/env bash
# Creates .venv-sglang: a lean SGLang 0.5.23 environment (CPU torch 2.13 from the local wheel
# folder, sglang without its CUDA dependencies, the small
# packages its mem_cache modules import) plus kvcr-core, kvcr-guard, kvcr-sglang and
# kvcr-bench (the SGLang rig of the tests, `kvcr bench sglang`) editable.
# SGLang cannot serve on CPU; this venv drives its real storage/linker classes. Idempotent.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
# shellcheck source=venv.sh
source scripts/venv.sh
venv="$root/.venv-sglang"
pip=("$venv/bin/python" -m pip install --quiet --disable-pip-version-check)

make_venv "$venv" setup-sglang

# The JIT page-hash extension needs g++, OpenSSL headers and ninja.
if ! command -v g++ >/dev/null || ! command -v ninja >/dev/null || \
   [ ! -f /usr/include/openssl/sha.h ]; then
  echo "setup-sglang: installing g++, libssl-dev, ninja-build"
  apt-get update -qq && apt-get install -y -qq g++ libssl-dev ninja-build >/dev/null
fi

if ! "$venv/bin/python" -c "import sglang, torch" >/dev/null 2>&1; then
  echo "setup-sglang: installing torch 2.13.0+cpu and sglang 0.5.23 (lean, about 2 minutes)"
  "${pip[@]}" "torch==2.13.0+cpu"
  "${pip[@]}" --no-deps "sglang==0.5.23"
  "${pip[@]}" numpy orjson psutil pybase64 requests packaging pillow starlette msgspec \
    pydantic pyzmq tqdm IPython aiohttp "transformers==5.19.0" dill "apache-tvm-ffi==0.1.11" \
    "sentencepiece==0.2.1" "compressed-tensors==0.18.0" gguf "triton==3.8.0" \
    "tokenizers==0.23.2" ninja pytest pytest-timeout pytest-xdist
fi

# CPU-test shim for torchvision (SGLang imports it eagerly; PyPI's needs CUDA torch).
site=$("$venv/bin/python" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
echo "$root/packages/kvcr-sglang/tests/cpu_shims" > "$site/kvcr-cpu-shims.pth"

want=$(cat scripts/setup_sglang.sh packages/kvcr-{core,guard,sglang,bench}/pyproject.toml \
  | sha256sum | cut -d' ' -f1)
done_if_stamped "$venv" "$want" setup-sglang
echo "setup-sglang: installing kvcr packages (editable) into $venv"
"${pip[@]}" -e "packages/kvcr-core[test]" -e packages/kvcr-guard -e packages/kvcr-sglang \
  -e packages/kvcr-bench
stamp "$venv" "$want"
echo "setup-sglang: done"
