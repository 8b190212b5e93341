"""The ``broadcast`` transport's engine end: a member of the learner's weight group (:mod:`.broadcast`).

For an event tagged ``broadcast`` an engine - the transformers engine, or each tensor-parallel worker
of a vLLM engine through its worker extension - holds a :class:`BroadcastReceiver`, which keeps one
:class:`BroadcastMember` per learner session (a restarted learner has a new store and group). The
member's background thread
registers in the learner's TCP store, joins the group (a process group of its own, built on the
store: NCCL on CUDA, gloo on CPU; never the default group: :mod:`streamrl.torchkit.process_group`), and follows the protocol of
:mod:`streamrl.common.weights.broadcast`: for every version the learner broadcasts, it receives the
buckets into its staging buffers, recomputes the device-side block checksum (the CUDA IPC path's
definition, :func:`streamrl.torchkit.flat.weights_checksum`) and acknowledges. Receiving
runs while the engine generates; the engine takes a verified version between two batches::

    version, tensors = receiver.acquire(version, timeout_s, checksum=signed)  # waits, then pins the buffers
    try:
        load(tensors)                                             # (name, view of the staging buffers)
    finally:
        receiver.release()

The store and the group have no authentication: whoever reaches the store can announce a version
and broadcast buckets of their own, and the checksum the member first checks against comes from
that store. So an engine loads a version only as a signed weights event names it: ``checksum`` is
the event's (``WeightsBroadcast.checksum``, :mod:`streamrl.common.weights.auth`), and ``acquire``
hands out exactly that version with what was received hashing to exactly that checksum - anything
else staged is refused with a :class:`WeightSyncError` naming both (a newer version staged
meanwhile too: it loads with its own event).

A joiner gets the learner's current version as soon as it is in the group. A missed deadline, a
checksum mismatch or a learner that gave an update up leaves the last verified version staged
(or none) and is acknowledged as an error; the learner then re-forms the group and sends the
current version again. A lost store (the learner is gone) ends the thread: ``acquire`` then
raises :class:`WeightSyncError` at once, and :class:`BroadcastReceiver` fetches over ZMQ instead
where the event names an ``endpoint`` (the learner's ``weights_zmq_fallback``).

Memory: one copy of the weights in the staging buffers, on the engine's CUDA device (NCCL) or in
host memory (gloo).
"""

from __future__ import annotations

import logging
import os
import secrets
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import timedelta

import torch
import torch.distributed as dist

from streamrl.common.errors import WeightSyncError
from streamrl.common.messages import WeightsBroadcast, WeightsPublished, WeightsTransport
from streamrl.common.weights import broadcast as wb
from streamrl.torchkit.flat import tensor_views, weights_checksum
from streamrl.torchkit.process_group import Group, new_group, put
from streamrl.torchkit.weights.protocol import Received
from streamrl.torchkit.weights.zmq import ZmqReceiver

logger = logging.getLogger(__name__)

STORE_CONNECT_TIMEOUT_S = 10.0
"""How long a receiver tries to reach the learner's store before it gives up (the caller may then use ZMQ)."""
REJOIN_AFTER_S = 60.0
"""A failed member is replaced by a new one (a new try to join) only this long after it failed: until
then updates fail at once, and the caller fetches over ZMQ where it can."""


def staging_device(backend: str, device: torch.device) -> torch.device:
    """Where a receiver on ``device`` keeps its buckets: the CUDA device for NCCL, host memory for gloo."""
    if backend == "nccl":
        if device.type != "cuda":
            raise WeightSyncError(
                f"the learner broadcasts weights over NCCL, which needs a CUDA device; this engine is on {device}"
            )
        return device
    if backend != "gloo":
        raise WeightSyncError(f"unknown weight-broadcast backend {backend!r}")
    return torch.device("cpu")


def member_for(
    current: BroadcastMember | None, info: WeightsBroadcast, device: torch.device, label: str, timeout_s: float
) -> BroadcastMember:
    """An engine's member of the group ``info`` advertises: ``current`` while it belongs to the same
    learner (session) - also for ``REJOIN_AFTER_S`` after it failed, so a worker that cannot join
    fails fast - else a new one (``current`` is closed)."""
    if current is not None and current.info.session == info.session:
        failed_at = current.failed_at
        if failed_at is None or time.monotonic() - failed_at < REJOIN_AFTER_S:
            return current
    if current is not None:
        current.close()
    return BroadcastMember(info, device, label, timeout_s)


