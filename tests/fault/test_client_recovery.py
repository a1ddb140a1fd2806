"""The client's harder paths against a real daemon, with the ranks as threads of this
process: a call that timed out while the daemon stalled (SIGSTOP), a daemon killed and
restarted while the ranks already knew their world had failed, a registration whose
memory went before the daemon restarted, late events, and a group open on one thread
while another calls. Each ends with a call whose data is checked."""

from __future__ import annotations

import os
import resource
import select
import signal
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import pytest

import proto
from client import (
    CommError,
    CommTimeout,
    DaemonBackend,
    LimitExceeded,
    MisuseError,
    ProtocolError,
    WorldFailed,
    hostmem,
)
from client.hostmem import default_memory
from commd.launch import DaemonProcess
from proto import ErrorCode
from tests.fault.ranks import joined, met_the_failure, on_both, own_daemon, restart_daemon, summed
from tests.integration.harness import (
    back_to,
    held_at_rest,
    memfd_mappings,
    open_fds,
    wait_until,
    world_name,
    world_status,
)

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def daemon(request: pytest.FixtureRequest) -> Iterator[DaemonProcess]:
    yield from own_daemon(getattr(request, "param", ()))


def test_a_buffer_whose_import_timed_out_works_after_reconnect(daemon: DaemonProcess) -> None:
    """The daemon stalls during rank 0's first call on a buffer: the Import times out on
    the client, but the daemon maps it once it runs again. After attempt_reconnect the
    buffer must work (before: "buffer id already in use" on every call)."""
    with joined(daemon, timeout=1) as comms:
        bufs = [hostmem.alloc(8) for _ in range(2)]
        os.kill(daemon.pid, signal.SIGSTOP)
        threading.Timer(1.5, os.kill, (daemon.pid, signal.SIGCONT)).start()
        with pytest.raises(CommTimeout):
            comms[0].all_reduce(bufs[0].ptr, 8, dtype="i32")
        time.sleep(1.0)  # running again; rank 1 hears of the failed world too
        on_both(lambda r: comms[r].attempt_reconnect())
        assert summed(comms, bufs) == [[3, 30], [3, 30]]
        assert summed(comms, bufs) == [[3, 30], [3, 30]]  # and the cached op again


def test_the_first_reconnect_after_a_daemon_restart_works(daemon: DaemonProcess) -> None:
    """Both ranks know their world failed (a lonely call timed out) when the daemon is
    killed and restarted: attempt_reconnect, which would have asked the dead daemon,
    reconnects to the new one at the first try."""
    with joined(daemon, timeout=2) as comms:
        bufs = [hostmem.alloc(8) for _ in range(2)]
        with pytest.raises(CommError):
            comms[0].barrier()  # rank 1 never calls it: the world fails
        time.sleep(0.3)
        assert not any(comm.is_healthy() for comm in comms)
        daemon.kill()
        daemon.start()
        on_both(lambda r: comms[r].attempt_reconnect())
        assert summed(comms, bufs) == [[3, 30], [3, 30]]


def test_a_registration_whose_memory_went_before_a_restart_does_not_block_reconnect(
        daemon: DaemonProcess) -> None:
    with joined(daemon, timeout=5) as comms:
        bufs = [hostmem.alloc(8) for _ in range(2)]
        gone = hostmem.alloc(64)
        handle = comms[0].register_buffer(gone.ptr, 64)
        kept = comms[1].register_buffer(bufs[1].ptr, 8)
        gone.close()  # freed without deregistering
        on_both(lambda r: comms[r].barrier())
        daemon.kill()
        daemon.start()
        on_both(lambda r: comms[r].attempt_reconnect())
        assert summed(comms, bufs) == [[3, 30], [3, 30]]
        comms[0].deregister_buffer(handle)  # nothing left at the daemon: it just goes
        comms[1].deregister_buffer(kept)  # registered again with the new daemon


def test_a_late_event_about_the_old_epoch_does_not_fail_the_new_one(daemon: DaemonProcess) -> None:
    """A failure pushed about epoch 1 that the rank reads only after it reconnected (to
    epoch 2) is old news; one about epoch 2 is not, even if it comes while reconnecting."""
    with joined(daemon, timeout=2) as comms:
        bufs = [hostmem.alloc(8) for _ in range(2)]
        with pytest.raises(CommError):
            comms[0].barrier()  # rank 1 never calls it: epoch 1 fails
        on_both(lambda r: comms[r].attempt_reconnect())
        assert [comm.epoch for comm in comms] == [2, 2]
        conn = comms[0]._conn
        conn._on_event(proto.Event(proto.EventKind.WORLD_FAILED, ErrorCode.TIMEOUT, "epoch 1 failed", 1),
                       conn.transport)
        assert comms[0].is_healthy()
        assert summed(comms, bufs) == [[3, 30], [3, 30]]
        conn = comms[0]._conn
        conn._on_event(proto.Event(proto.EventKind.WORLD_FAILED, ErrorCode.TIMEOUT, "epoch 2 failed", 2),
                       conn.transport)
        assert not comms[0].is_healthy()


