#!/usr/bin/env bash
# The README's main command: set up .venv if needed, then run the pool benchmark and print
# its table (the vLLM demo replaces this once kvcr-vllm lands).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
bash scripts/setup.sh
exec .venv/bin/kvcr bench pool --quick "$@"
