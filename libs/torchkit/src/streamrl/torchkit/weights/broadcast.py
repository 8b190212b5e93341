"""The ``broadcast`` transport's learner end: the weights to rollout workers over a process group of their own.

With ``learner.weights_transport = "broadcast"``, learner rank 0 owns a
:class:`BroadcastPublisher` (the workers' end is :mod:`.broadcast_member`):

* It hosts a ``torch.distributed.TCPStore`` (the rendezvous advertised in every
  ``WeightsPublished.broadcast``) and builds the weight group directly on it -
  ``ProcessGroupNCCL`` when the weights are on CUDA, ``ProcessGroupGloo`` on CPU - on a
  ``PrefixStore`` per generation: the learner's default group (its DeepSpeed data-parallel group)
  is never touched (:func:`streamrl.torchkit.process_group.new_group`). Rollout workers
  (:class:`.broadcast_member.BroadcastReceiver`) are ranks 1..n.
* :meth:`publish` copies the weights into flat device buckets of ``bucket_bytes`` and computes
  the device-side block checksum - the packing, layout and checksum of the CUDA IPC path
  (:mod:`.ipc`, :mod:`streamrl.torchkit.flat`) - then returns. A background thread broadcasts the
  buckets: the training step waits only for the copy, and for a broadcast of the previous version
  that is still reading the buckets.
* The thread also keeps the membership (protocol: :mod:`streamrl.common.weights.broadcast`): a
  worker that registers late, or a member that misses a deadline or dies mid-update, makes a new
  generation of the group, which gets the current version again - so a late joiner receives the
  current weights as soon as it joins, before its first prompt. Every operation has a deadline
  (``timeout_s``); a member that misses one is named in the log and dropped, training goes on.
* With ``zmq_fallback`` (a :class:`.zmq.ZmqPublisher`) the same buckets are also served over ZMQ for
  workers that cannot join; the event is still tagged ``broadcast``, its ``endpoint`` set and its
  ``checksum`` the ZMQ server's (members check the rendezvous' own checksum).

Memory: one copy of the weights in the buckets on the learner's device. The TCP store listens on
every interface and has no authentication (nor does the group): keep the learner and its rollout
workers on a private network. The group picks its network interface as torch does
(``GLOO_SOCKET_IFNAME`` / ``NCCL_SOCKET_IFNAME``).

NCCL: a timed-out collective aborts this group's communicator instead of the whole process
(``TORCH_NCCL_ASYNC_ERROR_HANDLING=2`` while the group is built), so a dead rollout worker never
takes the learner down.
"""

from __future__ import annotations

import logging
import secrets
import threading
import time
from collections.abc import Iterable, Mapping
from datetime import timedelta

import torch
import torch.distributed as dist

from streamrl.common.messages import WeightsBroadcast
from streamrl.common.weights import broadcast as wb
from streamrl.torchkit.flat import BLOCK_BYTES, tensor_views
from streamrl.torchkit.process_group import Group, new_group, put, wait_work
from streamrl.torchkit.weights.ipc import IpcPublisher
from streamrl.torchkit.weights.protocol import PublishedWeights
from streamrl.torchkit.weights.tied import TIED_ALIASES
from streamrl.torchkit.weights.zmq import ZmqPublisher

logger = logging.getLogger(__name__)

DEFAULT_BUCKET_BYTES = 512 * 2**20
JOIN_POLL_S = 0.1
"""How often the thread looks for new registrations while idle (s)."""