class BroadcastMember:
    """Joins the learner's weight group and keeps the newest verified version staged; see the module docstring.

    ``label`` names this member within its process (``hf``, ``tp0``...); the member id is
    ``{host}:{pid}:{label}:{random}``. ``timeout_s`` bounds every step of the protocol.
    """

    def __init__(self, info: WeightsBroadcast, device: torch.device, label: str, timeout_s: float) -> None:
        self.info = info
        self.member = f"{socket.gethostname()}:{os.getpid()}:{label}:{secrets.token_hex(3)}"
        self._device = staging_device(info.backend, device)
        self._timeout_s = timeout_s
        self._staging = [torch.empty(n, dtype=torch.uint8, device=self._device) for n in info.bucket_bytes]
        self._named = self._views()
        self._lock = threading.Lock()
        """Held by the thread while it writes the staging buffers, and by the engine while it reads them."""
        self._changed = threading.Condition()
        self._staged = -1
        """Version verified in the staging buffers (-1: none)."""
        self._staged_checksum = ""
        """Block checksum of what the staging buffers hold, as computed here from the received bytes."""
        self._failure: str | None = None
        self.failed_at: float | None = None
        """When the thread failed (``time.monotonic()``); None while it is alive."""
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"weights-receiver-{label}", daemon=True)
        self._thread.start()

    @property
    def staged_version(self) -> int:
        """Version verified in the staging buffers (-1: none yet)."""
        return self._staged

    @property
    def staging(self) -> list[torch.Tensor]:
        """The staging buffers (flat uint8); read them only between :meth:`acquire` and :meth:`release`."""
        return self._staging

    def acquire(
        self, version: int, timeout_s: float, checksum: str | None = None
    ) -> tuple[int, list[tuple[str, torch.Tensor]]]:
        """Wait until ``version`` is staged, pin the staging buffers and return (version, [(name, view)]);
        call :meth:`release` when loaded.

        ``checksum``: what the signed weights event says ``version`` hashes to - only exactly that
        version with exactly that checksum is handed out, anything else staged raises WeightSyncError.
        None (no event to check against: tests, tools): the newest verified version >= ``version``.
        Raises WeightSyncError after ``timeout_s``, or at once when the receiver has failed.
        """
        deadline = time.monotonic() + timeout_s
        while True:
            with self._changed:
                while self._staged < version:
                    if self._failure is not None:
                        raise WeightSyncError(f"weight broadcast member {self.member} failed: {self._failure}")
                    remaining = deadline - time.monotonic()
                    if remaining <= 0:
                        raise WeightSyncError(
                            f"weights version {version} not received over the broadcast group at "
                            f"{self.info.store} within {timeout_s:g} s (member {self.member}, staged {self._staged})"
                        )
                    self._changed.wait(min(remaining, 0.5))
                if checksum is not None:
                    self._refuse_unless_signed(version, checksum)
            if not self._lock.acquire(timeout=max(0.0, deadline - time.monotonic())):
                raise WeightSyncError(f"the staging buffers of {self.member} stayed busy for {timeout_s:g} s")
            staged, staged_checksum = self._staged, self._staged_checksum
            if (staged == version and checksum in (None, staged_checksum)) or (staged > version and checksum is None):
                return staged, self._named  # not overwritten between the wait and the lock
            self._lock.release()

    def _refuse_unless_signed(self, version: int, checksum: str) -> None:
        """Raise WeightSyncError unless the staging buffers hold ``version`` hashing to ``checksum``
        (called holding ``_changed``, with a version >= ``version`` staged)."""
        if self._staged > version:
            raise WeightSyncError(
                f"weights version {version} was replaced in the staging buffers of {self.member} by version "
                f"{self._staged} before it was loaded (that one loads with its own signed event)"
            )
        if self._staged_checksum != checksum:
            raise WeightSyncError(
                f"the weight-broadcast group at {self.info.store} delivered a version {version} that hashes to "
                f"{self._staged_checksum}, not to {checksum} as the signed weights event says: refused "
                f"(member {self.member}; the store has no authentication - is something else serving it?)"
            )

    def release(self) -> None:
        """Unpin the staging buffers (after :meth:`acquire`)."""
        self._lock.release()

    def close(self) -> None:
        """Stop the thread (the learner drops this member at its next update)."""
        self._stop.set()
        self._thread.join(timeout=self._timeout_s + 5)

    def _views(self) -> list[tuple[str, torch.Tensor]]:
        views = tensor_views(self._staging, self.info.tensors)
        return [(t.name, v) for t, v in zip(self.info.tensors, views, strict=True)]

    def _set_staged(self, version: int, checksum: str = "") -> None:
        with self._changed:
            self._staged, self._staged_checksum = version, checksum
            self._changed.notify_all()

    # ------------------------------------------------------------------ thread side
    def _run(self) -> None:
        if self._device.type == "cuda":  # this thread's CUDA calls go to the staging device
            torch.cuda.set_device(self._device)
        try:
            host, port = self.info.store.rsplit(":", 1)
            timeout = timedelta(seconds=min(self._timeout_s, STORE_CONNECT_TIMEOUT_S))
            try:
                store = dist.TCPStore(host, int(port), is_master=False, timeout=timeout)
            except dist.DistNetworkError as e:
                self._fail(f"could not reach the learner's store {self.info.store}: {e}")
                return
            registration = self._register(store)
            seen = 0
            while not self._stop.is_set():
                joined = self._join(store, seen, registration)
                if joined is None:
                    break
                generation, rank, group, registration = joined
                seen = self._serve(store, generation, rank, group)
            put(store, wb.leave_key(self.member), b"1")  # closed: the learner stops waiting for us at once
            store.add(wb.LEAVES, 1)
        except dist.DistNetworkError as e:  # the learner is gone
            logger.warning(
                "weight broadcast member %s lost the learner's store %s: %s", self.member, self.info.store, e
            )
            self._fail(f"lost the learner's store {self.info.store}: {e}")
        except Exception as e:  # thread boundary: acquire() raises it to the engine
            logger.exception("weight broadcast member %s failed", self.member)
            self._fail(f"{type(e).__name__}: {e} (store {self.info.store})")

    def _fail(self, reason: str) -> None:
        with self._changed:
            self._failure = reason
            self.failed_at = time.monotonic()
            self._changed.notify_all()

    def _register(self, store: dist.Store) -> int:
        registration = store.add(wb.JOINS, 1)
        put(store, wb.join_key(registration), self.member)
        logger.info("weight broadcast: %s registered at %s", self.member, self.info.store)
        return registration

    def _wait_key(self, store: dist.Store, key: str, deadline: float | None) -> bytes | None:
        """The value of ``key`` once set; None if stopped or past ``deadline``."""
        while not store.check([key]):
            if self._stop.is_set() or (deadline is not None and time.monotonic() > deadline):
                return None
            time.sleep(wb.POLL_S)
        return store.get(key)

    def _join(self, store: dist.Store, seen: int, registration: int) -> tuple[int, int, Group, int] | None:
        """Wait for a generation newer than ``seen`` that lists this member and build its group;
        returns (generation, rank, group, registration), or None when stopped."""
        while not self._stop.is_set():
            generation = int(store.get(wb.GENERATION))
            if generation <= seen:
                time.sleep(wb.POLL_S)
                continue
            seen = generation
            members = wb.decode_members(store.get(wb.members_key(generation)))
            if self.member not in members.members:
                if members.joins_seen >= registration:  # formed after we registered, without us: dropped
                    logger.warning("weight broadcast: %s was dropped from the group: registering again", self.member)
                    registration = self._register(store)
                continue
            put(store, wb.ready_key(generation, self.member), b"1")
            start = self._wait_key(store, wb.start_key(generation), time.monotonic() + 2 * self._timeout_s)
            if start is None:
                if self._stop.is_set():
                    return None
                raise WeightSyncError(f"the learner did not start generation {generation} of the weight group")
            if not wb.decode_start(start).ok:
                continue
            rank = members.members.index(self.member) + 1
            prefixed = dist.PrefixStore(wb.group_prefix(generation), store)
            try:
                group = new_group(
                    prefixed, rank, len(members.members) + 1, self.info.backend, self._timeout_s, self._device
                )
            except RuntimeError as e:  # another member died meanwhile: the learner re-forms the group
                logger.warning("weight broadcast: building generation %d failed (%s)", generation, e)
                continue
            logger.info("weight broadcast: %s is rank %d of generation %d", self.member, rank, generation)
            return generation, rank, group, registration
        return None

    def _serve(self, store: dist.Store, generation: int, rank: int, group: Group) -> int:
        """Answer the ops of ``generation`` until it ends; returns the last generation not to look at."""
        op = 0
        while True:
            data = self._wait_key(store, wb.op_key(generation, op), None)
            if data is None:  # stopped
                group.abort()
                return generation
            record = wb.decode_op(data)
            if isinstance(record, wb.RegroupOp):
                group.abort()
                return record.generation - 1
            self._receive(store, generation, op, rank, group, record)
            op += 1

    def _receive(
        self, store: dist.Store, generation: int, op: int, rank: int, group: Group, record: wb.BroadcastOp
    ) -> None:
        started = time.perf_counter()
        deadline = time.monotonic() + self._timeout_s
        checksum = ""
        with self._lock:
            self._set_staged(-1)  # the buffers are about to change
            put(store, wb.op_ready_key(generation, op, rank), b"1")
            error = self._receive_buckets(store, generation, op, group, deadline)
            if error is None:
                checksum = weights_checksum(self._staging, record.version, self.info.block_bytes)
                if checksum != record.checksum:
                    error = f"checksum mismatch: received {checksum}, published {record.checksum}"
            if error is None:
                self._set_staged(record.version, checksum)
        put(store, wb.ack_key(generation, op, rank), wb.encode(wb.Ack(checksum=checksum, error=error or "")))
        if error is not None:
            logger.warning("weight broadcast: %s did not receive version %d: %s", self.member, record.version, error)
        else:
            logger.info(
                "weight broadcast: %s received version %d (%.1f ms)",
                self.member,
                record.version,
                (time.perf_counter() - started) * 1e3,
            )

    def _receive_buckets(
        self, store: dist.Store, generation: int, op: int, group: Group, deadline: float
    ) -> str | None:
        """Receive every bucket into the staging buffers; None, or why not."""
        options = dist.BroadcastOptions()
        options.rootRank = 0
        abort = wb.abort_key(generation, op)
        for index, bucket in enumerate(self._staging):
            work = group.broadcast([bucket], options)
            next_look = time.monotonic() + wb.POLL_S
            while not work.is_completed():
                now = time.monotonic()
                gave_up = now > deadline or (now >= next_look and store.check([abort]))
                if gave_up or self._stop.is_set():
                    group.abort()
                    self._replace_staging()
                    why = "missed its deadline" if now > deadline else "was given up by the learner"
                    return f"bucket {index + 1}/{len(self._staging)} {why}"
                if now >= next_look:
                    next_look = now + wb.POLL_S
                time.sleep(0.0005)
            try:
                work.wait()
            except RuntimeError as e:  # a peer closed its connection or the collective timed out
                return f"bucket {index + 1}/{len(self._staging)}: {e}"
        return None

    def _replace_staging(self) -> None:
        """New staging buffers after an abandoned receive: a gloo receive cannot be cancelled, so a late
        arrival must land in memory no longer read (NCCL aborts its communicator: nothing arrives)."""
        if self.info.backend == "gloo":
            self._staging = [torch.empty_like(b) for b in self._staging]
            self._named = self._views()


