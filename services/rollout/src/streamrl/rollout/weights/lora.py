"""LoRA adapters as weight versions (``WeightsPublished.payload = "lora"``): what both engines do with one.

A LoRA run's learner (``learner.lora.sync = "adapter"``) publishes the adapter alone: its ``lora_A`` /
``lora_B`` tensors in peft's saved naming (``base_model.model.<module>.lora_A.weight``) over the same
transports as full weights (ZMQ buckets, CUDA IPC buffers), verified against the signed event's checksum
by the transport's receiver before anything is applied (:mod:`streamrl.torchkit.weights`), and the adapter's shape
(:class:`~streamrl.common.messages.LoraAdapter`) in the event. The engine keeps the base it was built from
(its model folder) and adds the adapter on top:

* the transformers engine injects peft LoRA layers into its model at the first adapter
  (:func:`inject`) and copies every later version into them in place (:func:`load_in_place`);
* the vLLM engine (built with ``enable_lora``) writes each version as a peft folder
  (``adapter_model.safetensors`` + ``adapter_config.json``, :func:`write_peft_folder`) under a folder of
  its own in ``/dev/shm`` (memory, not disk; vLLM 0.32's ``LoRARequest`` takes a path, not tensors), loads
  it as a ``LoRARequest``, generates every request of that version with it, and deletes the older folder.

An adapter of a rank above ``rollout.engine.max_lora_rank``, or sent to an engine without it, is refused
with an error naming that field (:func:`check_adapter`); the engine keeps serving its version. A
full-weights version after adapters (a learner restarted with ``lora.sync = "merged"``) is served alone:
the transformers engine zeroes its LoRA layers' B (:func:`zero_adapter`), the vLLM engine drops its adapter.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from streamrl.common.errors import WeightSyncError
from streamrl.common.messages import LoraAdapter

PEFT_PREFIX = "base_model.model."
ADAPTER = "default"
"""Name of the adapter in the transformers engine's peft layers."""


def check_adapter(adapter: LoraAdapter, version: int, max_lora_rank: int | None) -> None:
    """WeightSyncError when this engine cannot take ``adapter``: no LoRA support configured, or a rank above it."""
    if max_lora_rank is None:
        raise WeightSyncError(
            f"version {version} is a LoRA adapter (rank {adapter.rank}) but this engine takes full weights only: "
            "set rollout.engine.max_lora_rank (or learner.lora.sync = 'merged')"
        )
    if adapter.rank > max_lora_rank:
        raise WeightSyncError(
            f"version {version} is a LoRA adapter of rank {adapter.rank}, above rollout.engine.max_lora_rank = "
            f"{max_lora_rank}: raise it (or lower learner.lora.rank)"
        )


def _check_names(tensors: Sequence[tuple[str, torch.Tensor]], version: int) -> None:
    bad = [name for name, _ in tensors if not name.startswith(PEFT_PREFIX) or ".lora_" not in name]
    if bad:
        raise WeightSyncError(f"version {version}: not LoRA adapter tensors: {bad[:5]}")


def peft_config(adapter: LoraAdapter) -> Any:
    """The peft ``LoraConfig`` of ``adapter`` (no dropout: generation only)."""
    import peft

    return peft.LoraConfig(
        r=adapter.rank,
        lora_alpha=adapter.alpha,  # type: ignore[arg-type]  # peft annotates int; a float scales the same
        lora_dropout=0.0,
        target_modules=list(adapter.target_modules),
        task_type=peft.TaskType.CAUSAL_LM,
    )


def inject(model: torch.nn.Module, adapter: LoraAdapter) -> None:
    """Add peft LoRA layers of ``adapter``'s shape to ``model`` in place (their B zero: the base's outputs)."""
    import peft

    peft.inject_adapter_in_model(peft_config(adapter), model, adapter_name=ADAPTER)
    model.eval()


def load_in_place(model: torch.nn.Module, tensors: Sequence[tuple[str, torch.Tensor]], version: int) -> None:
    """Copy a whole verified adapter into ``model``'s injected LoRA parameters (every one written)."""
    _check_names(tensors, version)
    params = {name: p for name, p in model.named_parameters() if ".lora_" in name}
    local = {_local_name(name): t for name, t in tensors}
    missing = sorted(params.keys() - local.keys())
    unknown = sorted(local.keys() - params.keys())
    if missing or unknown:
        raise WeightSyncError(
            f"version {version}: the adapter does not match the engine's LoRA layers: missing {missing[:5]}, "
            f"unknown {unknown[:5]}"
        )
    bad = [n for n, t in local.items() if t.shape != params[n].shape]
    if bad:
        raise WeightSyncError(f"version {version}: wrong adapter shapes for {bad[:5]}")
    dsts = [params[n].data for n in local]
    srcs = [t.to(d.dtype) for t, d in zip(local.values(), dsts, strict=True)]
    with torch.no_grad():
        torch._foreach_copy_(dsts, srcs)


def zero_adapter(model: torch.nn.Module) -> None:
    """Make the injected LoRA layers add nothing (every ``lora_B`` zero): the engine then computes with the
    full weights it was given, exactly."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".lora_B." in name:
                p.zero_()


def _local_name(wire_name: str) -> str:
    """``base_model.model.X.lora_A.weight`` -> ``X.lora_A.default.weight`` (the injected parameter's name)."""
    name = wire_name.removeprefix(PEFT_PREFIX)
    for marker in (".lora_A.", ".lora_B."):
        name = name.replace(marker, f"{marker}{ADAPTER}.")
    return name


def write_peft_folder(
    directory: Path, adapter: LoraAdapter, tensors: Sequence[tuple[str, torch.Tensor]], base_model: str, version: int
) -> Path:
    """Write ``tensors`` as a peft adapter folder (safetensors + adapter_config.json) that vLLM loads."""
    from safetensors.torch import save_file

    _check_names(tensors, version)
    directory.mkdir(parents=True, exist_ok=False)
    save_file({name: t.contiguous() for name, t in tensors}, str(directory / "adapter_model.safetensors"))
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model,
        "r": adapter.rank,
        "lora_alpha": adapter.alpha,
        "lora_dropout": 0.0,
        "target_modules": list(adapter.target_modules),
        "bias": "none",
        "fan_in_fan_out": False,
        "use_rslora": False,
        "use_dora": False,
        "modules_to_save": None,
    }
    (directory / "adapter_config.json").write_text(json.dumps(config))
    return directory
