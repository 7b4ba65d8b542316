#!/usr/bin/env bash
# Writes deploy/kubernetes/ from `prism deploy kubernetes` (make manifests). With --check
# (make lint): fails where the committed manifests differ from what it writes, and
# validates them against the Kubernetes API schemas (kubernetes-validate, offline).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
out=deploy/kubernetes
check=${1:-}
if [ "$check" = --check ]; then
  out=$(mktemp -d)
  trap 'rm -rf "$out"' EXIT
fi
mkdir -p "$out"

write() {
  local file=$1
  shift
  {
    echo "# Written by 'make manifests': prism deploy kubernetes $*"
    $PY -m prism.cli deploy kubernetes "$@"
  } >"$out/$file"
}

# The four modes on the tiny model (CPU): each pod builds it before it starts.
tiny=(--model /models/tiny-llava --tiny-model llava)
write epd.yaml --mode epd "${tiny[@]}"
write e-pd.yaml --mode e/pd "${tiny[@]}"
write e-p-d.yaml --mode e/p/d "${tiny[@]}"
write ep-d.yaml --mode ep/d "${tiny[@]}"
# The same without Consul: stages find each other through the API server.
write e-p-d-no-consul.yaml --mode e/p/d --discovery kubernetes "${tiny[@]}"
# The gRPC hops through Consul Connect sidecars (consul-k8s injects them).
write e-p-d-connect.yaml --mode e/p/d --discovery connect "${tiny[@]}"
# With the planner: it sets the replicas of the encoder, prefill and decode.
write e-p-d-planner.yaml --mode e/p/d --planner slo "${tiny[@]}"
# E/P/D on GPUs: a real checkpoint on a volume, a GPU for each engine, decode autoscaled;
# the image built with TARGET=gpu, tagged with the version.
version=$($PY -c 'from importlib.metadata import version; print(version("prism-mesh"))')
write e-p-d-gpu.yaml --mode e/p/d --image "prism:$version-gpu" --model /models/llava-1.5-7b-hf \
  --model-pvc prism-models --gpus encoder=1 --gpus prefill=1 --gpus decode=1 \
  --replicas decode=2 --autoscale decode=4 --routing kv

if [ "$check" = --check ]; then
  for f in "$out"/*.yaml; do
    if ! cmp -s "$f" "deploy/kubernetes/$(basename "$f")"; then
      echo "deploy/kubernetes/$(basename "$f") is stale: run 'make manifests'" >&2
      exit 1
    fi
  done
  if [ "$(ls "$out" | wc -l)" != "$(ls deploy/kubernetes/*.yaml | wc -l)" ]; then
    echo "deploy/kubernetes holds manifests that 'make manifests' does not write" >&2
    exit 1
  fi
  .venv/bin/kubernetes-validate --strict --quiet deploy/kubernetes/*.yaml
  echo "Kubernetes manifests are current and valid"
fi
