#!/usr/bin/env bash
# The README's test command: set up .venv if needed, then run every test suite.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
bash scripts/setup.sh
exec .venv/bin/python -m pytest -n 2 "$@"