class BroadcastPublisher:
    """Learner rank 0's end of the weight broadcast; see the module docstring.

    Example:
        publisher = BroadcastPublisher(advertise_host="learner-0", port=29600)
        fields = publisher.publish(engine.iter_full_params(), version=3)
        # -> WeightsPublished(version=3, **fields, ...)
        publisher.close()
    """

    def __init__(
        self,
        *,
        advertise_host: str = "127.0.0.1",
        port: int = 0,
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        timeout_s: float = 60.0,
        tied_aliases: Mapping[str, tuple[str, ...]] = TIED_ALIASES,
        zmq_fallback: ZmqPublisher | None = None,
    ) -> None:
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        self._timeout_s = timeout_s
        # The server listens on every interface; this object is also its one client, used only by the thread.
        self._store = dist.TCPStore(
            "127.0.0.1", port, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=timeout_s)
        )
        put(self._store, wb.GENERATION, "0")
        self.address = f"{advertise_host}:{self._store.port}"
        """``host:port`` of the rendezvous, as advertised to the rollout workers."""
        self.session = secrets.token_hex(8)
        self._packer = IpcPublisher(bucket_bytes, tied_aliases)  # its buckets, layout and checksum; no IPC
        self._zmq = zmq_fallback
        self._lock = threading.Lock()
        """Held by ``publish`` while it writes the buckets and by the thread while it broadcasts them."""
        self._current: tuple[int, str] | None = None
        """(version, checksum) in the buckets."""
        self._backend: str | None = None
        """``nccl`` or ``gloo``, from the device of the first version."""
        # thread state
        self._generation = 0
        self._members: list[str] = []
        self._group: Group | None = None
        self._next_op = 0
        self._joins_seen = 0
        self._join_gap_since: float | None = None
        self._regroup_needed = False
        self._known: set[str] = set()
        """Every member id ever registered."""
        self._left: set[str] = set()
        """Members that left on purpose."""
        self._leaves_seen = 0
        self._unresponsive: list[str] = []
        """Members that missed the last op's deadline: left out of the next generation (alive, they register again)."""
        self._delivered = (-1, -1)
        """(generation, version) last received and acknowledged by every member."""
        self.last_delivery: dict[str, float] = {}
        """Seconds of the last delivered version: ``ready_s`` (members ready), ``buckets_s`` (the
        broadcast calls), ``acks_s`` (acknowledgements), ``total_s``; plus ``version``, ``members``."""
        self._changed = threading.Condition()
        self._failure: BaseException | None = None
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._thread = threading.Thread(target=self._run, name="weights-broadcast", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ caller side
    @property
    def num_bytes(self) -> int:
        """Bytes of the tensors published (padding excluded)."""
        return self._packer.num_bytes

    @property
    def num_buckets(self) -> int:
        return self._packer.num_buffers

    @property
    def members(self) -> list[str]:
        """Member ids of the current generation, in rank order (rank 0, the learner, not included)."""
        with self._changed:
            return list(self._members)

    def publish(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> PublishedWeights:
        """Copy ``named_tensors`` (all on one device) into the buckets as ``version``; the broadcast
        runs in the background. The event's ``broadcast`` rendezvous carries the checksum (signed with
        the event, members load nothing else); with the ZMQ fallback the buckets are served there too.

        Waits while the previous version is still being broadcast. Raises RuntimeError if the
        broadcast thread died (its store failed).
        """
        self._check_alive()
        started = time.perf_counter()
        with self._lock:
            waited = time.perf_counter() - started
            checksum = self._packer.pack(named_tensors, version)
            self._current = (version, checksum)
            if self._backend is None:
                self._backend = "nccl" if self._packer.buffers[0].device.type == "cuda" else "gloo"
        self._wake.set()
        logger.info(
            "weights version %d ready to broadcast: %d bytes in %d buckets (%.1f ms; %.1f ms waiting for the "
            "previous broadcast)",
            version,
            self.num_bytes,
            self.num_buckets,
            (time.perf_counter() - started) * 1e3,
            waited * 1e3,
        )
        with self._changed:
            generation = self._generation
        broadcast = WeightsBroadcast(
            store=self.address,
            session=self.session,
            backend=self._backend,
            generation=generation,
            block_bytes=BLOCK_BYTES,
            bucket_bytes=[b.numel() for b in self._packer.buffers],
            tensors=self._packer.layout,
            checksum=checksum,
        )
        fields = PublishedWeights(
            transport="broadcast",
            checksum=checksum,
            num_bytes=self.num_bytes,
            num_buckets=self.num_buckets,
            endpoint="",
            ipc=None,
            broadcast=broadcast,
        )
        if self._zmq is not None:  # the event's checksum is then the ZMQ server's
            served = self._zmq.publish(self.tensors(), version)
            fields["checksum"], fields["endpoint"] = served["checksum"], served["endpoint"]
        return fields

    def tensors(self) -> list[tuple[str, torch.Tensor]]:
        """(name, view of the buckets) of the last published version, e.g. to feed the ZMQ server too;
        valid until the next :meth:`publish`."""
        names = [t.name for t in self._packer.layout]
        return list(zip(names, tensor_views(self._packer.buffers, self._packer.layout), strict=True))

    def wait_delivered(self, version: int, timeout_s: float, min_members: int = 1) -> list[str]:
        """Block until a group of at least ``min_members`` acknowledged ``version`` (or a newer one);
        returns its members. Raises TimeoutError naming the current members otherwise."""
        deadline = time.monotonic() + timeout_s
        with self._changed:
            while not (self._delivered[1] >= version and len(self._members) >= min_members):
                self._check_alive()
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise TimeoutError(
                        f"weights version {version} not delivered to {min_members} members within {timeout_s} s "
                        f"(generation {self._generation}, members {self._members}, delivered {self._delivered})"
                    )
                self._changed.wait(min(remaining, 0.1))
            return list(self._members)

    def close(self) -> None:
        """Stop the thread, leave the group and shut the store down (members see it gone)."""
        if self._zmq is not None:
            self._zmq.close()
        self._stop.set()
        self._wake.set()
        self._thread.join(timeout=self._timeout_s + 5)
        if self._group is not None:
            self._group.abort()
            self._group = None
        del self._store

    def _check_alive(self) -> None:
        if self._failure is not None:
            raise RuntimeError(f"the weight broadcast thread failed: {self._failure!r}") from self._failure

    # ------------------------------------------------------------------ thread side
    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                self._wake.wait(JOIN_POLL_S)
                self._wake.clear()
                if self._backend is None:  # nothing published: nobody can know the rendezvous yet
                    continue
                if self._backend == "nccl":  # this thread's CUDA calls go to the buckets' device
                    torch.cuda.set_device(self._packer.buffers[0].device)
                joiners = self._new_joiners()
                self._read_leaves()
                if joiners or self._regroup_needed or self._left.intersection(self._members):
                    self._regroup(joiners)
                self._deliver()
        except Exception as e:  # thread boundary: publish() re-raises it
            logger.exception("the weight broadcast thread failed")
            self._failure = e
            with self._changed:
                self._changed.notify_all()

    def _new_joiners(self) -> list[str]:
        """Ids registered since the last look (``join/{n}`` is set just after the counter moves)."""
        count = self._store.add(wb.JOINS, 0)
        joiners = []
        while self._joins_seen < count:
            key = wb.join_key(self._joins_seen + 1)
            if not self._store.check([key]):
                now = time.monotonic()
                self._join_gap_since = self._join_gap_since or now
                if now - self._join_gap_since < self._timeout_s:
                    break  # the member is between its two calls: look again later
                logger.warning(
                    "weight broadcast: registration %d never named its member: skipped", self._joins_seen + 1
                )
            else:
                joiners.append(self._store.get(key).decode())
                self._known.add(joiners[-1])
            self._join_gap_since = None
            self._joins_seen += 1
        return joiners

    def _wait_keys(self, keys: Mapping[str, str], deadline: float) -> list[str]:
        """Wait until every key of ``{member: key}`` is set or ``deadline``; returns the members still
        missing (those that left are missing at once)."""
        pause = 0.0002  # members usually answer within a millisecond: look often at first
        while True:
            self._read_leaves()
            gone = [m for m in keys if m in self._left]
            waiting = [key for m, key in keys.items() if m not in self._left]
            if not waiting or self._store.check(waiting):
                return gone
            if time.monotonic() > deadline or self._stop.is_set():
                return gone + [m for m, key in keys.items() if m not in self._left and not self._store.check([key])]
            time.sleep(pause)
            pause = min(2 * pause, wb.POLL_S)

    def _read_leaves(self) -> None:
        """Note who left since the last look (one round trip unless someone did)."""
        count = self._store.add(wb.LEAVES, 0)
        if count != self._leaves_seen:
            self._leaves_seen = count
            self._left.update(m for m in self._known - self._left if self._store.check([wb.leave_key(m)]))

    def _missing(self, members: list[str]) -> str:
        """``members`` as a log phrase: who left, who missed the deadline."""
        return ", ".join(
            f"{m} ({'left' if m in self._left else f'no answer in {self._timeout_s:g} s'})" for m in members
        )

    def _set_members(self, generation: int, members: list[str]) -> None:
        with self._changed:
            self._generation, self._members = generation, members
            self._changed.notify_all()

    def _regroup(self, joiners: list[str]) -> None:
        """Form the next generation from the members plus ``joiners``, dropping whoever does not come."""
        leaving = set(self._unresponsive) | self._left
        candidates = [m for m in dict.fromkeys(self._members + joiners) if m not in leaving]
        self._unresponsive = []
        if self._group is not None or self._members:  # members of the old generation wait for its next op
            put(self._store, wb.op_key(self._generation, self._next_op), wb.encode(wb.RegroupOp(self._generation + 1)))
        if self._group is not None:
            self._group.abort()
            self._group = None
        self._regroup_needed = False
        assert self._backend is not None
        while not self._stop.is_set():
            generation = self._generation + 1
            put(self._store, wb.members_key(generation), wb.encode(wb.GroupMembers(candidates, self._joins_seen)))
            put(self._store, wb.GENERATION, str(generation))
            self._set_members(generation, [])
            if not candidates:
                return
            deadline = time.monotonic() + self._timeout_s
            missing = self._wait_keys({m: wb.ready_key(generation, m) for m in candidates}, deadline)
            if missing:
                put(self._store, wb.start_key(generation), wb.encode(wb.GroupStart(ok=False, missing=missing)))
                logger.warning("weight broadcast: dropped from generation %d: %s", generation, self._missing(missing))
                candidates = [c for c in candidates if c not in missing]
                continue
            put(self._store, wb.start_key(generation), wb.encode(wb.GroupStart(ok=True)))
            device = self._packer.buffers[0].device
            store = dist.PrefixStore(wb.group_prefix(generation), self._store)
            self._next_op = 0
            try:
                self._group = new_group(store, 0, len(candidates) + 1, self._backend, self._timeout_s, device)
            except RuntimeError as e:  # a member died after it said ready: it will not be ready next time
                logger.warning("weight broadcast: building generation %d failed (%s): re-forming", generation, e)
                self._set_members(generation, candidates)
                self._regroup_needed = True
                return
            self._set_members(generation, candidates)
            logger.info(
                "weight broadcast: generation %d of %d members: %s", generation, len(candidates), ", ".join(candidates)
            )
            return

    def _deliver(self) -> None:
        """Broadcast the current version to the current generation unless it has it already."""
        generation, members = self._generation, self._members
        with self._lock:
            current = self._current
            if self._group is None or current is None or self._delivered == (generation, current[0]):
                return
            version, checksum = current
            op = self._next_op
            self._next_op += 1
            deadline = time.monotonic() + self._timeout_s
            started = time.perf_counter()
            put(self._store, wb.op_key(generation, op), wb.encode(wb.BroadcastOp(version, checksum)))
            ranks = {m: wb.op_ready_key(generation, op, rank) for rank, m in enumerate(members, start=1)}
            missing = self._wait_keys(ranks, deadline)
            failure = f"not ready: {self._missing(missing)}" if missing else None
            self._unresponsive = missing
            ready = time.perf_counter()
            if failure is None:
                failure = self._broadcast_buckets(deadline)
            sent = time.perf_counter()
        if failure is not None:
            put(self._store, wb.abort_key(generation, op), b"1")
            logger.warning(
                "weight broadcast of version %d to generation %d failed: %s; re-forming the group",
                version,
                generation,
                failure,
            )
            self._regroup_needed = True
            return
        acks = {m: wb.ack_key(generation, op, rank) for rank, m in enumerate(members, start=1)}
        missing = self._wait_keys(acks, deadline)
        for member, key in acks.items():
            if member in missing:
                continue
            ack = wb.decode_ack(self._store.get(key))
            if ack.error or ack.checksum != checksum:
                logger.error(
                    "weight broadcast: %s failed version %d: %s",
                    member,
                    version,
                    ack.error or f"checksum {ack.checksum}, published {checksum}",
                )
        if missing:
            logger.warning(
                "weight broadcast: version %d not acknowledged by %s: re-forming the group",
                version,
                self._missing(missing),
            )
            self._unresponsive = missing
            self._regroup_needed = True
            return
        done = time.perf_counter()
        with self._changed:
            self._delivered = (generation, version)
            self.last_delivery = {
                "version": version,
                "members": len(members),
                "ready_s": ready - started,
                "buckets_s": sent - ready,
                "acks_s": done - sent,
                "total_s": done - started,
            }
            self._changed.notify_all()
        logger.info(
            "weight broadcast: version %d to %d members in %.1f ms (buckets %.1f ms; generation %d)",
            version,
            len(members),
            (done - started) * 1e3,
            (sent - ready) * 1e3,
            generation,
        )

    def _broadcast_buckets(self, deadline: float) -> str | None:
        """Broadcast every bucket from rank 0; None, or why it failed (the group is then aborted)."""
        assert self._group is not None
        options = dist.BroadcastOptions()
        options.rootRank = 0
        buffers = self._packer.buffers
        for index, bucket in enumerate(buffers):
            try:
                done = wait_work(self._group.broadcast([bucket], options), deadline)
            except RuntimeError as e:  # gloo/NCCL: a member closed its connection or the collective timed out
                return f"bucket {index + 1}/{len(buffers)}: {e}"
            if not done:
                self._group.abort()
                return f"bucket {index + 1}/{len(buffers)} missed the {self._timeout_s:g} s deadline"
        return None
