"""Ctrl-C (KeyboardInterrupt in the main thread) while a DaemonBackend call is under way,
caught by the worker (a notebook), which goes on with the same backend. What the daemon
did of the interrupted call is unknown, so the rank's connection is dropped: the world
fails at once for every rank (no rank waits out its timeout), every thread's later call
raises a CommError (none hangs, none is handed another step's data), and
attempt_reconnect on every rank makes it work again. Each interrupt is a real SIGINT,
landed at a chosen point by a patched internal."""

from __future__ import annotations

import os
import select
import signal
import socket
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import pytest

import proto
from client import CommError, DaemonBackend, DaemonUnavailable, WorldFailed, hostmem
from client.hostmem import HostMemory
from client.transport import Transport
from commd.launch import DaemonProcess
from tests.conftest import held_elsewhere
from tests.fault.ranks import joined, on_both, own_daemon, summed
from tests.integration import workers
from tests.integration.harness import RankPool, wait_until, world_name, world_status
from tests.unit.standin import RecordingDaemon

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def daemon(request: pytest.FixtureRequest) -> Iterator[DaemonProcess]:
    yield from own_daemon(getattr(request, "param", ()))


def ctrl_c() -> None:
    """A real SIGINT to the main thread, from the main thread: Python's handler raises
    KeyboardInterrupt at the next bytecode boundary (here, as pthread_kill returns)."""
    signal.pthread_kill(threading.main_thread().ident, signal.SIGINT)  # type: ignore[arg-type]
    time.sleep(5)  # (not reached)


def on_main_thread() -> bool:
    return threading.current_thread() is threading.main_thread()


def dropped_and_repaired(comms: list[Any], bufs: list[hostmem.HostBuffer]) -> None:
    """Rank 0 dropped its connection: it says so, the other rank's world has failed (it is
    told at once), and a rebuild on both makes the collectives right again."""
    assert not comms[0].is_healthy()
    with pytest.raises(DaemonUnavailable, match="interrupted"):
        comms[0].barrier()
    started = time.monotonic()
    with pytest.raises(WorldFailed):
        comms[1].barrier()  # (timeout 10 s: told, not timed out)
    assert time.monotonic() - started < 5
    on_both(lambda r: comms[r].attempt_reconnect())
    assert summed(comms, bufs) == [[3, 30], [3, 30]]


def test_an_interrupted_all_reduce_is_never_paired_with_another_step(daemon: DaemonProcess) -> None:
    """Ctrl-C while rank 0's all_reduce waits for rank 1. Before: the daemon still held that
    call and paired it with rank 1's step k, and rank 0's retry of step k with rank 1's
    step k+1: the retry came back with the wrong sum, is_healthy() said True."""
    with joined(daemon, timeout=10) as comms:
        bufs = [hostmem.alloc(8) for _ in range(2)]
        assert summed(comms, bufs) == [[3, 30], [3, 30]]
        timer = threading.Timer(0.5, signal.pthread_kill, (threading.main_thread().ident, signal.SIGINT))
        timer.start()
        with pytest.raises(KeyboardInterrupt):
            comms[0].all_reduce(bufs[0].ptr, 8, dtype="i32")  # rank 1 is not there yet
        timer.join()
        bufs[1].view(np.int32)[:2] = [2, 20]
        with pytest.raises(WorldFailed):
            comms[1].all_reduce(bufs[1].ptr, 8, dtype="i32")  # step k: no partner any more
        assert bufs[1].view(np.int32)[:2].tolist() == [2, 20]  # untouched
        bufs[0].view(np.int32)[:2] = [1, 10]
        with pytest.raises(DaemonUnavailable, match="interrupted"):
            comms[0].all_reduce(bufs[0].ptr, 8, dtype="i32")  # the retry: refused, not paired
        assert bufs[0].view(np.int32)[:2].tolist() == [1, 10]
        on_both(lambda r: comms[r].attempt_reconnect())
        assert summed(comms, bufs) == [[3, 30], [3, 30]]


