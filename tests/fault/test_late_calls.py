"""What happens to a call after the client gave up on it. A rank whose call raised
CommTimeout believes the call failed and may write, reuse or free its buffer: the
daemon, stalled (SIGSTOP) past the call's deadline and its verdict's grace, must not
run that call when it goes on, and the other ranks of the world must get a typed error
for theirs, not a result made of the given-up rank's buffer."""

from __future__ import annotations

import contextlib
import errno
import mmap
import os
import select
import signal
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import numpy as np
import pytest

from client import CommError, CommTimeout, DaemonBackend, LimitExceeded, WorldFailed, hostmem
from commd.launch import DaemonProcess
from tests.fault.ranks import joined, on_both, own_daemon, summed
from tests.integration.harness import query_status, wait_until, world_name, world_status

pytestmark = pytest.mark.timeout(60)
TIMEOUT_S = 1.0
MARKER = [-7, -70]  # what a rank writes into its buffer once its call has failed
_BIG = 64 << 20  # an all_reduce long enough (~20 ms) to stop the daemon in the middle of
_ATTEMPTS = 5


@pytest.fixture
def daemon() -> Iterator[DaemonProcess]:
    yield from own_daemon()


def mark(buf: hostmem.HostBuffer) -> None:
    buf.view(np.int32)[:2] = MARKER


def held(buf: hostmem.HostBuffer) -> list[int]:
    values: list[int] = buf.view(np.int32)[:2].tolist()
    return values


def rebuilt(comms: list[DaemonBackend]) -> list[list[int]]:
    """Both ranks reconnect, then sum afresh (the world works again)."""
    on_both(lambda r: comms[r].attempt_reconnect())
    return summed(comms, [hostmem.alloc(8), hostmem.alloc(8)])


def test_calls_both_ranks_gave_up_on_never_run_when_the_daemon_goes_on(daemon: DaemonProcess) -> None:
    """The daemon stops before it reads either rank's all_reduce; both ranks give up
    (CommTimeout) and write their buffers. When the daemon goes on, neither buffer is
    written by the all_reduce they gave up on (before: both held the sum of the two
    ranks' markers)."""
    with joined(daemon, TIMEOUT_S) as comms:
        bufs = [hostmem.alloc(8), hostmem.alloc(8)]
        summed(comms, bufs)  # (imported: the calls below are one Submit each)
        os.kill(daemon.pid, signal.SIGSTOP)
        try:
            errors = on_both(lambda r: _raised(lambda: comms[r].all_reduce(bufs[r].ptr, 8, dtype="i32")))
            assert all(isinstance(e, CommTimeout) for e in errors), errors
            for buf in bufs:
                mark(buf)
        finally:
            os.kill(daemon.pid, signal.SIGCONT)
        _settled(daemon)
        assert [held(b) for b in bufs] == [MARKER, MARKER]
        assert rebuilt(comms) == [[3, 30], [3, 30]]


def test_a_call_one_rank_gave_up_on_fails_the_others_when_the_daemon_goes_on(
        daemon: DaemonProcess) -> None:
    """Rank 0's all_reduce reaches the daemon, which then stops; rank 0 gives up
    (CommTimeout) and writes its buffer; rank 1 makes the matching call while the daemon
    is still stopped. Rank 1 joined first with a longer timeout (the world's), so the
    daemon's own verdict on rank 0's call is far off when it goes on. Rank 1 gets
    WorldFailed (rank 0 is gone from the world), and neither buffer is written by the
    all_reduce: rank 0 gave up on it, and rank 1's result would be made of what rank 0
    wrote after giving up (before: both held the marker plus rank 1's values)."""
    world = world_name()
    with ThreadPoolExecutor(1) as rank0, ThreadPoolExecutor(1) as rank1:
        joining = rank1.submit(DaemonBackend, str(daemon.socket_path), world, 1, 2, timeout=10.0)
        wait_until(lambda: (world_status(daemon, world) or {}).get("waiting") == [1], "rank 1 first")
        comms = [DaemonBackend(str(daemon.socket_path), world, 0, 2, timeout=TIMEOUT_S), joining.result(10)]
        try:
            bufs = [hostmem.alloc(8), hostmem.alloc(8)]
            summed(comms, bufs)
            for r, buf in enumerate(bufs):
                buf.view(np.int32)[:2] = [r + 1, 10 * (r + 1)]
            first = rank0.submit(_raised, lambda: comms[0].all_reduce(bufs[0].ptr, 8, dtype="i32"))
            wait_until(lambda: (world_status(daemon, world) or {}).get("pending_calls") == 1,
                       "rank 0's call at the daemon")
            os.kill(daemon.pid, signal.SIGSTOP)
            try:
                assert isinstance(first.result(10), CommTimeout)
                mark(bufs[0])
                second = rank1.submit(_raised, lambda: comms[1].all_reduce(bufs[1].ptr, 8, dtype="i32"))
                time.sleep(0.3)  # (its Submit waits in the socket)
            finally:
                os.kill(daemon.pid, signal.SIGCONT)
            error = second.result(10)
            assert isinstance(error, WorldFailed), repr(error)
            _settled(daemon)
            assert [held(b) for b in bufs] == [MARKER, [2, 20]]
            assert rebuilt(comms) == [[3, 30], [3, 30]]
        finally:
            for comm in comms:
                comm.close()


