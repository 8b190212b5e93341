"""One agent conversation, recorded token-exactly as it goes (the OpenAI endpoint's bookkeeping).

An agent sends each request with the whole conversation so far (the OpenAI convention). The
record holds what the engine actually saw and produced, never a re-tokenization of earlier text::

    request 0: prompt = tokens(rendered_0)             # the chat template applied (or the raw prompt)
               reply  = engine(prompt)                 # model turn: loss mask 1, behaviour log-probs
    request k: rendered_k must start with text(record)  # record = prompt + everything since
               extra  = tokens(rendered_k[len(text(record)):])   # tool results, user turns: mask 0
               reply  = engine(prompt + record + extra)

``text(record)`` is the first request's rendered text followed by the text of every span appended
since (the reply tokens decoded with special tokens kept, the extra text as sent), so a later
request extends the record exactly when the agent sent back the replies it got and only added
messages after them. A request that does not (the agent rewrote or dropped history, or a chat
template renders an earlier reply differently from the tokens generated) is refused with
:class:`HistoryRewrittenError`; the conversation is left as it was and can go on with a request that
does extend it. Why refuse rather than start a new segment: one trajectory has one prompt, and a
second segment would be a different sample of the group that the coordinator did not ask for.

When the agent reports its reward, the record becomes an :class:`AgentEpisode` (an
:class:`streamrl.rollout.environments.episode.Episode` with the conversation's own prompt and the reward).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import msgspec

from streamrl.common.messages import Turn
from streamrl.rollout.engines.engine import Sample, turn_versions
from streamrl.rollout.environments.episode import Episode


class HistoryRewrittenError(ValueError):
    """A request's prompt does not extend the conversation recorded so far."""


class ContextExhaustedError(ValueError):
    """The conversation has no room left for another reply."""


@dataclass(frozen=True, slots=True)
class AgentEpisode(Episode):
    """A finished agent conversation: the episode after its prompt, the prompt, and the agent's reward."""

    prompt_ids: list[int] = field(default_factory=list)
    """[P] token ids of the first request's prompt as the engine saw it (chat template applied)."""
    prompt_text: str = ""
    """The first request's prompt as text."""
    reward: float = 0.0
    """The reward the agent reported (``metadata["agent_reward"]`` of the trajectory)."""


@dataclass(frozen=True, slots=True)
class Plan:
    """The prompt of one request, before the engine answers it."""

    extra_text: str
    """Text the request adds after the record (the first request: its whole prompt)."""
    extra_ids: list[int]
    """``extra_text`` as token ids (environment tokens, or the prompt)."""
    prompt_ids: list[int]
    """[P] what the engine is asked to continue: prompt + record + ``extra_ids``."""


@dataclass
class Conversation:
    """The record of one conversation (see the module docstring)."""

    prompt_ids: list[int] = field(default_factory=list)
    prompt_text: str = ""
    text: str = ""
    """The first prompt's text and every span appended since."""
    token_ids: list[int] = field(default_factory=list)
    """[T] everything after the prompt: replies and the agent's extra tokens."""
    logprobs: list[float] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)
    turns: list[Turn] = field(default_factory=list)
    samples: list[Sample] = field(default_factory=list)

    @property
    def started(self) -> bool:
        return bool(self.prompt_ids)

    def plan(self, rendered: str, encode: Callable[[str], list[int]]) -> Plan:
        """The prompt of a request whose conversation renders to ``rendered`` (HistoryRewrittenError if it
        does not extend the record)."""
        if not self.started:
            ids = encode(rendered)
            if not ids:
                raise ValueError("the prompt is empty")
            return Plan(extra_text=rendered, extra_ids=ids, prompt_ids=ids)
        if not rendered.startswith(self.text):
            at = next((i for i, (a, b) in enumerate(zip(rendered, self.text, strict=False)) if a != b), None)
            where = f"at character {at}" if at is not None else f"after character {len(rendered)} (it is shorter)"
            raise HistoryRewrittenError(
                f"the conversation differs from the one recorded {where}: send back every reply as it was "
                "returned and only add messages after it (docs/agents.md)"
            )
        extra_text = rendered[len(self.text) :]
        extra_ids = encode(extra_text) if extra_text else []
        return Plan(extra_text=extra_text, extra_ids=extra_ids, prompt_ids=self.prompt_ids + self.token_ids + extra_ids)

    def room(self, max_tokens: int, max_model_len: int, plan: Plan) -> int:
        """Tokens a reply to ``plan`` may have (ContextExhaustedError when none)."""
        prompt_len = len(plan.prompt_ids) if not self.started else len(self.prompt_ids)
        room = min(prompt_len + max_tokens, max_model_len) - len(plan.prompt_ids)
        if room < 1:
            raise ContextExhaustedError(
                f"the conversation holds {len(plan.prompt_ids)} tokens: no room for a reply "
                f"(rollout.agent.max_tokens={max_tokens} after a prompt of {prompt_len}, "
                f"rollout.engine.max_model_len={max_model_len})"
            )
        return room

    def record(self, plan: Plan, sample: Sample, reply_text: str) -> None:
        """Append ``plan``'s extra tokens (environment) and the engine's ``sample`` (a model turn)
        whose tokens decode to ``reply_text``."""
        if not self.started:
            self.prompt_ids, self.prompt_text = list(plan.extra_ids), plan.extra_text
        else:
            self.token_ids += plan.extra_ids
            self.logprobs += [0.0] * len(plan.extra_ids)
            self.loss_mask += [0] * len(plan.extra_ids)
        self.text += plan.extra_text
        start = len(self.token_ids)
        self.token_ids += sample.token_ids
        self.logprobs += sample.logprobs
        self.loss_mask += [1] * len(sample.token_ids)
        self.text += reply_text
        self.turns.append(Turn(start=start, end=len(self.token_ids), policy_version=sample.version_start))
        self.samples.append(sample)

    def finish(self, reward: float, info: dict[str, Any], turn_rewards: list[float] | None = None) -> AgentEpisode:
        """The conversation as a finished episode with the agent's ``reward``, and ``turn_rewards`` (one
        per model turn, in order) when the agent gives them: they become the turns' rewards."""
        if not self.samples:
            raise ValueError("the conversation has no reply yet: a trajectory needs at least one model turn")
        turns = list(self.turns)
        if turn_rewards is not None:
            if len(turn_rewards) != len(turns):
                raise ValueError(
                    f"turn_rewards has {len(turn_rewards)} values but the conversation has "
                    f"{len(turns)} model turns (one per reply)"
                )
            turns = [msgspec.structs.replace(t, reward=float(r)) for t, r in zip(turns, turn_rewards, strict=True)]
        first, last = self.samples[0], self.samples[-1]
        return AgentEpisode(
            token_ids=list(self.token_ids),
            logprobs=list(self.logprobs),
            loss_mask=list(self.loss_mask),
            text=self.text[len(self.prompt_text) :],
            turns=turns,
            stop_reason="done",
            finish_reason=last.finish_reason,
            version_start=first.version_start,
            version_end=last.version_end,
            versions=turn_versions(
                ((t.start, s) for t, s in zip(self.turns, self.samples, strict=True)), len(self.token_ids)
            ),
            env_infos=[info] if info else [],
            prompt_ids=list(self.prompt_ids),
            prompt_text=self.prompt_text,
            reward=reward,
        )
