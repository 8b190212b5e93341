#!/usr/bin/env bash
# Run the README's GPU commands, as written, in a checkout on a GPU machine with no package index
# (the checkout carries .gpukit/ from scripts/gpu_kit.sh), and keep their logs:
#   scripts/setup.sh
#   .venv/bin/python examples/gpu_arithmetic/prepare.py recipes/gpu_arithmetic.toml
#   .venv/bin/streamrl up recipes/gpu_arithmetic.toml --dry-run
#   .venv/bin/streamrl up recipes/gpu_arithmetic.toml
# Each command's output goes to $OUT/<step>.log (default bench/results/readme-gpu-<time>/), its exit
# code and wall time to $OUT/steps.txt, and the run's metrics.jsonl is copied there
# (at most 8 files: what the GPU machine here sends back). If setup fails, the versions it met are logged and the kit is installed into .venv without
# dependency resolution (--no-deps) so that the later commands still run; steps.txt says so.
#   bash scripts/gpu_readme_run.sh [UP_TIMEOUT_S]
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-bench/results/readme-gpu-$(date -u +%Y%m%dT%H%M%S)}
mkdir -p "$OUT"
UP_TIMEOUT_S=${1:-420}
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
export TORCH_CUDA_ARCH_LIST=9.0   # the image's 9.0a is not parsed by DeepSpeed's op builder

step() {  # step NAME COMMAND...: run, log, record exit code and seconds
  local name=$1 started rc
  shift
  started=$EPOCHREALTIME
  echo "=== $name: $*"
  "$@" >"$OUT/$name.log" 2>&1
  rc=$?
  printf '%s rc=%s %ss: %s\n' "$name" "$rc" "$(awk "BEGIN {printf \"%.1f\", $EPOCHREALTIME - $started}")" "$*" \
    | tee -a "$OUT/steps.txt"
  tail -n 25 "$OUT/$name.log"
  return $rc
}

{
  echo "machine: $(nvidia-smi -L 2>/dev/null | head -1); $(python3 --version) at $(command -v python3)"
  echo "date: $(date -u +%Y-%m-%dT%H:%M:%SZ); checkout: $(cat .gitrev 2>/dev/null || echo unknown)"
} | tee "$OUT/steps.txt"

if ! step setup scripts/setup.sh; then
  python3 -m pip list 2>/dev/null | grep -iE '^(pyarrow|typing.extensions|protobuf|fsspec|huggingface|requests|setuptools|pip) ' \
    >>"$OUT/setup.log"
  step setup-fallback bash -c '.venv/bin/python -m pip install -q --no-index --no-deps .gpukit/wheels/*.whl &&
    .venv/bin/python -m pip install -q --no-index --no-deps --no-build-isolation -e libs/common -e libs/ops \
      -e libs/torchkit -e services/coordinator -e services/rollout -e services/reward -e services/learner'
fi
step prepare .venv/bin/python examples/gpu_arithmetic/prepare.py recipes/gpu_arithmetic.toml
step dry-run .venv/bin/streamrl up recipes/gpu_arithmetic.toml --dry-run
step up timeout "$UP_TIMEOUT_S" .venv/bin/streamrl up recipes/gpu_arithmetic.toml
cp runs/gpu_arithmetic/metrics.jsonl "$OUT"/ 2>/dev/null   # prepare.json's summary is prepare.log's last line
grep -E "eval|held" "$OUT/up.log" | tail -n 15
cat "$OUT/steps.txt"
