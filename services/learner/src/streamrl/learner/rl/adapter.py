"""The LoRA adapter as a weights payload (``learner.lora.sync = "adapter"``): what a version sends.

With LoRA the base weights never change, so a version is the adapter alone: every ``lora_A`` /
``lora_B`` matrix of the policy, named as peft saves them (``base_model.model.<module>.lora_A.weight``,
the adapter's name dropped), in the policy's training dtype. The tensors travel exactly as full weights
do (ZMQ buckets or CUDA IPC buffers, same checksum, same signed event); the event's
:class:`~streamrl.common.messages.LoraAdapter` says the adapter's rank, alpha and target modules, so an
engine can build its LoRA layers before loading them. Under ZeRO-3 the adapter's shards are gathered
on every rank (the base stays partitioned) and yielded on rank 0.

:func:`check_target_modules` refuses, before any weight is loaded, target modules the model lacks.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import nullcontext
from typing import Any

import torch

from streamrl.common.messages import LoraAdapter
from streamrl.learner.ds_config import LoraConfig
from streamrl.torchkit.vision import has_vision_tower

LORA_MARKERS = (".lora_A.", ".lora_B.")


def check_target_modules(model_path: str, lora: LoraConfig) -> None:
    """ValueError naming every entry of ``lora.target_modules`` that matches no module of the model at
    ``model_path`` (peft's rule: a module whose name is the entry or ends with ``.entry``). The model is
    built on the meta device from its config: no weight is read."""
    if lora.target_modules == "all-linear":
        return
    import transformers

    config = transformers.AutoConfig.from_pretrained(model_path)
    auto = transformers.AutoModelForImageTextToText if has_vision_tower(config) else transformers.AutoModelForCausalLM
    with torch.device("meta"):
        model = auto.from_config(config)
    names = [name for name, _ in model.named_modules()]
    missing = [t for t in lora.target_modules if not any(n == t or n.endswith("." + t) for n in names)]
    if missing:
        leaves = sorted({n.rsplit(".", 1)[-1] for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)})
        raise ValueError(
            f"learner.lora.target_modules: {missing} name no module of {model_path} "
            f"(its linear layers: {leaves}; or use 'all-linear')"
        )


def adapter_shape(peft_model: Any) -> LoraAdapter:
    """The rank, alpha and resolved target modules of ``peft_model``'s active adapter."""
    config = peft_model.peft_config[peft_model.active_adapter]
    return LoraAdapter(rank=int(config.r), alpha=float(config.lora_alpha), target_modules=sorted(config.target_modules))


def wire_name(peft_name: str, adapter: str) -> str:
    """``...q_proj.lora_A.default.weight`` -> ``...q_proj.lora_A.weight`` (peft's saved naming)."""
    for marker in LORA_MARKERS:
        peft_name = peft_name.replace(f"{marker}{adapter}.", marker)
    return peft_name


def iter_adapter(module: Any, rank: int) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(wire name, detached copy)`` of every adapter parameter of the peft model ``module``, on
    rank 0 only; every rank must iterate (ZeRO-3 gathers the adapter's shards on all of them at once)."""
    adapter = module.active_adapter
    named = [(n, p) for n, p in module.named_parameters() if any(m in n for m in LORA_MARKERS)]
    if not named:
        raise ValueError("the policy has no LoRA parameters: learner.lora is not set")
    if any(hasattr(p, "ds_id") for _, p in named):
        import deepspeed

        ctx: Any = deepspeed.zero.GatheredParameters([p for _, p in named], modifier_rank=None)
    else:
        ctx = nullcontext()
    with ctx, torch.no_grad():
        if rank != 0:
            return
        for name, p in named:
            yield wire_name(name, adapter), p.detach().clone()