def test_a_group_open_on_one_thread_does_not_take_another_threads_call(daemon: DaemonProcess) -> None:
    """Groups are per thread, as NCCL's: while this thread holds a group open, another
    thread's all_reduce on the same backend runs (and sums) at once."""
    with joined(daemon, timeout=5) as comms:
        bufs = [hostmem.alloc(8) for _ in range(2)]
        comms[0].group_start()
        assert summed(comms, bufs) == [[3, 30], [3, 30]]  # rank 0's call from another thread
        with ThreadPoolExecutor(1) as pool:
            other = pool.submit(comms[1].barrier)
            comms[0].barrier()  # in the group: sent at group_end
            comms[0].group_end()
            other.result(10)


def test_symmetric_memory_of_a_killed_daemon_used_with_the_new_one_is_let_go_when_freed(
        daemon: DaemonProcess) -> None:
    """After a restart, symmetric buffers of the old daemon are the worker's own memory;
    used with the new daemon they are imported there like any buffer, and symmetric_free
    must make the new daemon forget them too."""
    with joined(daemon, timeout=3) as comms:
        ptrs = on_both(lambda r: comms[r].symmetric_alloc(4096))
        daemon.kill()
        daemon.start()
        on_both(lambda r: comms[r].attempt_reconnect())
        on_both(lambda r: comms[r].all_reduce(ptrs[r], 4096, dtype="u8"))
        assert memfd_mappings(daemon.pid) == 2
        on_both(lambda r: comms[r].symmetric_free(ptrs[r]))
        on_both(lambda r: comms[r].barrier())  # (carries the forgets)
        deadline = time.monotonic() + 5
        while memfd_mappings(daemon.pid):
            assert time.monotonic() < deadline, memfd_mappings(daemon.pid)
            time.sleep(0.05)


def stalled_daemon_times_out(daemon: DaemonProcess, call: Callable[[], object]) -> None:
    """`call` times out while the daemon is stopped; it does the work once it runs again."""
    os.kill(daemon.pid, signal.SIGSTOP)
    threading.Timer(1.5, os.kill, (daemon.pid, signal.SIGCONT)).start()
    with pytest.raises(CommTimeout):
        call()
    time.sleep(1.0)  # running again: the late reply is on its way


@pytest.mark.parametrize("daemon", [["--max-registrations", "1"]], indirect=True)
def test_a_registration_that_timed_out_is_undone_when_its_reply_comes(daemon: DaemonProcess) -> None:
    """The daemon registers the buffer once it runs again, after the client gave up: the
    client undoes it when the late reply comes (before: it held a registration slot, and
    its memory, until the connection closed). With a limit of one, the next one fits."""
    with joined(daemon, timeout=1) as comms:
        bufs = [hostmem.alloc(8) for _ in range(2)]
        assert summed(comms, bufs) == [[3, 30], [3, 30]]  # imported: the stall meets the Register
        stalled_daemon_times_out(daemon, lambda: comms[0].register_buffer(bufs[0].ptr, 8))
        on_both(lambda r: comms[r].attempt_reconnect())  # (reads the late reply)
        handle = comms[0].register_buffer(bufs[0].ptr, 8)
        assert summed(comms, bufs) == [[3, 30], [3, 30]]
        comms[0].deregister_buffer(handle)


def test_a_symmetric_alloc_that_timed_out_is_freed_when_its_reply_comes(daemon: DaemonProcess) -> None:
    """The daemon allocates once it runs again, after the client gave up: the client has
    the daemon free it when the late reply comes (before: the memory stayed allocated in
    the daemon until the connection closed)."""
    with joined(daemon, timeout=1) as comms:
        bufs = [hostmem.alloc(8) for _ in range(2)]
        assert summed(comms, bufs) == [[3, 30], [3, 30]]  # (its buffers imported: part of the base)
        base = held_at_rest(daemon.pid)
        stalled_daemon_times_out(daemon, lambda: comms[0].symmetric_alloc(1 << 20))
        on_both(lambda r: comms[r].attempt_reconnect())
        assert summed(comms, bufs) == [[3, 30], [3, 30]]
        back_to(daemon.pid, base, timeout=5)


def test_a_group_holding_recv_command_waits_without_a_deadline(daemon: DaemonProcess) -> None:
    """recv_command_u32 waits for its command without a deadline, in a group too (the
    group was sent with the backend's deadline: a command later than it failed the world)."""
    with joined(daemon, timeout=1) as comms:
        bufs = [hostmem.alloc(4) for _ in range(2)]
        def rank(r: int) -> int:
            if r == 0:
                time.sleep(3.5)  # the command comes later than the timeout (and its grace)
                bufs[0].view(np.uint32)[0] = 7
                comms[0].broadcast(bufs[0].ptr, 4, 0)
            else:
                comms[1].group_start()
                comms[1].recv_command_u32(bufs[1].ptr, 0)
                comms[1].group_end()
            return int(bufs[r].view(np.uint32)[0])

        assert on_both(rank) == [7, 7]
        assert all(comm.is_healthy() for comm in comms)