def test_an_op_the_daemon_started_before_the_ranks_gave_up_no_longer_reaches_their_buffers(
        daemon: DaemonProcess) -> None:
    """The daemon stops in the middle of a 64 MiB all_reduce, both ranks give up
    (CommTimeout) and write their buffers, and the daemon goes on: the op it had started
    finishes, but on memory the worker no longer sees (the call's host buffers moved to
    fresh memory as the call was given up on). Before: all 16,777,216 elements of each
    buffer were overwritten with the sum."""
    for _ in range(_ATTEMPTS):
        with joined(daemon, TIMEOUT_S) as comms:
            bufs = [hostmem.alloc(_BIG), hostmem.alloc(_BIG)]
            summed(comms, bufs)  # (imported: the calls below are one Submit each)
            for buf in bufs:
                buf.view(np.float32)[:] = 1.0
            with ThreadPoolExecutor(2) as ranks:
                calls = [ranks.submit(_raised, comms[r].all_reduce, bufs[r].ptr, _BIG, dtype="f32")
                         for r in range(2)]
                caught = _stop_while_running(daemon, comms[0]._world, seq=1)
                try:
                    errors = [call.result(10) for call in calls]
                    for buf in bufs:
                        buf.view(np.float32)[:] = -7.0
                finally:
                    os.kill(daemon.pid, signal.SIGCONT)
            if not caught or not all(isinstance(e, CommTimeout) for e in errors):
                continue  # the op ended before the daemon stopped: once more
            assert not any(getattr(e, "__notes__", None) for e in errors), errors  # (moved at once)
            _settled(daemon)
            assert [int((buf.view(np.float32) != -7.0).sum()) for buf in bufs] == [0, 0]
            assert rebuilt(comms) == [[3, 30], [3, 30]]
            return
    pytest.fail(f"the daemon was never stopped in the middle of the op ({_ATTEMPTS} tries)")


def test_a_buffer_moved_off_a_given_up_call_is_named_afresh_to_another_worlds_daemon(
        daemon: DaemonProcess) -> None:
    """One worker process in two worlds: world A's call on a buffer is given up on (the
    buffer moves to fresh memory), and world B, which had the buffer mapped already, calls
    on it again: B's daemon connection forgets the old memory and maps the new, so B's
    all_reduce reads what the worker wrote since and writes where the worker reads (before
    the forget: the sum of the old bytes, written where the worker never looks)."""
    with joined(daemon, TIMEOUT_S) as a, joined(daemon, 10.0) as b:
        shared, other = hostmem.alloc(8), hostmem.alloc(8)
        assert summed(a, [shared, hostmem.alloc(8)]) == [[3, 30], [3, 30]]  # (imported for both)
        assert summed(b, [shared, other]) == [[3, 30], [3, 30]]
        old = shared.id
        os.kill(daemon.pid, signal.SIGSTOP)
        try:
            assert isinstance(_raised(a[0].all_reduce, shared.ptr, 8, dtype="i32"), CommTimeout)
        finally:
            os.kill(daemon.pid, signal.SIGCONT)
        assert shared.id != old
        assert summed(b, [shared, other]) == [[3, 30], [3, 30]]
        assert old not in b[0]._imports and shared.id in b[0]._imports  # (the old one forgotten)


def _stop_while_running(daemon: DaemonProcess, world: str, seq: int) -> bool:
    """SIGSTOP the daemon once both ranks' call #`seq` runs there (False: it ended first, and
    the daemon is stopped all the same)."""
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        calls = ((world_status(daemon, world) or {}).get("recent_calls") or {}).values()
        states = [c["state"] for made in calls for c in made if c["seq"] == seq]  # type: ignore[attr-defined]
        if len(states) == 2 and (states == ["running", "running"] or "done" in states):
            os.kill(daemon.pid, signal.SIGSTOP)
            return states == ["running", "running"]
    raise AssertionError(f"call #{seq} never ran at the daemon")