def test_an_interrupted_import_leaves_the_buffer_usable_after_a_rebuild(
        daemon: DaemonProcess, monkeypatch: pytest.MonkeyPatch) -> None:
    """Ctrl-C while rank 0 waits for the daemon's answer to its first Import of a buffer,
    which the daemon did all the same. Before: the buffer was refused for good ("buffer id
    N is already in use"), also after attempt_reconnect."""
    with joined(daemon, timeout=10) as comms:
        bufs = [hostmem.alloc(8) for _ in range(2)]
        real_request, real_wait = Transport.request, Transport._wait
        importing: set[int] = set()

        def request(self: Transport, msg: proto.Message, *args: Any, **kwargs: Any) -> Any:
            if isinstance(msg, proto.Import) and on_main_thread():
                importing.add(msg.id)
            return real_request(self, msg, *args, **kwargs)

        def wait(self: Transport, request_id: int, deadline: float | None) -> Any:
            if request_id in importing:
                importing.clear()
                ctrl_c()
            return real_wait(self, request_id, deadline)

        monkeypatch.setattr(Transport, "request", request)
        monkeypatch.setattr(Transport, "_wait", wait)
        with pytest.raises(KeyboardInterrupt):
            comms[0].all_reduce(bufs[0].ptr, 8, dtype="i32")
        monkeypatch.undo()
        dropped_and_repaired(comms, bufs)


def test_an_interrupt_as_the_reader_stops_leaves_no_thread_waiting_for_a_reader(
        daemon: DaemonProcess, monkeypatch: pytest.MonkeyPatch) -> None:
    """Ctrl-C as rank 0's main thread, the transport's reader, has read its reply and goes
    to give up the role. Before: the role stayed with it, every later call of every
    thread timed out waiting for a reader, and is_healthy() said True."""
    with joined(daemon, timeout=10) as comms:
        bufs = [hostmem.alloc(8) for _ in range(2)]
        assert summed(comms, bufs) == [[3, 30], [3, 30]]
        real_stop = Transport._stop_reading
        armed = [True]

        def stop_reading(self: Transport) -> None:
            if armed[0] and on_main_thread():
                armed[0] = False
                ctrl_c()
            real_stop(self)

        monkeypatch.setattr(Transport, "_stop_reading", stop_reading)
        with ThreadPoolExecutor(1) as pool:
            other = pool.submit(comms[1].barrier)
            with pytest.raises(KeyboardInterrupt):
                comms[0].barrier()
            other.result(10)  # (its barrier was done: both had arrived)
        monkeypatch.undo()
        transport = comms[0]._conn.transport
        assert transport._reader is None
        with ThreadPoolExecutor(1) as pool:  # another thread of rank 0: told, not timed out
            started = time.monotonic()
            with pytest.raises(DaemonUnavailable, match="interrupted"):
                pool.submit(comms[0].barrier).result(10)
            assert time.monotonic() - started < 5
        on_both(lambda r: comms[r].attempt_reconnect())
        assert transport._sock.fileno() == -1  # (the dropped connection's socket is closed)
        with ThreadPoolExecutor(1) as pool:
            assert pool.submit(summed, comms, bufs).result(30) == [[3, 30], [3, 30]]
        assert summed(comms, bufs) == [[3, 30], [3, 30]]


def test_an_interrupted_reader_leaves_another_threads_call_no_wait(
        daemon: DaemonProcess, monkeypatch: pytest.MonkeyPatch) -> None:
    """Rank 0's main thread waits in a barrier and reads for every thread; a second thread
    of rank 0 registers a buffer. Ctrl-C lands as the main thread routes that thread's
    reply. Before: the reply was lost and the register timed out (its registration left
    at the daemon). Now it ends at once with a CommError, and the world is rebuilt."""
    with joined(daemon, timeout=10) as comms:
        bufs = [hostmem.alloc(8) for _ in range(2)]
        assert summed(comms, bufs) == [[3, 30], [3, 30]]
        real_route = Transport._route
        armed = [True]

        def route(self: Transport, msg: proto.Message, fds: list[int]) -> bool:
            if armed[0] and isinstance(msg, proto.Ok) and on_main_thread():
                armed[0] = False
                ctrl_c()
            return real_route(self, msg, fds)

        def register_once_main_reads() -> int:
            deadline = time.monotonic() + 5
            while comms[0]._conn.transport._reader != threading.main_thread().ident:
                assert time.monotonic() < deadline
                time.sleep(0.01)
            return comms[0].register_buffer(bufs[0].ptr, 8)

        monkeypatch.setattr(Transport, "_route", route)
        with ThreadPoolExecutor(1) as pool:
            registered = pool.submit(register_once_main_reads)
            with pytest.raises(KeyboardInterrupt):
                comms[0].barrier()
            started = time.monotonic()
            assert isinstance(registered.exception(10), CommError)
            assert time.monotonic() - started < 5  # (its timeout is 10 s)
        monkeypatch.undo()
        dropped_and_repaired(comms, bufs)
        assert comms[0].register_buffer(bufs[0].ptr, 8) >= 1


