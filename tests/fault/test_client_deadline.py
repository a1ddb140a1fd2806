"""One deadline per call (DESIGN §9): a call that first hands the daemon its buffer (an
Import) and then submits waits for both together no longer than its timeout (and the
grace its submission gives the daemon's own verdict), not a timeout for each step. And
the operator's cap on how long a call may stay open (--max-call-timeout) holds whatever
timeout the ranks ask for."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import pytest

import proto
from client import CommError, CommTimeout, DaemonBackend, DaemonUnavailable, hostmem
from client import calls as client_calls
from client import daemon as client_daemon
from client import transport as client_transport
from commd.launch import DaemonProcess
from tests.fault.ranks import joined, met_the_failure, on_both, own_daemon, slowed, summed
from tests.integration.harness import query_status, wait_until, world_name, world_status

pytestmark = pytest.mark.timeout(60)
TIMEOUT_S = 2.0
IMPORT_S = 1.5  # how long the first step takes


@pytest.fixture
def daemon(request: pytest.FixtureRequest) -> Iterator[DaemonProcess]:
    yield from own_daemon(getattr(request, "param", ()))


def test_a_call_whose_import_was_slow_has_only_the_rest_of_its_deadline_to_submit(
        daemon: DaemonProcess) -> None:
    with joined(daemon, TIMEOUT_S) as comms:
        slow_import_then_stop(comms[0], daemon)  # (the submission that follows is never answered)
        fresh = hostmem.alloc(64)  # (never handed to the daemon: the call imports it first)
        started = time.monotonic()
        try:
            with pytest.raises(CommTimeout):
                comms[0].all_reduce(fresh.ptr, 8, dtype="i32")
            took = time.monotonic() - started
        finally:
            os.kill(daemon.pid, signal.SIGCONT)
    # one deadline: TIMEOUT_S + the grace from the call's start; a deadline per step
    # would have given the submission that much again after the import's IMPORT_S
    one_deadline = TIMEOUT_S + client_calls._VERDICT_GRACE_S
    assert took < one_deadline + 0.5 < IMPORT_S + one_deadline


def test_a_send_the_daemon_does_not_take_gives_up_at_the_calls_deadline(daemon: DaemonProcess) -> None:
    """register_buffer hands the daemon its buffer first (slowed to IMPORT_S), and the
    daemon then stops reading (SIGSTOP, the socket's send buffer filled): the Register's
    send waits only for what is left of the call's deadline, and the call raises
    CommTimeout by then (before: the send waited the backend's whole timeout from its own
    start, and the call raised DaemonUnavailable IMPORT_S + TIMEOUT_S after it began). The
    connection is dropped (the daemon may have taken nothing), and the ranks rebuild."""
    with joined(daemon, TIMEOUT_S) as comms:
        slow_import_then_stop(comms[0], daemon, full_socket=True)
        fresh = hostmem.alloc(64)
        started = time.monotonic()
        try:
            with pytest.raises(CommTimeout, match="dropped"):
                comms[0].register_buffer(fresh.ptr, 64)
            took = time.monotonic() - started
        finally:
            os.kill(daemon.pid, signal.SIGCONT)
        assert took < TIMEOUT_S + 0.5 < IMPORT_S + TIMEOUT_S, took
        with pytest.raises(CommError):  # (the daemon heard rank 0 go: the world failed)
            comms[1].barrier()
        on_both(lambda r: comms[r].attempt_reconnect())
        assert summed(comms, [hostmem.alloc(8), hostmem.alloc(8)]) == [[3, 30], [3, 30]]
        assert comms[0].register_buffer(fresh.ptr, 64) > 0


def test_a_call_waiting_for_another_threads_import_gives_up_by_its_own_deadline(
        daemon: DaemonProcess, monkeypatch: pytest.MonkeyPatch) -> None:
    """Imports take turns (one lock, held over the round trip). Thread `early` starts its
    call first but reaches its import late (its pointer lookup slowed); thread `late`,
    started meanwhile, holds the turn over a slow import, within its own deadline. The
    early call raises CommTimeout by its own deadline (before: it waited for the turn until
    the late import was done, 1.5 s past its deadline, and only then timed out); the late
    call succeeds, and so does the early call's buffer afterwards."""
    timeout = 4.0
    with DaemonBackend(str(daemon.socket_path), world_name(), 0, 1, timeout=timeout) as comm:
        early_buf, late_buf = hostmem.alloc(8), hostmem.alloc(8)  # (neither imported yet)
        early_buf.view(np.int32)[:2] = [1, 10]
        late_buf.view(np.int32)[:2] = [2, 20]
        looking_up = slowed(monkeypatch, comm._resolver, "resolve", "early", 3.0)
        slowed(monkeypatch, comm._conn.transport, "request", "late", 3.0,
               when=lambda msg, *args, **kwargs: isinstance(msg, proto.Import))
        with ThreadPoolExecutor(1, "early") as early, ThreadPoolExecutor(1, "late") as late:
            started = time.monotonic()
            early_call = early.submit(comm.all_reduce, early_buf.ptr, 8, dtype="i32")
            assert looking_up.wait(5)
            time.sleep(max(0.0, started + 2.5 - time.monotonic()))
            late_call = late.submit(comm.all_reduce, late_buf.ptr, 8, dtype="i32")
            error = early_call.exception(20)
            took = time.monotonic() - started
            late_call.result(20)
        assert took < timeout + 0.8, took  # (before: 5.5 s, when the late import was done)
        assert isinstance(error, CommTimeout) and "another thread's import" in str(error), repr(error)
        assert late_buf.view(np.int32)[:2].tolist() == [2, 20]
        comm.all_reduce(early_buf.ptr, 8, dtype="i32")
        assert early_buf.view(np.int32)[:2].tolist() == [1, 10]


def test_a_failed_send_waits_for_the_daemons_last_word_no_longer_than_the_call_may(
        daemon: DaemonProcess, monkeypatch: pytest.MonkeyPatch) -> None:
    """Rank 0's recv_command_u32 (no deadline) reads for every thread when the daemon stops
    reading (SIGSTOP, the socket's buffer filled): symmetric_alloc's send gives up at the
    call's deadline, and the call raises CommTimeout then, without waiting for the reader
    to learn why the daemon went (a failed send waits for that only while its deadline
    allows: before, it waited the whole parting wait, stretched here from 1 s to 5 s so
    that the two tell apart with slack, then raised). The connection is dropped, and the
    reader's call ends with it."""
    monkeypatch.setattr(client_transport, "_PARTING_WAIT_S", 5.0)
    with joined(daemon, TIMEOUT_S) as comms:
        bufs = [hostmem.alloc(8), hostmem.alloc(8)]
        summed(comms, bufs)  # (rank 0's buffer is imported: its command request is the one read for)
        transport = comms[0]._conn.transport
        with ThreadPoolExecutor(1) as waiting:
            command = waiting.submit(comms[0].recv_command_u32, bufs[0].ptr, 1)  # rank 1 never sends
            wait_until(lambda: transport._reader is not None, "rank 0 reading for its command")
            os.kill(daemon.pid, signal.SIGSTOP)
            try:
                fill_send_buffer(transport._sock)
                started = time.monotonic()
                with pytest.raises(CommTimeout, match="connection was dropped"):
                    comms[0].symmetric_alloc(64)
                took = time.monotonic() - started
            finally:
                os.kill(daemon.pid, signal.SIGCONT)
            with pytest.raises(DaemonUnavailable):
                command.result(10)
    assert took < TIMEOUT_S + 1.0, took  # (its send took TIMEOUT_S, the call's deadline)


def test_a_rejoin_connects_within_what_is_left_of_its_deadline(daemon: DaemonProcess) -> None:
    """The daemon is killed and a new one started that accepts nothing (stopped, its listen
    backlog full), its socket kept out of sight (renamed) until 1.2 s before rank 0's rejoin
    gives up: the rejoin's last try to connect waits only for what is left of the rejoin's
    deadline, and attempt_reconnect raises DaemonUnavailable by then (before: that connect
    waited the backend's whole timeout, 3 s, and the call ended 1.8 s or more past its
    deadline). Once the daemon goes on, the rank rejoins and its calls work."""
    timeout = 3.0
    with DaemonBackend(str(daemon.socket_path), world_name(), 0, 1, timeout=timeout) as comm:
        daemon.kill()
        met_the_failure(comm)
        daemon.start()
        hidden = daemon.socket_path.with_name("hidden.sock")
        os.kill(daemon.pid, signal.SIGSTOP)
        try:
            with fill_backlog(str(daemon.socket_path)), ThreadPoolExecutor(1) as rank0:
                os.rename(daemon.socket_path, hidden)
                started = time.monotonic()
                rejoin = rank0.submit(comm.attempt_reconnect)
                gives_up = started + timeout + client_daemon._JOIN_GRACE_S
                time.sleep(max(0.0, gives_up - 1.2 - time.monotonic()))
                os.rename(hidden, daemon.socket_path)  # (its next try to connect waits in the backlog)
                error = rejoin.exception(20)
                took = time.monotonic() - started
        finally:
            os.kill(daemon.pid, signal.SIGCONT)
        assert took < timeout + client_daemon._JOIN_GRACE_S + 0.8, took
        assert isinstance(error, DaemonUnavailable), repr(error)
        assert "cannot connect to the daemon" in str(error), str(error)
        comm.attempt_reconnect()
        buf = hostmem.alloc(8)
        buf.view(np.int32)[:2] = [5, 50]
        comm.all_reduce(buf.ptr, 8, dtype="i32")
        assert buf.view(np.int32)[:2].tolist() == [5, 50]


def test_a_call_a_stopped_daemon_never_answers_names_its_world(daemon: DaemonProcess) -> None:
    """The daemon stops (SIGSTOP) under a one-rank world's barrier: the CommTimeout the rank
    decides alone (its timeout and the verdict's grace passed) names the world, as the
    daemon's own verdict does, so that a worker in several worlds can tell which call it was
    (before: 'the call did not complete before its deadline; ...', no world). Once the daemon
    goes on, the rank rejoins and its calls work."""
    world = world_name()
    with DaemonBackend(str(daemon.socket_path), world, 0, 1, timeout=0.5) as comm:
        os.kill(daemon.pid, signal.SIGSTOP)
        try:
            with pytest.raises(CommTimeout) as timed_out:
                comm.barrier()
        finally:
            os.kill(daemon.pid, signal.SIGCONT)
        said = str(timed_out.value)
        assert said.startswith(f"world {world} "), said
        assert "did not complete before its deadline" in said and said.count("attempt_reconnect") == 1, said
        comm.attempt_reconnect()
        buf = hostmem.alloc(8)
        buf.view(np.int32)[:2] = [5, 50]
        comm.all_reduce(buf.ptr, 8, dtype="i32")
        assert buf.view(np.int32)[:2].tolist() == [5, 50]


def test_the_calls_besides_the_ops_a_stopped_daemon_never_answers_name_their_world(
        daemon: DaemonProcess) -> None:
    """As for an op (above): register_buffer, deregister_buffer, symmetric_alloc and
    symmetric_free on a stopped daemon (SIGSTOP) each fail at their deadline with a
    CommTimeout that names the world and says to reconnect, which is what it leaves to do:
    is_healthy() is False (before: 'the call did not complete before its deadline', no
    world, no advice). Once the daemon goes on, the rank rejoins and sums."""
    world = world_name()
    with DaemonBackend(str(daemon.socket_path), world, 0, 1, timeout=0.5) as comm:
        buf = hostmem.alloc(64)
        handle = comm.register_buffer(buf.ptr, 64)
        ptr = comm.symmetric_alloc(64)
        os.kill(daemon.pid, signal.SIGSTOP)
        said: dict[str, str] = {}
        try:
            for call, fn in (("register_buffer", lambda: comm.register_buffer(buf.ptr, 32)),
                             ("deregister_buffer", lambda: comm.deregister_buffer(handle)),
                             ("symmetric_alloc", lambda: comm.symmetric_alloc(64)),
                             ("symmetric_free", lambda: comm.symmetric_free(ptr))):
                with pytest.raises(CommTimeout) as timed_out:
                    fn()
                said[call] = str(timed_out.value)
            assert not comm.is_healthy()
        finally:
            os.kill(daemon.pid, signal.SIGCONT)
        for call, words in said.items():
            assert words.startswith(f"world {world} "), (call, words)
            assert words.count("attempt_reconnect") == 1, (call, words)
        comm.attempt_reconnect()
        buf.view(np.int32)[:2] = [5, 50]
        comm.all_reduce(buf.ptr, 8, dtype="i32")
        assert buf.view(np.int32)[:2].tolist() == [5, 50]


@contextlib.contextmanager
def fill_backlog(path: str) -> Iterator[None]:
    """Connections that fill the listen backlog of a daemon that accepts none (stopped), so
    that the next connect waits; closed at the end."""
    with contextlib.ExitStack() as connections:
        while True:
            sock = connections.enter_context(socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET))
            sock.setblocking(False)
            try:
                sock.connect(path)
            except BlockingIOError:
                break
        yield


