"""ModelEngine: a Hugging Face model trained by DeepSpeed. The only module that calls ``deepspeed.initialize``.

What it owns, in order of use:

* process-group setup (:mod:`streamrl.learner.distributed`): a single process needs no launcher, and no
  world is written into its environment;
* the model: causal LM, reward model (sequence classification, one label: the score at the last
  non-pad token) or value model (token classification, one label per token); optional LoRA (peft),
  QLoRA only on CUDA. A causal-LM checkpoint whose config has a ``vision_config`` is loaded as a
  vision-language model (``AutoModelForImageTextToText``, with its ``AutoProcessor``; its vision
  tower optionally frozen), see :mod:`streamrl.learner.vision`.
* AdamW with decay on matrices only, linear warmup then constant / linear / cosine decay
  (:func:`lr_multiplier`), DeepSpeed's accumulation boundary and gradient clipping.
* resumable checkpoints (DeepSpeed model/optimizer/scheduler states, per-rank RNG states, and the
  caller's ``client_state`` such as the data position); every file and folder is fsync'ed, then the
  ``latest`` pointer is written last (atomically, durably: :mod:`streamrl.learner.durable`), so a kill
  or a power cut during a save leaves the previous checkpoint in force; files are loaded as data, never
  as code.
* full parameters in Hugging Face naming (:meth:`ModelEngine.iter_full_params`, ZeRO-3 shards
  gathered in groups, LoRA merged) and Hugging Face export (safetensors + tokenizer, and the
  processor of a vision-language model).
"""

from __future__ import annotations

import copy
import logging
import math
import os
import random
import time
from collections.abc import Iterator
from contextlib import nullcontext
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch

from streamrl.learner import durable
from streamrl.learner.distributed import init_distributed
from streamrl.learner.ds_config import DeepSpeedConfig, LoraConfig
from streamrl.learner.kernels import apply_kernels
from streamrl.learner.safe_checkpoint import SafeLoads, load_checkpoint_file
from streamrl.learner.varlen_attention import register as register_varlen_attention
from streamrl.learner.vision import vision_tower
from streamrl.torchkit.vision import has_vision_tower, load_processor

logger = logging.getLogger(__name__)
ModelKind = Literal["causal_lm", "reward", "value"]
GATHER_BUCKET_BYTES = 512 * 2**20
_CLIENT_KEY = "streamrl_client_state"
_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def lr_multiplier(step: int, warmup: int, total: int, scheduler: str, min_ratio: float) -> float:
    """Learning-rate factor for the optimizer step with 0-based index ``step``."""
    if step < warmup:
        return (step + 1) / warmup
    if scheduler == "constant":
        return 1.0
    progress = min(1.0, max(0.0, (step - warmup) / max(1, total - warmup)))
    if scheduler == "linear":
        return 1.0 - (1.0 - min_ratio) * progress
    if scheduler == "cosine":
        return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))
    raise ValueError(f"unknown scheduler {scheduler!r}")


def seed_everything(seed: int) -> None:
    """Seed python, numpy and torch (all devices)."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def _rng_state() -> dict[str, Any]:
    np_state = np.random.get_state(legacy=True)
    assert isinstance(np_state, tuple)  # legacy=True: ("MT19937", keys, pos, has_gauss, cached_gaussian)
    state: dict[str, Any] = {
        "python": random.getstate(),
        "numpy": [np_state[0], np_state[1].tolist(), *np_state[2:]],
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    kind, keys, *rest = state["numpy"]
    np.random.set_state((kind, np.array(keys, dtype=np.uint32), *rest))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def load_tokenizer(path: str) -> Any:
    """The tokenizer at ``path`` (folder or hub id), with the eos token as pad token when it has none."""
    import transformers

    tokenizer = transformers.AutoTokenizer.from_pretrained(path)
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def _check_qlora(lora: LoraConfig | None, ds_cfg: DeepSpeedConfig) -> None:
    if lora is None or not lora.load_in_4bit:
        return
    if not torch.cuda.is_available():
        raise ValueError(
            "lora.load_in_4bit (QLoRA) needs a CUDA GPU: bitsandbytes' 4-bit kernels do not run on CPU. "
            "Use plain LoRA (lora.load_in_4bit=false) on this machine."
        )
    if ds_cfg.zero_stage == 3:
        raise ValueError("lora.load_in_4bit (QLoRA) cannot be combined with deepspeed.zero_stage=3; use stage <= 2")
    try:
        import bitsandbytes  # noqa: F401
    except ImportError as e:
        raise ValueError("lora.load_in_4bit (QLoRA) needs the bitsandbytes package, which is not installed") from e


def training_device() -> torch.device:
    """Where DeepSpeed trains this rank's model: ``cuda:LOCAL_RANK`` when CUDA is available, else the CPU."""
    if torch.cuda.is_available():
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    return torch.device("cpu")