def test_a_reply_in_the_socket_when_the_wait_gives_up_is_the_calls_answer(daemon: DaemonProcess) -> None:
    """The daemon did rank 0's all_reduce and its answer is in rank 0's socket, unread,
    when rank 0's wait gives up (its deadline came as the answer did): the call returns
    the sum, as rank 1's did, and the connection stays (before: CommTimeout, the
    connection dropped, and the ranks disagreed on whether the step was made)."""
    with joined(daemon, TIMEOUT_S) as comms:
        bufs = [hostmem.alloc(8), hostmem.alloc(8)]
        summed(comms, bufs)  # (imported: the call below is one Submit)
        transport = comms[0]._conn.transport
        wait = transport._wait
        answered = select.poll()
        answered.register(transport._sock.fileno(), select.POLLIN)

        def gives_up_as_the_answer_comes(request_id: int, deadline: float | None) -> Any:
            wait_until(lambda: answered.poll(0), "rank 0's answer in its socket")
            raise CommTimeout(f"request {request_id}: the deadline came (as the answer did)")

        transport._wait = gives_up_as_the_answer_comes  # type: ignore[method-assign]
        try:
            assert summed(comms, bufs) == [[3, 30], [3, 30]]
        finally:
            transport._wait = wait  # type: ignore[method-assign]
        assert comms[0].is_healthy() and comms[1].is_healthy()
        assert summed(comms, bufs) == [[3, 30], [3, 30]]


Halves = tuple[list[DaemonBackend], hostmem.HostBuffer, hostmem.HostBuffer,
               "Future[Exception | None]", "Future[None]", ThreadPoolExecutor]


@contextlib.contextmanager
def _halves_in_two_worlds(daemon: DaemonProcess) -> Iterator[Halves]:
    """One worker process in two worlds, A on `daemon` and B (its ranks `b`) on a daemon of
    its own, on two halves of one buffer `shared`: B's all_reduce on the second half
    (`in_b`) waits at its daemon for B's other rank (whose buffer is `b1`), and A's on the
    first half (`in_a`, what it raised) waits at A's daemon for A's other rank."""
    other = own_daemon()
    b_daemon = next(other)
    try:
        with joined(daemon, 10.0) as a, joined(b_daemon, 10.0) as b, \
                ThreadPoolExecutor(2) as calls:
            shared, a1, b1 = hostmem.alloc(16), hostmem.alloc(8), hostmem.alloc(8)
            on_both(lambda r: a[r].all_reduce([shared, a1][r].ptr, 8, dtype="i32"))  # (imported)
            on_both(lambda r: b[r].all_reduce([shared, b1][r].ptr + 8 * (1 - r), 8, dtype="i32"))
            shared.view(np.int32)[:] = [1, 10, 1, 10]
            b1.view(np.int32)[:] = [2, 20]
            in_b = calls.submit(b[0].all_reduce, shared.ptr + 8, 8, dtype="i32")
            wait_until(lambda: (world_status(b_daemon, b[0]._world) or {}).get("pending_calls") == 1,
                       "B's call at its daemon")
            in_a = calls.submit(_raised, a[0].all_reduce, shared.ptr, 8, dtype="i32")
            wait_until(lambda: (world_status(daemon, a[0]._world) or {}).get("pending_calls") == 1,
                       "A's call at its daemon")
            yield b, shared, b1, in_a, in_b, calls
    finally:
        next(other, None)


def _raised(call: Callable[..., object], *args: Any, **kwargs: Any) -> Exception | None:
    """What `call(*args, **kwargs)` raised (None: it returned)."""
    try:
        call(*args, **kwargs)
    except Exception as exc:
        return exc
    return None


def _settled(daemon: DaemonProcess) -> None:
    """The daemon, gone on, answers again: a late op would have run by now."""
    query_status(str(daemon.socket_path), 5)
    time.sleep(0.5)


def test_a_call_in_flight_in_another_world_keeps_its_result_when_a_lost_call_moves_the_buffer(
        daemon: DaemonProcess) -> None:
    """One worker process in two worlds (each on a daemon of its own) uses two halves of one
    buffer: world B's all_reduce on the second half waits at its daemon for B's other rank
    while world A's call on the first half is lost (A's daemon killed). B's call then
    completes and returns: its sum must be in the buffer the worker reads."""
    with _halves_in_two_worlds(daemon) as (b, shared, b1, in_a, in_b, _calls):
        daemon.kill()
        assert isinstance(in_a.result(10), CommError)
        b[1].all_reduce(b1.ptr, 8, dtype="i32")
        in_b.result(10)
        assert b1.view(np.int32).tolist() == [3, 30]
        assert shared.view(np.int32)[2:].tolist() == [3, 30]  # B's result, where the worker reads


