"""One worker process in several worlds (tensor-, pipeline- and data-parallel groups), each
a DaemonBackend of its own, on the same memory: calls of two worlds from two threads, one
world failing and rebuilt while the other runs, the daemon restarted under both, one
world's symmetric memory in the other's calls, and freeing memory both worlds hold. The
ranks are threads of this process (each rank's backends share its host buffers), against
a real daemon; a killed peer is a real process."""

from __future__ import annotations

import multiprocessing as mp
import os
import shutil
import signal
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest

import proto
from client import CommError, DaemonBackend, LimitExceeded, MisuseError, WorldFailed, hostmem
from commd.launch import DaemonProcess
from tests.conftest import held_elsewhere
from tests.fault.ranks import join, met_the_failure, on_both, own_daemon, slowed
from tests.fault.test_kill_daemon import restart, start
from tests.integration import workers
from tests.integration.harness import held_at_rest, memfd_mappings, short_tmpdir, wait_until, world_name
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


def refuse_each_others_handles(a: list[DaemonBackend], b: list[DaemonBackend],
                               ptrs: list[tuple[int, int]]) -> None:
    """Rank r registers 128 bytes at ptrs[r][0] with world A and at ptrs[r][1] with world B
    (on a daemon of --max-registrations 1): each backend refuses the other's handle, and
    B's buffer stays registered with the daemon (a second registration is refused until B's
    own handle lets go of it)."""
    handles = on_both(lambda r: (a[r].register_buffer(ptrs[r][0], 128),
                                 b[r].register_buffer(ptrs[r][1], 128)))
    for r in range(2):
        in_a, in_b = handles[r]
        with pytest.raises(MisuseError, match=f"^handle {in_a} is not registered$"):
            b[r].deregister_buffer(in_a)
        with pytest.raises(MisuseError, match=f"^handle {in_b} is not registered$"):
            a[r].deregister_buffer(in_b)
        with pytest.raises(LimitExceeded):  # B's registration is still the daemon's
            b[r].register_buffer(ptrs[r][1], 64)
        b[r].deregister_buffer(in_b)
        a[r].deregister_buffer(in_a)
        again = b[r].register_buffer(ptrs[r][1], 64)  # (room again: it was B's that held it)
        b[r].deregister_buffer(again)


@pytest.mark.parametrize("daemon", [("--max-registrations", "1")], indirect=True)
def test_a_handle_of_one_worlds_backend_is_refused_by_another_and_leaves_its_registration_be(
        daemon: DaemonProcess, two_worlds: tuple[list[DaemonBackend], list[DaemonBackend]]) -> None:
    """A worker registers a buffer in world A and another in world B, then passes A's
    handle to B's deregister_buffer (the handles are opaque; a pipeline stage keeps them in
    one table). Before, each backend numbered its handles from 1: B took A's handle for its
    own and deregistered B's buffer without a word, and B's own handle was then 'not
    registered'. Now a handle names one backend's registration: B refuses A's."""
    a, b = two_worlds
    bufs = [hostmem.alloc(256) for _ in range(2)]
    refuse_each_others_handles(a, b, [(buf.ptr, buf.ptr + 128) for buf in bufs])
    on_both(lambda r: checked_rounds(b[r], bufs[r].view(np.int32)[32:], bufs[r].ptr + 128, r, 5, 2))


@pytest.mark.parametrize("daemon", [("--max-registrations", "1")], indirect=True)
def test_backends_on_memory_tables_of_their_own_refuse_each_others_handles(daemon: DaemonProcess) -> None:
    """As above, each backend on a HostMemory of its own (`DaemonBackend(memory=...)`).
    Before, handles came from each table's own count, which numbered both backends' alike
    (observed: A's and B's first handle both 2): B took A's handle for its own again."""
    tables = [[hostmem.HostMemory() for _ in range(2)] for _ in range(2)]  # [world][rank]
    bufs = [[table.alloc(128) for table in world] for world in tables]
    worlds = [world_name(), world_name()]
    a, b = (on_both(lambda r, w=w: DaemonBackend(str(daemon.socket_path), worlds[w], r, 2, timeout=10,
                                                 memory=tables[w][r])) for w in range(2))
    try:
        refuse_each_others_handles(a, b, [(bufs[0][r].ptr, bufs[1][r].ptr) for r in range(2)])
        on_both(lambda r: checked_rounds(b[r], bufs[1][r].view(np.int32), bufs[1][r].ptr, r, 5, 2))
    finally:
        for comm in a + b:
            comm.close()


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


