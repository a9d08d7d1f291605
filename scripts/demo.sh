#!/usr/bin/env bash
# The README's main command: set up .venv if needed (vLLM for CPU included), then run the
# demo: kvcr-guard and two vLLM OpenAI servers on the local model, a multi-user multi-turn
# workload alternating between them, with and without kvcr; prints TTFT and reuse per
# request and writes .cache/demo/ttft.png. Extra arguments go to the demo (--quick).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
bash scripts/setup.sh
exec .venv/bin/python -m kvcr_bench.demo "$@"
