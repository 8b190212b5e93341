"""Delta sync through the ``zmq`` transport's two ends (real sockets): full weights and a LoRA adapter,
whose delta is an adapter's tensors."""

from __future__ import annotations

import logging

import pytest
import torch

from streamrl.common.messages import LoraAdapter
from streamrl.torchkit.testing import weights_event
from streamrl.torchkit.weights.zmq import ZmqPublisher, ZmqReceiver


def _adapter(seed: int) -> dict[str, torch.Tensor]:
    """A rank-8 adapter on two modules of two layers, in peft naming, bf16, some steps into training."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for layer in range(2):
        for module, (d_in, d_out) in {"q_proj": (64, 64), "down_proj": (128, 64)}.items():
            prefix = f"base_model.model.model.layers.{layer}.mlp.{module}"
            out[f"{prefix}.lora_A.weight"] = (torch.randn(8, d_in, generator=g) * 0.02).to(torch.bfloat16)
            # (B starts at zero; some steps in, as here, it is as dense as A)
            out[f"{prefix}.lora_B.weight"] = (torch.randn(d_out, 8, generator=g) * 0.02).to(torch.bfloat16)
    return out


def _train_step(weights: dict[str, torch.Tensor], seed: int) -> dict[str, torch.Tensor]:
    """A small optimizer-like step: each weight moves by ~1e-5 (a few % of the bf16 words change)."""
    g = torch.Generator().manual_seed(seed)
    return {n: (w.float() + torch.randn(w.shape, generator=g) * 1e-5).to(w.dtype) for n, w in weights.items()}


@pytest.mark.parametrize("payload", ["full", "lora"])
def test_versions_after_the_first_arrive_as_deltas(payload: str, caplog: pytest.LogCaptureFixture) -> None:
    lora = LoraAdapter(rank=8, alpha=16.0, target_modules=["down_proj", "q_proj"]) if payload == "lora" else None
    weights = _adapter(0)
    if payload == "full":
        weights = {n.removeprefix("base_model.model.").replace(".lora_A", ""): w for n, w in weights.items()}
        weights = {n: w for n, w in weights.items() if ".lora_B" not in n}
    publisher = ZmqPublisher(max_behind=4)
    receiver = ZmqReceiver()
    caplog.set_level(logging.INFO, logger="streamrl.torchkit.weights.zmq")
    try:
        kinds = []
        for version in range(4):
            if version:
                weights = _train_step(weights, version)
            published = publisher.publish(weights.items(), version)
            event = weights_event(version, published, payload=payload, lora=lora)
            if version == 2:
                continue  # this worker missed version 2: version 3 comes as a chain of two deltas
            with receiver.receive(event, timeout_s=20) as received:
                got = dict(received.tensors)
                assert set(got) == set(weights)
                for name, w in weights.items():
                    assert torch.equal(got[name], w), name
            info = receiver.last_sync
            assert info is not None
            kinds.append((info.kind, info.base_version))
            if info.kind == "delta":
                assert info.num_bytes < info.full_bytes / 4
        assert kinds == [("full", -1), ("delta", 0), ("delta", 1)]
        lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("weights version 3")]
        assert len(lines) == 1 and f"({payload}): delta from version 1" in lines[0]
        receiver.release_memory()  # the engine slept: the next version comes whole
        weights = _train_step(weights, 9)
        event = weights_event(4, publisher.publish(weights.items(), 4), payload=payload, lora=lora)
        with receiver.receive(event, timeout_s=20) as received:
            assert all(torch.equal(t, weights[n]) for n, t in received.tensors)
        assert receiver.last_sync is not None and receiver.last_sync.kind == "full"
    finally:
        receiver.close()
        publisher.close()
