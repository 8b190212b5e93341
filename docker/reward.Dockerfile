# syntax=docker/dockerfile:1
# Reward image (CPU only). Build from the repository root:
#   docker build -f docker/reward.Dockerfile -t streamrl/reward .
FROM python:3.11-slim

ENV PYTHONUNBUFFERED=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PATH=/opt/venv/bin:$PATH
RUN python -m venv /opt/venv

WORKDIR /src
COPY constraints.txt ./
COPY libs/common libs/common
COPY services/reward services/reward
RUN --mount=type=cache,target=/root/.cache/pip \
    pip install -c constraints.txt ./libs/common ./services/reward

# /app mirrors the repository root: compose mounts recipes/ and the shared runs/ volume here.
# runs/ is created owned by the service user so a fresh named volume inherits that owner; USER is
# numeric so orchestrators can verify that the image does not run as root.
RUN useradd --create-home --uid 1000 --user-group streamrl \
    && mkdir -p /app/runs \
    && chown streamrl:streamrl /app/runs
WORKDIR /app
USER 1000:1000
ENTRYPOINT ["streamrl", "reward"]
