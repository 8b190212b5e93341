"""Multi-turn episodes over the engine: the model and an environment take turns.

One episode per sample of a prompt, all ``n`` of them concurrently (the engine batches their turns)::

    ids = []                                          # everything after the prompt, as token ids
    ids += tokens(env.reset(prompt, label, metadata)) # if it says anything: environment tokens
    for k in range(max_turns):
        turn = engine.generate(prompt + ids)          # one sample, max_new_tokens within the budget
        ids += turn tokens                            # loss_mask 1, the engine's behaviour log-probs
        result = env.step(turn.text)                  # its reward becomes Turn.reward
        if result.done: break
        ids += tokens(result.observation)             # loss_mask 0, log-probs 0

The next turn's prompt is this exact list of ids - the engine's tokens and the environment's text
tokenized alone - never a re-tokenization of the conversation's text: the log-probs the engine
reports are those of the sequence the learner trains on.

Why an episode stops (``Trajectory.stop_reason``):

* ``done``: the environment said so;
* ``max_turns``: the last allowed turn was answered (its observation is not appended: nobody would
  read it);
* ``max_tokens``: the episode's budget (``rollout.environment.max_tokens``) cut a turn or left no
  room for the next one (or for an observation and a turn after it);
* ``length``: a turn hit the turn limit (``sampling.max_new_tokens``), or the engine's context
  (``max_model_len``) cut a turn or left no room, where that is tighter than the budget;
* ``error``: ``step`` raised, overran ``step_timeout_s`` or returned something malformed; the
  message goes in ``metadata["env_error"]`` and the turns so far are kept.

Images (vision-language policies, :mod:`streamrl.rollout.vision`): a step may return images with
its observation, whose text holds one image token per image. The engine's context keeps each image
as that one token (the collapsed form the engines take, with every image of the episode so far);
the episode records it expanded into the image's tokens (loss mask 0, log-prob 0), as the model saw
it, and budgets count the expanded tokens. The next turn's engine-reported prompt must equal the
prompt and the episode so far, expanded. The engines never sample an image's tokens; should an
engine still return the image token in a model turn, that turn cannot go back to an engine as
context (it would stand for an image that is not there): the episode then stops with ``error``
before the next turn.

A turn cut by a limit is not shown to the environment. ``reset`` failing (or the environment's
constructor) fails the whole prompt instead (the consumer loop retries it, then dead-letters it, and
the coordinator replaces the group): there is no episode without a start. ``truncated`` is true
when a limit ended the episode (``length``, ``max_tokens``, ``max_turns``).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, Literal, TypeVar

import msgspec

from streamrl.common.aio import cancel_and_wait
from streamrl.common.errors import RetryableError
from streamrl.common.messages import Image, PromptWorkItem, SamplingParams, Turn
from streamrl.rollout.config import EnvironmentConfig
from streamrl.rollout.engines.engine import Engine, FinishReason, GenerationRequest, Sample, VersionRuns, turn_versions
from streamrl.rollout.environments.environment import EnvironmentCallError, as_step_result, call
from streamrl.rollout.vision import ImageExpander, check_image_count

logger = logging.getLogger(__name__)

StopReason = Literal["done", "max_turns", "max_tokens", "length", "error"]
Tokenize = Callable[[str], list[int]]
"""Text -> token ids with the engine's tokenizer, adding no special tokens of its own (no BOS)."""
T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class Episode:
    """One finished episode: everything after the prompt, and where the model's turns lie in it."""

    token_ids: list[int]
    """[T] the model's tokens and the environment's, in order."""
    logprobs: list[float]
    """[T] behaviour log-probs; 0 on environment tokens."""
    loss_mask: list[int]
    """[T] 1 on the model's tokens, 0 on the environment's."""
    text: str
    """The turns' texts and the observations, concatenated."""
    turns: list[Turn]
    stop_reason: StopReason
    finish_reason: FinishReason
    """The last turn's."""
    version_start: int
    """Policy version of the first turn's first token."""
    version_end: int
    """Policy version of the last turn's last token."""
    versions: VersionRuns = field(default_factory=list)
    """Policy version of each token, run-length (:func:`streamrl.rollout.engines.engine.version_runs`);
    empty when one version produced every turn."""
    env_infos: list[dict[str, Any]] = field(default_factory=list)
    """``StepResult.info`` of each step."""
    env_error: str | None = None
    """Why the environment failed (stop reason ``error``)."""
    prompt_ids: list[int] | None = None
    """The prompt as the model saw it when the episode had images (image tokens expanded), else None."""
    images: list[Image] = field(default_factory=list)
    """The images the environment returned, in order (after the prompt's)."""

    @property
    def truncated(self) -> bool:
        """A limit ended the episode, not the environment."""
        return self.stop_reason in ("length", "max_tokens", "max_turns")

    @property
    def num_model_tokens(self) -> int:
        return sum(self.loss_mask)


