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
from streamrl.common.messages import PromptWorkItem, Turn
from streamrl.rollout.config import EnvironmentConfig
from streamrl.rollout.engine import Engine, FinishReason, GenerationRequest, Sample
from streamrl.rollout.environments import EnvironmentCallError, as_step_result, call

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
    env_infos: list[dict[str, Any]] = field(default_factory=list)
    """``StepResult.info`` of each step."""
    env_error: str | None = None
    """Why the environment failed (stop reason ``error``)."""

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
    logprobs: list[float] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)
    texts: list[str] = field(default_factory=list)
    turns: list[Turn] = field(default_factory=list)
    samples: list[Sample] = field(default_factory=list)
    infos: list[dict[str, Any]] = field(default_factory=list)

    def add_turn(self, sample: Sample) -> None:
        start = len(self.token_ids)
        self.token_ids += sample.token_ids
        self.logprobs += sample.logprobs
        self.loss_mask += [1] * len(sample.token_ids)
        self.texts.append(sample.text)
        self.turns.append(Turn(start=start, end=len(self.token_ids), policy_version=sample.version_start))
        self.samples.append(sample)

    def add_observation(self, text: str, token_ids: list[int]) -> None:
        self.token_ids += token_ids
        self.logprobs += [0.0] * len(token_ids)
        self.loss_mask += [0] * len(token_ids)
        self.texts.append(text)

    def reward_last_turn(self, reward: float) -> None:
        self.turns[-1] = msgspec.structs.replace(self.turns[-1], reward=reward)

    def build(self, stop_reason: StopReason, error: str | None) -> Episode:
        first, last = self.samples[0], self.samples[-1]
        return Episode(
            token_ids=self.token_ids, logprobs=self.logprobs, loss_mask=self.loss_mask, text="".join(self.texts),
            turns=self.turns, stop_reason=stop_reason, finish_reason=last.finish_reason,
            version_start=first.version_start, version_end=last.version_end, env_infos=self.infos, env_error=error,
        )  # fmt: skip


class EpisodeRunner:
    """Runs the episodes of a prompt (see the module docstring)."""

    def __init__(
        self,
        engine: Engine,
        make_environment: Callable[[], Any],
        tokenize: Tokenize,
        config: EnvironmentConfig,
        max_model_len: int,
    ) -> None:
        self.engine = engine
        self.make_environment = make_environment
        self.tokenize = tokenize
        self.cfg = config
        self.max_model_len = max_model_len

    async def run_group(self, item: PromptWorkItem) -> list[Episode]:
        """``item.sampling.n`` episodes of ``item``, in sample order."""
        try:
            envs = [self.make_environment() for _ in range(item.sampling.n)]
        except Exception as e:  # the plug-in's constructor: re-raised as the domain error
            raise EnvironmentCallError(f"creating the environment raised {type(e).__name__}: {e}") from e
        try:
            openings = await _all([self._reset(env, item) for env in envs])
            return await _all(
                [self._run(env, item, j, text) for j, (env, text) in enumerate(zip(envs, openings, strict=True))]
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

    async def _run(self, env: Any, item: PromptWorkItem, j: int, opening: str) -> Episode:
        prompt, sampling, cfg = item.prompt_ids.tolist(), item.sampling, self.cfg
        room_in_context = self.max_model_len - len(prompt)
        budget = min(cfg.max_tokens, room_in_context)  # tokens after the prompt this episode may hold
        out_of_room: StopReason = "max_tokens" if cfg.max_tokens <= room_in_context else "length"
        ep = _Builder()
        opening_ids = self.tokenize(opening) if opening else []
        if len(opening_ids) >= budget:
            raise ValueError(
                f"a prompt of {len(prompt)} tokens and the environment's opening text ({len(opening_ids)} tokens) "
                f"leave no room for a turn (rollout.environment.max_tokens={cfg.max_tokens}, "
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
            ((sample,),) = await self.engine.generate([GenerationRequest(prompt + ep.token_ids, turn_sampling)])
            if sample.finish_reason == "abort":
                raise RetryableError(f"the engine aborted turn {k} of {item.id}/{j}")
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
            if len(ep.token_ids) + len(ids) >= budget:
                stop = out_of_room
                break
            ep.add_observation(result.observation, ids)
        return ep.build(stop, error)


async def _all(calls: list[Awaitable[T]]) -> list[T]:
    """Every result in order; when one fails, the others are cancelled (and waited for) first."""
    tasks = [asyncio.ensure_future(c) for c in calls]
    try:
        return list(await asyncio.gather(*tasks))
    except BaseException:
        await cancel_and_wait(tasks)
        raise
