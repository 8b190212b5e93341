"""The generation engine seen by the rollout service: one protocol, two implementations.

* :class:`streamrl.rollout.engines.vllm_engine.VLLMEngine` - vLLM (the only module importing vllm):
  continuous batching of everything submitted concurrently, weight updates between engine steps.
* :class:`streamrl.rollout.engines.hf_engine.HFEngine` - plain transformers, one request at a time: for
  debugging, and for machines without vLLM (the GPU test machine).

A request may carry images (vision-language models, :mod:`streamrl.rollout.vision`): its prompt then
holds one image token per image (collapsed) and each sample reports the prompt as the model saw it,
every image token expanded into that image's tokens.

Both return, per sample, the token ids, the behaviour log-probs of the distribution actually
sampled from (after temperature / top-k / top-p: what TIS and ICEPOP need), the finish reason and
the policy versions that produced the first and the last token. Both take new weights from the
learner's weight server (:mod:`streamrl.common.weights.wire`), or as members of the learner's
weight-broadcast group (:mod:`streamrl.rollout.weights.broadcast`), and report the version they
serve; the transformers engine also takes them over CUDA IPC when it shares the learner's GPU
(:mod:`streamrl.rollout.weights.ipc`), and so does the vLLM engine on a GPU. In colocated synchronous
runs both can sleep between versions (``rollout.engine.sleep_between_versions``): give back GPU
memory while the learner trains, take it back when the next version's weights arrive.

This module imports no torch, vllm or transformers; :func:`streamrl.rollout.engines.factory.build_engine`
builds the engine a config names (the implementations import this module, never the factory).
"""

from __future__ import annotations

import concurrent.futures
from dataclasses import dataclass, field
from typing import Literal, Protocol

from streamrl.common.messages import Image, IpcWeights, SamplingParams, WeightsBroadcast
from streamrl.rollout.engines.config import EngineConfig
from streamrl.rollout.vision import check_image_count

FinishReason = Literal["stop", "length", "abort"]


@dataclass(frozen=True, slots=True)
class GenerationRequest:
    """One prompt to answer ``sampling.n`` times.

    Example:
        GenerationRequest(prompt_ids=[12, 7, 99], sampling=SamplingParams(temperature=0.7, n=4))
    """

    prompt_ids: list[int]
    """[P] prompt token ids (chat template already applied); one image token per image (collapsed)."""
    sampling: SamplingParams = field(default_factory=SamplingParams)
    images: list[Image] = field(default_factory=list)
    """The images of the prompt, in the order of its image tokens (vision-language models only)."""


@dataclass(frozen=True, slots=True)
class Sample:
    """One generated response."""

    token_ids: list[int]
    """[T] generated token ids (the stop token included when one ended generation)."""
    logprobs: list[float]
    """[T] log-prob of each token under the distribution it was sampled from."""
    text: str
    """Decoded response (a matched stop string is not included)."""
    finish_reason: FinishReason
    """``stop`` (EOS or stop string), ``length`` (max_new_tokens / max_model_len) or ``abort``."""
    version_start: int
    """Policy version that generated the first token."""
    version_end: int
    """Policy version that generated the last token (newer when an update landed mid-generation)."""
    prompt_ids: list[int] | None = None
    """The prompt as the model saw it when the request had images (each image token expanded by the
    model's processor: what a trajectory records); None for a text prompt (the request's ids)."""

    @property
    def truncated(self) -> bool:
        """True when generation hit the length limit."""
        return self.finish_reason == "length"


@dataclass
class WeightUpdate:
    """A weight update queued to an engine's driver thread; ``future`` gets the seconds it took."""

    endpoint: str
    version: int
    checksum: str
    timeout_s: float
    ipc: IpcWeights | None = None
    """CUDA IPC buffers of the version (colocated with the learner); None = pull from ``endpoint``."""
    broadcast: WeightsBroadcast | None = None
    """Rendezvous of the learner's weight-broadcast group: receive the version as a member of it."""
    future: concurrent.futures.Future[float] = field(default_factory=concurrent.futures.Future)


def check_requests(requests: list[GenerationRequest], config: EngineConfig, image_token_id: int | None) -> None:
    """Reject requests no engine can serve, with a message naming the problem. ``image_token_id``:
    the model's image token (None: not a vision-language model, so no request may hold images)."""
    for r in requests:
        if r.sampling.n < 1:
            raise ValueError(f"sampling.n must be >= 1, got {r.sampling.n}")
        if not 0 < len(r.prompt_ids) < config.max_model_len:
            raise ValueError(f"prompt of {len(r.prompt_ids)} tokens does not fit max_model_len={config.max_model_len}")
        if len(r.images) > config.max_images_per_prompt:
            raise ValueError(
                f"a prompt with {len(r.images)} images: more than "
                f"rollout.engine.max_images_per_prompt={config.max_images_per_prompt}"
            )
        check_image_count(r.prompt_ids, len(r.images), image_token_id)


class Engine(Protocol):
    """A generation engine: many concurrent ``generate`` calls, weight updates between them."""

    @property
    def version(self) -> int:
        """Policy version of the weights served now (0 = the weights the engine was built from)."""
        ...

    async def generate(self, requests: list[GenerationRequest]) -> list[list[Sample]]:
        """Answer every request; result ``[i][j]`` is sample ``j`` of request ``i`` (``n`` per request)."""
        ...

    async def update_weights(
        self,
        endpoint: str,
        version: int,
        checksum: str,
        timeout_s: float,
        ipc: IpcWeights | None = None,
        broadcast: WeightsBroadcast | None = None,
    ) -> None:
        """Take ``version`` and serve it from now on: from the learner's CUDA IPC buffers ``ipc`` when
        given (the engine shares the learner's GPU), as a member of the learner's weight-broadcast
        group ``broadcast`` when given (exactly ``version``, loaded only if what the member received
        hashes to ``broadcast.checksum``, the signed event's), else pulled from the weight server at
        ``endpoint``.

        Raises :class:`streamrl.common.errors.WeightSyncError` on a missed deadline, a checksum
        mismatch, a broadcast version replaced by a newer one before it was loaded, or ``ipc`` /
        ``broadcast`` weights the engine cannot take; the engine then keeps serving its previous version.
        """
        ...

    @property
    def asleep(self) -> bool:
        """Whether the engine has given its GPU memory back (:meth:`sleep`) and not taken it again."""
        ...

    async def sleep(self) -> float:
        """Once the requests running now are done, free what GPU memory the engine can while it has no
        work (``rollout.engine.sleep_between_versions``: colocated synchronous runs, the learner trains
        meanwhile); returns the seconds it took. A later ``generate`` or ``update_weights`` wakes it first."""
        ...

    async def wake(self) -> float:
        """Take back what :meth:`sleep` freed (nothing when awake); returns the seconds it took."""
        ...

    def close(self) -> None:
        """Abort what is in flight and free the engine."""
        ...
