"""Every message that travels on the streamrl bus, in one file.

Each message is a msgpack map with a type tag (``"type"``) and a schema version (``"v"``),
readable by any msgpack library: no pickle, no extension types. Tensors travel as
``{"dtype", "shape", "data"}`` maps (see :class:`Tensor`).

Flow (stream names come from :mod:`streamrl.common.streams`)::

    coordinator -> prompts      -> rollout      PromptWorkItem
    rollout     -> trajectories -> reward       TrajectoryRecord (its Trajectory stored once, by reference)
    reward      -> scored       -> coordinator  ScoredRecord
    coordinator -> batches      -> learner      BatchManifest (or a whole TrainingBatch)
    learner     -> weights      -> rollout, coordinator   WeightsPublished
    every consumer -> dead                      DeadLetter
    every service -> hb key (not a stream)      Heartbeat

A trajectory's payload travels once: the rollout worker SETs the encoded :class:`Trajectory` under its
own key (``payload:{trajectory id}:{attempt}``, :meth:`StreamNames.payload`) and commits only a small
:class:`TrajectoryRecord` naming it; the reward tier reads the payload and publishes a small
:class:`ScoredRecord` (never the tokens); the coordinator keeps records in its group buffers and, when a
group is batched, renames each payload under the batch (``batched:{batch}:{trajectory id}``); the learner
reads the payloads a :class:`BatchManifest`'s refs name and assembles the ScoredTrajectory it trains
(:mod:`streamrl.common.payloads`).

A batch travels by reference: the coordinator publishes a :class:`BatchManifest` (the batch's
header and, per sample, a :class:`SampleRef` naming the Redis hash field that holds its
ScoredTrajectory: the group buffer ``groups:{group id}``, field = trajectory id); the learner reads
the payloads itself, in replies of at most ``redis.max_command_mb`` (:mod:`streamrl.common.batch_payloads`),
and trains the :class:`TrainingBatch` they make. So no stream entry grows with the batch's tokens
(18,000 samples: a manifest of a few MB). The payloads stay until the batch is trained and covered by
a checkpoint (the learner deletes them with its acknowledgement) or counted dead (the coordinator
deletes them). A whole TrainingBatch on ``batches`` is still accepted (v1 of the batch contract).

A change that breaks compatibility adds a new version next to the old one; it never edits a
published version in place.
"""

from __future__ import annotations

from typing import Any, Literal

import msgspec
import numpy as np

SCHEMA_VERSION = 1


_DTYPE_NAMES: dict[np.dtype, str] = {}


def _dtype_name(dtype: np.dtype) -> str:
    """``dtype.name``, cached: numpy computes the name in Python on every access (several us, per
    tensor of every trajectory)."""
    name = _DTYPE_NAMES.get(dtype)
    if name is None:
        name = _DTYPE_NAMES[dtype] = dtype.name
    return name


class Tensor(msgspec.Struct, frozen=True):
    """A dense array on the wire: numpy dtype name, shape, raw little-endian bytes (C order).

    Example:
        >>> t = Tensor.from_numpy(np.arange(3, dtype=np.int32))
        >>> t.dtype, t.shape
        ('int32', [3])
    """

    dtype: str
    """numpy dtype name, e.g. ``int32``, ``float32``, ``uint8``, ``bfloat16`` (raw 2-byte words)."""
    shape: list[int]
    """Dimensions; ``[]`` for a scalar."""
    data: bytes
    """Raw little-endian C-order bytes, ``prod(shape) * itemsize`` long."""

    @classmethod
    def from_numpy(cls, array: np.ndarray) -> Tensor:
        array = np.ascontiguousarray(array)
        if array.dtype.byteorder == ">":
            array = array.astype(array.dtype.newbyteorder("<"))
        return cls(dtype=_dtype_name(array.dtype), shape=list(array.shape), data=array.tobytes())

    @classmethod
    def from_list(cls, values: list[int] | list[float], dtype: str) -> Tensor:
        return cls.from_numpy(np.asarray(values, dtype=dtype))

    def to_numpy(self) -> np.ndarray:
        return np.frombuffer(self.data, dtype=np.dtype(self.dtype)).reshape(self.shape)

    def tolist(self) -> list[Any]:
        return self.to_numpy().tolist()  # type: ignore[no-any-return]

    def __len__(self) -> int:
        return self.shape[0] if self.shape else 1


