"""A worker's memory let go of at awkward moments, and the daemon still hears of it (a
Forget), or a forked child still gets past its hooks: freed by a garbage collection in
the middle of its import (a rejoin re-imports what was registered), evicted from the CUDA
cache by another thread's call while it is imported, or freed by a collection inside a
forked child's at-fork hooks while a parent thread held the backend's lock."""

from __future__ import annotations

import contextlib
import gc
import os
import signal
import threading
import time
import weakref
from collections import Counter
from collections.abc import Iterator

import pytest

import proto
from client import CommError, DaemonBackend, sockets
from client.hostmem import HostMemory
from client.memory import MemoryRef
from tests.conftest import garbage, held_elsewhere
from tests.unit.standin import RecordingDaemon
from tests.unit.test_client_cuda import FakeDriver
from tests.unit.test_hostmem_release import garbage_buffer

pytestmark = pytest.mark.timeout(30)


@pytest.mark.parametrize("when", ["before the import is sent", "after the import is answered"])
def test_a_collection_during_a_rejoins_import_of_a_dropped_registered_buffer(
        recording: tuple[RecordingDaemon, str], no_automatic_collection: None, when: str) -> None:
    """The import holds the buffer until it is recorded, and an import whose memory went
    meanwhile is forgotten. Before: a collection before the send closed the fd being sent
    (EBADF broke the new connection: attempt_reconnect raised DaemonUnavailable); one after
    the reply released it before the import was recorded, so it stayed recorded and the
    daemon kept the mapping for good."""
    fake, path = recording
    memory = HostMemory()
    backend = DaemonBackend(path, "w", 0, 1, timeout=5, memory=memory, cuda_driver=lambda: None)
    try:
        buf = memory.alloc(64)
        buf_id = buf.id
        backend.register_buffer(buf.ptr, 64)
        garbage(buf)  # the worker lets go of the memory, freed at the next collection
        del buf

        if when == "before the import is sent":
            real_fds = backend._resolver.import_fds

            @contextlib.contextmanager
            def collecting(ref: MemoryRef) -> Iterator[list[int]]:
                # (a collection started by an allocation before the send)
                with real_fds(ref) as fds:
                    gc.collect()
                    yield fds

            backend._resolver.import_fds = collecting  # type: ignore[method-assign]
        else:
            real_add = backend._imports.add

            def collecting_add(buffer_id: int) -> None:  # (one started just before it is recorded)
                gc.collect()
                real_add(buffer_id)

            backend._imports.add = collecting_add  # type: ignore[method-assign]

        fake.drop()  # the daemon went away; the rejoin registers again what it knew
        backend.is_healthy()
        backend.attempt_reconnect()  # before: DaemonUnavailable, [Errno 9] Bad file descriptor
        assert memory.locate(0) is None and not memory._by_start  # the buffer was collected
        backend.barrier()  # (the Forgets owed go with the next request)
        forgotten = {b for n, m in fake.seen if n == 1 and isinstance(m, proto.Forget) for b in m.bufs}
        imported = {m.buf for n, m in fake.seen if n == 1 and isinstance(m, proto.Import)}
        # the new daemon may import it, but then must hear it was freed
        assert buf_id not in imported or buf_id in forgotten, (imported, forgotten)
        assert buf_id not in backend._imports
    finally:
        backend.close()


class CollectingSet:
    """Stands in for sockets._OPEN: iterating it (in the child's fork hook) starts a
    collection, as any allocation in the hooks that run before the backends are marked may."""

    def __init__(self, real: object) -> None:
        self.real = real

    def __iter__(self) -> Iterator[object]:
        gc.collect()
        return iter(list(self.real))  # type: ignore[call-overload]

    def add(self, item: object) -> None:
        self.real.add(item)  # type: ignore[attr-defined]