def test_an_interrupt_in_one_worlds_call_leaves_the_other_worlds_calls_on_the_memory_be(
        daemon: DaemonProcess, two_worlds: tuple[list[DaemonBackend], list[DaemonBackend]]) -> None:
    """Ctrl-C in rank 0's call of world A (the main thread, waiting for rank 1) while both
    ranks run world B's calls on the other half of A's symmetric memory on threads of their
    own: A's connection is dropped and A rebuilt, B sees no error and every sum is right."""
    a, b = two_worlds
    sym = on_both(lambda r: a[r].symmetric_alloc(8192))
    b_rounds, goal = [0, 0], [0]  # (goal 0: on until told how many)

    def world_b(r: int) -> None:
        view = host(sym[r]).view(np.int32)[1024:]
        while not goal[0] or b_rounds[r] < goal[0]:
            checked_rounds(b[r], view, sym[r] + 4096, r, 5 + b_rounds[r], 1)
            b_rounds[r] += 1

    with ThreadPoolExecutor(2) as pool:
        running = [pool.submit(world_b, r) for r in range(2)]
        timer = threading.Timer(0.5, signal.pthread_kill, (threading.main_thread().ident, signal.SIGINT))
        timer.start()
        with pytest.raises(KeyboardInterrupt):
            a[0].all_reduce(sym[0], 64, dtype="i32")  # rank 1 never makes it
        timer.join()
        with pytest.raises(WorldFailed):
            a[1].barrier()
        on_both(lambda r: a[r].attempt_reconnect())
        on_both(lambda r: checked_rounds(a[r], host(sym[r]).view(np.int32)[:16], sym[r], r, 3, 3))
        goal[0] = max(b_rounds) + 2  # (read as one: a rank may be a round ahead of the other)
        for future in running:
            future.result(30)
    assert b_rounds[0] == b_rounds[1] > 0
    assert all(comm.is_healthy() for comm in a + b)


def rebuild_both(*comms: DaemonBackend) -> None:
    """One worker's worlds, each rebuilt on a thread of its own (as its other ranks' daemon,
    or the network, allow: attempt_reconnect until it succeeds)."""
    with ThreadPoolExecutor(len(comms)) as pool:
        for future in [pool.submit(workers.reconnect_until, comm, time.monotonic() + 30) for comm in comms]:
            future.result(60)