def test_close_during_attempt_reconnect_does_not_rejoin_behind_it(daemon: DaemonProcess) -> None:
    """close() on another thread fails the pending Reconnect as if the daemon had gone:
    attempt_reconnect must not then join afresh behind the closed backend (before: it
    returned, its new socket leaked, and rank 1 waited out its timeout for rank 0)."""
    base = open_fds(os.getpid())
    with joined(daemon, timeout=3) as comms:
        outcome: list[object] = []

        def reconnect_rank0() -> None:
            try:
                comms[0].attempt_reconnect()
                outcome.append("returned")
            except CommError as exc:
                outcome.append(exc)

        reconnecting = threading.Thread(target=reconnect_rank0)
        reconnecting.start()
        time.sleep(0.3)  # rank 0's Reconnect waits for rank 1's
        comms[0].close()
        reconnecting.join(20)
        assert outcome and isinstance(outcome[0], MisuseError), outcome
        with pytest.raises(CommError):
            comms[1].attempt_reconnect()  # rank 0 never comes back
        started = time.monotonic()
        with pytest.raises(CommError):
            comms[1].barrier()
        assert time.monotonic() - started < 2, "rank 1 waited for a rank that had closed"
    assert open_fds(os.getpid()) == base


def test_the_add_kernel_is_set_again_after_a_daemon_restart(daemon: DaemonProcess) -> None:
    """set_add_kernel is part of what a rank tells a restarted daemon again (before: the
    new daemon's world had none, and the 2-rank add path was off without a word)."""
    world = world_name()
    with joined(daemon, timeout=5, world=world) as comms:
        on_both(lambda r: comms[r].set_add_kernel(100 + r))
        assert (world_status(daemon, world) or {})["add_kernel"] == {"0": 100, "1": 101}
        daemon.kill()
        daemon.start()
        on_both(lambda r: comms[r].attempt_reconnect())
        on_both(lambda r: comms[r].barrier())
        assert (world_status(daemon, world) or {})["add_kernel"] == {"0": 100, "1": 101}


def test_set_add_kernel_with_the_daemon_gone_returns_and_the_restarted_one_is_told(
        daemon: DaemonProcess) -> None:
    """The seed's set_add_kernel cannot fail: with its daemon killed it returns all the
    same, the backend is unhealthy, and the rejoin tells the restarted daemon the handle."""
    world = world_name()
    with joined(daemon, timeout=5, world=world) as comms:
        daemon.kill()
        on_both(lambda r: comms[r].set_add_kernel(200 + r))
        assert [comm.is_healthy() for comm in comms] == [False, False]
        daemon.start()
        on_both(lambda r: comms[r].attempt_reconnect())
        on_both(lambda r: comms[r].barrier())
        assert (world_status(daemon, world) or {})["add_kernel"] == {"0": 200, "1": 201}


def test_numpy_integers_are_integers_and_floats_are_misuse(daemon: DaemonProcess) -> None:
    """np.prod(shape) * 2 is a numpy integer: it works like an int (before: msgpack's
    TypeError, and the op cache kept it, so the same call with an int failed too; in
    symmetric_alloc it left the connection unusable for good). A float is refused here
    (before: sent, and the daemon dropped the connection, failing the rank's world)."""
    with joined(daemon, timeout=5) as comms:
        bufs = [hostmem.alloc(8) for _ in range(2)]
        for r, buf in enumerate(bufs):
            buf.view(np.int32)[:] = [r + 1, 10 * (r + 1)]
        on_both(lambda r: comms[r].all_reduce(bufs[r].ptr, np.int64(8), dtype="i32"))
        assert [buf.view(np.int32).tolist() for buf in bufs] == [[3, 30], [3, 30]]
        assert summed(comms, bufs) == [[3, 30], [3, 30]]  # the same op with a plain int
        for bad in (8.0, True, "8", None):
            with pytest.raises(MisuseError):
                comms[0].all_reduce(bufs[0].ptr, bad)  # type: ignore[arg-type]
        with pytest.raises(MisuseError):
            comms[0].broadcast(bufs[0].ptr, 8, 0.0)  # type: ignore[arg-type]
        ptr = comms[0].symmetric_alloc(np.uint32(64))  # type: ignore[arg-type]
        handle = comms[0].register_buffer(bufs[0].ptr, 8)
        for bad in (float(ptr), None, "0x10"):  # (not ValueError or TypeError)
            with pytest.raises(MisuseError, match="ptr must be an integer"):
                comms[0].symmetric_free(bad)  # type: ignore[arg-type]
        for bad in (float(handle), None):  # (1.0 deregistered handle 1)
            with pytest.raises(MisuseError, match="handle must be an integer"):
                comms[0].deregister_buffer(bad)  # type: ignore[arg-type]
        comms[0].deregister_buffer(np.int64(handle))  # type: ignore[arg-type]
        comms[0].symmetric_free(np.uint64(ptr))  # type: ignore[arg-type]
        fds = open_fds(os.getpid())
        for bad_args in ({"rank": 0.0}, {"timeout": float("inf")}, {"timeout": "5"}, {"token": 5}):
            args: dict[str, Any] = {"rank": 0, "timeout": 5, **bad_args}
            with pytest.raises(MisuseError):
                DaemonBackend(str(daemon.socket_path), world_name(), world_size=1, **args)
        assert open_fds(os.getpid()) == fds
        assert all(comm.is_healthy() for comm in comms)
        assert summed(comms, bufs) == [[3, 30], [3, 30]]


