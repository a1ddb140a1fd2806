"""HostBuffer.detach: a buffer moves, at the same address, onto fresh memory that holds
its bytes, under a new id, so that whoever mapped the old memory (a daemon still running
a call the worker gave up on) no longer reaches what the worker reads and writes."""

from __future__ import annotations

import contextlib
import errno
import fcntl
import gc
import mmap
import os
import signal
import threading
import time
import weakref
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

import proto
from client.errors import CommTimeout, LimitExceeded
from client.hostmem import HostBuffer, HostMemory
from client.memory import MemoryResolver
from client.moves import InFlight
from client.opcache import OpCache
from tests.conftest import garbage

pytestmark = pytest.mark.timeout(30)


class Heard:
    """The ids a table's release listeners hear of."""

    def __init__(self, memory: HostMemory) -> None:
        self.ids: list[int] = []
        memory.on_release(self.release)

    def release(self, buffer_id: int) -> None:
        self.ids.append(buffer_id)


def mapped_elsewhere(buffer: HostBuffer) -> mmap.mmap:
    """The buffer's memory as another process (the daemon) maps it: from its fd."""
    return mmap.mmap(buffer.fd, buffer.size)


@contextlib.contextmanager
def interrupted_while_held(lock: threading.RLock, first: threading.Event | None = None
                           ) -> Iterator[threading.Event]:
    """Another thread holds `lock` (once `first` is set, if given) and, holding it, sends
    this thread a real SIGINT 0.2 s later (what waits for the lock meanwhile meets the
    interrupt there), then lets go. Yields the event set once the lock is held."""
    held = threading.Event()

    def hold_then_ctrl_c() -> None:
        if first is not None:
            assert first.wait(5)
        with lock:
            held.set()
            time.sleep(0.2)
            signal.pthread_kill(threading.main_thread().ident, signal.SIGINT)  # type: ignore[arg-type]
            time.sleep(0.2)

    holder = threading.Thread(target=hold_then_ctrl_c)
    holder.start()
    try:
        yield held
    finally:
        holder.join(5)


def test_the_worker_keeps_its_bytes_and_the_old_mapping_no_longer_reaches_them() -> None:
    memory = HostMemory()
    buffer = memory.alloc(1 << 20)
    ours = buffer.view(np.int32)
    ours[:] = np.arange(ours.size)
    daemons = mapped_elsewhere(buffer)
    theirs = np.frombuffer(daemons, np.int32)
    old_id, fd, ptr = buffer.id, buffer.fd, buffer.ptr
    assert buffer.detach()
    assert buffer.id > old_id
    assert (buffer.fd, buffer.ptr) == (fd, ptr)  # (the same fd number, now naming the fresh memory)
    assert np.array_equal(ours, np.arange(ours.size))  # a view made before sees the same bytes
    theirs[:4] = -7  # the daemon goes on writing the old memory
    ours[4] = 99
    assert ours[:5].tolist() == [0, 1, 2, 3, 99]
    assert theirs[4] == 4
    later = mapped_elsewhere(buffer)  # a later import maps what the worker sees
    assert np.frombuffer(later, np.int32)[:5].tolist() == [0, 1, 2, 3, 99]
    del ours, theirs
    for mapping in (daemons, later):
        mapping.close()
    buffer.close()


def test_the_table_finds_it_under_its_new_id_and_listeners_hear_of_the_old() -> None:
    memory = HostMemory()
    heard = Heard(memory)
    buffer = memory.alloc(64)
    old_id = buffer.id
    releases = memory.releases
    assert buffer.detach()
    assert heard.ids == [old_id]
    assert memory.releases > releases  # ops built from its address before are stale
    found, offset = memory.find(buffer.ptr + 8, 8)
    assert found is buffer and offset == 8 and found.id != old_id
    new_id = buffer.id
    buffer.close()
    assert heard.ids == [old_id, new_id]
    assert memory.locate(buffer.ptr) is None


