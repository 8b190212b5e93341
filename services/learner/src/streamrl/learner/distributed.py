"""The learner's default process group: NCCL on GPU, gloo on CPU, made once per process.

Under ``torchrun``, the ``deepspeed`` launcher or the learner's own rank launcher (``learner.ranks``) the
world is the launcher's (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR/PORT`` in the environment, ``env://``). A
single process without one gets a world of one on a free local port, handed to the process group directly
(``tcp://127.0.0.1:PORT``, rank 0, size 1): the process's environment is left as it was, so a child it
starts later (a vLLM engine, a subprocess) never believes it is rank 0 of a world, and a second world made
in the same process (after something destroyed the first) takes a new port instead of a stale one.

DeepSpeed reads two variables of its own from the environment, and reads them all through the process's
life (``zero.Init``, its engine, checkpoint saves): ``LOCAL_RANK`` (the device of this rank; 0 without a
launcher) and ``TORCH_EXTENSIONS_DIR`` (where it JIT-builds ops: a small shm op on its first
``init_distributed``, ~50 s unless scripts/setup.sh pre-built it; default ``{sys.prefix}/torch_extensions``,
one per virtual environment, so two never rebuild, and lock, each other's copy). Those two are set where
unset (:data:`DEEPSPEED_DEFAULTS`): they describe this process and hold for a child as well; nothing that
describes a world is.
"""

from __future__ import annotations

import os
import socket
import sys
from pathlib import Path

import torch

DEEPSPEED_DEFAULTS = {"LOCAL_RANK": "0", "TORCH_EXTENSIONS_DIR": str(Path(sys.prefix) / "torch_extensions")}
"""What DeepSpeed reads from the environment, set where unset (see the module docstring)."""


def init_distributed() -> None:
    """Create the default process group once (see the module docstring)."""
    for name, value in DEEPSPEED_DEFAULTS.items():
        os.environ.setdefault(name, value)
    _release_stale_deepspeed_groups()
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return
    import deepspeed

    backend = "nccl" if torch.cuda.is_available() else "gloo"
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    if "RANK" in os.environ:  # a launcher's world
        deepspeed.init_distributed(dist_backend=backend)
        return
    deepspeed.init_distributed(
        dist_backend=backend,
        auto_mpi_discovery=False,
        init_method=f"tcp://127.0.0.1:{_free_port()}",
        rank=0,
        world_size=1,
    )


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _release_stale_deepspeed_groups() -> None:
    """Forget the process groups DeepSpeed cached in a world that no longer exists.

    Something else in this process (a vLLM engine's shutdown calls ``torch.distributed.destroy_process_group``)
    may have destroyed the world DeepSpeed built its groups in. DeepSpeed only forgets them when the world is
    destroyed through ``deepspeed.comm``; otherwise the next ``deepspeed.initialize`` broadcasts over a dead
    group and fails with "Group ... is not registered".
    """
    groups = sys.modules.get("deepspeed.utils.groups")
    if groups is None or groups._WORLD_GROUP is None:
        return
    if torch.distributed.is_initialized():
        try:
            torch.distributed.get_process_group_ranks(groups._WORLD_GROUP)
            return
        except (KeyError, ValueError, RuntimeError):
            pass
    groups._release_process_group_references()
