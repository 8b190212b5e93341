"""Autoscaling rollout and reward replicas on the backlog of their input stream.

A tier's backlog is what its consumer group has not finished: entries not yet delivered (the
group's ``lag``) plus entries delivered and not acknowledged (``pending``), read with one
``XINFO GROUPS``. From it, every ``interval_s``, each autoscaled service gets a replica count:

    wanted = clamp(ceil(backlog / target_backlog), min_replicas, max_replicas)

    up:    wanted > current and scale_up_cooldown_s since the last change   -> wanted
    down:  wanted < current for scale_down_cooldown_s in a row, and
           scale_down_cooldown_s since the last change                    -> current - 1
           (so a backlog that stays low takes one replica away per cooldown)

Up jumps to what the backlog asks (a burst of prompts should not wait one cooldown per replica);
down removes one replica at a time, and only after the backlog stayed low for a whole cooldown:
a replica is removed by draining it (SIGTERM: it finishes or hands back what it holds), which costs
its start-up again if the backlog comes back. The counts are written where ``streamrl scale``
writes them (:func:`streamrl.ops.scaling.request_replicas`); the launcher's backend
(local processes or Ray actors) makes them so. On Kubernetes, KEDA plays this part (deploy/k8s).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

import redis as syncredis
from pydantic import Field, PositiveInt, model_validator

from streamrl.common.config import BaseConfig
from streamrl.common.streams import StreamNames

INPUTS = {"rollout": ("prompts", "rollout"), "reward": ("trajectories", "reward")}
"""Autoscalable services -> (their input stream's name in :class:`StreamNames`, their consumer group)."""


class ScalePolicy(BaseConfig):
    """How one service is scaled."""

    min_replicas: int = Field(1, ge=0)
    """Fewest replicas the autoscaler keeps."""
    max_replicas: PositiveInt = 4
    """Most replicas the autoscaler starts (at most ``up.max_replicas`` of the service)."""
    target_backlog: PositiveInt = 64
    """Backlog (undelivered + unacknowledged entries of its input) one replica is meant to carry."""
    scale_up_cooldown_s: float = Field(30.0, ge=0)
    """Least time between a change and a scale-up (s)."""
    scale_down_cooldown_s: float = Field(120.0, ge=0)
    """The backlog must want fewer replicas this long in a row, and this long after the last change (s)."""

    @model_validator(mode="after")
    def _check_bounds(self) -> ScalePolicy:
        if self.min_replicas > self.max_replicas:
            raise ValueError(f"min_replicas ({self.min_replicas}) is above max_replicas ({self.max_replicas})")
        return self


class AutoscaleConfig(BaseConfig):
    """The ``[autoscale]`` section of a recipe: which services are scaled on their backlog, and how."""

    enabled: bool = False
    """Scale the services of ``services`` on their backlog (False = replica counts change only by hand)."""
    interval_s: float = Field(5.0, gt=0)
    """How often the backlogs are read and the counts decided (s)."""
    services: dict[str, ScalePolicy] = {}
    """Service -> its policy; only ``rollout`` and ``reward`` (the coordinator and learner are one per run)."""

    @model_validator(mode="after")
    def _check_services(self) -> AutoscaleConfig:
        unknown = sorted(set(self.services) - set(INPUTS))
        if unknown:
            raise ValueError(f"autoscale.services: {unknown} cannot be autoscaled; only {sorted(INPUTS)} can")
        if self.enabled and not self.services:
            raise ValueError("autoscale.enabled is true but autoscale.services names no service")
        return self


@dataclass
class ScaleState:
    """What the decision remembers of one service between two looks."""

    last_change_s: float = -math.inf
    low_since_s: float | None = None
    """Since when the backlog has wanted fewer replicas than there are (None: it does not now)."""


def decide(policy: ScalePolicy, backlog: int, current: int, state: ScaleState, now_s: float) -> int:
    """The replica count for ``backlog`` given ``current`` replicas (pure, but for ``state``, which it updates)."""
    wanted = min(max(math.ceil(backlog / policy.target_backlog), policy.min_replicas), policy.max_replicas)
    since_change = now_s - state.last_change_s
    if wanted >= current:
        state.low_since_s = None
    elif state.low_since_s is None:
        state.low_since_s = now_s
    target = current
    if wanted > current and since_change >= policy.scale_up_cooldown_s:
        target = wanted
    elif (
        state.low_since_s is not None
        and now_s - state.low_since_s >= policy.scale_down_cooldown_s
        and since_change >= policy.scale_down_cooldown_s
    ):
        target = current - 1
    target = min(max(target, policy.min_replicas), policy.max_replicas)  # a count set outside the bounds comes back
    if target != current:
        state.last_change_s = now_s  # the low clock runs on: a backlog that stays low steps down every cooldown
    return target


def backlog(client: syncredis.Redis, names: StreamNames, service: str) -> int:
    """Entries of ``service``'s input its consumer group has not finished: ``lag + pending`` (0 before
    the stream or group exists). Redis < 7 reports no lag: then pending plus the entries after the
    group's last delivered id are counted by range."""
    stream_attr, group = INPUTS[service]
    stream = getattr(names, stream_attr)
    try:
        groups = client.xinfo_groups(stream)
    except syncredis.ResponseError:  # no such stream yet
        return 0
    for info in groups:
        name = info["name"].decode() if isinstance(info["name"], bytes) else info["name"]
        if name != group:
            continue
        lag = info.get("lag")
        if lag is None:  # not reported (Redis < 7, or a trimmed stream it cannot count)
            last = info["last-delivered-id"]
            lag = len(client.xrange(stream, min=b"(" + last if isinstance(last, bytes) else "(" + last, max="+") or [])
        return int(lag) + int(info["pending"])
    return int(client.xlen(stream))  # no group yet: every entry waits


@dataclass(frozen=True)
class Change:
    """One decided change of a service's replica count."""

    service: str
    old: int
    new: int
    backlog: int

    def __str__(self) -> str:
        return f"autoscale {self.service}: {self.old} -> {self.new} replicas (backlog {self.backlog})"


@dataclass
class Autoscaler:
    """The control loop's state: ``tick()`` as often as convenient; it looks every ``config.interval_s``."""

    config: AutoscaleConfig
    names: StreamNames
    states: dict[str, ScaleState] = field(default_factory=dict)
    next_tick_s: float = 0.0

    def tick(
        self,
        client: syncredis.Redis,
        current: dict[str, int],
        now_s: float | None = None,
    ) -> list[Change]:
        """The changes to make to the ``current`` counts (none between two intervals)."""
        now_s = time.monotonic() if now_s is None else now_s
        if not self.config.enabled or now_s < self.next_tick_s:
            return []
        self.next_tick_s = now_s + self.config.interval_s
        changes = []
        for service, policy in self.config.services.items():
            have = current.get(service, 0)
            waiting = backlog(client, self.names, service)
            target = decide(policy, waiting, have, self.states.setdefault(service, ScaleState()), now_s)
            if target != have:
                changes.append(Change(service, have, target, waiting))
        return changes