class SamplingParams(msgspec.Struct, frozen=True):
    """Sampling parameters a trajectory was generated with (temperature matters for log-probs)."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    """-1 = disabled."""
    max_new_tokens: int = 64
    min_new_tokens: int = 0
    """End-of-sequence is suppressed before this many tokens (benchmarks, length floors)."""
    n: int = 1
    """Samples per prompt (the group size)."""
    seed: int | None = None
    stop: list[str] = []


class Image(msgspec.Struct, frozen=True):
    """An image attached to a prompt or to environment feedback: inline bytes or a reference."""

    media_type: str
    """MIME type, e.g. ``image/png``."""
    data: bytes | None = None
    """Inline encoded image bytes."""
    uri: str | None = None
    """Object-store reference when not inline."""


class Turn(msgspec.Struct, frozen=True):
    """One model turn of a multi-turn episode: where its tokens lie in the trajectory's ``response_ids``.

    The model's tokens of turn ``k`` are ``response_ids[start:end]`` (``loss_mask`` 1); what the
    environment answered after it (tool output, observation) follows up to the next turn's ``start``
    (``loss_mask`` 0, behaviour log-probs 0).
    """

    start: int
    """Index in ``response_ids`` of the turn's first model token."""
    end: int
    """One past its last model token."""
    policy_version: int
    """Policy version that generated this turn (the version at its first token)."""
    reward: float = 0.0
    """Reward the environment gave after this turn (0 when it gives none)."""


class _Message(msgspec.Struct, tag_field="type", kw_only=True):
    v: int = SCHEMA_VERSION
    """Schema version of this message type."""


class PromptWorkItem(_Message, tag="prompt"):
    """One prompt to answer ``sampling.n`` times. coordinator -> prompts -> rollout.

    Example:
        PromptWorkItem(id="run1-p42", prompt_ids=Tensor.from_list([1, 2], "int32"), ...)
    """

    id: str
    """Work item id; also the group id of every trajectory answering it. Unique per run."""
    prompt_ids: Tensor
    """[P] int32 prompt token ids (chat template already applied)."""
    prompt_text: str = ""
    """The prompt as text, for reward functions and logs."""
    label: str | None = None
    """Reference answer / label from the dataset, handed to the reward function."""
    metadata: dict[str, Any] = {}
    """Free-form dataset fields carried to the reward function."""
    sampling: SamplingParams = SamplingParams()
    images: list[Image] = []
    policy_version: int = 0
    """Policy version when the coordinator issued the prompt."""
    issued_at: float = 0.0
    """Unix time (s) the coordinator issued it."""
    is_eval: bool = False
    """Evaluation prompt: scored and reported, never trained on."""
    traceparent: str = ""
    """W3C trace context of the trajectory's trace."""


class Trajectory(_Message, tag="trajectory"):
    """One sampled response with everything the learner needs. rollout -> trajectories -> reward."""

    id: str
    """Trajectory id, unique per run: ``{group_id}/{group_index}``. Used for de-duplication."""
    group_id: str
    """The prompt work item this answers."""
    group_index: int
    """Index of this sample in its group, ``0 <= group_index < group_size``."""
    group_size: int
    prompt_ids: Tensor
    """[P] int32."""
    response_ids: Tensor
    """[T] int32 generated tokens (and environment tokens in multi-turn episodes)."""
    logprobs: Tensor
    """[T] float32 behaviour log-probs of the distribution actually sampled from."""
    loss_mask: Tensor
    """[T] uint8; 0 on environment/tool tokens."""
    prompt_text: str = ""
    response_text: str = ""
    finish_reason: str = "stop"
    """``stop`` | ``length`` | ``abort``."""
    truncated: bool = False
    """True when generation hit the length limit."""
    sampling: SamplingParams = SamplingParams()
    policy_version_start: int = 0
    """Policy version that generated the first token."""
    policy_version_end: int = 0
    """Policy version that generated the last token (differs under partial rollout)."""
    policy_versions: list[tuple[int, int]] = []
    """Policy version of each response token, run-length: ``(first token index, version)`` pairs in
    token order, each version holding up to the next pair's index; empty when one version produced
    every token (``policy_version_start``: always so without partial rollout, and in older messages).
    Environment tokens of a multi-turn episode carry the version of the turn before them."""
    label: str | None = None
    metadata: dict[str, Any] = {}
    images: list[Image] = []
    is_eval: bool = False
    timings: dict[str, float] = {}
    """Seconds per phase, e.g. ``queue_s``, ``generate_s``."""
    traceparent: str = ""
    turns: list[Turn] = []
    """Multi-turn episodes: the model's turns in order (environment tokens lie between them); empty
    for a single prompt and completion."""
    stop_reason: str = ""
    """Why a multi-turn episode ended: ``done`` (the environment said so), ``max_turns``,
    ``max_tokens`` (the episode's token budget), ``length`` (a turn hit max_new_tokens or the
    context), ``error`` (the environment raised; its message in ``metadata["env_error"]``)."""


