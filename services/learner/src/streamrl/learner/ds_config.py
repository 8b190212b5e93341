"""Typed configuration of the model engine (DeepSpeed, optimizer, schedule, LoRA) and the DeepSpeed dict builder.

Torch-free on purpose: recipes are validated (and ``streamrl ... --help`` style tools run) without
importing torch or DeepSpeed. ``engine.py`` is the only consumer of :meth:`DeepSpeedConfig.to_deepspeed_dict`.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, model_validator

from streamrl.common.config import BaseConfig

Dtype = Literal["fp32", "bf16", "fp16"]
Scheduler = Literal["constant", "linear", "cosine"]


class DeepSpeedConfig(BaseConfig):
    """How the learner's DeepSpeed engine trains: sharding, precision, optimizer and schedule."""

    zero_stage: int = Field(2, ge=0, le=3)
    """ZeRO stage: 0 = plain data parallel, 1 = shard optimizer states, 2 = + gradients, 3 = + parameters."""
    dtype: Dtype = "bf16"
    """Training precision of the weights and activations (optimizer master weights stay fp32 for bf16/fp16)."""
    lr: float = Field(1e-5, gt=0)
    """Peak learning rate (AdamW)."""
    betas: tuple[float, float] = (0.9, 0.95)
    """AdamW beta1, beta2."""
    eps: float = Field(1e-8, gt=0)
    """AdamW epsilon."""
    weight_decay: float = Field(0.0, ge=0)
    """Decoupled weight decay; never applied to biases and norm weights (1-D parameters)."""
    warmup_steps: int = Field(0, ge=0)
    """Optimizer steps of linear warmup from 0 to ``lr``."""
    scheduler: Scheduler = "cosine"
    """Learning-rate shape after warmup: constant, linear decay or cosine decay to ``min_lr_ratio * lr``."""
    min_lr_ratio: float = Field(0.1, ge=0, le=1)
    """Final learning rate of the linear / cosine schedules, as a fraction of ``lr``."""
    grad_clip: float = Field(1.0, ge=0)
    """Clip the global gradient norm to this value (0 = no clipping)."""
    micro_batch_size: int = Field(1, ge=1)
    """Samples (or packed rows) per forward/backward on one rank."""
    grad_accum: int = Field(1, ge=1)
    """Micro-batches accumulated per optimizer step on each rank."""
    gradient_checkpointing: bool = False
    """Recompute activations in the backward pass (less memory, ~30% more compute)."""
    torch_adam: bool = True
    """Use torch's AdamW inside DeepSpeed. False = DeepSpeed's own Adam (JIT-compiled; ~75 s to build on CPU)."""
    attn_implementation: Literal["varlen", "sdpa", "eager", "flash_attention_2"] = "varlen"
    """Attention kernel of the Hugging Face model. ``varlen``: the learner's forwards lay their rows end
    to end without padding and attention stays within each sequence, in torch's flash-attention varlen
    kernel on CUDA (sdpa over the sequences gathered into a padded batch elsewhere); other forwards
    behave as ``sdpa``
    (:mod:`streamrl.learner.varlen_attention`). ``sdpa``: packed rows get a dense block-diagonal mask.
    ``flash_attention_2`` needs the flash-attn package."""
    logprob_head: Literal["fused", "full"] = "fused"
    """How per-token log-probs (SFT, DPO, the RL step) come out of the final hidden states. ``fused``:
    output-head matmul and log-softmax chunk by chunk, the ``[tokens, vocabulary]`` logits never held
    (:mod:`streamrl.learner.fused_head`; Triton kernels on CUDA). ``full``: the head module's logits."""
    head_chunk_tokens: int = Field(8192, ge=1)
    """Tokens per chunk of the fused head: its one logits buffer holds ``chunk x vocabulary`` values
    (8192 x 151,669 bf16 = 2.5 GB); larger chunks make longer matmuls."""
    kernels: Literal["auto", "liger", "none"] = "auto"
    """Fused Triton kernels (liger-kernel) for RMSNorm, SwiGLU and RoPE (:mod:`streamrl.learner.kernels`;
    on one H200, 0.5B Qwen2: SFT 119.8k instead of 98.7k tokens/s, the RL step 119.2k instead of 96.6k).
    ``auto``: when training on a CUDA GPU with the liger-kernel package installed and the model type
    supported; ``liger``: required (an error otherwise); ``none``: eager PyTorch."""
    skip_nonfinite_steps: bool = False
    """bf16: before every optimizer step, check each gradient for inf/NaN and skip the step when one is
    found (DeepSpeed's ``check_grad_overflow``). It costs a few small kernels per parameter and a host
    sync per step (on one H200, 0.5B Qwen2, 16 packed rows of 2048: 101.1k instead of 118.5k tokens/s),
    so it is off by default, as in most bf16 trainers; the RL step still stops on a non-finite loss.
    fp16 always checks (its loss scaling depends on it)."""
    fused_optimizer: bool = True
    """On CUDA, torch AdamW's fused kernel (one pass over the float32 states instead of about a dozen
    multi-tensor passes). Applies with ``torch_adam``; ignored on CPU."""
    compile: bool = False
    """``torch.compile`` the model's forward (and, through it, backward) with dynamic shapes, compiled
    at start-up on a small warm-up batch so the first step does not wait for it. Fuses the many
    small element-wise kernels of a small model (a 0.66M-parameter Llama on one CPU thread: 0.175 ->
    0.139 s per step of 256 samples, ~25 s to compile). Needs a C++ compiler on CPU; ZeRO stage <= 2."""
    seed: int = 42
    """Seed of every random number generator (weights of new heads, dropout, data order)."""
    offload_optimizer: bool = False
    """Keep the optimizer states (AdamW's moments and the fp32 master weights, 12 bytes a trainable
    parameter) in pinned host memory and step on the CPU (ZeRO stage >= 1): a 7B model's 91 GB of states
    leave the GPU, at the cost of the host step and the gradient/parameter copies each step. With
    ``torch_adam = false`` DeepSpeed's CPU Adam (JIT-built) steps them, much faster than torch's."""
    offload_params: bool = False
    """ZeRO-3 only: keep the partitioned parameters in pinned host memory, fetched to the GPU layer by
    layer in each forward and backward (the last resort when the weights themselves do not fit)."""

    @model_validator(mode="after")
    def _check(self) -> DeepSpeedConfig:
        if self.offload_optimizer and self.zero_stage == 0:
            raise ValueError("offload_optimizer=true needs zero_stage >= 1 (DeepSpeed offloads ZeRO's partitions)")
        if self.offload_params and self.zero_stage != 3:
            raise ValueError("offload_params=true needs zero_stage = 3 (only ZeRO-3 partitions the parameters)")
        if self.compile and self.zero_stage == 3:
            raise ValueError("compile=true needs zero_stage <= 2 (ZeRO-3 gathers parameters inside the forward)")
        b1, b2 = self.betas
        if not (0 <= b1 < 1 and 0 <= b2 < 1):
            raise ValueError(f"betas must lie in [0, 1), got {self.betas}")
        return self

    def to_deepspeed_dict(self, train: bool = True, cuda: bool = False) -> dict[str, Any]:
        """The JSON config handed to ``deepspeed.initialize`` (no optimizer section when ``train`` is False;
        ``cuda``: the engine trains on a GPU, where ``fused_optimizer`` applies)."""
        stage = self.zero_stage if train or self.zero_stage == 3 else 0
        ds: dict[str, Any] = {
            "train_micro_batch_size_per_gpu": self.micro_batch_size,
            "gradient_accumulation_steps": self.grad_accum,
            "gradient_clipping": self.grad_clip,
            "zero_optimization": {"stage": stage},
            "bf16": {"enabled": self.dtype == "bf16", "check_grad_overflow": self.skip_nonfinite_steps},
            "fp16": {"enabled": self.dtype == "fp16", "initial_scale_power": 16},
            "steps_per_print": 10**12,
            "wall_clock_breakdown": False,
        }
        if stage == 3:
            ds["zero_optimization"].update({"stage3_param_persistence_threshold": 0, "overlap_comm": True})
            if self.offload_params:
                ds["zero_optimization"]["offload_param"] = {"device": "cpu", "pin_memory": True}
        if train and stage >= 1 and self.offload_optimizer:
            ds["zero_optimization"]["offload_optimizer"] = {"device": "cpu", "pin_memory": True}
            ds["zero_force_ds_cpu_optimizer"] = not self.torch_adam  # torch's AdamW may step host states too
        if train:
            ds["optimizer"] = {
                "type": "AdamW",
                "params": {
                    "lr": self.lr,
                    "betas": list(self.betas),
                    "eps": self.eps,
                    "weight_decay": self.weight_decay,
                    "torch_adam": self.torch_adam,
                },
            }
            if cuda and self.torch_adam and self.fused_optimizer and not self.offload_optimizer:
                ds["optimizer"]["params"]["fused"] = True
        return ds


class LoraConfig(BaseConfig):
    """Low-rank adapters (peft) trained instead of the full weights; merged into the weights on export."""

    rank: int = Field(16, ge=1)
    """Adapter rank r."""
    alpha: float = Field(32.0, gt=0)
    """Scaling numerator: the update is ``alpha / rank * B @ A``."""
    dropout: float = Field(0.0, ge=0, lt=1)
    """Dropout on the adapter input."""
    target_modules: list[str] | Literal["all-linear"] = "all-linear"
    """Module names to adapt (e.g. ["q_proj", "v_proj"]) or every linear layer but the output head."""
    load_in_4bit: bool = False
    """QLoRA: keep the frozen base weights in 4-bit NF4 (bitsandbytes; CUDA GPUs only, ZeRO stage <= 2)."""
