"""The bytes a run holds in Redis: an upper bound computed from its config (docs/operations.md states it).

Everything a run writes is bounded by its in-flight work, has a lifetime, or grows with the run's
length by a fixed amount per step; the bound adds up each term (:func:`memory_bound`):

* **in flight**: the coordinator admits groups for ``H = max_staleness + prefetch_steps + 1``
  batches ahead of the learner (:mod:`streamrl.coordinator.admission`), ``N = H x B`` samples with
  ``B = prompts_per_step x group_size``. Each sample's payload is one string (``payload:``, renamed
  ``batched:`` once batched) and its record sits in one place at a time (a trajectory or scored entry, a
  group buffer, the batch's manifest), counted at the largest of them (never less than a whole scored
  trajectory in one place, the first form of the contract); the groups' prompt items are counted besides.
* **retained batches**: the learner acknowledges a batch only once a checkpoint covers it, and deletes
  its payloads then, so up to ``min(checkpoint_every, total_steps)`` trained batches stay: each its
  manifest entry and its samples' hashes.
* **consumed, not yet trimmed**: streams are trimmed to what their groups still need every
  ``trim_interval_s``, keeping consumed entries ``redis.retain_consumed_s`` longer: at most
  ``L = ceil((retain_consumed_s + trim_interval_s) / min_step_s)`` batches' worth of every stream.
  Each stream also holds at most ``redis.maxlen`` entries (plus one listpack node of slack).
* **evaluation**: up to two open rounds of ``eval.num_prompts`` one-sample prompts, every stage.
* **the whole run**: one ``weights`` entry per version (4 KiB; 128 KiB when CUDA IPC or broadcast
  events list every tensor), a field per version in the coordinator's
  ``version_seen_at`` and ``eval_rounds`` hashes; dead letters kept (an assumption: the ``dead`` stream
  is capped only by ``redis.maxlen``).
* **run state**: the coordinator's per-group bookkeeping (in-flight set and hash, ready list) and the
  learner's batch fingerprints (the last 1,024 indices).
* **lifetimes**: operation (``once:``) keys - one per transaction, and per commit that acknowledges
  no entry - about ``(2 x prompts_per_step + 16) / min_step_s`` a second, each kept ``2 x outage_s``;
  heartbeats, leases and the instance set, per instance.
* **transient**: a batch's manifest is in Redis up to three more times while it is written and read
  (the writer's query buffer, the AOF buffer, the reader's reply buffer), plus one read of its
  payloads (at most ``redis.max_command_mb``, or one sample) and one read of scored entries.

Message sizes are those the real codec produces for the longest trajectory the config allows
(``prompt + response <= rollout.engine.max_model_len``, ``response <= max_new_tokens`` or, in
multi-turn episodes, ``rollout.environment.max_tokens``): prompt ids 4 bytes a token, response ids,
log-probs 4 each and the loss mask 1, texts at ``text_bytes_per_token``, plus the row's label and
metadata and the images. Redis's own costs are modelled as measured on redis-server 7 with jemalloc:
an allocation rounds up to jemalloc's size class (up to 25 % above the request), a stream entry of
its own listpack node costs ~64 bytes more, a pending entry ~160 bytes, a hash field ~80 plus its
name, a key with a TTL ~160 plus name and value. The integration test fills a real redis-server as
a run at its maximum would and checks ``used_memory`` stays under the bound and above half of it.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, fields
from typing import Any

import msgspec
from pydantic import ValidationError

from streamrl.common.codec import encode
from streamrl.common.messages import (
    RECORD_METADATA_BYTES,
    BatchManifest,
    Image,
    PromptWorkItem,
    SampleRef,
    SamplingParams,
    ScoredRecord,
    ScoredTrajectory,
    Tensor,
    Trajectory,
    Turn,
)
from streamrl.common.payloads import record_of

MIB = 2**20
BASE_BYTES = 4 * MIB
"""An empty redis-server, its script cache, its clients' fixed buffers (~1 MiB measured) and slack."""
NODE_BYTES = 4096
"""``stream-node-max-bytes``: entries share listpack nodes up to this size (Redis default)."""
STREAM_ENTRY_OVERHEAD = 64
"""A stream entry beyond its payload: listpack fields and the radix-tree node (measured 35-50 bytes)."""
PENDING_ENTRY_BYTES = 160
"""One entry in a consumer group's pending list (measured 92-157 bytes)."""
HASH_FIELD_OVERHEAD = 80
"""One field of a hash in table encoding beyond its name and value (measured ~75)."""
KEY_OVERHEAD = 160
"""A top-level key with a TTL beyond its name and value (measured ~100)."""
NODE_SLACK_ENTRIES = 100
"""``stream-node-max-entries``: an approximate trim (``~``) keeps up to one partial node more."""
INSTANCE_BYTES = 4096
"""Per service instance: heartbeat key, instance-set member, lease and its take count, served-version field,
group consumer."""
ONCE_KEY_BYTES = 320
"""One operation key (``once:{op}``): name, the stored replies, TTL."""
WEIGHTS_ENTRY_BYTES = {"zmq": 4096, "ipc": 128 * 1024, "broadcast": 128 * 1024, "relay": 4096}
"""One ``weights`` entry by ``learner.weights_transport``: the event, the step's metrics, the signature;
CUDA IPC and broadcast events also list every tensor (~100 bytes each: 1,000 tensors and more)."""
VERSION_FIELD_BYTES = 128
"""One field of the coordinator's per-version hashes (``version_seen_at``, ``eval_rounds``)."""
RUN_STATE_BYTES = 1024 * 160 + 64 * 1024
"""The learner's batch fingerprints (1,024 kept) and the coordinator's counters, cursors and progress hash."""
GROUP_STATE_BYTES = 384
"""Per group in flight: its in-flight set member, in-flight info field and ready-list entry."""
OPEN_EVAL_ROUNDS = 2
"""Evaluation rounds assumed open at once (a round is answered before the one after next opens)."""
METRICS_PER_SAMPLE = 8
"""Timings and reward metrics assumed per sample (names of ~24 characters, float values)."""


