"""The GPU memory a run needs, per GPU, computed from its recipe before anything is loaded.

``streamrl up`` prints this plan for every GPU the recipe places services on (``up.gpus``) and refuses
to start a plan that does not fit, naming the setting to change (:func:`check_plan`). The terms
(docs/gpu.md, "The memory plan", has the same list):

* **policy weights** ``P x 2`` bytes (bf16; fp32 doubles it), divided by the learner's ranks under
  ZeRO-3, on the host with ``learner.ds.offload_params``. With LoRA the base is frozen in bf16 and
  the trainable parameters are the adapters' (:func:`lora_params`).
* **gradients** ``T x 2`` bytes for the ``T`` trainable parameters (``/ ranks`` under ZeRO-2 and 3), while
  training; with the optimizer offloaded only DeepSpeed's reduce buckets (``GRAD_BUCKETS_GIB``).
* **optimizer** AdamW's two moments and the fp32 master copy, ``T x 12`` bytes (``T x 8`` with fp32
  weights), ``/ ranks`` under ZeRO-1..3, on the host with ``learner.ds.offload_optimizer``.
* **activations** of one micro-batch of ``learner.ds.micro_batch_size`` sequences of
  ``rollout.engine.max_model_len`` tokens, bf16: per token and layer ``2 (8 h + 4 kv + 5 i)`` bytes
  without gradient checkpointing (the tensors a decoder layer keeps for its backward pass: norms,
  projections, attention, the gated MLP), ``2 h`` with it plus one layer's full set; the output head's
  fp32 logits and their gradient, ``8 V`` bytes per token over ``learner.ds.head_chunk_tokens`` tokens
  with the fused head, over every token with the full one.
* **the learner's runtime** (CUDA context, NCCL, allocator slack): a fixed allowance, ``RUNTIME_GIB``.
* **CUDA IPC** (``learner.weights_transport = "ipc"``): the learner's persistent bf16 buffers of what it
  publishes (the whole model, or only the adapters with LoRA's adapter sync), once per buffer set
  (``learner.weights_ipc_buffer_sets``, default 2), and the engine's staging copy of each update (while
  generating).
* **host memory**: offloaded optimizer states with their fp32 gradients (``16 T`` bytes), offloaded
  parameters, and each sleeping vLLM engine's weights; refused past ``HOST_SHARE`` of the machine's memory.
* **rollout engine**: vLLM takes ``gpu_memory_utilization x capacity`` (weights, activations, CUDA
  graphs and the KV cache inside it), or its weights plus ``kv_cache_gib``; the transformers engine
  its weights plus a KV cache for ``max_num_seqs`` sequences of ``max_model_len`` tokens. With
  ``rollout.engine.sleep_between_versions`` the engine gives its share back while the learner trains,
  so the two phases are checked apart: generating (learner's resident terms + the engine) and
  training (learner's resident terms + activations).

Model shapes come from the model folder's ``config.json`` (decoder-only transformers with Llama /
Qwen2 / Mistral fields); a hub id with no local folder is looked up in the Hugging Face cache, and a
model whose config cannot be read gets no plan (said once, not an error). GPU capacity comes from
``up.gpu_memory_gib`` when set, else from ``nvidia-smi``; no GPU, no plan. Figures are estimates: the
fixed allowances are stated, and a margin (``up.gpu_memory_margin_gib``) is kept free.
"""

from __future__ import annotations

import json
import shutil
import subprocess
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

GIB = 2**30
RUNTIME_GIB = 2.0
"""The learner's CUDA context, NCCL buffers and allocator fragmentation (an allowance, not a measurement)."""
_ING = {"generate": "generating", "train": "training"}
HOST_SHARE = 0.8
"""Of the host's memory, what the plan's host terms may take."""
GRAD_BUCKETS_GIB = 2.0
"""Gradients on the GPU when the optimizer is offloaded: DeepSpeed's reduce buckets (an allowance)."""
ENGINE_RUNTIME_GIB = 1.5
"""The transformers engine's CUDA context, graphs and sampling buffers (an allowance)."""


