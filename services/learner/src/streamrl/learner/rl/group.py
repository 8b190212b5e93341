"""The learner group: N data-parallel ranks that train as one learner; rank 0 alone is on the bus.

Rank 0 runs :class:`~streamrl.learner.rl.service.LearnerService` (the one bus consumer, the one that
publishes weights and acknowledges batches). Every operation the ranks must do together goes
through :class:`LearnerGroup`: on rank 0 it first broadcasts the command (over a gloo group of its
own, so an idle learner waiting for its next batch never trips a GPU collective's timeout), then
runs it; the other ranks sit in :meth:`LearnerGroup.follow`, receive each command and run the same
method. So the collectives inside (gradient reduction, ZeRO-3 gathers, checkpoint barriers) are
entered by every rank in the same order, by construction.

A step's outcome is the same on every rank: a failure before a backward pass on any rank makes every
rank raise :class:`~streamrl.learner.rl.trainer.StepFailedError` at the same agreement point (an
all-reduce of an ok flag, :mod:`~streamrl.learner.rl.trainer`); the ranks then gather the failing
rank's error over the control group, so rank 0 counts it, and all of them retry (rank 0 sends the
step again) or all stop together. Any other exception ends its rank: a follower's exit (or its
death: OOM-kill, segfault) makes :func:`launch` kill the others and exit non-zero at once, for the
orchestrator to restart the group; rank 0 counted the step before it began, so the attempt is known.

Checkpoints are durable and consistent: the critic's is written (tagged like the policy's) before the
policy's, whose ``latest`` marker is written last, after every file is fsync'ed
(:mod:`streamrl.learner.durable`); a resume loads the critic's checkpoint of the policy's tag.

Commands: ``step`` (the encoded TrainingBatch: every rank trains its share of it), ``weights``
(every rank joins the gather of the full parameters; rank 0 publishes them), ``adapter`` (the same
for the LoRA adapter alone), ``checkpoint``,
``export`` and ``stop``. Resuming needs no command: every rank loads the checkpoint at start.

:func:`launch` starts the ranks for ``learner.ranks > 1`` when no launcher (``torchrun``,
``deepspeed``) did: one child process per rank, with the usual ``RANK`` / ``WORLD_SIZE`` /
``LOCAL_RANK`` / ``MASTER_ADDR`` / ``MASTER_PORT`` environment, each dying with the launcher.
"""

from __future__ import annotations

import ctypes
import datetime
import logging
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from streamrl.common.codec import decode, encode
from streamrl.common.messages import TrainingBatch
from streamrl.learner.checkpoint_retention import prune_checkpoints
from streamrl.learner.rl.adapter import iter_adapter
from streamrl.learner.rl.trainer import RLTrainer, StepFailedError

logger = logging.getLogger(__name__)
IDLE_TIMEOUT = datetime.timedelta(days=7)
"""How long the other ranks wait for rank 0's next command (rank 0 may wait long for a batch)."""