@dataclass
class _Builder:
    """The episode so far."""

    token_ids: list[int] = field(default_factory=list)
    """The episode as the model saw it (image tokens expanded): what the trajectory records."""
    context: list[int] = field(default_factory=list)
    """The episode as the engine takes it (one image token per image)."""
    images: list[Image] = field(default_factory=list)
    """The environment's images so far."""
    prompt_ids: list[int] | None = None
    logprobs: list[float] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)
    texts: list[str] = field(default_factory=list)
    turns: list[Turn] = field(default_factory=list)
    samples: list[Sample] = field(default_factory=list)
    infos: list[dict[str, Any]] = field(default_factory=list)

    def add_turn(self, sample: Sample) -> None:
        start = len(self.token_ids)
        self.token_ids += sample.token_ids
        self.context += sample.token_ids
        self.logprobs += sample.logprobs
        self.loss_mask += [1] * len(sample.token_ids)
        self.texts.append(sample.text)
        self.turns.append(Turn(start=start, end=len(self.token_ids), policy_version=sample.version_start))
        self.samples.append(sample)

    def add_observation(
        self, text: str, token_ids: list[int], expanded: list[int] | None = None, images: list[Image] | None = None
    ) -> None:
        """``token_ids`` with one image token per image of ``images``; ``expanded``: the same with the
        images' tokens (None: no images, the same ids)."""
        expanded = token_ids if expanded is None else expanded
        self.context += token_ids
        self.images += images or []
        self.token_ids += expanded
        self.logprobs += [0.0] * len(expanded)
        self.loss_mask += [0] * len(expanded)
        self.texts.append(text)

    def reward_last_turn(self, reward: float) -> None:
        self.turns[-1] = msgspec.structs.replace(self.turns[-1], reward=reward)

    def build(self, stop_reason: StopReason, error: str | None) -> Episode:
        first, last = self.samples[0], self.samples[-1]
        return Episode(
            token_ids=self.token_ids,
            logprobs=self.logprobs,
            loss_mask=self.loss_mask,
            text="".join(self.texts),
            turns=self.turns,
            stop_reason=stop_reason,
            finish_reason=last.finish_reason,
            version_start=first.version_start,
            version_end=last.version_end,
            versions=turn_versions(
                ((t.start, s) for t, s in zip(self.turns, self.samples, strict=True)), len(self.token_ids)
            ),
            env_infos=self.infos,
            env_error=error,
            prompt_ids=self.prompt_ids,
            images=self.images,
        )


