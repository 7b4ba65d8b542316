#!/usr/bin/env bash
# Writes deploy/kubernetes/ from `prism deploy kubernetes` and the Helm chart's values
# (deploy/helm/prism/values-*.yaml) from `prism deploy helm` with the same flags (make
# manifests). With --check (make lint): fails where the committed files differ from what it
# writes, validates the manifests against the Kubernetes API schemas (kubernetes-validate,
# offline), lints the chart, and renders it with each values file to the very objects of
# the manifests of the same flags.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
HELM=${HELM:-.venv-checkov/bin/helm}
CHART=deploy/helm/prism
out=deploy/kubernetes
values=$CHART
check=${1:-}
if [ "$check" = --check ]; then
  out=$(mktemp -d)
  values=$out/chart
  trap 'rm -rf "$out"' EXIT
fi
mkdir -p "$out" "$values"

write() {
  local file=$1
  shift
  for what in kubernetes helm; do
    {
      echo "# Written by 'make manifests': prism deploy $what $*"
      $PY -m prism.cli deploy "$what" "$@"
    } >"$([ $what = kubernetes ] && echo "$out/$file" || echo "$values/values-$file")"
  done
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
# E/P/D on GPUs: a real checkpoint on a volume, a GPU for each engine, the planner scaling
# decode between 2 and 4; the image built with TARGET=gpu, tagged with the version.
version=$($PY -c 'from importlib.metadata import version; print(version("prism-mesh"))')
write e-p-d-gpu.yaml --mode e/p/d --image "prism:$version-gpu" --model /models/llava-1.5-7b-hf \
  --model-pvc prism-models --gpus encoder=1 --gpus prefill=1 --gpus decode=1 \
  --replicas decode=2 --planner slo --min-replicas decode=2 --max-replicas decode=4 --routing kv

if [ "$check" = --check ]; then
  for f in "$out"/*.yaml; do
    if ! cmp -s "$f" "deploy/kubernetes/$(basename "$f")"; then
      echo "deploy/kubernetes/$(basename "$f") is stale: run 'make manifests'" >&2
      exit 1
    fi
  done
  if [ "$(ls "$out"/*.yaml | wc -l)" != "$(ls deploy/kubernetes/*.yaml | wc -l)" ]; then
    echo "deploy/kubernetes holds manifests that 'make manifests' does not write" >&2
    exit 1
  fi
  for f in "$values"/*.yaml; do
    if ! cmp -s "$f" "$CHART/$(basename "$f")"; then
      echo "$CHART/$(basename "$f") is stale: run 'make manifests'" >&2
      exit 1
    fi
  done
  if [ "$(ls "$values" | wc -l)" != "$(ls "$CHART"/values-*.yaml | wc -l)" ]; then
    echo "$CHART holds values files that 'make manifests' does not write" >&2
    exit 1
  fi
  .venv/bin/kubernetes-validate --strict --quiet deploy/kubernetes/*.yaml
  chart=$(sed -n 's/^version: //p' "$CHART/Chart.yaml")
  if [ "$chart" != "$version" ]; then
    echo "$CHART/Chart.yaml: version $chart, the package's is $version" >&2
    exit 1
  fi
  for f in "$CHART"/values-*.yaml; do
    mesh=${f##*/values-}
    "$HELM" lint --strict --quiet "$CHART" --namespace prism -f "$f" >/dev/null
    "$HELM" template prism "$CHART" --namespace prism -f "$f" >"$out/helm-$mesh"
    $PY scripts/same_objects.py "$out/helm-$mesh" "deploy/kubernetes/$mesh"
  done
  # The chart's ServiceMonitor option is the generator's --service-monitor.
  $PY -m prism.cli deploy kubernetes --mode e/p/d "${tiny[@]}" --service-monitor >"$out/monitored"
  "$HELM" template prism "$CHART" --namespace prism -f "$CHART/values-e-p-d.yaml" \
    --set serviceMonitor.enabled=true >"$out/helm-monitored"
  $PY scripts/same_objects.py "$out/helm-monitored" "$out/monitored"
  echo "Kubernetes manifests and the Helm chart are current, valid and agree"
fi
