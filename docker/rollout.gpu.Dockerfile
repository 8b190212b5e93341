# syntax=docker/dockerfile:1
# Rollout image, GPU: vLLM on CUDA (the streamrl-rollout[vllm] extra). Build from the repository root:
#   docker build -f docker/rollout.gpu.Dockerfile -t streamrl/rollout:gpu .
# torch and vLLM bring their own CUDA libraries as wheels; the base image supplies the container's
# CUDA plumbing, and the host needs an NVIDIA driver recent enough for torch's CUDA version.
ARG CUDA_VERSION=13.2.0
FROM nvidia/cuda:${CUDA_VERSION}-base-ubuntu24.04

ENV DEBIAN_FRONTEND=noninteractive \
    PYTHONUNBUFFERED=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PATH=/opt/venv/bin:$PATH \
    HF_HOME=/cache/huggingface
# Ubuntu 24.04's own Python is 3.12. gcc and the Python headers stay in the image because Triton
# compiles small launcher modules at run time.
RUN apt-get update \
    && apt-get install -y --no-install-recommends ca-certificates python3.12 python3.12-dev python3.12-venv gcc libc6-dev \
    && rm -rf /var/lib/apt/lists/* \
    && python3.12 -m venv /opt/venv

WORKDIR /src
COPY constraints.txt ./
# The dependencies that the packages' pyproject.toml files declare, with the vllm extra (vLLM and the
# CUDA torch it pins), installed from those files alone (empty src/ folders), so that editing
# streamrl code reuses this heavy layer; then the code, --no-deps. VLLM_VERSION pins the extra's
# vLLM: 0.33.0 pins torch 2.14.0, the torch of the learner and reward GPU images. `pip show` fails
# the build if the extra brought no vLLM.
ARG VLLM_VERSION=0.33.0
COPY libs/common/pyproject.toml libs/common/
COPY libs/ops/pyproject.toml libs/ops/
COPY libs/torchkit/pyproject.toml libs/torchkit/
COPY services/rollout/pyproject.toml services/rollout/
RUN --mount=type=cache,target=/root/.cache/pip \
    mkdir -p libs/common/src libs/ops/src libs/torchkit/src services/rollout/src \
    && pip install -c constraints.txt ./libs/common ./libs/ops ./libs/torchkit "./services/rollout[vllm]" "vllm==${VLLM_VERSION}" \
    && pip show vllm >/dev/null
COPY libs/common libs/common
COPY libs/ops libs/ops
COPY libs/torchkit libs/torchkit
COPY services/rollout services/rollout
RUN pip install --no-deps --force-reinstall ./libs/common ./libs/ops ./libs/torchkit ./services/rollout

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
ENTRYPOINT ["streamrl", "rollout"]