def vm_size() -> int:
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) * 1024 for line in status if line.startswith("VmSize"))


def test_symmetric_memory_this_process_cannot_map_is_a_comm_error_and_leaks_nothing(
        daemon: DaemonProcess) -> None:
    """RLIMIT_AS (a batch system's memory limit) keeps the worker from mapping what the
    daemon allocated: a LimitExceeded, the fd closed, the daemon's memory let go (before:
    a bare OSError, the fd leaked, the daemon held the memory until the connection went)."""
    with DaemonBackend(str(daemon.socket_path), world_name(), 0, 1, timeout=5) as comm:
        comm.barrier()
        fds, daemon_base = open_fds(os.getpid()), held_at_rest(daemon.pid)
        soft, hard = resource.getrlimit(resource.RLIMIT_AS)
        resource.setrlimit(resource.RLIMIT_AS, (vm_size() + (1 << 30), hard))
        try:
            with pytest.raises(LimitExceeded):
                comm.symmetric_alloc(4 << 30)
        finally:
            resource.setrlimit(resource.RLIMIT_AS, (soft, hard))
        assert open_fds(os.getpid()) == fds
        back_to(daemon.pid, daemon_base, timeout=5)
        comm.barrier()


def test_host_memory_this_process_cannot_map_or_size_is_a_comm_error_and_leaks_nothing(
        daemon: DaemonProcess) -> None:
    """hostmem.alloc under RLIMIT_AS (a batch system's memory limit), as a worker that tries
    smaller sizes until one fits would: a LimitExceeded each time and no fd left open (out
    of open files too, saying which limit to raise); a
    size that is no integer is a MisuseError (before: a bare OSError, and each failure
    leaked its memfd: a retrying worker runs out of fds; a float was a TypeError)."""
    memory = hostmem.HostMemory()
    with DaemonBackend(str(daemon.socket_path), world_name(), 0, 1, timeout=5, memory=memory) as comm:
        comm.barrier()
        fds = open_fds(os.getpid())
        soft, hard = resource.getrlimit(resource.RLIMIT_AS)
        resource.setrlimit(resource.RLIMIT_AS, (vm_size() + (1 << 30), hard))
        try:
            for _ in range(20):
                with pytest.raises(LimitExceeded, match="cannot allocate"):
                    memory.alloc(4 << 30)
        finally:
            resource.setrlimit(resource.RLIMIT_AS, (soft, hard))
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        top = max(int(fd) for fd in os.listdir("/proc/self/fd"))
        resource.setrlimit(resource.RLIMIT_NOFILE, (top + 1, hard))  # (new fds fit only in holes)
        held = []
        try:
            with pytest.raises(LimitExceeded) as raised:
                for _ in range(top + 1):
                    held.append(memory.alloc(64))
        finally:
            resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
        assert ("Too many open files; each host buffer holds one of this process's open files: "
                "raise its limit (ulimit -n)") in str(raised.value), raised.value
        for buf in held:
            buf.close()
        for size in (64.0, "64", None):
            with pytest.raises(MisuseError, match="nbytes must be an integer"):
                memory.alloc(size)  # type: ignore[arg-type]
        assert open_fds(os.getpid()) == fds
        with memory.alloc(np.int64(16)) as buf:  # (a numpy integer is one)
            assert type(buf.nbytes) is int
            buf.view(np.int32)[:] = [1, 2, 3, 4]
            comm.all_reduce(buf.ptr, 16, dtype="i32", op="max")
            assert buf.view(np.int32).tolist() == [1, 2, 3, 4]


def test_a_symmetric_alloc_that_fails_after_its_answer_leaks_no_fd(
        daemon: DaemonProcess, monkeypatch: pytest.MonkeyPatch) -> None:
    """An answer with two fds (a ProtocolError) and a mapping that fails with anything but
    an OSError: every fd the answer carried is closed and the daemon lets go of the memory
    (before: both leaked the fds, and the first did not free the daemon's memory)."""
    memory = hostmem.HostMemory()
    with DaemonBackend(str(daemon.socket_path), world_name(), 0, 1, timeout=5, memory=memory) as comm:
        comm.symmetric_free(comm.symmetric_alloc(64))
        fds, daemon_base = open_fds(os.getpid()), held_at_rest(daemon.pid)
        symmetric = comm._symmetric
        request = symmetric._request

        def two_fds(make: Any, **kwargs: Any) -> Any:
            answer = request(make, **kwargs)
            return answer._replace(fds=[*answer.fds, os.dup(answer.fds[0])]) if answer.fds else answer

        monkeypatch.setattr(symmetric, "_request", two_fds)
        with pytest.raises(ProtocolError, match="2 fds"):
            comm.symmetric_alloc(64)
        monkeypatch.undo()

        def broken_adopt(fd: int, nbytes: int, buffer_id: int) -> hostmem.HostBuffer:
            raise RuntimeError("mapping failed")

        monkeypatch.setattr(memory, "adopt", broken_adopt)
        with pytest.raises(RuntimeError, match="mapping failed"):
            comm.symmetric_alloc(64)
        assert open_fds(os.getpid()) == fds
        back_to(daemon.pid, daemon_base, timeout=5)
        comm.barrier()


