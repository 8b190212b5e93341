"""The agent gateway: prompts from the bus become tasks that external agents take and converse on.

The rollout service hands each PromptWorkItem to :meth:`AgentGateway.run_group` as it would to the
episode runner. The gateway offers the item's ``n`` samples as tasks; an agent takes one
(:meth:`take`), gets a conversation id and the prompt, label and metadata, and talks to the model
through the OpenAI endpoint (:mod:`streamrl.rollout.agents.openai_server`); every request is recorded
(:mod:`streamrl.rollout.agents.conversation`). When the agent reports its reward (:meth:`finish`), the
sample is done; when all ``n`` are, ``run_group`` returns them and the service publishes them as
one group of trajectories - with the work item's ack, de-duplicated by its id, as for any other
prompt. The coordinator's issuing, staleness, admission and grouping see nothing new.

A conversation with no request for ``idle_timeout_s`` is dropped with a log line and its sample is
offered again (a new conversation id; the old one answers 404). An agent may also give a task
back (:meth:`abandon`). If the worker stops, the work item stays pending and is redelivered, so
conversations then in flight are lost, never half-trained.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import msgspec

from streamrl.common.aio import timeout
from streamrl.common.errors import RetryableError
from streamrl.common.messages import PromptWorkItem
from streamrl.rollout.agents.config import AgentEndpointConfig
from streamrl.rollout.agents.conversation import AgentEpisode, Conversation, Plan
from streamrl.rollout.engines.engine import Engine, GenerationRequest, Sample
from streamrl.rollout.environments.episode import Episode

logger = logging.getLogger(__name__)


class UnknownConversationError(KeyError):
    """No live conversation has this id (finished, timed out, given back, or never issued)."""


class ConversationBusyError(ValueError):
    """A request arrived while another one of the same conversation is being answered."""


@dataclass
class _Slot:
    """Sample ``index`` of ``item``; ``done`` gets its episode."""

    item: PromptWorkItem
    index: int
    done: asyncio.Future[AgentEpisode]


@dataclass
class Live:
    """A conversation an agent is having now."""

    id: str
    slot: _Slot
    conversation: Conversation = field(default_factory=Conversation)
    last_active: float = field(default_factory=time.monotonic)
    busy: bool = False


@dataclass(frozen=True, slots=True)
class Reply:
    """One answered request."""

    plan: Plan
    sample: Sample
    text: str
    """The reply's tokens decoded with special tokens kept (what the record holds)."""


class AgentGateway:
    """See the module docstring."""

    def __init__(
        self,
        engine: Engine,
        decode: Callable[[list[int]], str],
        encode: Callable[[str], list[int]],
        config: AgentEndpointConfig,
        max_model_len: int,
    ) -> None:
        self.engine = engine
        self.decode = decode
        self.encode = encode
        self.cfg = config
        self.max_model_len = max_model_len
        self.offered: asyncio.Queue[_Slot] = asyncio.Queue()
        self.live: dict[str, Live] = {}

    async def run_group(self, item: PromptWorkItem) -> list[Episode]:
        """The ``item.sampling.n`` conversations of ``item``, in sample order, once agents finished them."""
        loop = asyncio.get_running_loop()
        slots = [_Slot(item, j, loop.create_future()) for j in range(item.sampling.n)]
        for slot in slots:
            self.offered.put_nowait(slot)
        try:
            return list(await asyncio.gather(*(slot.done for slot in slots)))
        finally:  # cancelled (stopping): the item is redelivered; its conversations end here
            for slot in slots:
                slot.done.cancel()
            for cid in [cid for cid, live in self.live.items() if live.slot in slots]:
                del self.live[cid]

    async def take(self, wait_s: float) -> Live | None:
        """A new conversation on the next offered sample, waiting up to ``wait_s``; None if none came."""
        deadline = time.monotonic() + wait_s
        while True:
            try:
                slot = self.offered.get_nowait()
            except asyncio.QueueEmpty:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return None
                try:
                    async with timeout(remaining):
                        slot = await self.offered.get()
                except TimeoutError:
                    return None
            if not slot.done.done():  # a group withdrawn while its samples waited
                live = Live(id=uuid.uuid4().hex, slot=slot)
                self.live[live.id] = live
                return live

    def get(self, conversation_id: str) -> Live:
        live = self.live.get(conversation_id)
        if live is None:
            raise UnknownConversationError(conversation_id)
        return live

    async def reply(self, live: Live, rendered: str, max_new_tokens: int | None, stop: list[str] | None) -> Reply:
        """Answer one request of ``live`` whose conversation renders to ``rendered``, and record it."""
        if live.busy:
            raise ConversationBusyError(f"conversation {live.id} is answering another request")
        conversation, item = live.conversation, live.slot.item
        plan = conversation.plan(rendered, self.encode)
        room = conversation.room(self.cfg.max_tokens, self.max_model_len, plan)
        base = item.sampling
        seed = None if base.seed is None else base.seed + live.slot.index + len(conversation.samples) * base.n
        sampling = msgspec.structs.replace(
            base,
            n=1,
            seed=seed,
            max_new_tokens=min(base.max_new_tokens, room, max_new_tokens or room),
            stop=base.stop if stop is None else stop,
        )
        live.busy = True
        try:
            ((sample,),) = await self.engine.generate([GenerationRequest(plan.prompt_ids, sampling)])
        finally:
            live.busy = False
            live.last_active = time.monotonic()
        if sample.finish_reason == "abort":
            raise RetryableError(f"the engine aborted a reply of conversation {live.id}")
        text = self.decode(sample.token_ids)
        if live.id in self.live:  # not dropped while the engine answered (its group withdrawn)
            conversation.record(plan, sample, text)
        return Reply(plan=plan, sample=sample, text=text)

    def finish(
        self, live: Live, reward: float, info: dict[str, Any], turn_rewards: list[float] | None = None
    ) -> AgentEpisode:
        """End ``live`` with the agent's ``reward`` (and per-turn rewards, if given): its sample is done."""
        if live.busy:
            raise ConversationBusyError(f"conversation {live.id} is answering a request")
        episode = live.conversation.finish(reward, info, turn_rewards)
        del self.live[live.id]
        if not live.slot.done.done():
            live.slot.done.set_result(episode)
        return episode

    def abandon(self, live: Live, why: str) -> None:
        """Drop ``live`` and offer its sample again."""
        self.live.pop(live.id, None)
        if not live.slot.done.done():
            self.offered.put_nowait(live.slot)
        item = live.slot.item
        logger.warning(
            "agent conversation %s on %s/%d dropped (%s): the sample is offered again",
            live.id,
            item.id,
            live.slot.index,
            why,
        )

    async def reap_forever(self) -> None:
        """Drop conversations idle longer than ``idle_timeout_s`` (see the module docstring)."""
        period_s = min(1.0, self.cfg.idle_timeout_s / 4)
        while True:
            await asyncio.sleep(period_s)
            now = time.monotonic()
            for live in list(self.live.values()):
                if not live.busy and now - live.last_active > self.cfg.idle_timeout_s:
                    self.abandon(live, f"no request for {self.cfg.idle_timeout_s:g} s")