class LearnerGroup:
    """The operations every rank of the learner runs together. Build it on every rank after the trainer."""

    def __init__(self, trainer: RLTrainer, ckpt_dir: Path, keep_last: int) -> None:
        self.trainer = trainer
        self.ckpt_dir = ckpt_dir
        self.keep_last = keep_last
        self.rank, self.world = trainer.policy.rank, trainer.policy.world_size
        self._control = torch.distributed.new_group(backend="gloo", timeout=IDLE_TIMEOUT) if self.world > 1 else None

    # ------------------------------------------------------------ rank 0 tells
    def _tell(self, command: str, argument: Any = None) -> None:
        if self._control is not None and self.rank == 0:
            torch.distributed.broadcast_object_list([(command, argument)], src=0, group=self._control)

    def resume(self) -> dict[str, Any] | None:
        """Every rank, at start: load the newest checkpoint (policy, critic, KL coefficient); its client state.
        The critic's is the one saved with the policy's (same tag), or the critic's newest when it has none."""
        state = self.trainer.policy.load_checkpoint(self.ckpt_dir)
        critic_dir = self.ckpt_dir / "critic"
        if self.trainer.critic is not None and critic_dir.is_dir():
            latest = self.ckpt_dir / "latest"
            tag = latest.read_text().strip() if latest.is_file() else None
            self.trainer.critic.load_checkpoint(critic_dir, tag=tag if tag and (critic_dir / tag).is_dir() else None)
        if state is not None:
            self.trainer.kl_ctl.value = float(state.get("kl_coef", self.trainer.kl_ctl.value))
        return state

    def step(self, batch: TrainingBatch) -> dict[str, float]:
        """Train one step on ``batch``, each rank on its share; the step's metrics (the same on every rank)."""
        self._tell("step", encode(batch))
        return self._step(batch)

    def _step(self, batch: TrainingBatch) -> dict[str, float]:
        """Every rank: the step; a StepFailedError (raised on every rank together) carries the failing rank's error."""
        try:
            return self.trainer.step(batch)
        except StepFailedError as e:
            if self._control is None:
                raise
            errors: list[str | None] = [None] * self.world
            torch.distributed.all_gather_object(errors, e.local, group=self._control)
            first = next((error for error in errors if error is not None), str(e))
            raise StepFailedError(first, local=e.local) from e

    def full_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """The full parameters (ZeRO-3 shards gathered in buckets, on every rank): yielded on rank 0 only."""
        self._tell("weights")
        return self.trainer.policy.iter_full_params()

    def adapter_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """The LoRA adapter's tensors (ZeRO-3 shards gathered on every rank): yielded on rank 0 only."""
        self._tell("adapter")
        return iter_adapter(self.trainer.policy.module, self.rank)

    def checkpoint(self, client_state: dict[str, Any]) -> None:
        """Save a resumable checkpoint of every model (all ranks), then keep the newest ``keep_last``."""
        self._tell("checkpoint", client_state)
        tag = f"step_{self.trainer.policy.global_steps}"
        if self.trainer.critic is not None:  # first: the policy's ``latest`` must never name a step the critic lacks
            self.trainer.critic.save_checkpoint(self.ckpt_dir / "critic", {"step": client_state["step"]}, tag=tag)
        self.trainer.policy.save_checkpoint(self.ckpt_dir, client_state, tag=tag)
        if self.rank == 0:  # both checkpoints and their ``latest`` are written by now
            prune_checkpoints(self.ckpt_dir, self.keep_last)
            if self.trainer.critic is not None:
                prune_checkpoints(self.ckpt_dir / "critic", self.keep_last)

    def export(self, directory: Path) -> None:
        """Write the policy in Hugging Face format to ``directory`` (gathered on every rank, written by rank 0)."""
        self._tell("export", str(directory))
        self.trainer.policy.export_hf(directory)

    def stop(self) -> None:
        """Rank 0, last: let the other ranks return from :meth:`follow`."""
        self._tell("stop")

    # ---------------------------------------------------- other ranks follow
    def follow(self) -> None:
        """Ranks > 0: run rank 0's commands until it says ``stop`` (an exception ends the rank, and the group)."""
        assert self._control is not None and self.rank > 0
        self.resume()
        while True:
            box: list[Any] = [None]
            torch.distributed.broadcast_object_list(box, src=0, group=self._control)
            command, argument = box[0]
            if command == "step":
                try:
                    self._step(decode(argument))
                except StepFailedError as e:  # raised on every rank together (trainer._agree):
                    logger.warning("rank %d: %s", self.rank, e)  # rank 0 retries, skips or stops the group
            elif command == "weights":
                for _ in self.trainer.policy.iter_full_params():
                    pass
            elif command == "adapter":
                for _ in iter_adapter(self.trainer.policy.module, self.rank):
                    pass
            elif command == "checkpoint":
                self.checkpoint(argument)
            elif command == "export":
                self.export(Path(argument))
            elif command == "stop":
                logger.info("rank %d: rank 0 stopped; done", self.rank)
                return
            else:
                raise RuntimeError(f"rank {self.rank}: unknown learner-group command {command!r}")


# ---------------------------------------------------------------- launching
def _die_with_parent() -> None:
    """In a child, before exec: get SIGKILL when the launcher dies (Linux), so no rank outlives it."""
    libc = ctypes.CDLL(None, use_errno=True)
    pr_set_pdeathsig = 1
    libc.prctl(pr_set_pdeathsig, signal.SIGKILL)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def launch(ranks: int, argv: list[str], command: list[str] | None = None) -> int:
    """Run ``streamrl learner ARGV`` (or ``command ARGV``) as a group of ``ranks`` processes on this host; their exit code.

    SIGTERM / SIGINT go to rank 0 only, which drains, checkpoints and tells the others to stop. When
    a rank fails, the others are killed and its exit code is returned (the group lives and dies as one).
    """
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port()), "WORLD_SIZE": str(ranks)}
    children: list[subprocess.Popen[bytes]] = []
    for rank in range(ranks):
        child_env = {**env, "RANK": str(rank), "LOCAL_RANK": str(rank), "LOCAL_WORLD_SIZE": str(ranks)}
        argv_ = [*(command or [sys.executable, "-m", "streamrl.learner"]), *argv]
        children.append(subprocess.Popen(argv_, env=child_env, preexec_fn=_die_with_parent))
    logger.info("learner group: %d ranks, pids %s", ranks, [c.pid for c in children])

    def forward(sig: int, _frame: Any) -> None:
        if children[0].poll() is None:
            children[0].send_signal(sig)

    signal.signal(signal.SIGTERM, forward)
    signal.signal(signal.SIGINT, forward)
    while True:
        codes = [c.poll() for c in children]
        failed = [(rank, code) for rank, code in enumerate(codes) if code not in (None, 0)]
        if failed:
            rank, code = failed[0]
            print(f"streamrl learner: rank {rank} exited with code {code}; stopping the group", file=sys.stderr)
            for c in children:
                if c.poll() is None:
                    c.kill()
            for c in children:
                c.wait()
            return int(code) if code and code > 0 else 1
        if all(code == 0 for code in codes):
            return 0
        time.sleep(0.2)