def test_a_collected_buffer_releases_the_id_it_has_then() -> None:
    memory = HostMemory()
    heard = Heard(memory)
    buffer = memory.alloc(64)
    buffer.detach()
    new_id, ptr = buffer.id, buffer.ptr
    garbage(buffer)
    del buffer
    gc.collect()
    assert heard.ids[-1] == new_id
    assert memory.locate(ptr) is None


def test_an_op_built_before_the_detach_is_built_afresh_with_the_new_id() -> None:
    memory = HostMemory()
    resolver = MemoryResolver(memory, driver=lambda: None)
    cache = OpCache(resolver)
    buffer = memory.alloc(64)

    def build() -> proto.Op:
        ref = resolver.resolve(buffer.ptr, 64)
        assert ref is not None
        return proto.AllReduce(proto.Mem(ref.buffer_id, ref.offset), 64, proto.DType.F32)

    first, _ = cache.get(("all_reduce", buffer.ptr), build)
    assert memory.moves.detach({buffer.id}) == ({}, set())
    second, _ = cache.get(("all_reduce", buffer.ptr), build)
    assert isinstance(first, proto.AllReduce) and isinstance(second, proto.AllReduce)
    assert first.buf is not None and second.buf is not None
    assert second.buf.buf == buffer.id != first.buf.buf
    buffer.close()


def test_only_the_named_live_buffers_move() -> None:
    memory = HostMemory()
    named, other = memory.alloc(64), memory.alloc(64)
    ids = (named.id, other.id)
    closed = memory.alloc(64)
    closed_id = closed.id
    closed.close()
    assert memory.moves.detach({ids[0], closed_id, 12345}) == ({}, set())
    assert named.id != ids[0] and other.id == ids[1]
    assert not closed.detach()
    named.close()
    other.close()


def test_the_daemons_own_memory_is_not_moved() -> None:
    """symmetric_alloc's host memory is the daemon's (freed by its id there)."""
    memory = HostMemory()
    fd = os.memfd_create("symmetric", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    os.ftruncate(fd, 64)
    fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK)  # (as the daemon's: adopt checks)
    adopted = memory.adopt(fd, 64, memory.next_id())
    buffer_id = adopted.id
    assert not adopted.detach()
    assert memory.moves.detach({buffer_id}) == ({}, set())
    assert adopted.id == buffer_id
    adopted.close()


def test_a_buffer_holds_one_open_file() -> None:
    """The mapping is made over reserved memory, not from the fd (an mmap object keeps a
    duplicate of the fd it maps, and with it the memory a detach leaves)."""
    before = len(os.listdir("/proc/self/fd"))
    buffers = [HostMemory().alloc(64) for _ in range(8)]
    assert len(os.listdir("/proc/self/fd")) - before == 8
    for buffer in buffers:
        buffer.detach()
    assert len(os.listdir("/proc/self/fd")) - before == 8
    for buffer in buffers:
        buffer.close()
    assert len(os.listdir("/proc/self/fd")) == before


def test_a_failed_detach_leaves_the_buffer_as_it_was(monkeypatch: pytest.MonkeyPatch) -> None:
    import client.hostmem as hostmem

    memory = HostMemory()
    buffer = memory.alloc(64)
    buffer.view(np.int32)[:2] = [5, 6]
    old_id = buffer.id

    def no_memory(nbytes: int) -> int:
        raise OSError(24, "Too many open files")

    monkeypatch.setattr(hostmem, "_sealed_memfd", no_memory)
    failed, _ = memory.moves.detach({old_id})
    assert list(failed) == [old_id] and isinstance(failed[old_id], OSError)
    assert buffer.id == old_id and buffer.view(np.int32)[:2].tolist() == [5, 6]
    assert memory.find(buffer.ptr, 8)[0] is buffer
    buffer.close()


