#!/usr/bin/env bash
# Fails when the committed stubs in prism/v1 differ from what `make protos` generates.
set -euo pipefail
cd "$(dirname "$0")/.."
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
.venv/bin/python -m grpc_tools.protoc -Iprotos --python_out="$tmp" --pyi_out="$tmp" \
  --grpc_python_out="$tmp" protos/prism/v1/*.proto
for f in "$tmp"/prism/v1/*; do
  if ! cmp -s "$f" "prism/v1/$(basename "$f")"; then
    echo "prism/v1/$(basename "$f") is stale: run 'make protos'" >&2
    exit 1
  fi
done
n_generated=$(ls "$tmp"/prism/v1 | wc -l)
n_committed=$(ls prism/v1 | grep -c '_pb2' || true)
if [ "$n_generated" != "$n_committed" ]; then
  echo "prism/v1 holds stubs that no proto generates: run 'make protos'" >&2
  exit 1
fi
echo "protobuf stubs are current"
