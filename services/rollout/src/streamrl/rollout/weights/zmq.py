"""Receive the learner's weights over ZMQ (``learner.weights_transport = "zmq"``, the portable path).

The learner's weight server (``streamrl.learner.rl.weights.zmq``) serves one version as buckets
(:mod:`streamrl.common.weights.wire`); :func:`torch_tensors` pulls them, verifies the checksum the
signed event names before it yields anything (a failed transfer leaves the engine untouched) and
hands each tensor out as a read-only torch view of the received bytes
(:func:`streamrl.torchkit.wire.to_torch`). Both engines use it: the transformers engine in its
driver thread, each vLLM worker through the worker extension (:mod:`.vllm_extension`).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator

import torch

from streamrl.common.weights.wire import fetch_buckets
from streamrl.torchkit.wire import to_torch


def torch_tensors(
    endpoint: str, version: int, checksum: str | None, timeout_s: float, abandoned: threading.Event | None = None
) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) pairs of ``version`` from the weight server at ``endpoint``, verified against
    ``checksum`` (None: not checked) before the first is yielded; raises
    :class:`streamrl.common.errors.WeightSyncError` on a missed deadline, a server gone, a mismatch, or
    ``abandoned`` set."""
    for received in fetch_buckets(endpoint, version, checksum, timeout_s, abandoned=abandoned):
        yield received.name, to_torch(received)