def test_a_buffer_another_call_in_flight_names_moves_once_that_call_ends() -> None:
    """Two calls in flight name one buffer (two worlds, each its half): the first fails and
    its buffers are to move, but what the second's daemon writes must reach the worker, so
    the buffer waits for the second call to end, and moves then, with what it wrote."""
    memory = HostMemory()
    buffer, alone = memory.alloc(64), memory.alloc(64)
    ids = (buffer.id, alone.id)
    theirs = mapped_elsewhere(buffer)
    memory.moves.calling("failed", lambda: set(ids))
    memory.moves.calling("other", lambda: {ids[0]})
    assert memory.moves.detach(set(ids), "failed") == ({}, {ids[0]})
    assert (buffer.id, alone.id != ids[1]) == (ids[0], True)
    memory.moves.called("failed")
    assert buffer.id == ids[0]
    np.frombuffer(theirs, np.int32)[8:] = 7  # the second call's daemon writes its result
    memory.moves.called("other")
    assert buffer.id != ids[0]
    assert buffer.view(np.int32)[8:].tolist() == [7] * 8
    np.frombuffer(theirs, np.int32)[:] = -1  # the failed call's daemon, late: not seen
    assert buffer.view(np.int32)[:8].tolist() == [0] * 8
    theirs.close()
    buffer.close()
    alone.close()


@pytest.mark.parametrize("where", ["_map_over", "dup2"])
def test_a_detach_a_ctrl_c_cuts_short_midway_still_leaves_one_memory(
        monkeypatch: pytest.MonkeyPatch, where: str) -> None:
    """A real SIGINT lands as the mapping is put over the old one (or as the fd is), long
    calls for a big buffer: what the worker sees at `.ptr`, what a later import maps from
    `.fd`, and the id the daemons know it by must still be one memory, the fresh one
    (before: the worker's writes went to the fresh memory, the next import mapped the
    old, under the old id every daemon still held)."""
    import client.hostmem as hostmem

    memory = HostMemory()
    heard = Heard(memory)
    buffer = memory.alloc(64)
    old_id = buffer.id
    theirs = mapped_elsewhere(buffer)
    target = hostmem if where == "_map_over" else hostmem.os
    real = getattr(target, where)

    def then_ctrl_c(*args: Any, **kwargs: Any) -> Any:
        monkeypatch.undo()
        done = real(*args, **kwargs)
        signal.pthread_kill(threading.main_thread().ident, signal.SIGINT)  # type: ignore[arg-type]
        time.sleep(5)  # (not reached)
        return done

    monkeypatch.setattr(target, where, then_ctrl_c)
    with pytest.raises(KeyboardInterrupt):
        buffer.detach()
    buffer.view(np.int32)[0] = 99
    later = mapped_elsewhere(buffer)
    assert np.frombuffer(later, np.int32)[0] == 99
    assert np.frombuffer(theirs, np.int32)[0] == 0
    assert buffer.id != old_id and heard.ids == [old_id]
    assert memory.find(buffer.ptr, 8)[0] is buffer
    later.close()
    theirs.close()
    buffer.close()


def test_a_ctrl_c_in_one_buffers_move_still_moves_the_calls_others(monkeypatch: pytest.MonkeyPatch) -> None:
    """The interrupt is raised once every buffer the failed call named has moved (before:
    those after the one it cut into stayed where the daemon may still write)."""
    import client.hostmem as hostmem

    memory = HostMemory()
    buffers = [memory.alloc(64), memory.alloc(64)]
    ids = [b.id for b in buffers]
    real = hostmem._map_over

    def then_ctrl_c(ptr: int, size: int, fd: int) -> None:
        monkeypatch.undo()
        real(ptr, size, fd)
        signal.pthread_kill(threading.main_thread().ident, signal.SIGINT)  # type: ignore[arg-type]
        time.sleep(5)  # (not reached)

    monkeypatch.setattr(hostmem, "_map_over", then_ctrl_c)
    with pytest.raises(KeyboardInterrupt):
        memory.moves.detach(set(ids))
    assert [b.id != i for b, i in zip(buffers, ids, strict=True)] == [True, True]
    for buffer in buffers:
        buffer.close()