def test_worlds_rooted_on_two_daemons_come_back_after_one_is_restarted() -> None:
    """Two workers, each on its node's daemon, each in world A (rooted on daemon 1) and world
    B (rooted on daemon 2, rank 0 there), each on one buffer and A's symmetric memory
    registered with B. Daemon 1 is killed -9 and restarted: worker 0's worlds lose their
    daemon, worker 1's their peer; all four rebuild, and the calls of both worlds (on two
    threads at once), A's symmetric memory in B and B's deregistration are right."""
    tmp = Path(short_tmpdir())
    first, second = start(tmp / "1" / "commd.sock", "n1"), start(tmp / "2" / "commd.sock", "n2")
    port = int(first.peer_address().rsplit(":", 1)[1])
    roots = first.peer_address(), second.peer_address()
    try:
        def worker(w: int) -> tuple[DaemonBackend, DaemonBackend]:
            sock = str((first if w == 0 else second).socket_path)
            with ThreadPoolExecutor(2) as pool:
                joining = [pool.submit(DaemonBackend, sock, world, rank, 2, timeout=5, bootstrap=root)
                           for world, rank, root in ((world_a, w, roots[0]), (world_b, 1 - w, roots[1]))]
                made = [f.result(30) for f in joining]
            return made[0], made[1]

        world_a, world_b = world_name("tp"), world_name("dp")
        comms = on_both(worker)
        a, b = [c[0] for c in comms], [c[1] for c in comms]
        bufs = [hostmem.alloc(8192) for _ in range(2)]
        sym = on_both(lambda w: a[w].symmetric_alloc(64))
        handles = on_both(lambda w: b[w].register_buffer(sym[w], 64))

        def calls() -> None:
            both_worlds_at_once(a, b, bufs, 3)  # (world B's rank is 1 - w: the same sums)
            on_both(lambda w: checked_rounds(b[w], host(sym[w]).view(np.int32), sym[w], 1 - w, 2, 2))

        calls()
        first.kill()
        first = restart(tmp / "1" / "commd.sock", "n1", port)
        for comm in a + b:
            met_the_failure(comm)
        on_both(lambda w: rebuild_both(a[w], b[w]))
        calls()
        on_both(lambda w: b[w].deregister_buffer(handles[w]))
        for comm in a + b:
            comm.close()
    finally:
        first.stop()
        second.stop()
        shutil.rmtree(tmp, ignore_errors=True)


def ctrl_c() -> None:
    """A real SIGINT to the main thread, from it: KeyboardInterrupt lands as pthread_kill returns."""
    signal.pthread_kill(threading.main_thread().ident, signal.SIGINT)  # type: ignore[arg-type]
    time.sleep(5)  # (not reached)


