"""Scorer running a local reward model, and the model wrapper ``serve-rm`` shares.

Two folder layouts (Hugging Face format, safetensors):

* ``sequence_classification``: a ``*ForSequenceClassification`` with ``num_labels=1``;
* ``value_head``: a causal LM (or bare transformer) checkpoint plus a linear value head stored as
  ``{value_head_prefix}.weight`` (and optional ``.bias``), the layout OpenRLHF reward models use.

Decoder models are pooled at the last real token of each right-padded sequence (right padding
keeps every position id as in an unpadded forward); other sequence classifiers use their own
pooling. With ``normalize``, ``(r - mean) / std`` is applied when the model's config.json holds
``mean`` and ``std``. The score in [0, 1] is ``sigmoid(reward)``, the Bradley-Terry probability.

torch and transformers are imported inside, never at module import.
"""

from __future__ import annotations

import asyncio
import logging
import math
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from streamrl.common.messages import Trajectory
from streamrl.reward.config import ModelScorerConfig
from streamrl.reward.scorers.base import ScorerError, ScorerResult
from streamrl.reward.threads import CallTimeoutError, ThreadCaller, ThreadsExhaustedError

logger = logging.getLogger(__name__)


def reward_to_score(x: float) -> float:
    """The [0, 1] score of a reward: sigmoid(reward), computed without overflow."""
    return 1.0 / (1.0 + math.exp(-x)) if x >= 0 else math.exp(x) / (1.0 + math.exp(x))


