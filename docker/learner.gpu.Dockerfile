# syntax=docker/dockerfile:1
# Learner image, GPU: CUDA toolkit + CUDA torch + DeepSpeed. Compose also runs the one-shot `prepare`
# job in it (examples/ below). Build from the repository root:
#   docker build -f docker/learner.gpu.Dockerfile -t streamrl/learner:gpu .
# A devel base because DeepSpeed JIT-compiles its CUDA ops (FusedAdam, ...) on first use with this
# nvcc, whose major version must match torch's CUDA. Leave TORCH_CUDA_ARCH_LIST unset to compile for
# the GPUs present; if you set it, use plain numbers ("9.0"): DeepSpeed's builder cannot parse names
# such as "9.0a".
ARG CUDA_VERSION=13.2.0
FROM nvidia/cuda:${CUDA_VERSION}-devel-ubuntu24.04

ENV DEBIAN_FRONTEND=noninteractive \
    PYTHONUNBUFFERED=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PATH=/opt/venv/bin:$PATH \
    HF_HOME=/cache/huggingface \
    TORCH_EXTENSIONS_DIR=/app/runs/.cache/torch_extensions
# Ubuntu 24.04's own Python is 3.12. g++ and the Python headers are needed by the JIT builds of
# DeepSpeed ops, Triton and torch.compile.
RUN apt-get update \
    && apt-get install -y --no-install-recommends ca-certificates python3.12 python3.12-dev python3.12-venv g++ \
    && rm -rf /var/lib/apt/lists/* \
    && python3.12 -m venv /opt/venv

WORKDIR /src
COPY constraints.txt ./
# The CUDA torch that vLLM pins in the rollout GPU image: one torch (and NCCL) on both ends of the
# weight path. TORCH_INDEX_URL empty = the default index and its default CUDA build; point it at
# another of PyTorch's CUDA wheel indexes to match an older driver.
ARG TORCH_VERSION=2.14.0
ARG TORCH_INDEX_URL=""
RUN --mount=type=cache,target=/root/.cache/pip \
    pip install -c constraints.txt setuptools wheel ninja \
    && pip install -c constraints.txt ${TORCH_INDEX_URL:+--extra-index-url "$TORCH_INDEX_URL"} "torch==${TORCH_VERSION}"
# DeepSpeed's setup imports torch: no build isolation. DS_BUILD_OPS=0 defers its ops to the run-time
# JIT build described at the top. No pip cache: a cached DeepSpeed wheel built with other DS_BUILD_*
# settings would be reused as is.
RUN DS_BUILD_OPS=0 pip install --no-cache-dir --no-build-isolation -c constraints.txt deepspeed
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
# not run as root. Ubuntu's own user 1000 ("ubuntu") makes way for it.
RUN if id -u ubuntu >/dev/null 2>&1; then userdel ubuntu && rm -rf /home/ubuntu; fi \
    && useradd --create-home --uid 1000 --user-group streamrl \
    && mkdir -p /app/runs /cache/huggingface \
    && chown streamrl:streamrl /app/runs /cache/huggingface
WORKDIR /app
USER 1000:1000
ENTRYPOINT ["streamrl", "learner"]
