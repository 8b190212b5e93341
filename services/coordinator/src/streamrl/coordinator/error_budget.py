"""The run's error budget (pure): when too many of the groups settled lately failed, issuing pauses.

A failure that every group meets and that the reward tier cannot recognise as permanent (a scorer that rejects
every sample, a rollout that produces nothing scorable) would otherwise fail each group, replace it, fail the
replacement, ... until the dataset is burnt while the policy version never moves. The budget counts the groups
that settled over the last ``window_s``: completed (trained-ready or filtered) or failed (dead-lettered member,
timed out). With at least ``min_groups`` settled and more than ``max_dead_fraction`` of them failed, it trips:
issuing - new prompts and replacements - pauses for ``window_s`` with the cause on screen, then resumes with a
fresh window (a half-open circuit: if the failure lasts, it trips again after ``min_groups`` more failures;
groups that settle while it is paused count in no window: they met the cause already counted).
The window lives in the coordinator's memory: a restarted coordinator starts a fresh one.
"""

from __future__ import annotations

import collections
from dataclasses import dataclass, field


@dataclass
class ErrorBudget:
    """See the module docstring. Times are ``time.monotonic()`` seconds.

    Example:
        budget = ErrorBudget(max_dead_fraction=0.5, window_s=120.0, min_groups=32)
        budget.record(now, failed=3, completed=1)
        cause = budget.check(now)  # a sentence once it trips, then None until it trips again
    """

    max_dead_fraction: float
    window_s: float
    min_groups: int
    paused_until: float = 0.0
    """Issuing is paused until then (``time.monotonic()``)."""
    _events: collections.deque[tuple[float, int, int]] = field(default_factory=collections.deque)
    """(time, failed, completed) of each record within the window."""

    def record(self, now: float, *, failed: int = 0, completed: int = 0) -> None:
        """Groups settled at ``now``; those settled while paused count in no window (they met the same cause)."""
        if (failed or completed) and not self.paused(now):
            self._events.append((now, failed, completed))

    def paused(self, now: float) -> bool:
        return now < self.paused_until

    def check(self, now: float) -> str | None:
        """The cause when the budget trips now (issuing then pauses for ``window_s``); None otherwise."""
        while self._events and self._events[0][0] <= now - self.window_s:
            self._events.popleft()
        failed = sum(e[1] for e in self._events)
        settled = failed + sum(e[2] for e in self._events)
        if self.paused(now) or settled < self.min_groups or failed <= self.max_dead_fraction * settled:
            return None
        self.paused_until = now + self.window_s
        self._events.clear()
        return (
            f"error budget spent: {failed} of the {settled} groups settled in the last {self.window_s:.0f} s failed "
            f"(over coordinator.max_dead_fraction = {self.max_dead_fraction:g}); no prompt or replacement is issued "
            f"for {self.window_s:.0f} s"
        )
