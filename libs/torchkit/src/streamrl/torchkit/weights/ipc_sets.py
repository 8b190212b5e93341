"""CUDA IPC weight buffer sets: which set a version goes to, and the readers' release of a set (no torch, no CUDA).

The learner keeps ``num_sets`` sets of flat buffers (``learner.weights_ipc_buffer_sets``) and writes
version after version into them in turn, so an engine has a whole training step to copy the version
it was told about before that set is written again. A set is never rewritten while an engine is
still copying it: every set has a small lock file on the learner's host (``/dev/shm``, which CUDA IPC
already needs shared between the learner and its engines), named in the version's
:class:`~streamrl.common.messages.IpcWeights` (``reader_lock``).

* An engine (:class:`SetReader`) holds a shared ``flock`` on the set's file while it copies, and checks
  under it that the set still holds the version it was told about (the file's first 8 bytes); a set
  being or already rewritten is refused as superseded (the newer version is in the other set, or on its
  way), before a byte is copied. Releasing the lock is the reader's acknowledgement: no Redis round trip.
* The learner (:class:`BufferSets`) takes the exclusive ``flock`` of the next set before it writes it,
  marks the set as being written, packs, then records the new version and releases. A reader that died
  releases its lock with its process (the kernel drops it); a reader that hangs mid-copy is waited for
  ``wait_s`` at most, then the set is written anyway with a warning and counted in ``forced_writes``
  - that reader's copy then fails the checksum and it skips the version (as every reader did before
  the locks).

With one set this is today's memory: every version rewrites the same buffers, after the readers of
the previous one finished; an engine that had not started its copy by then skips to the new version.
"""

from __future__ import annotations

import fcntl
import logging
import os
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager

from streamrl.common.errors import WeightSyncError

logger = logging.getLogger(__name__)

WRITING = -1
"""The version word of a set being written (or never written)."""
POLL_S = 0.002
"""How often the learner tries again for a set a reader holds."""
MAX_SETS = 4


def lock_dir() -> str:
    """Where the learner puts the sets' lock files: ``/dev/shm`` (shared with the engines like torch's
    CUDA IPC reference counters), else the temporary directory."""
    return "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()


def _read_word(fd: int) -> int:
    data = os.pread(fd, 8, 0)
    return int.from_bytes(data, "little", signed=True) if len(data) == 8 else WRITING


def _write_word(fd: int, version: int) -> None:
    os.pwrite(fd, version.to_bytes(8, "little", signed=True), 0)


def check_num_sets(num_sets: int) -> None:
    if not 1 <= num_sets <= MAX_SETS:
        raise ValueError(f"learner.weights_ipc_buffer_sets must be 1..{MAX_SETS}, got {num_sets}")


class BufferSets:
    """The learner's end: the rotation over ``num_sets`` sets and their lock files (see the module docstring).

    Example:
        sets = BufferSets(2, wait_s=10.0)
        with sets.claim(version=7) as index:  # waits (bounded) for the readers of set ``index``
            pack_into(index)                 # the set's version is recorded when the block ends
        sets.path(index)                     # goes into the event
    """

    def __init__(self, num_sets: int, wait_s: float, directory: str | None = None) -> None:
        check_num_sets(num_sets)
        if wait_s <= 0:
            raise ValueError(f"wait_s must be > 0, got {wait_s}")
        self.wait_s = wait_s
        self.forced_writes = 0
        """Sets written while a reader still held them (it waited ``wait_s``): each costs that reader a version."""
        self._next = 0
        self._paths: list[str] = []
        self._fds: list[int] = []
        where = directory or lock_dir()
        for index in range(num_sets):
            fd, path = tempfile.mkstemp(prefix="streamrl-ipc-", suffix=f"-set{index}.lock", dir=where)
            _write_word(fd, WRITING)
            self._fds.append(fd)
            self._paths.append(path)

    @property
    def num_sets(self) -> int:
        return len(self._fds)

    @property
    def next_set(self) -> int:
        """The set the next :meth:`claim` writes."""
        return self._next

    def path(self, index: int) -> str:
        """The lock file of set ``index`` (what ``IpcWeights.reader_lock`` names)."""
        return self._paths[index]

    @contextmanager
    def claim(self, version: int) -> Iterator[int]:
        """Take the next set for ``version``: yields its index once no reader holds it (or ``wait_s`` passed).
        When the block ends the set holds ``version`` and the rotation moves on; when it raises, the set is
        left marked as being written (its old version is gone) and the next claim takes it again."""
        index = self._next
        fd = self._fds[index]
        locked = self._lock(fd, index, version)
        try:
            _write_word(fd, WRITING)
            yield index
            _write_word(fd, version)
            self._next = (index + 1) % len(self._fds)
        finally:
            if locked:
                fcntl.flock(fd, fcntl.LOCK_UN)

    def _lock(self, fd: int, index: int, version: int) -> bool:
        deadline = time.monotonic() + self.wait_s
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return True
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    break
                time.sleep(POLL_S)
        self.forced_writes += 1
        logger.warning(
            "CUDA IPC weights: a reader still held buffer set %d (version %d) after %.1f s (an engine stuck "
            "mid-copy?): writing version %d into it anyway; that reader's copy fails its checksum and it skips "
            "the version (%d forced writes so far)",
            index,
            _read_word(fd),
            self.wait_s,
            version,
            self.forced_writes,
        )
        return False

    def close(self) -> None:
        """Close and remove the lock files (readers holding them keep theirs until they close)."""
        for fd, path in zip(self._fds, self._paths, strict=True):
            os.close(fd)
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass
        self._fds, self._paths = [], []


class SetReader:
    """An engine's end: holds a set's lock while its copy runs (see the module docstring).

    Example:
        reader = SetReader()
        with reader.reading(ipc.reader_lock, ipc.buffer_set, version):  # WeightSyncError if superseded
            copy_and_verify()
    """

    def __init__(self) -> None:
        self._files: dict[int, tuple[str, int]] = {}
        """Set index -> (lock file path, its descriptor): opened once per learner."""

    @contextmanager
    def reading(self, path: str, index: int, version: int) -> Iterator[None]:
        """Hold set ``index``'s lock (file ``path``) for the block; raises :class:`WeightSyncError` before the
        block when the set no longer holds ``version`` or is being rewritten."""
        fd = self._open(path, index)
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            raise WeightSyncError(
                f"version {version} superseded: the learner is writing a newer version into its CUDA IPC "
                f"buffer set {index}; nothing copied"
            ) from None
        try:
            held = _read_word(fd)
            if held != version:
                raise WeightSyncError(
                    f"version {version} superseded: the learner's CUDA IPC buffer set {index} holds "
                    f"{'a version being written' if held == WRITING else f'version {held}'} now; nothing copied"
                )
            yield
        finally:
            fcntl.flock(fd, fcntl.LOCK_UN)

    def _open(self, path: str, index: int) -> int:
        known = self._files.get(index)
        if known is not None and known[0] == path:
            return known[1]
        if known is not None:  # a new learner: its sets have new files
            os.close(known[1])
            del self._files[index]
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError as e:
            raise WeightSyncError(
                f"cannot open the learner's CUDA IPC reader lock {path}: {e} (the learner and its engines must "
                "share /dev/shm, as CUDA IPC itself needs)"
            ) from e
        self._files[index] = (path, fd)
        return fd

    def close(self) -> None:
        for _, fd in self._files.values():
            os.close(fd)
        self._files = {}
