#!/usr/bin/env bash
# checkov on the deployment files (make lint): deploy/kubernetes/, the Dockerfile and
# compose.yaml must pass with no failed check; every check skipped is named and justified
# where it applies (checkov.io/skipN annotations, written by prism.ops.deploy.security). checkov
# runs from a virtualenv of its own, made here when missing (--setup: only that), since its
# dependencies would fight vLLM's in .venv. PYTHON picks its interpreter.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${CHECKOV_VENV:-.venv-checkov}
VERSION=3.3.30
if [ "$("$VENV/bin/checkov" --version 2>/dev/null)" != "$VERSION" ]; then
  "${PYTHON:-python3.11}" -m venv "$VENV"
  "$VENV/bin/python" -m pip install --quiet --disable-pip-version-check "checkov==$VERSION"
fi
[ "${1:-}" = --setup ] && exit 0

# --skip-download: the checks as installed, nothing fetched.
checkov() { "$VENV/bin/checkov" --quiet --compact --skip-download "$@"; }
checkov --framework kubernetes -d deploy/kubernetes
checkov --framework dockerfile -f Dockerfile
# checkov has no Compose framework: of its scans only the secrets one reads compose.yaml
# (tests/unit/test_compose.py asserts its hardening).
checkov -f compose.yaml