def test_a_collection_in_the_childs_fork_hooks_does_not_wait_for_the_parents_lock(
        recording: tuple[RecordingDaemon, str], no_automatic_collection: None,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A buffer freed by a collection in the hooks that run before the backends learn they
    are the parent's: its listener does not take the backend's lock (held by a parent
    thread the child lacks). Before: the child hung inside os.fork()."""
    _, path = recording
    memory = HostMemory()
    backend = DaemonBackend(path, "w", 0, 1, timeout=5, memory=memory, cuda_driver=lambda: None)
    garbage_buffer(memory)
    monkeypatch.setattr(sockets, "_OPEN", CollectingSet(sockets._OPEN))
    try:
        with held_elsewhere(backend._lock):  # (a reader in on_event, any call's bookkeeping)
            child = os.fork()
            if child == 0:
                os._exit(0)  # (reached only once the fork hooks returned)
            deadline = time.monotonic() + 5
            while time.monotonic() < deadline:
                pid, _ = os.waitpid(child, os.WNOHANG)
                if pid:
                    break
                time.sleep(0.05)
            else:
                os.kill(child, signal.SIGKILL)
                os.waitpid(child, 0)
                pytest.fail("the child hangs in its fork hook: the buffer's finalizer waits there "
                            "for the backend's lock, held by a thread the child does not have")
    finally:
        backend.close()


def test_a_device_allocation_evicted_while_it_is_imported_is_forgotten(
        recording: tuple[RecordingDaemon, str]) -> None:
    """Another thread's call fills the CUDA cache and evicts the allocation this thread is
    importing: on_forget (release) comes before the import is recorded (add)."""
    fake, path = recording
    driver = FakeDriver()
    a, b = driver.alloc(0x10000, 4096), driver.alloc(0x20000, 4096)
    backend = DaemonBackend(path, "w", 0, 1, timeout=5, memory=HostMemory(), cuda_driver=lambda: driver)
    try:
        cuda = backend._resolver._cuda_memory()
        cuda._max = 1  # (a full cache, without a thousand allocations)
        a_id = backend._resolver.resolve(a.base, 8).buffer_id
        arrived, go = threading.Event(), threading.Event()
        fake.gate = (a_id, arrived, go)
        first = threading.Thread(target=lambda: backend.broadcast(a.base, 8, 0))
        first.start()
        assert arrived.wait(5)  # a's Import is out, its reply held
        second = threading.Thread(target=lambda: backend.broadcast(b.base, 8, 0))
        second.start()  # finds b, which evicts a (on_forget: released), then waits for the import lock
        for _ in range(100):
            if not cuda.owns(a_id):
                break
            threading.Event().wait(0.01)
        assert not cuda.owns(a_id)
        go.set()
        first.join(5)
        second.join(5)
        backend.barrier()  # (the Forgets owed go with the next request)
        forgotten = {x for _, m in fake.seen if isinstance(m, proto.Forget) for x in m.bufs}
        assert a_id in forgotten, "the daemon keeps a's mapping for ever"
        assert a_id not in backend._imports
    finally:
        go.set()
        backend.close()


class CollectingPins(Counter[int]):
    """Stands in for ImportedBuffers._pinned: its second lookup (one per owed Forget, in
    take_owed) starts a collection, as any allocation there may."""

    lookups = 0

    def __contains__(self, buffer_id: object) -> bool:
        self.lookups += 1
        if self.lookups == 2:
            gc.collect()
        return super().__contains__(buffer_id)


def test_a_buffer_freed_as_a_pinned_calls_forgets_are_taken_is_still_forgotten(
        recording: tuple[RecordingDaemon, str], no_automatic_collection: None) -> None:
    """A call on a CUDA allocation (pinned until its op is sent) takes the Forgets owed before
    it; a collection then frees a host buffer the daemon imported, on the same thread: its
    Forget goes with the next request. Before: the release, added to the list take_owed was
    splitting into what goes and what waits, ended up in neither, and the daemon kept the
    freed memory mapped for as long as the connection lived."""
    fake, path = recording
    driver = FakeDriver()
    device = driver.alloc(0x10000, 4096)
    memory = HostMemory()
    backend = DaemonBackend(path, "w", 0, 1, timeout=5, memory=memory, cuda_driver=lambda: driver)
    try:
        owed, freed = memory.alloc(64), memory.alloc(64)
        for ptr in (owed.ptr, freed.ptr, device.base):  # (all three imported)
            backend.broadcast(ptr, 8, 0)
        owed_id, freed_id = owed.id, freed.id
        with held_elsewhere(backend._conn.transport._send_lock):  # (its Forget cannot go at once)
            owed.close()
        garbage(freed)
        gone = weakref.ref(freed)
        del freed
        pins = backend._imports._pinned = CollectingPins()
        backend.broadcast(device.base, 8, 0)
        assert pins.lookups >= 2 and gone() is None  # (freed as the Forgets were taken)
        backend.barrier()  # (what is owed goes with the next request)
        forgotten = [b for _, m in fake.seen if isinstance(m, proto.Forget) for b in m.bufs]
        assert sorted(forgotten) == sorted([owed_id, freed_id]), "the daemon keeps freed memory mapped"
    finally:
        backend.close()


def test_a_failure_on_record_keeps_no_callers_frame_alive(recording: tuple[RecordingDaemon, str]) -> None:
    """The failure the backend keeps (until attempt_reconnect) and the one its broken
    connection raises again are copies without tracebacks. Before: the one on record held
    the frames of the call that met it (the worker's locals: its buffers, tensors), and
    every call that raised it again added its own."""
    fake, path = recording
    memory = HostMemory()
    backend = DaemonBackend(path, "w", 0, 1, timeout=5, memory=memory, cuda_driver=lambda: None)

    class Tensor:
        pass

    def step(dropped: HostMemory) -> tuple[weakref.ref[Tensor], weakref.ref[object]]:
        activations = Tensor()
        buffer = dropped.alloc(1 << 20)  # (its first import meets the failure)
        with pytest.raises(CommError):
            backend.all_reduce(buffer.ptr, 64)
        return weakref.ref(activations), weakref.ref(buffer)

    try:
        fake.drop()
        kept = [step(memory) for _ in range(3)]
        gc.collect()
        assert not backend.is_healthy()
        assert all(tensor() is None and buffer() is None for tensor, buffer in kept)
    finally:
        backend.close()


def test_a_steady_loop_on_the_same_buffers_is_served_from_the_op_cache(
        recording: tuple[RecordingDaemon, str]) -> None:
    """(A release anywhere rebuilds each op once, then the cache serves it again.)"""
    _, path = recording
    memory = HostMemory()
    backend = DaemonBackend(path, "w", 0, 1, timeout=5, memory=memory, cuda_driver=lambda: None)
    try:
        a, b = memory.alloc(64), memory.alloc(64)
        resolved: list[int] = []
        real = backend._resolver.resolve

        def resolve(ptr: int, nbytes: int) -> MemoryRef | None:
            resolved.append(ptr)
            return real(ptr, nbytes)

        backend._resolver.resolve = resolve  # type: ignore[method-assign]
        for _ in range(3):
            backend.all_reduce(a.ptr, 64)
            backend.all_gather(a.ptr, b.ptr, 64)
        assert resolved == [a.ptr, a.ptr, b.ptr]
        memory.alloc(8).close()
        for _ in range(3):
            backend.all_reduce(a.ptr, 64)
            backend.all_gather(a.ptr, b.ptr, 64)
        assert resolved == [a.ptr, a.ptr, b.ptr] * 2
    finally:
        backend.close()