@pytest.mark.parametrize("daemon", [["--max-registrations", "1"]], indirect=True)
def test_an_interrupt_after_a_registration_was_answered_does_not_leak_it(
        daemon: DaemonProcess, monkeypatch: pytest.MonkeyPatch) -> None:
    """Ctrl-C as register_buffer's reply has been read (the main thread, as the reader,
    goes to give up the role). Before: the registration stayed at the daemon unknown to
    the client (here the one allowed), so the next register_buffer was refused."""
    with joined(daemon, timeout=10) as comms:
        bufs = [hostmem.alloc(8) for _ in range(2)]
        assert summed(comms, bufs) == [[3, 30], [3, 30]]
        real_request, real_stop = Transport.request, Transport._stop_reading
        armed = [False]

        def request(self: Transport, msg: proto.Message, *args: Any, **kwargs: Any) -> Any:
            armed[0] = isinstance(msg, proto.Register)
            return real_request(self, msg, *args, **kwargs)

        def stop_reading(self: Transport) -> None:
            if armed[0] and on_main_thread():
                armed[0] = False
                ctrl_c()
            real_stop(self)

        monkeypatch.setattr(Transport, "request", request)
        monkeypatch.setattr(Transport, "_stop_reading", stop_reading)
        with pytest.raises(KeyboardInterrupt):
            comms[0].register_buffer(bufs[0].ptr, 8)
        monkeypatch.undo()
        dropped_and_repaired(comms, bufs)
        assert comms[0].register_buffer(bufs[0].ptr, 8) >= 1


def test_an_interrupt_between_an_answer_and_its_record_drops_the_connection_too(
        daemon: DaemonProcess, monkeypatch: pytest.MonkeyPatch) -> None:
    """Ctrl-C after the daemon answered rank 0's Import, before rank 0 recorded it (no
    transport call under way: the backend drops the connection itself). Else the daemon
    holds a buffer this side does not know of, and refuses its next import for good."""
    with joined(daemon, timeout=10) as comms:
        bufs = [hostmem.alloc(8) for _ in range(2)]
        imports = comms[0]._imports
        real_add = imports.add

        def add(buffer_id: int) -> None:
            if on_main_thread():
                monkeypatch.undo()
                ctrl_c()
            real_add(buffer_id)

        monkeypatch.setattr(imports, "add", add)
        with pytest.raises(KeyboardInterrupt):
            comms[0].all_reduce(bufs[0].ptr, 8, dtype="i32")
        dropped_and_repaired(comms, bufs)


def hung_up(conn: socket.socket, within: float = 2.0) -> bool:
    """Whether the client's side of this (stand-in daemon's) connection went."""
    poll = select.poll()
    poll.register(conn, select.POLLRDHUP | select.POLLHUP)
    return any(events & (select.POLLRDHUP | select.POLLHUP) for _, events in poll.poll(int(within * 1000)))


def stand_in_backend(path: str, memory: HostMemory | None = None) -> DaemonBackend:
    return DaemonBackend(path, "w", 0, 1, timeout=5, memory=memory or HostMemory(),
                         cuda_driver=lambda: None)


def test_an_interrupt_as_a_rejoin_has_joined_drops_the_new_connection(
        recording: tuple[RecordingDaemon, str]) -> None:
    """Ctrl-C in attempt_reconnect's rejoin once its hello was welcomed (the daemon has the
    rank on the new connection), while it waits for the backend's lock to put it in place.
    Before: the old connection was dropped (broken already) and the new one stayed open,
    held by the interrupt's traceback: the daemon kept the rank, and the next rejoin's
    hello was refused as 'already connected'."""
    fake, path = recording
    backend = stand_in_backend(path)
    try:
        fake.drop()
        assert not backend.is_healthy()
        real_join = backend._conn._join

        def join(deadline: float) -> Any:
            joined = real_join(deadline)
            holding = held_elsewhere(backend._lock)
            holding.__enter__()
            threading.Timer(1.0, holding.__exit__, (None, None, None)).start()
            threading.Timer(0.3, signal.pthread_kill, (threading.main_thread().ident, signal.SIGINT)).start()
            return joined

        backend._conn._join = join  # type: ignore[method-assign]
        with pytest.raises(KeyboardInterrupt) as interrupt:
            backend.attempt_reconnect()
        assert interrupt.traceback[-1].name == "rejoin"
        assert len(fake.conns) == 2 and hung_up(fake.conns[-1])
    finally:
        backend.close()


def test_an_interrupted_constructor_drops_its_connection(recording: tuple[RecordingDaemon, str]) -> None:
    """Ctrl-C as the constructor finishes, once its hello was welcomed: nobody could close
    the half-made backend, so it drops its connection itself (before: the daemon kept the
    rank as long as the traceback held the backend)."""

    class InterruptedOnRelease(HostMemory):
        def on_release(self, listener: Any) -> None:
            raise KeyboardInterrupt

    fake, path = recording
    with pytest.raises(KeyboardInterrupt):
        stand_in_backend(path, InterruptedOnRelease())
    assert hung_up(fake.conns[-1])