def test_a_ctrl_c_during_the_copy_still_moves_the_buffer(monkeypatch: pytest.MonkeyPatch) -> None:
    """A real SIGINT lands during the copy onto the fresh memory, the longest step for a
    big buffer (Python raises it as the copy returns): the buffer still moves before the
    interrupt goes on (before: it stayed on the old memory, under the id every daemon
    held, where the daemon running the lost call went on writing what the worker reads)."""
    import client.hostmem as hostmem

    memory = HostMemory()
    heard = Heard(memory)
    buffer = memory.alloc(64)
    buffer.view(np.int32)[:] = 5
    old_id = buffer.id
    theirs = mapped_elsewhere(buffer)
    real = hostmem.os.pwrite

    def then_ctrl_c(*args: Any, **kwargs: Any) -> int:
        monkeypatch.undo()
        written: int = real(*args, **kwargs)
        del args, kwargs  # (as the real call's end drops its arguments, the mapping's exports)
        signal.pthread_kill(threading.main_thread().ident, signal.SIGINT)  # type: ignore[arg-type]
        time.sleep(5)  # (not reached)
        return written

    monkeypatch.setattr(hostmem.os, "pwrite", then_ctrl_c)
    with pytest.raises(KeyboardInterrupt):
        memory.moves.detach({old_id})
    np.frombuffer(theirs, np.int32)[:] = -1  # the lost call's daemon, late
    assert buffer.view(np.int32).tolist() == [5] * 16
    assert buffer.id != old_id and heard.ids == [old_id]
    assert memory.find(buffer.ptr, 8)[0] is buffer
    theirs.close()
    buffer.close()


def test_a_ctrl_c_as_a_call_ends_still_moves_what_waited_for_it() -> None:
    """A buffer waits for another call in flight to end before it moves (see the test
    above); a real SIGINT lands as that call's end waits for the table's lock (another
    thread's, at the moment a daemon's death ends every call at once). The buffer must
    still move before the interrupt goes on (before: the call stayed in flight for good,
    so the buffer never moved, and the lost call's daemon went on writing what the worker
    reads)."""
    memory = HostMemory()
    buffer = memory.alloc(64)
    buffer_id = buffer.id
    theirs = mapped_elsewhere(buffer)
    memory.moves.calling("failed", lambda: {buffer_id})
    memory.moves.calling("other", lambda: {buffer_id})
    assert memory.moves.detach({buffer_id}, "failed") == ({}, {buffer_id})
    memory.moves.called("failed")
    with interrupted_while_held(memory._lock) as held:
        assert held.wait(5)
        with pytest.raises(KeyboardInterrupt):
            memory.moves.called("other")  # (waits for the lock)
    np.frombuffer(theirs, np.int32)[:] = -1  # the lost call's daemon, late
    assert buffer.id != buffer_id and buffer.view(np.int32).tolist() == [0] * 16
    theirs.close()
    buffer.close()


def test_a_ctrl_c_as_a_lost_call_waits_for_the_table_still_moves_its_buffers() -> None:
    """A real SIGINT lands as a lost call's move waits for the table's lock (another
    thread's, at the moment a daemon's death loses every call at once): its buffers must
    still move before the interrupt goes on (before: none moved, and the lost call's
    daemon went on writing what the worker reads)."""
    memory = HostMemory()
    buffer = memory.alloc(64)
    buffer_id = buffer.id
    theirs = mapped_elsewhere(buffer)
    with interrupted_while_held(memory._lock) as held:
        assert held.wait(5)
        with pytest.raises(KeyboardInterrupt):
            memory.moves.detach({buffer_id}, "lost")  # (waits for the lock)
    np.frombuffer(theirs, np.int32)[:] = -1  # the lost call's daemon, late
    assert buffer.id != buffer_id and buffer.view(np.int32).tolist() == [0] * 16
    assert not memory.moves._leaving
    theirs.close()
    buffer.close()