@dataclass(frozen=True)
class ModelShape:
    """What the plan needs of a decoder-only transformer."""

    params: int
    layers: int
    hidden: int
    intermediate: int
    vocab: int
    kv_dim: int
    """Key/value width per token and layer: ``num_key_value_heads x head_dim``."""
    linear_shapes: tuple[tuple[str, int, int], ...] = ()
    """``(module name, in, out)`` of one layer's linear projections (what LoRA can adapt)."""


def shape_from_config(config: Mapping[str, Any]) -> ModelShape:
    """The shape of a Llama / Qwen2 / Mistral-style decoder from its ``config.json`` fields."""
    h = int(config["hidden_size"])
    layers = int(config["num_hidden_layers"])
    heads = int(config["num_attention_heads"])
    kv_heads = int(config.get("num_key_value_heads") or heads)
    head_dim = int(config.get("head_dim") or h // heads)
    i = int(config["intermediate_size"])
    vocab = int(config["vocab_size"])
    q, kv = heads * head_dim, kv_heads * head_dim
    linears = (
        ("q_proj", h, q),
        ("k_proj", h, kv),
        ("v_proj", h, kv),
        ("o_proj", q, h),
        ("gate_proj", h, i),
        ("up_proj", h, i),
        ("down_proj", i, h),
    )
    per_layer = sum(a * b for _, a, b in linears) + 2 * h  # projections and the two norms
    if config.get("model_type") == "qwen2" or config.get("attention_bias"):
        per_layer += q + 2 * kv  # q/k/v biases
    head = 0 if config.get("tie_word_embeddings", False) else vocab * h
    params = vocab * h + layers * per_layer + h + head
    return ModelShape(params, layers, h, i, vocab, kv, linears)


def read_shape(model: str) -> ModelShape | None:
    """The shape of ``model`` (a folder, or a hub id found in the local Hugging Face cache); None if unreadable."""
    candidates = [Path(model) / "config.json"]
    cache = Path.home() / ".cache" / "huggingface" / "hub" / f"models--{model.replace('/', '--')}" / "snapshots"
    if cache.is_dir():
        candidates += sorted(cache.glob("*/config.json"))
    for path in candidates:
        try:
            config = json.loads(path.read_text())
            return shape_from_config(config.get("text_config", config))
        except (OSError, ValueError, KeyError, TypeError):
            continue
    return None


def lora_params(shape: ModelShape, rank: int, targets: list[str] | str) -> int:
    """Trainable parameters of LoRA adapters of ``rank`` on ``targets`` (module names, or ``all-linear``)."""
    names = {n for n, _, _ in shape.linear_shapes} if targets == "all-linear" else set(targets)
    return shape.layers * sum(rank * (a + b) for n, a, b in shape.linear_shapes if n in names)


@dataclass
class Term:
    name: str
    gib: float
    setting: str
    """The setting that changes this term (named in the refusal)."""
    phase: str = "both"
    """``both``, ``generate`` or ``train``: when the term is held."""


@dataclass
class GpuPlan:
    """The terms held on one GPU and its capacity."""

    device: str
    capacity_gib: float
    margin_gib: float
    terms: list[Term] = field(default_factory=list)
    host: tuple[list[Term], float | None] | None = None
    """Host-memory terms of the run and the host's memory (GiB), on the first GPU's plan (:func:`host_terms`)."""

    def peak_gib(self, phase: str) -> float:
        return sum(t.gib for t in self.terms if t.phase in ("both", phase))

    @property
    def peak(self) -> tuple[str, float]:
        """The phase with the largest total, and that total."""
        return max(((p, self.peak_gib(p)) for p in ("generate", "train")), key=lambda x: x[1])

    def fits(self) -> bool:
        return self.peak[1] + self.margin_gib <= self.capacity_gib

    def render(self) -> str:
        phase, total = self.peak
        rows = [f"GPU {self.device}: {self.capacity_gib:.1f} GiB, plan peaks at {total:.1f} GiB while {_ING[phase]}"]
        for t in self.terms:
            when = "" if t.phase == "both" else f" ({t.phase} only)"
            rows.append(f"  {t.name:<34} {t.gib:8.2f} GiB{when}")
        if self.host is not None:
            terms, memory = self.host
            known = f"{memory:.1f} GiB" if memory is not None else "unknown"
            rows.append(f"host memory ({known}): {sum(t.gib for t in terms):.1f} GiB")
            rows += [f"  {t.name:<34} {t.gib:8.2f} GiB" for t in terms]
        return "\n".join(rows)


def _section(data: Mapping[str, Any], dotted: str) -> Mapping[str, Any]:
    node: Any = data
    for key in dotted.split("."):
        node = node.get(key) if isinstance(node, Mapping) else None
    return node if isinstance(node, Mapping) else {}


def published_params(data: Mapping[str, Any], shape: ModelShape) -> int:
    """Parameters in each weights update: the adapters with LoRA's adapter sync, else the whole model."""
    lora = _section(data, "learner").get("lora")
    if isinstance(lora, Mapping) and lora.get("sync", "adapter") == "adapter":
        return lora_params(shape, int(lora.get("rank", 16)), lora.get("target_modules", "all-linear"))
    return shape.params


def learner_terms(data: Mapping[str, Any], shape: ModelShape, max_len: int) -> list[Term]:
    """The learner's terms on each of its GPUs (see the module docstring)."""
    learner, ds = _section(data, "learner"), _section(data, "learner.ds")
    lora = learner.get("lora")
    ranks = int(learner.get("ranks", 1))
    stage = int(ds.get("zero_stage", 2))
    width = 4 if ds.get("dtype", "bf16") == "fp32" else 2
    trainable = shape.params
    if isinstance(lora, Mapping):
        trainable = lora_params(shape, int(lora.get("rank", 16)), lora.get("target_modules", "all-linear"))
    terms = []
    weights = shape.params * width / (ranks if stage == 3 else 1)
    if isinstance(lora, Mapping):
        weights += trainable * width / (ranks if stage == 3 else 1)
    on_host = bool(ds.get("offload_params"))
    terms.append(
        Term(
            "learner weights" + (" (on host)" if on_host else ""),
            0 if on_host else weights / GIB,
            "learner.ds.offload_params",
        )
    )
    grads = trainable * width / (ranks if stage >= 2 else 1)
    if ds.get("offload_optimizer"):  # reduced in buckets and moved to the host states as they come
        grads = min(grads, GRAD_BUCKETS_GIB * GIB)
    terms.append(Term("learner gradients", grads / GIB, "learner.ds.zero_stage", "train"))
    optim = trainable * (12 if width == 2 else 8) / (ranks if stage >= 1 else 1)
    offloaded = bool(ds.get("offload_optimizer"))
    terms.append(
        Term(
            "learner optimizer (AdamW)" + (" (on host)" if offloaded else ""),
            0 if offloaded else optim / GIB,
            "learner.ds.offload_optimizer",
        )
    )
    tokens = int(ds.get("micro_batch_size", 1)) * max_len
    per_token_layer = 2 * (8 * shape.hidden + 4 * shape.kv_dim + 5 * shape.intermediate)
    if ds.get("gradient_checkpointing"):
        act = tokens * (shape.layers * 2 * shape.hidden + per_token_layer)
    else:
        act = tokens * shape.layers * per_token_layer
    head_tokens = (
        min(tokens, int(ds.get("head_chunk_tokens", 8192))) if ds.get("logprob_head", "fused") == "fused" else tokens
    )
    act += head_tokens * shape.vocab * 8
    terms.append(Term(f"learner activations ({tokens} tokens)", act / GIB, "learner.ds.micro_batch_size", "train"))
    terms.append(Term("learner runtime (allowance)", RUNTIME_GIB, "learner.ds.micro_batch_size"))
    if learner.get("weights_transport") == "ipc":  # persistent flat buffers the engines copy from, per set
        sets = int(learner.get("weights_ipc_buffer_sets", 2))
        ipc = sets * published_params(data, shape) * width / GIB
        terms.append(Term("learner CUDA IPC weight buffers", ipc, "learner.weights_ipc_buffer_sets"))
    return terms


def engine_terms(data: Mapping[str, Any], shape: ModelShape, capacity_gib: float) -> list[Term]:
    """The rollout engine's terms on its GPU (one replica)."""
    engine = _section(data, "rollout.engine")
    sleeps = bool(engine.get("sleep_between_versions"))
    phase = "generate" if sleeps else "both"
    tp = int(engine.get("tensor_parallel_size", 1))
    width = 4 if engine.get("dtype") == "float32" else 2
    weights = shape.params * width / tp / GIB
    max_len = int(engine.get("max_model_len", 4096))
    terms = []
    if _section(data, "learner").get("weights_transport") == "ipc":  # the engine's checked copy of each update
        staged = published_params(data, shape) * width / GIB
        terms.append(Term("engine CUDA IPC staging copy", staged, "learner.weights_transport", phase))
    if engine.get("type", "vllm") == "vllm":
        if engine.get("kv_cache_gib") is not None:
            return [
                *terms,
                Term("vLLM weights", weights, "rollout.engine.tensor_parallel_size", phase),
                Term("vLLM KV cache", float(engine["kv_cache_gib"]), "rollout.engine.kv_cache_gib", phase),
            ]
        share = float(engine.get("gpu_memory_utilization", 0.9)) * capacity_gib
        return [
            *terms,
            Term("vLLM (gpu_memory_utilization share)", share, "rollout.engine.gpu_memory_utilization", phase),
        ]
    kv = int(engine.get("max_num_seqs", 256)) * max_len * shape.layers * 2 * shape.kv_dim * width / GIB
    return [
        *terms,
        Term("transformers engine weights", weights, "rollout.engine.dtype", phase),
        Term("transformers engine KV cache", kv, "rollout.engine.max_num_seqs", phase),
        Term("transformers engine runtime (allowance)", ENGINE_RUNTIME_GIB, "rollout.engine.max_num_seqs", phase),
    ]


def gpu_capacity_gib() -> dict[str, float]:
    """Each visible GPU's memory (GiB) by index, from ``nvidia-smi``; empty without one."""
    if shutil.which("nvidia-smi") is None:
        return {}
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=index,memory.total", "--format=csv,noheader,nounits"],
            capture_output=True,
            text=True,
            timeout=10,
            check=True,
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return {}
    rows = [line.split(",") for line in out.strip().splitlines() if "," in line]
    return {index.strip(): float(mib) / 1024 for index, mib in rows}


def placements(data: Mapping[str, Any]) -> dict[str, list[str]]:
    """Device -> the services ``up.gpus`` places there (a service once per replica entry naming it)."""
    placed: dict[str, list[str]] = {}
    for service, devices in (_section(data, "up").get("gpus") or {}).items():
        for spec in devices if isinstance(devices, list) else [devices]:
            for device in str(spec).split(","):
                placed.setdefault(device.strip(), []).append(service)
    return placed


def plan_gpus(data: Mapping[str, Any], capacity: Mapping[str, float]) -> list[GpuPlan]:
    """A plan for each GPU the recipe's ``up.gpus`` places the learner or rollout engines on."""
    up = _section(data, "up")
    placed = placements(data)
    learner_model = _section(data, "learner").get("model")
    engine = _section(data, "rollout.engine")
    plans = []
    for device, services in sorted(placed.items()):
        if device not in capacity:
            continue
        plan = GpuPlan(device, capacity[device], float(up.get("gpu_memory_margin_gib", 1.0)))
        if "learner" in services and learner_model:
            shape = read_shape(str(learner_model))
            if shape is not None:
                plan.terms += learner_terms(data, shape, int(engine.get("max_model_len", 4096)))
        if "rollout" in services and engine.get("device", "auto") != "cpu":
            shape = read_shape(str(engine.get("model") or learner_model))
            if shape is not None:
                for _ in range(services.count("rollout")):
                    plan.terms += engine_terms(data, shape, plan.capacity_gib)
        if plan.terms:
            plans.append(plan)
    return plans


class PlanError(ValueError):
    """A GPU's plan does not fit; the message names the settings to change."""


def check_plan(plan: GpuPlan) -> None:
    """Raise :class:`PlanError` naming the largest terms' settings when ``plan`` does not fit."""
    if plan.fits():
        return
    phase, total = plan.peak
    over = total + plan.margin_gib - plan.capacity_gib
    held = sorted((t for t in plan.terms if t.phase in ("both", phase) and t.gib > 0), key=lambda t: -t.gib)
    advice = "; ".join(f"{t.name} {t.gib:.1f} GiB ({t.setting})" for t in held[:3])
    raise PlanError(
        f"GPU {plan.device}: the run needs {total:.1f} GiB while {_ING[phase]}, {over:.1f} GiB more than its "
        f"{plan.capacity_gib:.1f} GiB less the {plan.margin_gib:g} GiB margin. Largest terms: {advice}. Change one of "
        "those settings (or up.gpu_memory_gib if the capacity is wrong)"
    )


def host_terms(data: Mapping[str, Any]) -> list[Term]:
    """What the GPU plans put in host memory: offloaded optimizer states with their fp32 gradients
    (16 bytes a trainable parameter), offloaded parameters, and each sleeping vLLM engine's weights."""
    learner, ds, engine = _section(data, "learner"), _section(data, "learner.ds"), _section(data, "rollout.engine")
    shape = read_shape(str(learner.get("model"))) if learner.get("model") else None
    terms = []
    if shape is not None:
        lora = learner.get("lora")
        trainable = shape.params
        if isinstance(lora, Mapping):
            trainable = lora_params(shape, int(lora.get("rank", 16)), lora.get("target_modules", "all-linear"))
        if ds.get("offload_optimizer"):
            terms.append(
                Term("learner optimizer + fp32 gradients", trainable * 16 / GIB, "learner.ds.offload_optimizer")
            )
        if ds.get("offload_params"):
            terms.append(Term("learner parameters", shape.params * 2 / GIB, "learner.ds.offload_params"))
        rollouts = sum(services.count("rollout") for services in placements(data).values())
        if engine.get("type", "vllm") == "vllm" and engine.get("sleep_between_versions") and rollouts:
            terms.append(
                Term(
                    "vLLM weights while asleep",
                    rollouts * shape.params * 2 / GIB,
                    "rollout.engine.sleep_between_versions",
                )
            )
    return terms


def host_memory_gib() -> float | None:
    """This machine's memory (GiB) from /proc/meminfo; None where it cannot be read."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) / 2**20
    except (OSError, ValueError, IndexError):
        return None
    return None


def plan_run(data: Mapping[str, Any]) -> tuple[list[GpuPlan], str | None]:
    """The plans of a recipe (``up.gpu_memory_gib`` or ``nvidia-smi`` for the capacity), and the first
    refusal's message when ``up.gpu_plan_check`` is on and a plan does not fit (None when all fit)."""
    up = _section(data, "up")
    if up.get("gpu_memory_gib") is not None:
        capacity = dict.fromkeys(placements(data), float(up["gpu_memory_gib"]))
    else:
        capacity = gpu_capacity_gib()
    plans = plan_gpus(data, capacity)
    if plans:  # the host's share of the same plan: offloaded states, a sleeping engine's weights
        host = host_terms(data)
        total, memory = sum(t.gib for t in host), host_memory_gib()
        if host:
            plans[0].host = (host, memory)
        if up.get("gpu_plan_check", True) and memory is not None and total > HOST_SHARE * memory:
            names = "; ".join(f"{t.name} {t.gib:.1f} GiB ({t.setting})" for t in host)
            return plans, (
                f"host memory: the run puts {total:.1f} GiB in this machine's {memory:.1f} GiB (more than "
                f"{HOST_SHARE:.0%} of it, which the services, pinned buffers and page cache need too): {names}. "
                "Train LoRA adapters (learner.lora), or use a machine with more memory"
            )
    if up.get("gpu_plan_check", True):
        for plan in plans:
            try:
                check_plan(plan)
            except PlanError as e:
                return plans, str(e)
    return plans, None