def test_a_close_cut_short_by_an_interrupt_can_be_called_again(
        recording: tuple[RecordingDaemon, str]) -> None:
    """Ctrl-C in close() after the backend counts as closed, before its connection is:
    a second close() drops the connection (before: it returned at once)."""
    fake, path = recording
    backend = stand_in_backend(path)
    real_let_go = backend._symmetric.let_go

    def let_go() -> Any:
        real_let_go()
        raise KeyboardInterrupt

    backend._symmetric.let_go = let_go  # type: ignore[method-assign]
    with pytest.raises(KeyboardInterrupt):
        backend.close()
    backend.close()
    assert hung_up(fake.conns[-1])


def test_a_close_cut_short_while_it_drops_its_connection_unmaps_on_the_second(
        recording: tuple[RecordingDaemon, str]) -> None:
    """Ctrl-C in close() as it drops the connection, once it has taken the symmetric
    buffers: the second close() unmaps them (before: they stayed mapped for good)."""
    _, path = recording
    backend = stand_in_backend(path)
    unmapped: list[str] = []
    backend._symmetric.let_go = lambda: (lambda: unmapped.append("unmapped"))  # type: ignore[method-assign]
    transport = backend._conn.transport
    real_close = transport.close
    calls: list[int] = []

    def close() -> None:
        calls.append(1)
        if len(calls) == 1:
            raise KeyboardInterrupt
        real_close()

    transport.close = close  # type: ignore[method-assign]
    with pytest.raises(KeyboardInterrupt):
        backend.close()
    assert unmapped == []
    backend.close()
    assert unmapped == ["unmapped"]


def test_a_close_cut_short_as_it_unmaps_unmaps_on_the_second(recording: tuple[RecordingDaemon, str]) -> None:
    """Ctrl-C in close() as it lets go of the streams' events, before the unmapping: the
    second close() unmaps (before: the unmapping was lost with the first's frame)."""
    _, path = recording
    backend = stand_in_backend(path)
    unmapped: list[str] = []
    backend._symmetric.let_go = lambda: (lambda: unmapped.append("unmapped"))  # type: ignore[method-assign]
    real_close = backend._order.close
    calls: list[int] = []

    def order_close(driver: Any) -> None:
        calls.append(1)
        if len(calls) == 1:
            raise KeyboardInterrupt
        real_close(driver)

    backend._order.close = order_close  # type: ignore[method-assign]
    with pytest.raises(KeyboardInterrupt):
        backend.close()
    assert unmapped == []
    backend.close()
    assert unmapped == ["unmapped"]


@pytest.mark.parametrize("reuse", [False, True])
def test_close_in_a_signal_handler_ends_the_call_the_signal_cut_into(
        daemon: DaemonProcess, pool: RankPool, reuse: bool) -> None:
    """A worker's signal handler calls close() (a SIGTERM handler that leaves cleanly) while
    the main thread, which runs handlers, is inside a call's send. The call ends at once
    with DaemonUnavailable, the connection is gone and the rank can join again. Before:
    close() waited for the send lock, held by the very call it had interrupted, for good
    (the worker hung). `reuse`: the handler then opens pipes until one takes the socket's
    fd number: the send, waiting for room in poll() by that number, waited on the pipe's
    read end (never writable) until the backend's timeout (10 s). Now the socket closes
    once the send is over, and no pipe can take its number before."""
    world = world_name("sig")
    try:
        [outcome] = pool.run(workers.closed_by_a_signal_handler,
                             [(str(daemon.socket_path), world, 0, 1, daemon.pid, reuse)], timeout=30)
    finally:
        os.kill(daemon.pid, signal.SIGCONT)  # (a worker that hung left the daemon stopped)
    after = outcome.unwrap()
    assert after["ended"] == "DaemonUnavailable: the backend was closed"
    assert after["took"] < 3  # (the signal came at 0.5 s; the send's own limit is 10 s)
    assert (after["healthy"], after["next call"]) == (False, "MisuseError")
    wait_until(lambda: world_status(daemon, world) is None, "the daemon to see the rank go")
    with DaemonBackend(str(daemon.socket_path), world, 0, 1, timeout=10) as again:
        buf = hostmem.alloc(8)
        buf.view(np.int32)[:2] = [7, 70]
        again.all_reduce(buf.ptr, 8, dtype="i32")
        assert buf.view(np.int32)[:2].tolist() == [7, 70]
