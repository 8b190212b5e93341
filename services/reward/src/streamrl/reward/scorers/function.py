"""Scorer calling a user Python reward function (OpenRLHF-compatible plug-in).

The function is loaded from a file (``/path/rewards.py[:func]``) or a module
(``pkg.mod[:func]``); the default name is ``reward_func``. It is called once per micro-batch as
``reward_func(queries, prompts, labels)`` (plus ``metadata=[...]`` when it accepts that keyword
or ``**kwargs``) and returns ``{"rewards", "scores", "extra_logs"}`` as lists or tensors.
An ``async def`` function is awaited; a plain one runs in a worker thread so it never blocks
the event loop.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
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

    def __init__(self, config: FunctionScorerConfig, func: Callable[..., Any] | None = None) -> None:
        self.name = config.name
        self._config = config
        self._func = func if func is not None else load_reward_function(config.path)
        self._is_async = inspect.iscoroutinefunction(self._func)
        self._pass_metadata = _accepts_metadata(self._func)
        self._calls = 0
        self._failures = 0

    async def _call(self, batch: list[Trajectory]) -> Any:
        inputs = protocol_inputs(batch)
        args = (inputs.queries, inputs.prompts, inputs.labels)
        kwargs = {"metadata": [dict(t.metadata) for t in batch]} if self._pass_metadata else {}
        if self._is_async:
            return await self._func(*args, **kwargs)
        result = await asyncio.to_thread(self._func, *args, **kwargs)
        if inspect.isawaitable(result):  # a sync wrapper that returns a coroutine
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
        source = f"reward function {self._config.path!r} (scorer {self.name!r})"
        try:
            async with timeout(self._config.timeout_s):
                output = await self._call(batch)
        except TimeoutError as e:
            raise ScorerError(
                f"{source} timed out after {self._config.timeout_s} s",
                sample_specific=True,
            ) from e
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
