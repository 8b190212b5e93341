"""Typed configs of the offline jobs (``streamrl sft|rm|dpo RECIPE``); torch-free so recipes validate anywhere.

A recipe is TOML with one table per section::

    [model]      path = "Qwen/Qwen2.5-0.5B-Instruct"        # or a local folder
    [data]       train_path = "data/sft.jsonl"
    [train]      run_dir = "runs/sft" ; epochs = 1
    [deepspeed]  zero_stage = 2 ; dtype = "bf16" ; lr = 1e-5
    [logging]    wandb_project = "my-project"
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from streamrl.common.config import BaseConfig
from streamrl.learner.ds_config import DeepSpeedConfig, LoraConfig

PreferenceLoss = Literal["sigmoid", "ipo"]
SFT_METRICS = ("loss",)
RM_METRICS = ("loss", "accuracy", "reward_mean", "reward_std")
DPO_METRICS = ("loss", "accuracy", "margin", "chosen_reward", "rejected_reward")


class ModelSource(BaseConfig):
    """Which model to start from and whether to train adapters instead of all weights."""

    path: str
    """Local Hugging Face folder or hub id of the starting model."""
    tokenizer_path: str | None = None
    """Tokenizer folder or hub id (default: ``path``)."""
    lora: LoraConfig | None = None
    """Train LoRA adapters (merged into the weights on export); None = full fine-tuning."""


class DataConfig(BaseConfig):
    """Where the examples come from and which record keys hold what."""

    train_path: str
    """JSONL / JSON / Parquet file, or a folder written by ``datasets.save_to_disk``."""
    eval_path: str | None = None
    """Held-out examples in the same format (default: carve ``eval_fraction`` out of the training set)."""
    eval_fraction: float = Field(0.0, ge=0, lt=1)
    """Fraction of the training records held out for evaluation when ``eval_path`` is unset."""
    train_split: str = "train"
    """Split to read when ``train_path`` is a dataset folder holding several splits."""
    eval_split: str = "test"
    """Split to read when ``eval_path`` is a dataset folder holding several splits."""
    prompt_key: str = "prompt"
    """Record key of the prompt: a string, or a list of chat messages."""
    response_key: str = "response"
    """SFT: record key of the response string (or assistant message)."""
    messages_key: str | None = None
    """SFT: record key of a whole chat (list of role/content messages); the loss covers assistant turns only."""
    chosen_key: str = "chosen"
    """RM / DPO: record key of the preferred response (string, or full conversation when there is no prompt key)."""
    rejected_key: str = "rejected"
    """RM / DPO: record key of the dispreferred response."""
    margin_key: str | None = None
    """RM: record key of a per-pair margin (Llama-2 margin loss); None = plain Bradley-Terry."""
    apply_chat_template: bool = True
    """Render prompts and responses with the tokenizer's chat template (False = plain text + eos)."""
    max_len: int = Field(2048, ge=8)
    """Longest sequence in tokens; longer examples are cut at the end (and dropped if no response token is left)."""
    max_samples: int | None = Field(None, ge=1)
    """Use only the first N training records."""


class TrainConfig(BaseConfig):
    """Length of the run, evaluation, checkpoints and export."""

    run_dir: str = "runs/offline"
    """Output folder: checkpoints/, best/, final/, tensorboard/, metrics.jsonl, resolved config."""
    epochs: int = Field(1, ge=1)
    """Passes over the training set."""
    max_steps: int | None = Field(None, ge=1)
    """Stop after this many optimizer steps (also the length of the LR schedule)."""
    eval_every: int = Field(0, ge=0)
    """Evaluate every N optimizer steps (0 = only at the end)."""
    save_every: int = Field(0, ge=0)
    """Write a resumable checkpoint every N optimizer steps (0 = only at the end)."""
    keep_last: int = Field(2, ge=1)
    """Resumable checkpoints kept on disk (oldest deleted first)."""
    resume: bool = True
    """Continue from ``run_dir/checkpoints`` when it holds a checkpoint (same data order as an uninterrupted run)."""
    best_metric: str | None = None
    """Evaluation metric that picks the best checkpoint (``run_dir/best``); None = loss for SFT/DPO, accuracy for RM."""
    best_mode: Literal["min", "max"] | None = None
    """Whether a lower or a higher ``best_metric`` is better; None = min for loss, max for the other metrics."""
    save_best: bool = True
    """Export the best model so far to ``run_dir/best`` whenever the metric improves."""
    export: bool = True
    """Export the final model to ``run_dir/final`` in Hugging Face format."""


