#!/usr/bin/env bash
# Build the vLLM kit for a GPU machine with no package index whose image has torch 2.11 (CUDA 13),
# as the GPU machine here: vllm==0.25.0 (the release that pins exactly torch 2.11.0) trimmed of what
# a Hopper GPU serving dense models does not load, plus every wheel it needs that the image lacks
# (scripts/gpu_kit_deps.py over its Requires-Dist, less the heavy optional GPU packages in SKIP),
# packed as one tar.xz and split into parts small enough for one device call each.
#   scripts/gpu_vllm_kit.sh [PART_MIB]       (default 55: a part and a checkout under 9 MiB fit one 64 MiB call)
# Layout (gitignored .vllmkit/):
#   dl/         the downloaded vllm wheel (~250 MB)
#   wheels/     the trimmed vllm wheel (stored, not deflated: xz packs it better) and its dependencies
#   parts/part1, part2, ...   the split vllm-kit.tar.xz;  parts/SHA256SUMS
# Trimmed from the vllm wheel (and from its RECORD): FlashAttention 2 (sm80; Hopper runs FA3), the
# fused-MoE kernels (dense models), DeepGEMM and the sm100 (Blackwell) attention sources, the Rust
# serving frontend (vllm-rs). Installed there by scripts/gpu_vllm_install.sh.
set -euo pipefail
cd "$(dirname "$0")/.."
PART_MIB=${1:-55}
KIT=.vllmkit
PY=${PYTHON:-python3}
VLLM=0.25.0
mkdir -p "$KIT/dl" "$KIT/wheels" "$KIT/parts"

if ! compgen -G "$KIT/dl/vllm-$VLLM-*.whl" >/dev/null; then
  "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 -d "$KIT/dl" "vllm==$VLLM"
fi
source=$(ls "$KIT"/dl/vllm-$VLLM-*.whl)
trimmed=$KIT/wheels/$(basename "$source")
if [ ! -f "$trimmed" ]; then
  echo "gpu_vllm_kit: trimming $(basename "$source")"
  "$PY" - "$source" "$trimmed" <<'EOF'
import sys, zipfile

DROP = ("vllm/vllm_flash_attn/_vllm_fa2_C", "vllm/_moe_C", "vllm/third_party/deep_gemm/", "vllm/third_party/fmha_sm100/",
        "vllm/vllm-rs")
source, target = sys.argv[1:]
kept = dropped = 0
with zipfile.ZipFile(source) as src, zipfile.ZipFile(target, "w", zipfile.ZIP_STORED) as out:
    for info in src.infolist():
        if info.filename.startswith(DROP):
            dropped += info.file_size
            continue
        data = src.read(info)
        if info.filename.endswith(".dist-info/RECORD"):
            lines = data.decode().splitlines()
            data = ("\n".join(l for l in lines if not l.startswith(DROP)) + "\n").encode()
        out.writestr(info, data, compress_type=zipfile.ZIP_STORED)
        kept += info.file_size
print(f"gpu_vllm_kit: kept {kept / 1e6:.0f} MB, dropped {dropped / 1e6:.0f} MB")
EOF
fi

# Its dependencies that the image lacks; the heavy optional GPU packages are left out (SKIP): vLLM
# imports them only for the features they serve (FlashInfer sampling/attention, TileLang, CUTLASS
# DSL, DeepGEMM, video decoding, ...). Run with VLLM_USE_FLASHINFER_SAMPLER=0 VLLM_USE_DEEP_GEMM=0.
SKIP=(flashinfer-python flashinfer-cubin apache-tvm-ffi tilelang nvidia-cudnn-frontend nvtx fastsafetensors
      nvidia-cutlass-dsl quack-kernels tokenspeed-mla humming-kernels torchcodec pynvvideocodec torch torchaudio
      torchvision numba xgrammar mcp anthropic model-hosting-container-standards opencv-python-headless)
roots=$(unzip -p "$source" '*.dist-info/METADATA' | sed -n 's/^Requires-Dist: //p' | grep -v 'extra ==' \
  | sed 's/^fastapi\[standard\]/fastapi/; s/^mistral_common\[image\]/mistral_common/')
image=$(mktemp)
trap 'rm -f "$image"' EXIT
{ cat scripts/gpu_image_packages.txt; printf '%s\n' "${SKIP[@]}"; } >"$image"
mapfile -t root_list <<<"$roots"
"$PY" scripts/gpu_kit_deps.py --wheels "$KIT/wheels" --image "$image" --constraints /dev/null --keep vllm \
  "${root_list[@]}" pydantic msgspec pyzmq redis >"$KIT/carried.txt"
echo "gpu_vllm_kit: $(wc -l <"$KIT/carried.txt") dependency wheels: $(tr '\n' ' ' <"$KIT/carried.txt")"

rm -f "$KIT"/parts/*
tar -C "$KIT/wheels" -cf - . | xz -T0 -6 >"$KIT/vllm-kit.tar.xz"
split -b "${PART_MIB}M" -d -a 1 "$KIT/vllm-kit.tar.xz" "$KIT/parts/part"
(cd "$KIT/parts" && sha256sum part* >SHA256SUMS)
echo "gpu_vllm_kit: $(du -h "$KIT/vllm-kit.tar.xz" | cut -f1) in $(ls "$KIT"/parts/part* | wc -l) parts of <= $PART_MIB MiB:"
ls -l "$KIT"/parts
