"""Scorer calling a user Python reward function (OpenRLHF-compatible plug-in).

The function is loaded from a file (``/path/rewards.py[:func]``) or a module
(``pkg.mod[:func]``); the default name is ``reward_func``. It is called once per micro-batch as
``reward_func(queries, prompts, labels)`` (plus ``metadata=[...]`` when it accepts that keyword
or ``**kwargs``) and returns ``{"rewards", "scores", "extra_logs"}`` as lists or tensors.
An ``async def`` function is awaited; a plain one runs on threads of the scorer's own
(:class:`streamrl.reward.threads.ThreadCaller`, ``max_threads`` at most) so it never blocks the event
loop, and its time-out counts from the moment its thread starts.

A synchronous call that times out cannot be stopped: its thread runs on until the function returns.
So a sample whose call *alone* timed out is not started again while that call still runs - its later
deliveries fail at once with the reason, and the consumer loop dead-letters it after
``consumer.max_deliveries`` - instead of taking a new thread each time (a batch that timed out is
retried sample by sample to find the culprit). When every thread is held by such calls the scorer
can score nothing more: ``on_exhausted`` is told (the reward worker then exits non-zero for its
orchestrator to restart it), and calls still waiting are cancelled, their entries left pending.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import time
from collections.abc import Callable
from typing import Any

from streamrl.common.aio import timeout
from streamrl.common.messages import Trajectory
from streamrl.common.plugins import import_target, split_spec
from streamrl.reward.config import FunctionScorerConfig
from streamrl.reward.scorers.base import (
    ScorerError,
    ScorerResult,
    parse_reward_output,
    protocol_inputs,
)
from streamrl.reward.threads import CallTimeoutError, ThreadCaller, ThreadsExhaustedError

logger = logging.getLogger(__name__)

DEFAULT_FUNC_NAME = "reward_func"


def load_reward_function(spec: str) -> Callable[..., Any]:
    """Import the function named by ``spec`` and check it can be called with (queries, prompts, labels).

    Raises ValueError naming the file, module or function when any of them is missing or has the
    wrong signature, TypeError when the name is not a function.
    """
    target, func_name = split_spec(spec, DEFAULT_FUNC_NAME)
    module = import_target(target, "reward function")
    func = getattr(module, func_name, None)
    if func is None:
        raise ValueError(f"{target} has no function {func_name!r}")
    if not callable(func):
        raise TypeError(f"{target}:{func_name} is a {type(func).__name__}, not a function")
    try:
        inspect.signature(func).bind([], [], [], **({"metadata": []} if _accepts_metadata(func) else {}))
    except TypeError as e:
        raise ValueError(
            f"{target}:{func_name} must accept (queries, prompts, labels, **kwargs); "
            f"its signature is {func_name}{inspect.signature(func)}: {e}"
        ) from e
    return func  # type: ignore[no-any-return]


def _accepts_metadata(func: Callable[..., Any]) -> bool:
    params = inspect.signature(func).parameters.values()
    return any(p.kind is p.VAR_KEYWORD or (p.name == "metadata" and p.kind is not p.POSITIONAL_ONLY) for p in params)


class FunctionScorer:
    """Calls a user reward function on each micro-batch."""

    reads_tokens = False

    def __init__(
        self,
        config: FunctionScorerConfig,
        func: Callable[..., Any] | None = None,
        on_exhausted: Callable[[str], None] | None = None,
    ) -> None:
        self.name = config.name
        self._config = config
        self._func = func if func is not None else load_reward_function(config.path)
        self._is_async = inspect.iscoroutinefunction(self._func)
        self._pass_metadata = _accepts_metadata(self._func)
        self._source = f"reward function {config.path!r} (scorer {self.name!r})"
        self._threads = ThreadCaller(
            config.max_threads,
            f"reward-{self.name}",
            on_exhausted=lambda why: on_exhausted(f"{self._source}: {why}") if on_exhausted else None,
        )
        self._stuck: dict[str, float] = {}
        """Trajectory id -> when its call alone timed out, while that call still runs."""
        self._calls = 0
        self._failures = 0

    async def _call(self, batch: list[Trajectory]) -> Any:
        inputs = protocol_inputs(batch)
        args = (inputs.queries, inputs.prompts, inputs.labels)
        kwargs = {"metadata": [dict(t.metadata) for t in batch]} if self._pass_metadata else {}
        timeout_s = self._config.timeout_s
        if self._is_async:
            async with timeout(timeout_s):
                return await self._func(*args, **kwargs)
        if self._threads.exhausted is not None:  # the worker is stopping: leave the entries pending
            raise asyncio.CancelledError(self._threads.exhausted)
        try:
            result = await self._threads.call(timeout_s, self._func, *args, **kwargs)
        except CallTimeoutError as e:
            if len(batch) == 1:  # this sample is the culprit: no new thread for it while this one runs
                sample = batch[0].id
                self._stuck[sample] = time.monotonic()
                e.returned.add_done_callback(lambda _: self._stuck.pop(sample, None))
            held = f"{self._threads.num_overdue} of {self._threads.max_threads} threads held by calls that timed out"
            raise ScorerError(
                f"{self._source} timed out after {timeout_s:g} s; its thread runs on ({held})", sample_specific=True
            ) from e
        except ThreadsExhaustedError as e:  # exhausted while this call waited for a thread
            raise asyncio.CancelledError(str(e)) from None
        if inspect.isawaitable(result):  # a sync wrapper that returns a coroutine
            async with timeout(timeout_s):
                result = await result
        return result

    async def score(self, batch: list[Trajectory]) -> ScorerResult:
        self._calls += 1
        try:
            return await self._score(batch)
        except ScorerError:
            self._failures += 1
            raise

    async def _score(self, batch: list[Trajectory]) -> ScorerResult:
        source = self._source
        stuck = [t.id for t in batch if t.id in self._stuck]
        if stuck:
            ago = time.monotonic() - self._stuck[stuck[0]]
            raise ScorerError(
                f"{source} timed out on {stuck[0]} {ago:.1f} s ago and is still running: not started again "
                "while it runs (it would only hold another thread)",
                sample_specific=True,
            )
        try:
            output = await self._call(batch)
        except ScorerError:
            raise
        except TimeoutError as e:
            raise ScorerError(f"{source} timed out after {self._config.timeout_s:g} s", sample_specific=True) from e
        except Exception as e:
            raise ScorerError(f"{source} raised {type(e).__name__}: {e}", sample_specific=True) from e
        return parse_reward_output(output, len(batch), source)

    def metrics(self) -> dict[str, float]:
        return {
            "reward/function/calls": float(self._calls),
            "reward/function/failures": float(self._failures),
        }

    async def close(self) -> None:
        return None