class LoggingConfig(BaseConfig):
    """Where training curves go (metrics.jsonl in the run folder is always written)."""

    tensorboard: bool = True
    """Write TensorBoard event files to ``run_dir/tensorboard``."""
    wandb_project: str | None = None
    """Weights & Biases project; None (or wandb not installed) = no W&B logging."""
    wandb_run_name: str | None = None
    """Weights & Biases run name (default: the run folder's name)."""
    progress: bool = True
    """Show a progress bar on rank 0."""


def _check_metric(train: TrainConfig, allowed: tuple[str, ...], job: str) -> None:
    if train.best_metric is not None and train.best_metric not in allowed:
        raise ValueError(f"train.best_metric={train.best_metric!r} is not a {job} metric; choose one of {allowed}")


class SFTConfig(BaseConfig):
    """Supervised fine-tuning: next-token loss on response (assistant) tokens."""

    model: ModelSource
    """Starting model."""
    data: DataConfig
    """Examples: prompt/response pairs or whole chats."""
    train: TrainConfig = TrainConfig()
    """Run length, evaluation, checkpoints."""
    deepspeed: DeepSpeedConfig = DeepSpeedConfig()
    """Engine, optimizer and schedule."""
    logging: LoggingConfig = LoggingConfig()
    """Curves and progress."""
    packing: bool = False
    """Pack several examples into each row of ``data.max_len`` tokens (per-sample attention and positions)."""

    @model_validator(mode="after")
    def _check(self) -> SFTConfig:
        _check_metric(self.train, SFT_METRICS, "SFT")
        return self


class RMConfig(BaseConfig):
    """Pairwise reward model: a scalar head trained so that r(chosen) > r(rejected)."""

    model: ModelSource
    """Starting model (a causal LM gets a fresh scalar head)."""
    data: DataConfig
    """Preference pairs."""
    train: TrainConfig = TrainConfig()
    """Run length, evaluation, checkpoints."""
    deepspeed: DeepSpeedConfig = DeepSpeedConfig()
    """Engine, optimizer and schedule."""
    logging: LoggingConfig = LoggingConfig()
    """Curves and progress."""

    @model_validator(mode="after")
    def _check(self) -> RMConfig:
        _check_metric(self.train, RM_METRICS, "reward-model")
        return self


class DPOConfig(BaseConfig):
    """Direct preference optimisation (DPO / cDPO / IPO) against a frozen reference policy."""

    model: ModelSource
    """Starting policy (usually the SFT model)."""
    data: DataConfig
    """Preference pairs."""
    train: TrainConfig = TrainConfig()
    """Run length, evaluation, checkpoints."""
    deepspeed: DeepSpeedConfig = DeepSpeedConfig()
    """Engine, optimizer and schedule."""
    logging: LoggingConfig = LoggingConfig()
    """Curves and progress."""
    ref_model_path: str | None = None
    """Reference policy (default: the starting model ``model.path``)."""
    beta: float = Field(0.1, gt=0)
    """Inverse temperature of the implicit reward (tau for IPO)."""
    loss_type: PreferenceLoss = "sigmoid"
    """``sigmoid`` = DPO (cDPO with label_smoothing > 0), ``ipo`` = IPO."""
    label_smoothing: float = Field(0.0, ge=0, lt=0.5)
    """cDPO: assumed probability that a preference label is flipped."""
    nll_coef: float = Field(0.0, ge=0)
    """Weight of an extra SFT loss on the chosen responses."""
    precompute_ref: bool = True
    """Compute the reference log-probs once before training and free the reference model."""

    @model_validator(mode="after")
    def _check(self) -> DPOConfig:
        _check_metric(self.train, DPO_METRICS, "DPO")
        if self.loss_type == "ipo" and self.label_smoothing > 0:
            raise ValueError("label_smoothing (cDPO) applies to loss_type='sigmoid' only, not to 'ipo'")
        return self
