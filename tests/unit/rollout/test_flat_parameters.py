"""FlatParameters (CPU tensors): parameters move into the published layout once; a load is one copy
per buffer; a tied parameter lives once; a layout that does not fit the model is refused."""

from __future__ import annotations

import pytest
import torch

from streamrl.common.errors import WeightSyncError
from streamrl.common.messages import IpcWeights
from streamrl.learner.rl.weights.ipc import plan_layout
from streamrl.rollout.weights.ipc import FlatParameters, tensor_views


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Embedding(50, 16), torch.nn.Linear(16, 16), torch.nn.Linear(16, 50, bias=False)
    )
    model[2].weight = model[0].weight  # tied head
    return model


def _ipc(named: list[tuple[str, torch.Tensor]]) -> tuple[IpcWeights, list[torch.Tensor]]:
    layout, sizes = plan_layout(named, bucket_bytes=4096)
    staging = [torch.zeros(size, dtype=torch.uint8) for size in sizes]
    for view, (_, t) in zip(tensor_views(staging, layout), named, strict=True):
        view.copy_(t)
    return IpcWeights(device_uuid="cpu", block_bytes=4096, buffers=[], tensors=layout), staging


def test_load_is_a_copy_per_buffer_into_the_moved_parameters() -> None:
    model = _model()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    new = {k: torch.randn_like(v) for k, v in before.items()}
    new["2.weight"] = new["0.weight"]
    ipc, staging = _ipc(list(new.items()))
    flat = FlatParameters(model.state_dict(keep_vars=True), list(model.parameters()), ipc, staging)
    for name, value in model.state_dict().items():
        torch.testing.assert_close(value, before[name], msg=f"{name} kept its values when moved")
    flat.load(staging)
    for name, value in model.state_dict().items():
        torch.testing.assert_close(value, new[name])
    assert model[2].weight is model[0].weight and model[0].weight.data.data_ptr() in {
        v.data_ptr() for v in tensor_views(flat.buffers, ipc.tensors)
    }


def test_a_layout_that_does_not_fit_the_model_is_refused() -> None:
    model = _model()
    state = model.state_dict(keep_vars=True)
    named = [(k, v.detach()) for k, v in model.state_dict().items()]
    ipc, staging = _ipc([*named, ("extra.weight", torch.zeros(3))])
    with pytest.raises(WeightSyncError, match="does not have"):
        FlatParameters(state, list(model.parameters()), ipc, staging)
    ipc, staging = _ipc([(k, v) for k, v in named if k != "1.bias"])
    with pytest.raises(WeightSyncError, match="lack 1"):
        FlatParameters(state, list(model.parameters()), ipc, staging)
    ipc, staging = _ipc(
        [(k, v.T.contiguous() if k == "1.weight" else v) for k, v in named if k != "1.weight"]
        + [("1.weight", torch.zeros(16, 8))]
    )
    with pytest.raises(WeightSyncError, match=r"1\.weight"):
        FlatParameters(state, list(model.parameters()), ipc, staging)