def test_a_buffer_whose_move_once_another_call_ended_failed_is_refused_at_its_next_call(
        daemon: DaemonProcess, monkeypatch: pytest.MonkeyPatch) -> None:
    """As above, but the move B's call's end makes fails (out of open files): the buffer
    stays on the memory the lost call's daemon may still write. The next call naming it
    must say so (LimitExceeded), not go on with that memory (before: nothing told the
    worker, and it went on reading what that daemon wrote); the buffer moves as that call
    ends, and the call made again works."""
    with _halves_in_two_worlds(daemon) as (b, shared, b1, in_a, in_b, calls):
        def out_of_files(nbytes: int) -> int:
            raise OSError(errno.EMFILE, os.strerror(errno.EMFILE))

        monkeypatch.setattr(hostmem, "_sealed_memfd", out_of_files)
        daemon.kill()
        assert isinstance(in_a.result(10), CommError)
        b[1].all_reduce(b1.ptr, 8, dtype="i32")
        in_b.result(10)  # (the buffer's move, once B's call ended, failed)
        monkeypatch.undo()
        old = shared.id
        theirs = mmap.mmap(shared.fd, shared.size)  # the memory as A's daemon maps it
        rank1 = calls.submit(b[1].all_reduce, b1.ptr, 8, dtype="i32")
        with pytest.raises(LimitExceeded, match=f"host buffer {old} could not be moved"):
            b[0].all_reduce(shared.ptr + 8, 8, dtype="i32")
        assert shared.id != old
        np.frombuffer(theirs, np.int32)[:] = -1  # A's daemon, late
        assert shared.view(np.int32).tolist() == [1, 10, 3, 30]
        b[0].all_reduce(shared.ptr + 8, 8, dtype="i32")  # (made again)
        rank1.result(10)
        assert shared.view(np.int32).tolist() == [1, 10, 6, 60]
        assert b1.view(np.int32).tolist() == [6, 60]
        theirs.close()


def test_an_op_running_when_ctrl_c_lands_as_its_submit_went_no_longer_reaches_the_buffer(
        daemon: DaemonProcess, monkeypatch: pytest.MonkeyPatch) -> None:
    """Rank 1's 64 MiB all_reduce waits at the daemon; rank 0's Submit goes (the daemon
    starts the op at once, and is stopped in the middle of it), and a Ctrl-C lands as the
    send returns. Rank 0 hears KeyboardInterrupt and writes its buffer, the daemon goes on:
    the op it had started must not write what rank 0 sees now (before: the call was not
    counted as sent, and 16,580,608 of its 16,777,216 elements were overwritten)."""
    for _ in range(_ATTEMPTS):
        with joined(daemon, 10.0) as comms, ThreadPoolExecutor(1) as rank1:
            bufs = [hostmem.alloc(_BIG), hostmem.alloc(_BIG)]
            summed(comms, bufs)
            for buf in bufs:
                buf.view(np.float32)[:] = 1.0
            other = rank1.submit(_raised, comms[1].all_reduce, bufs[1].ptr, _BIG, dtype="f32")
            wait_until(lambda: (world_status(daemon, comms[0]._world) or {}).get("pending_calls") == 1,
                       "rank 1's call at the daemon")
            caught = _ctrl_c_once_sent(monkeypatch, daemon, comms[0])
            try:
                with pytest.raises(KeyboardInterrupt):
                    comms[0].all_reduce(bufs[0].ptr, _BIG, dtype="f32")
                bufs[0].view(np.float32)[:] = -7.0
            finally:
                os.kill(daemon.pid, signal.SIGCONT)
            other.result(10)
            if not caught[0]:
                continue  # the op ended before the daemon stopped: once more
            _settled(daemon)
            assert int((bufs[0].view(np.float32) != -7.0).sum()) == 0
            return
    pytest.fail(f"the daemon was never stopped in the middle of the op ({_ATTEMPTS} tries)")


def _ctrl_c_once_sent(monkeypatch: pytest.MonkeyPatch, daemon: DaemonProcess,
                      comm: DaemonBackend) -> list[bool]:
    """Rank `comm`'s next send stops the daemon in the middle of its call #1 once it is
    made, then a real SIGINT lands as it returns; what _stop_while_running said, once sent."""
    transport = comm._conn.transport
    real_send, caught = transport._send, []

    def send_then_ctrl_c(packet: bytes, fds: Any, deadline: float | None) -> bool:
        monkeypatch.undo()
        went = real_send(packet, fds, deadline)
        caught.append(_stop_while_running(daemon, comm._world, seq=1))
        signal.pthread_kill(threading.main_thread().ident, signal.SIGINT)  # type: ignore[arg-type]
        time.sleep(5)  # (not reached)
        return went

    monkeypatch.setattr(transport, "_send", send_then_ctrl_c)
    return caught