class ScoredTrajectory(_Message, tag="scored"):
    """A trajectory with its reward. reward -> scored -> coordinator."""

    trajectory: Trajectory
    reward: float
    """Scalar reward (sum of turn rewards in multi-turn episodes)."""
    score: float = 0.0
    """0-1 score used by dynamic filtering and accuracy metrics."""
    turn_rewards: list[float] = []
    """Per-turn rewards for multi-turn episodes, else empty."""
    extra: dict[str, float] = {}
    """Extra metrics from the scorers, ``{scorer}/{name}``."""
    scorer: str = ""
    """Which scorer(s) produced the reward."""
    reward_latency_ms: float = 0.0
    traceparent: str = ""


MANIFEST_PART_BYTES = 2**20
"""A :class:`BatchManifest` whose sample refs encode to more than this many bytes is published split: a header
entry naming :class:`ManifestPart` strings of at most about this size each (one ref always fits)."""

RECORD_METADATA_BYTES = 1024
"""A :class:`TrajectoryRecord` carries its trajectory's ``metadata`` whole when it encodes to at most this
many bytes, else only its scalar entries (numbers, booleans, strings up to 256 characters): the whole is
in the payload."""


class TrajectoryRecord(_Message, tag="trajectory_record"):
    """What is committed of one sampled trajectory: every small field a consumer decides by, and where its
    payload (the encoded :class:`Trajectory`) lies. rollout -> trajectories -> reward.

    The record never carries tokens, log-probs or text: the reward tier reads the payload at
    ``payload_key``; the coordinator decides on the record alone (groups, evaluation, staleness, statistics).
    """

    id: str
    """Trajectory id, ``{group_id}/{group_index}`` (as :attr:`Trajectory.id`)."""
    group_id: str
    group_index: int
    group_size: int
    payload_key: str
    """The Redis string holding the encoded Trajectory (``streamrl:{run}:payload:{id}:{attempt}``)."""
    payload_bytes: int
    """Its size (bytes): what readers plan their bounded reads by."""
    payload_head_bytes: int = 0
    """How long its prefix up to the end of the head is (payload format 2, :mod:`streamrl.common.payloads`: the
    Trajectory without its tensors, what text scorers read with ``GETRANGE key 0 n-1``); 0: a payload of
    format 1 (the encoded Trajectory alone), read whole."""
    finish_reason: str = "stop"
    truncated: bool = False
    policy_version_start: int = 0
    policy_version_end: int = 0
    num_response_tokens: int = 0
    """Length of the response (model and environment tokens)."""
    num_loss_tokens: int = 0
    """The model's tokens in it (``loss_mask`` sum)."""
    is_eval: bool = False
    metadata: dict[str, Any] = {}
    """The trajectory's metadata when small (:data:`RECORD_METADATA_BYTES`), else its scalar entries."""
    timings: dict[str, float] = {}
    traceparent: str = ""
    stop_reason: str = ""


class ScoredRecord(_Message, tag="scored_record"):
    """A trajectory's record with its reward: :class:`ScoredTrajectory` without the payload.
    reward -> scored -> coordinator.

    ``trajectory`` is the record (named as in ScoredTrajectory, so a reader of scored samples reads the same
    fields); the learner assembles the ScoredTrajectory from it and the payload it names.
    """

    trajectory: TrajectoryRecord
    reward: float
    score: float = 0.0
    turn_rewards: list[float] = []
    extra: dict[str, float] = {}
    scorer: str = ""
    reward_latency_ms: float = 0.0
    traceparent: str = ""


