"""Clients that hoard: limits on connections, registrations, pending calls and unread
replies each give a clear LimitExceeded (or drop only the hoarder); others go on."""

from __future__ import annotations

import contextlib
import ctypes
import json
import mmap
import os
import resource
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest

import proto
from client import DaemonBackend, LimitExceeded, hostmem
from commd.engine.hostmemory import create_memfd
from commd.launch import DaemonProcess
from commd.server import STATUS_HEADROOM
from proto import ErrorCode
from tests.conftest import FaultReport, Steady, steady_world
from tests.integration import workers
from tests.integration.data import make_input, reduce_reference
from tests.integration.harness import (
    RankPool,
    back_to,
    held_at_rest,
    memfd_mappings,
    short_tmpdir,
    world_name,
)
from tests.integration.rawclient import RawClient

pytestmark = pytest.mark.timeout(60)


@pytest.fixture(scope="module")
def tight() -> Iterator[DaemonProcess]:
    tmp = short_tmpdir()
    daemon = DaemonProcess(Path(tmp) / "commd.sock", args=[
        "--max-connections", "8", "--max-registrations", "5", "--max-pending-ops", "20",
        "--max-queued-replies", "16", "--hello-timeout", "2", "--max-buffers", "6"],
        env={"COMMD_MAX_MAPPED_BYTES": str(4 << 20)}).start()
    yield daemon
    daemon.stop()
    shutil.rmtree(tmp, ignore_errors=True)


@pytest.fixture(scope="module")
def steady_t(tight: DaemonProcess) -> Iterator[Steady]:
    """An unrelated world on the limited daemon (2 of its 8 connections), throughout."""
    with steady_world([str(tight.socket_path)] * 2) as running:
        yield running


def once_room(call: Callable[[], object], timeout: float = 10) -> None:
    """`call`, again while the daemon refuses it as LimitExceeded, until `timeout`."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            call()
            return
        except LimitExceeded:
            assert time.monotonic() < deadline, "still refused as LimitExceeded"
            time.sleep(0.05)


def connect_once_there_is_room(sock: str) -> None:
    """A 1-rank world's barrier, retried while the connection limit is still reached."""
    def barrier() -> None:
        with DaemonBackend(sock, world_name(), 0, 1, timeout=5) as comm:
            comm.barrier()

    once_room(barrier)


def test_connections(tight: DaemonProcess, steady_t: Steady, fault_report: FaultReport) -> None:
    sock = str(tight.socket_path)
    unrelated = steady_t.errors()
    held = [RawClient(sock) for _ in range(6)]  # with the steady world's two: all 8
    try:
        with pytest.raises(LimitExceeded, match="8 connections"):
            DaemonBackend(sock, world_name(), 0, 1, timeout=5)
    finally:
        for client in held:
            client.close()
    connect_once_there_is_room(sock)  # the daemon reads the closes in its own time
    fault_report.add("a client opens connections past the limit: LimitExceeded", float("nan"),
                     float("nan"), steady_t.errors() - unrelated, "none (room again once closed)")


