"""CoordinatorService: owns the run — prompts, policy version, staleness, batching, evaluation.

Components, all in this process, wired by :meth:`CoordinatorService.run`:

* a consumer loop on ``scored``: stores each scored trajectory in its group's Redis hash
  (atomically with the ack, de-duplicated by trajectory id);
* a tail of ``weights``: the learner's WeightsPublished events raise the policy version (kept in
  Redis, never decreasing) and carry the learner's step metrics;
* a tail of ``dead``: dead-lettered prompts/trajectories fail their group (counted, with reason),
  so replacement prompts are issued instead of waiting forever;
* one ``tick`` task that, every few ms: completes groups (dynamic filtering), builds batches of
  complete groups, issues prompts under admission control, runs evaluation rounds, updates the
  progress hash and metrics, and ends the run after ``total_steps``.

All run state lives in Redis (``streamrl:{run}:state:*``), so a restarted coordinator continues.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from typing import Any

import numpy as np

from streamrl.common.aio import cancel_and_wait, wait_set
from streamrl.common.bus import Output
from streamrl.common.codec import decode, encode
from streamrl.common.consumer import ConsumerLoop
from streamrl.common.errors import MessageTooLargeError, PoisonMessageError
from streamrl.common.follower import StreamFollower
from streamrl.common.lifecycle import ServiceContext
from streamrl.common.messages import (
    DeadLetter,
    PromptWorkItem,
    SamplingParams,
    ScoredTrajectory,
    Tensor,
    TrainingBatch,
    Trajectory,
    WeightsPublished,
)
from streamrl.common.weights_auth import check, weights_key
from streamrl.coordinator.admission import groups_admissible, required_version, staleness
from streamrl.coordinator.batching import ReadyGroup, select_groups
from streamrl.coordinator.config import CoordinatorConfig
from streamrl.coordinator.filtering import has_spread
from streamrl.coordinator.metrics import MetricsWriter, plot
from streamrl.coordinator.prompts import PromptSource

logger = logging.getLogger(__name__)
TICK_S = 0.05
"""Longest pause between two ticks; stored trajectories and new versions wake the tick at once."""
MOVE_GROUP_LUA = """
if redis.call('SREM', KEYS[1], ARGV[1]) == 0 then return 0 end
if ARGV[2] == '1' then
  redis.call('RPUSH', KEYS[2], ARGV[1]); redis.call('INCR', KEYS[3])
else
  redis.call('DEL', KEYS[4]); redis.call('INCR', KEYS[5])
