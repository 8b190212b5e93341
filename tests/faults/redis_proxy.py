"""A fault-injecting TCP proxy between services and redis-server, on 127.0.0.1.

:class:`FaultProxy` runs one asyncio loop in a thread and listens on one port per service
(:meth:`FaultProxy.listen`); a service given that URL instead of Redis's talks to Redis through it.
It parses RESP both ways (:mod:`resp`), so it knows where each command and each reply ends, and
names each command (:func:`resp.command_kind`: ``XADD batches``, ``EVALSHA bus.COMMIT_LUA
trajectories``, ``MULTI[XADD batches, INCR state:batch_index]`` for a transaction: its distinct
commands in order; each command of a pipeline on its own).

What it does with a reply is its :class:`Policy`'s call, asked once per complete reply (or, for one reply,
:meth:`FaultProxy.drop_reply_to`: the next command whose bytes hold a marker):

* pass it through (no policy, the default);
* **lose it**: the command was forwarded and Redis ran it, Redis's reply is read, and then the
  client's connection is closed instead of forwarding the reply (and the connection to Redis with
  it). The client cannot know whether the command ran; redis-py's outage retry sends it again on a
  new connection. :class:`LoseEachKind` loses the first reply of each kind of write one service
  makes, one kind at a time; :class:`LoseRandom` loses a fraction of all write replies.

Error replies are never lost (the command had no effect), nor the empty reply of a read from a
consumer group (nothing was delivered). Every command seen is logged as (service, kind, is_write)
with a count (:attr:`FaultProxy.seen`), and every lost reply as a :class:`LostReply`.
"""

from __future__ import annotations

import asyncio
import random
import threading
import time
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass, field

from resp import ScriptNames, command_kind, is_write, next_frame, parse_command

READ_CHUNK = 1 << 16
EMPTY_REPLIES = (b"*-1\r\n", b"*0\r\n", b"_\r\n", b"$-1\r\n")
GROUP_READS = ("XREADGROUP", "XAUTOCLAIM")


@dataclass(frozen=True)
class LostReply:
    at: float
    service: str
    kind: str


Policy = Callable[[str, str, bool, float], bool]
"""``policy(service, kind, is_write, now) -> lose?``, asked for each complete non-error reply."""


@dataclass
class LoseEachKind:
    """Lose one reply (``times`` replies) of each kind of write ``service`` makes, in the order the
    kinds come up, at most one loss every ``gap_s`` seconds (so the service recovers from one before
    the next), after ``after`` (time.time()) if given. ``skip``: kinds never lost (prefixes)."""

    service: str
    gap_s: float = 2.0
    times: int = 1
    after: float = 0.0
    skip: tuple[str, ...] = ()
    only: tuple[str, ...] = ()
    """If set, only kinds starting with one of these are lost."""
    lost: Counter[str] = field(default_factory=Counter)
    last_loss: float = 0.0

    def __call__(self, service: str, kind: str, write: bool, now: float) -> bool:
        if service != self.service or not write or now < self.after or now - self.last_loss < self.gap_s:
            return False
        if self.lost[kind] >= self.times or any(kind.startswith(s) for s in self.skip):
            return False
        if self.only and not any(kind.startswith(s) for s in self.only):
            return False
        self.lost[kind] += 1
        self.last_loss = now
        return True


@dataclass
class LoseRandom:
    """Lose each write reply with probability ``fraction`` (every service, or those named)."""

    fraction: float
    seed: int = 0
    services: tuple[str, ...] = ()
    rng: random.Random = field(init=False)

    def __post_init__(self) -> None:
        if not 0.0 <= self.fraction <= 1.0:
            raise ValueError(f"fraction must be in [0, 1], got {self.fraction}")
        self.rng = random.Random(self.seed)

    def __call__(self, service: str, kind: str, write: bool, now: float) -> bool:
        if not write or (self.services and service not in self.services):
            return False
        return self.rng.random() < self.fraction