def test_a_daemon_at_its_connection_limit_still_answers_commd_status(tight: DaemonProcess,
                                                                     steady_t: Steady) -> None:
    """Past max_connections every connection was refused at once, `commd status` too: a daemon
    full of workers failed the liveness probe deploy/kubernetes runs (`commd status`), and the
    kubelet restarted it, failing every world it served. A few connections past the limit
    may ask for the status (each closed once answered); a hello there is refused as before."""
    sock = str(tight.socket_path)
    unrelated = steady_t.errors()
    held = [RawClient(sock) for _ in range(6)]  # with the steady world's two: all 8
    try:
        for client in held:
            assert isinstance(client.join(world_name()), proto.Welcome)
        done = subprocess.run([sys.executable, "-m", "commd", "status", "--json", "--socket", sock],
                              capture_output=True, text=True, timeout=30)
        assert done.returncode == 0, done.stderr
        report = json.loads(done.stdout)
        assert (report["pid"], report["connections"], report["ranks_connected"]) == (tight.pid, 9, 8)
        with pytest.raises(LimitExceeded, match="limit of 8 connections"):
            DaemonBackend(sock, world_name(), 0, 1, timeout=5)
        # the room past the limit is bounded: 4 more connections, and the next is refused at once
        past = [RawClient(sock) for _ in range(STATUS_HEADROOM + 1)]
        try:
            refused = past[-1].error()
            assert refused.code is ErrorCode.LIMIT and "limit of 8 connections" in refused.message
            # one asking for the status is answered, then closed: it holds no room for good
            past[0].send(proto.StatusQuery(1))
            answer = past[0].recv()
            assert isinstance(answer, proto.StatusReport) and answer.info["pid"] == tight.pid
            assert past[0].closed()
            past[1].send(proto.StatusQuery(1, "no-such-world"))
            assert past[1].error().code is ErrorCode.UNKNOWN_WORLD
            assert past[1].closed()
        finally:
            for client in past:
                client.close()
    finally:
        for client in held:
            client.close()
    connect_once_there_is_room(sock)
    assert steady_t.errors() == unrelated


def test_a_connection_that_says_nothing_is_closed_with_a_timeout(tight: DaemonProcess,
                                                                  steady_t: Steady) -> None:
    """An idle connection would hold one of the 8 for ever: after --hello-timeout it gets
    a timeout error and is closed, and the slot is free again."""
    sock = str(tight.socket_path)
    unrelated = steady_t.errors()
    idle = [RawClient(sock, timeout=10) for _ in range(6)]  # with the steady world's two: all 8
    try:
        started = time.monotonic()
        for client in idle:
            error = client.recv()
            assert isinstance(error, proto.Error) and error.code is ErrorCode.TIMEOUT, error
            assert "nothing said within 2s" in error.message
            assert client.recv() is None  # then closed
        assert 1.9 <= time.monotonic() - started <= 6
    finally:
        for client in idle:
            client.close()
    connect_once_there_is_room(sock)  # the slots are free again
    assert steady_t.errors() == unrelated


def test_a_connection_that_asked_for_the_status_and_idles_is_closed_with_a_timeout(
        tight: DaemonProcess, steady_t: Steady) -> None:
    """--hello-timeout watched only the silence before a connection's first packet: one that
    asked for the status (answered, or refused for an unknown world) and then idled held one
    of the 8 for good, and workers got LimitExceeded. A connection that is no rank is watched
    again from each answer; a rank that asked for the status is not."""
    sock = str(tight.socket_path)
    unrelated = steady_t.errors()
    rank = RawClient(sock)
    idle = [RawClient(sock, timeout=10) for _ in range(5)]  # with the steady world's two and rank: 8
    try:
        assert isinstance(rank.join(world_name()), proto.Welcome)
        started = time.monotonic()
        for i, client in enumerate([rank, *idle]):
            client.send(proto.StatusQuery(1, "no-such-world" if i % 2 else None))
            answer = client.recv()
            if i % 2:
                assert isinstance(answer, proto.Error) and answer.code is ErrorCode.UNKNOWN_WORLD, answer
            else:
                assert isinstance(answer, proto.StatusReport) and answer.info["pid"] == tight.pid, answer
        with pytest.raises(LimitExceeded, match="limit of 8 connections"):
            DaemonBackend(sock, world_name(), 0, 1, timeout=5)  # (the 8 are held meanwhile)
        time.sleep(max(0.0, started + 1.0 - time.monotonic()))
        # (timed before asking: the answer comes after, and the watch starts from it, however
        # late this thread reads it; a time taken after the read is later by that delay)
        asking_again = time.monotonic()
        idle[0].send(proto.StatusQuery(2))  # asking again: watched from this answer on
        assert isinstance(idle[0].recv(), proto.StatusReport)
        closed_at = []
        for client in idle:
            error = client.recv()
            assert isinstance(error, proto.Error) and error.code is ErrorCode.TIMEOUT, error
            assert "nothing said within 2s of the answer to its last status query" in error.message
            assert client.recv() is None  # then closed
            closed_at.append(time.monotonic())
        assert all(1.9 <= at - started <= 8 for at in closed_at), [at - started for at in closed_at]
        assert closed_at[0] - asking_again >= 1.9  # (from the first answer it would be about 1)
        rank.sock.settimeout(0.5)
        with pytest.raises(TimeoutError):
            rank.recv()  # the rank stays, idle as ranks are between calls
    finally:
        rank.close()
        for client in idle:
            client.close()
    connect_once_there_is_room(sock)  # the slots are free again
    assert steady_t.errors() == unrelated