class LocalRewardModel:
    """A reward model in this process: ``score_texts`` / ``score_token_ids`` -> one reward each.

    Thread-safe (one forward at a time); call it from a worker thread in async code.
    """

    def __init__(
        self,
        path: str,
        *,
        architecture: str = "auto",
        value_head_prefix: str = "value_head",
        batch_size: int = 16,
        max_length: int = 2048,
        device: str = "cpu",
        dtype: str = "float32",
        normalize: bool = True,
        load_tokenizer: bool = True,
    ) -> None:
        import torch
        import transformers

        folder = Path(path)
        if not (folder / "config.json").is_file():
            raise ValueError(f"reward model folder {path!r} has no config.json")
        self._torch = torch
        self._lock = threading.Lock()
        self.batch_size = batch_size
        self.max_length = max_length
        self.device = torch.device(device)
        torch_dtype = getattr(torch, dtype)
        hf_config = transformers.AutoConfig.from_pretrained(path)
        if architecture == "auto":
            names = hf_config.architectures or []
            architecture = (
                "sequence_classification"
                if any(n.endswith("ForSequenceClassification") for n in names)
                else "value_head"
            )
        self.head: Any
        if architecture == "sequence_classification":
            model = transformers.AutoModelForSequenceClassification.from_pretrained(path, dtype=torch_dtype)
            if model.config.num_labels != 1:
                raise ValueError(f"reward model {path!r} has num_labels={model.config.num_labels}; expected 1")
            # Decoder classifiers (a `score` head over a causal transformer) get our last-token pooling.
            self.head = getattr(model, "score", None)
            self.body = getattr(model, model.base_model_prefix) if self.head is not None else model
        else:
            self.body = transformers.AutoModel.from_pretrained(path, dtype=torch_dtype)
            self.head = self._load_value_head(folder, value_head_prefix, torch_dtype)
        self.body.to(self.device).eval()
        if self.head is not None:
            self.head.to(self.device).eval()
        self.mean, self.std = 0.0, 1.0
        if normalize and getattr(hf_config, "mean", None) is not None and getattr(hf_config, "std", None) is not None:
            self.mean, self.std = float(hf_config.mean), float(hf_config.std)
            if self.std <= 0:
                raise ValueError(f"reward model {path!r}: config std must be > 0, got {self.std}")
        elif normalize:
            logger.info(
                "reward model %s has no mean/std in its config: rewards are not normalised",
                path,
            )
        self.tokenizer = None
        if load_tokenizer:
            self.tokenizer = transformers.AutoTokenizer.from_pretrained(path)
            self.tokenizer.truncation_side = "left"  # keep the end of the response
        self.pad_id = int(hf_config.pad_token_id if hf_config.pad_token_id is not None else 0)

    def _load_value_head(self, folder: Path, prefix: str, dtype: Any) -> Any:
        from safetensors import safe_open

        tensors = {}
        for file in sorted(folder.glob("*.safetensors")):
            with safe_open(str(file), framework="pt") as f:
                for key in f.keys():
                    if key in (f"{prefix}.weight", f"{prefix}.bias"):
                        tensors[key.rsplit(".", 1)[1]] = f.get_tensor(key)
        if "weight" not in tensors:
            raise ValueError(f"reward model folder {folder} has no value head weight {prefix}.weight")
        weight = tensors["weight"].reshape(1, -1)
        head = self._torch.nn.Linear(weight.shape[1], 1, bias="bias" in tensors, dtype=dtype)
        with self._torch.no_grad():
            head.weight.copy_(weight)
            if "bias" in tensors:
                head.bias.copy_(tensors["bias"].reshape(1))
        return head

    def score_texts(self, texts: list[str]) -> list[float]:
        """Rewards of full texts (prompt followed by response), tokenized by the model's tokenizer."""
        if self.tokenizer is None:
            raise ValueError("this reward model was loaded without a tokenizer; score token ids instead")
        ids = self.tokenizer(texts, truncation=True, max_length=self.max_length)["input_ids"]
        return self.score_token_ids(ids)

    def score_token_ids(self, sequences: list[list[int]]) -> list[float]:
        """Rewards of token sequences; longer ones keep their last ``max_length`` tokens."""
        if any(len(s) == 0 for s in sequences):
            raise ValueError("cannot score an empty token sequence")
        rewards: list[float] = []
        with self._lock, self._torch.inference_mode():
            for start in range(0, len(sequences), self.batch_size):
                chunk = [list(s[-self.max_length :]) for s in sequences[start : start + self.batch_size]]
                rewards.extend(self._forward(chunk))
        return [(r - self.mean) / self.std for r in rewards]

    def _forward(self, chunk: list[list[int]]) -> list[float]:
        torch = self._torch
        lengths = torch.tensor([len(s) for s in chunk], device=self.device)
        width = int(lengths.max())
        input_ids = torch.full((len(chunk), width), self.pad_id, dtype=torch.long, device=self.device)
        for row, seq in enumerate(chunk):
            input_ids[row, : len(seq)] = torch.tensor(seq, dtype=torch.long)
        attention_mask = (torch.arange(width, device=self.device)[None, :] < lengths[:, None]).long()
        if self.head is None:
            logits = self.body(input_ids=input_ids, attention_mask=attention_mask).logits
            return [float(v) for v in logits[:, 0].float().tolist()]
        hidden = self.body(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
        last = hidden[torch.arange(len(chunk), device=self.device), lengths - 1]
        return [float(v) for v in self.head(last)[:, 0].float().tolist()]


class ModelScorer:
    """Scores micro-batches with a local reward model, off the event loop."""

    def __init__(
        self,
        config: ModelScorerConfig,
        model: LocalRewardModel | None = None,
        on_exhausted: Callable[[str], None] | None = None,
    ) -> None:
        self.name = config.name
        self.reads_tokens = config.input == "token_ids"
        self._config = config
        source = f"model scorer {self.name!r}"
        self._thread = ThreadCaller(
            1,
            f"reward-{self.name}",
            on_exhausted=lambda why: on_exhausted(f"{source}: {why}") if on_exhausted else None,
        )
        """One forward at a time on a thread of the scorer's own, each with a deadline (``timeout_s``): a forward
        that never returns exhausts it, and the worker exits for its orchestrator to restart it."""
        self._model = model or LocalRewardModel(
            config.path,
            architecture=config.architecture,
            value_head_prefix=config.value_head_prefix,
            batch_size=config.batch_size,
            max_length=config.max_length,
            device=config.device,
            dtype=config.dtype,
            normalize=config.normalize,
            load_tokenizer=config.input == "text",
        )
        self._num_samples = 0

    async def score(self, batch: list[Trajectory]) -> ScorerResult:
        timeout_s = self._config.timeout_s
        try:
            if self._config.input == "text":
                texts = [t.prompt_text + t.response_text for t in batch]
                rewards = await self._thread.call(timeout_s, self._model.score_texts, texts)
            else:
                ids = [t.prompt_ids.tolist() + t.response_ids.tolist() for t in batch]
                rewards = await self._thread.call(timeout_s, self._model.score_token_ids, ids)
        except ValueError as e:
            raise ScorerError(f"model scorer {self.name!r}: {e}", sample_specific=True) from e
        except CallTimeoutError as e:
            raise ScorerError(f"model scorer {self.name!r}: a forward of {len(batch)} samples {e}") from e
        except ThreadsExhaustedError as e:  # the worker is stopping: leave the entries pending
            raise asyncio.CancelledError(str(e)) from None
        self._num_samples += len(batch)
        return ScorerResult(
            rewards=rewards,
            scores=[reward_to_score(r) for r in rewards],
            extra=[{} for _ in batch],
        )

    def metrics(self) -> dict[str, float]:
        return {"reward/model/samples": float(self._num_samples)}

    async def close(self) -> None:
        return None
