"""Simulated rollout workers and a simulated learner for bench/fleet.py: real bus traffic, no model.

``python bench/fleet_sim.py rollout ...`` runs ``--workers`` rollout workers in one process. Each is
what a real rollout replica is on the bus: a ConsumerLoop on ``prompts`` (group ``rollout``, its own
consumer name, ``max_in_flight`` one eighth above the groups its GPUs decode at once, as an engine
queues a few requests past its batch), a heartbeat (key + instances set), its served version in the
``served`` hash; per PromptWorkItem it waits for the prompt's policy version and a free GPU slot,
"generates" for ``seqs_per_gpu * response_tokens / tokens_per_s`` seconds (an asyncio sleep; the
first group of each slot a random fraction of that, as if the fleet were already running), then
writes ``group_size`` Trajectory payloads and commits their records, as the real worker does
(:func:`streamrl.common.payloads.store_payloads`), the trajectories shaped as the real worker's (``{group}/{j}`` ids, int32
response ids, float32 behaviour log-probs, uint8 loss mask, the response text at
``text_chars_per_token`` characters a token, versions, timings, the prompt's traceparent).
Differences from real workers: one tail of ``weights`` per process instead of one per worker, and
the token ids, log-probs and text are the same bytes in every trajectory (msgpack does not compress).

``python bench/fleet_sim.py learner ...`` is the learner on the bus: it publishes version 0, then per
batch (group ``learner``; a BatchManifest, or a whole TrainingBatch) reads the batch's payloads as the real
learner does (:func:`streamrl.common.batch_payloads.fetch_batch`: replies of at most ``redis.max_command_mb``,
decoded; the next batch's while one trains, as the learner's prefetch), waits ``step_s`` (the batches one at a
time, in order) and publishes the next version (the
WeightsPublished event and the ``state:learner`` copy, one atomic commit). It acknowledges each batch at
once and then deletes its payloads (the real learner does both once a checkpoint covers the batch).

Both write their counters to the hash ``state:fleet_sim`` every second (one field per process) for
the driver to read.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import random
import signal
import time

import numpy as np

from streamrl.common import aio
from streamrl.common.aio import wait_set
from streamrl.common.batch_payloads import fetch_batch, load_manifest, owned_buffers
from streamrl.common.bus import PAYLOAD_FIELD, Bus, Output, connect
from streamrl.common.codec import decode, encode
from streamrl.common.config import ConsumerConfig
from streamrl.common.consumer import ConsumerLoop
from streamrl.common.follower import StreamFollower
from streamrl.common.health import heartbeat_forever
from streamrl.common.messages import BatchManifest, PromptWorkItem, Tensor, TrainingBatch, Trajectory, WeightsPublished
from streamrl.common.payloads import store_payloads
from streamrl.common.streams import StreamNames

logger = logging.getLogger("fleet_sim")
STATS_FIELD = "fleet_sim"
"""Name of the run-state hash the simulators write their counters to."""
STATS_EVERY_S = 1.0
WORKER_MAX_CONNECTIONS = 8
"""Connections each simulated worker opens at most (a real worker is a process with its own pool)."""


class VersionBoard:
    """The policy version this process serves, and a way to wait for a newer one."""

    def __init__(self) -> None:
        self.version = -1
        self.changed = asyncio.Condition()

    async def set(self, version: int) -> None:
        async with self.changed:
            self.version = max(self.version, version)
            self.changed.notify_all()

    async def wait_for(self, version: int) -> None:
        async with self.changed:
            await self.changed.wait_for(lambda: self.version >= version)


class Payload:
    """The bytes every simulated response carries (built once)."""

    def __init__(self, response_tokens: int, text_chars_per_token: int, seed: int) -> None:
        rng = np.random.default_rng(seed)
        self.response_ids = Tensor.from_numpy(rng.integers(0, 151_000, response_tokens, dtype=np.int32))
        self.logprobs = Tensor.from_numpy(-rng.exponential(1.0, response_tokens).astype(np.float32))
        self.loss_mask = Tensor.from_numpy(np.ones(response_tokens, dtype=np.uint8))
        words = [f"w{i % 997}" for i in range(response_tokens)]
        self.text = " ".join(words)[: response_tokens * text_chars_per_token - 2]
        self.text += " " * (response_tokens * text_chars_per_token - 2 - len(self.text))


class SimWorker:
    """One simulated rollout worker: ``num_gpus`` GPUs behind one consumer (see the module docstring)."""

    def __init__(
        self, name: str, bus: Bus, names: StreamNames, args: argparse.Namespace, board: VersionBoard, payload: Payload
    ) -> None:
        self.name = name
        self.bus = bus
        self.names = names
        self.board = board
        self.payload = payload
        self.generation_s = args.seqs_per_gpu * args.response_tokens / args.tokens_per_s
        slots = args.gpus_per_worker * (args.seqs_per_gpu // args.group_size)
        self.gpus = asyncio.Semaphore(slots)
        """One permit per group the worker's GPUs decode at once."""
        self.first = slots
        """Slots whose first group is still to start (it takes a random fraction of generation_s)."""
        self.generated = 0
        # a few prompts more than the GPUs hold, as an engine queues requests past its batch: a group
        # whose commit is in flight frees its GPU at once
        in_flight = slots + max(1, slots // 8)
        self.config = ConsumerConfig(
            max_in_flight=in_flight, count=in_flight, heartbeat_interval_s=args.heartbeat_interval_s
        )
        self.loop: ConsumerLoop[PromptWorkItem] = ConsumerLoop(
            bus,
            names,
            stream=names.prompts,
            group="rollout",
            consumer=name,
            handler=self.handle,
            message_type=PromptWorkItem,
            config=self.config,
        )

    async def handle(self, item: PromptWorkItem) -> list[Output]:
        await self.board.wait_for(item.policy_version)
        async with self.gpus:
            version_start = self.board.version
            started = time.time()
            seconds = self.generation_s
            if self.first > 0:
                self.first -= 1
                seconds *= random.random()
            await asyncio.sleep(seconds)
            ended = time.time()
        timings = {"queue_s": max(0.0, started - item.issued_at), "generate_s": ended - started, "started_at": started}
        n = item.sampling.n
        self.generated += n
        # as the real worker: each payload SET once, the commit carries records (streamrl.common.payloads)
        return await store_payloads(
            self.bus, self.names, [self.trajectory(item, j, version_start, timings) for j in range(n)]
        )

    def trajectory(self, item: PromptWorkItem, j: int, version_start: int, timings: dict[str, float]) -> Trajectory:
        """Sample ``j`` of ``item``, with the fields the real worker sets (``rollout/service.py``)."""
        p = self.payload
        return Trajectory(
            id=f"{item.id}/{j}",
            group_id=item.id,
            group_index=j,
            group_size=item.sampling.n,
            prompt_ids=item.prompt_ids,
            response_ids=p.response_ids,
            logprobs=p.logprobs,
            loss_mask=p.loss_mask,
            prompt_text=item.prompt_text,
            response_text=p.text[:-1] + str(j % 10),
            finish_reason="stop",
            sampling=item.sampling,
            policy_version_start=version_start,
            policy_version_end=self.board.version,
            label=item.label,
            metadata=item.metadata,
            timings=dict(timings),
            traceparent=item.traceparent,
        )

    async def run(self, stop: asyncio.Event) -> None:
        beat = asyncio.create_task(
            heartbeat_forever(
                self.bus.redis,
                self.names,
                "rollout",
                self.name,
                self.config.heartbeat_interval_s,
                self.snapshot,
            )
        )
        try:
            await self.loop.run(stop)
        finally:
            beat.cancel()

    def snapshot(self) -> dict[str, int | str]:
        s = self.loop.stats
        return {
            "processed": s.processed,
            "failed": s.failed,
            "retried": s.retried,
            "dead_lettered": s.dead_lettered,
            "in_flight": s.in_flight,
            "policy_version": self.board.version,
            "status": "running",
        }


async def run_rollout(args: argparse.Namespace) -> None:
    names = StreamNames(args.run_id)
    shared = connect(args.redis_url, max_connections=16)
    board = VersionBoard()
    payload = Payload(args.response_tokens, args.text_chars_per_token, seed=args.first_worker)
    workers = [
        SimWorker(
            f"sim-{args.first_worker + i}",
            Bus(connect(args.redis_url, max_connections=WORKER_MAX_CONNECTIONS)),
            names,
            args,
            board,
            payload,
        )
        for i in range(args.workers)
    ]

    async def on_weights(entries: list[tuple[str, WeightsPublished]], last_id: str) -> str:
        if entries:
            version = max(e.version for _, e in entries)
            await board.set(version)
            await shared.hset(names.served_versions, mapping={w.name: version for w in workers})
        return last_id

    follower = StreamFollower(shared, names.weights, lambda f: decode(f[PAYLOAD_FIELD], WeightsPublished), on_weights)
    stop = _stop_on_signals()
    tasks = [asyncio.create_task(follower.run("0-0", stop))]
    tasks += [asyncio.create_task(w.run(stop)) for w in workers]
    sample = encode(
        Trajectory(
            id="p0/0",
            group_id="p0",
            group_index=0,
            group_size=args.group_size,
            prompt_ids=Tensor.from_numpy(np.zeros(args.prompt_tokens, np.int32)),
            response_ids=payload.response_ids,
            logprobs=payload.logprobs,
            loss_mask=payload.loss_mask,
            prompt_text="x" * args.prompt_tokens * 4,
            response_text=payload.text,
        )
    )
    field = f"rollout-{args.first_worker}"
    while not stop.is_set():
        stats = {
            "generated": sum(w.generated for w in workers),
            "trajectory_bytes": len(sample),
            "in_flight": sum(w.loop.stats.in_flight for w in workers),
            "version": board.version,
            "failed": sum(w.loop.stats.failed for w in workers),
            "t": time.time(),
        }
        await shared.hset(names.state(STATS_FIELD), field, json.dumps(stats))
        await wait_set(stop, STATS_EVERY_S)
    await asyncio.gather(*tasks, return_exceptions=True)


async def run_learner(args: argparse.Namespace) -> None:
    names = StreamNames(args.run_id)
    bus = Bus(connect(args.redis_url))
    state = {"version": 0, "samples": 0, "batches": 0}

    def published(version: int, batch_id: str) -> list[Output]:
        event = WeightsPublished(
            version=version,
            step=version,
            batch_id=batch_id,
            checksum="simulated",
            num_bytes=0,
            num_buckets=0,
            endpoint="",
            metrics={"learner/loss/policy": 0.0},
            published_at=time.time(),
        )
        return [
            Output(stream=names.weights, message=event),
            Output(key=names.state("learner"), field="published", message=event),
        ]

    turn = asyncio.Condition()
    order = {"taken": 0, "trained": 0}
    held: dict[str, list[str]] = {}
    """Per batch read, the keys of its payloads and parts (deleted once it is acknowledged)."""

    async def handle(entry: TrainingBatch | BatchManifest) -> list[Output]:
        # batches train one at a time, in order; the next one's payloads are read while one trains (two in flight)
        mine = order["taken"]
        order["taken"] += 1
        try:
            batch = entry
            if isinstance(entry, BatchManifest):
                whole = await load_manifest(bus.redis, entry, max_reply_bytes=bus.max_command_bytes)
                held[entry.id] = whole.buffers  # a split manifest's header names its parts, not the payloads
                batch = await fetch_batch(bus.redis, whole, max_reply_bytes=bus.max_command_bytes)
            async with turn:
                await turn.wait_for(lambda: order["trained"] == mine)
            await asyncio.sleep(args.step_s)
            state["version"] += 1
            state["batches"] += 1
            state["samples"] += len(batch.samples)
            return published(state["version"], batch.id)
        finally:
            async with turn:
                order["trained"] = max(order["trained"], mine + 1)
                turn.notify_all()

    await bus.commit(published(0, ""))

    async def trained(entry_id: str, entry: TrainingBatch | BatchManifest) -> None:
        if isinstance(entry, BatchManifest):
            if keys := owned_buffers(names, entry.id, [*held.pop(entry.id, []), *entry.buffers]):
                pipe = bus.redis.pipeline(transaction=False)  # a command a key, as the learner deletes them
                for key in keys:
                    pipe.unlink(key)
                await pipe.execute()

    loop: ConsumerLoop[TrainingBatch | BatchManifest] = ConsumerLoop(
        bus,
        names,
        stream=names.batches,
        group="learner",
        consumer="learner",
        handler=handle,
        message_type=(BatchManifest, TrainingBatch),
        config=ConsumerConfig(max_in_flight=2, count=1),
        max_message_bytes=None,
        on_committed=trained,
    )
    stop = _stop_on_signals()
    task = asyncio.create_task(loop.run(stop))
    while not stop.is_set():
        await bus.redis.hset(names.state(STATS_FIELD), "learner", json.dumps({**state, "t": time.time()}))
        await wait_set(stop, STATS_EVERY_S)
    await task


def _stop_on_signals() -> asyncio.Event:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    return stop


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("role", choices=["rollout", "learner"])
    parser.add_argument("--redis-url", required=True)
    parser.add_argument("--run-id", required=True)
    parser.add_argument("--workers", type=int, default=1, help="rollout: simulated workers in this process")
    parser.add_argument("--first-worker", type=int, default=0, help="rollout: index of this process's first worker")
    parser.add_argument("--gpus-per-worker", type=int, default=8)
    parser.add_argument("--tokens-per-s", type=float, default=5000.0)
    parser.add_argument("--response-tokens", type=int, default=8192)
    parser.add_argument("--prompt-tokens", type=int, default=512)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--seqs-per-gpu", type=int, default=8)
    parser.add_argument("--text-chars-per-token", type=int, default=4)
    parser.add_argument("--heartbeat-interval-s", type=float, default=2.0)
    parser.add_argument("--step-s", type=float, default=2.0, help="learner: seconds per step")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    aio.run(run_rollout(args) if args.role == "rollout" else run_learner(args))


if __name__ == "__main__":
    main()