def test_registrations_and_pending_calls(tight: DaemonProcess, steady_t: Steady,
                                        fault_report: FaultReport) -> None:
    sock = str(tight.socket_path)
    unrelated = steady_t.errors()
    with DaemonBackend(sock, world_name(), 0, 1, timeout=5) as comm:
        buf = hostmem.alloc(4096)
        handles = [comm.register_buffer(buf.ptr + 8 * i, 8) for i in range(5)]
        with pytest.raises(LimitExceeded, match="a connection may hold at most 5 registrations"):
            comm.register_buffer(buf.ptr, 8)
        comm.deregister_buffer(handles[0])
        comm.register_buffer(buf.ptr, 8)  # room again
    with _two(sock) as (a, b):
        a.group_start()
        for _ in range(21):
            a.barrier()
        with pytest.raises(LimitExceeded, match=r"^rank 0 has 0 calls waiting for their match and this "
                                                r"request would add 21; the limit is 20$"):
            a.group_end()
        b.send(proto.Submit(2, (proto.Barrier(),) * 20))
        a.group_start()
        for _ in range(20):
            a.barrier()
        a.group_end()  # (none of the refused group's is left waiting: the limit's room is whole)
        assert isinstance(b.recv(), proto.Welcome) and b.recv() == proto.Ok(2)
    fault_report.add("a client registers buffers and queues calls past the limits: LimitExceeded",
                     float("nan"), float("nan"), steady_t.errors() - unrelated,
                     "none (room again once deregistered)")


def test_forgotten_memory_a_waiting_call_still_holds_counts_until_it_goes(
        tight: DaemonProcess, steady_t: Steady, fault_report: FaultReport) -> None:
    """A call waiting for its match holds its buffer's memory; the client forgetting the
    buffer does not give the connection room to map more until the call has let go."""
    sock = str(tight.socket_path)
    unrelated = steady_t.errors()
    world = world_name()
    with RawClient(sock) as a, RawClient(sock) as b:
        for client, rank in ((a, 0), (b, 1)):
            client.send(proto.Hello(1, proto.PROTOCOL_VERSION, os.getpid(), world, rank, 2, 60_000))
        assert isinstance(a.recv(), proto.Welcome) and isinstance(b.recv(), proto.Welcome)
        for i in range(4):  # 4 MiB: the connection's limit
            assert isinstance(a.import_memfd(100 + i, 1 + i, 1 << 20), proto.Ok)
            a.send(proto.Submit(200 + i, (proto.AllReduce(proto.Mem(1 + i, 0), 1 << 20, proto.DType.U8),)))
            a.send(proto.Forget((1 + i,)))  # (rank 1 never calls: each call waits, holding its buffer)
        refused = a.import_memfd(300, 9, 1 << 20)
        assert isinstance(refused, proto.Error) and refused.code is ErrorCode.LIMIT, refused
        b.close()  # the world fails: the waiting calls let go of the memory
        deadline = time.monotonic() + 10
        while True:
            reply = a.import_memfd(400, 10, 1 << 20)
            if isinstance(reply, proto.Ok):
                break
            assert isinstance(reply, proto.Error | proto.Event), reply
            assert time.monotonic() < deadline, reply
            time.sleep(0.1)
    fault_report.add("a client forgets buffers its waiting calls hold: LimitExceeded until they go",
                     float("nan"), float("nan"), steady_t.errors() - unrelated, "none")


