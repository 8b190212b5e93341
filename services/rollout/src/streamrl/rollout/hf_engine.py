"""Plain-transformers generation engine: for debugging and machines without vLLM.

Deliberately simple: one request at a time (its ``n`` samples as one batch, no padding needed),
a hand-written decode loop with the KV cache, so the sampled distribution is explicit:
:func:`processed_logprobs` applies temperature, then top-k, then top-p (vLLM's order), and the
behaviour log-prob of a token is read from exactly that distribution. Greedy (temperature 0)
takes the argmax and reports the log-softmax of the raw logits, as vLLM does.

Generation and weight updates take one lock, so an update never lands mid-generation here
(``version_start == version_end``). Blocking work runs in a thread; the event loop stays free.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel

from streamrl.common.errors import WeightSyncError
from streamrl.common.weights_wire import fetch_buckets
from streamrl.rollout.engine import FinishReason, GenerationRequest, Sample, check_requests
from streamrl.rollout.engine_config import EngineConfig
from streamrl.rollout.weight_receiver import to_torch

logger = logging.getLogger(__name__)

_DTYPES = {"auto": "auto", "float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def processed_logprobs(logits: torch.Tensor, temperature: float, top_k: int, top_p: float) -> torch.Tensor:
    """[B, V] log-probs of the distribution sampled from: logits / T, then top-k, then top-p.

    Filtered tokens get -inf. ``temperature == 0`` (greedy) returns the raw log-softmax.
    ``top_k <= 0`` and ``top_p >= 1`` disable those filters. Top-p keeps the smallest set of most
    likely tokens whose probability reaches ``top_p`` (always at least one token).
    """
    logits = logits.float()
    if temperature == 0:
        return torch.log_softmax(logits, dim=-1)
    logits = logits / temperature
    if 0 < top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        mass_before = torch.cumsum(probs, dim=-1) - probs  # probability of strictly better tokens
        drop_sorted = mass_before >= top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return torch.log_softmax(logits, dim=-1)


class HFEngine:
    """transformers behind the :class:`streamrl.rollout.engine.Engine` protocol (see module docstring)."""

    def __init__(self, config: EngineConfig) -> None:
        self._config = config
        device = config.device
        if device == "auto":
            device = "cuda" if torch.cuda.is_available() else "cpu"
        self._device = torch.device(device)
        self._model: PreTrainedModel = AutoModelForCausalLM.from_pretrained(
            config.model, dtype=_DTYPES[config.dtype], trust_remote_code=config.trust_remote_code
        ).to(self._device)
        self._model.eval()
        self._tokenizer = AutoTokenizer.from_pretrained(config.tokenizer or config.model)
        eos = self._model.generation_config.eos_token_id
        self._eos_ids = set(eos if isinstance(eos, list) else [eos] if eos is not None else [])
        if self._tokenizer.eos_token_id is not None:
            self._eos_ids.add(self._tokenizer.eos_token_id)
        self._seeds = torch.Generator().manual_seed(config.seed)
        self._lock = threading.Lock()
        self._version = 0

    @property
    def version(self) -> int:
        return self._version

    async def generate(self, requests: list[GenerationRequest]) -> list[list[Sample]]:
        check_requests(requests, self._config.max_model_len)
        return await asyncio.to_thread(self._generate_all, requests)

    async def update_weights(self, endpoint: str, version: int, checksum: str, timeout_s: float) -> None:
        await asyncio.to_thread(self._update, endpoint, version, checksum, timeout_s)

    def close(self) -> None:
        with self._lock:
            self._model = None  # type: ignore[assignment]

    def _generate_all(self, requests: list[GenerationRequest]) -> list[list[Sample]]:
        with self._lock, torch.inference_mode():
            return [self._generate_one(r) for r in requests]

    def _generate_one(self, request: GenerationRequest) -> list[Sample]:
        sp = request.sampling
        seed = sp.seed if sp.seed is not None else int(torch.randint(0, 2**31, (1,), generator=self._seeds))
        gen = torch.Generator(self._device).manual_seed(seed)
        n = sp.n
        max_new = min(sp.max_new_tokens, self._config.max_model_len - len(request.prompt_ids))
        tokens: list[list[int]] = [[] for _ in range(n)]
        logprobs: list[list[float]] = [[] for _ in range(n)]
        texts: list[str | None] = [None] * n
        reasons: list[FinishReason | None] = [None] * n
        step_input = torch.tensor([request.prompt_ids] * n, device=self._device)
        past = None
        for position in range(max_new):
            out = self._model(input_ids=step_input, past_key_values=past, use_cache=True)
            past = out.past_key_values
            logits = out.logits[:, -1, :].float()
            if position < sp.min_new_tokens and self._eos_ids:
                logits[:, sorted(self._eos_ids)] = float("-inf")
            logp = processed_logprobs(logits, sp.temperature, sp.top_k, sp.top_p)
            if sp.temperature == 0:
                next_ids = logits.argmax(dim=-1)
            else:
                next_ids = torch.multinomial(logp.exp(), 1, generator=gen).squeeze(1)
            chosen = logp.gather(1, next_ids[:, None]).squeeze(1).tolist()
            for row, (token, lp) in enumerate(zip(next_ids.tolist(), chosen, strict=True)):
                if reasons[row] is None:
                    tokens[row].append(token)
                    logprobs[row].append(lp)
                    reasons[row], texts[row] = self._check_stop(tokens[row], sp.stop)
            if all(r is not None for r in reasons):
                break
            step_input = next_ids[:, None]
        return [
            Sample(
                token_ids=tokens[row],
                logprobs=logprobs[row],
                text=texts[row] if texts[row] is not None else self._decode(tokens[row]),
                finish_reason=reasons[row] or "length",
                version_start=self._version,
                version_end=self._version,
            )
            for row in range(n)
        ]

    def _decode(self, token_ids: list[int]) -> str:
        return str(self._tokenizer.decode(token_ids, skip_special_tokens=True))

    def _check_stop(self, token_ids: list[int], stop: list[str]) -> tuple[FinishReason | None, str | None]:
        """(``stop``, text without the stop string) when the sample just ended, else (None, None)."""
        if token_ids[-1] in self._eos_ids:
            return "stop", self._decode(token_ids)
        if stop:
            text = self._decode(token_ids)
            hits = [text.find(s) for s in stop if s in text]
            if hits:
                return "stop", text[: min(hits)]
        return None, None

    def _update(self, endpoint: str, version: int, checksum: str, timeout_s: float) -> None:
        start = time.perf_counter()
        received = {t.name: to_torch(t) for t in fetch_buckets(endpoint, version, checksum, timeout_s)}
        with self._lock:
            params = dict(self._model.named_parameters())
            missing = [name for name in params if name not in received]
            known = self._model.state_dict()
            unknown = [name for name in received if name not in known]
            if missing or unknown:
                raise WeightSyncError(
                    f"version {version} does not match the model: missing {missing[:5]}, unknown {unknown[:5]}"
                )
            with torch.no_grad():
                self._model.load_state_dict(received, strict=False)
            self._version = version
        logger.info("serving weights version %d (update took %.3f s)", version, time.perf_counter() - start)
