"""Plain-transformers generation engine: for small models, debugging, and machines without vLLM.

One driver thread owns the model and runs this loop::

    take commands (generate jobs / weight updates / stop) -> decode every queued job as ONE batch

* Everything submitted while the previous batch ran (or within ``batch_wait_ms`` of the first
  request) is decoded together: all samples of all
  requests are left-padded into one batch and decoded with the KV cache; a finished row leaves
  the batch (its cache rows are dropped), so long and short answers cost what they should. A
  prompt is prefilled once and its cache copied to its n samples.
* The sampled distribution is explicit: :func:`processed_logprobs` applies temperature, then
  top-k, then top-p (vLLM's order), and a token's behaviour log-prob is read from exactly that
  distribution. Greedy (temperature 0) takes the argmax and reports the log-softmax of the raw
  logits, as vLLM does. Rows with different sampling parameters share the batch.
* A request with a seed samples from its own generator, so it repeats whatever else is batched.
* Weight updates are commands too: they land between two batches, never mid-generation
  (``version_start == version_end``); a failed transfer leaves the served weights untouched.

The asyncio side never blocks: commands go through a thread-safe queue, results come back as
``concurrent.futures.Future``s.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import queue
import threading
import time
from dataclasses import dataclass, field

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel

from streamrl.common.errors import WeightSyncError
from streamrl.common.messages import SamplingParams
from streamrl.common.weights_wire import fetch_buckets
from streamrl.rollout.engine import FinishReason, GenerationRequest, Sample, WeightUpdate, check_requests
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


@dataclass
class _Job:
    """One ``generate`` call."""

    requests: list[GenerationRequest]
    future: concurrent.futures.Future[list[list[Sample]]] = field(default_factory=concurrent.futures.Future)


class _Stop:
    pass


@dataclass
class _Row:
    """One sample being decoded."""

    job: int
    request: int
    index: int
    prompt: list[int]
    sampling: SamplingParams
    max_new: int
    gen_key: int
    """Which generator samples it: the request's own (seeded) or -1 (the engine's)."""
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    text: str | None = None
    reason: FinishReason | None = None


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
        pad = self._tokenizer.pad_token_id
        self._pad_id = int(pad if pad is not None else min(self._eos_ids, default=0))
        self._seeds = torch.Generator().manual_seed(config.seed)
        self._version = 0
        self._commands: queue.SimpleQueue[_Job | WeightUpdate | _Stop] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._closed = False
        self._thread = threading.Thread(target=self._drive, name="hf-engine", daemon=True)
        self._thread.start()

    @property
    def version(self) -> int:
        return self._version

    async def generate(self, requests: list[GenerationRequest]) -> list[list[Sample]]:
        check_requests(requests, self._config.max_model_len)
        if not requests:
            return []
        job = _Job(requests)
        self._submit(job)
        return await asyncio.wrap_future(job.future)

    async def update_weights(self, endpoint: str, version: int, checksum: str, timeout_s: float) -> None:
        update = WeightUpdate(endpoint, version, checksum, timeout_s)
        self._submit(update)
        seconds = await asyncio.wrap_future(update.future)
        logger.info("serving weights version %d (update took %.3f s)", version, seconds)

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._commands.put(_Stop())
        self._thread.join()

    def _submit(self, command: _Job | WeightUpdate) -> None:
        with self._lock:
            if self._closed:
                raise RuntimeError("the transformers engine is closed")
            self._commands.put(command)

    # --- driver thread -------------------------------------------------------------------

    def _drive(self) -> None:
        while True:
            commands = [self._commands.get()]
            window_ends = time.monotonic() + self._config.batch_wait_ms / 1e3
            while (left := window_ends - time.monotonic()) > 0:
                try:
                    commands.append(self._commands.get(timeout=left))
                except queue.Empty:
                    break
            while not self._commands.empty():
                commands.append(self._commands.get())
            jobs: list[_Job] = []
            for command in commands:
                if isinstance(command, _Job):
                    jobs.append(command)
                    continue
                self._run(jobs)  # jobs queued before an update use the weights they were queued under
                jobs = []
                if isinstance(command, _Stop):
                    self._fail_rest(RuntimeError("the transformers engine was closed"))
                    self._model = None  # type: ignore[assignment]
                    return
                self._update(command)
            self._run(jobs)

    def _fail_rest(self, error: BaseException) -> None:
        while not self._commands.empty():
            command = self._commands.get()
            if isinstance(command, _Job | WeightUpdate):
                command.future.set_exception(error)

    def _run(self, jobs: list[_Job]) -> None:
        if not jobs:
            return
        try:
            rows = self._rows(jobs)
            with torch.inference_mode():
                self._decode(rows)
        except Exception as e:
            logger.exception("generation failed")
            for job in jobs:
                job.future.set_exception(e)
            return
        for j, job in enumerate(jobs):
            out: list[list[Sample]] = [[] for _ in job.requests]
            for row in rows:
                if row.job == j:
                    out[row.request].append(self._sample(row))
            job.future.set_result(out)

    def _rows(self, jobs: list[_Job]) -> list[_Row]:
        rows: list[_Row] = []
        for j, job in enumerate(jobs):
            for i, request in enumerate(job.requests):
                max_new = min(request.sampling.max_new_tokens, self._config.max_model_len - len(request.prompt_ids))
                gen_key = len(rows) if request.sampling.seed is not None else -1
                for k in range(request.sampling.n):
                    rows.append(_Row(j, i, k, list(request.prompt_ids), request.sampling, max_new, gen_key))
        return rows

    def _decode(self, rows: list[_Row]) -> None:
        """Generate every row to its end (one batch; finished rows leave it).

        Rows with the same prompt (the n samples of a request) share one prefill: each distinct
        prompt runs through the model once and its KV cache is copied to its rows.
        """
        distinct: dict[tuple[int, ...], int] = {}
        source = torch.tensor([distinct.setdefault(tuple(r.prompt), len(distinct)) for r in rows])
        prompts = list(distinct)
        width = max(len(p) for p in prompts)
        input_ids = torch.full((len(prompts), width), self._pad_id, dtype=torch.long)
        attention = torch.zeros((len(prompts), width), dtype=torch.long)
        for b, prompt in enumerate(prompts):
            input_ids[b, width - len(prompt) :] = torch.tensor(prompt)
            attention[b, width - len(prompt) :] = 1
        generators = {
            r.gen_key: torch.Generator().manual_seed(r.sampling.seed)
            for r in rows
            if r.gen_key >= 0 and r.sampling.seed is not None
        }
        positions = (attention.cumsum(dim=1) - 1).clamp(min=0)
        out = self._model(
            input_ids=input_ids.to(self._device), attention_mask=attention.to(self._device),
            position_ids=positions.to(self._device), use_cache=True,
        )  # fmt: skip
        past = out.past_key_values
        logits = out.logits[:, -1, :].float().cpu()[source]
        if len(prompts) < len(rows):
            past.batch_select_indices(source.to(self._device))
        attention, positions = attention[source], positions[source]
        live = list(range(len(rows)))  # row index of each batch position
        step = 0
        while True:
            next_ids, chosen = self._pick(logits, [rows[b] for b in live], step, generators)
            keep = []
            for pos, (b, token, lp) in enumerate(zip(live, next_ids.tolist(), chosen.tolist(), strict=True)):
                row = rows[b]
                row.tokens.append(token)
                row.logprobs.append(lp)
                row.reason, row.text = self._check_stop(row)
                if row.reason is None:
                    keep.append(pos)
            step += 1
            if len(keep) < len(live):
                live = [live[p] for p in keep]
                if not live:
                    return
                index = torch.tensor(keep)
                past.batch_select_indices(index.to(self._device))
                attention, positions, next_ids = attention[index], positions[index], next_ids[index]
            attention = torch.cat([attention, torch.ones((len(live), 1), dtype=torch.long)], dim=1)
            positions = positions[:, -1:] + 1
            out = self._model(
                input_ids=next_ids[:, None].to(self._device), attention_mask=attention.to(self._device),
                position_ids=positions.to(self._device), past_key_values=past, use_cache=True,
            )  # fmt: skip
            past = out.past_key_values
            logits = out.logits[:, -1, :].float().cpu()

    def _pick(
        self, logits: torch.Tensor, rows: list[_Row], step: int, generators: dict[int, torch.Generator]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Next token and its behaviour log-prob for each live row (rows grouped by sampling parameters)."""
        for b, row in enumerate(rows):
            if step < row.sampling.min_new_tokens and self._eos_ids:
                logits[b, sorted(self._eos_ids)] = float("-inf")
        next_ids = torch.empty(len(rows), dtype=torch.long)
        chosen = torch.empty(len(rows), dtype=torch.float32)
        by_params: dict[tuple[float, int, float], list[int]] = {}
        for b, row in enumerate(rows):
            sp = row.sampling
            by_params.setdefault((sp.temperature, sp.top_k, sp.top_p), []).append(b)
        for (temperature, top_k, top_p), members in by_params.items():
            index = torch.tensor(members)
            logp = processed_logprobs(logits[index], temperature, top_k, top_p)
            if temperature == 0:
                picked = logits[index].argmax(dim=-1)
            else:
                picked = torch.empty(len(members), dtype=torch.long)
                by_gen: dict[int, list[int]] = {}
                for p, b in enumerate(members):
                    by_gen.setdefault(rows[b].gen_key, []).append(p)
                probs = logp.exp()
                for key, where in by_gen.items():
                    gen = generators.get(key, self._seeds)
                    picked[where] = torch.multinomial(probs[where], 1, generator=gen).squeeze(1)
            next_ids[index] = picked
            chosen[index] = logp.gather(1, picked[:, None]).squeeze(1)
        return next_ids, chosen

    def _sample(self, row: _Row) -> Sample:
        return Sample(
            token_ids=row.tokens,
            logprobs=row.logprobs,
            text=row.text if row.text is not None else self._decode_text(row.tokens),
            finish_reason=row.reason or "length",
            version_start=self._version,
            version_end=self._version,
        )

    def _decode_text(self, token_ids: list[int]) -> str:
        return str(self._tokenizer.decode(token_ids, skip_special_tokens=True))

    def _check_stop(self, row: _Row) -> tuple[FinishReason | None, str | None]:
        """(reason, text without the stop string) when the row just ended, else (None, None)."""
        if row.tokens[-1] in self._eos_ids:
            return "stop", self._decode_text(row.tokens)
        stop = row.sampling.stop
        if stop:
            text = self._decode_text(row.tokens)
            hits = [text.find(s) for s in stop if s in text]
            if hits:
                return "stop", text[: min(hits)]
        if len(row.tokens) >= row.max_new:
            return "length", None
        return None, None

    def _update(self, update: WeightUpdate) -> None:
        start = time.perf_counter()
        try:
            received = {
                t.name: to_torch(t)
                for t in fetch_buckets(update.endpoint, update.version, update.checksum, update.timeout_s)
            }
            known = self._model.state_dict()
            missing = [name for name, _ in self._model.named_parameters() if name not in received]
            unknown = [name for name in received if name not in known]
            if missing or unknown:
                raise WeightSyncError(
                    f"version {update.version} does not match the model: missing {missing[:5]}, unknown {unknown[:5]}"
                )
            with torch.no_grad():
                self._model.load_state_dict(received, strict=False)
        except Exception as e:  # noqa: BLE001 - the caller gets it; the old weights stay
            update.future.set_exception(e)
            return
        self._version = update.version
        update.future.set_result(time.perf_counter() - start)