def slow_import_then_stop(comm: DaemonBackend, daemon: DaemonProcess, full_socket: bool = False) -> None:
    """`comm`'s next Import takes IMPORT_S more, and once it is answered the daemon stops
    (SIGSTOP; with `full_socket`, `comm`'s send buffer filled too, so its next send waits)."""
    transport = comm._conn.transport
    request = transport.request

    def slow_import_then_a_stopped_daemon(msg: proto.Message, *args: Any, **kwargs: Any) -> Any:
        if not isinstance(msg, proto.Import):
            return request(msg, *args, **kwargs)
        time.sleep(IMPORT_S)
        try:
            return request(msg, *args, **kwargs)
        finally:
            os.kill(daemon.pid, signal.SIGSTOP)
            if full_socket:
                fill_send_buffer(transport._sock)

    transport.request = slow_import_then_a_stopped_daemon  # type: ignore[method-assign]


def fill_send_buffer(sock: socket.socket) -> None:
    """Fill the connection's send buffer through a copy of its socket (without waiting: by
    the flag, not the shared file's mode), so that the next send blocks."""
    with socket.socket(fileno=os.dup(sock.fileno())) as filler:
        forget = proto.encode(proto.Forget(tuple(range(1, proto.MAX_GROUP_OPS + 1))))
        with contextlib.suppress(BlockingIOError):
            while True:
                filler.send(forget, socket.MSG_DONTWAIT)


