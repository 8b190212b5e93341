"""Every Redis key and stream name of a run, built in one place from the run id.

    streamrl:{run}:prompts        PromptWorkItem      coordinator -> rollout
    streamrl:{run}:trajectories   TrajectoryRecord    rollout -> reward
    streamrl:{run}:scored         ScoredRecord        reward -> coordinator
    streamrl:{run}:batches        BatchManifest       coordinator -> learner
    streamrl:{run}:payload:{trajectory id}:{attempt}   a Trajectory's payload (string), written once
                                  by the rollout worker; renamed batched:{batch}:{trajectory id} when batched
    streamrl:{run}:weights        WeightsPublished    learner -> rollout, coordinator
    streamrl:{run}:dead           DeadLetter          any consumer
    streamrl:{run}:hb:{service}:{instance}   Heartbeat key with TTL
    streamrl:{run}:instances      set of "{service}:{instance}" that have heartbeated (readers look
                                  keys up from it, never with a SCAN of the keyspace)
    streamrl:{run}:lease:...      leases (:mod:`streamrl.common.lease`), the fence of a service's writes
    streamrl:{run}:once:{service}:{op}  replies of one transaction / no-entry commit, for twice redis.outage_s
                                  (:mod:`streamrl.common.tx`)

The braces are literal: ``{run}`` is a Redis Cluster hash tag, so every key of a run hashes to one
slot and the commit script and transactions, which touch several keys at once, work on a cluster.
"""

from __future__ import annotations

from dataclasses import dataclass

PREFIX = "streamrl"


@dataclass(frozen=True)
class StreamNames:
    """Names of one run's streams and keys."""

    run_id: str

    def _key(self, *parts: str) -> str:
        return ":".join((PREFIX, "{" + self.run_id + "}", *parts))

    @property
    def prompts(self) -> str:
        return self._key("prompts")

    @property
    def trajectories(self) -> str:
        return self._key("trajectories")

    @property
    def scored(self) -> str:
        return self._key("scored")

    @property
    def batches(self) -> str:
        return self._key("batches")

    @property
    def weights(self) -> str:
        return self._key("weights")

    @property
    def dead(self) -> str:
        return self._key("dead")

    @property
    def all_keys(self) -> str:
        """Glob pattern of every key of the run (``SCAN MATCH``, ACL key patterns)."""
        return self._key("*")

    def heartbeat(self, service: str, instance: str) -> str:
        return self._key("hb", service, instance)

    @property
    def instances(self) -> str:
        """Set of ``{service}:{instance}`` members, one per instance that wrote a heartbeat."""
        return self._key("instances")

    def lease(self, *parts: str) -> str:
        """A lease one process holds at a time (:mod:`streamrl.common.lease`), e.g. ``lease("singleton", "coordinator")``."""
        return self._key("lease", *parts)

    def state(self, name: str) -> str:
        """A piece of run state (e.g. ``policy_version``, ``cursor``) owned by one service."""
        return self._key("state", name)

    def group_buffer(self, group_id: str) -> str:
        """Hash of the scored trajectories collected so far for one prompt group."""
        return self._key("groups", group_id)

    def batched_samples(self, batch_id: str, group_id: str) -> str:
        """Hash of a batched group's scored trajectories (its buffer, renamed when the group went into batch
        ``batch_id``), read by the learner; deleted once the batch is trained and checkpointed, or counted dead.
        ``batched_samples(batch_id, "")`` is the prefix of every hash of that batch."""
        return self._key("batched", batch_id, group_id)

    def manifest_part(self, batch_id: str, attempt: str, number: int) -> str:
        """One part of batch ``batch_id``'s split manifest (a :class:`ManifestPart`), written by one build attempt
        (``attempt``: a random token, so an attempt that lost the race never overwrites the published parts);
        under :meth:`batched_samples`'s prefix, deleted with the batch's payloads."""
        return self._key("batched", batch_id, "manifest", attempt, str(number))

    def payload(self, trajectory_id: str, attempt: str) -> str:
        """String holding one trajectory's encoded Trajectory, as written by one delivery (``attempt``: a random
        token of that delivery, so a worker whose lease was taken over can never overwrite the payload another
        committed). Written with a time to live (``redis.payload_orphan_ttl_s``) that the rollout's commit
        removes: a payload no commit references expires."""
        return self._key("payload", trajectory_id, attempt)

    @property
    def payload_prefix(self) -> str:
        """Prefix of every :meth:`payload` key of the run."""
        return self._key("payload", "")

    def batched_payload(self, batch_id: str, trajectory_id: str) -> str:
        """A batched trajectory's payload (its :meth:`payload` key, renamed when its group went into batch
        ``batch_id``): under :meth:`batched_samples`'s prefix, so only that batch's reader or dead letter deletes it."""
        return self._key("batched", batch_id, trajectory_id)

    @property
    def group_index(self) -> str:
        """Sorted set of group ids with collected samples, scored by first arrival."""
        return self._key("groups")

    @property
    def served_versions(self) -> str:
        """Hash instance -> policy version that rollout instance serves now."""
        return self._key("served")