def compile_and_warm_up(model: Any, batch: int = 6, length: int = 17, shared_prompts: bool = False) -> float:
    """``torch.compile`` the decoder body of ``model`` in place (dynamic shapes; parameter names
    unchanged; every forward path runs through the body) and compile its training and no-grad graphs
    now, leaving no gradient behind. The warm-up takes the path training will take: a causal LM the
    flat varlen forward of :mod:`streamrl.learner.lm_forward` (three sequences end to end), or with
    ``shared_prompts`` the shared-prompt forward (prompts, then responses on their KV cache); a
    score or value model a right-padded random batch. Every warm-up size differs from the others and
    from 1: equal sizes would be assumed equal for good (a recompile at the first real step). Runs
    before DeepSpeed wraps the model, on the device the model is on: the caller puts it on its
    training device first (inductor builds kernels for the device of the warm-up). Returns the
    seconds it took."""
    from streamrl.learner.prompt_sharing import shared_prompt_logits
    from streamrl.learner.varlen_attention import varlen_kwargs

    started = time.perf_counter()
    base = model.get_base_model() if hasattr(model, "peft_config") else model
    body = getattr(base, base.base_model_prefix)
    body.compile(dynamic=True)
    model.train()  # the training engine runs in train mode; a mode change would recompile
    device = next(model.parameters()).device
    generator = torch.Generator().manual_seed(0)
    vocab_size = model.config.get_text_config().vocab_size  # a vision-language config keeps it in text_config
    ids = torch.randint(0, vocab_size, (batch, length), generator=generator).to(device)
    mask = torch.ones_like(ids)
    mask[0, length // 2 :] = 0  # training batches are right-padded
    prompt_len = 5  # 3 distinct prompts of 5 tokens, 2 rows each, responses up to 12 tokens
    prompt_lens = torch.full((batch,), prompt_len, dtype=torch.long)
    ids[1::2, :prompt_len] = ids[::2, :prompt_len]
    flat = not shared_prompts and base.get_output_embeddings() is not None
    lengths = [5, 7, 9]  # the flat row: 21 tokens, 4 boundaries, longest 9
    cu = torch.tensor([0, 5, 12, 21], dtype=torch.int32)
    positions = torch.cat([torch.arange(n) for n in lengths])[None, :].to(device)

    def forward() -> torch.Tensor:
        if shared_prompts:
            return shared_prompt_logits(model, ids, mask, prompt_lens, length - prompt_len)
        if flat:
            out = body(input_ids=ids.flatten()[None, :21], position_ids=positions, **varlen_kwargs(cu, 9, device))
            return out.last_hidden_state
        return model(input_ids=ids, attention_mask=mask).logits

    (forward().float().sum() * 0.0).backward()
    model.zero_grad(set_to_none=True)
    with torch.no_grad():
        forward()
    return time.perf_counter() - started


def _load_model(
    path: str, kind: ModelKind, ds_cfg: DeepSpeedConfig, lora: LoraConfig | None, vision: bool = False
) -> Any:
    model = _from_pretrained(path, kind, ds_cfg, lora, vision)
    apply_kernels(model, ds_cfg.kernels)
    return model


def _from_pretrained(
    path: str, kind: ModelKind, ds_cfg: DeepSpeedConfig, lora: LoraConfig | None, vision: bool = False
) -> Any:
    import transformers

    attn = register_varlen_attention() if ds_cfg.attn_implementation == "varlen" else ds_cfg.attn_implementation
    kwargs: dict[str, Any] = {"dtype": _DTYPES[ds_cfg.dtype], "attn_implementation": attn}
    if lora is not None and lora.load_in_4bit:
        kwargs["quantization_config"] = transformers.BitsAndBytesConfig(
            load_in_4bit=True,
            bnb_4bit_quant_type="nf4",
            bnb_4bit_use_double_quant=True,
            bnb_4bit_compute_dtype=_DTYPES[ds_cfg.dtype],
        )
        kwargs["device_map"] = {"": int(os.environ.get("LOCAL_RANK", "0"))}
    if kind == "causal_lm" and vision:
        return transformers.AutoModelForImageTextToText.from_pretrained(path, **kwargs)
    if kind == "causal_lm":
        return transformers.AutoModelForCausalLM.from_pretrained(path, **kwargs)
    if kind == "reward":
        return transformers.AutoModelForSequenceClassification.from_pretrained(path, num_labels=1, **kwargs)
    if kind == "value":
        config = transformers.AutoConfig.from_pretrained(path, num_labels=1)
        config.classifier_dropout = 0.0  # token classifiers default to dropout 0.1 on the hidden states
        return transformers.AutoModelForTokenClassification.from_pretrained(path, config=config, **kwargs)
    raise ValueError(f"unknown model kind {kind!r}; expected 'causal_lm', 'reward' or 'value'")


def _vision_checkpoint(model_path: str, kind: ModelKind, freeze_vision_tower: bool) -> bool:
    """Whether ``model_path`` loads as a vision-language model; ValueError for ``freeze_vision_tower`` on another."""
    import transformers

    vision = kind == "causal_lm" and has_vision_tower(transformers.AutoConfig.from_pretrained(model_path))
    if freeze_vision_tower and not vision:
        raise ValueError(f"freeze_vision_tower = true needs a vision-language model; {model_path} has no vision_config")
    return vision


def _set_use_cache(config: Any, value: bool) -> None:
    """Set ``use_cache`` on a model config and on its language model's (vision-language models read that one)."""
    config.use_cache = value
    if getattr(config, "text_config", None) is not None:
        config.text_config.use_cache = value


def _apply_lora(model: Any, lora: LoraConfig, kind: ModelKind, gradient_checkpointing: bool) -> Any:
    import peft

    if lora.load_in_4bit:
        model = peft.prepare_model_for_kbit_training(model, use_gradient_checkpointing=gradient_checkpointing)
    task = {"causal_lm": peft.TaskType.CAUSAL_LM, "reward": peft.TaskType.SEQ_CLS, "value": peft.TaskType.TOKEN_CLS}
    config = peft.LoraConfig(
        r=lora.rank,
        lora_alpha=lora.alpha,  # type: ignore[arg-type]  # peft annotates int; a float scales the same (alpha / r)
        lora_dropout=lora.dropout,
        target_modules=lora.target_modules,
        task_type=task[kind],
    )
    return peft.get_peft_model(model, config)


def _param_groups(model: torch.nn.Module, weight_decay: float) -> list[dict[str, Any]]:
    decay: list[torch.nn.Parameter] = []
    no_decay: list[torch.nn.Parameter] = []
    for p in model.parameters():
        if not p.requires_grad:
            continue
        shape = getattr(p, "ds_shape", p.shape)  # ZeRO-3 partitioned params are flat; ds_shape is the real one
        (decay if len(shape) >= 2 else no_decay).append(p)
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return [g for g in groups if g["params"]]


def _hf_name(peft_name: str) -> str:
    """Map a peft parameter name to the plain model's name."""
    name = peft_name.removeprefix("base_model.model.")
    return name.replace(".base_layer.", ".").replace(".modules_to_save.default.", ".")


def _group_key(name: str) -> str:
    """Parameters that must be gathered together (a LoRA layer's base weight and its adapters)."""
    for marker in (".base_layer.", ".lora_"):
        if marker in name:
            return name.split(marker)[0]
    return name


class ModelEngine:
    """A Hugging Face model under a DeepSpeed engine. Build with :meth:`from_config`."""

    def __init__(self, ds_engine: Any, tokenizer: Any, kind: ModelKind, train: bool, processor: Any = None) -> None:
        self._engine = ds_engine
        self.tokenizer = tokenizer
        """The model's tokenizer (pad token set: the eos token when the tokenizer has none)."""
        self.processor = processor
        """A vision-language model's ``AutoProcessor`` (image processor and tokenizer); None for a text model."""
        self.kind = kind
        self._train = train
        self._manual_grad_norm: float | None = None
        self.backward_calls = 0
        """Backward passes so far: a failed step that made any has changed gradients or weights."""

    @classmethod
    def from_config(
        cls,
        model_path: str,
        ds_cfg: DeepSpeedConfig,
        kind: ModelKind = "causal_lm",
        *,
        lora: LoraConfig | None = None,
        train: bool = True,
        total_steps: int | None = None,
        tokenizer_path: str | None = None,
        shared_prompts: bool = False,
        freeze_vision_tower: bool = False,
    ) -> ModelEngine:
        """Load ``model_path`` (local folder or hub id) and wrap it in DeepSpeed.

        ``train=False`` builds a frozen engine (no optimizer; ZeRO-3 still shards it), e.g. a
        reference policy. ``total_steps`` sizes the linear/cosine schedules. ``shared_prompts``: the
        forwards will be shared-prompt ones (a compiled model is warmed up on those).
        ``freeze_vision_tower``: a vision-language model's vision encoder is not trained.
        """
        _check_qlora(lora, ds_cfg)
        if train and ds_cfg.scheduler != "constant" and total_steps is None:
            raise ValueError(f"scheduler={ds_cfg.scheduler!r} needs total_steps")
        vision = _vision_checkpoint(model_path, kind, freeze_vision_tower)
        init_distributed()
        import deepspeed

        seed_everything(ds_cfg.seed)
        tokenizer = load_tokenizer(tokenizer_path or model_path)
        ds_dict = ds_cfg.to_deepspeed_dict(train, cuda=torch.cuda.is_available())
        zero3_loading = None  # while alive, from_pretrained loads straight into ZeRO-3 shards
        if ds_dict["zero_optimization"]["stage"] == 3:
            from transformers.integrations import HfDeepSpeedConfig

            ds_dict["train_batch_size"] = (
                ds_cfg.micro_batch_size * ds_cfg.grad_accum * torch.distributed.get_world_size()
            )
            zero3_loading = HfDeepSpeedConfig(ds_dict)
        model = _load_model(model_path, kind, ds_cfg, lora, vision)
        del zero3_loading  # later from_pretrained calls in this process must load plain models
        processor = load_processor(tokenizer_path or model_path) if vision else None
        if freeze_vision_tower:
            vision_tower(model).requires_grad_(False)
        if model.config.pad_token_id is None or kind != "causal_lm":
            model.config.pad_token_id = tokenizer.pad_token_id  # score heads pool at the last non-pad token
        # no KV cache in training/scoring forwards: with a cache, transformers ignores the position-id
        # restarts that isolate packed samples (export writes use_cache=True back)
        _set_use_cache(model.config, False)
        if train and ds_cfg.gradient_checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        if lora is not None:
            model = _apply_lora(model, lora, kind, train and ds_cfg.gradient_checkpointing)
        if not train:
            model.requires_grad_(False)
            model.eval()
            engine, *_ = deepspeed.initialize(model=model, config=ds_dict)
            return cls(engine, tokenizer, kind, train=False, processor=processor)

        if ds_cfg.compile:
            # Warm up where training runs. deepspeed.initialize moves a ZeRO <= 2 model to this same
            # device itself (compile excludes ZeRO-3, whose parameters are already partitioned),
            # and a 4-bit model was loaded onto it (and cannot be moved).
            device = training_device()
            if next(model.parameters()).device != device:
                model.to(device)
            seconds = compile_and_warm_up(model, shared_prompts=shared_prompts)
            logger.info("torch.compile: model compiled and warmed up in %.1f s", seconds)
        steps = total_steps or 1

        def make_scheduler(optimizer: torch.optim.Optimizer) -> torch.optim.lr_scheduler.LambdaLR:
            return torch.optim.lr_scheduler.LambdaLR(
                optimizer,
                lambda s: lr_multiplier(s, ds_cfg.warmup_steps, steps, ds_cfg.scheduler, ds_cfg.min_lr_ratio),
            )

        engine, *_ = deepspeed.initialize(
            model=model,
            model_parameters=_param_groups(model, ds_cfg.weight_decay),
            config=ds_dict,
            lr_scheduler=make_scheduler,
        )
        engine.train()
        return cls(engine, tokenizer, kind, train=True, processor=processor)

    # ----------------------------------------------------------------- training
    @property
    def module(self) -> Any:
        """The wrapped model (a ``transformers`` model, or a peft model around one)."""
        return self._engine.module

    @property
    def device(self) -> torch.device:
        return torch.device(self._engine.device)

    @property
    def rank(self) -> int:
        return torch.distributed.get_rank()

    @property
    def world_size(self) -> int:
        return torch.distributed.get_world_size()

    @property
    def global_steps(self) -> int:
        """Optimizer steps taken so far (restored by :meth:`load_checkpoint`)."""
        return int(self._engine.global_steps)

    @property
    def lr(self) -> float:
        """Learning rate of the next optimizer step."""
        return float(self._engine.get_lr()[0])

    @property
    def grad_norm(self) -> float | None:
        """Global gradient norm of the last optimizer step, before clipping (None if not computed)."""
        norm = self._engine.get_global_grad_norm()
        return self._manual_grad_norm if norm is None else float(norm)

    def forward(self, **inputs: Any) -> Any:
        """Run the model; tensors may be on any device, they are moved to the engine's."""
        return self._engine(**{k: v.to(self.device) if isinstance(v, torch.Tensor) else v for k, v in inputs.items()})

    __call__ = forward

    def train(self, mode: bool = True) -> None:
        """Switch dropout etc. on (``mode=True``) or off."""
        self._engine.train(mode)

    def backward(self, loss: torch.Tensor) -> None:
        """Backward of one micro-batch's loss (DeepSpeed scales it by 1 / grad_accum)."""
        if not self._train:
            raise RuntimeError("this engine was built with train=False")
        self.backward_calls += 1
        self._engine.backward(loss)

    def step(self) -> bool:
        """Call after every micro-batch; returns True when this call took an optimizer step."""
        if not self._train:
            raise RuntimeError("this engine was built with train=False")
        boundary = bool(self._engine.is_gradient_accumulation_boundary())
        if boundary and self._engine.zero_optimization_stage() == 0:  # ZeRO optimizers track the norm themselves
            grads = [p.grad for p in self.module.parameters() if p.grad is not None]
            self._manual_grad_norm = float(torch.linalg.vector_norm(torch.stack([g.float().norm() for g in grads])))
        self._engine.step()
        return boundary

    # ----------------------------------------------------------- checkpoints
    def save_checkpoint(self, directory: str | Path, client_state: dict[str, Any], tag: str | None = None) -> str:
        """Save a resumable checkpoint tagged ``tag`` (default ``step_<global_steps>``) under ``directory``, on
        disk (fsync'ed) before ``latest`` names it; all ranks call it."""
        directory = Path(directory)
        tag = tag or f"step_{self.global_steps}"
        self._engine.save_checkpoint(
            str(directory), tag=tag, client_state={_CLIENT_KEY: client_state}, save_latest=False
        )
        torch.save(_rng_state(), directory / tag / f"rng_rank{self.rank}.pt")
        durable.sync_tree(directory / tag)  # every rank: its own files (another host's disk is not ours to see)
        torch.distributed.barrier()
        if self.rank == 0:
            durable.write_marker(directory / "latest", tag)
        torch.distributed.barrier()
        return tag

    def load_checkpoint(self, directory: str | Path, tag: str | None = None) -> dict[str, Any] | None:
        """Restore checkpoint ``tag`` (default: the one ``latest`` points to); returns its ``client_state``, or
        None if there is none.

        Every file is loaded as data (:mod:`streamrl.learner.safe_checkpoint`): one holding other
        objects than tensors, plain values and DeepSpeed's few types raises UnsafeCheckpointError.
        """
        directory = Path(directory)
        latest = directory / "latest"
        if tag is None and not latest.is_file():
            return None
        tag = tag or latest.read_text().strip()
        if not isinstance(self._engine.checkpoint_engine, SafeLoads):
            self._engine.checkpoint_engine = SafeLoads(self._engine.checkpoint_engine)
        path, client_state = self._engine.load_checkpoint(
            str(directory), tag=tag, load_optimizer_states=self._train, load_lr_scheduler_states=self._train
        )
        if path is None:
            raise RuntimeError(f"DeepSpeed could not load checkpoint {directory / tag}")
        rng = directory / tag / f"rng_rank{self.rank}.pt"
        if rng.is_file():
            _set_rng_state(load_checkpoint_file(rng))
        return dict((client_state or {}).get(_CLIENT_KEY, {}))

    # ---------------------------------------------------------- full weights
    def _is_peft(self) -> bool:
        return hasattr(self.module, "peft_config")

    def _hf_model(self) -> Any:
        return self.module.get_base_model() if self._is_peft() else self.module

    def iter_full_params(self, bucket_bytes: int = GATHER_BUCKET_BYTES) -> Iterator[tuple[str, torch.Tensor]]:
        """Yield ``(hf_name, full tensor)`` for every parameter, on rank 0 only; every rank must iterate.

        ZeRO-3 shards are gathered ``bucket_bytes`` at a time. LoRA adapters are merged into their
        base weights (names and shapes are the plain model's). Tensors are detached copies on the
        engine's device. Tied weights appear once (under the input-embedding name).
        """
        named = list(self.module.named_parameters())
        zero3 = any(hasattr(p, "ds_id") for _, p in named)
        peft_layers = dict(self.module.named_modules()) if self._is_peft() else {}
        buckets: list[list[tuple[str, torch.nn.Parameter]]] = []
        size = bucket_bytes
        for i, (name, p) in enumerate(named):
            nbytes = getattr(p, "ds_numel", p.numel()) * p.element_size()
            same_group = i > 0 and _group_key(name) == _group_key(named[i - 1][0])
            if size + nbytes > bucket_bytes and not same_group:
                buckets.append([])
                size = 0
            buckets[-1].append((name, p))
            size += nbytes
        is_rank0 = self.rank == 0
        for bucket in buckets:
            if zero3:
                import deepspeed

                ctx: Any = deepspeed.zero.GatheredParameters([p for _, p in bucket], modifier_rank=None)
            else:
                ctx = nullcontext()
            with ctx, torch.no_grad():
                if not is_rank0:
                    continue
                for name, p in bucket:
                    if not peft_layers:
                        yield name, p.detach().clone()
                    elif ".lora_" in name or ".original_module." in name:
                        continue
                    elif name.endswith(".base_layer.weight"):
                        yield _hf_name(name), self._merged_weight(peft_layers[name.removesuffix(".base_layer.weight")])
                    else:
                        yield _hf_name(name), p.detach().clone()

    @staticmethod
    def _merged_weight(layer: Any) -> torch.Tensor:
        base = layer.get_base_layer()
        weight = base.weight
        if weight.__class__.__name__ == "Params4bit":
            from peft.utils.integrations import dequantize_module_weight

            weight = dequantize_module_weight(base)
        merged = weight.detach().clone()
        for adapter in layer.active_adapters:
            if adapter in layer.lora_A:
                merged += layer.get_delta_weight(adapter).to(merged.dtype)
        return merged

    def export_hf(self, directory: str | Path, extra_config: dict[str, Any] | None = None) -> Path:
        """Write a Hugging Face folder (safetensors weights, config, tokenizer; a vision-language model's
        processor) that transformers and vLLM load.

        ZeRO-3 shards are gathered and LoRA merged; ``extra_config`` entries are set on the saved
        config (e.g. a reward model's ``reward_mean`` / ``reward_std``). All ranks call it.
        """
        directory = Path(directory)
        state = {name: t.cpu() for name, t in self.iter_full_params()}
        if self.rank == 0:
            model = self._hf_model()
            directory.mkdir(parents=True, exist_ok=True)
            model.save_pretrained(directory, state_dict=state)
            config = copy.deepcopy(model.config)
            _set_use_cache(config, True)
            for key, value in (extra_config or {}).items():
                setattr(config, key, value)
            config.save_pretrained(directory)
            if self.processor is not None:  # image processor and chat template; the tokenizer below
                self.processor.save_pretrained(directory)
            self.tokenizer.save_pretrained(directory)
        torch.distributed.barrier()
        return directory