@pytest.mark.parametrize("daemon", [["--max-call-timeout", "1"]], indirect=True)
def test_the_daemons_cap_on_an_open_call_holds_over_a_ranks_longer_timeout(
        daemon: DaemonProcess) -> None:
    with joined(daemon, 30) as comms:
        assert daemon_status(daemon)["call_timeout_s"] == 1.0
        buf = hostmem.alloc(8)
        started = time.monotonic()
        with pytest.raises(CommTimeout, match="did not complete within 1s"):
            comms[0].all_reduce(buf.ptr, 8, dtype="i32")  # rank 1 never calls
        assert time.monotonic() - started < 10  # (not the rank's 30 s)
        assert not comms[0].is_healthy()
        wait_until(lambda: not comms[1].is_healthy(), "rank 1 told of the failure", timeout=5)
        on_both(lambda r: comms[r].attempt_reconnect())
        assert summed(comms, [hostmem.alloc(8), hostmem.alloc(8)]) == [[3, 30], [3, 30]]


def daemon_status(daemon: DaemonProcess) -> dict[str, Any]:
    """The status of the daemon's one world."""
    worlds = query_status(str(daemon.socket_path), 5)["worlds"]
    assert len(worlds) == 1
    world: dict[str, Any] = worlds[0]
    return world