class TrainingBatch(_Message, tag="batch"):
    """What one learner step consumes: complete groups only. coordinator -> batches -> learner."""

    id: str
    """Batch id, unique per run: ``batch-{index}``."""
    index: int
    """Batch sequence number (0, 1, ...); the learner applies batches in this order."""
    samples: list[ScoredTrajectory]
    """Complete groups, contiguous by group."""
    policy_version: int
    """Policy version when the batch was built."""
    staleness: list[int]
    """Per sample: policy_version - policy_version_start."""
    created_at: float = 0.0
    traceparent: str = ""


class SampleRef(msgspec.Struct, frozen=True, kw_only=True):
    """Where one sample of a :class:`BatchManifest` lives: with ``scored`` set, the Redis string ``key`` holding
    its encoded :class:`Trajectory` (the payload; ``scored`` is the rest of the sample); without, a field of a
    Redis hash holding its encoded :class:`ScoredTrajectory` (the first form of the contract)."""

    trajectory_id: str
    group_id: str
    key: str
    """The Redis hash holding the payload (the group's buffer, ``streamrl:{run}:groups:{group id}``)."""
    field: str
    """The field of ``key`` holding it (the trajectory id)."""
    policy_version_start: int
    """The sample's ``trajectory.policy_version_start`` (what staleness is counted from)."""
    num_bytes: int
    """Size of the encoded payload (bytes): what the reader plans its reads by."""
    traceparent: str = ""
    """The sample's trace context in the batch (its batch-wait span), which replaces the stored payload's
    ``traceparent``; empty: the payload's stands."""
    scored: ScoredRecord | None = None
    """The sample's scored record (its reward, score, versions, ...): ``key`` is then its payload, a string."""


class BatchManifest(_Message, tag="batch_manifest"):
    """A training batch by reference: what the learner fetches and trains as a :class:`TrainingBatch`.
    coordinator -> batches -> learner.

    The learner reads ``samples`` (payloads) from Redis, in order; a missing payload makes the batch
    unusable (skipped, dead-lettered: its groups are counted dropped), never trained short.

    A manifest too large for one small entry (its refs over :data:`MANIFEST_PART_BYTES`, e.g. 18,000 samples at
    about 1 KB of record each) is published split: its entry is the header (``samples`` empty) naming
    ``parts``, Redis strings each holding a :class:`ManifestPart` (the refs of consecutive samples, in order);
    the learner reads them first (:func:`streamrl.common.batch_payloads.load_manifest`). A part missing is a
    missing payload: the batch is skipped whole.
    """

    id: str
    """Batch id, unique per run: ``batch-{index}``."""
    index: int
    """Batch sequence number (0, 1, ...); the learner applies batches in this order."""
    samples: list[SampleRef]
    """Complete groups, contiguous by group (the TrainingBatch's samples, in its order)."""
    policy_version: int
    """Policy version when the batch was built."""
    staleness: list[int]
    """Per sample, as :attr:`TrainingBatch.staleness`."""
    created_at: float = 0.0
    traceparent: str = ""
    parts: list[str] = []
    """Split form: the Redis strings holding the samples' refs (:class:`ManifestPart`, in order); ``samples`` is
    then empty in the entry (filled once the parts are read)."""
    part_bytes: list[int] = []
    """Size of each part (bytes): what the reader plans its reads by."""

    @property
    def num_samples(self) -> int:
        """How many samples the batch has (a header of the split form names them by its ``staleness``)."""
        return len(self.samples) or len(self.staleness)

    @property
    def buffers(self) -> list[str]:
        """The Redis keys holding the payloads and the manifest's parts, each once, in order."""
        return list(dict.fromkeys([*(s.key for s in self.samples), *self.parts]))


class ManifestPart(_Message, tag="manifest_part"):
    """The refs of consecutive samples of a split :class:`BatchManifest` (one of its ``parts``). coordinator ->
    Redis string ``batched:{batch}:manifest:{attempt}:{number}`` -> learner."""

    batch_id: str
    """The manifest's id: a part of another batch is refused."""
    number: int
    """Its place among the manifest's parts (0, 1, ...)."""
    samples: list[SampleRef]


