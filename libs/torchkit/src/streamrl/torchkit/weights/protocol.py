"""The two protocols every weight transport implements: the learner's end and an engine's end.

The learner's rank 0 holds one :class:`WeightPublisher`; each version it ``publish``es returns the
transport's fields of the ``WeightsPublished`` event (:class:`PublishedWeights`), which the learner
completes (version, step, metrics, payload), signs and sends. A rollout engine (the transformers
engine, or each vLLM worker) holds one :class:`WeightReceiver`, built from the event's ``transport``
tag (:func:`streamrl.torchkit.weights.factory.receiver_for`); ``receive`` fetches the version the
event names and verifies it against the event's checksum before the caller sees a single tensor::

    receiver = receiver_for(event, receiver, device=device, label="hf")
    with receiver.receive(event, timeout_s) as received:
        sink(received.version, received.tensors)  # views valid only inside the block

Neither side ever asks which transport it holds. Both work for either payload (full weights or a
LoRA adapter's tensors); a transport that cannot carry one refuses it with a WeightSyncError.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Protocol, TypedDict

import torch

from streamrl.common.messages import IpcWeights, WeightsBroadcast, WeightsPublished, WeightsTransport


class PublishedWeights(TypedDict):
    """The fields of ``WeightsPublished`` a publisher fills: how the version travels and its checksum."""

    transport: WeightsTransport
    checksum: str
    num_bytes: int
    num_buckets: int
    endpoint: str
    ipc: IpcWeights | None
    broadcast: WeightsBroadcast | None


@dataclass(frozen=True, slots=True)
class Received:
    """A verified version: ``(name, tensor)`` pairs in publishing order, valid until the ``receive`` block ends."""

    version: int
    tensors: list[tuple[str, torch.Tensor]]


class WeightPublisher(Protocol):
    """The learner's end of a transport (learner rank 0)."""

    def publish(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> PublishedWeights:
        """Make ``named_tensors`` available as ``version`` (which must increase); returns the event's fields."""
        ...

    def close(self) -> None:
        """Stop serving and release what the transport holds (ports, threads, buffers, groups)."""
        ...


class WeightReceiver(Protocol):
    """An engine's end of a transport (one per engine, or per vLLM worker)."""

    transport: WeightsTransport

    def receive(
        self, event: WeightsPublished, timeout_s: float, abandoned: threading.Event | None = None
    ) -> AbstractContextManager[Received]:
        """Fetch the version ``event`` names and verify it against the event's checksum; the context
        yields it (nothing is yielded on a failure: :class:`streamrl.common.errors.WeightSyncError` - a
        missed deadline, a mismatch, ``abandoned`` set, a payload the transport cannot carry)."""
        ...

    def release_memory(self) -> None:
        """Free staging memory the receiver keeps between versions (the engine sleeps); the next ``receive``
        allocates it again."""
        ...

    def close(self) -> None:
        """Release what the receiver holds (a group membership, opened handles)."""
        ...
