"""CUDA IPC weights, rollout side, without a GPU: what is refused, and how (the checksum and views are
streamrl.torchkit.flat's, tested in tests/unit/torchkit/test_flat.py)."""

from __future__ import annotations

import pytest

from streamrl.rollout.weights import ipc as rollout_ipc


def test_the_receiver_needs_a_cuda_device() -> None:
    with pytest.raises(ValueError, match="need a CUDA device"):
        rollout_ipc.IpcWeightReceiver("cpu")