class IpcBuffer(msgspec.Struct, frozen=True):
    """One of the learner's flat weight buffers on its GPU, shared over CUDA IPC.

    The fields are exactly what torch's ``UntypedStorage._share_cuda_()`` returns for the buffer
    (less the learner's device index: the receiver opens it on its own index of the same GPU);
    ``torch.UntypedStorage._new_shared_cuda(device, *fields)`` rebuilds it in another process.
    """

    handle: bytes
    """``cudaIpcMemHandle_t`` of the CUDA allocation holding the buffer."""
    storage_size_bytes: int
    """Size of the buffer (bytes)."""
    storage_offset_bytes: int
    """Offset of the buffer inside that allocation (bytes)."""
    ref_counter_handle: bytes
    """Name of torch's shared reference-counter file."""
    ref_counter_offset: int
    event_handle: bytes
    """``cudaIpcEventHandle_t`` recorded when the buffer was shared."""
    event_sync_required: bool


class IpcTensor(msgspec.Struct, frozen=True):
    """Where one named tensor lies in flat weight buffers: the CUDA IPC buffers, or the buckets of
    the weight broadcast (:class:`WeightsBroadcast`)."""

    name: str
    """Hugging Face parameter name."""
    dtype: str
    """torch dtype name, e.g. ``bfloat16``."""
    shape: list[int]
    buffer: int
    """Index into :attr:`IpcWeights.buffers` (broadcast: into :attr:`WeightsBroadcast.bucket_bytes`)."""
    offset_bytes: int
    """Start inside that buffer (a multiple of :attr:`IpcWeights.block_bytes`)."""


class IpcWeights(msgspec.Struct, frozen=True):
    """The learner's weights as CUDA IPC buffers, for rollout engines on the learner's own GPU.

    The learner keeps ``num_sets`` sets of buffers (``learner.weights_ipc_buffer_sets``), each allocated
    and shared once, and writes the versions into them in turn; ``buffers`` are the handles of the set
    holding this version (``buffer_set``), so a receiver opens each handle once. A receiver holds the
    set's ``reader_lock`` while it copies (the learner does not rewrite a set a reader holds:
    ``streamrl.torchkit.weights.ipc_sets``). The checksum (``WeightsPublished.checksum``) is computed on
    the device over the buffers, ``block_bytes`` at a time (``streamrl.torchkit.flat``).

    Example:
        IpcWeights(device_uuid="GPU-5e2f...", block_bytes=4096, buffers=[IpcBuffer(...)],
                   tensors=[IpcTensor("model.embed_tokens.weight", "bfloat16", [151936, 1536], 0, 0), ...])
    """

    device_uuid: str
    """UUID of the learner's GPU (``torch.cuda.get_device_properties(d).uuid``)."""
    block_bytes: int
    """Alignment of every tensor and granularity of the checksum (bytes)."""
    buffers: list[IpcBuffer]
    tensors: list[IpcTensor]
    """In publishing order (tied aliases such as ``lm_head.weight`` included)."""
    buffer_set: int = 0
    """Which of the learner's buffer sets holds this version (``0 .. num_sets - 1``)."""
    num_sets: int = 1
    """How many buffer sets the learner rotates through."""
    reader_lock: str = ""
    """Path of the set's lock file on the learner's host (``/dev/shm``): a receiver holds a shared ``flock``
    on it while it copies, and its first 8 bytes (little-endian) name the version the set holds."""


