"""CUDA IPC buffer sets without a GPU (streamrl.torchkit.weights.ipc_sets, and IpcPublisher.pack per set):
the rotation, a reader still copying holds its set back, a stuck reader is waited for a bounded time,
a dead one releases with its process, a superseded version is refused before a byte is copied, and one
set rewrites the same buffers every version as before."""

from __future__ import annotations

import fcntl
import logging
import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from streamrl.common.errors import WeightSyncError
from streamrl.torchkit.flat import tensor_views, weights_checksum
from streamrl.torchkit.weights.ipc import IpcPublisher
from streamrl.torchkit.weights.ipc_sets import WRITING, BufferSets, SetReader, _read_word


@pytest.fixture
def sets(tmp_path: Path) -> Iterator[BufferSets]:
    guard = BufferSets(2, wait_s=5.0, directory=str(tmp_path))
    yield guard
    guard.close()


def _publish(guard: BufferSets, version: int) -> int:
    with guard.claim(version) as index:
        return index


def _word(guard: BufferSets, index: int) -> int:
    fd = os.open(guard.path(index), os.O_RDONLY)
    try:
        return _read_word(fd)
    finally:
        os.close(fd)


def test_two_sets_alternate_and_each_records_its_version(sets: BufferSets) -> None:
    assert [_word(sets, i) for i in range(2)] == [WRITING, WRITING]  # nothing published yet
    assert [_publish(sets, v) for v in range(1, 6)] == [0, 1, 0, 1, 0]
    assert (_word(sets, 0), _word(sets, 1)) == (5, 4)
    assert sets.path(0) != sets.path(1) and sets.forced_writes == 0


def test_one_set_rewrites_the_same_buffers_every_version(tmp_path: Path) -> None:
    guard = BufferSets(1, wait_s=5.0, directory=str(tmp_path))
    try:
        assert [_publish(guard, v) for v in range(3)] == [0, 0, 0]
        reader = SetReader()
        with reader.reading(guard.path(0), 0, 2):  # the newest version reads as before
            pass
        with pytest.raises(WeightSyncError, match=r"version 1 superseded: .* set 0 holds version 2 now"):
            with reader.reading(guard.path(0), 0, 1):
                pytest.fail("a superseded version must not be copied")
        reader.close()
    finally:
        guard.close()


def test_a_reader_still_copying_holds_its_set_back_until_it_releases(sets: BufferSets) -> None:
    _publish(sets, 1)  # set 0
    _publish(sets, 2)  # set 1
    reader = SetReader()
    copying = reader.reading(sets.path(0), 0, 1)
    copying.__enter__()  # an engine mid-copy of version 1
    claimed = threading.Event()

    def learner() -> None:
        with sets.claim(3) as index:  # set 0 again
            assert index == 0
            claimed.set()

    thread = threading.Thread(target=learner)
    thread.start()
    time.sleep(0.3)
    assert not claimed.is_set()  # the learner waits: version 1 is still being read
    assert _word(sets, 0) == 1
    copying.__exit__(None, None, None)  # the copy finished: the reader's release is its ack
    thread.join(timeout=5)
    assert claimed.is_set() and sets.forced_writes == 0 and _word(sets, 0) == 3
    with reader.reading(sets.path(1), 1, 2):  # the other set was free all along
        pass
    reader.close()


def test_a_stuck_reader_is_waited_for_a_bounded_time_then_written_over_with_a_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    guard = BufferSets(2, wait_s=0.2, directory=str(tmp_path))
    try:
        _publish(guard, 1)
        _publish(guard, 2)
        reader = SetReader()
        stuck = reader.reading(guard.path(0), 0, 1)
        stuck.__enter__()  # never leaves
        started = time.monotonic()
        with caplog.at_level(logging.WARNING):
            assert _publish(guard, 3) == 0
        assert 0.2 <= time.monotonic() - started < 2.0
        assert guard.forced_writes == 1 and _word(guard, 0) == 3
        assert "still held buffer set 0 (version 1) after 0.2 s" in caplog.text
        assert "writing version 3 into it anyway" in caplog.text and "1 forced writes so far" in caplog.text
        assert _publish(guard, 4) == 1  # the other set is not held: no wait
        assert guard.forced_writes == 1
        stuck.__exit__(None, None, None)
        reader.close()
    finally:
        guard.close()


def test_a_dead_reader_releases_its_set_with_its_process(sets: BufferSets) -> None:
    _publish(sets, 1)
    _publish(sets, 2)
    fd = os.open(sets.path(0), os.O_RDONLY)  # a reader's descriptor, mid-copy ...
    fcntl.flock(fd, fcntl.LOCK_SH)
    os.close(fd)  # ... and its process dies: the kernel drops the lock with the last descriptor
    started = time.monotonic()
    assert _publish(sets, 3) == 0
    assert time.monotonic() - started < 1.0 and sets.forced_writes == 0


