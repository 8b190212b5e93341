"""What a user sees of the run besides its curves: the progress hash and the run counters as metrics.

The progress hash (``state:progress``) is what ``streamrl up`` shows as its progress line. It holds the latest figures (step, reward, accuracy, staleness, loss, evaluation accuracy, the last
dead-letter reason, and ``paused`` with its cause while the run issues no prompts) and every run counter of ``state.COUNTERS`` that is not zero - groups dead, timed
out or filtered, batches dead, evaluation prompts dead or missing... - so a user sees what was lost
as soon as it is. It is written only when something changed.
"""

from __future__ import annotations

from typing import Any

from streamrl.coordinator import state as st
from streamrl.coordinator.state import RunState

REASON_CHARS = 240
"""Characters of the last dead-letter reason kept."""


class Progress:
    """Figures to show, published to Redis when they change."""

    def __init__(self, state: RunState) -> None:
        self.state = state
        self.fields: dict[str, Any] = {}
        self.published: dict[str, str] = {}

    def update(self, figures: dict[str, Any]) -> None:
        self.fields.update(figures)

    async def refresh_counters(self) -> dict[str, int]:
        """Read the run counters; the non-zero ones are shown (``dead_letters`` as ``dead``)."""
        counters = await self.state.counters()
        for name, value in counters.items():
            if value:
                self.fields["dead" if name == st.DEAD_LETTERS else name] = value
        return counters

    async def publish(self, version: int) -> None:
        self.fields["version"] = version
        shown = {k: str(v) for k, v in self.fields.items()}
        if shown != self.published:
            key = self.state.key(st.PROGRESS)
            tx = self.state.tx().call("HSET", key, *(x for kv in shown.items() for x in kv))
            gone = [k for k in self.published if k not in shown]
            if gone:  # a figure that no longer holds (the run is no longer paused)
                tx = tx.hdel(key, *gone)
            await tx.execute()
            self.published = shown

    def clear(self, name: str) -> None:
        """Stop showing ``name`` (removed from the hash at the next publish)."""
        self.fields.pop(name, None)


def counter_metrics(counters: dict[str, int]) -> dict[str, int]:
    """The run counters as metrics: ``coordinator/{name}``, and the reward tier's dead letters as
    ``reward/dead_lettered`` (``samples_too_stale`` is left out: each batch reports its own)."""
    out = {}
    for name, value in counters.items():
        if name == st.REWARD_DEAD_LETTERED:
            out["reward/dead_lettered"] = value
        elif name != st.SAMPLES_TOO_STALE:
            out[f"coordinator/{name}"] = value
    return out