class WeightsBroadcast(msgspec.Struct, frozen=True):
    """Rendezvous of the learner's weight-broadcast group (``learner.weights_transport = "broadcast"``).

    Learner rank 0 hosts a TCP store at ``store``. A rollout worker (each tensor-parallel worker of a
    vLLM engine on its own) registers there, joins a process group with rank 0, and from then on
    receives every version as flat buckets laid out as ``tensors`` say, broadcast over NCCL (GPU)
    or gloo (CPU). What is said over the store is :mod:`streamrl.common.weights.broadcast`. Members
    check every version against the device-side block checksum of the CUDA IPC path over the
    buckets (``block_bytes`` blocks, the version included), which the learner sets in the store with
    the version (and in ``WeightsPublished.checksum`` unless the ZMQ server is fed too).

    Example:
        WeightsBroadcast(store="learner-0:29600", session="9b1f0c2e", backend="nccl", generation=2,
                         block_bytes=4096, bucket_bytes=[536870912, 412090368],
                         tensors=[IpcTensor("model.embed_tokens.weight", "bfloat16", [151936, 1536], 0, 0), ...])
    """

    store: str
    """``host:port`` of the TCP store on learner rank 0."""
    session: str
    """Random id of the learner's publisher: a restarted learner has a new one, and a new store and group."""
    backend: str
    """``nccl`` (the learner's weights on CUDA: receivers need a CUDA device) or ``gloo`` (on CPU)."""
    generation: int
    """Group generation when the version was published (informational; members follow the store)."""
    block_bytes: int
    """Alignment of every tensor in its bucket and granularity of the checksum (bytes)."""
    bucket_bytes: list[int]
    """Size of each bucket (bytes), in broadcast order."""
    tensors: list[IpcTensor]
    """Where each tensor lies (``buffer`` = bucket index), in publishing order (tied aliases included)."""
    checksum: str = ""
    """Block checksum of this version's buckets (the version included): what a member must have received
    to load it. Signed with the event, so a member refuses whatever else the group's store (which
    has no authentication) offers; empty from a learner that predates it."""


class LoraAdapter(msgspec.Struct, frozen=True):
    """What a LoRA payload is (``WeightsPublished.payload = "lora"``): the adapter's shape, enough for an
    engine to build its LoRA layers before it loads the tensors.

    Example:
        LoraAdapter(rank=16, alpha=32.0, target_modules=["down_proj", "gate_proj", "k_proj", "o_proj", ...])
    """

    rank: int
    """Adapter rank r (every adapted module's ``lora_A`` is ``[r, in]``, its ``lora_B`` ``[out, r]``)."""
    alpha: float
    """Scaling numerator: a module's output gains ``alpha / rank * B @ A @ x``."""
    target_modules: list[str]
    """Names of the adapted modules (``all-linear`` resolved: e.g. ``q_proj``, ``down_proj``), sorted."""


WeightsTransport = Literal["zmq", "ipc", "broadcast", "relay"]
"""The weight transports (``learner.weights_transport``, ``WeightsPublished.transport``); ``relay`` came with v4."""

WEIGHTS_SCHEMA_VERSION = 4
"""Schema version of :class:`WeightsPublished`: v2 added ``payload`` and ``lora``, v3 the explicit
``transport`` tag, v4 the CUDA IPC buffer sets (``IpcWeights.buffer_set``, ``num_sets``, ``reader_lock``:
a v3 engine would neither keep both sets' handles nor hold the reader lock) and the ``relay`` transport. Only v4 is read: an older
event is refused as an unsupported version, and an older worker refuses a v4 event the same way."""


class WeightsPublished(_Message, tag="weights", kw_only=True):
    """The learner finished a step and serves new weights. learner -> weights -> rollout, coordinator.

    The payload is the whole model (``payload = "full"``) or, for a LoRA run with
    ``learner.lora.sync = "adapter"``, the adapter alone (``payload = "lora"``, ``lora`` its shape): the
    tensors are then the adapter's in peft naming (``base_model.model.<module>.lora_A.weight`` /
    ``lora_B.weight``), applied on top of the engine's base model (the model folder it was built from).
    Either payload travels the same transports (ZMQ buckets, CUDA IPC buffers) with the same version,
    checksum and signature. ``transport`` says which one carries the bytes; receivers are built from it
    (``streamrl.torchkit.weights.factory``), never from which optional field is set.
    """

    v: int = WEIGHTS_SCHEMA_VERSION
    transport: WeightsTransport = "zmq"
    """How the bytes travel: ``zmq`` (buckets at ``endpoint``), ``ipc`` (CUDA IPC buffers in ``ipc``),
    ``broadcast`` (the group of ``broadcast``; ``endpoint`` set too when the learner also serves ZMQ for
    workers that cannot join - still tagged ``broadcast``) or ``relay`` (one flat buffer rooted at
    ``endpoint``, relayed worker to worker: :mod:`streamrl.torchkit.weights.relay`)."""
    version: int
    """New policy version (monotonic)."""
    step: int
    """Learner step that produced it."""
    batch_id: str
    """The batch this step trained on."""
    checksum: str
    """Digest over all buckets (IPC and broadcast: over all buffers, with the version; relay: the relay
    manifest's, over the version, sizes and every chunk's digest), checked by every receiver.
    With a broadcast rendezvous and ``endpoint`` set it is the ZMQ server's digest: group members check
    the one the learner hands them in its store with each version."""
    num_bytes: int
    num_buckets: int
    """ZMQ buckets, IPC buffers, broadcast buckets, or relay chunks."""
    endpoint: str
    """ZMQ address serving the buckets (``tcp://host:port``; relay: the learner's node, the relay's root);
    empty when the weights travel only over CUDA IPC or only over the broadcast group."""
    metrics: dict[str, float] = {}
    """Learner metrics of the step (``learner/...``)."""
    published_at: float = 0.0
    ipc: IpcWeights | None = None
    """CUDA IPC buffers of this version (``learner.weights_transport = "ipc"``), for engines on the learner's GPU."""
    broadcast: WeightsBroadcast | None = None
    """Rendezvous of the weight-broadcast group (``learner.weights_transport = "broadcast"``); workers that
    cannot join it fetch from ``endpoint`` when it is set."""
    signature: str = ""
    """HMAC-SHA256 of this event with the run's weights key (:mod:`streamrl.common.weights.auth`); empty
    when the learner has no key."""
    payload: Literal["full", "lora"] = "full"
    """``full``: every weight of the model; ``lora``: a LoRA adapter's tensors only (``lora`` says its shape)."""
    lora: LoraAdapter | None = None
    """The adapter's rank, alpha and target modules when ``payload = "lora"`` (None otherwise)."""


