"""Learner ZmqPublisher: torch tensors -> buckets -> received arrays, bf16, tied head, versions."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest
import torch

from streamrl.common.weights.wire import fetch_buckets
from streamrl.torchkit.weights.zmq import ZmqPublisher


@pytest.fixture
def server() -> Iterator[ZmqPublisher]:
    srv = ZmqPublisher(bucket_bytes=1024)
    yield srv
    srv.close()


def test_publish_round_trips_dtypes_and_adds_the_tied_head(server: ZmqPublisher) -> None:
    embed = torch.randn(20, 8, dtype=torch.bfloat16)
    named = [
        ("model.embed_tokens.weight", embed),
        ("model.norm.weight", torch.randn(8)),
        ("model.layers.0.mlp.up_proj.weight", torch.randn(16, 8).t()),  # non-contiguous
    ]
    published = server.publish(named, version=1)
    checksum, num_bytes, num_buckets = published["checksum"], published["num_bytes"], published["num_buckets"]
    assert num_buckets > 1
    received = {t.name: t for t in fetch_buckets(server.endpoint, 1, checksum, 5.0)}
    assert set(received) == {name for name, _ in named} | {"lm_head.weight"}
    assert num_bytes == sum(t.array.nbytes for t in received.values())
    head = received["lm_head.weight"]
    assert head.dtype == "bfloat16" and head.array.dtype == np.uint16
    restored = torch.from_numpy(head.array.copy().view(np.int16)).view(torch.bfloat16)
    assert torch.equal(restored, embed)
    up = received["model.layers.0.mlp.up_proj.weight"]
    assert up.dtype == "float32" and np.array_equal(up.array, named[2][1].numpy())


def test_an_explicit_head_is_kept(server: ZmqPublisher) -> None:
    embed, head = torch.randn(4, 2), torch.randn(4, 2)
    published = server.publish([("model.embed_tokens.weight", embed), ("lm_head.weight", head)], version=1)
    checksum = published["checksum"]
    received = {t.name: t.array for t in fetch_buckets(server.endpoint, 1, checksum, 5.0)}
    assert np.array_equal(received["lm_head.weight"], head.numpy())


@pytest.mark.parametrize(
    "embed_name", ["model.text_model.embed_tokens.weight", "model.language_model.embed_tokens.weight"]
)
def test_a_vision_language_model_gets_its_tied_head_too(server: ZmqPublisher, embed_name: str) -> None:
    """vLLM's CPU backend keeps its own packed head: without lm_head.weight a tied VL model is served
    a mix of old and new weights."""
    embed = torch.randn(6, 4)
    published = server.publish([(embed_name, embed), ("model.vision_model.post_layernorm.weight", torch.ones(4))], 1)
    checksum = published["checksum"]
    received = {t.name: t.array for t in fetch_buckets(server.endpoint, 1, checksum, 5.0)}
    assert np.array_equal(received["lm_head.weight"], embed.numpy())


def test_versions_must_increase(server: ZmqPublisher) -> None:
    server.publish([("w", torch.ones(2))], version=3)
    assert server.version == 3
    with pytest.raises(ValueError, match="increase"):
        server.publish([("w", torch.ones(2))], version=3)