def test_what_a_rejoin_restores_has_a_deadline_of_its_own(daemon: DaemonProcess) -> None:
    """The daemon is killed; rank 0 rejoins at once, the daemon is back after 1.6 s, and
    rank 1 comes just before rank 0's rejoin gives up: the rebuild took all of the call's
    deadline, and rank 0 still registers its 3000 buffers and tells its add kernel again
    (before: refused unsent, the rebuilt world marked unhealthy, and the registrations
    never made again, a later reconnect on the same daemon leaving them so)."""
    world = world_name()
    with joined(daemon, TIMEOUT_S, world) as comms:
        big = hostmem.alloc(1 << 22)
        for i in range(3000):
            comms[0].register_buffer(big.ptr + 256 * i, 256)
        on_both(lambda r: comms[r].set_add_kernel(100 + r))
        daemon.kill()
        for comm in comms:
            met_the_failure(comm)
        started = time.monotonic()
        with ThreadPoolExecutor(1) as rank0:
            rejoined = rank0.submit(comms[0].attempt_reconnect)
            time.sleep(1.6)
            daemon.start()
            wait_until(lambda: (world_status(daemon, world) or {}).get("waiting") == [0],
                       "rank 0 waiting at the restarted daemon", timeout=5)
            # rank 0's hello came by now, and the daemon gives it TIMEOUT_S from its coming
            heard_by = time.monotonic()
            gives_up = min(started + TIMEOUT_S + client_daemon._JOIN_GRACE_S, heard_by + TIMEOUT_S)
            time.sleep(max(0.0, gives_up - 0.3 - time.monotonic()))
            assert time.monotonic() > started + TIMEOUT_S  # (past the call's own deadline)
            comms[1].attempt_reconnect()
            rejoined.result(20)
        assert [comm.is_healthy() for comm in comms] == [True, True]
        assert (world_status(daemon, world) or {})["add_kernel"] == {"0": 100, "1": 101}
        assert all(reg.daemon_handle is not None for reg in comms[0]._registrations._by_handle.values())
        assert summed(comms, [hostmem.alloc(8), hostmem.alloc(8)]) == [[3, 30], [3, 30]]


def test_a_timeout_of_weeks_is_waited_for_like_any_other(daemon: DaemonProcess) -> None:
    """A timeout may be up to a year, but poll() takes its wait in milliseconds as a C int
    (at most about 24.8 days): a longer deadline is waited for in steps. Before: every wait
    for the daemon raised OverflowError ("timeout is too large"), no CommError, from the
    constructor's hello on, so a backend with a timeout of 25 days or more could not be made."""
    with joined(daemon, 30 * 86400.0) as comms:
        bufs = [hostmem.alloc(8) for _ in range(2)]
        assert summed(comms, bufs) == [[3, 30], [3, 30]]
        with ThreadPoolExecutor(1) as later:  # rank 0 waits in its reader's poll for rank 1
            late = later.submit(lambda: (time.sleep(0.3), comms[1].all_reduce(bufs[1].ptr, 8, dtype="i32")))
            comms[0].all_reduce(bufs[0].ptr, 8, dtype="i32")
            late.result(10)
        assert [buf.view(np.int32)[:2].tolist() for buf in bufs] == [[6, 60], [6, 60]]
        assert all(comm.is_healthy() for comm in comms)
