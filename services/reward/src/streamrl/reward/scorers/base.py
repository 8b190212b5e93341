"""The scorer protocol, its result type, and the checks every scorer's output goes through.

A scorer turns a batch of trajectories into one reward, one score and extra metrics per sample.
Its output is checked here, never silently made 0, at two depths:

* the answer as a whole (a dict with ``rewards``, lists, one value per sample): a malformed answer
  raises ``ScorerError``, which fails the call; a list of the wrong length is marked sample-specific,
  so the reward service's batcher scores the samples one by one and only the one that breaks it fails;
* each sample's values (a number, finite): :meth:`ScorerResult.problem` says why one sample's are
  unusable, and the reward service fails that sample alone (or scores it as ``reward.invalid_value``).

``ScorerError`` carries the reason up to the consumer loop, which retries the entry and finally
dead-letters it with that reason. Both carry how many backend calls the samples took (``attempts``):
the reward service reports them per trajectory.
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
    invalid: list[str] | None = None
    """Per sample: why the scorer's answer for it was not a number ("" where it was; None = all were);
    such a sample's reward or score is NaN here."""

    def attempts_of(self, i: int) -> int:
        """Backend calls sample ``i`` took."""
        return 1 if self.attempts is None else self.attempts[i]

    def problem(self, i: int) -> str:
        """Why sample ``i``'s values are unusable (not a number, NaN, infinite), "" when they are usable."""
        if self.invalid is not None and self.invalid[i]:
            return self.invalid[i]
        named = [("reward", self.rewards[i]), ("score", self.scores[i])]
        for what, value in [*named, *((f"extra_logs[{k!r}]", v) for k, v in self.extra[i].items())]:
            if not math.isfinite(value):
                return f"{what} is {value} (not finite)"
        return ""

    @staticmethod
    def concat(parts: Sequence[ScorerResult]) -> ScorerResult:
        """Join the results of consecutive chunks of one batch."""
        return ScorerResult(
            rewards=[r for p in parts for r in p.rewards],
            scores=[s for p in parts for s in p.scores],
            extra=[e for p in parts for e in p.extra],
            attempts=[p.attempts_of(i) for p in parts for i in range(len(p.rewards))],
            retries=sum(p.retries for p in parts),
            invalid=[p.invalid[i] if p.invalid else "" for p in parts for i in range(len(p.rewards))]
            if any(p.invalid for p in parts)
            else None,
        )


class Scorer(Protocol):
    """What the reward service calls: one async call per micro-batch."""

    name: str
    reads_tokens: bool
    """Whether it reads the trajectories' token ids (tensors): the reward service then fetches whole
    payloads for it; else only their heads, whose tensors are empty."""

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


MAX_SHOWN_VALUE_CHARS = 80
"""A value that is not a number is shown in the reason cut to this many characters."""


def _floats(value: Any, n: int, what: str, source: str) -> tuple[list[float], list[str]]:
    """``value`` as ``n`` floats, and per sample why its value is not a number ("" where it is; NaN put in
    its place). A value that is no list, or a list of another length, fails the whole call."""
    value = _to_plain(value)
    if isinstance(value, int | float) and n == 1:
        value = [value]
    if not isinstance(value, list | tuple):
        raise ScorerError(f"{source}: {what} must be a list or tensor of {n} numbers, got {type(value).__name__}")
    if len(value) != n:  # which sample broke it is unknown: scored one by one, only that one fails
        raise ScorerError(f"{source}: {what} has {len(value)} values for a batch of {n} samples", sample_specific=True)
    out: list[float] = []
    reasons: list[str] = []
    for v in value:
        if isinstance(v, list) and len(v) == 1:  # a [N, 1] tensor
            v = v[0]
        if isinstance(v, int | float):  # bools count as 0/1; NaN and inf are judged per sample later
            out.append(float(v))
            reasons.append("")
        else:
            out.append(math.nan)
            reasons.append(f"{what} is not a number: {repr(v)[:MAX_SHOWN_VALUE_CHARS]}")
    return out, reasons


def parse_reward_output(output: Any, n: int, source: str) -> ScorerResult:
    """Check and convert a ``{"rewards", "scores"?, "extra_logs"?}`` answer for a batch of ``n``.

    ``scores`` defaults to the rewards when absent. An ``extra_logs`` entry is either one value
    per sample or a single batch-level number (copied to every sample). A value that is not a number
    makes its sample invalid (``ScorerResult.invalid``), not the call; an extra metric that is not one
    is left out of its sample's dict.
    """
    if not isinstance(output, Mapping):
        raise ScorerError(f"{source}: expected a dict with 'rewards', got {type(output).__name__}")
    if output.get("rewards") is None:
        raise ScorerError(f"{source}: answer has no 'rewards' (keys: {sorted(output)})")
    rewards, invalid = _floats(output["rewards"], n, "rewards", source)
    scores = rewards
    if output.get("scores") is not None:
        scores, bad_scores = _floats(output["scores"], n, "scores", source)
        invalid = [a or b for a, b in zip(invalid, bad_scores, strict=True)]
    extra_logs = output.get("extra_logs") or {}
    if not isinstance(extra_logs, Mapping):
        raise ScorerError(f"{source}: extra_logs must be a dict, got {type(extra_logs).__name__}")
    extra: list[dict[str, float]] = [{} for _ in range(n)]
    for key, value in extra_logs.items():
        plain = _to_plain(value)
        if isinstance(plain, int | float):
            plain = [plain] * n
        values, bad = _floats(plain, n, f"extra_logs[{key!r}]", source)
        for i, (sample, v) in enumerate(zip(extra, values, strict=True)):
            if bad[i]:
                invalid[i] = invalid[i] or bad[i]
            else:
                sample[str(key)] = v
    return ScorerResult(rewards=rewards, scores=scores, extra=extra, invalid=invalid if any(invalid) else None)
