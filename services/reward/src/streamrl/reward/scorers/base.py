"""The scorer protocol, its result type, and the checks every scorer's output goes through.

A scorer turns a batch of trajectories into one reward, one score and extra metrics per sample.
Its output is checked here (right length, finite numbers, rewards present): a malformed answer is
an error, never a silent 0. ``ScorerError`` carries the reason up to the consumer loop, which
retries the entry and finally dead-letters it with that reason. Both carry how many backend calls
the samples took (``attempts``): the reward service reports them per trajectory.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from streamrl.common.messages import Trajectory


class ScorerError(RuntimeError):
    """A scorer could not score a batch; the message says which scorer and why.

    ``sample_specific`` is True when particular samples may be the cause (a user function raised,
    a server rejected the payload), so scoring the samples one by one can isolate the bad ones.
    It is False when the backend is down or misconfigured, where splitting would only multiply
    the failing calls.
    """

    def __init__(self, message: str, *, sample_specific: bool = False, attempts: int = 1) -> None:
        super().__init__(message)
        self.sample_specific = sample_specific
        self.attempts = attempts
        """Calls to the backend made for these samples before giving up (1 = no retry)."""


class PermanentScorerError(ScorerError):
    """The backend refuses every sample for now, whichever they are: it refused the token (HTTP 401/403) or stayed
    unreachable past every retry. Retrying the entries would only dead-letter them all; the reward service pauses
    its intake instead and probes until the backend accepts again (:mod:`streamrl.reward.pause`)."""


@dataclass(frozen=True)
class ScorerResult:
    """Per-sample output of one scorer call.

    Example:
        ScorerResult(rewards=[1.0, 0.0], scores=[1.0, 0.0], extra=[{"format": 1.0}, {"format": 1.0}])
    """

    rewards: list[float]
    scores: list[float]
    extra: list[dict[str, float]]
    """One dict of extra metrics per sample."""
    attempts: list[int] | None = None
    """Per sample: calls to the backend it took (1 = first try); None = one each."""
    retries: int = 0
    """Backend calls retried to produce this result, over all of its requests (0 = none)."""

    def attempts_of(self, i: int) -> int:
        """Backend calls sample ``i`` took."""
        return 1 if self.attempts is None else self.attempts[i]

    @staticmethod
    def concat(parts: Sequence[ScorerResult]) -> ScorerResult:
        """Join the results of consecutive chunks of one batch."""
        return ScorerResult(
            rewards=[r for p in parts for r in p.rewards],
            scores=[s for p in parts for s in p.scores],
            extra=[e for p in parts for e in p.extra],
            attempts=[p.attempts_of(i) for p in parts for i in range(len(p.rewards))],
            retries=sum(p.retries for p in parts),
        )


class Scorer(Protocol):
    """What the reward service calls: one async call per micro-batch."""

    name: str

    async def score(self, batch: list[Trajectory]) -> ScorerResult: ...

    def metrics(self) -> dict[str, float]:
        """Counters since start, e.g. ``reward/http/retries``."""
        ...

    async def close(self) -> None: ...


@dataclass(frozen=True)
class ProtocolInputs:
    """The OpenRLHF reward inputs of a batch: full texts, prompts, labels."""

    queries: list[str]
    """Prompt text followed by response text (what OpenRLHF calls the query)."""
    prompts: list[str]
    labels: list[str]
    """Dataset labels; "" where a trajectory has none."""


def protocol_inputs(batch: Sequence[Trajectory]) -> ProtocolInputs:
    """Build the ``queries``/``prompts``/``labels`` lists of the OpenRLHF protocol from trajectories."""
    return ProtocolInputs(
        queries=[t.prompt_text + t.response_text for t in batch],
        prompts=[t.prompt_text for t in batch],
        labels=[t.label if t.label is not None else "" for t in batch],
    )


def _to_plain(value: Any) -> Any:
    """Tensors and arrays (anything with ``tolist``) become plain Python lists or numbers."""
    if hasattr(value, "detach"):  # torch tensor: drop autograd before converting
        value = value.detach()
    if hasattr(value, "tolist"):
        return value.tolist()
    return value


def _floats(value: Any, n: int, what: str) -> list[float]:
    value = _to_plain(value)
    if isinstance(value, int | float) and n == 1:
        value = [value]
    if not isinstance(value, list | tuple):
        raise ScorerError(f"{what} must be a list or tensor of {n} numbers, got {type(value).__name__}")
    if len(value) != n:
        raise ScorerError(f"{what} has {len(value)} values for a batch of {n} samples")
    out: list[float] = []
    for i, v in enumerate(value):
        if isinstance(v, list) and len(v) == 1:  # a [N, 1] tensor
            v = v[0]
        if not isinstance(v, int | float):  # bools count as 0/1
            raise ScorerError(f"{what}[{i}] is not a number: {v!r}")
        if not math.isfinite(v):
            raise ScorerError(f"{what}[{i}] is not finite: {v}")
        out.append(float(v))
    return out


def parse_reward_output(output: Any, n: int, source: str) -> ScorerResult:
    """Check and convert a ``{"rewards", "scores"?, "extra_logs"?}`` answer for a batch of ``n``.

    ``scores`` defaults to the rewards when absent. An ``extra_logs`` entry is either one value
    per sample or a single batch-level number (copied to every sample).
    """
    if not isinstance(output, Mapping):
        raise ScorerError(f"{source}: expected a dict with 'rewards', got {type(output).__name__}")
    if output.get("rewards") is None:
        raise ScorerError(f"{source}: answer has no 'rewards' (keys: {sorted(output)})")
    rewards = _floats(output["rewards"], n, f"{source}: rewards")
    scores = rewards if output.get("scores") is None else _floats(output["scores"], n, f"{source}: scores")
    extra_logs = output.get("extra_logs") or {}
    if not isinstance(extra_logs, Mapping):
        raise ScorerError(f"{source}: extra_logs must be a dict, got {type(extra_logs).__name__}")
    extra: list[dict[str, float]] = [{} for _ in range(n)]
    for key, value in extra_logs.items():
        plain = _to_plain(value)
        if isinstance(plain, int | float):
            plain = [plain] * n
        for sample, v in zip(extra, _floats(plain, n, f"{source}: extra_logs[{key!r}]"), strict=True):
            sample[str(key)] = v
    return ScorerResult(rewards=rewards, scores=scores, extra=extra)
