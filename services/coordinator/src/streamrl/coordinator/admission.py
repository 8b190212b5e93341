"""Admission control: may the coordinator issue another prompt group now? (pure)

The learner trains batch ``k`` at policy version ``k`` (version = steps done). A group issued now,
while the policy is at version ``V``, will land in batch ``k = accepted + in_flight`` (counting
groups, divided by groups per batch). Its staleness when trained is ``k - V``; admission keeps it
``<= max_staleness``::

    issue while  accepted + in_flight < (V + max_staleness + 1) * prompts_per_step

``accepted`` counts groups already batched or complete-and-kept, ``in_flight`` groups issued but not
yet complete. Dropped groups (dynamic filtering, staleness) leave both counts, so replacement
prompts are issued automatically. max_staleness = 0 is the synchronous mode: the prompts of batch
``V`` are issued only once version ``V`` is published.
"""

from __future__ import annotations


def groups_admissible(
    *, accepted: int, in_flight: int, version: int, max_staleness: int, prompts_per_step: int, total_steps: int
) -> int:
    """How many more groups may be issued now (>= 0)."""
    horizon = min(version + max_staleness + 1, total_steps) * prompts_per_step
    return max(0, horizon - accepted - in_flight)


def staleness(learner_version: int, generation_version: int) -> int:
    """Versions between the policy that generated a sample and the one that trains on it."""
    return learner_version - generation_version
