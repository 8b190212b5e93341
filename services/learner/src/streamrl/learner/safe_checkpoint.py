"""Checkpoint files loaded as data, never as code: ``torch.load(weights_only=True)`` with a short allowlist.

DeepSpeed unpickles its checkpoint files with ``weights_only=False`` (0.19: ``TorchCheckpointEngine.load``;
it has no option to change that), and every container of a run mounts the volume they live on, so
whoever can write a file there could run code in the learner at its next resume. Here every file a
resume reads goes through torch's weights-only unpickler instead: tensors, plain Python values and
containers, and the few DeepSpeed types its optimizer states hold (:data:`ALLOWED_GLOBALS`: all the
globals of ZeRO 0-3 checkpoints in fp32 and bf16, listed with
``torch.serialization.get_unsafe_globals_in_checkpoint``). Anything else is refused before it is
built, with :class:`UnsafeCheckpointError` naming the file.

:class:`SafeLoads` wraps a DeepSpeed engine's checkpoint engine so that its loads go through
:func:`load_checkpoint_file`; saving is unchanged.
"""

from __future__ import annotations

import importlib
import pickle
import re
from pathlib import Path
from typing import Any

import torch

ALLOWED_GLOBALS = (
    "deepspeed.runtime.fp16.loss_scaler.LossScaler",
    "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler",
    "deepspeed.runtime.zero.config.ZeroStageEnum",
    "deepspeed.utils.tensor_fragment.fragment_address",
)
"""The non-tensor types DeepSpeed writes into checkpoints (loss scalers, the ZeRO stage, flat-buffer
fragment addresses): classes rebuilt from their attributes, none runs code when loaded."""
_REASON = re.compile(r"WeightsUnpickler error: (?P<reason>[^\n]*?)(?: Please use|\n|$)")


class UnsafeCheckpointError(ValueError):
    """A checkpoint file holds something besides tensors, plain values and :data:`ALLOWED_GLOBALS`."""


def _allowed() -> list[Any]:
    allowed = []
    for name in ALLOWED_GLOBALS:
        module, _, attr = name.rpartition(".")
        allowed.append(getattr(importlib.import_module(module), attr))
    return allowed


def load_checkpoint_file(path: str | Path, map_location: Any = None) -> Any:
    """``torch.load`` of one checkpoint file that builds only tensors, plain values and
    :data:`ALLOWED_GLOBALS`; :class:`UnsafeCheckpointError` (naming the file) for anything else."""
    with torch.serialization.safe_globals(_allowed()):
        try:
            return torch.load(path, map_location=map_location, weights_only=True)
        except pickle.UnpicklingError as e:
            found = _REASON.search(str(e))
            reason = found["reason"] if found else str(e).splitlines()[0]
            raise UnsafeCheckpointError(
                f"refusing to load checkpoint file {path}: {reason} A checkpoint holds only tensors, plain "
                f"values and DeepSpeed's {', '.join(n.rsplit('.', 1)[1] for n in ALLOWED_GLOBALS)}; one that "
                "holds other objects was not written by streamrl. Remove it (or its checkpoint folder)."
            ) from e


class SafeLoads:
    """A DeepSpeed checkpoint engine whose ``load`` is :func:`load_checkpoint_file`; all else is the wrapped one's."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def load(self, path: str, map_location: Any = None) -> Any:
        return load_checkpoint_file(path, map_location)