def test_a_call_looks_for_moved_buffers_only_while_one_lives() -> None:
    """Each call asks the table whether a buffer it names moved: the ids are listed (a
    walk over its ops) only while a moved buffer lives."""
    memory = HostMemory()
    buffer = memory.alloc(64)
    old = buffer.id
    listed: list[int] = []

    def names() -> set[int]:
        listed.append(1)
        return {old}

    assert memory.moves.moved(names, time.monotonic() + 5) == {} and not listed
    buffer.detach()
    assert memory.moves.moved(names, time.monotonic() + 5) == {old: buffer} and len(listed) == 1
    buffer.close()
    garbage(buffer)
    del buffer
    gc.collect()
    assert memory.moves.moved(names, time.monotonic() + 5) == {} and len(listed) == 1


def test_a_ctrl_c_as_a_move_is_marked_done_still_marks_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """A real SIGINT lands as a lost call's move, done, waits for the table's lock (another
    thread's) to mark itself done: marked all the same before the interrupt goes on
    (before: the buffer stayed 'moving' for good, and every later call naming it waited
    out its deadline, then failed CommTimeout)."""
    memory = HostMemory()
    buffer = memory.alloc(64)
    old = buffer.id
    moved = threading.Event()
    detach = buffer.detach
    with interrupted_while_held(memory._lock, first=moved) as held:

        def detach_then_wait_for_the_holder() -> bool:
            done = detach()
            moved.set()
            assert held.wait(5)  # (then the mover waits for the lock, to mark the move done)
            return done

        monkeypatch.setattr(buffer, "detach", detach_then_wait_for_the_holder)
        with pytest.raises(KeyboardInterrupt):
            memory.moves.detach({old})
    started = time.monotonic()
    assert memory.moves.moved(lambda: {old}, started + 2) == {old: buffer}
    assert time.monotonic() - started < 1
    buffer.close()


def test_a_ctrl_c_as_a_call_is_recorded_in_flight_still_ends_it() -> None:
    """A real SIGINT lands as a call is recorded in flight (InFlight's enter, which a `with`
    has no exit for if it raises), once the record is made: the call must end all the same
    (before: it stayed in flight for good, so a buffer it names that a later lost call moves
    waited for it for ever, where that call's daemon went on writing what the worker reads)."""
    memory = HostMemory()
    buffer = memory.alloc(64)
    buffer_id = buffer.id
    theirs = mapped_elsewhere(buffer)

    class ThenCtrlC(dict[object, Any]):
        def __setitem__(self, call: object, names: Any) -> None:
            super().__setitem__(call, names)
            signal.pthread_kill(threading.main_thread().ident, signal.SIGINT)  # type: ignore[arg-type]
            time.sleep(5)  # (not reached)

    memory.moves._calls = ThenCtrlC()
    with pytest.raises(KeyboardInterrupt), InFlight(memory.moves, (proto.AllReduce(
            proto.Mem(buffer_id, 0), 64, proto.DType.I32),)):
        pytest.fail("the call went on")  # (not reached)
    assert memory.moves.detach({buffer_id}, "lost") == ({}, set())  # (a later call on it, lost)
    assert not memory.moves._calls
    np.frombuffer(theirs, np.int32)[:] = -1  # that call's daemon, late
    assert buffer.id != buffer_id and buffer.view(np.int32).tolist() == [0] * 16
    theirs.close()
    buffer.close()


