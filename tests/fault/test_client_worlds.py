"""One worker process in several worlds (tensor-, pipeline- and data-parallel groups), each
a DaemonBackend of its own, on the same memory: calls of two worlds from two threads, one
world failing and rebuilt while the other runs, the daemon restarted under both, one
world's symmetric memory in the other's calls, and freeing memory both worlds hold. The
ranks are threads of this process (each rank's backends share its host buffers), against
a real daemon; a killed peer is a real process."""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from client import CommError, DaemonBackend, MisuseError, WorldFailed, hostmem
from commd.launch import DaemonProcess
from tests.conftest import held_elsewhere
from tests.fault.ranks import join, met_the_failure, on_both, own_daemon
from tests.integration import workers
from tests.integration.harness import held_at_rest, memfd_mappings, wait_until, world_name
from tests.integration.workers import checked_rounds

pytestmark = pytest.mark.timeout(90)


@pytest.fixture
def daemon(request: pytest.FixtureRequest) -> Iterator[DaemonProcess]:
    yield from own_daemon(getattr(request, "param", ()))


@pytest.fixture
def two_worlds(daemon: DaemonProcess) -> Iterator[tuple[list[DaemonBackend], list[DaemonBackend]]]:
    """Both ranks of world A and of world B: rank r's two backends stand for one worker."""
    a = join(daemon, 10)
    b = join(daemon, 10)
    yield a, b
    for comm in a + b:
        comm.close()


def host(ptr: int) -> hostmem.HostBuffer:
    """The host buffer (symmetric memory mapped here, too) holding `ptr`."""
    buffer = hostmem.default_memory().locate(ptr)
    assert buffer is not None
    return buffer