class EpisodeRunner:
    """Runs the episodes of a prompt (see the module docstring)."""

    def __init__(
        self,
        engine: Engine,
        make_environment: Callable[[], Any],
        tokenize: Tokenize,
        config: EnvironmentConfig,
        max_model_len: int,
        expand: ImageExpander | None = None,
    ) -> None:
        self.engine = engine
        self.make_environment = make_environment
        self.tokenize = tokenize
        self.cfg = config
        self.max_model_len = max_model_len
        self.expand = expand
        """Image-token expansion with the model's processor; None: not a vision-language model."""

    async def run_group(self, item: PromptWorkItem) -> list[Episode]:
        """``item.sampling.n`` episodes of ``item``, in sample order."""
        try:
            envs = [self.make_environment() for _ in range(item.sampling.n)]
        except Exception as e:  # the plug-in's constructor: re-raised as the domain error
            raise EnvironmentCallError(f"creating the environment raised {type(e).__name__}: {e}") from e
        try:
            openings = await _all([self._reset(env, item) for env in envs])
            prompt = item.prompt_ids.tolist()
            if self.expand is not None:  # the model's view of the prompt, for the budgets and the record
                prompt = await asyncio.to_thread(self.expand, prompt, list(item.images))
            return await _all(
                [
                    self._run(env, item, prompt, j, text)
                    for j, (env, text) in enumerate(zip(envs, openings, strict=True))
                ]
            )
        finally:
            await asyncio.gather(*(self._close(env) for env in envs))

    async def _reset(self, env: Any, item: PromptWorkItem) -> str:
        text = await call(
            env.reset,
            item.prompt_text,
            item.label,
            dict(item.metadata),
            timeout_s=self.cfg.step_timeout_s,
            what="reset",
        )
        if text is not None and not isinstance(text, str):
            raise EnvironmentCallError(f"reset returned a {type(text).__name__}, not a str or None")
        return text or ""

    async def _close(self, env: Any) -> None:
        close = getattr(env, "close", None)
        if callable(close):
            try:
                await call(close, timeout_s=self.cfg.step_timeout_s, what="close")
            except EnvironmentCallError as e:
                logger.warning("environment: %s", e)

    async def _run(self, env: Any, item: PromptWorkItem, expanded_prompt: list[int], j: int, opening: str) -> Episode:
        """Episode ``j`` of ``item``; ``expanded_prompt``: the prompt as the model sees it."""
        sampling, cfg = item.sampling, self.cfg
        room_in_context = self.max_model_len - len(expanded_prompt)
        budget = min(cfg.max_tokens, room_in_context)  # tokens after the prompt this episode may hold
        out_of_room: StopReason = "max_tokens" if cfg.max_tokens <= room_in_context else "length"
        ep = _Builder()
        ep.prompt_ids = expanded_prompt if item.images else None
        opening_ids = self._opening_ids(opening)
        if len(opening_ids) >= budget:
            raise ValueError(
                f"a prompt of {len(expanded_prompt)} tokens and the environment's opening text "
                f"({len(opening_ids)} tokens) leave no room for a turn (rollout.environment.max_tokens={cfg.max_tokens}, "
                f"rollout.engine.max_model_len={self.max_model_len})"
            )
        if opening:
            ep.add_observation(opening, opening_ids)
        stop: StopReason = "max_turns"
        error: str | None = None
        for k in range(cfg.max_turns):
            room = budget - len(ep.token_ids)
            if room < 1:
                stop = out_of_room
                break
            max_new = min(sampling.max_new_tokens, room)
            seed = None if sampling.seed is None else sampling.seed + j + k * sampling.n
            turn_sampling = msgspec.structs.replace(sampling, n=1, max_new_tokens=max_new, seed=seed)
            sample = await self._turn(item, ep, expanded_prompt, turn_sampling, f"turn {k} of {item.id}/{j}")
            ep.add_turn(sample)
            if sample.finish_reason == "length":
                stop = out_of_room if max_new < sampling.max_new_tokens else "length"
                break
            try:
                what = f"step of turn {k}"
                result = as_step_result(await call(env.step, sample.text, timeout_s=cfg.step_timeout_s, what=what))
            except EnvironmentCallError as e:
                stop, error = "error", str(e)
                break
            ep.reward_last_turn(result.reward)
            ep.infos.append(result.info)
            if result.done:
                stop = "done"
                break
            if k == cfg.max_turns - 1:
                break  # max_turns: the observation would never be read
            ids = self.tokenize(result.observation) if result.observation else []
            try:
                expanded = await self._expand_observation(ep, ids, result.images)
            except ValueError as e:
                stop, error = "error", f"turn {k}: {e}"
                break
            if len(ep.token_ids) + len(expanded) >= budget:
                stop = out_of_room
                break
            ep.add_observation(result.observation, ids, expanded, result.images)
        return ep.build(stop, error)

    def _opening_ids(self, opening: str) -> list[int]:
        """The ids of ``reset``'s text (ValueError when it holds an image token: it brings no image)."""
        ids = self.tokenize(opening) if opening else []
        if self.expand is not None and self.expand.token_id in ids:
            raise ValueError(
                f"the environment's opening text holds the image token (id {self.expand.token_id}), "
                "but reset returns no images"
            )
        return ids

    async def _turn(
        self, item: PromptWorkItem, ep: _Builder, expanded_prompt: list[int], sampling: SamplingParams, name: str
    ) -> Sample:
        """One model turn after the episode so far: the engine gets the collapsed context and every image."""
        images = [*item.images, *ep.images]
        ((sample,),) = await self.engine.generate(
            [GenerationRequest(item.prompt_ids.tolist() + ep.context, sampling, images)]
        )
        if sample.finish_reason == "abort":
            raise RetryableError(f"the engine aborted {name}")
        if images:
            _check_expansion(sample, expanded_prompt + ep.token_ids, name)
        return sample

    async def _expand_observation(self, ep: _Builder, ids: list[int], images: list[Image]) -> list[int]:
        """An observation's ids as the model sees them; ValueError when the episode cannot go on with it
        (images for a text model, image tokens that do not match the images, or the model's last turn
        holding the image token)."""
        if self.expand is None:
            if images:
                raise ValueError(
                    f"the environment returned {len(images)} image(s) for a model that is not a vision-language model"
                )
            return ids
        token_id = self.expand.token_id
        if token_id in ep.samples[-1].token_ids:
            raise ValueError(
                f"the model wrote the image token (id {token_id}): the context would name an image that is not there"
            )
        if not images:
            check_image_count(ids, 0, token_id)
            return ids
        try:
            check_image_count(ids, len(images), token_id)
        except ValueError as e:
            raise ValueError(f"the observation: {e} (write one image token per returned image in its text)") from e
        return await asyncio.to_thread(self.expand, ids, images)


def _check_expansion(sample: Sample, expected: list[int], name: str) -> None:
    """The engine's expanded prompt must be what the episode records (the model's processor's)."""
    if sample.prompt_ids != expected:
        got = sample.prompt_ids or []
        at = next(
            (i for i, (a, b) in enumerate(zip(got, expected, strict=False)) if a != b), min(len(got), len(expected))
        )
        raise ValueError(
            f"{name}: the engine expanded the images into other tokens than the model's processor "
            f"(first difference at position {at} of {len(expected)})"
        )


async def _all(calls: list[Awaitable[T]]) -> list[T]:
    """Every result in order; when one fails, the others are cancelled (and waited for) first."""
    tasks = [asyncio.ensure_future(c) for c in calls]
    try:
        return list(await asyncio.gather(*tasks))
    except BaseException:
        await cancel_and_wait(tasks)
        raise
