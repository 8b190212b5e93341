"""Checkpoints are loaded as data, never as code (streamrl.learner.safe_checkpoint).

A checkpoint file holding a pickle that would run code (here: create a marker file) is refused with
an error naming the file, and the marker is never written; a real DeepSpeed checkpoint (ZeRO 2 and 3:
loss scaler, ZeRO stage, fragment addresses) still resumes exactly: that one runs DeepSpeed in a
subprocess (safe_checkpoint_worker.py), so it is in tests/integration/learner/test_safe_checkpoint_process.py.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from streamrl.learner.safe_checkpoint import SafeLoads, UnsafeCheckpointError, load_checkpoint_file


class TouchMarker:
    """Unpickling it creates a file: what a malicious checkpoint could do with any other command."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):  # type: ignore[no-untyped-def]
        return (Path.touch, (self.marker,))


def test_a_file_holding_code_is_refused_naming_it_and_never_runs(tmp_path: Path) -> None:
    marker, path = tmp_path / "MARKER", tmp_path / "mp_rank_00_model_states.pt"
    torch.save({"module": {"w": torch.ones(2)}, "ds_version": "0.19.8", "x": TouchMarker(marker)}, path)
    with pytest.raises(UnsafeCheckpointError, match=f"refusing to load checkpoint file {path}: .*getattr"):
        load_checkpoint_file(path)
    assert not marker.exists()
    torch.load(path, weights_only=False)  # what DeepSpeed itself does: the file runs its code
    assert marker.exists()


def test_tensors_plain_values_and_deepspeeds_own_types_load(tmp_path: Path) -> None:
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address

    state = {
        "w": torch.arange(3.0),
        "steps": 7,
        "betas": (0.9, 0.95),
        "tag": "step_7",
        "stage": ZeroStageEnum(2),
        "scaler": LossScaler(scale=1.0),
        "dynamic": DynamicLossScaler(2.0**16, 1000, 1, 2, False),
        "address": fragment_address(numel=3, start=0),
    }
    torch.save(state, tmp_path / "optim_states.pt")
    loaded = load_checkpoint_file(tmp_path / "optim_states.pt")
    assert torch.equal(loaded["w"], state["w"]) and loaded["stage"] is ZeroStageEnum.gradients
    assert (loaded["steps"], loaded["betas"], loaded["tag"], loaded["address"]) == (
        7,
        (0.9, 0.95),
        "step_7",
        state["address"],
    )
    assert loaded["scaler"].cur_scale == 1.0 and loaded["dynamic"].cur_scale == 2.0**16


def test_safe_loads_routes_loads_and_keeps_the_rest(tmp_path: Path) -> None:
    class Engine:
        name = "TorchCheckpointEngine"

        def load(self, path: str, map_location: object = None) -> object:
            raise AssertionError("the unsafe load was called")

    torch.save({"w": torch.ones(1)}, tmp_path / "f.pt")
    safe = SafeLoads(Engine())
    assert safe.name == "TorchCheckpointEngine"
    assert torch.equal(safe.load(str(tmp_path / "f.pt"), map_location="cpu")["w"], torch.ones(1))
