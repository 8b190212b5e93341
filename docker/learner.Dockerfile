# syntax=docker/dockerfile:1
# Learner image, CPU: DeepSpeed on a CPU torch (gloo). Compose also runs the one-shot `prepare` job in
# it (examples/ below). Build from the repository root:
#   docker build -f docker/learner.Dockerfile -t streamrl/learner .
# The CUDA variant is docker/learner.gpu.Dockerfile (compose.gpu.yaml).
ARG PYTHON_VERSION=3.12
FROM python:${PYTHON_VERSION}-slim

ENV PYTHONUNBUFFERED=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PATH=/opt/venv/bin:$PATH \
    HF_HOME=/cache/huggingface \
    TORCH_EXTENSIONS_DIR=/app/runs/.cache/torch_extensions
# g++ builds DeepSpeed's shared-memory op below, and any op or torch.compile kernel built at run time
# (into TORCH_EXTENSIONS_DIR, on the runs volume, writable by the service user).
RUN apt-get update \
    && apt-get install -y --no-install-recommends g++ \
    && rm -rf /var/lib/apt/lists/* \
    && python -m venv /opt/venv

WORKDIR /src
COPY constraints.txt ./
# torch first, in its own layer. TORCH_VERSION is the one the project is tested with
# (requirements-dev.txt). TORCH_INDEX_URL empty = the default index, whose x86-64 Linux torch also
# carries CUDA libraries (unused here); PyTorch's CPU-only wheel index gives a much smaller image.
ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX_URL=""
RUN --mount=type=cache,target=/root/.cache/pip \
    pip install -c constraints.txt setuptools wheel ninja \
    && pip install -c constraints.txt ${TORCH_INDEX_URL:+--extra-index-url "$TORCH_INDEX_URL"} "torch==${TORCH_VERSION}"
# DeepSpeed's setup imports torch: no build isolation. Its shared-memory op is built now (the first
# init_distributed would otherwise JIT-build it, ~50 s); every other op is left to the JIT. No pip
# cache: a cached DeepSpeed wheel built with other DS_BUILD_* settings would be reused as is.
RUN DS_BUILD_OPS=0 DS_BUILD_SHM_COMM=1 pip install --no-cache-dir --no-build-isolation -c constraints.txt deepspeed
# The dependencies that the packages' pyproject.toml files declare, installed from those files alone
# (empty src/ folders), so that editing streamrl code reuses this layer; then the code, --no-deps.
COPY libs/common/pyproject.toml libs/common/
COPY libs/ops/pyproject.toml libs/ops/
COPY libs/torchkit/pyproject.toml libs/torchkit/
COPY services/learner/pyproject.toml services/learner/
RUN --mount=type=cache,target=/root/.cache/pip \
    mkdir -p libs/common/src libs/ops/src libs/torchkit/src services/learner/src \
    && pip install -c constraints.txt ./libs/common ./libs/ops ./libs/torchkit ./services/learner
COPY libs/common libs/common
COPY libs/ops libs/ops
COPY libs/torchkit libs/torchkit
COPY services/learner services/learner
RUN pip install --no-deps --force-reinstall ./libs/common ./libs/ops ./libs/torchkit ./services/learner

# The demo task and its preparation script (examples/arithmetic/prepare.py), relative to /app.
COPY examples /app/examples
# /app mirrors the repository root: compose mounts recipes/ and the shared runs/ volume here, and the
# Hugging Face cache at /cache/huggingface. Both are created owned by the service user so that fresh
# named volumes inherit that owner; USER is numeric so orchestrators can verify that the image does
# not run as root.
RUN useradd --create-home --uid 1000 --user-group streamrl \
    && mkdir -p /app/runs /cache/huggingface \
    && chown streamrl:streamrl /app/runs /cache/huggingface
WORKDIR /app
USER 1000:1000
ENTRYPOINT ["streamrl", "learner"]
