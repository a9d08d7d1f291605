#!/usr/bin/env bash
# The README's test command: set up the virtual environments if needed, then run every test
# suite: kvcr-core, -guard, -vllm, -router in .venv (tests/dynamo start Dynamo from
# .venv-dynamo), and kvcr-sglang in .venv-sglang (SGLang needs another torch build than vLLM).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
# Two lanes at once (on a fresh machine, each spends much of its time on I/O): .venv then
# Dynamo's beside it; SGLang's, then deploy's and docs'. The two scripts that use apt are in
# the same lane (dpkg takes one lock).
side_log=$(mktemp)
{
  bash scripts/setup_sglang.sh
  bash scripts/setup_deploy.sh  # tests/deploy: hadolint, kubectl, kubernetes-validate, checkov, Prometheus
  bash scripts/setup_docs.sh  # tests/docs: MkDocs and the Material theme for the user guide
} > "$side_log" 2>&1 &
side=$!
main_rc=0
{ bash scripts/setup.sh && bash scripts/setup_dynamo.sh; } || main_rc=$?  # tests/dynamo: Dynamo 1.6.1
side_rc=0
wait "$side" || side_rc=$?
cat "$side_log"
rm -f "$side_log"
if [ "$main_rc" -ne 0 ] || [ "$side_rc" -ne 0 ]; then
  echo "test.sh: setting up the environments failed (see above)" >&2
  exit 1
fi
export TORCH_EXTENSIONS_DIR="$root/.cache/torch_extensions"  # SGLang's JIT page hash, built once
rc=0
.venv/bin/python -m pytest -n 2 "$@" || rc=$?
.venv-sglang/bin/python -m pytest -n 2 packages/kvcr-sglang/tests "$@" || rc=$((rc ? rc : $?))
exit "$rc"
