#!/usr/bin/env bash
# Generates the Python stubs of protos/prism/{v1,stage/v1,kserve} into prism/proto/ (or into
# the folder given), apart from the hand-written code. The descriptors keep their file names
# (prism/v1/common.proto, ...): only the generated Python imports move under prism.proto.
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-prism/proto}
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
.venv/bin/python -m grpc_tools.protoc -Iprotos --python_out="$tmp" --pyi_out="$tmp" \
  --grpc_python_out="$tmp" protos/prism/v1/*.proto protos/prism/stage/v1/*.proto \
  protos/prism/kserve/*.proto
# protoc names a dependency's module after its .proto path (prism/v1/common.proto ->
# prism.v1.common_pb2), and no protoc option places it elsewhere; protoletariat, which
# rewrites such imports, requires protobuf < 6. google.protobuf's imports stay as they are.
find "$tmp/prism" -name '*_pb2*.py*' -exec sed -i -E 's/^from prism\./from prism.proto./' {} +
rm -rf "$out"
mkdir -p "$out"
cp -r "$tmp/prism/." "$out/"
touch "$out/__init__.py" "$out/stage/__init__.py" "$out/v1/__init__.py" \
  "$out/stage/v1/__init__.py" "$out/kserve/__init__.py"
