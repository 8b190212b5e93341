# syntax=docker/dockerfile:1
# Coordinator image (CPU only; it tokenizes prompts, no torch). Build from the repository root:
#   docker build -f docker/coordinator.Dockerfile -t streamrl/coordinator .
ARG PYTHON_VERSION=3.12
FROM python:${PYTHON_VERSION}-slim

ENV PYTHONUNBUFFERED=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PATH=/opt/venv/bin:$PATH \
    HF_HOME=/cache/huggingface
RUN python -m venv /opt/venv

WORKDIR /src
COPY constraints.txt ./
# The dependencies that the packages' pyproject.toml files declare, installed from those files alone
# (empty src/ folders), so that editing streamrl code reuses this layer; then the code, --no-deps.
COPY libs/common/pyproject.toml libs/common/
COPY libs/ops/pyproject.toml libs/ops/
COPY services/coordinator/pyproject.toml services/coordinator/
RUN --mount=type=cache,target=/root/.cache/pip \
    mkdir -p libs/common/src libs/ops/src services/coordinator/src \
    && pip install -c constraints.txt ./libs/common ./libs/ops ./services/coordinator
COPY libs/common libs/common
COPY libs/ops libs/ops
COPY services/coordinator services/coordinator
RUN pip install --no-deps --force-reinstall ./libs/common ./libs/ops ./services/coordinator

# /app mirrors the repository root: compose mounts recipes/ and the shared runs/ volume here, and the
# Hugging Face cache at /cache/huggingface; compose's one-shot `redis-acl` (this image) writes the Redis
# ACL file into /acl. All are created owned by the service user so that fresh named volumes inherit
# that owner; USER is numeric so orchestrators can verify that the image does not run as root.
RUN useradd --create-home --uid 1000 --user-group streamrl \
    && mkdir -p /app/runs /cache/huggingface /acl \
    && chown streamrl:streamrl /app/runs /cache/huggingface /acl
WORKDIR /app
USER 1000:1000
ENTRYPOINT ["streamrl", "coordinator"]
