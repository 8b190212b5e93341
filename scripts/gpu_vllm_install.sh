#!/usr/bin/env bash
# On the GPU machine: gather the parts of the vLLM kit (scripts/gpu_vllm_kit.sh) over back-to-back
# device calls, then install it. Files outside the checkout stay while the machine is warm, so each
# call carries one part (.vllmkit/parts/partN) and leaves it in $VLLMKIT_STASH:
#   bash scripts/gpu_vllm_install.sh stash     # keep the parts this call carries; list what is kept
#   bash scripts/gpu_vllm_install.sh install   # the same, then check every part against SHA256SUMS,
#                                              # unpack and pip-install the wheels (--no-index --no-deps)
#                                              # into $VLLMKIT_SITE (put it on PYTHONPATH)
# xgrammar (structured output) is not in the kit but vLLM imports it: a stand-in whose every name
# raises when used is installed in its place. Run vLLM there with VLLM_USE_FLASHINFER_SAMPLER=0 and
# VLLM_USE_DEEP_GEMM=0 (neither is in the kit).
set -euo pipefail
cd "$(dirname "$0")/.."
STASH=${VLLMKIT_STASH:-/tmp/vllmkit}
SITE=${VLLMKIT_SITE:-/tmp/vsite}
mkdir -p "$STASH"
for part in .vllmkit/parts/part* .vllmkit/parts/SHA256SUMS; do
  [ -e "$part" ] && cp "$part" "$STASH/"
done
ls -l "$STASH"
[ "${1:-}" = install ] || exit 0

(cd "$STASH" && sha256sum -c --quiet SHA256SUMS) || { echo "gpu_vllm_install: a part is missing or damaged" >&2; exit 1; }
rm -rf "$STASH/wheels" && mkdir -p "$STASH/wheels"
cat "$STASH"/part? | xz -d | tar -x -C "$STASH/wheels"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" "$STASH"/wheels/*.whl
if ! PYTHONPATH=$SITE python3 -c 'import xgrammar' 2>/dev/null; then
  mkdir -p "$SITE/xgrammar"
  cat >"$SITE/xgrammar/__init__.py" <<'EOF'
"""Stand-in for xgrammar, which the vLLM kit leaves out: vLLM imports it, structured output needs it."""

__version__ = "0.0.0"


def __getattr__(name: str) -> type:
    def refuse(*args: object, **kwargs: object) -> None:
        raise RuntimeError(f"xgrammar.{name}: structured output is not available (xgrammar is not installed)")

    return type(name, (), {"__init__": refuse, "__call__": refuse})
EOF
fi
echo "gpu_vllm_install: $(ls "$STASH"/wheels/*.whl | wc -l) wheels in $SITE"
PYTHONPATH=$SITE python3 -c 'import vllm; print("gpu_vllm_install: vllm", vllm.__version__)'