class Heartbeat(_Message, tag="heartbeat"):
    """Liveness and counters of one service instance, stored in a key with a TTL."""

    service: str
    instance: str
    pid: int
    ts: float
    """Unix time (s) written."""
    processed: int = 0
    failed: int = 0
    retried: int = 0
    dead_lettered: int = 0
    in_flight: int = 0
    policy_version: int = -1
    """Version the instance serves or trains (-1 = n/a)."""
    status: str = "running"
    """``starting`` | ``running`` | ``paused`` | ``draining`` (``standby`` for a coordinator waiting for the lease)."""
    loop_lag_s: float = 0.0
    """The event loop's worst pause since the instance runs (s); the lease TTL must cover it."""
    reason: str = ""
    """Why the instance is ``paused`` (a reward worker whose backend refuses its token or stays down: it
    consumes nothing until a probe succeeds); empty otherwise. The coordinator shows it and issues no prompts."""
    weights_relay: str = ""
    """``host:port`` where a rollout worker serves the weights version it holds (``policy_version``) onward on the
    ``relay`` transport (:mod:`streamrl.rollout.weights.relay_sources`); empty otherwise."""


class DeadLetter(_Message, tag="dead"):
    """An entry given up on, with why. any consumer -> dead."""

    stream: str
    """Stream the entry came from."""
    entry_id: str
    group: str
    consumer: str
    error: str
    """The reason: exception type and message."""
    deliveries: int
    payload: bytes
    """The original entry payload, unchanged."""
    ts: float
    signature: str = ""
    """HMAC-SHA256 of this letter with the run's weights key (:mod:`streamrl.common.weights.auth`): set on the
    letters about batches the learner (or lane 0's joiner) writes; the coordinator honours only signed ones."""


BATCH_SKIPPED = "skipped untrained"
"""In the error of the learner's dead letter for a batch it consumed without training (its samples are
lost to the run). Other dead letters of batches (a copy of a trained one, one from the future, bytes
that are no batch) lost nothing the coordinator issued."""

MESSAGE_TYPES: dict[str, type[_Message]] = {
    cls.__struct_config__.tag: cls  # type: ignore[misc]
    for cls in (
        PromptWorkItem,
        Trajectory,
        ScoredTrajectory,
        TrajectoryRecord,
        ScoredRecord,
        TrainingBatch,
        BatchManifest,
        ManifestPart,
        WeightsPublished,
        Heartbeat,
        DeadLetter,
    )
}
SUPPORTED_VERSIONS: dict[str, frozenset[int]] = {tag: frozenset({SCHEMA_VERSION}) for tag in MESSAGE_TYPES}
SUPPORTED_VERSIONS["weights"] = frozenset({WEIGHTS_SCHEMA_VERSION})
Message = _Message
