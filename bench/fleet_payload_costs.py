"""Redis CPU and bytes per trajectory of each step of a payload's life, on a fresh redis-server of the probe's own,
through the real code of each step (bench/fleet.py reports it as ``redis_payload_costs``).

Trajectories shaped as bench/fleet_sim.py's (:class:`fleet_sim.Payload`: ``response_tokens`` int32 ids, float32
log-probs, uint8 mask, ``text_chars_per_token`` characters of text a token) go, ``group_size`` to a prompt, through:

* ``rollout``: :func:`streamrl.common.payloads.store_payloads` (one SET per payload) and ``Bus.commit`` of its
  outputs with the prompt's ack (PERSIST of each payload, the small TrajectoryRecord XADDed);
* ``reward_read``: :class:`streamrl.reward.service.RedisPayloads` fetching the records' payloads in micro-batches
  of 16 - their heads (GETRANGE), as for text scorers, and ``reward_read_whole`` as for a scorer on token ids;
* ``reward_commit``: ``Bus.commit`` of each ScoredRecord with the record's ack;
* ``coordinator``: each scored record stored in its group's buffer with the entry's ack (a commit, as the
  coordinator's handler), then the real GroupBuffer / BatchBuilder: groups completed, batches built and
  published (the payloads renamed under their batch, a BatchManifest XADDed);
* ``learner``: :func:`streamrl.common.batch_payloads.fetch_batch` of each manifest (GET of every payload) and
  the UNLINK of its payloads, as bench/fleet_sim.py's learner.

Each step runs for every trajectory before the next starts (the reads of stream entries that feed a step run
between steps, uncounted), so its Redis CPU is read from /proc around it alone: ``us`` per trajectory, and
``out_bytes`` / ``in_bytes`` per trajectory from INFO's network counters. The prompts' XADD and every
XREADGROUP are left out: those are no payload's.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import fleet_model as fm
import redis as syncredis
from fleet_sim import Payload

from streamrl.common.batch_payloads import fetch_batch, owned_buffers
from streamrl.common.bus import Bus, Output, connect
from streamrl.common.codec import decode
from streamrl.common.messages import (
    BatchManifest,
    PromptWorkItem,
    ScoredRecord,
    Tensor,
    Trajectory,
    TrajectoryRecord,
)
from streamrl.common.payloads import store_payloads
from streamrl.common.streams import StreamNames
from streamrl.coordinator.batches import BatchBuilder
from streamrl.coordinator.groups import GroupBuffer
from streamrl.coordinator.state import RunState
from streamrl.ops.redis_server import RedisServer
from streamrl.reward.service import RedisPayloads

CLK_TCK = os.sysconf("SC_CLK_TCK")
REWARD_BATCH = 16
"""Records a reward fetch reads together (``reward.max_batch_size``'s default)."""


def _trajectory(payload: Payload, group: int, j: int, group_size: int, prompt_tokens: int) -> Trajectory:
    return Trajectory(
        id=f"p{group}/{j}",
        group_id=f"p{group}",
        group_index=j,
        group_size=group_size,
        prompt_ids=Tensor.from_list(list(range(prompt_tokens)), "int32"),
        response_ids=payload.response_ids,
        logprobs=payload.logprobs,
        loss_mask=payload.loss_mask,
        prompt_text="q" * (4 * prompt_tokens),
        response_text=payload.text[:-1] + str(j % 10),
        metadata={"source": "fleet"},
        traceparent="00-" + "1" * 32 + "-" + "2" * 16 + "-01",
    )


async def _entries(bus: Bus, stream: str, group: str) -> list[tuple[str, bytes]]:
    """Every undelivered entry of ``stream`` for ``group``, delivered (uncounted: the loop's read)."""
    await bus.redis.xgroup_create(stream, group, id="0", mkstream=True)
    out: list[tuple[str, bytes]] = []
    while reply := await bus.redis.xreadgroup(group, "c", {stream: ">"}, count=1000):
        out += [(entry_id.decode(), fields[b"d"]) for entry_id, fields in reply[0][1]]
    return out


class _Probe:
    """The run's state between steps, and one method per step."""

    def __init__(self, url: str, pid: int, spec: fm.FleetSpec, num_groups: int, chars_per_token: int) -> None:
        self.names = StreamNames("probe")
        self.bus = Bus(connect(url))
        self.sync = syncredis.Redis.from_url(url)
        self.stat = Path(f"/proc/{pid}/stat")
        self.spec = spec
        self.num_groups = num_groups
        self.num = num_groups * spec.group_size
        self.payload = Payload(spec.response_tokens, chars_per_token, seed=0)
        self.state = RunState(self.bus, self.names)
        self.groups = GroupBuffer(self.state, group_size=spec.group_size, dynamic_filtering=False)
        self.costs: dict[str, dict[str, float]] = {}
        self.sizes: list[int] = []
        self.records: list[tuple[str, TrajectoryRecord]] = []

    async def step(self, name: str, run: Callable[[], Awaitable[None]]) -> None:
        """Run ``run`` and keep the Redis CPU and bytes it took, per trajectory, as ``name``."""
        net0, ticks0 = self.sync.info("stats"), fm.process_ticks(self.stat.read_text())
        await run()
        ticks1, net1 = fm.process_ticks(self.stat.read_text()), self.sync.info("stats")
        self.costs[name] = {
            "us": round(1e6 * (ticks1 - ticks0) / CLK_TCK / self.num, 1),
            "in_bytes": round((net1["total_net_input_bytes"] - net0["total_net_input_bytes"]) / self.num),
            "out_bytes": round((net1["total_net_output_bytes"] - net0["total_net_output_bytes"]) / self.num),
        }

    async def rollout(self) -> None:
        names, spec = self.names, self.spec
        tx = self.state.tx()
        for g in range(self.num_groups):
            self.groups.queue_issue(tx, f"p{g}", 0, time.time())
            tx.xadd(names.prompts, PromptWorkItem(id=f"p{g}", prompt_ids=Tensor.from_list([1], "int32")))
        await tx.execute()
        prompts = await _entries(self.bus, names.prompts, "rollout")

        async def run() -> None:
            for g, (entry, _) in enumerate(prompts):
                samples = [
                    _trajectory(self.payload, g, j, spec.group_size, spec.prompt_tokens) for j in range(spec.group_size)
                ]
                outputs = await store_payloads(self.bus, names, samples)
                self.sizes += [o.message.payload_bytes for o in outputs if isinstance(o.message, TrajectoryRecord)]
                assert await self.bus.commit(outputs, ack_stream=names.prompts, ack_group="rollout", ack_entry=entry)

        await self.step("rollout", run)

    async def reward(self) -> None:
        names = self.names
        entries = await _entries(self.bus, names.trajectories, "reward")
        self.records = [(entry, decode(raw, TrajectoryRecord)) for entry, raw in entries]
        reader = RedisPayloads(self.bus.redis, self.bus.max_command_bytes)

        async def read(whole: bool) -> None:
            for i in range(0, len(self.records), REWARD_BATCH):
                await reader.fetch([r for _, r in self.records[i : i + REWARD_BATCH]], whole)

        async def commit() -> None:
            for entry, record in self.records:
                out = Output(stream=names.scored, message=ScoredRecord(trajectory=record, reward=1.0, score=1.0))
                assert await self.bus.commit([out], ack_stream=names.trajectories, ack_group="reward", ack_entry=entry)

        await self.step("reward_read", lambda: read(False))
        await self.step("reward_read_whole", lambda: read(True))
        await self.step("reward_commit", commit)

    async def coordinator(self) -> None:
        names = self.names
        scored = await _entries(self.bus, names.scored, "coordinator")
        # one batch of every group (at version 0 with max_staleness 0, a second batch would wait for version 1)
        build = BatchBuilder(
            self.state, self.groups, prompts_per_step=self.num_groups, max_staleness=0, drop_stale=True
        )

        async def run() -> None:
            for entry, raw in scored:
                s = decode(raw, ScoredRecord)
                out = Output(key=names.group_buffer(s.trajectory.group_id), field=s.trajectory.id, message=s)
                assert await self.bus.commit([out], ack_stream=names.scored, ack_group="coordinator", ack_entry=entry)
            await self.groups.complete(None)
            assert len(await build.build(version=0)) == 1

        await self.step("coordinator", run)

    async def learner(self) -> None:
        names = self.names
        manifests = [decode(raw, BatchManifest) for _, raw in await _entries(self.bus, names.batches, "learner")]

        async def run() -> None:
            for manifest in manifests:
                await fetch_batch(self.bus.redis, manifest, max_reply_bytes=self.bus.max_command_bytes)
                if keys := owned_buffers(names, manifest.id, manifest.buffers):
                    await self.bus.redis.unlink(*keys)

        await self.step("learner", run)
        left = await self.bus.redis.keys(names.payload_prefix + "*")
        assert not left, f"{len(left)} payloads left after the learner's unlink"

    def summary(self) -> dict[str, Any]:
        mean = sum(self.sizes) / len(self.sizes)
        path = ("rollout", "reward_read", "reward_commit", "coordinator", "learner")
        return {
            "where": "bench/fleet_payload_costs.py: each step of the payload-once contract through its real code",
            "trajectories": self.num,
            "payload_bytes": round(mean),
            "steps": self.costs,
            "redis_us_per_trajectory": round(sum(self.costs[s]["us"] for s in path), 1),
            "redis_in_x_payload": round(sum(self.costs[s]["in_bytes"] for s in path) / mean, 3),
            "redis_out_x_payload": round(sum(self.costs[s]["out_bytes"] for s in path) / mean, 3),
        }

    async def run(self) -> dict[str, Any]:
        try:
            await self.rollout()
            await self.reward()
            await self.coordinator()
            await self.learner()
            return self.summary()
        finally:
            self.sync.close()
            await self.bus.redis.aclose()


def payload_costs(folder: Path, spec: fm.FleetSpec, num_groups: int = 128, chars_per_token: int = 4) -> dict[str, Any]:
    """Redis CPU (us) and bytes per trajectory of each step of its payload's life (see the module docstring), and
    their sums for text scorers (``reward_read``; ``reward_read_whole`` is reported beside, not summed)."""
    server = RedisServer(folder, appendonly=False).start()
    assert server.proc is not None
    try:
        return asyncio.run(_Probe(server.url, server.proc.pid, spec, num_groups, chars_per_token).run())
    finally:
        server.stop()


if __name__ == "__main__":
    import json
    import sys
    import tempfile

    groups = int(sys.argv[1]) if len(sys.argv) > 1 else 128
    with tempfile.TemporaryDirectory() as tmp:
        print(json.dumps(payload_costs(Path(tmp), fm.FleetSpec(), num_groups=groups), indent=1))
