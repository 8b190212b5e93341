"""A process group of its own, built directly on a store: the learner's weight-broadcast group.

The learner (rank 0) and its rollout workers (ranks 1..n) build the group on a ``PrefixStore`` of
the learner's ``TCPStore`` (the rendezvous of :mod:`streamrl.common.weights.broadcast`) - never
``torch.distributed``'s default group, so the learner's own data-parallel group is not touched.
NCCL when the weights are on CUDA, gloo on CPU. With NCCL a timed-out collective aborts this
group's communicator instead of the whole process (``TORCH_NCCL_ASYNC_ERROR_HANDLING=2`` while
the group is built): a dead member never takes the others down.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Iterator
from datetime import timedelta
from typing import Protocol, cast

import torch
import torch.distributed as dist


class Group(Protocol):
    """What streamrl calls on the group :func:`new_group` builds (a c10d ``ProcessGroupGloo`` or
    ``ProcessGroupNCCL``; torch's stubs leave their ``broadcast`` out)."""

    def abort(self) -> None: ...

    def broadcast(self, tensors: list[torch.Tensor], opts: dist.BroadcastOptions) -> dist.Work: ...


def put(store: dist.Store, key: str, value: bytes | str) -> None:
    """``store.set``: a c10d store keeps bytes as they are (torch's stubs declare ``str`` values only)."""
    store.set(key, value)  # type: ignore[arg-type]


@contextlib.contextmanager
def _env(name: str, value: str) -> Iterator[None]:
    saved = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if saved is None:
            del os.environ[name]
        else:
            os.environ[name] = saved


def new_group(store: dist.Store, rank: int, size: int, backend: str, timeout_s: float, device: torch.device) -> Group:
    """A process group of ``size`` ranks built directly on ``store``, ``backend`` ``nccl`` (connected
    on ``device`` at once) or ``gloo``; every member calls it, and it blocks until all came."""
    if backend not in ("nccl", "gloo"):
        raise ValueError(f"unknown process-group backend {backend!r}: nccl or gloo")
    timeout = timedelta(seconds=timeout_s)
    if backend == "gloo":
        return cast(Group, dist.ProcessGroupGloo(store, rank, size, timeout))
    options = dist.ProcessGroupNCCL.Options()
    options._timeout = timeout
    with _env("TORCH_NCCL_ASYNC_ERROR_HANDLING", "2"):  # abort the communicator on error, not the process
        group = dist.ProcessGroupNCCL(store, rank, size, options)
    group.eager_connect_single_device(device)
    return cast(Group, group)


def wait_work(work: dist.Work, deadline: float) -> bool:
    """Poll ``work`` until it completes (then raise its error, if any) or ``deadline`` (``time.monotonic()``);
    True if done."""
    while not work.is_completed():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.0005)
    work.wait()
    return True
