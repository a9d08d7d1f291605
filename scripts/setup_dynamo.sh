#!/usr/bin/env bash
# Installs NVIDIA Dynamo 1.6.1 for the Dynamo checks (tests/dynamo, docs/dynamo.md) into a
# side venv, .venv-dynamo, that sees the vLLM venv (.venv) instead of installing vLLM again:
#   - ai-dynamo==1.6.1 and ai-dynamo-runtime==1.6.1 with --no-deps (never the [vllm] extra:
#     it would pull a CUDA vLLM and torch), plus the one dependency .venv lacks (redis);
#   - a .pth that adds .venv's site-packages (vLLM 0.32, torch CPU, kvcr) after the venv's own;
#   - bin/dynamo-vllm, a launcher (scripts/dynamo/launcher.py) that gives vLLM 0.32's renamed
#     vllm.v1.engine.utils.get_engine_zmq_bind_addresses its old name get_engine_zmq_addresses
#     (what dynamo.vllm 1.6.1 imports), then runs `python -m dynamo.vllm`;
#   - a stub `torchvision` (scripts/dynamo/torchvision_stub.py; only in this venv: PyPI's
#     torchvision fails to load on CPU torch, yet dynamo.vllm imports transformers' vision
#     processors) whose modules and names all import, and raise ImportError when called.
# Idempotent: a stamp of this script skips the work when nothing changed.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
# shellcheck source=venv.sh
source scripts/venv.sh
export PYTHON=${PYTHON:-$root/.venv/bin/python}  # the same Python as .venv (its packages must load)
venv="$root/.venv-dynamo"
vllm_site="$root/.venv/lib/python3.11/site-packages"

if [ ! -d "$vllm_site/vllm" ]; then
  echo "setup-dynamo: $vllm_site has no vLLM: run bash scripts/setup.sh first" >&2
  exit 1
fi
make_venv "$venv" setup-dynamo
want=$(cat scripts/setup_dynamo.sh scripts/dynamo/*.py | sha256sum | cut -d' ' -f1)
done_if_stamped "$venv" "$want" setup-dynamo
echo "setup-dynamo: installing ai-dynamo 1.6.1 into $venv (about 15 s)"
"$venv/bin/python" -m pip install --quiet --disable-pip-version-check --no-deps \
  "ai-dynamo-runtime==1.6.1" "ai-dynamo==1.6.1" "redis>=6.2,<9"

site=$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
# Added after the venv's own site-packages: Dynamo's packages win, vLLM's venv gives the rest.
echo "import site; site.addsitedir('$vllm_site')" > "$site/zz_kvcr_vllm_venv.pth"

mkdir -p "$site/torchvision"
cp scripts/dynamo/torchvision_stub.py "$site/torchvision/__init__.py"
{ echo "#!$venv/bin/python"; cat scripts/dynamo/launcher.py; } > "$venv/bin/dynamo-vllm"
chmod +x "$venv/bin/dynamo-vllm"

"$venv/bin/python" -c 'import dynamo.frontend, dynamo.llm, vllm, torchvision' \
  || { echo "setup-dynamo: the Dynamo venv does not import" >&2; exit 1; }
stamp "$venv" "$want"
echo "setup-dynamo: done ($venv/bin/dynamo-vllm runs a worker, python -m dynamo.frontend the frontend)"