class FaultProxy:
    """See the module docstring. ``close()`` stops every listener and connection."""

    def __init__(self, upstream_port: int, scripts: ScriptNames | None = None) -> None:
        self.upstream_port = upstream_port
        self.scripts = scripts or ScriptNames()
        self.policy: Policy | None = None
        self.marker: bytes | None = None
        """Set by :meth:`drop_reply_to`: the next command holding it loses its reply."""
        self.seen: Counter[tuple[str, str, bool]] = Counter()
        self.lost: list[LostReply] = []
        self.forwarded = 0
        """Replies passed on so far."""
        self._lock = threading.Lock()
        self._urls: dict[str, str] = {}
        self._servers: list[asyncio.Server] = []
        self._conns: set[asyncio.StreamWriter] = set()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="fault-proxy", daemon=True)
        self._thread.start()

    # -- control (any thread) ---------------------------------------------------------------
    def listen(self, service: str) -> str:
        """The URL of ``service``'s listener (started on first use)."""
        with self._lock:
            if service in self._urls:
                return self._urls[service]
        port = asyncio.run_coroutine_threadsafe(self._listen(service), self._loop).result(10)
        url = f"redis://127.0.0.1:{port}"
        with self._lock:
            self._urls[service] = url
        return url

    def set_policy(self, policy: Policy | None) -> None:
        with self._lock:
            self.policy = policy

    def drop_reply_to(self, marker: bytes) -> None:
        """Lose the reply of the next command whose bytes hold ``marker`` (a key, a script's SHA1, ``EXEC``; a
        command queued in a transaction: its EXEC's reply), once: the client's re-send goes through. An error
        reply is not lost (the command had no effect), and the marker is spent all the same."""
        with self._lock:
            self.marker = marker

    @property
    def armed(self) -> bool:
        """A :meth:`drop_reply_to` marker waits for its command."""
        with self._lock:
            return self.marker is not None

    def writes_by_service(self) -> dict[str, list[str]]:
        """Every kind of write seen, by service (sorted)."""
        out: dict[str, set[str]] = {}
        with self._lock:
            for service, kind, write in self.seen:
                if write:
                    out.setdefault(service, set()).add(kind)
        return {s: sorted(k) for s, k in sorted(out.items())}

    def lost_by_kind(self, service: str | None = None) -> dict[str, int]:
        with self._lock:
            return dict(
                Counter(
                    f"{r.service}: {r.kind}" if service is None else r.kind
                    for r in self.lost
                    if service is None or r.service == service
                )
            )

    def close(self) -> None:
        if self._loop.is_closed():
            return
        asyncio.run_coroutine_threadsafe(self._shutdown(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)
        self._loop.close()

    # -- the loop ---------------------------------------------------------------------------
    async def _listen(self, service: str) -> int:
        server = await asyncio.start_server(lambda r, w: self._serve(service, r, w), "127.0.0.1", 0, limit=READ_CHUNK)
        self._servers.append(server)
        return int(server.sockets[0].getsockname()[1])

    async def _shutdown(self) -> None:
        for server in self._servers:
            server.close()
        for w in list(self._conns):
            w.transport.abort()
        for server in self._servers:
            await server.wait_closed()

    async def _serve(self, service: str, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.upstream_port)
        except OSError:  # redis is down: the client sees a refused connection, as it would without us
            writer.transport.abort()
            return
        self._conns |= {writer, up_writer}
        expected: deque[tuple[str, bool, bool]] = deque()
        tasks = [
            asyncio.create_task(self._requests(service, reader, up_writer, expected)),
            asyncio.create_task(self._replies(service, up_reader, writer, expected)),
        ]
        try:
            await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for t in tasks:
                t.cancel()
            for w in (writer, up_writer):
                w.transport.abort()
                self._conns.discard(w)

    async def _requests(
        self,
        service: str,
        reader: asyncio.StreamReader,
        up: asyncio.StreamWriter,
        expected: deque[tuple[str, bool, bool]],
    ) -> None:
        """Forward commands, noting for each reply to come its command's kind, whether it writes, and whether it
        is to be lost (:meth:`drop_reply_to`)."""
        buf = bytearray()
        multi: list[tuple[str, bool]] | None = None
        multi_marked = False
        while data := await reader.read(READ_CHUNK):
            buf += data
            pos = 0
            while (parsed := parse_command(buf, pos)) is not None:
                start = pos
                args, pos = parsed
                marked = self._marked(bytes(buf[start:pos]))
                name = args[0].upper() if args else b""
                kind, write = command_kind(args, self.scripts), is_write(args)
                if name == b"MULTI":
                    multi, multi_marked = [], marked
                    expected.append(("MULTI", False, False))
                elif name == b"EXEC" and multi is not None:
                    kind = "MULTI[" + ", ".join(dict.fromkeys(k for k, _ in multi)) + "]"
                    write = any(w for _, w in multi)
                    expected.append((kind, write, marked or multi_marked))  # the transaction ran at its EXEC
                    multi = None
                elif name == b"DISCARD":
                    multi = None
                    expected.append(("DISCARD", False, False))
                elif multi is not None:
                    multi.append((kind, write))
                    multi_marked |= marked
                    expected.append(("QUEUED", False, False))
                    continue  # logged with its EXEC
                else:
                    expected.append((kind, write, marked))
                with self._lock:
                    self.seen[(service, kind, write)] += 1
            del buf[:pos]
            up.write(data)
            await up.drain()

    def _marked(self, command: bytes) -> bool:
        """Whether ``command`` (its raw bytes) holds the :meth:`drop_reply_to` marker (which it then spends)."""
        with self._lock:
            if self.marker is None or self.marker not in command:
                return False
            self.marker = None
            return True

    async def _replies(
        self,
        service: str,
        up: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        expected: deque[tuple[str, bool, bool]],
    ) -> None:
        buf = bytearray()
        while data := await up.read(READ_CHUNK):
            buf += data
            pos = 0
            while (end := next_frame(buf, pos)) is not None:
                kind, write, marked = expected.popleft() if expected else ("(out of band)", False, False)
                if self._lose(service, kind, write, bytes(buf[pos : min(end, pos + 8)]), marked):
                    writer.write(bytes(buf[:pos]))  # the replies before it still arrive
                    await writer.drain()
                    return  # _serve closes both connections
                self.forwarded += 1
                pos = end
            if pos:
                writer.write(bytes(buf[:pos]))
                del buf[:pos]
                await writer.drain()

    def _lose(self, service: str, kind: str, write: bool, head: bytes, marked: bool = False) -> bool:
        if head.startswith(b"-") or (kind.startswith(GROUP_READS) and head in EMPTY_REPLIES):
            return False
        now = time.time()
        with self._lock:
            if not marked and (self.policy is None or not self.policy(service, kind, write, now)):
                return False
            self.lost.append(LostReply(now, service, kind))
        return True
