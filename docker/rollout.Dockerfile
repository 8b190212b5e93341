# syntax=docker/dockerfile:1
# Rollout image, CPU: the transformers ("hf") engine on a CPU torch, for laptops and CI. Build from the
# repository root:
#   docker build -f docker/rollout.Dockerfile -t streamrl/rollout .
# The GPU image, vLLM on CUDA, is docker/rollout.gpu.Dockerfile (compose.gpu.yaml). vLLM's CPU build
# is left out: it pins PyTorch's own CPU wheels, which the default index does not carry.
ARG PYTHON_VERSION=3.12
FROM python:${PYTHON_VERSION}-slim

ENV PYTHONUNBUFFERED=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PATH=/opt/venv/bin:$PATH \
    HF_HOME=/cache/huggingface
RUN python -m venv /opt/venv

WORKDIR /src
COPY constraints.txt ./
# torch first, in its own layer. TORCH_VERSION is the one the project is tested with
# (requirements-dev.txt). TORCH_INDEX_URL empty = the default index, whose x86-64 Linux torch also
# carries CUDA libraries (unused here); PyTorch's CPU-only wheel index gives a much smaller image.
ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX_URL=""
RUN --mount=type=cache,target=/root/.cache/pip \
    pip install -c constraints.txt ${TORCH_INDEX_URL:+--extra-index-url "$TORCH_INDEX_URL"} "torch==${TORCH_VERSION}"
# The dependencies that the packages' pyproject.toml files declare, installed from those files alone
# (empty src/ folders), so that editing streamrl code reuses this layer; then the code, --no-deps.
COPY libs/common/pyproject.toml libs/common/
COPY libs/ops/pyproject.toml libs/ops/
COPY libs/torchkit/pyproject.toml libs/torchkit/
COPY services/rollout/pyproject.toml services/rollout/
RUN --mount=type=cache,target=/root/.cache/pip \
    mkdir -p libs/common/src libs/ops/src libs/torchkit/src services/rollout/src \
    && pip install -c constraints.txt ./libs/common ./libs/ops ./libs/torchkit ./services/rollout
COPY libs/common libs/common
COPY libs/ops libs/ops
COPY libs/torchkit libs/torchkit
COPY services/rollout services/rollout
RUN pip install --no-deps --force-reinstall ./libs/common ./libs/ops ./libs/torchkit ./services/rollout

# /app mirrors the repository root: compose mounts recipes/ and the shared runs/ volume here, and the
# Hugging Face cache at /cache/huggingface. Both are created owned by the service user so that fresh
# named volumes inherit that owner; USER is numeric so orchestrators can verify that the image does
# not run as root.
RUN useradd --create-home --uid 1000 --user-group streamrl \
    && mkdir -p /app/runs /cache/huggingface \
    && chown streamrl:streamrl /app/runs /cache/huggingface
WORKDIR /app
USER 1000:1000
ENTRYPOINT ["streamrl", "rollout"]
