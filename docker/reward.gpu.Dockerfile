# syntax=docker/dockerfile:1
# Reward image, GPU: model scorers and `streamrl serve-rm` on a CUDA torch (reward functions and HTTP
# verifiers need no GPU). Build from the repository root:
#   docker build -f docker/reward.gpu.Dockerfile -t streamrl/reward:gpu .
# torch brings its own CUDA libraries as wheels; the base image supplies the container's CUDA plumbing.
ARG CUDA_VERSION=13.2.0
FROM nvidia/cuda:${CUDA_VERSION}-base-ubuntu24.04

ENV DEBIAN_FRONTEND=noninteractive \
    PYTHONUNBUFFERED=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PATH=/opt/venv/bin:$PATH \
    HF_HOME=/cache/huggingface
# Ubuntu 24.04's own Python is 3.12.
RUN apt-get update \
    && apt-get install -y --no-install-recommends ca-certificates python3.12 python3.12-venv \
    && rm -rf /var/lib/apt/lists/* \
    && python3.12 -m venv /opt/venv

WORKDIR /src
COPY constraints.txt ./
# The same CUDA torch as the learner and rollout GPU images, in its own layer.
ARG TORCH_VERSION=2.14.0
ARG TORCH_INDEX_URL=""
RUN --mount=type=cache,target=/root/.cache/pip \
    pip install -c constraints.txt ${TORCH_INDEX_URL:+--extra-index-url "$TORCH_INDEX_URL"} "torch==${TORCH_VERSION}"
# The dependencies that the packages' pyproject.toml files declare, with the model extra (torch,
# transformers: model scorers and serve-rm), installed from those files alone (empty src/ folders),
# so that editing streamrl code reuses this layer; then the code, --no-deps. `pip show` fails the
# build if the extra brought no transformers.
COPY libs/common/pyproject.toml libs/common/
COPY libs/ops/pyproject.toml libs/ops/
COPY services/reward/pyproject.toml services/reward/
RUN --mount=type=cache,target=/root/.cache/pip \
    mkdir -p libs/common/src libs/ops/src services/reward/src \
    && pip install -c constraints.txt ./libs/common ./libs/ops "./services/reward[model]" \
    && pip show transformers >/dev/null
COPY libs/common libs/common
COPY libs/ops libs/ops
COPY services/reward services/reward
RUN pip install --no-deps --force-reinstall ./libs/common ./libs/ops ./services/reward

# Reward functions that recipes name by path (examples/arithmetic/task.py), relative to /app.
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
ENTRYPOINT ["streamrl", "reward"]
