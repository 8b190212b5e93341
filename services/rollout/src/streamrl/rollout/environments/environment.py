"""Multi-turn environments: the plug-in interface, its loader, and calling it safely.

An environment is a class named by ``rollout.environment.path``: a file (``/path/env.py[:Class]``)
or a module (``pkg.mod[:Class]``), the class name ``Environment`` by default - found the way
reward functions are. Each episode gets its own instance::

    env = Class(**options)                            # rollout.environment.options
    text = env.reset(prompt, label, metadata)         # shown before the first turn, or None
    result = env.step(response_text)                  # after every model turn: a StepResult
    env.close()                                       # optional: when the episode ends

Any of them may be ``async def``; a plain one runs in a worker thread, so it never blocks the
rollout worker's event loop. ``step`` returns a :class:`StepResult`, or a mapping with the same
keys, so a plug-in file needs no streamrl import. With a vision-language policy a step may also
return images (``images``: PIL images or streamrl ``Image`` messages), each shown where the
observation's text holds an image token; a text-only plug-in never mentions them. The interface
follows OpenRLHF's agent API in spirit (reset / step with the environment's feedback text, a
per-step reward and a done flag), with typed results instead of dicts.

What a plug-in does wrong - raising, overrunning ``step_timeout_s``, returning a malformed result -
becomes an :class:`EnvironmentCallError` naming the call: the episode runner
(:mod:`streamrl.rollout.environments.episode`) ends that episode with stop reason ``error``.
"""

from __future__ import annotations

import asyncio
import inspect
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

import msgspec

from streamrl.common.aio import timeout
from streamrl.common.messages import Image
from streamrl.common.plugins import import_target, split_spec
from streamrl.rollout.vision import to_image

DEFAULT_CLASS_NAME = "Environment"


@dataclass(frozen=True, slots=True)
class StepResult:
    """What an environment answers to one model turn.

    Example:
        StepResult(observation="<result>19</result>", reward=0.0, done=False)
    """

    observation: str = ""
    """Text appended after the turn as environment tokens (loss-masked); ignored when ``done``."""
    reward: float = 0.0
    """The environment's reward for this turn (``Turn.reward``); the reward tier adds the final one."""
    done: bool = False
    """True ends the episode (stop reason ``done``)."""
    info: dict[str, Any] = field(default_factory=dict)
    """Anything else, kept in the trajectory's ``metadata["env_info"]`` (one dict per step): plain
    values only (numbers, strings, lists, dicts), as the message goes over msgpack."""
    images: list[Any] = field(default_factory=list)
    """Images shown with ``observation`` (vision-language policies): PIL images (kept as PNG) or
    streamrl ``Image`` messages with inline bytes; ``observation`` holds the model's image token (e.g.
    ``<image>``) once per image, in order. Checked results hold ``Image`` messages."""


class Environment(Protocol):
    """What a plug-in class provides (``async def`` versions of these methods are accepted too)."""

    def reset(self, prompt: str, label: str | None, metadata: dict[str, Any]) -> str | None:
        """Start an episode for ``prompt``; the text to show before the first turn, or None."""
        ...

    def step(self, response: str) -> StepResult | Mapping[str, Any]:
        """React to the model's turn ``response`` (its text)."""
        ...


class EnvironmentCallError(Exception):
    """An environment raised, overran its deadline or returned a malformed result."""


@dataclass(frozen=True)
class EnvironmentFactory:
    """Builds one environment per episode: the loaded class and its constructor options."""

    cls: type
    options: dict[str, Any]

    def __call__(self) -> Any:
        return self.cls(**self.options)


def load_environment(spec: str, options: Mapping[str, Any] | None = None) -> EnvironmentFactory:
    """Import the class named by ``spec`` and check it: ``reset`` and ``step`` methods, a constructor
    that takes ``options``. Raises ValueError naming what is missing."""
    target, name = split_spec(spec, DEFAULT_CLASS_NAME)
    module = import_target(target, "rollout.environment.path:")
    cls = getattr(module, name, None)
    if not inspect.isclass(cls):
        what = "nothing" if cls is None else f"a {type(cls).__name__}"
        raise ValueError(f"rollout.environment.path: {target}:{name} is {what}, not a class")
    missing = [m for m in ("reset", "step") if not callable(getattr(cls, m, None))]
    if missing:
        raise ValueError(f"rollout.environment.path: {target}:{name} has no {' or '.join(missing)} method")
    options = dict(options or {})
    try:
        inspect.signature(cls).bind(**options)
    except TypeError as e:
        raise ValueError(
            f"rollout.environment.options {sorted(options)} do not fit {name}{inspect.signature(cls)}: {e}"
        ) from e
    return EnvironmentFactory(cls, options)


async def call(method: Any, *args: Any, timeout_s: float, what: str) -> Any:
    """``method(*args)`` awaited (async) or in a worker thread (sync), within ``timeout_s``.

    Raises EnvironmentCallError naming ``what`` when it raises or overruns (a sync method overrunning
    keeps running in its thread: the plug-in should bound its own work).
    """
    try:
        async with timeout(timeout_s):
            if inspect.iscoroutinefunction(method):
                return await method(*args)
            result = await asyncio.to_thread(method, *args)
            if inspect.isawaitable(result):  # a sync wrapper that returns a coroutine
                result = await result
            return result
    except TimeoutError as e:
        raise EnvironmentCallError(f"{what} timed out after {timeout_s} s") from e
    except Exception as e:  # the plug-in's own error, re-raised as the domain error
        raise EnvironmentCallError(f"{what} raised {type(e).__name__}: {e}") from e


def as_step_result(value: Any) -> StepResult:
    """A ``step`` return value checked and normalised; EnvironmentCallError when it is malformed."""
    if isinstance(value, Mapping):
        unknown = set(value) - {"observation", "reward", "done", "info", "images"}
        if unknown:
            raise EnvironmentCallError(f"step returned unknown keys {sorted(unknown)}")
        value = StepResult(**value)
    if not isinstance(value, StepResult):
        raise EnvironmentCallError(f"step returned a {type(value).__name__}, not a StepResult or a mapping")
    observation = "" if value.observation is None else value.observation
    if not isinstance(observation, str):
        raise EnvironmentCallError(f"step returned an observation of type {type(observation).__name__}, not str")
    if isinstance(value.reward, bool) or not isinstance(value.reward, int | float) or not math.isfinite(value.reward):
        raise EnvironmentCallError(f"step returned reward {value.reward!r}, not a finite number")
    if not isinstance(value.done, bool):
        raise EnvironmentCallError(f"step returned done={value.done!r}, not a bool")
    if not isinstance(value.info, dict):
        raise EnvironmentCallError(f"step returned info of type {type(value.info).__name__}, not dict")
    try:
        msgspec.msgpack.encode(value.info)
    except (TypeError, msgspec.EncodeError) as e:
        raise EnvironmentCallError(f"step returned info that cannot go in a message: {e}") from e
    return StepResult(observation, float(value.reward), value.done, value.info, _images(value.images))


def _images(images: Any) -> list[Image]:
    """A step's images as messages; EnvironmentCallError naming a bad one."""
    if not isinstance(images, list | tuple):
        raise EnvironmentCallError(f"step returned images of type {type(images).__name__}, not a list")
    try:
        return [to_image(image) for image in images]
    except ValueError as e:
        raise EnvironmentCallError(f"step returned a bad image: {e}") from e