def jemalloc_size(n: int) -> int:
    """The bytes jemalloc hands out for a request of ``n`` (its size classes: 16-byte steps up to 128,
    then four classes per power of two), which is what Redis counts in ``used_memory``."""
    if n <= 8:
        return 8
    if n <= 128:
        return -(-n // 16) * 16
    spacing = 1 << ((n - 1).bit_length() - 3)
    return -(-n // spacing) * spacing


def stream_entry_bytes(payload: int, pending: bool = True) -> int:
    """Memory of one stream entry holding ``payload`` bytes (plus its pending-list entry when ``pending``).

    An entry under a node's size shares its listpack with others (rounding spread over the node); a
    larger one gets a node of its own, rounded up to a jemalloc size class."""
    own = payload + STREAM_ENTRY_OVERHEAD
    size = own if own < NODE_BYTES else jemalloc_size(own) + STREAM_ENTRY_OVERHEAD
    return size + (PENDING_ENTRY_BYTES if pending else 0)


def hash_field_bytes(payload: int, name: int = 40) -> int:
    """Memory of one hash field of ``name`` bytes holding ``payload`` bytes (table encoding)."""
    return jemalloc_size(payload + 16) + HASH_FIELD_OVERHEAD + name


@dataclass(frozen=True)
class RunShape:
    """What the bound depends on: the run's config, and a few assumptions about its data and speed."""

    prompts_per_step: int
    group_size: int
    max_staleness: int
    prefetch_steps: int
    total_steps: int
    checkpoint_every: int
    """``learner.checkpoint_every``: trained batches stay until a checkpoint covers them."""
    max_model_len: int
    """``rollout.engine.max_model_len``: prompt + response tokens of one trajectory at most."""
    response_tokens: int
    """Tokens after the prompt at most: ``coordinator.sampling.max_new_tokens``, or in multi-turn
    episodes ``rollout.environment.max_tokens``."""
    turns: int = 0
    """Turns recorded per trajectory (multi-turn episodes: ``rollout.environment.max_turns``)."""
    eval_prompts: int = 0
    """Prompts of one evaluation round (0: no evaluation)."""
    eval_response_tokens: int = 64
    maxlen: int = 100_000
    """``redis.maxlen``: entries per stream at most."""
    outage_s: float = 60.0
    """``redis.outage_s``: operation keys live twice this."""
    retain_consumed_s: float = 0.0
    """``redis.retain_consumed_s``: consumed entries kept this long before they are trimmed."""
    trim_interval_s: float = 5.0
    """How often a stream is trimmed (the consumer loop's reclaim round, ``consumer.claim_interval_s``)."""
    read_count: int = 16
    """``consumer.count``: entries one read returns at most."""
    instances: int = 4
    """Service instances alive at once (replicas, learner ranks)."""
    text_bytes_per_token: float = 6.0
    """UTF-8 bytes of prompt and response text per token (assumption)."""
    row_bytes: int = 1024
    """A dataset row's label and metadata, encoded (assumption)."""
    image_bytes: int = 0
    """Image bytes one prompt (and its trajectories) carries (assumption; vision-language runs)."""
    min_step_s: float = 0.25
    """The shortest learner step of the run (s): how fast entries pass through the streams."""
    dead_letters: int = 256
    """Sample-sized dead letters kept in the ``dead`` stream (assumption)."""
    dead_batches: int = 2
    """Batch-sized dead letters kept (a batch the learner skipped; assumption)."""
    max_message_bytes: int = 32 * MIB
    """``redis.max_message_mb``: no entry is larger (a skipped batch's letter keeps at most half)."""
    max_command_bytes: int = 8 * MIB
    """``redis.max_command_mb``: one read of a batch's payloads returns at most this (or one sample)."""
    weights_transport: str = "zmq"
    """``learner.weights_transport``: CUDA IPC and broadcast events list every tensor."""

    def __post_init__(self) -> None:
        if self.weights_transport not in WEIGHTS_ENTRY_BYTES:
            raise ValueError(
                f"RunShape.weights_transport: {self.weights_transport!r} is not one of {list(WEIGHTS_ENTRY_BYTES)}"
            )
        for f in fields(self):
            if f.name == "weights_transport":
                continue
            value = getattr(self, f.name)
            floor = 1 if f.name in _AT_LEAST_ONE else 0
            if not isinstance(value, (int, float)) or isinstance(value, bool) or value < floor:
                raise ValueError(f"RunShape.{f.name}: {value!r} must be a number >= {floor}")
        if self.min_step_s <= 0 or self.trim_interval_s <= 0:
            raise ValueError("RunShape.min_step_s and trim_interval_s must be > 0")
        if self.response_tokens >= self.max_model_len and self.max_model_len < 2:
            raise ValueError(f"RunShape.max_model_len: {self.max_model_len} leaves no room for a prompt")

    @property
    def batch_samples(self) -> int:
        """``B``: samples of one batch."""
        return self.prompts_per_step * self.group_size

    @property
    def horizon_batches(self) -> int:
        """``H``: batches' worth of groups admitted ahead of the learner."""
        return self.max_staleness + self.prefetch_steps + 1

    @property
    def lag_batches(self) -> int:
        """``L``: batches' worth of consumed entries a stream may still hold before it is trimmed."""
        return math.ceil((self.retain_consumed_s + self.trim_interval_s) / self.min_step_s)


_AT_LEAST_ONE = {
    "prompts_per_step",
    "group_size",
    "total_steps",
    "checkpoint_every",
    "max_model_len",
    "response_tokens",
    "eval_response_tokens",
    "maxlen",
    "read_count",
    "instances",
    "max_message_bytes",
    "max_command_bytes",
}


@dataclass(frozen=True)
class MessageSizes:
    """Encoded bytes of the largest message of each kind the run writes."""

    prompt: int
    trajectory: int
    scored: int
    batch: int
    """A batch's payloads together (its samples' scored trajectories)."""
    manifest: int
    """A batch's entry on ``batches``: its BatchManifest."""
    eval_prompt: int
    eval_scored: int
    record: int = 0
    """A sample's ScoredRecord (what streams, group buffers and manifests hold of it besides its payload)."""


def _text(n_bytes: float) -> str:
    return "x" * math.ceil(n_bytes)


def _scored(shape: RunShape, prompt_tokens: int, response_tokens: int) -> tuple[int, int, int, int]:
    """Encoded (prompt item, trajectory, scored trajectory, scored record) bytes for a sample of these token counts."""
    zeros = bytes(4 * max(prompt_tokens, response_tokens))
    images = [Image(media_type="image/png", data=bytes(shape.image_bytes))] if shape.image_bytes else []
    metadata = {"row": _text(shape.row_bytes)}
    prompt_ids = Tensor(dtype="int32", shape=[prompt_tokens], data=zeros[: 4 * prompt_tokens])
    prompt_text = _text(prompt_tokens * shape.text_bytes_per_token)
    traceparent = "00-" + "0" * 32 + "-" + "0" * 16 + "-01"
    sampling = SamplingParams(max_new_tokens=response_tokens, n=shape.group_size, seed=2**31)
    metrics = {f"metric_name_of_24_chars_{i}": 1.0e9 + i for i in range(METRICS_PER_SAMPLE)}
    item = PromptWorkItem(
        id="g" * 40,
        prompt_ids=prompt_ids,
        prompt_text=prompt_text,
        metadata=metadata,
        sampling=sampling,
        images=images,
        policy_version=2**31,
        issued_at=1.0e9,
        traceparent=traceparent,
    )
    traj = Trajectory(
        id="t" * 48,
        group_id="g" * 40,
        group_index=2**15,
        group_size=shape.group_size,
        prompt_ids=prompt_ids,
        response_ids=Tensor(dtype="int32", shape=[response_tokens], data=zeros[: 4 * response_tokens]),
        logprobs=Tensor(dtype="float32", shape=[response_tokens], data=zeros[: 4 * response_tokens]),
        loss_mask=Tensor(dtype="uint8", shape=[response_tokens], data=zeros[:response_tokens]),
        prompt_text=prompt_text,
        response_text=_text(response_tokens * shape.text_bytes_per_token),
        finish_reason="length",
        truncated=True,
        sampling=sampling,
        policy_version_start=2**31,
        policy_version_end=2**31,
        # partial rollout: a switch per version published while the group is in flight (H + 1 runs)
        policy_versions=[(2**31, 2**31)] * (shape.horizon_batches + 1),
        metadata=metadata,
        images=images,
        timings=metrics,
        traceparent=traceparent,
        turns=[Turn(start=2**31, end=2**31, policy_version=2**31, reward=1.5) for _ in range(shape.turns)],
        stop_reason="max_tokens",
    )
    scored = ScoredTrajectory(
        trajectory=traj,
        reward=1.5,
        score=0.5,
        turn_rewards=[1.5] * shape.turns,
        extra=metrics,
        scorer="s" * 32,
        reward_latency_ms=1.5,
        traceparent=traceparent,
    )
    key = f"streamrl:{{{'r' * RUN_ID_CHARS}}}:payload:{traj.id}:{'a' * 12}"
    record = ScoredRecord(
        trajectory=record_of(traj, key, 2**31),
        reward=scored.reward,
        score=scored.score,
        turn_rewards=scored.turn_rewards,
        extra=scored.extra,
        scorer=scored.scorer,
        reward_latency_ms=scored.reward_latency_ms,
        traceparent=traceparent,
    )
    record = msgspec.structs.replace(
        record,
        trajectory=msgspec.structs.replace(
            record.trajectory, metadata={"row": _text(min(shape.row_bytes, RECORD_METADATA_BYTES - 8))}
        ),
    )  # the most of a row's metadata a record keeps
    return len(encode(item)), len(encode(traj)), len(encode(scored)), len(encode(record))


def message_sizes(shape: RunShape) -> MessageSizes:
    """The largest encoded messages of the run: the longest response the config allows, the rest of the
    model's context as the prompt (``4 x prompt + 9 x response`` bytes of tensors is largest that way)."""
    response = min(shape.response_tokens, shape.max_model_len - 1)
    prompt, traj, scored, record = _scored(shape, shape.max_model_len - response, response)
    eval_response = min(shape.eval_response_tokens, shape.max_model_len - 1)
    eval_prompt, _, eval_scored, _ = _scored(shape, shape.max_model_len - eval_response, eval_response)
    batch_header = 256 + 9 * shape.batch_samples  # id, index, version, created_at, traceparent, staleness ints
    return MessageSizes(
        prompt=prompt,
        trajectory=traj,
        scored=scored,
        batch=batch_header + shape.batch_samples * scored,
        manifest=batch_header + shape.batch_samples * (sample_ref_bytes() + record),
        eval_prompt=eval_prompt,
        eval_scored=eval_scored,
        record=record,
    )


GROUP_ID_CHARS = 48
"""A group id's characters at most (``{run}-p{row}-...``; assumption), in a sample's reference."""
RUN_ID_CHARS = 48
"""A run id's characters at most (assumption), in the key names a reference holds."""


def sample_ref_bytes() -> int:
    """Encoded bytes of one sample's reference in a manifest (long ids, a trace context), each at most."""
    group = "g" * GROUP_ID_CHARS
    key = f"streamrl:{{{'r' * RUN_ID_CHARS}}}:batched:batch-{10**9}:{group}"
    ref = SampleRef(
        trajectory_id=f"{group}/{10**4}",
        group_id=group,
        key=key,
        field=f"{group}/{10**4}",
        policy_version_start=2**31,
        num_bytes=2**31,
        traceparent="00-" + "a" * 32 + "-" + "b" * 16 + "-01",
    )
    header = BatchManifest(id="", index=0, samples=[], policy_version=0, staleness=[])
    with_ref = BatchManifest(id="", index=0, samples=[ref], policy_version=0, staleness=[])
    return len(encode(with_ref)) - len(encode(header))


@dataclass(frozen=True)
class MemoryBound:
    """The bound, term by term (bytes); :attr:`total` is their sum."""

    terms: dict[str, int]
    sizes: MessageSizes
    shape: RunShape = field(repr=False)

    @property
    def total(self) -> int:
        return sum(self.terms.values())

    def describe(self) -> str:
        """One line: the total and each term in MiB, largest first."""
        parts = ", ".join(f"{k} {v / MIB:.1f}" for k, v in sorted(self.terms.items(), key=lambda kv: -kv[1]))
        return f"{self.total / MIB:.1f} MiB ({parts})"


def _stream(entries: int, payload: int, maxlen: int, pending: bool = True) -> int:
    """A stream holding ``entries`` entries of ``payload`` bytes, capped by ``maxlen`` (+ a node of slack)."""
    return min(entries, maxlen + NODE_SLACK_ENTRIES) * stream_entry_bytes(payload, pending)


def memory_bound(shape: RunShape) -> MemoryBound:
    """Upper bound on the bytes (``used_memory``) the run holds in Redis at any time, term by term."""
    s = message_sizes(shape)
    manifest = stream_entry_bytes(s.manifest)
    n_groups, n_samples = shape.horizon_batches * shape.prompts_per_step, shape.horizon_batches * shape.batch_samples
    lag_groups, lag_samples = shape.lag_batches * shape.prompts_per_step, shape.lag_batches * shape.batch_samples
    payload = jemalloc_size(s.trajectory) + KEY_OVERHEAD  # the payload string, written once
    batched_sample = max(hash_field_bytes(s.scored), payload) + manifest / shape.batch_samples  # + its reference
    rec = min(s.record, s.scored)  # a record never holds more than its trajectory's scored form
    record = max(stream_entry_bytes(rec), hash_field_bytes(rec), manifest / shape.batch_samples)
    per_sample = max(stream_entry_bytes(s.scored), batched_sample, payload + record)
    batch_hashes = shape.prompts_per_step * KEY_OVERHEAD  # the batched groups' hashes themselves
    eval_samples = OPEN_EVAL_ROUNDS * shape.eval_prompts
    dead_batch = min(s.manifest, shape.max_message_bytes // 2)
    payload_read = min(s.batch, max(shape.max_command_bytes, s.scored))
    once_rate = (2 * shape.prompts_per_step + 16) / shape.min_step_s
    terms = {
        "base": BASE_BYTES,
        "in_flight_samples": math.ceil(n_samples * per_sample),
        "in_flight_prompts": _stream(n_groups, s.prompt, shape.maxlen),
        "retained_batches": min(shape.checkpoint_every, shape.total_steps)
        * math.ceil(shape.batch_samples * batched_sample + batch_hashes),
        "consumed_untrimmed": (
            _stream(lag_groups, s.prompt, shape.maxlen, pending=False)
            + 2 * _stream(lag_samples, rec, shape.maxlen, pending=False)  # records on trajectories and scored
            + min(shape.lag_batches, shape.maxlen) * stream_entry_bytes(s.manifest, pending=False)
        ),
        "evaluation": eval_samples
        * (stream_entry_bytes(s.eval_prompt) + 2 * stream_entry_bytes(s.eval_scored) + hash_field_bytes(s.eval_scored)),
        "weights_and_versions": (
            min(shape.total_steps + 1, shape.maxlen)
            * stream_entry_bytes(WEIGHTS_ENTRY_BYTES[shape.weights_transport], pending=False)
            + 2 * (shape.total_steps + 1) * VERSION_FIELD_BYTES
        ),
        "dead_letters": (
            _stream(shape.dead_letters, s.scored + 512, shape.maxlen, pending=False)
            + shape.dead_batches * stream_entry_bytes(dead_batch + 512, pending=False)
        ),
        "run_state": RUN_STATE_BYTES + n_groups * GROUP_STATE_BYTES,
        "once_keys": math.ceil(once_rate * 2 * shape.outage_s) * ONCE_KEY_BYTES,
        "instances": shape.instances * INSTANCE_BYTES,
        "transient": 3 * jemalloc_size(s.manifest)
        + jemalloc_size(payload_read)
        + shape.read_count * jemalloc_size(s.scored),
    }
    return MemoryBound(terms=terms, sizes=s, shape=shape)


def maxmemory_for(bound: MemoryBound, margin: float = 2.0, floor: int = 64 * MIB) -> int:
    """The ``maxmemory`` ``streamrl up`` gives its embedded redis-server: ``margin`` times the bound, at
    least ``floor``, rounded up to a MiB."""
    if margin < 1:
        raise ValueError(f"margin {margin} < 1: maxmemory must not be below the bound")
    return max(floor, math.ceil(bound.total * margin / MIB) * MIB)


def policy_warnings(policy: str, maxmemory: int, bound: MemoryBound) -> list[str]:
    """What is wrong, for streamrl, with an external Redis's ``maxmemory-policy`` and ``maxmemory``
    (0 = no limit). Empty when nothing is."""
    problems = []
    if policy.startswith("allkeys-"):
        problems.append(
            f"maxmemory-policy is {policy}: when Redis is full it evicts any key, streams and run state "
            "included (work lost, runs wedged); set maxmemory-policy noeviction"
        )
    elif policy.startswith("volatile-"):
        problems.append(
            f"maxmemory-policy is {policy}: when Redis is full it evicts keys with a TTL - leases, heartbeats "
            "and operation keys (a lease taken twice, live workers judged dead, a re-sent write applied "
            "twice); set maxmemory-policy noeviction"
        )
    elif policy != "noeviction":
        problems.append(f"maxmemory-policy is {policy!r}, not noeviction; set maxmemory-policy noeviction")
    if 0 < maxmemory < bound.total:
        problems.append(
            f"maxmemory is {maxmemory / MIB:.0f} MiB, below this run's bound of {bound.total / MIB:.0f} MiB "
            "(docs/operations.md): writes will wait for memory and services stop after redis.outage_s"
        )
    return problems


def shape_dict(shape: RunShape) -> dict[str, Any]:
    """The shape as plain data (for logs and JSON results)."""
    return asdict(shape)


SERVICE_DEFAULTS: dict[str, Any] = {
    "coordinator.group_size": 8,
    "coordinator.prompts_per_step": 8,
    "coordinator.max_staleness": 0,
    "coordinator.prefetch_steps": 1,
    "coordinator.total_steps": 20,
    "coordinator.sampling.max_new_tokens": 64,
    "coordinator.eval.num_prompts": 200,
    "coordinator.eval.max_new_tokens": 64,
    "learner.checkpoint_every": 5,
    "learner.ranks": 1,
    "learner.weights_transport": "zmq",
    "rollout.engine.max_model_len": 4096,
    "rollout.environment.max_tokens": 1024,
    "rollout.environment.max_turns": 4,
    "redis.maxlen": 100_000,
    "redis.outage_s": 60.0,
    "redis.max_message_mb": 32.0,
    "redis.max_command_mb": 8.0,
    "redis.retain_consumed_s": 0.0,
    "consumer.claim_interval_s": 5.0,
    "consumer.count": 16,
}
"""The services' defaults of every field the bound reads (libs/common imports no service; a unit test
holds these equal to the services' config classes)."""

SHARED_TOP_LEVEL = ("total_steps", "redis", "consumer")
"""Fields a service section takes from the recipe's top level when it does not set them."""


def recipe_value(data: dict[str, Any], dotted: str) -> Any:
    """``dotted`` (``section.field...``) from a recipe's data, else its top-level shared value, else the
    services' default (:data:`SERVICE_DEFAULTS`)."""
    parts = dotted.split(".")
    candidates = [parts]
    if parts[0] in ("coordinator", "learner", "rollout", "reward") and parts[1] in SHARED_TOP_LEVEL:
        candidates.append(parts[1:])
    for path in candidates:
        node: Any = data
        for key in path:
            node = node.get(key) if isinstance(node, dict) else None
            if node is None:
                break
        if node is not None:
            return node
    return SERVICE_DEFAULTS[dotted]


def shape_from_recipe(data: dict[str, Any], assumptions: dict[str, Any] | None = None) -> RunShape:
    """The :class:`RunShape` of a recipe (its data after overrides). ``assumptions`` gives the shape's
    assumption fields (``text_bytes_per_token``, ``row_bytes``, ``image_bytes``, ``min_step_s``,
    ``dead_letters``, ``dead_batches``); None: the recipe's ``[up.redis_memory]`` (its defaults where
    unset). Bad values raise ValueError naming the field."""
    if assumptions is None:
        from streamrl.ops.up_config import RedisMemoryConfig

        section = (data.get("up") or {}).get("redis_memory") or {}
        try:
            assumptions = RedisMemoryConfig.model_validate(section).assumptions()
        except ValidationError as e:
            problems = "; ".join(
                f"up.redis_memory.{'.'.join(map(str, err['loc']))}: {err['msg']}" for err in e.errors()
            )
            raise ValueError(f"cannot bound this recipe's Redis memory: {problems}") from e

    def number(dotted: str, kind: type[int] | type[float] = int) -> Any:
        value = recipe_value(data, dotted)
        try:
            if isinstance(value, bool) or not isinstance(value, (int, float, str)):
                raise ValueError
            return kind(float(value)) if kind is int else float(value)
        except ValueError:
            raise ValueError(f"{dotted} = {value!r} is not a number") from None

    up = data.get("up") or {}
    services = up.get("services") or ["coordinator", "rollout", "reward", "learner"]
    replicas = up.get("replicas") or {}
    multi_turn = isinstance((data.get("rollout") or {}).get("environment"), dict)
    coordinator_eval = (data.get("coordinator") or {}).get("eval") or {}
    try:
        instances = sum(int(replicas.get(s, 1)) for s in services) + number("learner.ranks") - 1
        return RunShape(
            prompts_per_step=number("coordinator.prompts_per_step"),
            group_size=number("coordinator.group_size"),
            max_staleness=number("coordinator.max_staleness"),
            prefetch_steps=number("coordinator.prefetch_steps"),
            total_steps=number("coordinator.total_steps"),
            checkpoint_every=number("learner.checkpoint_every"),
            max_model_len=number("rollout.engine.max_model_len"),
            response_tokens=number(
                "rollout.environment.max_tokens" if multi_turn else "coordinator.sampling.max_new_tokens"
            ),
            turns=number("rollout.environment.max_turns") if multi_turn else 0,
            eval_prompts=number("coordinator.eval.num_prompts") if coordinator_eval.get("dataset") else 0,
            eval_response_tokens=number("coordinator.eval.max_new_tokens"),
            maxlen=number("redis.maxlen"),
            outage_s=number("redis.outage_s", float),
            retain_consumed_s=number("redis.retain_consumed_s", float),
            trim_interval_s=number("consumer.claim_interval_s", float),
            read_count=number("consumer.count"),
            instances=max(1, instances),
            max_message_bytes=int(number("redis.max_message_mb", float) * MIB),
            max_command_bytes=int(number("redis.max_command_mb", float) * MIB),
            weights_transport=str(recipe_value(data, "learner.weights_transport")),
            **(assumptions or {}),
        )
    except ValueError as e:
        raise ValueError(f"cannot bound this recipe's Redis memory: {e}") from e


def main(argv: list[str] | None = None) -> int:
    """``python -m streamrl.ops.memory_budget RECIPE [overrides]``: the recipe's bound, term by term, the
    message sizes and the ``maxmemory`` ``streamrl up`` would set; the last line is one JSON object."""
    import argparse
    import json
    import sys

    from streamrl.common.config import ConfigError, apply_overrides, read_recipe, validate
    from streamrl.ops.up_config import LaunchRecipe

    parser = argparse.ArgumentParser(prog="python -m streamrl.ops.memory_budget", description=main.__doc__)
    parser.add_argument("recipe")
    args, overrides = parser.parse_known_args(argv)
    try:
        data = apply_overrides(read_recipe(args.recipe), overrides)
        settings = validate(LaunchRecipe, data, source=f"recipe {args.recipe}").up.redis_memory
        bound = memory_bound(shape_from_recipe(data))
    except (ConfigError, ValueError) as e:
        print(f"memory_budget: {e}", file=sys.stderr)
        return 2
    maxmemory = (
        int(settings.maxmemory_mb * MIB) if settings.maxmemory_mb is not None else maxmemory_for(bound, settings.margin)
    )
    for name, value in sorted(bound.terms.items(), key=lambda kv: -kv[1]):
        print(f"{name:<22} {value / MIB:12.2f} MiB")
    print(
        f"{'total':<22} {bound.total / MIB:12.2f} MiB; maxmemory of an embedded redis-server: {maxmemory / MIB:.0f} MiB"
    )
    print(
        json.dumps(
            {
                "bound_bytes": bound.total,
                "maxmemory_bytes": maxmemory,
                "terms": bound.terms,
                "sizes": asdict(bound.sizes),
                "shape": shape_dict(bound.shape),
            }
        )
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