class BroadcastReceiver:
    """An engine's end of the broadcast transport: its member of the learner's group (replaced when the
    learner restarts), and a ZMQ fetch when the member fails and the event names an ``endpoint``.
    ``label`` names the member within its process (``hf``, ``tp0``...)."""

    transport: WeightsTransport = "broadcast"

    def __init__(self, device: torch.device, label: str) -> None:
        self._device = device
        self._label = label
        self._member: BroadcastMember | None = None

    @contextmanager
    def receive(
        self, event: WeightsPublished, timeout_s: float, abandoned: threading.Event | None = None
    ) -> Iterator[Received]:
        """Exactly ``event.version``, as the member received it, loaded only if it hashes to the signed
        rendezvous' checksum; over ZMQ when that fails and the learner serves it there too."""
        assert event.broadcast is not None, "a broadcast event names its rendezvous"
        if event.payload != "full":
            raise WeightSyncError(f"version {event.version}: a LoRA adapter never travels over the broadcast group")
        try:
            self._member = member_for(self._member, event.broadcast, self._device, self._label, timeout_s)
            signed = event.broadcast.checksum or event.checksum  # (an older learner: the event's own checksum)
            version, tensors = self._member.acquire(event.version, timeout_s, checksum=signed)
        except WeightSyncError as e:
            if not event.endpoint:
                raise WeightSyncError(
                    f"{e}; the learner serves version {event.version} only over its broadcast group (set "
                    "learner.weights_zmq_fallback for workers that cannot join)"
                ) from e
            logger.warning("weight broadcast failed (%s): fetching version %d over ZMQ", e, event.version)
            with ZmqReceiver().receive(event, timeout_s, abandoned) as received:
                yield received
            return
        try:
            yield Received(int(version), tensors)
        finally:
            self._member.release()

    def release_memory(self) -> None:
        pass  # the member receives in the background: its staging stays

    def close(self) -> None:
        if self._member is not None:
            self._member.close()
            self._member = None
