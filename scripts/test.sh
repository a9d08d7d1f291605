#!/usr/bin/env bash
# The README's test command: set up the virtual environments if needed, then run every test
# suite: kvcr-core, -guard, -vllm, -router in .venv (tests/dynamo start Dynamo from
# .venv-dynamo), and kvcr-sglang in .venv-sglang (SGLang needs another torch build than vLLM).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
bash scripts/setup.sh
bash scripts/setup_sglang.sh
bash scripts/setup_deploy.sh  # tests/deploy: hadolint, kubectl, kubernetes-validate, checkov, Prometheus
bash scripts/setup_docs.sh  # tests/docs: MkDocs and the Material theme for the user guide
bash scripts/setup_dynamo.sh  # tests/dynamo: NVIDIA Dynamo 1.6.1 beside .venv's vLLM
export TORCH_EXTENSIONS_DIR="$root/.cache/torch_extensions"  # SGLang's JIT page hash, built once
rc=0
.venv/bin/python -m pytest -n 2 "$@" || rc=$?
.venv-sglang/bin/python -m pytest -n 2 packages/kvcr-sglang/tests "$@" || rc=$((rc ? rc : $?))
exit "$rc"
