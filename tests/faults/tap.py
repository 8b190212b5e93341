"""Every entry of every stream of a run, as it was written: the fault suite counts from this, not
from what Redis still holds.

Streams are trimmed once consumed (``redis.retain_consumed_s``), so by the end of a run most
entries are gone from Redis. :class:`StreamTap` is a thread with its own connection (never through
the fault proxy) that XREADs each stream from ``0`` and keeps every entry it sees, riding out a
Redis restart. :meth:`StreamTap.missed` says whether it could have missed any: a stream whose
``entries-added`` (XINFO STREAM) is larger than the entries the tap saw was trimmed past the tap.

With ``slim=True`` (a long soak: hundreds of thousands of trajectories) the tap keeps each
trajectory, scored trajectory and batch re-encoded without its tokens, log-probs, texts, images and
free-form fields (:func:`slim`): what the counting reads (ids, groups, evaluation flags, versions)
stays.
"""

from __future__ import annotations

import threading
import time

import msgspec
import redis as syncredis
from redis.exceptions import ClusterDownError, TryAgainError

from streamrl.common.codec import decode, encode
from streamrl.common.errors import PoisonMessageError
from streamrl.common.messages import ScoredTrajectory, Tensor, TrainingBatch, Trajectory
from streamrl.common.streams import StreamNames

BLOCK_MS = 100
COUNT = 1000
EMPTY = Tensor(dtype="int32", shape=[0], data=b"")


def _slim_trajectory(t: Trajectory) -> Trajectory:
    return msgspec.structs.replace(
        t,
        prompt_ids=EMPTY,
        response_ids=EMPTY,
        logprobs=EMPTY,
        loss_mask=EMPTY,
        prompt_text="",
        response_text="",
        metadata={},
        timings={},
        turns=[],
        images=[],
    )


def _slim_scored(s: ScoredTrajectory) -> ScoredTrajectory:
    return msgspec.structs.replace(s, trajectory=_slim_trajectory(s.trajectory), extra={})


def slim(payload: bytes) -> bytes:
    """``payload`` re-encoded without the bulk of a trajectory (see the module docstring); any other
    message, or bytes that do not decode, as they are."""
    try:
        msg = decode(payload)
    except PoisonMessageError:
        return payload
    if isinstance(msg, Trajectory):
        return encode(_slim_trajectory(msg))
    if isinstance(msg, ScoredTrajectory):
        return encode(_slim_scored(msg))
    if isinstance(msg, TrainingBatch):
        return encode(msgspec.structs.replace(msg, samples=[_slim_scored(s) for s in msg.samples]))
    return payload


class StreamTap:
    """See the module docstring. ``start()``, then ``entries(stream)`` at any time; ``stop()`` reads
    what is left and ends the thread."""

    def __init__(self, port: int, names: StreamNames, *, slim: bool = False) -> None:
        self.names = names
        self.slim = slim
        self.streams = (names.prompts, names.trajectories, names.scored, names.batches, names.weights, names.dead)
        self._client = syncredis.Redis(port=port, socket_timeout=10)
        self._seen: dict[str, list[tuple[str, bytes]]] = {s: [] for s in self.streams}
        self._last: dict[str, str] = dict.fromkeys(self.streams, "0-0")
        self._bulky = {names.trajectories, names.scored, names.batches}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"tap-{names.run_id}", daemon=True)

    def start(self) -> StreamTap:
        self._thread.start()
        return self

    def entries(self, stream: str) -> list[tuple[str, bytes]]:
        """Every entry of ``stream`` seen so far, as (id, payload field ``d``), in order."""
        with self._lock:
            return list(self._seen[stream])

    def stop(self) -> None:
        """Stop the thread after one last read of everything written so far."""
        if self._thread.is_alive():
            self._stop.set()
            self._thread.join(30)
        try:
            while self._read_once(block=False):
                pass
        except (syncredis.ConnectionError, syncredis.TimeoutError):
            pass

    def missed(self) -> list[str]:
        """One line per stream the tap may have missed entries of (trimmed before it read them)."""
        out = []
        for stream in self.streams:
            try:
                info = self._client.xinfo_stream(stream)
            except syncredis.ResponseError:
                continue  # never written
            added = int(info.get("entries-added", 0))
            seen = len(self.entries(stream))
            if added > seen:
                out.append(f"the tap saw {seen} of the {added} entries added to {stream.rsplit(':', 1)[-1]}")
        return out

    def close(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(30)
        self._client.close()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self._read_once(block=True)
            except (syncredis.ConnectionError, syncredis.TimeoutError, ClusterDownError, TryAgainError):
                time.sleep(0.2)  # redis (a cluster node) restarting: its AOF keeps what we have not read yet

    def _read_once(self, *, block: bool) -> int:
        with self._lock:
            last = dict(self._last)
        reply = self._client.xread(last, count=COUNT, block=BLOCK_MS if block else None)  # type: ignore[arg-type]
        got = 0
        with self._lock:
            for raw_stream, items in reply or []:
                stream = raw_stream.decode()
                for eid, fields in items:
                    payload = fields.get(b"d", b"")
                    if self.slim and stream in self._bulky:
                        payload = slim(payload)
                    self._seen[stream].append((eid.decode(), payload))
                    self._last[stream] = eid.decode()
                    got += 1
        return got
