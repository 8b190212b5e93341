"""Admission control: which prompt groups the coordinator may issue now, and at which version (pure).

The learner trains batch ``k`` at policy version ``k`` (version = steps done). Groups are counted
in issue order: a group issued now lands in batch ``k = (accepted + in_flight) // prompts_per_step``
(``accepted`` counts groups already batched or complete-and-kept, ``in_flight`` groups issued but
not yet complete). Its staleness when trained is ``k - g`` for generation version ``g``, so a
group for batch ``k`` must be generated at version ``g >= k - max_staleness``: that is the
``policy_version`` its prompt carries, and the rollout waits for those weights before generating.

Groups are issued for batches up to ``V + max_staleness + prefetch_steps`` while the policy is at
version ``V``. ``prefetch_steps`` queues the prompts of the next batches at the rollout workers
before their weights exist, so generation starts the moment the weights land (no prompt round
trip on the critical path). max_staleness = 0 is the synchronous mode: every sample is generated
by the version that trains on it.

Dropped groups (dynamic filtering, staleness, a dead-lettered member, a timeout) leave both
counts, so replacement prompts are issued automatically. A replacement takes the version *owed* by
the group it replaces, not one from its own position: issued later, behind groups of the next
batches, its position would place it in a later batch - with prefetch, one needing the version that
only the incomplete batch itself can produce, and the run would wait forever.
"""

from __future__ import annotations


def groups_admissible(
    *,
    accepted: int,
    in_flight: int,
    version: int,
    max_staleness: int,
    prompts_per_step: int,
    total_steps: int,
    prefetch_steps: int = 0,
) -> int:
    """How many more groups may be issued now (>= 0)."""
    horizon = min(version + max_staleness + prefetch_steps + 1, total_steps) * prompts_per_step
    return max(0, horizon - accepted - in_flight)


def required_version(*, position: int, version: int, max_staleness: int, prompts_per_step: int) -> int:
    """The policy version a group must be generated at: the ``position``-th group in issue order
    (``accepted + in_flight`` before it) lands in batch ``position // prompts_per_step``."""
    return max(version, position // prompts_per_step - max_staleness)


def new_group_versions(
    count: int, *, owed: list[int], position: int, version: int, max_staleness: int, prompts_per_step: int
) -> list[int]:
    """Required versions of the next ``count`` groups: the owed versions first (lowest first: the
    earliest batch waits for them), then by position (``position`` = ``accepted + in_flight``).

    The first ``min(count, len(owed))`` entries replace the lowest owed versions (the caller removes
    those, :func:`repaid`, from its list), each raised to the current ``version``: served at once
    either way, and then the version a replacement requires is the one it is generated at, which the
    batch builder counts on to know which batch is its last (``batching.py``).
    """
    replacing = [max(v, version) for v in repaid(count, owed)]
    fresh = [
        required_version(
            position=position + i, version=version, max_staleness=max_staleness, prompts_per_step=prompts_per_step
        )
        for i in range(len(replacing), count)
    ]
    return replacing + fresh


def repaid(count: int, owed: list[int]) -> list[int]:
    """The owed versions the next ``count`` groups repay: the lowest first."""
    return sorted(owed)[:count]


def staleness(learner_version: int, generation_version: int) -> int:
    """Versions between the policy that generated a sample and the one that trains on it."""
    return learner_version - generation_version
