#!/usr/bin/env bash
# What `make bench-planner-dynamo` needs beyond the anchors (scripts/bench_anchors.sh):
# the modules NVIDIA Dynamo's planner imports but its wheel does not declare, in
# .anchors/dynamo, and etcd, where the planner publishes its decisions (the bench starts
# an etcd of its own on free loopback ports; the system's is not used). Its AISimulate
# SDK, fetched only from NVIDIA's own index, is replaced by a stand-in the bench writes
# (load mode calls none of it). Idempotent.
set -euo pipefail
cd "$(dirname "$0")/.."

scripts/bench_anchors.sh
VENV=.anchors/dynamo
if [ ! -f "$VENV/.planner-complete" ]; then
  "$VENV/bin/python" -m pip install --quiet scikit-learn pandas plotly prometheus-api-client \
    pmdarima prophet filterpy "kubernetes>=32.0.1,<33"
  "$VENV/bin/python" -c "import sklearn, pandas, plotly, prometheus_api_client, pmdarima, prophet, filterpy, kubernetes"
  touch "$VENV/.planner-complete"
fi
if ! command -v etcd >/dev/null; then
  echo "etcd is not installed: run \`sudo apt-get install etcd-server\` (etcd 3.4), then again" >&2
  exit 1
fi
echo "Dynamo's planner installed in $VENV; $(etcd --version | head -1)"
