#!/usr/bin/env bash
# Fails when the committed stubs (prism/v1, prism/stage/v1, prism/kserve) differ from what `make protos`
# generates.
set -euo pipefail
cd "$(dirname "$0")/.."
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
for dir in prism/v1 prism/stage/v1 prism/kserve; do
  .venv/bin/python -m grpc_tools.protoc -Iprotos --python_out="$tmp" --pyi_out="$tmp" \
    --grpc_python_out="$tmp" protos/$dir/*.proto
  for f in "$tmp/$dir"/*; do
    if ! cmp -s "$f" "$dir/$(basename "$f")"; then
      echo "$dir/$(basename "$f") is stale: run 'make protos'" >&2
      exit 1
    fi
  done
  n_generated=$(ls "$tmp/$dir" | wc -l)
  n_committed=$(ls "$dir" | grep -c '_pb2' || true)
  if [ "$n_generated" != "$n_committed" ]; then
    echo "$dir holds stubs that no proto generates: run 'make protos'" >&2
    exit 1
  fi
done
echo "protobuf stubs are current"
