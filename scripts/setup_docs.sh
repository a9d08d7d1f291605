#!/usr/bin/env bash
# Installs the documentation tools into .venv-docs: MkDocs with the Material theme (pinned),
# which builds the site from docs/ (`mkdocs build --strict`, run by tests/docs). A venv of its
# own keeps MkDocs' dependencies out of vLLM's .venv. Idempotent: a stamp of this script skips
# the pip step when nothing changed.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
# shellcheck source=venv.sh
source scripts/venv.sh
venv="$root/.venv-docs"

make_venv "$venv" setup-docs
want=$(sha256sum scripts/setup_docs.sh | cut -d' ' -f1)
done_if_stamped "$venv" "$want" setup-docs
echo "setup-docs: installing MkDocs and the Material theme into $venv (about 20 s)"
"$venv/bin/python" -m pip install --quiet --disable-pip-version-check \
  "mkdocs==1.6.1" "mkdocs-material==9.8.2" "pymdown-extensions==13.1.2"
stamp "$venv" "$want"
echo "setup-docs: done"
