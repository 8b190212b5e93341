"""The one place a transport is chosen: the learner's publisher from config, an engine's receiver from the event.

Adding a transport: write its two ends in this folder (a :class:`~.protocol.WeightPublisher` and a
:class:`~.protocol.WeightReceiver`), add its tag to ``WeightsTransport`` (``streamrl.common.messages``)
and one branch to each function below. Nothing else tests which transport it holds.
"""

from __future__ import annotations

import socket
from collections.abc import Mapping

import torch

from streamrl.common.messages import WeightsPublished
from streamrl.torchkit.weights.protocol import WeightPublisher, WeightReceiver
from streamrl.torchkit.weights.tied import TIED_ALIASES

TRANSPORTS = ("zmq", "ipc", "broadcast", "relay")


def _unknown(transport: str) -> ValueError:
    return ValueError(f"unknown weights transport {transport!r} (known: {', '.join(TRANSPORTS)})")


def make_publisher(
    transport: str,
    *,
    host: str = "127.0.0.1",
    port: int = 0,
    advertise_host: str | None = None,
    store_port: int = 0,
    bucket_bytes: int = 512 * 2**20,
    broadcast_timeout_s: float = 60.0,
    zmq_fallback: bool = False,
    tied_aliases: Mapping[str, tuple[str, ...]] = TIED_ALIASES,
    ipc_buffer_sets: int = 2,
    ipc_reader_wait_s: float = 10.0,
    delta_max_behind: int = 0,
) -> WeightPublisher:
    """The learner's publisher for ``learner.weights_transport`` (its ``weights_*`` fields as arguments):
    ``host``/``port``/``advertise_host`` the ZMQ server's (also the fallback of ``broadcast``),
    ``store_port`` the broadcast rendezvous', ``ipc_*`` the CUDA IPC buffer sets', ``delta_max_behind`` the
    ZMQ server's delta links (0: full weights only); ``relay`` roots its relay on ``host``/``port`` alone."""
    if transport == "zmq":
        from streamrl.torchkit.weights.zmq import ZmqPublisher

        return ZmqPublisher(host, port, advertise_host, bucket_bytes, tied_aliases, max_behind=delta_max_behind)
    if transport == "ipc":
        from streamrl.torchkit.weights.ipc import IpcPublisher

        return IpcPublisher(bucket_bytes, tied_aliases, ipc_buffer_sets, ipc_reader_wait_s)
    if transport == "broadcast":
        from streamrl.torchkit.weights.broadcast import BroadcastPublisher
        from streamrl.torchkit.weights.zmq import ZmqPublisher

        rendezvous = advertise_host or host
        if rendezvous in ("0.0.0.0", "*"):
            rendezvous = socket.gethostname()
        fallback = ZmqPublisher(host, port, advertise_host, bucket_bytes) if zmq_fallback else None
        return BroadcastPublisher(
            advertise_host=rendezvous,
            port=store_port,
            bucket_bytes=bucket_bytes,
            timeout_s=broadcast_timeout_s,
            tied_aliases=tied_aliases,
            zmq_fallback=fallback,
        )
    if transport == "relay":
        from streamrl.torchkit.weights.relay import RelayPublisher

        return RelayPublisher(host, port, advertise_host, tied_aliases=tied_aliases)
    raise _unknown(transport)


def make_receiver(
    transport: str, *, device: torch.device, label: str = "engine", tensor_parallel_size: int = 1
) -> WeightReceiver:
    """An engine's receiver for events tagged ``transport``: ``device`` the engine's (or the vLLM
    worker's), ``label`` its name in a broadcast group, ``tensor_parallel_size`` the engine's. A ``relay``
    receiver fetches into the process's relay seat (:func:`streamrl.torchkit.weights.relay.install_seat`, set
    by the rollout service), or from the learner alone when there is none."""
    if transport == "zmq":
        from streamrl.torchkit.weights.zmq import ZmqReceiver

        return ZmqReceiver()
    if transport == "ipc":
        from streamrl.torchkit.weights.ipc import IpcReceiver

        return IpcReceiver(device, tensor_parallel_size)
    if transport == "broadcast":
        from streamrl.torchkit.weights.broadcast_member import BroadcastReceiver

        return BroadcastReceiver(device, label)
    if transport == "relay":
        from streamrl.torchkit.weights.relay import RelayReceiver, installed_seat

        return RelayReceiver(installed_seat())
    raise _unknown(transport)


def receiver_for(
    event: WeightsPublished,
    current: WeightReceiver | None,
    *,
    device: torch.device,
    label: str = "engine",
    tensor_parallel_size: int = 1,
) -> WeightReceiver:
    """``current`` when it takes ``event``'s transport, else a new receiver for it (``current`` closed)."""
    if current is not None and current.transport == event.transport:
        return current
    receiver = make_receiver(event.transport, device=device, label=label, tensor_parallel_size=tensor_parallel_size)
    if current is not None:
        current.close()
    return receiver
