#!/usr/bin/env bash
# Fails when the committed stubs (prism/proto/) differ from what `make protos` generates.
set -euo pipefail
cd "$(dirname "$0")/.."
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
scripts/protos.sh "$tmp/proto"
if ! diff -r -q -x __pycache__ "$tmp/proto" prism/proto >&2; then
  echo "prism/proto/ is stale: run 'make protos'" >&2
  exit 1
fi
echo "protobuf stubs are current"