def both_worlds_at_once(a: list[DaemonBackend], b: list[DaemonBackend], bufs: list[hostmem.HostBuffer],
                        rounds: int) -> None:
    """Each rank runs world A's calls on the first half of its buffer and world B's on the
    second, on two threads at once."""
    def rank(r: int) -> None:
        half = bufs[r].nbytes // 2
        views = bufs[r].view(np.int32)[: half // 4], bufs[r].view(np.int32)[half // 4:]
        with ThreadPoolExecutor(2) as pool:
            done = [pool.submit(checked_rounds, a[r], views[0], bufs[r].ptr, r, 1, rounds),
                    pool.submit(checked_rounds, b[r], views[1], bufs[r].ptr + half, r, 100, rounds)]
            for future in done:
                future.result(60)

    on_both(rank)


def test_a_buffer_both_worlds_used_is_let_go_by_both_once_freed(
        daemon: DaemonProcess, two_worlds: tuple[list[DaemonBackend], list[DaemonBackend]]) -> None:
    """Each rank's one buffer, half of it in world A's calls and half in world B's, on two
    threads at once: every sum right. Freed, the daemon lets go of both worlds' mappings of
    it, though neither world calls again (a pipeline world may be idle for long). Before,
    each world's Forget waited for that world's next request: the daemon kept the freed
    memory mapped, 4 mappings, for as long as the worlds stayed idle."""
    a, b = two_worlds
    base = held_at_rest(daemon.pid)[1]
    bufs = [hostmem.alloc(8192) for _ in range(2)]
    both_worlds_at_once(a, b, bufs, 50)
    assert memfd_mappings(daemon.pid) - base == 4  # each buffer, once per connection
    for buf in bufs:
        buf.close()
    wait_until(lambda: memfd_mappings(daemon.pid) == base,
               lambda: f"{memfd_mappings(daemon.pid) - base} freed buffers still mapped", timeout=5)
    fresh = [hostmem.alloc(8192) for _ in range(2)]
    both_worlds_at_once(a, b, fresh, 5)  # and both worlds go on


@pytest.mark.parametrize("daemon", [("--max-daemon-mappings", "4")], indirect=True)
def test_memory_freed_while_a_world_is_idle_makes_room_for_another_worlds_buffer(
        daemon: DaemonProcess, two_worlds: tuple[list[DaemonBackend], list[DaemonBackend]]) -> None:
    """The daemon's limit (4 mappings) is full with the two ranks' buffers in both worlds.
    The worker frees them and world B calls on new buffers while world A is idle. Before,
    the freed memory stayed mapped as long as A was idle, and B's import of a new buffer
    was refused, LimitExceeded 'the daemon maps N buffers', for memory the worker had freed."""
    a, b = two_worlds
    base = held_at_rest(daemon.pid)[1]
    bufs = [hostmem.alloc(4096) for _ in range(2)]
    both_worlds_at_once(a, b, bufs, 2)
    for buf in bufs:
        buf.close()
    # (the Forgets go as the buffers are freed; the daemon reads each connection on its own)
    wait_until(lambda: memfd_mappings(daemon.pid) == base,
               lambda: f"{memfd_mappings(daemon.pid) - base} freed buffers still mapped", timeout=5)
    fresh = [hostmem.alloc(4096) for _ in range(2)]
    on_both(lambda r: checked_rounds(b[r], fresh[r].view(np.int32), fresh[r].ptr, r, 7, 3))
    on_both(lambda r: checked_rounds(a[r], fresh[r].view(np.int32), fresh[r].ptr, r, 9, 3))


def test_a_forget_that_cannot_go_at_once_goes_with_the_next_request(
        daemon: DaemonProcess, two_worlds: tuple[list[DaemonBackend], list[DaemonBackend]]) -> None:
    """A buffer freed while another thread's send holds its world's connection: the free
    does not wait for that send, and the daemon hears of it with the world's next request."""
    a, _ = two_worlds
    base = held_at_rest(daemon.pid)[1]
    bufs = [hostmem.alloc(64) for _ in range(2)]
    on_both(lambda r: checked_rounds(a[r], bufs[r].view(np.int32), bufs[r].ptr, r, 1, 2))
    with held_elsewhere(a[0]._conn.transport._send_lock):
        bufs[0].close()
    held_at_rest(daemon.pid)
    assert memfd_mappings(daemon.pid) - base == 2  # (rank 0's Forget is still owed)
    on_both(lambda r: a[r].barrier())
    wait_until(lambda: memfd_mappings(daemon.pid) - base == 1,
               lambda: f"{memfd_mappings(daemon.pid) - base} buffers mapped, 1 live", timeout=5)


def test_one_world_rebuilt_after_a_killed_peer_leaves_the_other_world_on_the_same_memory_be(
        daemon: DaemonProcess) -> None:
    """This process is rank 0 of worlds A and B, on one symmetric_alloc buffer of A (B's calls
    on its second half). A's rank 1, a process, is killed -9 in the middle; a new process
    takes its slot and A is rebuilt, while B's calls (rank 1 another process) run on: B sees
    no error and every sum is right, before, during and after."""
    sock, ctx = str(daemon.socket_path), mp.get_context("spawn")
    world_a, world_b = world_name("tp"), world_name("dp")
    victim = ctx.Process(target=workers.join_and_wait, args=(sock, world_a, 1, 2), daemon=True)
    victim.start()
    rounds = 300
    peer_b = ctx.Process(target=workers.rounds_in_world, args=(sock, world_b, 1, 2, 256, 100, rounds),
                         daemon=True)
    peer_b.start()
    with ThreadPoolExecutor(2) as pool:
        joining = [pool.submit(DaemonBackend, sock, w, 0, 2, timeout=20) for w in (world_a, world_b)]
        a, b = (f.result(30) for f in joining)
    try:
        ptr = a.symmetric_alloc(2048)
        views = host(ptr).view(np.int32)[:256], host(ptr).view(np.int32)[256:]
        b_errors: list[BaseException] = []

        def world_b_calls() -> None:
            try:
                checked_rounds(b, views[1], ptr + 1024, 0, 100, rounds)
                b.barrier()
            except BaseException as exc:
                b_errors.append(exc)

        b_thread = threading.Thread(target=world_b_calls)
        b_thread.start()
        threading.Timer(0.3, os.kill, (victim.pid, signal.SIGKILL)).start()
        with pytest.raises(WorldFailed):
            a.barrier()  # rank 1 never comes: it is killed
        victim.join(10)
        replacement = ctx.Process(target=workers.rounds_in_world, args=(sock, world_a, 1, 2, 256, 1, 5),
                                  daemon=True)
        replacement.start()
        a.attempt_reconnect()
        assert a.epoch == 2
        checked_rounds(a, views[0], ptr, 0, 1, 5)
        a.barrier()
        replacement.join(30)
        assert replacement.exitcode == 0
        b_thread.join(60)
        assert not b_thread.is_alive() and b_errors == []
        peer_b.join(30)
        assert peer_b.exitcode == 0
    finally:
        a.close()
        b.close()
        for process in (victim, peer_b):
            if process.is_alive():
                process.kill()


def test_a_daemon_restart_under_two_worlds_keeps_each_ones_registrations_and_symmetric_memory(
        daemon: DaemonProcess, two_worlds: tuple[list[DaemonBackend], list[DaemonBackend]]) -> None:
    """Each world registers the rank's shared buffer and allocates symmetric memory, which
    the other world's calls use too. The daemon is killed -9 and restarted under both; both
    rejoin: the same handles deregister, each symmetric pointer works in both worlds, and
    once all is freed the new daemon holds no mapping."""
    a, b = two_worlds
    bufs = [hostmem.alloc(256) for _ in range(2)]
    handles = on_both(lambda r: (a[r].register_buffer(bufs[r].ptr, 256),
                                 b[r].register_buffer(bufs[r].ptr, 256)))
    sym = on_both(lambda r: (a[r].symmetric_alloc(64), b[r].symmetric_alloc(64)))

    def crossed(r: int) -> None:
        for comm, other in ((a[r], sym[r][1]), (b[r], sym[r][0]), (a[r], sym[r][0]), (b[r], sym[r][1])):
            checked_rounds(comm, host(other).view(np.int32), other, r, 3, 2)
        both_halves = bufs[r].view(np.int32)
        checked_rounds(a[r], both_halves[:32], bufs[r].ptr, r, 1, 2)
        checked_rounds(b[r], both_halves[32:], bufs[r].ptr + 128, r, 1, 2)

    on_both(crossed)
    daemon.kill()
    daemon.start()
    base = held_at_rest(daemon.pid)[1]
    for comm in a + b:
        met_the_failure(comm)
    for world in (a, b):
        on_both(lambda r, world=world: world[r].attempt_reconnect())  # type: ignore[misc]
    on_both(crossed)
    on_both(lambda r: (a[r].deregister_buffer(handles[r][0]), b[r].deregister_buffer(handles[r][1])))
    on_both(lambda r: (a[r].symmetric_free(sym[r][0]), b[r].symmetric_free(sym[r][1])))
    for buf in bufs:
        buf.close()
    wait_until(lambda: memfd_mappings(daemon.pid) == base,
               lambda: f"{memfd_mappings(daemon.pid) - base} freed buffers still mapped", timeout=5)
    on_both(lambda r: (a[r].barrier(), b[r].barrier()))


def test_symmetric_memory_of_a_closed_world_in_another_world(
        daemon: DaemonProcess, two_worlds: tuple[list[DaemonBackend], list[DaemonBackend]]) -> None:
    """World A's symmetric memory in world B's calls, then A closed: close() frees it, and
    B's next call on the pointer is a MisuseError saying it is no memory it can open; with a
    view of it held, the memory stays and B's calls on it go on, right, until the view goes.
    B is healthy throughout, and the daemon lets go of all of it."""
    a, b = two_worlds
    base = held_at_rest(daemon.pid)[1]
    sym = on_both(lambda r: a[r].symmetric_alloc(64))
    on_both(lambda r: checked_rounds(b[r], host(sym[r]).view(np.int32), sym[r], r, 1, 2))
    kept = [host(sym[0]).view(np.int32)]  # rank 0 keeps a view; rank 1 none
    on_both(lambda r: a[r].close())
    assert hostmem.default_memory().locate(sym[1]) is None
    with pytest.raises(MisuseError, match="not in host memory"):
        b[1].all_reduce(sym[1], 64, dtype="i32")
    assert b[1].is_healthy()
    other = hostmem.alloc(64)  # (rank 1 calls on memory it still has)
    spans = [(kept[0], sym[0]), (other.view(np.int32), other.ptr)]
    on_both(lambda r: checked_rounds(b[r], spans[r][0], spans[r][1], r, 4, 2))
    kept.clear()
    spans.clear()
    wait_until(lambda: hostmem.default_memory().locate(sym[0]) is None, "the view's buffer to go", timeout=5)
    other.close()
    wait_until(lambda: memfd_mappings(daemon.pid) == base,
               lambda: f"{memfd_mappings(daemon.pid) - base} freed buffers still mapped", timeout=5)
    assert all(comm.is_healthy() for comm in b)
    with pytest.raises(CommError):
        a[0].barrier()  # (closed)


def test_symmetric_memory_freed_while_the_daemon_is_down_is_freed(
        daemon: DaemonProcess, two_worlds: tuple[list[DaemonBackend], list[DaemonBackend]]) -> None:
    """The daemon is killed under both worlds, and before attempt_reconnect each rank frees
    its symmetric memory of each world (one of them used in the other world's calls), as a
    worker cleaning up after an error would. The daemon that made it let go of it with the
    connection, and the worker's mapping goes: the free is done, and says so. Before, it
    raised DaemonUnavailable all the same, and once reconnected, the free tried again was a
    MisuseError, 'not a pointer from this backend's symmetric_alloc'."""
    a, b = two_worlds
    sym = on_both(lambda r: (a[r].symmetric_alloc(64), b[r].symmetric_alloc(64)))
    on_both(lambda r: checked_rounds(b[r], host(sym[r][0]).view(np.int32), sym[r][0], r, 1, 2))
    daemon.kill()
    daemon.start()
    base = held_at_rest(daemon.pid)[1]
    on_both(lambda r: (a[r].symmetric_free(sym[r][0]), b[r].symmetric_free(sym[r][1])))
    assert [hostmem.default_memory().locate(p) for pair in sym for p in pair] == [None] * 4
    for world in (a, b):
        on_both(lambda r, world=world: world[r].attempt_reconnect())  # type: ignore[misc]
    with pytest.raises(MisuseError, match="not a pointer from this backend's symmetric_alloc"):
        a[0].symmetric_free(sym[0][0])  # (freed: once)
    fresh = [hostmem.alloc(64) for _ in range(2)]
    on_both(lambda r: (checked_rounds(a[r], fresh[r].view(np.int32), fresh[r].ptr, r, 2, 2),
                       checked_rounds(b[r], fresh[r].view(np.int32), fresh[r].ptr, r, 3, 2)))
    assert memfd_mappings(daemon.pid) - base == 4  # the fresh buffers alone, in both worlds