def test_a_refused_re_registration_leaves_no_old_daemon_handle_behind(daemon: DaemonProcess) -> None:
    """The restarted daemon allows one registration; the rank held two. The one it could
    not make again must not keep the old daemon's handle (before: it did; the new daemon
    handed the same number to a later registration, and deregistering the old one dropped
    that one at the daemon)."""
    comm = DaemonBackend(str(daemon.socket_path), world_name(), 0, 1, timeout=5)
    x, y, z = (hostmem.alloc(64) for _ in range(3))
    restarted = DaemonProcess(daemon.socket_path, args=["--max-registrations", "1"])
    try:
        hx = comm.register_buffer(x.ptr, 64)
        hy = comm.register_buffer(y.ptr, 64)
        daemon.kill()
        restarted.start()
        with pytest.raises(LimitExceeded):
            comm.attempt_reconnect()  # x registered again; y refused (the world rebuilt all the same)
        assert comm.is_healthy()
        comm.deregister_buffer(hx)
        hz = comm.register_buffer(z.ptr, 64)  # the new daemon's only registration
        comm.deregister_buffer(hy)  # y: nothing held at the new daemon, nothing to drop
        with pytest.raises(LimitExceeded):  # z still holds the one registration allowed
            comm.register_buffer(x.ptr, 64)
        comm.deregister_buffer(hz)
    finally:
        comm.close()
        restarted.stop()


def test_registrations_a_restoring_left_undone_are_made_at_the_next_rebuild(
        daemon: DaemonProcess, monkeypatch: pytest.MonkeyPatch) -> None:
    """A rejoin's re-registering stops half-way (its 5th registration times out): the rank's
    next attempt_reconnect, a rebuild on the same daemon, makes the rest (before: only a
    rejoin registered again, and the rest stayed unmade at the daemon for good)."""
    with joined(daemon, timeout=5) as comms:
        regions = hostmem.alloc(4096)
        handles = [comms[0].register_buffer(regions.ptr + 256 * i, 256) for i in range(10)]
        restart_daemon(daemon, comms)
        register = comms[0]._registrations._register
        calls = [0]

        def times_out_once(ptr: int, nbytes: int, due: float,
                           buffer: int | None = None) -> tuple[int, int, int]:
            calls[0] += 1
            if calls[0] == 5:
                raise CommTimeout("the 5th re-registration took too long (made up)")
            return register(ptr, nbytes, due, buffer)

        monkeypatch.setattr(comms[0]._registrations, "_register", times_out_once)
        failed = on_both(lambda r: _error_of(comms[r].attempt_reconnect))
        assert failed == ["CommTimeout", None]
        unmade = [h for h, reg in comms[0]._registrations._by_handle.items() if reg.daemon_handle is None]
        assert unmade == handles[4:]
        on_both(lambda r: comms[r].attempt_reconnect())
        assert all(reg.daemon_handle is not None for reg in comms[0]._registrations._by_handle.values())
        assert summed(comms, [hostmem.alloc(8), hostmem.alloc(8)]) == [[3, 30], [3, 30]]
        for handle in handles:
            comms[0].deregister_buffer(handle)


def restarted_with(daemon: DaemonProcess, comms: list[DaemonBackend], args: list[str]) -> DaemonProcess:
    """kill -9 the ranks' daemon and start another at its socket with `args`; each rank's
    calling thread meets the failure. (The caller stops the new one.)"""
    restarted = DaemonProcess(daemon.socket_path, args=args)
    daemon.kill()
    restarted.start()
    for comm in comms:
        met_the_failure(comm)
    return restarted


def test_a_refused_re_registration_leaves_the_rebuilt_world_healthy_and_told_the_add_kernel(
        daemon: DaemonProcess) -> None:
    """Rank 0 held two registrations; the restarted daemon allows one. Both ranks rejoin:
    rank 0's attempt_reconnect raises the refusal, but the world was rebuilt and a limit is
    no failure of it: rank 0 is healthy, its add kernel told, and the next calls work
    (before: rank 0 stayed unhealthy, so rank 1's call timed out, and the daemon never
    heard rank 0's add kernel)."""
    world = world_name()
    with joined(daemon, 3, world) as comms:
        x, y = hostmem.alloc(64), hostmem.alloc(64)
        comms[0].register_buffer(x.ptr, 64)
        comms[0].register_buffer(y.ptr, 64)
        on_both(lambda r: comms[r].set_add_kernel(100 + r))
        restarted = restarted_with(daemon, comms, ["--max-registrations", "1"])
        try:
            assert on_both(lambda r: _error_of(comms[r].attempt_reconnect)) == ["LimitExceeded", None]
            assert [comm.is_healthy() for comm in comms] == [True, True]
            assert (world_status(restarted, world) or {})["add_kernel"] == {"0": 100, "1": 101}
            epoch = comms[0].epoch
            assert summed(comms, [hostmem.alloc(8), hostmem.alloc(8)]) == [[3, 30], [3, 30]]
            assert comms[0].epoch == comms[1].epoch == epoch
        finally:
            restarted.stop()


