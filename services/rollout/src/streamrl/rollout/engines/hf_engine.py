"""Plain-transformers generation engine: GPUs without vLLM, small models, debugging.

One driver thread owns the model and runs a continuous-batching loop::

    take commands -> admit jobs (their samples wait for a slot) -> prefill new samples into free
    slots -> decode every live slot for a few steps -> hand back finished samples -> repeat

* Llama-family models (llama, qwen2, qwen3, mistral) decode through
  :class:`streamrl.rollout.engines.kv_decoder.KVDecoder`: the model's own modules over a preallocated
  slot-based KV cache, each decode step a CUDA graph on GPU. Up to ``max_num_seqs`` samples decode
  together; a finished sample's slot takes the next waiting one. A prompt is prefilled once for its
  ``n`` samples. At start the decoder's logits are checked against the model's own forward; other
  architectures (or a failed check) use the model's plain forward with transformers' cache, one
  batch at a time.
* Sampling runs on the logits' device (:mod:`streamrl.rollout.engines.sampling`): temperature, then top-k,
  then top-p (vLLM's order), and each token's behaviour log-prob is read from exactly the
  distribution it was sampled from; greedy (temperature 0) reports the raw log-softmax, as vLLM
  does. Rows with different sampling parameters share the batch. Tokens, log-probs and stop flags
  stay on the device; the host looks every ``SYNC_EVERY`` steps (EOS, length and stop strings are
  decided per token: a sample's result never depends on when the host looked).
* A request with a seed samples from generators of its own (one per sample), so it repeats
  whatever else is batched.
* Vision-language models (a ``vision_config`` in the model's config) load as
  ``AutoModelForImageTextToText`` with their processor (:mod:`streamrl.rollout.vision`) and run on
  the plain forward. A request with images is expanded and its pixel inputs made (off the event
  loop) when it is submitted; its samples then decode as a batch of their own - the prefill takes
  the pixel inputs, the positions are the model's own (no padding in such a batch) - and report the
  expanded prompt. Sampling and log-probs are the text path's, with the ids of an image's expansion
  (:func:`streamrl.rollout.vision.expansion_token_ids`) at a logit of -inf first: they are never
  sampled, and the log-probs are those of the distribution over the other tokens (as vLLM's).
* Weight updates are commands too: an update waits until the samples admitted before it finish,
  jobs submitted after it wait for it (``version_start == version_end``, never mid-generation); a
  failed transfer leaves the served weights untouched. With ``partial_rollout`` an update is taken
  between two decode steps instead (the driver looks at its queue after every step; on the plain
  forward too), without waiting for the running samples: the transfer pauses the decode, then it
  goes on under the new weights over the KV cache computed under the old ones (kept, not
  recomputed: the tokens after the switch are the new weights' given that cache - what in-flight
  updates do), and each sample records the version of every token (:attr:`Sample.versions`). Jobs
  queued behind the update are admitted under the new version; an update behind a sleep, wake or
  stop keeps its place. The version comes from the receiver of the event's transport
  (:func:`streamrl.torchkit.weights.factory.receiver_for`), verified before a tensor is copied in (over
  the broadcast group a member receives in the background while the engine decodes).
  A LoRA version (``payload = "lora"``: the adapter's tensors only, over ZMQ or CUDA IPC) is copied into
  peft LoRA layers added to the model at the first adapter (:mod:`streamrl.rollout.weights.lora`);
  the KV decoder runs the model's modules, so it computes with them as they are.
* Sleep (``sleep_between_versions``) is a command too, taken once the samples before it finish: the
  KV decoder's cache, its captured CUDA graphs and the receiver's staging memory are freed and the
  allocator's cached blocks returned to the device (``torch.cuda.empty_cache``); the weights stay
  where they are (this engine does not offload them). Waking changes nothing: the next batch reserves the cache again (and
  recaptures its graphs).

The asyncio side never blocks: commands go through a thread-safe queue, results come back as
``concurrent.futures.Future``s.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import logging
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers import AutoModelForCausalLM, AutoModelForImageTextToText, AutoTokenizer, PreTrainedModel

from streamrl.common.errors import WeightSyncError
from streamrl.common.images import decode_image
from streamrl.common.messages import LoraAdapter, SamplingParams, WeightsPublished
from streamrl.rollout.engines.config import EngineConfig
from streamrl.rollout.engines.driver import DriverThread
from streamrl.rollout.engines.engine import (
    FinishReason,
    GenerationRequest,
    Sample,
    WeightUpdate,
    check_requests,
    version_runs,
)
from streamrl.rollout.engines.kv_decoder import KVDecoder, unsupported_reason
from streamrl.rollout.engines.sampling import RowParams, exponential_noise, pick, processed_logprobs, row_logprobs
from streamrl.rollout.vision import encode, expansion_token_ids, vision_processor
from streamrl.rollout.weights import lora as lora_weights
from streamrl.torchkit.vision import image_token_id
from streamrl.torchkit.weights.factory import receiver_for
from streamrl.torchkit.weights.protocol import WeightReceiver

__all__ = ["HFEngine", "processed_logprobs"]

logger = logging.getLogger(__name__)

_DTYPES = {"auto": "auto", "float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
SYNC_EVERY = 16
"""Decode steps between two looks of the host at the device state (finished samples, stop strings)."""
SELF_CHECK_TOLERANCE = {torch.float32: 1e-3, torch.float64: 1e-6}
"""Largest |logit difference| / max |logit| the decoder may show against the model's own forward
(other dtypes: 3e-2)."""


@dataclass
class _Job:
    """One ``generate`` call."""

    requests: list[GenerationRequest]
    inputs: list[_Inputs | None]
    """Per request: its expanded prompt and pixel inputs when it has images, else None."""
    future: concurrent.futures.Future[list[list[Sample]]] = field(default_factory=concurrent.futures.Future)
    results: list[list[Sample | None]] = field(default_factory=list)
    left: int = 0
    """Samples not finished yet."""


@dataclass(frozen=True)
class _Inputs:
    """A request with images as the model takes it."""

    prompt: list[int]
    """The prompt, image tokens expanded."""
    pixels: dict[str, torch.Tensor]
    """The processor's pixel inputs (on the engine's device and dtype), batch of one."""


class _Stop:
    pass


@dataclass
class _Sleep:
    future: concurrent.futures.Future[float] = field(default_factory=concurrent.futures.Future)


@dataclass
class _Wake:
    future: concurrent.futures.Future[float] = field(default_factory=concurrent.futures.Future)


@dataclass
class _Row:
    """One sample being generated."""

    job: _Job
    request: int
    index: int
    prompt: list[int]
    sampling: SamplingParams
    max_new: int
    generator: torch.Generator | None
    """The sample's own generator (seeded requests), else None (the engine's)."""
    inputs: _Inputs | None = None
    """Images of the request (``prompt`` is then the expanded prompt)."""
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    text: str | None = None
    reason: FinishReason | None = None
    steps: int = 0
    """Tokens generated so far, as far as the host knows (an upper bound between looks)."""
    checked: int = 0
    """Tokens already scanned for stop strings."""
    switches: list[tuple[int, int]] = field(default_factory=list)
    """(first token index, version): the version serving when the row started, then each update that
    landed while it decoded (``partial_rollout``; :func:`version_runs` makes them the sample's)."""


Command = _Job | WeightUpdate | _Stop | _Sleep | _Wake


class HFEngine(DriverThread):
    """transformers behind the :class:`streamrl.rollout.engines.engine.Engine` protocol (see module docstring)."""

    def __init__(self, config: EngineConfig) -> None:
        self._config = config
        device = config.device
        if device == "auto":
            device = "cuda" if torch.cuda.is_available() else "cpu"
        self._device = torch.device(device)
        if self._device.type == "cuda" and self._device.index is None:
            self._device = torch.device("cuda", torch.cuda.current_device())
        self._processor = vision_processor(config.model, config.trust_remote_code)
        self._image_token_id = None if self._processor is None else image_token_id(self._processor)
        self._banned: torch.Tensor | None = None
        """Ids of an image's expansion, never sampled (on the device); None for a text model."""
        if self._processor is not None:
            self._banned = torch.tensor(expansion_token_ids(self._processor), device=self._device)
        auto = AutoModelForCausalLM if self._processor is None else AutoModelForImageTextToText
        model: PreTrainedModel = auto.from_pretrained(
            config.model, dtype=_DTYPES[config.dtype], trust_remote_code=config.trust_remote_code
        )
        # transformers declares PreTrainedModel.to through a wrapper typed as unbound: the device is taken for `self`
        self._model: PreTrainedModel = model.to(self._device)  # type: ignore[arg-type]
        self._model.eval()
        self._tokenizer = AutoTokenizer.from_pretrained(config.tokenizer or config.model)
        eos = self._model.generation_config.eos_token_id
        self._eos_ids = set(eos if isinstance(eos, list) else [eos] if eos is not None else [])
        if self._tokenizer.eos_token_id is not None:
            self._eos_ids.add(self._tokenizer.eos_token_id)
        self._eos = torch.tensor(sorted(self._eos_ids), dtype=torch.long, device=self._device)
        pad = self._tokenizer.pad_token_id
        self._pad_id = int(pad if pad is not None else min(self._eos_ids, default=0))
        self._gen = torch.Generator(device=self._device).manual_seed(config.seed)
        self._targets = self._model.state_dict(keep_vars=True)
        self._receiver: WeightReceiver | None = None
        """Of the last update's transport (built at the first update)."""
        self._lora: LoraAdapter | None = None
        """The LoRA adapter shape the model's injected peft layers have (None: no adapter loaded yet)."""
        self._decoder = self._build_decoder()
        self._state: _SlotState | None = None
        if self._decoder is not None:
            self._state = _SlotState(config.max_num_seqs, config.max_model_len, self._device)
        self._version = 0
        self._asleep = False
        self._commands: queue.SimpleQueue[Command] = queue.SimpleQueue()
        self._backlog: collections.deque[Command] = collections.deque()
        """Commands taken from the queue, not run yet (in order)."""
        self._lock = threading.Lock()
        self._closed = False
        self._thread = threading.Thread(target=self._drive, name="hf-engine", daemon=True)
        self._thread.start()

    def _build_decoder(self) -> KVDecoder | None:
        reason = "a vision-language model" if self._processor is not None else unsupported_reason(self._model)
        if reason is not None:
            logger.warning("transformers engine: plain forward per batch (%s)", reason)
            return None
        decoder = KVDecoder(
            self._model, self._config.max_num_seqs, self._config.max_model_len, cuda_graphs=self._config.cuda_graphs
        )
        error = _self_check(self._model, decoder)
        limit = SELF_CHECK_TOLERANCE.get(decoder.dtype, 3e-2)
        if error > limit:
            logger.warning(
                "transformers engine: KV decoder differs from the model's forward by %.2e (> %.0e): "
                "plain forward per batch instead",
                error,
                limit,
            )
            return None
        logger.info(
            "transformers engine: KV decoder on %s (cuda graphs: %s; self-check error %.1e)",
            self._device,
            decoder.cuda_graphs,
            error,
        )
        return decoder

    async def generate(self, requests: list[GenerationRequest]) -> list[list[Sample]]:
        check_requests(requests, self._config, self._image_token_id)
        if not requests:
            return []
        inputs = [None if not r.images else await asyncio.to_thread(self._encode, r) for r in requests]
        job = _Job(requests, inputs)
        self._submit(job)
        return await asyncio.wrap_future(job.future)

    async def update_weights(self, event: WeightsPublished, timeout_s: float) -> None:
        if event.lora is not None:
            lora_weights.check_adapter(event.lora, event.version, self._config.max_lora_rank)
        await self._run_update(WeightUpdate(event, timeout_s))

    @property
    def asleep(self) -> bool:
        """Whether the KV cache is freed (:meth:`sleep`) and no batch has run since."""
        return self._asleep

    async def sleep(self) -> float:
        """Once the samples before it finish, free the KV cache and the CUDA graphs (the weights stay)."""
        command = _Sleep()
        self._submit(command)
        return await asyncio.wrap_future(command.future)

    async def wake(self) -> float:
        """Nothing to take back ahead of time: the next batch reserves its cache (returns 0.0 when it ran)."""
        command = _Wake()
        self._submit(command)
        return await asyncio.wrap_future(command.future)

    def close(self) -> None:
        if self._stop_driver(_Stop()) and self._receiver is not None:
            self._receiver.close()

    def _encode(self, request: GenerationRequest) -> _Inputs:
        """Expand a request's image tokens and make its pixel inputs (ValueError naming a problem)."""
        images = [decode_image(image) for image in request.images]
        prompt, pixels = encode(self._processor, request.prompt_ids, images)
        if len(prompt) >= self._config.max_model_len:
            raise ValueError(
                f"prompt of {len(prompt)} tokens with its images expanded does not fit "
                f"max_model_len={self._config.max_model_len}"
            )
        dtype = next(self._model.parameters()).dtype
        moved = {k: v.to(self._device, dtype=dtype if v.is_floating_point() else v.dtype) for k, v in pixels.items()}
        return _Inputs(prompt, moved)

    def _submit(self, command: _Job | WeightUpdate | _Sleep | _Wake) -> None:
        with self._lock:
            if self._closed:
                raise RuntimeError("the transformers engine is closed")
            self._commands.put(command)

    # --- driver thread -------------------------------------------------------------------

    def _drive(self) -> None:
        backlog = self._backlog
        waiting: collections.deque[_Row] = collections.deque()
        live: list[_Row] = []  # live[s] decodes in slot s
        while True:
            self._take(backlog, block=not (live or waiting or backlog))
            while backlog:  # jobs are admitted in order; an update or stop waits for the rows before it
                command = backlog[0]
                if isinstance(command, _Job):
                    backlog.popleft()
                    self._asleep = False
                    waiting.extend(self._admit(command))
                    continue
                if (live or waiting) and not (self._config.partial_rollout and isinstance(command, WeightUpdate)):
                    break
                backlog.popleft()
                if isinstance(command, WeightUpdate):  # (with partial_rollout: live rows go on under it)
                    self._update_live(command, live, [r.steps for r in live])
                    continue
                if isinstance(command, _Stop):
                    self._fail_rest(backlog, RuntimeError("the transformers engine was closed"))
                    self._model = None  # type: ignore[assignment]
                    return
                self._between_batches(command)
            if not (live or waiting):
                continue
            try:
                with torch.inference_mode():
                    if self._decoder is None:
                        self._run_batches(list(waiting))
                        waiting.clear()
                    else:
                        self._fill(live, waiting)
                        self._decode(live)
            except Exception as e:
                logger.exception("generation failed")
                for job in {id(r.job): r.job for r in [*live, *waiting]}.values():
                    if not job.future.done():
                        job.future.set_exception(e)
                live.clear()
                waiting.clear()

    def _update_live(self, update: WeightUpdate, live: list[_Row], counts: list[int]) -> None:
        """Apply ``update`` now; each row of ``live`` (``counts[i]`` tokens so far) notes that its
        tokens from there on come from the new version."""
        before = self._version
        self._update(update)
        if self._version != before:
            for row, count in zip(live, counts, strict=True):
                row.switches.append((count, self._version))

    def _updates_between_steps(self, live: list[_Row], counts: list[int]) -> None:
        """``partial_rollout``: apply the weight updates queued now, between two decode steps of
        ``live`` (``counts``: each row's tokens so far), without waiting for those rows. Updates queued
        behind a sleep, wake or stop keep their place (jobs admitted later take the new weights)."""
        if self._commands.empty() and not any(isinstance(c, WeightUpdate) for c in self._backlog):
            return
        self._take(self._backlog, block=False)
        kept: list[Command] = []
        while self._backlog:
            command = self._backlog[0]
            if isinstance(command, _Stop | _Sleep | _Wake):
                break
            self._backlog.popleft()
            if isinstance(command, WeightUpdate):
                self._update_live(command, live, counts)
            else:
                kept.append(command)
        self._backlog.extendleft(reversed(kept))

    def _between_batches(self, command: WeightUpdate | _Sleep | _Wake) -> None:
        """Run a command that waits for the samples admitted before it."""
        if isinstance(command, WeightUpdate):
            self._update(command)
            return
        if command.future.set_running_or_notify_cancel():  # (not when its waiter gave it up: the service stopped)
            if isinstance(command, _Sleep):
                command.future.set_result(self._sleep())
            else:
                self._asleep = False
                command.future.set_result(0.0)

    def _take(self, backlog: collections.deque[Command], block: bool) -> None:
        """Move queued commands to ``backlog``; when ``block``, wait for one and then ``batch_wait_ms``."""
        if block:
            backlog.append(self._commands.get())
            window_ends = time.monotonic() + self._config.batch_wait_ms / 1e3
            while (left := window_ends - time.monotonic()) > 0:
                try:
                    backlog.append(self._commands.get(timeout=left))
                except queue.Empty:
                    break
        while not self._commands.empty():
            backlog.append(self._commands.get())

    def _fail_rest(self, backlog: collections.deque[Command], error: BaseException) -> None:
        self._take(backlog, block=False)
        for command in backlog:
            if (
                isinstance(command, _Job | WeightUpdate | _Sleep | _Wake)
                and command.future.set_running_or_notify_cancel()
            ):
                command.future.set_exception(error)

    def _admit(self, job: _Job) -> list[_Row]:
        rows: list[_Row] = []
        job.results = [[None] * r.sampling.n for r in job.requests]
        for i, (request, inputs) in enumerate(zip(job.requests, job.inputs, strict=True)):
            sp = request.sampling
            prompt = list(request.prompt_ids) if inputs is None else inputs.prompt
            max_new = min(sp.max_new_tokens, self._config.max_model_len - len(prompt))
            for k in range(sp.n):
                generator = None
                if sp.seed is not None:  # one stream per sample: independent of what else is batched
                    generator = torch.Generator(device=self._device).manual_seed(sp.seed * 1_000_003 + k)
                rows.append(_Row(job, i, k, prompt, sp, max_new, generator, inputs))
        job.left = len(rows)
        return rows

    def _finish(self, row: _Row) -> None:
        text = row.text if row.text is not None else self._decode_text(row.tokens)
        versions = version_runs(row.switches, len(row.tokens))
        start = row.switches[0][1] if row.switches else self._version
        row.job.results[row.request][row.index] = Sample(
            token_ids=row.tokens,
            logprobs=row.logprobs,
            text=text,
            finish_reason=row.reason or "length",
            version_start=start,
            version_end=versions[-1][1] if versions else start,
            prompt_ids=None if row.inputs is None else row.prompt,
            versions=versions,
        )
        row.job.left -= 1
        if row.job.left == 0 and not row.job.future.done():
            row.job.future.set_result([list(samples) for samples in row.job.results])  # type: ignore[arg-type]

    # --- slot decoding (KV decoder) ------------------------------------------------------

    def _fill(self, live: list[_Row], waiting: collections.deque[_Row]) -> None:
        """Prefill waiting rows into free slots and sample their first token."""
        assert self._decoder is not None and self._state is not None
        free = self._config.max_num_seqs - len(live)
        if free <= 0 or not waiting:
            return
        new = [waiting.popleft() for _ in range(min(free, len(waiting)))]
        for row in new:
            row.switches = [(0, self._version)]
        longest = max(len(r.prompt) + r.max_new for r in [*live, *new])
        self._decoder.reserve(len(live) + len(new), longest)
        distinct: dict[tuple[int, ...], int] = {}
        source = torch.tensor([distinct.setdefault(tuple(r.prompt), len(distinct)) for r in new])
        slots = torch.arange(len(live), len(live) + len(new))
        logits = self._decoder.prefill([list(p) for p in distinct], slots, source)
        self._state.admit(slots, new)
        live.extend(new)
        first = len(live) - len(new)
        self._sample(logits, live, first, {s: r.generator for s, r in enumerate(new) if r.generator is not None})
        for row in new:
            row.steps = 1

    def _sample(
        self, logits: torch.Tensor, live: list[_Row], first: int, generators: dict[int, torch.Generator]
    ) -> None:
        """Sample the next token of slots ``first..len(live)-1`` from their ``logits`` and record it.

        ``generators``: the own generators of seeded rows, by position counted from ``first``.
        """
        assert self._state is not None
        state, n = self._state, len(live)
        rows = slice(first, n)
        if state.any_min_new and self._eos.numel():
            early = (state.n_gen[rows] < state.min_new[rows])[:, None]
            logits[:, self._eos] = torch.where(early, float("-inf"), logits[:, self._eos])
        params = RowParams(state.temperature[rows], state.top_k[rows], state.top_p[rows], state.any_filtered)
        logp = row_logprobs(logits, params)
        noise = exponential_noise(tuple(logp.shape), self._device, self._gen, generators)  # type: ignore[arg-type]
        ids, chosen = pick(logp, state.temperature[rows] <= 0, noise)
        state.record(first, n, ids, chosen, self._eos)

    def _decode(self, live: list[_Row]) -> None:
        """Decode up to ``SYNC_EVERY`` steps, then hand back finished rows and compact the slots.

        The live rows are fixed for these steps, so the host bookkeeping is done once: the steps
        until every row reached its length, and the highest position fed at each step.
        """
        assert self._decoder is not None and self._state is not None
        state, n = self._state, len(live)
        steps = min(SYNC_EVERY, max(r.max_new - r.steps for r in live))
        top = max(len(r.prompt) + r.steps - 1 for r in live)  # position of the newest token
        cap = max(len(r.prompt) + r.max_new - 1 for r in live)
        generators = {s: r.generator for s, r in enumerate(live) if r.generator is not None}
        for k in range(steps):
            logits = self._decoder.decode(state.cur_ids[:n], state.pos[:n], min(top + k, cap))
            self._sample(logits, live, 0, generators)
            if self._config.partial_rollout and k + 1 < steps:  # (a row that ended drops its switch)
                self._updates_between_steps(live, [r.steps + k + 1 for r in live])
        self._collect(live)

    def _collect(self, live: list[_Row]) -> None:
        """Look at the device state once: finish rows (EOS, length, stop string) and compact."""
        assert self._decoder is not None and self._state is not None
        state, n = self._state, len(live)
        done, n_gen = state.done[:n].tolist(), state.n_gen[:n].tolist()
        stops = [s for s in range(n) if live[s].sampling.stop and not done[s]]
        finished = [s for s in range(n) if done[s]]
        need = sorted(set(finished) | set(stops))
        if need:
            index = torch.tensor(need, device=self._device)
            width = max(n_gen[s] for s in need)
            tokens = state.tokens[index, :width].tolist()
            logps = state.logps[index, :width].tolist()
            for s, toks, lps in zip(need, tokens, logps, strict=True):
                row = live[s]
                row.tokens, row.logprobs = toks[: n_gen[s]], lps[: n_gen[s]]
                cut = self._stop_string(row)
                if cut is not None:
                    row.tokens, row.logprobs = row.tokens[:cut], row.logprobs[:cut]
                    done[s] = True
                elif done[s]:
                    row.reason = "stop" if row.tokens[-1] in self._eos_ids else "length"
        for s in range(n):
            live[s].steps = n_gen[s]
        keep = [s for s in range(n) if not done[s]]
        for s in range(n):
            if done[s]:
                self._finish(live[s])
        if len(keep) == n:
            return
        holes = [s for s in range(len(keep)) if done[s]]  # free slots below the new count ...
        movers = [s for s in keep if s >= len(keep)]  # ... take the live rows above it
        survivors = live[: len(keep)]
        if holes:
            src, dst = torch.tensor(movers, device=self._device), torch.tensor(holes, device=self._device)
            self._decoder.move(src, dst, self._decoder.capacity)
            state.move(src, dst)
            for hole, mover in zip(holes, movers, strict=True):
                survivors[hole] = live[mover]
        live[:] = survivors
        state.refresh_flags(live)

    def _stop_string(self, row: _Row) -> int | None:
        """Number of tokens to keep when a stop string appeared in ``row`` (its text set), else None."""
        stop = row.sampling.stop
        if not stop:
            return None
        for t in range(row.checked, len(row.tokens)):
            text = self._decode_text(row.tokens[: t + 1])
            hits = [text.find(s) for s in stop if s in text]
            if hits:
                row.text, row.reason = text[: min(hits)], "stop"
                return t + 1
            if row.tokens[t] in self._eos_ids:
                row.checked = t + 1
                return None
        row.checked = len(row.tokens)
        return None

    # --- plain forward (other architectures) ---------------------------------------------

    def _run_batches(self, rows: list[_Row]) -> None:
        """Generate ``rows`` with the model's own forward: the text rows as one batch, the samples of
        each request with images as a batch of their own."""
        text = [r for r in rows if r.inputs is None]
        if text:
            self._run_plain(text)
        requests: dict[int, list[_Row]] = {}
        for r in rows:
            if r.inputs is not None:
                requests.setdefault(id(r.inputs), []).append(r)
        for group in requests.values():
            self._run_plain(group, group[0].inputs)

    def _run_plain(self, rows: list[_Row], inputs: _Inputs | None = None) -> None:
        """Generate ``rows`` to their end with the model's own forward and cache (one batch).

        ``inputs``: the pixel inputs of the one prompt every row shares; the model then places its
        tokens itself (no padding: no positions are passed). With ``partial_rollout`` a weight update
        lands between two steps (the cache computed so far is kept).
        """
        for row in rows:
            row.switches = [(0, self._version)]
        distinct: dict[tuple[int, ...], int] = {}
        source = torch.tensor([distinct.setdefault(tuple(r.prompt), len(distinct)) for r in rows])
        prompts = list(distinct)
        width = max(len(p) for p in prompts)
        input_ids = torch.full((len(prompts), width), self._pad_id, dtype=torch.long)
        attention = torch.zeros((len(prompts), width), dtype=torch.long)
        for b, prompt in enumerate(prompts):
            input_ids[b, width - len(prompt) :] = torch.tensor(prompt)
            attention[b, width - len(prompt) :] = 1
        positions = (attention.cumsum(dim=1) - 1).clamp(min=0)
        input_ids, attention, positions = (t.to(self._device) for t in (input_ids, attention, positions))
        pixels = {} if inputs is None else inputs.pixels
        explicit_positions = inputs is None
        out = self._model(
            input_ids=input_ids,
            attention_mask=attention,
            use_cache=True,
            **pixels,
            position_ids=positions if explicit_positions else None,
        )
        past = out.past_key_values
        source = source.to(self._device)
        logits = out.logits[:, -1, :].float()[source]
        if len(prompts) < len(rows):
            past.batch_select_indices(source)
        attention, positions = attention[source], positions[source]
        live = list(range(len(rows)))
        step = 0
        while True:
            live_rows = [rows[b] for b in live]
            next_ids, chosen = self._plain_pick(logits, live_rows, step)
            keep = []
            for pos, (row, token, lp) in enumerate(zip(live_rows, next_ids.tolist(), chosen.tolist(), strict=True)):
                row.tokens.append(token)
                row.logprobs.append(lp)
                if self._plain_stop(row):
                    self._finish(row)
                else:
                    keep.append(pos)
            step += 1
            if not keep:
                return
            if len(keep) < len(live):
                live = [live[p] for p in keep]
                index = torch.tensor(keep, device=self._device)
                past.batch_select_indices(index)
                attention, positions, next_ids = attention[index], positions[index], next_ids[index]
            if self._config.partial_rollout:
                kept = [rows[b] for b in live]
                self._updates_between_steps(kept, [len(r.tokens) for r in kept])
            attention = torch.cat([attention, torch.ones_like(attention[:, :1])], dim=1)
            positions = positions[:, -1:] + 1
            out = self._model(
                input_ids=next_ids[:, None],
                attention_mask=attention,
                past_key_values=past,
                position_ids=positions if explicit_positions else None,
                use_cache=True,
            )
            past = out.past_key_values
            logits = out.logits[:, -1, :].float()

    def _plain_pick(self, logits: torch.Tensor, rows: list[_Row], step: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Sample the next token of each of ``rows`` (``step`` tokens so far) from ``logits``: ids and log-probs."""
        for r, row in enumerate(rows):
            if step < row.sampling.min_new_tokens and self._eos.numel():
                logits[r, self._eos] = float("-inf")
        if self._banned is not None:  # vision-language models: only ever on this path
            logits[:, self._banned] = float("-inf")
        params = RowParams(
            torch.tensor([r.sampling.temperature for r in rows], device=self._device),
            torch.tensor([r.sampling.top_k for r in rows], device=self._device),
            torch.tensor([r.sampling.top_p for r in rows], device=self._device),
            any(r.sampling.top_k > 0 or r.sampling.top_p < 1 for r in rows),
        )
        logp = row_logprobs(logits, params)
        generators = {i: r.generator for i, r in enumerate(rows) if r.generator is not None}
        noise = exponential_noise(tuple(logp.shape), self._device, self._gen, generators)  # type: ignore[arg-type]
        return pick(logp, params.temperature <= 0, noise)

    def _plain_stop(self, row: _Row) -> bool:
        if row.tokens[-1] in self._eos_ids:
            row.reason = "stop"
            return True
        if self._stop_string(row) is not None:
            return True
        if len(row.tokens) >= row.max_new:
            row.reason = "length"
            return True
        return False

    def _decode_text(self, token_ids: list[int]) -> str:
        return str(self._tokenizer.decode(token_ids, skip_special_tokens=True))

    def _sleep(self) -> float:
        """Free the KV cache and the captured graphs; the seconds it took."""
        start = time.perf_counter()
        if self._decoder is not None:
            self._decoder.release()
        if self._receiver is not None:  # e.g. the CUDA IPC staging copy (the next update allocates it)
            self._receiver.release_memory()
        if self._device.type == "cuda":
            torch.cuda.empty_cache()
        self._asleep = True
        return time.perf_counter() - start

    # --- weights -------------------------------------------------------------------------

    def _update(self, update: WeightUpdate) -> None:
        if not update.future.set_running_or_notify_cancel():  # given up before it began
            return
        start = time.perf_counter()
        event = update.event
        try:
            self._receiver = receiver_for(event, self._receiver, device=self._device, label="hf")
            with self._receiver.receive(event, update.timeout_s, update.abandoned) as received:
                if event.lora is not None:
                    self._load_adapter(event.lora, received.version, received.tensors)
                else:
                    self._load(received.version, received.tensors)
            if event.lora is None and self._lora is not None:  # full weights now: the adapter adds nothing
                lora_weights.zero_adapter(self._model)
        except Exception as e:  # noqa: BLE001 - the caller gets it; the old weights stay
            update.future.set_exception(e)
            return
        self._version = received.version
        update.future.set_result(time.perf_counter() - start)

    def _load_adapter(self, adapter: LoraAdapter, version: int, tensors: list[tuple[str, torch.Tensor]]) -> None:
        """Copy a verified LoRA adapter into the model's peft LoRA layers (added at the first adapter; an
        adapter of another shape than the first is refused)."""
        if self._lora is None:
            lora_weights.inject(self._model, adapter)
            self._lora = adapter
            if self._decoder is not None:
                self._decoder.drop_graphs()  # captured without the LoRA layers
        elif adapter != self._lora:
            raise WeightSyncError(
                f"version {version}: LoRA adapter {adapter} differs from the {self._lora} this engine serves"
            )
        lora_weights.load_in_place(self._model, tensors, version)
        if self._device.type == "cuda":
            torch.cuda.current_stream(self._device).synchronize()

    def _load(self, version: int, received: list[tuple[str, torch.Tensor]]) -> None:
        """Copy a whole verified version into the model's parameters (every parameter written)."""
        names = {name for name, _ in received}
        # (with LoRA layers added, a layer's own weight is its base_layer's: the same tensor as in _targets)
        own = (n.replace(".base_layer.", ".") for n, _ in self._model.named_parameters() if ".lora_" not in n)
        missing = [name for name in own if name not in names]
        unknown = [name for name in names if name not in self._targets]
        if missing or unknown:
            raise WeightSyncError(
                f"version {version} does not match the model: missing {missing[:5]}, unknown {unknown[:5]}"
            )
        bad = [n for n, t in received if tuple(t.shape) != tuple(self._targets[n].shape)]
        if bad:
            raise WeightSyncError(f"version {version}: wrong shapes for {bad[:5]}")
        dsts = [self._targets[n].data for n, _ in received]
        srcs = [t if t.dtype == d.dtype else t.to(d.dtype) for (_, t), d in zip(received, dsts, strict=True)]
        with torch.no_grad():
            torch._foreach_copy_(dsts, srcs, non_blocking=True)
        if self._device.type == "cuda":
            torch.cuda.current_stream(self._device).synchronize()


class _SlotState:
    """Per-slot decoding state on the device (slot ``s`` = ``live[s]``)."""

    def __init__(self, slots: int, max_len: int, device: torch.device) -> None:
        def zeros(*shape: int, dtype: torch.dtype = torch.long) -> torch.Tensor:
            return torch.zeros(shape, dtype=dtype, device=device)

        self.device = device
        self.cur_ids, self.pos, self.n_gen = zeros(slots), zeros(slots), zeros(slots)
        self.max_new, self.min_new = zeros(slots), zeros(slots)
        self.done = zeros(slots, dtype=torch.bool)
        self.temperature, self.top_p = zeros(slots, dtype=torch.float32), zeros(slots, dtype=torch.float32)
        self.top_k = zeros(slots)
        self.tokens, self.logps = zeros(slots, max_len), zeros(slots, max_len, dtype=torch.float32)
        self.any_min_new = False
        self.any_filtered = False
        self._all = [
            self.cur_ids,
            self.pos,
            self.n_gen,
            self.max_new,
            self.min_new,
            self.done,
            self.temperature,
            self.top_p,
            self.top_k,
            self.tokens,
            self.logps,
        ]

    def admit(self, slots: torch.Tensor, rows: list[_Row]) -> None:
        """Reset the state of ``slots`` for the newly prefilled ``rows`` (first token not sampled yet)."""
        s = slots.to(self.device)

        def put(target: torch.Tensor, values: list[Any], dtype: torch.dtype) -> None:
            target[s] = torch.tensor(values, dtype=dtype).to(self.device)

        put(self.pos, [len(r.prompt) - 1 for r in rows], torch.long)  # advanced to len(prompt) by record()
        put(self.n_gen, [0] * len(rows), torch.long)
        put(self.max_new, [r.max_new for r in rows], torch.long)
        put(self.min_new, [r.sampling.min_new_tokens for r in rows], torch.long)
        put(self.done, [False] * len(rows), torch.bool)
        put(self.temperature, [r.sampling.temperature for r in rows], torch.float32)
        put(self.top_p, [r.sampling.top_p for r in rows], torch.float32)
        put(self.top_k, [r.sampling.top_k for r in rows], torch.long)
        self.any_min_new |= any(r.sampling.min_new_tokens > 0 for r in rows)
        self.any_filtered |= any(_filtered(r.sampling) for r in rows)

    def record(self, first: int, n: int, ids: torch.Tensor, logps: torch.Tensor, eos: torch.Tensor) -> None:
        """Append the sampled ``ids`` (and log-probs) to the slots ``first..n-1`` that are not done."""
        rows = torch.arange(first, n, device=self.device)
        active = ~self.done[first:n]
        at = self.n_gen[first:n].clamp(max=self.tokens.shape[1] - 1)
        self.tokens[rows, at] = torch.where(active, ids, self.tokens[rows, at])
        self.logps[rows, at] = torch.where(active, logps, self.logps[rows, at])
        self.n_gen[first:n] += active
        self.pos[first:n] += active
        self.cur_ids[first:n] = torch.where(active, ids, self.cur_ids[first:n])
        ended = torch.isin(ids, eos) | (self.n_gen[first:n] >= self.max_new[first:n])
        self.done[first:n] |= active & ended

    def move(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        for t in self._all:
            t[dst] = t[src]

    def refresh_flags(self, live: list[_Row]) -> None:
        self.any_min_new = any(r.sampling.min_new_tokens > 0 for r in live)
        self.any_filtered = any(_filtered(r.sampling) for r in live)


def _filtered(sp: SamplingParams) -> bool:
    return sp.temperature > 0 and (sp.top_k > 0 or sp.top_p < 1.0)


def _self_check(model: PreTrainedModel, decoder: KVDecoder) -> float:
    """Max |logit difference| / max |logit| between the decoder (prefill + 3 decode steps of 2
    prompts) and the model's own forward on the same tokens."""
    vocab = model.config.vocab_size
    generator = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, vocab, (n,), generator=generator).tolist() for n in (5, 3)]
    follow = torch.randint(0, vocab, (2, 3), generator=generator)
    with torch.inference_mode():
        decoder.reserve(2, 16)
        got = [decoder.prefill(prompts, torch.arange(2), torch.arange(2))]
        for t in range(3):
            pos = torch.tensor([len(p) + t for p in prompts], device=decoder.device)
            got.append(decoder.decode(follow[:, t].to(decoder.device), pos, int(pos.max())))
        worst = 0.0
        for b, prompt in enumerate(prompts):
            ids = torch.tensor([prompt + follow[b].tolist()], device=decoder.device)
            ref = model(input_ids=ids).logits[0, len(prompt) - 1 :].float()
            mine = torch.stack([g[b] for g in got])
            worst = max(worst, float((mine - ref).abs().max() / ref.abs().max().clamp_min(1e-6)))
    return worst