def test_forgotten_buffers_a_waiting_call_still_maps_count_against_max_buffers(
        tight: DaemonProcess, steady_t: Steady, fault_report: FaultReport) -> None:
    """max_buffers counted the ids a connection holds, not its mappings: import, a call
    that waits for its match, forget, again, and one connection held as many mappings as
    it liked past the limit (each call keeps its forgotten buffer mapped). A forgotten
    buffer counts until it is unmapped, as its bytes do."""
    sock = str(tight.socket_path)
    unrelated = steady_t.errors()
    world = world_name()
    before = held_at_rest(tight.pid)[1]  # (an earlier test's mappings may still be going)
    with RawClient(sock) as a, RawClient(sock) as b:
        for client, rank in ((a, 0), (b, 1)):
            client.send(proto.Hello(1, proto.PROTOCOL_VERSION, os.getpid(), world, rank, 2, 60_000))
        assert isinstance(a.recv(), proto.Welcome) and isinstance(b.recv(), proto.Welcome)
        memory = []
        for i in range(6):  # the limit
            fd = create_memfd(4096, "raw")
            memory.append(mmap.mmap(fd, 4096))
            memory[i][:] = bytes([i + 1]) * 4096
            a.send(proto.Import(100 + i, 1 + i, proto.MemKind.HOST, 4096), [fd])
            os.close(fd)
            assert a.recv() == proto.Ok(100 + i)
            a.send(proto.Submit(200 + i, (proto.AllReduce(proto.Mem(1 + i, 0), 4096, proto.DType.U8),)))
            a.send(proto.Forget((1 + i,)))  # (each call waits for rank 1, holding its buffer)
        refused = a.import_memfd(300, 50, 4096)
        assert isinstance(refused, proto.Error) and refused.code is ErrorCode.LIMIT, refused
        assert "at most 6 buffers" in refused.message and "6 forgotten" in refused.message, refused
        assert memfd_mappings(tight.pid) - before == 6
        # rank 1 matches the waiting calls: they run on the forgotten buffers' memory
        for i in range(6):
            assert isinstance(b.import_memfd(400 + i, 1 + i, 4096), proto.Ok)
        for i in range(6):
            b.send(proto.Submit(500 + i, (proto.AllReduce(proto.Mem(1 + i, 0), 4096, proto.DType.U8),)))
        for i in range(6):
            assert a.recv() == proto.Ok(200 + i) and b.recv() == proto.Ok(500 + i)
            assert memory[i][:] == bytes([i + 1]) * 4096  # (b's memfds hold zeros)
        deadline = time.monotonic() + 10
        while not isinstance(reply := a.import_memfd(600, 60, 4096), proto.Ok):  # room once unmapped
            assert isinstance(reply, proto.Error) and reply.code is ErrorCode.LIMIT, reply
            assert time.monotonic() < deadline, reply
            time.sleep(0.1)
    fault_report.add("a client forgets buffers its waiting calls map: LimitExceeded until unmapped",
                     float("nan"), float("nan"), steady_t.errors() - unrelated, "none")