def test_a_refused_restoring_on_the_same_daemon_is_no_failure_a_thread_votes_on(
        daemon: DaemonProcess, monkeypatch: pytest.MonkeyPatch) -> None:
    """A rejoin's restoring times out half-way (B left unmade); the worker registers C, the
    daemon's limit of 2. The next rebuild, on the same daemon, is refused B: rank 0's
    attempt_reconnect raises it, yet the world was rebuilt. Another thread of rank 0 that
    met the earlier failure then returns at once from its attempt_reconnect (before: it
    voted again, and failed the world rank 1 had just rebuilt)."""
    with joined(daemon, 3) as comms:
        mem = hostmem.alloc(4096)
        comms[0].register_buffer(mem.ptr, 256)  # A
        comms[0].register_buffer(mem.ptr + 256, 256)  # B
        restarted = restarted_with(daemon, comms, ["--max-registrations", "2"])
        try:
            register = comms[0]._registrations._register
            calls = [0]

            def times_out_once(ptr: int, nbytes: int, due: float,
                           buffer: int | None = None) -> tuple[int, int, int]:
                calls[0] += 1
                if calls[0] == 2:
                    raise CommTimeout("the 2nd re-registration took too long (made up)")
                return register(ptr, nbytes, due, buffer)

            monkeypatch.setattr(comms[0]._registrations, "_register", times_out_once)
            assert on_both(lambda r: _error_of(comms[r].attempt_reconnect)) == ["CommTimeout", None]
            monkeypatch.undo()
            comms[0].register_buffer(mem.ptr + 512, 256)  # C: the daemon holds A and C
            assert on_both(lambda r: _error_of(comms[r].attempt_reconnect)) == ["LimitExceeded", None]
            epoch = comms[1].epoch
            outcome: list[object] = []

            def another_thread() -> None:
                comms[0]._health.met(epoch - 1)  # (as a call of it would have recorded)
                started = time.monotonic()
                outcome.extend([_error_of(comms[0].attempt_reconnect), time.monotonic() - started])

            thread = threading.Thread(target=another_thread)
            thread.start()
            thread.join(20)
            assert outcome[0] is None and outcome[1] < 1.0, outcome  # (a vote waits for rank 1)
            assert [comm.is_healthy() for comm in comms] == [True, True]
            assert comms[0].epoch == comms[1].epoch == epoch
        finally:
            restarted.stop()


def _error_of(call: Callable[[], object]) -> str | None:
    try:
        call()
    except CommError as exc:
        return type(exc).__name__
    return None


def test_symmetric_free_with_live_views_refuses_and_changes_nothing(daemon: DaemonProcess) -> None:
    """A worker still holds a numpy view of its symmetric memory: symmetric_free refuses
    (MisuseError) and the memory stays usable and freeable (before: the daemon had freed
    it already, and the pointer was unknown to the backend for good)."""
    with DaemonBackend(str(daemon.socket_path), world_name(), 0, 1, timeout=5) as comm:
        ptr = comm.symmetric_alloc(64)
        located = default_memory().locate(ptr)
        assert located is not None
        view = located.view(np.int32)
        del located
        with pytest.raises(MisuseError, match="live views"):
            comm.symmetric_free(ptr)
        view[:] = 7
        comm.all_reduce(ptr, 64, dtype="i32")  # the daemon still has it: a 1-rank sum
        assert view.tolist() == [7] * 16
        del view
        comm.symmetric_free(ptr)
        with pytest.raises(MisuseError, match="symmetric_alloc"):
            comm.symmetric_free(ptr)