def test_a_set_being_written_is_refused_before_anything_is_copied(sets: BufferSets) -> None:
    _publish(sets, 1)
    _publish(sets, 2)
    reader = SetReader()
    with sets.claim(3):  # the learner writes version 3 into set 0
        with pytest.raises(WeightSyncError, match=r"version 1 superseded: the learner is writing a newer version"):
            with reader.reading(sets.path(0), 0, 1):
                pytest.fail("must not copy a set being written")
    with pytest.raises(WeightSyncError, match=r"version 1 superseded: .* set 0 holds version 3 now"):
        with reader.reading(sets.path(0), 0, 1):
            pytest.fail("must not copy a rewritten set")
    reader.close()


def test_a_failed_write_leaves_the_set_marked_and_the_next_claim_takes_it_again(sets: BufferSets) -> None:
    _publish(sets, 1)
    with pytest.raises(RuntimeError, match="pack failed"), sets.claim(2) as index:
        assert index == 1
        raise RuntimeError("pack failed")
    assert _word(sets, 1) == WRITING and sets.next_set == 1
    reader = SetReader()
    with pytest.raises(WeightSyncError, match="holds a version being written"):
        with reader.reading(sets.path(1), 1, 2):
            pass
    reader.close()
    assert _publish(sets, 3) == 1 and _word(sets, 1) == 3


def test_a_reader_lock_that_cannot_be_opened_names_dev_shm(tmp_path: Path) -> None:
    with pytest.raises(WeightSyncError, match=r"must share /dev/shm"):
        with SetReader().reading(str(tmp_path / "missing.lock"), 0, 1):
            pass


def test_a_new_learner_s_lock_file_replaces_the_old_one(tmp_path: Path) -> None:
    old, new = BufferSets(1, 1.0, str(tmp_path)), BufferSets(1, 1.0, str(tmp_path))
    try:
        _publish(old, 1)
        _publish(new, 1)
        reader = SetReader()
        with reader.reading(old.path(0), 0, 1):
            pass
        with reader.reading(new.path(0), 0, 1):
            pass
        assert list(reader._files) == [0] and reader._files[0][0] == new.path(0)
        reader.close()
    finally:
        old.close()
        new.close()
    assert not list(tmp_path.iterdir())  # close removes the lock files


@pytest.mark.parametrize("num_sets", [0, 5])
def test_the_number_of_sets_is_checked_at_start(num_sets: int, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"learner.weights_ipc_buffer_sets must be 1..4"):
        BufferSets(num_sets, 1.0, str(tmp_path))
    with pytest.raises(ValueError, match=r"learner.weights_ipc_buffer_sets must be 1..4"):
        IpcPublisher(num_sets=num_sets)


def _weights(seed: int) -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [
        ("model.embed_tokens.weight", torch.randn(20, 8, generator=g).to(torch.bfloat16)),
        ("model.layers.0.mlp.up_proj.weight", torch.randn(16, 8, generator=g)),
        ("model.norm.weight", torch.randn(8, generator=g)),
    ]


def test_the_publisher_packs_each_version_into_its_set_and_leaves_the_other_alone() -> None:
    publisher = IpcPublisher(bucket_bytes=2**20, num_sets=2)
    first = publisher.pack(_weights(1), 1, buffer_set=0)
    set0 = [b.clone() for b in publisher.buffers]
    second = publisher.pack(iter(_weights(2)), 2, buffer_set=1)  # set 1 allocated at its first use
    assert publisher.buffers is publisher._sets[1].buffers and len(publisher._sets) == 2
    assert all(torch.equal(a, b) for a, b in zip(set0, publisher._sets[0].buffers, strict=True))  # untouched
    assert weights_checksum(publisher._sets[0].buffers, 1) == first
    assert weights_checksum(publisher._sets[1].buffers, 2) == second
    views = dict(
        zip([t.name for t in publisher.layout], tensor_views(publisher.buffers, publisher.layout), strict=True)
    )
    for name, tensor in _weights(2):
        assert torch.equal(views[name], tensor)
    assert torch.equal(views["lm_head.weight"], dict(_weights(2))["model.embed_tokens.weight"])  # tied head, set 1
    third = publisher.pack(iter(_weights(3)), 3, buffer_set=0)
    assert weights_checksum(publisher._sets[0].buffers, 3) == third != first
    assert weights_checksum(publisher._sets[1].buffers, 2) == second


def test_one_set_packs_every_version_into_the_same_buffers() -> None:
    publisher = IpcPublisher(bucket_bytes=2**20)
    publisher.pack(_weights(1), 1)
    buffers = publisher.buffers
    publisher.pack(iter(_weights(2)), 2)
    assert publisher.buffers is buffers and list(publisher._sets) == [0]