@pytest.mark.parametrize("size", [64, 2 << 20])
def test_a_buffer_freed_at_max_buffers_makes_room_for_the_next(
        tight: DaemonProcess, steady_t: Steady, size: int) -> None:
    """At the limit (6), a worker frees a host buffer and calls on a new one: the Forget
    goes right before the new one's Import. The forgotten buffer, held by no call, counted
    until its unmap came back to the loop, after the Import: every other call was refused
    (10 of 20, "1 forgotten ones still in use by calls waiting for their match"). Small
    mappings no call holds are unmapped at once; larger ones (past the loop's
    AT_ONCE_BYTES) on a thread, and count against the connection's buffers and bytes (2 MiB
    each: the two together are past its 4 MiB) only while a call holds them."""
    with DaemonBackend(str(tight.socket_path), world_name(), 0, 1, timeout=10) as comm:
        kept = [hostmem.alloc(64) for _ in range(5)]
        for buf in kept:
            comm.all_reduce(buf.ptr, 8, dtype="i32")
        results = []
        for i in range(20):
            with hostmem.alloc(size) as buf:
                values = buf.view(np.int32)
                values[:] = i  # (every page: a large one's unmap takes longer)
                values[:2] = [i, -i]
                try:
                    comm.all_reduce(buf.ptr, size // 4 * 4, dtype="i32")
                    results.append([*values[:2].tolist(), int(values[2:].min()), int(values[2:].max())])
                except LimitExceeded as exc:
                    results.append([str(exc)])
                del values  # (the buffer is freed with no view of it left)
        assert results == [[i, -i, i, i] for i in range(20)]


class _two:
    """Rank 0 of a 2-rank world whose rank 1 joins raw and never calls."""

    def __init__(self, sock: str) -> None:
        self.sock = sock

    def __enter__(self) -> tuple[DaemonBackend, RawClient]:
        world = world_name()
        self.raw = RawClient(self.sock)
        self.raw.send(proto.Hello(1, proto.PROTOCOL_VERSION, os.getpid(), world, 1, 2, 5000))
        self.comm = DaemonBackend(self.sock, world, 0, 2, timeout=5)
        return self.comm, self.raw

    def __exit__(self, *exc: object) -> None:
        self.comm.close()
        self.raw.close()


def test_a_client_that_never_reads_is_dropped(tight: DaemonProcess, steady_t: Steady,
                                             fault_report: FaultReport) -> None:
    sock = str(tight.socket_path)
    unrelated = steady_t.errors()
    with RawClient(sock) as hoarder:
        assert isinstance(hoarder.join(world_name()), proto.Welcome)
        hoarder.sock.settimeout(5)
        sent, dropped = 0, False
        try:
            for i in range(20000):
                hoarder.send(proto.Submit(10 + i, (proto.Barrier(),)))
                sent += 1
        except (BrokenPipeError, ConnectionResetError):
            dropped = True  # its replies piled up past the limit: the daemon hung up
        assert dropped, f"sent {sent} requests without reading and was never dropped"
        replies = 0
        while True:
            try:
                msg = hoarder.recv()
            except (ConnectionResetError, OSError):
                break
            if msg is None:
                break
            replies += 1
        assert replies < sent  # cut off, not served forever
    with DaemonBackend(sock, world_name(), 0, 1, timeout=5) as comm:  # and the daemon goes on
        comm.barrier()
    fault_report.add("a client that never reads its replies: dropped", float("nan"), float("nan"),
                     steady_t.errors() - unrelated, "none (its connection closed)")


def test_a_daemon_out_of_fds_refuses_imports_as_a_limit_and_serves_on_once_some_go() -> None:
    """Each mapping holds an fd in the daemon (the mmap's copy): out of them, an import was
    refused as bad memory (MisuseError), as if the worker's buffer were at fault."""
    tmp = short_tmpdir()
    daemon = DaemonProcess(Path(tmp) / "commd.sock").start()
    try:
        with DaemonBackend(str(daemon.socket_path), world_name(), 0, 1, timeout=10) as comm:
            first = hostmem.alloc(4096)
            comm.all_reduce(first.ptr, 8, dtype="u8")  # (the daemon's fds at rest, with a mapping)
            room = 4
            limit = held_at_rest(daemon.pid)[0] + room
            resource.prlimit(daemon.pid, resource.RLIMIT_NOFILE, (limit, limit))
            bufs, refused = [], []
            for i in range(room + 3):
                buf = hostmem.alloc(4096)
                buf.view(np.uint8)[:8] = i + 1
                bufs.append(buf)
                try:
                    comm.all_reduce(buf.ptr, 8, dtype="u8")
                except LimitExceeded as exc:
                    refused.append(str(exc))
            # (some fit: an import holds the fd it came with and the mapping's copy for a moment)
            assert 1 <= len(refused) < len(bufs), refused
            assert all("Too many open files; each buffer the daemon maps holds one of its open files: "
                       "raise its LimitNOFILE" in r for r in refused), refused
            for buf in bufs:
                buf.close()
            fresh = hostmem.alloc(4096)
            fresh.view(np.uint8)[:8] = 7
            # (the daemon unmaps the closed ones in its own time)
            once_room(lambda: comm.all_reduce(fresh.ptr, 8, dtype="u8"))
            assert fresh.view(np.uint8)[:8].tolist() == [7] * 8 and comm.is_healthy()
    finally:
        daemon.kill()
        shutil.rmtree(tmp, ignore_errors=True)


@pytest.mark.parametrize("limit", [("--max-daemon-mappings", "3"), ("--max-daemon-bytes", str(3 * 4096))])
def test_a_daemon_at_its_memory_limit_refuses_any_connections_import_until_another_frees_one(
        limit: tuple[str, str]) -> None:
    """The daemon's own limits (max_daemon_mappings, max_daemon_bytes) count every
    connection's buffers together: full with two worlds' three 4 KiB buffers, the next import,
    on either connection, is LimitExceeded naming both limits, and the connection that was
    refused goes on; once another world frees a buffer, the refused one is taken."""
    tmp = short_tmpdir()
    daemon = DaemonProcess(Path(tmp) / "commd.sock", args=list(limit)).start()
    try:
        sock = str(daemon.socket_path)
        with DaemonBackend(sock, world_name(), 0, 1, timeout=10) as a, \
                DaemonBackend(sock, world_name(), 0, 1, timeout=10) as b:
            held = [hostmem.alloc(4096) for _ in range(3)]
            for comm, buf, value in ((a, held[0], 1), (a, held[1], 2), (b, held[2], 3)):
                buf.view(np.int32)[:2] = [value, -value]
                comm.all_reduce(buf.ptr, 8, dtype="i32")
            late = hostmem.alloc(4096)
            late.view(np.int32)[:2] = [7, -7]
            for comm in (b, a):
                with pytest.raises(LimitExceeded, match=r"the daemon maps 3 buffers / 12288 bytes; "
                                                        r"its limits are \d+ / \d+"):
                    comm.all_reduce(late.ptr, 8, dtype="i32")
            b.all_reduce(held[2].ptr, 8, dtype="i32")  # (b goes on, on what it holds)
            assert held[2].view(np.int32)[:2].tolist() == [3, -3] and b.is_healthy()
            held.pop(0).close()  # world a's: the daemon hears of it and unmaps it
            # (the unmap comes back to the daemon's loop in its own time)
            once_room(lambda: b.all_reduce(late.ptr, 8, dtype="i32"))
            assert late.view(np.int32)[:2].tolist() == [7, -7] and a.is_healthy() and b.is_healthy()
        assert daemon.stop() == 0
    finally:
        daemon.kill()
        shutil.rmtree(tmp, ignore_errors=True)


@contextlib.contextmanager
def _logged_daemon() -> Iterator[tuple[DaemonProcess, Path]]:
    """A daemon logging at INFO to a file in its own directory, which goes afterwards: read
    the file once the daemon stopped (`daemon.stop()`), for its log whole."""
    tmp = short_tmpdir()
    logged = Path(tmp) / "daemon.log"
    try:
        with open(logged, "wb") as log, DaemonProcess(Path(tmp) / "commd.sock", log=log,
                                                      log_level="INFO") as daemon:
            yield daemon, logged
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def room_for(pid: int, fds: int) -> int:
    """The open-file limit under which the daemon, at rest, can open `fds` more files: the
    limit bounds an fd's number, and a closed one leaves a lower number free."""
    held_at_rest(pid)
    numbers = {int(fd) for fd in os.listdir(f"/proc/{pid}/fd")}
    return sorted(set(range(len(numbers) + fds + 1)) - numbers)[fds]


def test_a_daemon_out_of_fds_for_accepts_says_so_once_serves_its_clients_and_takes_the_waiting_one_later(
        ) -> None:
    """Out of fds, the listener cannot accept: the waiting connection stays in the backlog
    (it is not refused) and is served once fds come back; the ranks already connected go
    on, and the log says it once, not each time the listener looks again (every 0.5 s)."""
    with _logged_daemon() as (daemon, logged):
        sock = str(daemon.socket_path)
        with DaemonBackend(sock, world_name(), 0, 1, timeout=5) as comm:
            buf = hostmem.alloc(4096)
            buf.view(np.uint8)[:8] = 3
            comm.all_reduce(buf.ptr, 8, dtype="u8")  # (its mapping made while fds were there)
            soft, hard = resource.prlimit(daemon.pid, resource.RLIMIT_NOFILE)
            resource.prlimit(daemon.pid, resource.RLIMIT_NOFILE, (room_for(daemon.pid, 0), hard))
            try:
                waiting = RawClient(sock)  # (connect completes in the backlog)
                started = time.monotonic()
                while time.monotonic() - started < 1.5:  # three looks again (one would tell a line per look)
                    comm.all_reduce(buf.ptr, 8, dtype="u8")
                    time.sleep(0.1)
                assert buf.view(np.uint8)[:8].tolist() == [3] * 8 and comm.is_healthy()
            finally:
                resource.prlimit(daemon.pid, resource.RLIMIT_NOFILE, (soft, hard))
            welcome = waiting.join(world_name())
            assert isinstance(welcome, proto.Welcome), welcome
            waiting.close()
            buf.close()
        daemon.stop()  # (its log whole)
        lines = [line for line in logged.read_text().splitlines() if "accepting connections" in line]
        assert len(lines) == 2, lines
        assert "WARNING commd.server: not accepting connections: out of file descriptors (Too many " \
               "open files) (looking again every 0.5s; the connecting ones wait)" in lines[0], lines
        assert "INFO commd.server: accepting connections again, after " in lines[1], lines


def test_a_reply_with_an_fd_that_cannot_wait_for_a_client_not_reading_drops_it_with_a_warning() -> None:
    """A symmetric allocation's reply carries its memory's fd; behind replies the client has
    not read, it waits on a copy of that fd. Out of fds for the copy, the daemon drops the
    connection (the reply cannot wait), as it drops a client past its unread-reply caps;
    before, only a DEBUG line said why, and the log at its usual level showed only the
    world's 'connection was lost'. Now a warning says it, the allocation is let go, and
    the other worlds go on."""
    with _logged_daemon() as (daemon, logged):
        sock = str(daemon.socket_path)
        with DaemonBackend(sock, world_name(), 0, 1, timeout=5) as comm, RawClient(sock) as hoarder:
            buf = hostmem.alloc(4096)
            buf.view(np.uint8)[:8] = 5
            comm.all_reduce(buf.ptr, 8, dtype="u8")
            at_rest = held_at_rest(daemon.pid)
            assert isinstance(hoarder.join(world_name()), proto.Welcome)
            for i in range(1000):  # (a few hundred fill its socket: the rest wait in the daemon)
                hoarder.send(proto.Submit(10 + i, (proto.Barrier(),)))
            soft, hard = resource.prlimit(daemon.pid, resource.RLIMIT_NOFILE)
            # (the allocation's memfd and its mapping fit; the queued reply's copy does not)
            resource.prlimit(daemon.pid, resource.RLIMIT_NOFILE, (room_for(daemon.pid, 2), hard))
            try:
                hoarder.send(proto.SymAlloc(5000, 1, 4096))
                ids = []
                while (msg := hoarder.recv()) is not None:
                    ids.append(msg.id)
                    assert msg == proto.Ok(msg.id), msg
                assert 0 < len(ids) < 1000 and ids == list(range(10, 10 + len(ids)))
                comm.all_reduce(buf.ptr, 8, dtype="u8")
                assert buf.view(np.uint8)[:8].tolist() == [5] * 8 and comm.is_healthy()
            finally:
                resource.prlimit(daemon.pid, resource.RLIMIT_NOFILE, (soft, hard))
            # (less the hoarder's connection: the allocation's memory and fds went with it)
            back_to(daemon.pid, (at_rest[0] - 1, at_rest[1]))
            buf.close()
        daemon.stop()  # (its log whole)
        dropped = [line for line in logged.read_text().splitlines() if "connection dropped" in line]
        assert len(dropped) == 1 and dropped[0].endswith(
            "WARNING commd.channel: connection dropped: cannot keep a reply's fd until the client "
            "reads it: Too many open files"), dropped


def test_a_worker_at_its_open_file_limit_has_symmetric_alloc_refused_as_a_limit_and_goes_on(
        pool: RankPool) -> None:
    """symmetric_alloc's reply carries the memory's fd; a worker at its open-file limit has
    no room for it, and the kernel drops it, saying only that it did (MSG_CTRUNC). Before:
    the reply was taken for a bad packet, ProtocolError "ok needs 1 fd(s), the packet
    carried 0", and the connection dropped (the world failed for every rank). Now it is the
    worker's limit (LimitExceeded), the daemon is told to let go of what it made, and the
    world goes on."""
    tmp = short_tmpdir()
    daemon = DaemonProcess(Path(tmp) / "commd.sock").start()
    try:
        sock = str(daemon.socket_path)
        with steady_world([sock] * 2) as steady:
            at_rest = held_at_rest(daemon.pid)
            world = world_name()
            outcomes = pool.run(workers.symmetric_at_the_open_file_limit,
                                [(sock, world, r, 2, 1024, 5, daemon.pid) for r in range(2)])
            limited = outcomes[1].unwrap()
            assert limited["error"].startswith("LimitExceeded: the daemon's reply to request "), limited
            assert "carried a file this process had no room for: its open files are at their limit" \
                in limited["error"], limited
            assert limited["healthy"] and limited["fds after"] == limited["fds before"], limited
            out = [o.unwrap() for o in outcomes]
            summed = reduce_reference([make_input(5, r, 1024, "f32", "sum") for r in range(2)], "f32", "sum")
            assert [o["result"] for o in out] == [summed.tobytes()] * 2
            back_to(daemon.pid, at_rest)
            assert steady.errors() == 0
    finally:
        daemon.stop()
        shutil.rmtree(tmp, ignore_errors=True)


def test_a_daemon_out_of_fds_refuses_symmetric_alloc_as_a_limit_and_holds_nothing_of_it() -> None:
    """Out of fds for the allocation's memfd, or for its mapping's copy of it (one left), the
    daemon refuses symmetric_alloc with LimitExceeded (its memfd closed again), and the
    rank's world goes on. Before, the first said only 'cannot allocate 4096 bytes: [Errno
    24] Too many open files', which a worker near its own open-file limit takes for its
    own; both now say whose limit it is, as a refused import does."""
    tmp = short_tmpdir()
    daemon = DaemonProcess(Path(tmp) / "commd.sock").start()
    try:
        with DaemonBackend(str(daemon.socket_path), world_name(), 0, 1, timeout=5) as comm:
            buf = hostmem.alloc(4096)
            buf.view(np.uint8)[:8] = 9
            comm.all_reduce(buf.ptr, 8, dtype="u8")
            at_rest = held_at_rest(daemon.pid)
            soft, hard = resource.prlimit(daemon.pid, resource.RLIMIT_NOFILE)
            refused = []
            for room in (0, 1):
                resource.prlimit(daemon.pid, resource.RLIMIT_NOFILE, (room_for(daemon.pid, room), hard))
                try:
                    with pytest.raises(LimitExceeded) as exc:
                        comm.symmetric_alloc(4096)
                    refused.append(str(exc.value))
                finally:
                    resource.prlimit(daemon.pid, resource.RLIMIT_NOFILE, (soft, hard))
                back_to(daemon.pid, at_rest)
            hint = "; each buffer the daemon maps holds one of its open files: raise its LimitNOFILE"
            assert refused == ["cannot allocate 4096 bytes: [Errno 24] Too many open files" + hint,
                               "cannot map host memory: [Errno 24] Too many open files" + hint]
            assert comm.is_healthy()
            ptr = comm.symmetric_alloc(4096)
            ctypes.memset(ptr, 4, 8)
            comm.all_reduce(ptr, 8, dtype="u8")
            comm.all_reduce(buf.ptr, 8, dtype="u8")
            assert ctypes.string_at(ptr, 8) == bytes([4] * 8) and buf.view(np.uint8)[:8].tolist() == [9] * 8
            comm.symmetric_free(ptr)
            buf.close()
    finally:
        daemon.stop()
        shutil.rmtree(tmp, ignore_errors=True)
