# syntax=docker/dockerfile:1
# Coordinator image (CPU only). Build from the repository root:
#   docker build -f docker/coordinator.Dockerfile -t streamrl/coordinator .
FROM python:3.11-slim

ENV PYTHONUNBUFFERED=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PATH=/opt/venv/bin:$PATH
RUN python -m venv /opt/venv

WORKDIR /src
COPY constraints.txt ./
COPY libs/common libs/common
COPY services/coordinator services/coordinator
RUN --mount=type=cache,target=/root/.cache/pip \
    pip install -c constraints.txt ./libs/common ./services/coordinator

# /app mirrors the repository root: compose mounts recipes/ and the shared runs/ volume here.
# runs/ is created owned by the service user so a fresh named volume inherits that owner; USER is
# numeric so orchestrators can verify that the image does not run as root.
RUN useradd --create-home --uid 1000 --user-group streamrl \
    && mkdir -p /app/runs \
    && chown streamrl:streamrl /app/runs
WORKDIR /app
USER 1000:1000
ENTRYPOINT ["streamrl", "coordinator"]