end
return 1
"""
"""A complete group leaves ``inflight`` for ``ready`` (kept) or is dropped (filtered) - once."""
WAKE_BATCH_S = 0.002
"""After a wake-up, wait this long so one tick handles a whole burst of stored trajectories."""
FULL_CHECK_S = 1.0
"""Every so often a tick checks every in-flight group and evaluation round, not only touched ones."""


def eval_round_key(version: int) -> str:
    return f"eval-v{version}"


def buffer_group(traj: Trajectory) -> str:
    """The group buffer a scored trajectory is stored in: its group, or its evaluation round."""
    return eval_round_key(int(traj.metadata.get("eval_version", 0))) if traj.is_eval else traj.group_id


class CoordinatorService:
    """See the module docstring."""

    def __init__(self, config: CoordinatorConfig, ctx: ServiceContext) -> None:
        self.cfg = config
        self.ctx = ctx
        self.redis = ctx.bus.redis
        self.names = ctx.names
        self.source = PromptSource(config.dataset)
        self.eval_source = PromptSource(config.eval.dataset) if config.eval.dataset else None
        self.metrics = MetricsWriter(config.run_dir)
        self.version = 0
        self.dead_reasons: Counter[str] = Counter()
        self.last_batch_time = time.monotonic()
        self.progress: dict[str, Any] = {}
        self.too_stale_since_batch = 0
        self.wake = asyncio.Event()
        """Set when a scored trajectory is stored or a version is published: the tick runs at once."""
        self.touched: set[str] = set()
        """Groups (and evaluation rounds) that received a trajectory since the last tick looked."""
        self.full_check_at = 0.0
        self.eval_pending = 0
        """Evaluation rounds issued and not yet closed (as of the last look)."""
        self.next_plot_at = 0.0
        self.learner_ready = False
        self.said_waiting = False
        self.published_progress: dict[str, str] = {}
        self.weights_key = weights_key()

    # -- state in redis -------------------------------------------------------------------
    def _state(self, name: str) -> str:
        return self.names.state(name)

    async def _get_int(self, name: str) -> int:
        raw = await self.redis.get(self._state(name))
        return int(raw) if raw is not None else 0

    # -- entry ------------------------------------------------------------------------------
    async def run(self) -> None:
        self.version = await self._get_int("policy_version")
        logger.info(
            "coordinator: %d prompts, group size %d, %d groups/step, max staleness %d, resuming at version %d",
            len(self.source), self.cfg.group_size, self.cfg.prompts_per_step, self.cfg.max_staleness, self.version,
        )  # fmt: skip
        scored_loop: ConsumerLoop[ScoredTrajectory] = ConsumerLoop(
            self.ctx.bus, self.names, stream=self.names.scored, group="coordinator", consumer="coordinator",
            handler=self.handle_scored, message_type=ScoredTrajectory, config=self.cfg.consumer,
            dedupe_key=lambda m: m.trajectory.id, on_committed=self._on_scored_committed,
        )  # fmt: skip
        self.ctx.loops.append(scored_loop)
        self.ctx.mark_running()
        self.ctx.policy_version = self.version
        done = asyncio.Event()
        stop_all = asyncio.Event()
        tasks = {
            asyncio.create_task(scored_loop.run(stop_all)): "scored consumer",
            asyncio.create_task(
                self._tail(self.names.weights, "weights_cursor", self.on_weights, stop_all)
            ): "weights tail",
            asyncio.create_task(self._tail(self.names.dead, "dead_cursor", self.on_dead, stop_all)): "dead-letter tail",
            asyncio.create_task(self._tick_forever(done, stop_all)): "tick",
        }
        # A component that ends early (a bug raising in it) stops the run loudly instead of leaving
        # the others waiting for it forever.
        ends = [asyncio.create_task(self.ctx.stop.wait()), asyncio.create_task(done.wait())]
        await asyncio.wait([*ends, *tasks], return_when=asyncio.FIRST_COMPLETED)
        await cancel_and_wait(ends)
        stop_all.set()
        finished, hung = await asyncio.wait(tasks, timeout=self.cfg.consumer.shutdown_grace_s + 5.0)
        for task in hung:
            logger.error("coordinator %s did not stop within the grace period; cancelling it", tasks[task])
        await cancel_and_wait(hung)
        self.metrics.close()
        plot(self.cfg.run_dir)
        for task in finished:
            if not task.cancelled() and task.exception() is not None:
                logger.error("coordinator %s failed", tasks[task], exc_info=task.exception())
                raise task.exception()  # type: ignore[misc]
        if not done.is_set() and not self.ctx.stop.is_set():
            raise RuntimeError(f"coordinator {', '.join(tasks[t] for t in finished)} ended before the run did")

    async def _tail(self, stream: str, cursor_name: str, handle: Any, stop: asyncio.Event) -> None:
        """Follow a broadcast stream from a cursor saved in redis (at-least-once, handlers idempotent)."""
        cursor = (await self.redis.get(self._state(cursor_name)) or b"0-0").decode()

        async def each(entries: list[tuple[str, Any]], last_id: str) -> str:
            for _, msg in entries:
                await handle(msg)
            await self.redis.set(self._state(cursor_name), last_id)
            return last_id

        await StreamFollower(self.redis, stream, self._decode_followed, each, block_ms=200).run(cursor, stop)

    def _decode_followed(self, fields: dict[bytes, bytes]) -> Any:
        """An entry of a followed stream; a weights event must carry this run's signature (when there is a key)."""
        msg = decode(fields.get(b"d", b""))
        if isinstance(msg, WeightsPublished):
            check(msg, self.weights_key)  # a forged version must not move the run
        return msg

    # -- handlers ---------------------------------------------------------------------------
    async def handle_scored(self, msg: ScoredTrajectory) -> list[Output]:
        traj = msg.trajectory
        return [Output(key=self.names.group_buffer(buffer_group(traj)), field=traj.id, message=msg)]

    async def _on_scored_committed(self, entry_id: str, msg: ScoredTrajectory) -> None:
        self.touched.add(buffer_group(msg.trajectory))
        self.wake.set()

    async def on_weights(self, msg: Any) -> None:
        if not isinstance(msg, WeightsPublished):
            return
        self.wake.set()
        if msg.version > self.version:
            # the version's evaluation round is registered before the version counts: otherwise a
            # tick in between could find the run complete with no round pending, and end it
            await self._maybe_start_eval(msg.version)
            self.version = msg.version
            await self.redis.set(self._state("policy_version"), self.version)
            self.ctx.policy_version = self.version
        if msg.metrics:
            self.metrics.write(msg.version, dict(msg.metrics))
            self.progress.update({"loss": round(msg.metrics.get("learner/loss/policy", float("nan")), 4)})
        self.progress["version"] = self.version
        await self._maybe_plot()

    async def on_dead(self, msg: Any) -> None:
        if not isinstance(msg, DeadLetter):
            return
        self.dead_reasons[msg.error.split(":")[0]] += 1
        self.progress["dead"] = sum(self.dead_reasons.values())
        self.progress["dead_reason"] = msg.error[:240]
        logger.error("dead letter from %s: %s", msg.stream, msg.error)
        self.metrics.write(self.version, {
            "coordinator/dead_letters": sum(self.dead_reasons.values()),
            "coordinator/dead_reason": msg.error[:500],
            "coordinator/dead_stream": msg.stream.rsplit(":", 1)[-1],
        })  # fmt: skip
        try:
            inner = decode(msg.payload)
        except PoisonMessageError:
            return
        group = None
        if isinstance(inner, PromptWorkItem):
            group = inner.id
        elif isinstance(inner, Trajectory):
            group = inner.group_id
        elif isinstance(inner, ScoredTrajectory):
            group = inner.trajectory.group_id
        if group and await self.redis.srem(self._state("inflight"), group):
            await self.redis.delete(self.names.group_buffer(group))
            await self.redis.incr(self._state("groups_dead"))
            logger.warning("group %s failed (dead-lettered member): a replacement prompt will be issued", group)

    # -- the tick ---------------------------------------------------------------------------
    async def _tick_forever(self, done: asyncio.Event, stop: asyncio.Event) -> None:
        await self._maybe_start_eval(self.version)
        while not stop.is_set():
            # Usually only the groups that received trajectories are looked at; every FULL_CHECK_S
            # all of them are (after a restart nothing is "touched" yet).
            full = time.monotonic() >= self.full_check_at
            if full:
                self.full_check_at = time.monotonic() + FULL_CHECK_S
            touched, self.touched = self.touched, set()
            await self._complete_groups(None if full else touched)
            await self._build_batches()
            await self._issue_prompts()
            evals_done = await self._finish_eval_rounds(full or any(g.startswith("eval-") for g in touched))
            # the run ends on a fresh look at the rounds, never on the count remembered from an
            # earlier look (a round may have been started since)
            if evals_done and self._run_complete() and await self._finish_eval_rounds(look=True):
                done.set()
                return
            await self._publish_progress()
            if await wait_set(self.wake, TICK_S):
                await asyncio.sleep(WAKE_BATCH_S)  # let the rest of a burst of commits land first
            self.wake.clear()

    def _run_complete(self) -> bool:
        return self.version >= self.cfg.total_steps

    async def _complete_groups(self, candidates: set[str] | None) -> None:
        """Move complete groups to ``ready`` (or drop them: dynamic filtering); only ``candidates``
        are checked unless None (all in-flight groups). A group moves once: the move is one script
        that first takes it out of ``inflight``."""
        if candidates is None:
            groups = [g.decode() for g in await self.redis.smembers(self._state("inflight"))]
        else:
            groups = [g for g in candidates if not g.startswith("eval-")]
        if not groups:
            return
        pipe = self.redis.pipeline(transaction=False)
        for g in groups:
            pipe.hlen(self.names.group_buffer(g))
            pipe.sismember(self._state("inflight"), g)
        replies = await pipe.execute()
        complete = [g for g, size, in_flight in zip(groups, replies[::2], replies[1::2], strict=True)
                    if size >= self.cfg.group_size and in_flight]  # fmt: skip
        if not complete:
            return
        members = await self._groups_samples(complete) if self.cfg.dynamic_filtering else {}
        pipe = self.redis.pipeline(transaction=False)
        for group in complete:
            keep = has_spread([s.score for s in members[group]]) if self.cfg.dynamic_filtering else True
            keys = [self._state("inflight"), self._state("ready"), self._state("accepted"),
                    self.names.group_buffer(group), self._state("groups_filtered")]  # fmt: skip
            pipe.eval(MOVE_GROUP_LUA, len(keys), *keys, group, int(keep))
        await pipe.execute()

    async def _groups_samples(self, groups: list[str]) -> dict[str, list[ScoredTrajectory]]:
        """The stored samples of each group (one round trip), in sample order."""
        pipe = self.redis.pipeline(transaction=False)
        for group in groups:
            pipe.hgetall(self.names.group_buffer(group))
        out = {}
        for group, raw in zip(groups, await pipe.execute(), strict=True):
            samples = [decode(v, ScoredTrajectory) for v in raw.values()]
            out[group] = sorted(samples, key=lambda s: s.trajectory.group_index)
        return out

    async def _build_batches(self) -> None:
        per_step = self.cfg.prompts_per_step
        while await self.redis.llen(self._state("ready")) >= per_step:
            index = await self._get_int("batch_index")
            ready_ids = [g.decode() for g in await self.redis.lrange(self._state("ready"), 0, -1)]
            members = await self._groups_samples(ready_ids)
            ready = [ReadyGroup(g, min(s.trajectory.policy_version_start for s in members[g])) for g in ready_ids]
            pick = select_groups(ready, index=index, max_staleness=self.cfg.max_staleness, per_step=per_step,
                                 drop_stale=self.cfg.staleness_policy == "drop")  # fmt: skip
            if pick.too_stale:
                num = sum(len(members[g.group_id]) for g in pick.too_stale)
                pipe = self.redis.pipeline(transaction=True)
                for g in pick.too_stale:
                    pipe.lrem(self._state("ready"), 1, g.group_id)
                    pipe.delete(self.names.group_buffer(g.group_id))
                pipe.decrby(self._state("accepted"), len(pick.too_stale))  # their replacements get issued
                pipe.incrby(self._state("samples_too_stale"), num)
                await pipe.execute()
                self.too_stale_since_batch += num
                logger.warning("dropped %d groups (%d samples) over max_staleness=%d for batch %d",
                               len(pick.too_stale), num, self.cfg.max_staleness, index)  # fmt: skip
            if not pick.chosen:
                return
            samples = [s for g in pick.chosen for s in members[g.group_id]]
            batch = TrainingBatch(
                id=f"batch-{index}", index=index, samples=samples, policy_version=self.version,
                staleness=[staleness(index, s.trajectory.policy_version_start) for s in samples],
                created_at=time.time(),
            )  # fmt: skip
            pipe = self.redis.pipeline(transaction=True)
            pipe.xadd(self.names.batches, {b"d": encode(batch)}, maxlen=self.cfg.redis.maxlen, approximate=True)
            for g in pick.chosen:
                pipe.lrem(self._state("ready"), 1, g.group_id)
                pipe.delete(self.names.group_buffer(g.group_id))
            pipe.incr(self._state("batch_index"))
            await pipe.execute()
            self._record_batch(batch, self.too_stale_since_batch)
            self.too_stale_since_batch = 0

    def _record_batch(self, batch: TrainingBatch, num_too_stale: int) -> None:
        now = time.monotonic()
        rewards = np.array([s.reward for s in batch.samples], dtype=np.float64)
        scores = np.array([s.score for s in batch.samples], dtype=np.float64)
        lengths = np.array([len(s.trajectory.response_ids) for s in batch.samples], dtype=np.float64)
        truncated = np.array([s.trajectory.truncated for s in batch.samples], dtype=np.float64)
        partial = np.array(
            [s.trajectory.policy_version_end != s.trajectory.policy_version_start for s in batch.samples],
            dtype=np.float64,
        )
        elapsed = max(now - self.last_batch_time, 1e-6)
        self.last_batch_time = now
        stats = {
            "rollout/reward_mean": float(rewards.mean()) if rewards.size else 0.0,
            "rollout/acc": float(scores.mean()) if scores.size else 0.0,
            "rollout/response_len_mean": float(lengths.mean()) if lengths.size else 0.0,
            "rollout/truncated_frac": float(truncated.mean()) if truncated.size else 0.0,
            "rollout/partial_frac": float(partial.mean()) if partial.size else 0.0,
            "rollout/tokens_per_s": float(lengths.sum() / elapsed),
            "coordinator/staleness_mean": float(np.mean(batch.staleness)) if batch.staleness else 0.0,
            "coordinator/staleness_max": int(max(batch.staleness, default=0)),
            "coordinator/samples_too_stale": num_too_stale,
            "coordinator/batch_samples": len(batch.samples),
            "rollout/generation_started_min": min(
                (s.trajectory.timings.get("started_at", 0.0) for s in batch.samples), default=0.0
            ),
        }
        self.metrics.write(batch.index, stats)
        self.progress.update({
            "step": batch.index + 1,
            "reward": round(stats["rollout/reward_mean"], 3),
            "acc": round(stats["rollout/acc"], 3),
            "staleness": round(stats["coordinator/staleness_mean"], 2),
            "tok/s": round(stats["rollout/tokens_per_s"], 1),
        })  # fmt: skip
        logger.info("batch %d: %s", batch.index, " ".join(f"{k}={v:.3g}" for k, v in stats.items()))

    async def _learner_ready(self) -> bool:
        """A learner has published weights (any version): it can train what the prompts produce."""
        if not self.learner_ready:
            self.learner_ready = (
                not self.cfg.wait_for_learner or self.version > 0 or await self.redis.xlen(self.names.weights) > 0
            )
            if self.learner_ready:
                logger.info("a learner is ready: issuing prompts")
            elif not self.said_waiting:
                self.said_waiting = True
                logger.info("waiting for a learner to publish its weights before issuing prompts "
                            "(coordinator.wait_for_learner = false issues them at once)")  # fmt: skip
        return self.learner_ready

    async def _issue_prompts(self) -> None:
        if not await self._learner_ready():
            return
        inflight = await self.redis.scard(self._state("inflight"))
        accepted = await self._get_int("accepted")
        cfg = self.cfg
        budget = groups_admissible(
            accepted=accepted, in_flight=inflight, version=self.version, max_staleness=cfg.max_staleness,
            prompts_per_step=cfg.prompts_per_step, total_steps=cfg.total_steps, prefetch_steps=cfg.prefetch_steps,
        )  # fmt: skip
        if budget == 0:
            return
        s = cfg.sampling
        sampling = SamplingParams(
            temperature=s.temperature, top_p=s.top_p, top_k=s.top_k, max_new_tokens=s.max_new_tokens,
            min_new_tokens=s.min_new_tokens, n=cfg.group_size, seed=s.seed,
        )  # fmt: skip
        cursor = await self._get_int("cursor")
        pipe = self.redis.pipeline(transaction=True)
        issued = 0
        for i in range(budget):
            prompt = self.source.get(cursor + i)
            needs = required_version(position=accepted + inflight + issued, version=self.version,
                                     max_staleness=cfg.max_staleness, prompts_per_step=cfg.prompts_per_step)  # fmt: skip
            item = PromptWorkItem(
                id=f"p{cursor + i}", prompt_ids=Tensor.from_list(prompt.ids, "int32"), prompt_text=prompt.text,
                label=prompt.label, metadata=prompt.metadata, sampling=sampling, policy_version=needs,
                issued_at=time.time(),
            )  # fmt: skip
            try:
                payload = self.ctx.bus.encode(item, self.names.prompts)
            except MessageTooLargeError as e:
                self.dead_reasons["prompt too large"] += 1
                logger.warning("skipping dataset prompt %d: %s", (cursor + i) % len(self.source), e)
                continue
            pipe.xadd(self.names.prompts, {b"d": payload}, maxlen=cfg.redis.maxlen, approximate=True)
            pipe.sadd(self._state("inflight"), item.id)
            issued += 1
        pipe.incrby(self._state("cursor"), budget)
        await pipe.execute()

    # -- evaluation ---------------------------------------------------------------------------
    async def _maybe_start_eval(self, v: int) -> None:
        """Start the evaluation round of version ``v`` if one is due and was not started before."""
        if self.eval_source is None:
            return
        if not (v % self.cfg.eval.every_steps == 0 or v == self.cfg.total_steps):
            return
        if not await self.redis.hsetnx(self._state("eval_rounds"), str(v), f"started@{time.time():.3f}"):
            return  # already issued (e.g. before a restart)
        sampling = SamplingParams(temperature=0.0, max_new_tokens=self.cfg.eval.max_new_tokens, n=1)
        count = min(self.cfg.eval.num_prompts, len(self.eval_source))
        pipe = self.redis.pipeline(transaction=False)
        for i in range(count):
            prompt = self.eval_source.encode(i)
            item = PromptWorkItem(
                id=f"eval-v{v}-{i}", prompt_ids=Tensor.from_list(prompt.ids, "int32"), prompt_text=prompt.text,
                label=prompt.label, metadata={**prompt.metadata, "eval_version": v}, sampling=sampling,
                policy_version=v, issued_at=time.time(), is_eval=True,
            )  # fmt: skip
            pipe.xadd(self.names.prompts, {b"d": encode(item)}, maxlen=self.cfg.redis.maxlen, approximate=True)
        await pipe.execute()
        logger.info("evaluation round at version %d: %d greedy prompts issued", v, count)

    async def _finish_eval_rounds(self, look: bool = True) -> bool:
        """Close complete evaluation rounds; True when no round is pending (``look`` False: only
        report what is known)."""
        if self.eval_source is None:
            return True
        if not look:
            return self.eval_pending == 0
        rounds = {k.decode(): v.decode() for k, v in (await self.redis.hgetall(self._state("eval_rounds"))).items()}
        count = min(self.cfg.eval.num_prompts, len(self.eval_source))
        pending = 0
        for version, status in rounds.items():
            if not status.startswith("started"):
                continue
            key = self.names.group_buffer(eval_round_key(int(version)))
            if await self.redis.hlen(key) < count:
                pending += 1
                continue
            samples = [decode(v, ScoredTrajectory) for v in (await self.redis.hgetall(key)).values()]
            acc = float(np.mean([s.score for s in samples]))
            reward = float(np.mean([s.reward for s in samples]))
            started = float(status.partition("@")[2] or "nan")
            self.metrics.write(int(version), {
                "eval/acc": acc, "eval/reward_mean": reward, "eval/num_prompts": count,
                "eval/started_at": started, "eval/duration_s": time.time() - started,
                # the round asks for this version or newer: how much newer the engine actually was
                "eval/version_lag_max": max(s.trajectory.policy_version_end for s in samples) - int(version),
            })  # fmt: skip
            self.progress["eval_acc"] = round(acc, 3)
            logger.info("evaluation at version %s: greedy accuracy %.3f over %d held-out prompts", version, acc, count)
            pipe = self.redis.pipeline(transaction=True)
            pipe.hset(self._state("eval_rounds"), version, f"{acc:.6f}")
            pipe.delete(key)
            await pipe.execute()
            await self._maybe_plot()
        self.eval_pending = pending
        return pending == 0

    async def _maybe_plot(self) -> None:
        if time.monotonic() >= self.next_plot_at:
            self.next_plot_at = time.monotonic() + self.cfg.plot_every_s
            await asyncio.to_thread(plot, self.cfg.run_dir)

    async def _publish_progress(self) -> None:
        if self.progress:
            self.progress["version"] = self.version
            shown = {k: str(v) for k, v in self.progress.items()}
            if shown != self.published_progress:
                await self.redis.hset(self._state("progress"), mapping=shown)
                self.published_progress = shown
