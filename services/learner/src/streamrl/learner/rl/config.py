"""LearnerConfig: the ``[learner]`` section of an RL recipe (torch-free)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from streamrl.common.lifecycle import ServiceConfig
from streamrl.learner.ds_config import DeepSpeedConfig, LoraConfig
from streamrl.learner.rl.algo.config import AlgoConfig


class RLLoraConfig(LoraConfig):
    """LoRA in the RL learner: a frozen base, the adapter trained (under any ZeRO stage), and what each
    policy version publishes."""

    sync: Literal["adapter", "merged"] = "adapter"
    """What every version sends the rollout engines. ``adapter``: the adapter's tensors alone (a few MB
    instead of the whole model; ``WeightsPublished.payload = "lora"``): the engines add it to the base
    they loaded from their model folder (vLLM: ``rollout.engine.max_lora_rank`` set; the transformers
    engine: peft), over ZMQ or CUDA IPC. ``merged``: the adapter merged into the base weights, sent as
    full weights over any transport (engines need no LoRA support)."""


class LearnerConfig(ServiceConfig):
    """The RL learner: a DeepSpeed-trained policy (plus optional reference and critic models)."""

    model: str
    """Policy model folder or hub id (Hugging Face format)."""
    ref_model: str | None = None
    """Reference model for the KL term (None = the initial policy, loaded only when the KL is used)."""
    critic_model: str | None = None
    """Critic initialisation for the gae estimator (None = the policy's weights with a value head)."""
    ds: DeepSpeedConfig = DeepSpeedConfig(dtype="fp32", zero_stage=0, scheduler="constant")
    """DeepSpeed engine of the policy (and of the critic). ``ds.grad_accum`` = micro-batches per step."""
    algo: AlgoConfig = AlgoConfig()
    lora: RLLoraConfig | None = None
    """Train a LoRA adapter on the frozen policy (``[learner.lora]``: rank, alpha, dropout, target modules
    or ``all-linear``) instead of every weight; None = full-parameter training. The KL term's reference is
    the base: the policy's own forward with its adapter switched off (no second copy of the base in
    memory), unless ``ref_model`` names another model. Target modules the model lacks are refused at
    start, by name."""
    ranks: int = Field(1, ge=1)
    """Data-parallel ranks of the learner group, started by ``streamrl learner`` itself on this host
    (one process per rank; on GPUs rank k uses the k-th visible device). Each step's groups are
    split across the ranks balanced by tokens; rank 0 alone consumes batches and publishes weights.
    Under ``torchrun`` / ``deepspeed`` (``RANK`` set) the launcher's ranks are used instead."""
    total_steps: int = Field(20, ge=1)
    """Training steps of the run (top-level recipe key, shared with the coordinator)."""
    checkpoint_every: int = Field(5, ge=1)
    """Save a resumable checkpoint every N steps (and at the end). Batches are acknowledged only once
    a checkpoint covers them, so a killed learner replays exactly the batches it lost."""
    checkpoint_keep_last: int = Field(2, ge=1)
    """Resumable checkpoints kept in ``{run_dir}/checkpoints`` (and its ``critic`` folder): the newest N
    by step; older ones are deleted after each save, never the one ``latest`` names."""
    export_every: int | None = Field(None, ge=1)
    """Also export a Hugging Face snapshot every N steps to ``{run_dir}/exports/step-{k}`` (None = only the final one)."""
    export_dir: str | None = None
    """Hugging Face export of the final policy (default ``{run_dir}/final``)."""
    weights_host: str = "127.0.0.1"
    """Interface the weight server binds."""
    weights_advertise_host: str | None = None
    """Host name rollout workers use to reach the weight server and the broadcast rendezvous (default:
    weights_host; this machine's host name when weights_host is 0.0.0.0)."""
    weights_port: int = Field(0, ge=0, le=65535)
    """Weight server port (0 = a free port). Its raw TCP chunk stream listens on the next port
    (``weights_port + 1``; a free one when 0): rollout workers on other hosts must reach both."""
    weights_bucket_mb: int = Field(64, ge=1)
    """Target size of one weight bucket (MiB): a ZMQ bucket, one CUDA IPC buffer, or one broadcast bucket."""
    weights_transport: Literal["zmq", "ipc", "broadcast", "relay"] = "zmq"
    """How new weights reach the rollout engines. ``zmq``: buckets served from host memory by the weight
    server (any engine, any host). ``ipc``: the rollout engines share the learner's GPU (colocated) and
    copy the weights from CUDA IPC buffers on it, with no host copy; the ZMQ server then is not fed, so
    every engine must be a transformers engine on the learner's GPU. ``broadcast``: rank 0 hosts a TCP
    store (``weights_store_port``) and broadcasts every version in buckets to the rollout workers that
    joined its weight group - NCCL when the weights are on CUDA, gloo on CPU - from a background
    thread (``streamrl.torchkit.weights.broadcast``); workers join and leave at any time. The store and
    the group have no authentication: a private network only. ``relay``: rank 0 serves each version once, as
    chunks from ``weights_port``, to the first rollout worker(s); every worker forwards the verified chunks it
    holds to the next (a chain in instance-name order, from the workers' heartbeats), so the learner sends
    ~1x the model per version whatever the number of workers (``streamrl.torchkit.weights.relay``)."""
    weights_ipc_buffer_sets: int = Field(2, ge=1, le=4)
    """``ipc``: sets of CUDA IPC buffers the learner writes the versions into in turn. With 2 an engine has a
    whole step to copy a version before its buffers are written again; with either, a set is not rewritten
    while an engine still copies it (it holds the set's lock file in ``/dev/shm`` while it copies; one stuck
    past ``weights_ipc_reader_wait_s`` is written over, with a warning, and skips that version). Each set
    is a copy of what is published on the learner's GPU (counted in the memory plan): for a 7B model
    about 14 GiB (bf16), so on one 80 GB GPU with a colocated engine the second set does not fit
    (recipes/gpu_7b_full.toml sets 1; a synchronous run, ``coordinator.max_staleness = 0``, loses
    nothing with 1). LoRA's adapter sync publishes the adapters alone: a few MB a set."""
    weights_ipc_reader_wait_s: float = Field(10.0, gt=0)
    """``ipc``: the longest a publish waits for an engine still copying the buffer set it is about to write
    (a copy takes milliseconds); then it writes anyway, logs a warning and counts it."""
    weights_delta_max_behind: int = Field(0, ge=0, le=64)
    """``zmq``: versions back a rollout worker still gets only what changed (delta sync, docs/architecture.md
    "Delta sync"); 0, the default, serves full weights only. The weight server keeps the last this many
    single-step links (at most a quarter of the model's bytes) and encodes each on a background thread
    (2.9 s of one CPU core for a 0.5B model), so turn it on for workers behind a link slower than the
    CPU's encode-apply-verify rate (measured on 2 cores: pays below ~1.6 Gb/s; on one host's loopback the
    full fetch is faster)."""
    weights_store_port: int = Field(0, ge=0, le=65535)
    """``broadcast``: port of the TCP store rollout workers join through (0 = a free port; it listens on
    every interface, advertised as weights_advertise_host)."""
    weights_broadcast_timeout_s: float = Field(60.0, gt=0)
    """``broadcast``: deadline of each step of the group (joining, one version's buckets and acknowledgements);
    a worker that misses it is named in the log and dropped (it joins again when it can); training goes on."""
    weights_zmq_fallback: bool = False
    """``broadcast``: also serve every version from the ZMQ weight server, for workers that cannot join the
    group (another network; a CPU engine when the learner broadcasts over NCCL). Costs a host copy and
    a host hash of every byte per version (seconds for a 1.5B model), so off by default; without it such
    a worker fails its update with an error that names this field."""
    mini_batches: int = Field(1, ge=1)
    """Optimizer steps per pass over a training batch: its groups are split into this many mini-batches
    (whole groups; each one step of ``ds.grad_accum`` micro-batches). Advantages are computed over the
    whole batch first. With more than one update per batch a no-grad pass first records log pi_old,
    and later updates are clipped against it (PPO). In a rollout-bound run the extra updates use
    learner time that would otherwise be spent waiting for the next batch."""
    ppo_epochs: int = Field(1, ge=1)
    """Passes over each training batch (``mini_batches`` optimizer steps each; groups reshuffled)."""
    freeze_vision_tower: bool = False
    """Vision-language policies: keep the vision encoder's weights as loaded (its parameters get no gradient
    and no optimizer state); the connector that maps image features into the language model and the
    language model still train. Off by default, as in verl and EasyR1 (``freeze_vision_tower``) and TRL,
    which train the whole policy in RL: the rollout engines get every weight either way. Setting it on a
    text-only checkpoint is an error. (LLaMA-Factory and ms-swift freeze the tower by default for
    supervised fine-tuning.)"""
    share_prompts: bool = False
    """Compute each distinct prompt of a micro-batch once (policy and reference): the n samples of a
    group run their responses on the prompt's KV cache. Same log-probs; for n samples of a long prompt
    much less work. Not with ``ds.gradient_checkpointing`` (no KV cache in training mode there)."""

    @model_validator(mode="after")
    def _check(self) -> LearnerConfig:
        if self.algo.advantage.estimator == "gae" and self.algo.critic is None:
            raise ValueError("algo.advantage.estimator = 'gae' needs an [learner.algo.critic] section")
        if self.algo.advantage.estimator == "flash_reinforce" and self.updates_per_batch > 1:
            raise ValueError(
                "algo.advantage.estimator = 'flash_reinforce' takes exactly one optimizer step per batch: "
                f"set mini_batches = 1 and ppo_epochs = 1 (got {self.mini_batches} and {self.ppo_epochs})"
            )
        if self.lora is not None and self.lora.sync == "adapter" and self.weights_transport == "broadcast":
            raise ValueError(
                "learner.lora.sync = 'adapter' cannot travel over learner.weights_transport = 'broadcast' (its "
                "members load full weights only): set weights_transport = 'zmq' or 'ipc', or lora.sync = 'merged'"
            )
        if self.share_prompts and self.ds.gradient_checkpointing:
            raise ValueError("share_prompts needs the KV cache in training mode: set ds.gradient_checkpointing = false")
        return self

    @property
    def updates_per_batch(self) -> int:
        """Optimizer steps the learner takes per training batch."""
        return self.mini_batches * self.ppo_epochs