def test_a_free_interrupted_as_its_forget_goes_still_tells_the_daemon(
        daemon: DaemonProcess, two_worlds: tuple[list[DaemonBackend], list[DaemonBackend]],
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Ctrl-C lands in a buffer's close() as its Forget, taken from what the daemon is owed,
    is about to go on world A's connection: the interrupt reaches the worker, and the Forget
    goes with A's next request. Before, the Forget taken was lost: the daemon kept the freed
    memory mapped for as long as the connection lived, whatever A called after."""
    a, _ = two_worlds
    base = held_at_rest(daemon.pid)[1]
    bufs = [hostmem.alloc(64) for _ in range(2)]
    on_both(lambda r: checked_rounds(a[r], bufs[r].view(np.int32), bufs[r].ptr, r, 1, 2))
    transport = a[0]._conn.transport
    real = type(transport).try_post

    def try_post(self: object, msg: object) -> bool:
        if self is transport:
            monkeypatch.setattr(type(transport), "try_post", real)
            ctrl_c()
        return real(self, msg)  # type: ignore[arg-type]

    monkeypatch.setattr(type(transport), "try_post", try_post)
    with pytest.raises(KeyboardInterrupt):
        bufs[0].close()
    on_both(lambda r: a[r].barrier())
    wait_until(lambda: memfd_mappings(daemon.pid) - base == 1,
               lambda: f"{memfd_mappings(daemon.pid) - base} buffers mapped, 1 live", timeout=5)


class _InterruptedAsTaken:
    """A transport's send lock (the real one) on which Ctrl-C lands as a non-blocking
    acquire (try_post's) returns, as Python runs a signal's handler after a C call."""

    def __init__(self, lock: threading.RLock) -> None:
        self.lock, self.armed = lock, True

    def acquire(self, blocking: bool = True, timeout: float = -1) -> bool:
        got = self.lock.acquire(blocking, timeout)
        if self.armed and not blocking:
            self.armed = False
            ctrl_c()
        return got

    def release(self) -> None:
        self.lock.release()

    def _is_owned(self) -> bool:
        return self.lock._is_owned()  # type: ignore[attr-defined, no-any-return]

    def __enter__(self) -> bool:
        return self.lock.__enter__()

    def __exit__(self, *exc: object) -> None:
        self.lock.__exit__(*exc)


def test_a_free_interrupted_as_it_takes_the_send_lock_leaves_other_threads_calls_no_wait(
        daemon: DaemonProcess, two_worlds: tuple[list[DaemonBackend], list[DaemonBackend]]) -> None:
    """Ctrl-C lands in a buffer's close() just as its Forget took world A's send lock: the
    interrupt reaches the worker, and another thread's call on A then runs. Before, the main
    thread kept the lock for good: every other thread's send on A waited for it forever."""
    a, _ = two_worlds
    bufs = [hostmem.alloc(64) for _ in range(2)]
    on_both(lambda r: checked_rounds(a[r], bufs[r].view(np.int32), bufs[r].ptr, r, 1, 2))
    transport = a[0]._conn.transport
    lock = transport._send_lock
    transport._send_lock = _InterruptedAsTaken(lock)  # type: ignore[assignment]
    try:
        with pytest.raises(KeyboardInterrupt):
            bufs[0].close()
        done = threading.Event()
        other = threading.Thread(target=lambda: (a[0].barrier(), done.set()), daemon=True)
        other.start()
        a[1].barrier()
        assert done.wait(5), "rank 0's barrier on another thread waits for the send lock"
    finally:
        transport._send_lock = lock
        while lock._is_owned():  # type: ignore[attr-defined]
            lock.release()  # (let the stuck thread go)


def test_a_free_on_another_thread_never_takes_a_timed_out_imports_forget_from_its_retry(
        daemon: DaemonProcess, monkeypatch: pytest.MonkeyPatch) -> None:
    """Rank 0's import of X times out (the daemon stopped; it maps X once resumed), so the
    daemon is owed X's Forget, which must go before the call's retry imports X again. Another
    thread frees buffer Y meanwhile, and its Forget is slow to go; the world is rebuilt, and
    the retry's sums are right.
    Before, that free took X's Forget with Y's, the retry's Import went first, and the daemon
    refused it: 'buffer id N is already in use'."""
    comms = join(daemon, 1.5)
    try:
        ys, xs = _an_import_timed_out(daemon, comms)
        transport, real = comms[0]._conn.transport, type(comms[0]._conn.transport).try_post
        taken, go = threading.Event(), threading.Event()

        def slow_try_post(self: object, msg: object) -> bool:
            if self is transport and threading.current_thread() is not threading.main_thread():
                taken.set()
                go.wait(10)
            return real(self, msg)  # type: ignore[arg-type]

        monkeypatch.setattr(type(transport), "try_post", slow_try_post)
        freeing = threading.Thread(target=ys[0].close, daemon=True)
        freeing.start()
        assert taken.wait(5)
        _rebuilt_and_retried(comms, xs, go, freeing)
    finally:
        for comm in comms:
            comm.close()


def test_another_threads_request_never_sends_a_timed_out_imports_forget_after_its_retry(
        daemon: DaemonProcess, monkeypatch: pytest.MonkeyPatch) -> None:
    """Rank 0's import of X times out (the daemon stopped; it maps X once resumed), so the
    daemon is owed X's Forget, which must go before the call's retry imports X again. Another
    thread of rank 0 registers a buffer meanwhile: its request takes X's Forget and is slow
    to send it; the world is rebuilt, and the retry's sums are right.
    Before, the retry's Import went before that Forget, and the daemon refused it: 'buffer
    id N is already in use'."""
    comms = join(daemon, 1.5)
    try:
        ys, xs = _an_import_timed_out(daemon, comms)
        transport = comms[0]._conn.transport
        real = type(transport).post
        taken, go = threading.Event(), threading.Event()

        def slow_post(self: object, msg: proto.Message, *args: object) -> None:
            if self is transport and isinstance(msg, proto.Forget) and threading.current_thread() is other:
                taken.set()
                go.wait(0.5)  # (the thread preempted; not for good: after the fix others wait for it)
            real(self, msg, *args)  # type: ignore[arg-type]

        monkeypatch.setattr(type(transport), "post", slow_post)
        handles: list[int] = []
        other = threading.Thread(target=lambda: handles.append(comms[0].register_buffer(ys[0].ptr, 64)),
                                 daemon=True)
        other.start()
        assert taken.wait(5)
        _rebuilt_and_retried(comms, xs, go, other)
        assert len(handles) == 1  # (the other thread's call went through too)
    finally:
        for comm in comms:
            comm.close()


Buffers = list[hostmem.HostBuffer]


def _rebuilt_and_retried(comms: list[DaemonBackend], xs: Buffers, go: threading.Event,
                         held: threading.Thread) -> None:
    """Both ranks rebuild the world (the import's timeout failed it) and the call on X is made
    again, its sums checked, while `held` waits for `go`; then it goes on."""
    try:
        on_both(lambda r: comms[r].attempt_reconnect())
        on_both(lambda r: checked_rounds(comms[r], xs[r].view(np.int32), xs[r].ptr, r, 5, 2))
    finally:
        go.set()
        held.join(10)


def _an_import_timed_out(daemon: DaemonProcess, comms: list[DaemonBackend]) -> tuple[Buffers, Buffers]:
    """Buffers Y, summed, and X, whose import by rank 0 timed out (the daemon stopped; it
    maps X once resumed): the daemon is owed X's Forget, which must go before X's next
    Import."""
    ys = [hostmem.alloc(64) for _ in range(2)]
    on_both(lambda r: checked_rounds(comms[r], ys[r].view(np.int32), ys[r].ptr, r, 1, 1))
    xs = [hostmem.alloc(64) for _ in range(2)]
    os.kill(daemon.pid, signal.SIGSTOP)
    try:
        with pytest.raises(CommError):
            comms[0].all_reduce(xs[0].ptr, 64, dtype="i32")
    finally:
        os.kill(daemon.pid, signal.SIGCONT)
    return ys, xs


@pytest.mark.parametrize("window", ["imported", "importing"])
def test_a_buffer_moved_while_another_worlds_call_on_it_is_built_is_named_afresh(
        daemon: DaemonProcess, monkeypatch: pytest.MonkeyPatch, window: str) -> None:
    """A buffer moves (what a lost call on it in another world does: HostBuffer.detach)
    while world B's call on it has resolved it and not yet sent its Submit: its import
    done ('imported'), or on its way ('importing': the fd then names the new memory under
    the old id). B's call names the buffer by its new id, so its result is where the
    worker reads, and B's daemon connection lets go of the old one (before: the sum in
    memory the worker no longer sees, [1, 10]; or a second mapping of the buffer kept for
    the connection's life)."""
    b = join(daemon, 10)
    try:
        base = held_at_rest(daemon.pid)[1]
        bufs = [hostmem.alloc(8), hostmem.alloc(8)]
        for r, buf in enumerate(bufs):
            buf.view(np.int32)[:] = [r + 1, 10 * (r + 1)]
        target, method = ((b[0]._imports, "add") if window == "imported"
                          else (b[0]._resolver, "import_fds"))
        importing = slowed(monkeypatch, target, method, "B", 0.5)
        with ThreadPoolExecutor(1, thread_name_prefix="B") as rank0, ThreadPoolExecutor(1) as rank1:
            calls = [rank0.submit(b[0].all_reduce, bufs[0].ptr, 8, dtype="i32"),
                     rank1.submit(b[1].all_reduce, bufs[1].ptr, 8, dtype="i32")]
            assert importing.wait(5)
            hostmem.default_memory().moves.detach({bufs[0].id})
            for call in calls:
                call.result(10)
        assert [buf.view(np.int32).tolist() for buf in bufs] == [[3, 30], [3, 30]]
        on_both(lambda r: checked_rounds(b[r], bufs[r].view(np.int32), bufs[r].ptr, r, 1, 2))
        bufs[0].close()
        wait_until(lambda: memfd_mappings(daemon.pid) - base == 1,
                   lambda: f"{memfd_mappings(daemon.pid) - base} buffers mapped, 1 live", timeout=5)
    finally:
        for comm in b:
            comm.close()