@pytest.mark.parametrize("daemon", [["--max-registrations", "1"]], indirect=True)
def test_a_registration_whose_memory_went_is_not_made_again_on_what_took_its_address(
        daemon: DaemonProcess) -> None:
    """Rank 0 registers a buffer and frees it without deregistering (the daemon drops the
    registration with the memory); a new buffer takes the same address. After a daemon
    restart, the rejoin must not register the new buffer in the old one's place (before:
    it did, and that registration, which the worker never made, held the daemon's one
    allowed: the worker's next register_buffer was refused)."""
    with joined(daemon, timeout=5) as comms:
        gone = hostmem.alloc(4096)
        address = gone.ptr
        handle = comms[0].register_buffer(address, 64)
        gone.close()  # freed without deregistering
        # at once, the kernel gives the hole back: any mapping made first (another thread's,
        # the barrier's) may take it (1 run in 6 with the suite on two processes)
        reused = hostmem.alloc(4096)
        assert reused.ptr == address, "the kernel placed the new mapping elsewhere"
        on_both(lambda r: comms[r].barrier())  # (the Forget goes: the daemon drops the registration)
        other = hostmem.alloc(64)
        comms[0].deregister_buffer(comms[0].register_buffer(other.ptr, 64))  # the one slot is free
        restart_daemon(daemon, comms)
        on_both(lambda r: comms[r].attempt_reconnect())
        made = comms[0].register_buffer(other.ptr, 64)  # before: LimitExceeded
        assert comms[0]._registrations._by_handle[handle].daemon_handle is None
        assert summed(comms, [reused, hostmem.alloc(8)]) == [[3, 30], [3, 30]]
        comms[0].deregister_buffer(made)
        comms[0].deregister_buffer(handle)  # nothing held at the daemon: it just goes
        assert comms[0]._registrations.handles() == set()


def test_a_reply_the_daemon_sent_before_it_was_killed_is_read(daemon: DaemonProcess) -> None:
    """Both ranks' all_reduce is done and answered; rank 0 has not read its answer yet when
    the daemon is killed with a packet of rank 0 unread (a Forget that went after the
    call). Rank 0's receive meets ECONNRESET first, once, then the answer: rank 0 returns
    the sum, as rank 1 did, and the ranks agree the step was made. Before: rank 0 raised
    DaemonUnavailable "Connection reset by peer" for a step rank 1 had seen done."""
    with joined(daemon, timeout=5) as comms:
        bufs = [hostmem.alloc(8) for _ in range(2)]
        assert summed(comms, bufs) == [[3, 30], [3, 30]]  # (imported: the next call is one request)
        transport = comms[0]._conn.transport
        wait, killed = transport._wait, threading.Event()

        def wait_once_killed(request_id: int, deadline: float | None) -> Any:
            killed.wait(10)
            return wait(request_id, deadline)

        transport._wait = wait_once_killed  # type: ignore[method-assign]
        for r, buf in enumerate(bufs):
            buf.view(np.int32)[:2] = [r + 2, 20 * (r + 2)]
        with ThreadPoolExecutor(1) as rank0:
            step = rank0.submit(comms[0].all_reduce, bufs[0].ptr, 8, dtype="i32")
            comms[1].all_reduce(bufs[1].ptr, 8, dtype="i32")  # done: rank 0's answer goes too,
            # maybe a moment after rank 1's (the daemon writes one socket at a time)
            answered = select.poll()
            answered.register(transport._sock.fileno(), select.POLLIN)
            wait_until(lambda: answered.poll(0), "rank 0's answer in its socket")
            os.kill(daemon.pid, signal.SIGSTOP)
            transport.post(proto.Forget((1 << 40,)))  # (no buffer of ours: never read anyway)
            daemon.kill()
            killed.set()
            step.result(10)
        assert [buf.view(np.int32)[:2].tolist() for buf in bufs] == [[5, 100], [5, 100]]
        restart_daemon(daemon, comms)
        on_both(lambda r: comms[r].attempt_reconnect())
        assert summed(comms, bufs) == [[3, 30], [3, 30]]


def test_a_call_after_a_ranks_lone_vote_names_the_world_and_what_to_do(daemon: DaemonProcess) -> None:
    """Rank 0 calls attempt_reconnect on a healthy world (a retry loop that went once too
    often) while rank 1 is idle: the vote fails the world, and rank 1 hears of it by the
    daemon's event (is_healthy() turns false). Rank 1's next call must name the world and
    give the advice once, as after any other cause. Before, the cause itself named
    attempt_reconnect ('rank 0 called attempt_reconnect'), which the client took for the
    advice already given: the call raised the bare cause, no world named (a worker in
    several worlds could not tell which one failed). Both ranks then rebuild and sum."""
    with joined(daemon, timeout=10) as comms:
        world = comms[0]._world
        bufs = [hostmem.alloc(8) for _ in range(2)]
        with ThreadPoolExecutor(1) as rank0:
            voted = rank0.submit(comms[0].attempt_reconnect)
            wait_until(lambda: not comms[1].is_healthy(), "rank 1 hearing of rank 0's vote")
            with pytest.raises(WorldFailed) as next_call:
                comms[1].barrier()
            assert str(next_call.value) == (f"world {world} is not healthy: rank 0 called attempt_reconnect; "
                                            "call attempt_reconnect")
            comms[1].attempt_reconnect()
            voted.result(10)
        assert [comm.epoch for comm in comms] == [2, 2]
        assert summed(comms, bufs) == [[3, 30], [3, 30]]