def test_a_buffer_a_lost_call_could_not_move_is_refused_at_its_next_call(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A lost call's move of its buffer fails (out of open files): its error says so, and
    the next call naming the buffer is refused (LimitExceeded) rather than sent on memory
    the lost call's daemon may still write; the buffer moves as that call ends (before:
    the next call went on, and the worker read what that daemon wrote)."""
    import client.hostmem as hostmem

    memory = HostMemory()
    buffer = memory.alloc(64)
    buffer.view(np.int32)[:] = 5
    old = buffer.id
    theirs = mapped_elsewhere(buffer)
    op = proto.AllReduce(proto.Mem(old, 0), 64, proto.DType.I32)
    real = hostmem._sealed_memfd

    def out_of_files(nbytes: int) -> int:
        raise OSError(errno.EMFILE, os.strerror(errno.EMFILE))

    monkeypatch.setattr(hostmem, "_sealed_memfd", out_of_files)
    with InFlight(memory.moves, (op,)) as lost:
        lost.let_go(error := CommTimeout("lost"))
    assert "could not be moved" in error.__notes__[0] and buffer.id == old
    monkeypatch.setattr(hostmem, "_sealed_memfd", real)
    with pytest.raises(LimitExceeded, match=f"host buffer {old} could not be moved .*Too many open files"), \
            InFlight(memory.moves, (op,)) as call:
        call.follow_moves(lambda mem, moved: pytest.fail("renamed"), time.monotonic() + 5)
    np.frombuffer(theirs, np.int32)[:] = -1  # the lost call's daemon, late
    assert buffer.id != old and buffer.view(np.int32).tolist() == [5] * 16
    with InFlight(memory.moves, (op,)) as call:  # (made again: goes, under the new id)
        call.follow_moves(lambda mem, moved: proto.Mem(moved.id, mem.offset), time.monotonic() + 5)
    assert [mem.buf for mem in proto.mems_of(call.ops[0])] == [buffer.id]
    theirs.close()
    buffer.close()


def test_a_buffer_a_lost_call_could_not_move_is_still_freed_once_dropped(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """What keeps the buffer's refusal for its next call (see above) must not keep the
    buffer: dropped, its memory and its file go."""
    import client.hostmem as hostmem

    memory = HostMemory()
    before = len(os.listdir("/proc/self/fd"))
    buffer = memory.alloc(64)

    def out_of_files(nbytes: int) -> int:
        raise OSError(errno.EMFILE, os.strerror(errno.EMFILE))

    monkeypatch.setattr(hostmem, "_sealed_memfd", out_of_files)
    failed, _ = memory.moves.detach({buffer.id})
    assert list(failed) == [buffer.id]
    del failed
    ref = weakref.ref(buffer)
    del buffer
    gc.collect()
    assert ref() is None and len(os.listdir("/proc/self/fd")) == before


def test_a_ctrl_c_in_a_move_whose_redo_fails_still_goes_on_and_the_buffer_is_refused(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A real SIGINT lands as a lost call's move maps the fresh memory, and the move, done
    again, fails (out of open files): the interrupt goes on, saying so (before: the redo's
    OSError took its place, and the Ctrl-C was lost), and the buffer counts as not moved,
    so the next call naming it is refused (LimitExceeded)."""
    import client.hostmem as hostmem

    memory = HostMemory()
    buffer = memory.alloc(64)
    old = buffer.id
    real_map, real_memfd = hostmem._map_over, hostmem._sealed_memfd
    made: list[int] = []

    def then_ctrl_c(ptr: int, size: int, fd: int) -> None:
        monkeypatch.setattr(hostmem, "_map_over", real_map)
        real_map(ptr, size, fd)
        signal.pthread_kill(threading.main_thread().ident, signal.SIGINT)  # type: ignore[arg-type]
        time.sleep(5)  # (not reached)

    def once_then_out_of_files(nbytes: int) -> int:
        made.append(nbytes)
        if len(made) > 1:
            raise OSError(errno.EMFILE, os.strerror(errno.EMFILE))
        return real_memfd(nbytes)

    monkeypatch.setattr(hostmem, "_map_over", then_ctrl_c)
    monkeypatch.setattr(hostmem, "_sealed_memfd", once_then_out_of_files)
    with pytest.raises(KeyboardInterrupt) as raised:
        memory.moves.detach({old})
    monkeypatch.undo()
    assert any("Too many open files" in note for note in raised.value.__notes__)
    with pytest.raises(LimitExceeded, match=f"host buffer {old} could not be moved"):
        memory.moves.moved(lambda: {old}, time.monotonic() + 5)
    buffer.close()