@pytest.mark.parametrize("daemon", [("--max-registrations", "1")], indirect=True)
def test_deregister_with_the_daemon_gone_returns_and_the_rejoin_does_not_register_it_again(
        daemon: DaemonProcess) -> None:
    """The daemon is killed; each rank, cleaning up, deregisters its buffer before the new
    daemon is up, as symmetric_free may. Nothing is registered anywhere any more, so the
    call returns and the handle is gone. Before, it raised DaemonUnavailable and kept the
    handle, which the rejoin then registered again with the new daemon (observed: at its
    limit of 1 per connection, the next register_buffer was refused, LimitExceeded)."""
    with joined(daemon, timeout=5) as comms:
        bufs = [hostmem.alloc(64) for _ in range(2)]
        handles = on_both(lambda r: comms[r].register_buffer(bufs[r].ptr, 64))
        daemon.kill()
        for r, comm in enumerate(comms):
            met_the_failure(comm)
            comm.deregister_buffer(handles[r])
            with pytest.raises(MisuseError, match=f"^handle {handles[r]} is not registered$"):
                comm.deregister_buffer(handles[r])
        daemon.start()
        on_both(lambda r: comms[r].attempt_reconnect())
        fresh = on_both(lambda r: comms[r].register_buffer(bufs[r].ptr, 64))  # (the one room there is)
        assert [comm._registrations.handles() for comm in comms] == [{fresh[0]}, {fresh[1]}]
        assert summed(comms, bufs) == [[3, 30], [3, 30]]
        on_both(lambda r: comms[r].deregister_buffer(fresh[r]))


def test_a_symmetric_free_the_stalled_daemon_did_not_confirm_says_so_when_made_again(
        daemon: DaemonProcess) -> None:
    """symmetric_free of host memory lets go of the worker's mapping, then asks the daemon;
    stalled (SIGSTOP), it does not answer within the timeout: CommTimeout. Made again, the
    free said MisuseError 'not a pointer from this backend's symmetric_alloc', as if the
    worker had passed a wrong pointer. It now says the pointer was freed here and what
    becomes of the daemon's side; the daemon, running again, frees the memory (its fds and
    mappings back at rest) and the world goes on after a reconnect."""
    with DaemonBackend(str(daemon.socket_path), world_name(), 0, 1, timeout=1) as comm:
        buf = hostmem.alloc(64)
        comm.all_reduce(buf.ptr, 8, dtype="u8")  # (the mapping the rest counts)
        rest = held_at_rest(daemon.pid)
        ptr = comm.symmetric_alloc(64)
        os.kill(daemon.pid, signal.SIGSTOP)
        try:
            with pytest.raises(CommTimeout):
                comm.symmetric_free(ptr)
            with pytest.raises(MisuseError) as again:
                comm.symmetric_free(ptr)
        finally:
            os.kill(daemon.pid, signal.SIGCONT)
        assert "was freed here already" in str(again.value), again.value
        assert held_at_rest(daemon.pid) == rest
        buf.view(np.uint8)[:8] = 3
        assert not comm.is_healthy()  # (a call timed out: the backend asks for a reconnect)
        comm.attempt_reconnect()
        comm.all_reduce(buf.ptr, 8, dtype="u8")
        assert buf.view(np.uint8)[:8].tolist() == [3] * 8
        buf.close()


def test_a_plain_host_buffer_at_an_unconfirmed_symmetric_address_is_not_taken_for_a_freed_one(
        daemon: DaemonProcess) -> None:
    """A host symmetric_free the stalled daemon did not confirm leaves its pointer among the
    unconfirmed ones, so that a free made again says it was freed here already. But the
    address may be handed out again by a plain hostmem.alloc (the kernel reuses the range
    just unmapped), not only by symmetric_alloc: symmetric_free of that buffer's pointer, a
    wrong pointer, said '0x.. was freed here already; the daemon had not confirmed it',
    about memory the worker holds and uses. It must say that pointer is not from
    symmetric_alloc, and leave the buffer as it was (its data, its use in a call)."""
    with DaemonBackend(str(daemon.socket_path), world_name(), 0, 1, timeout=1) as comm:
        ptr = comm.symmetric_alloc(64)
        os.kill(daemon.pid, signal.SIGSTOP)
        try:
            with pytest.raises(CommTimeout):
                comm.symmetric_free(ptr)
        finally:
            os.kill(daemon.pid, signal.SIGCONT)
        held = [hostmem.alloc(64) for _ in range(4)]  # (the range just unmapped, taken again)
        at = [b for b in held if b.ptr == ptr]
        assert at, f"no host buffer took 0x{ptr:x} again: {[hex(b.ptr) for b in held]}"
        buf = at[0]
        buf.view(np.uint8)[:8] = 5
        with pytest.raises(MisuseError) as wrong:
            comm.symmetric_free(buf.ptr)
        assert f"0x{ptr:x} is not a pointer from this backend's symmetric_alloc" in str(wrong.value), \
            wrong.value
        assert buf.view(np.uint8)[:8].tolist() == [5] * 8
        comm.attempt_reconnect()  # (the free timed out: the backend asks for one)
        comm.all_reduce(buf.ptr, 8, dtype="u8")
        assert buf.view(np.uint8)[:8].tolist() == [5] * 8
        for b in held:
            b.close()
