"""What one thread of a rank frees, groups or closes while another calls or reconnects,
against a real daemon: a buffer freed on one thread never lends its cached op to a new
buffer at the same address; an op built from the old daemon's imports is not kept; a group
opened in the rebuilt world is kept; close() during another thread's rejoin leaves no
connection holding the rank. Each ends with a call whose data is checked."""

from __future__ import annotations

import contextlib
import gc
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from client import CommError, DaemonBackend, MisuseError, hostmem
from commd.launch import DaemonProcess
from tests.fault.ranks import joined, on_both, own_daemon, restart_daemon, slowed, summed
from tests.integration.harness import held_at_rest, wait_until, world_name, world_status

pytestmark = pytest.mark.timeout(60)
_BIG = 64 << 20


@pytest.fixture
def daemon() -> Iterator[DaemonProcess]:
    yield from own_daemon()


def test_a_buffer_at_the_address_of_one_freed_on_another_thread_is_not_taken_for_it(
        daemon: DaemonProcess, monkeypatch: pytest.MonkeyPatch) -> None:
    """Rank 0's all_reduce op is cached by its pointer. Another thread frees that buffer; a
    new one gets the same address before the backend hears of the free (held back here;
    unheld, 54-1338 of 20000 tries met it). Its all_reduce sums its own data (before: the
    cached op named the old buffer: the daemon summed into that one, rank 0 got its own
    data back and rank 1 the old buffer's)."""
    with joined(daemon, timeout=3) as comms:
        # 64 MiB (sparse): the kernel hands a freed hole of that size out again first
        old = [hostmem.alloc(_BIG) for _ in range(2)]
        assert summed(comms, old) == [[3, 30], [3, 30]]
        memory = hostmem.default_memory()
        released = memory._released
        heard = threading.Event()

        def late_released(buffer_id: int, ptr: int) -> None:
            if threading.current_thread().name.startswith("freeing"):
                heard.set()
                time.sleep(1.0)
            released(buffer_id, ptr)

        monkeypatch.setattr(memory, "_released", late_released)
        with ThreadPoolExecutor(1, thread_name_prefix="freeing") as freeing:
            freed = freeing.submit(old[0].close)
            assert heard.wait(5)  # unmapped; the table and the backends not told yet
            new = [hostmem.alloc(_BIG), hostmem.alloc(_BIG)]
            assert new[0].ptr == old[0].ptr  # (mmap hands the address out again)
            assert summed(comms, new) == [[3, 30], [3, 30]]
            freed.result(10)


def test_a_view_of_a_buffer_keeps_it_for_the_calls_made_on_the_view(daemon: DaemonProcess) -> None:
    """`x = hostmem.alloc(n).view(np.int32)` keeps only the view: a collection freed the
    buffer under it (its memory stayed mapped for the view), and a call on x.ctypes.data
    was refused, "not in host memory the daemon can open (allocate it with
    client.hostmem.alloc)". A view, and a slice of one, keep their buffer; once they go,
    the buffer is freed and the daemon lets go of its mapping."""
    def summed_in(arrays: list[np.ndarray]) -> list[list[int]]:
        for r, array in enumerate(arrays):
            array[:] = r + 1
        on_both(lambda r: comms[r].all_reduce(arrays[r].ctypes.data, arrays[r].nbytes, dtype="i32"))
        return [array.tolist() for array in arrays]

    with joined(daemon, timeout=5) as comms:
        at_rest = held_at_rest(daemon.pid)
        views = [hostmem.alloc(64).view(np.int32) for _ in range(2)]
        gc.collect()
        assert summed_in(views) == [[3] * 16, [3] * 16]
        tails = [view[8:] for view in views]
        views.clear()
        gc.collect()
        assert summed_in(tails) == [[3] * 8, [3] * 8]
        tails.clear()
        gc.collect()
        on_both(lambda r: comms[r].barrier())  # (the Forgets go with it)
        wait_until(lambda: held_at_rest(daemon.pid) == at_rest, timeout=10)


def test_an_op_built_while_a_rejoin_drops_the_old_imports_is_not_kept(
        daemon: DaemonProcess, monkeypatch: pytest.MonkeyPatch) -> None:
    """After a daemon restart a training thread retries its all_reduce while the heartbeat
    rejoins (held at the old connection's close here; unheld, 11 of 20 runs met it). The
    op it built then named buffers the old daemon had imported; it must not be reused with
    the new daemon (before: every later all_reduce on that pointer was refused as 'never
    imported', and rank 1's timed out)."""
    with joined(daemon, timeout=3) as comms, ThreadPoolExecutor(1) as training:
        bufs = [hostmem.alloc(8) for _ in range(2)]
        assert summed(comms, bufs) == [[3, 30], [3, 30]]  # imported by the old daemon
        restart_daemon(daemon, comms)
        closing = slowed(monkeypatch, comms[0]._conn.transport, "close", "", 1.0)
        with ThreadPoolExecutor(1) as heartbeat:
            rebuilt = heartbeat.submit(on_both, lambda r: comms[r].attempt_reconnect())
            assert closing.wait(10)
            with pytest.raises(CommError):  # (refused: the world is not rebuilt yet)
                training.submit(comms[0].all_reduce, bufs[0].ptr, 8, dtype="i32").result(10)
            rebuilt.result(30)
        assert summed(comms, bufs) == [[3, 30], [3, 30]]


def test_a_group_opened_once_the_rebuilt_world_is_healthy_is_kept(
        daemon: DaemonProcess, monkeypatch: pytest.MonkeyPatch) -> None:
    """This thread holds a group open across a failure; both ranks reconnect on other
    threads. As soon as rank 0 reads the world healthy, this thread opens a new group (a
    send and a receive, paired with rank 1's). The reconnect ends the old world's groups
    before the world reads healthy (the ending held back here), so the new group is whole
    (before: it was dropped, its receive went out alone, group_end said 'without
    group_start', and rank 1's receive timed out). The old group is refused once, at its
    next call, rather than sent in pieces."""
    with joined(daemon, timeout=3) as comms:
        send = [hostmem.alloc(8) for _ in range(2)]
        recv = [hostmem.alloc(8) for _ in range(2)]
        comms[0].group_start()
        with pytest.raises(CommError):
            comms[1].barrier()  # rank 0 never calls it: the world fails
        dropping = slowed(monkeypatch, comms[0]._conn, "_on_new_epoch", "", 1.0)  # (drop_all)
        for r in range(2):
            send[r].view(np.int32)[:] = [r + 1, r + 1]

        def exchange(r: int) -> list[int]:
            comms[r].group_start()
            comms[r].send_to(send[r].ptr, 8, 1 - r)
            comms[r].recv_from(recv[r].ptr, 8, 1 - r)
            comms[r].group_end()
            return list(recv[r].view(np.int32).tolist())

        with ThreadPoolExecutor(3) as pool:
            rebuilt = [pool.submit(comms[r].attempt_reconnect) for r in range(2)]
            assert dropping.wait(10)
            wait_until(comms[0].is_healthy, "the rebuilt world", timeout=10)
            with pytest.raises(MisuseError, match="ended this thread's group"):
                comms[0].send_to(send[0].ptr, 8, 1)  # (the old group)

            def rank1_once_rebuilt() -> list[int]:
                rebuilt[1].result(10)
                return exchange(1)

            rank1 = pool.submit(rank1_once_rebuilt)
            assert exchange(0) == [2, 2]
            assert rank1.result(30) == [1, 1]
            rebuilt[0].result(10)


def test_close_during_another_threads_rejoin_leaves_the_rank_free(daemon: DaemonProcess) -> None:
    """Rank 0's attempt_reconnect waits in its hello to a restarted daemon (rank 1 not back
    yet) when the worker closes the backend and starts afresh. The reconnect ends with a
    CommError, and the fresh rank 0 and rank 1 form the world (before: the hello's
    connection lived on, holding rank 0: the fresh one was refused as already connected,
    and the closed backend's reconnect waited out its whole timeout)."""
    with joined(daemon, timeout=8) as comms:
        bufs = [hostmem.alloc(8) for _ in range(2)]
        restart_daemon(daemon, comms)
        with ThreadPoolExecutor(2) as pool:
            reconnecting = pool.submit(comms[0].attempt_reconnect)
            wait_until(lambda: world_status(daemon, comms[0]._world) is not None,
                       "rank 0's hello at the new daemon", timeout=5)
            comms[0].close()
            with pytest.raises(CommError):
                reconnecting.result(5)  # (well before its 8 s)
            fresh = pool.submit(DaemonBackend, str(daemon.socket_path), comms[0]._world, 0, 2, timeout=8)
            comms[1].attempt_reconnect()
            comms[0] = fresh.result(10)
        assert summed(comms, bufs) == [[3, 30], [3, 30]]


def test_a_thread_told_its_group_was_ended_by_a_reconnect_does_not_vote_again(
        daemon: DaemonProcess) -> None:
    """The training thread is inside a group when the daemon is killed and restarted; the
    heartbeat threads of both ranks reconnect. Its next call in the group is refused, and
    its handler's attempt_reconnect returns at once: that failure is repaired (before: it
    voted a second rebuild, failed the new world for both ranks and timed out)."""
    with joined(daemon, timeout=3) as comms:
        bufs = [hostmem.alloc(8) for _ in range(2)]
        comms[0].group_start()
        comms[0].send_to(bufs[0].ptr, 8, 1)
        daemon.kill()
        daemon.start()

        def heartbeat(r: int) -> None:
            wait_until(lambda: not comms[r].is_healthy(), "the failure", timeout=10)
            comms[r].attempt_reconnect()

        on_both(heartbeat)
        epoch = comms[0].epoch
        with pytest.raises(MisuseError, match="ended this thread's group"):
            comms[0].recv_from(bufs[0].ptr, 8, 1)
        comms[0].attempt_reconnect()
        assert comms[0].epoch == epoch
        assert summed(comms, bufs) == [[3, 30], [3, 30]]


def test_an_op_fetched_before_a_rejoin_is_not_sent_to_the_new_daemon(
        daemon: DaemonProcess, monkeypatch: pytest.MonkeyPatch) -> None:
    """The training thread has its cached all_reduce op (naming buffers the old daemon
    imported) when it is held (1.5 s here) while both ranks rejoin a restarted daemon.
    Its call then fails as one the restart cut short, and counts as that failure: its
    attempt_reconnect returns at once and the next call works (before: the op went to the
    new daemon, which refused it as 'never imported', and rank 1's call timed out)."""
    with joined(daemon, timeout=3) as comms:
        bufs = [hostmem.alloc(8) for _ in range(2)]
        assert summed(comms, bufs) == [[3, 30], [3, 30]]  # the op cached
        daemon.kill()
        daemon.start()
        fetched = slowed(monkeypatch, comms[0]._groups, "current", "training", 1.5)
        with ThreadPoolExecutor(1, thread_name_prefix="training") as training:
            call = training.submit(comms[0].all_reduce, bufs[0].ptr, 8, dtype="i32")
            assert fetched.wait(5)
            on_both(lambda r: comms[r].attempt_reconnect())
            epoch = comms[0].epoch
            with pytest.raises(CommError, match="went away"):
                call.result(10)
            training.submit(comms[0].attempt_reconnect).result(10)
        assert comms[0].epoch == epoch
        monkeypatch.undo()
        assert summed(comms, bufs) == [[3, 30], [3, 30]]


def test_symmetric_free_of_host_memory_racing_close_ends_cleanly(
        daemon: DaemonProcess, monkeypatch: pytest.MonkeyPatch) -> None:
    """symmetric_free on one thread while close() runs on another (the free's unmap held
    here): neither raises anything but a CommError, the buffer is unmapped once, and
    close() lets go of the other symmetric buffers (before: close() raised AttributeError
    from the buffer's second unmap and left the rest mapped)."""
    memory = hostmem.HostMemory()
    comm = DaemonBackend(str(daemon.socket_path), world_name(), 0, 1, timeout=5, memory=memory)
    freed_ptr, other_ptr = comm.symmetric_alloc(64), comm.symmetric_alloc(64)
    other = memory.locate(other_ptr)
    assert other is not None
    unmapping = slowed(monkeypatch, memory, "_releasing", "freeing", 0.3, after=True)
    with ThreadPoolExecutor(1, thread_name_prefix="freeing") as freeing:
        freed = freeing.submit(comm.symmetric_free, freed_ptr)
        assert unmapping.wait(5)
        comm.close()
        with contextlib.suppress(CommError):
            freed.result(10)
    assert other.closed
    assert memory.locate(freed_ptr) is None and memory.locate(other_ptr) is None


@pytest.mark.parametrize("close_held", [False, True], ids=["close-done", "close-under-way"])
def test_symmetric_alloc_racing_close_leaves_nothing_mapped(
        daemon: DaemonProcess, monkeypatch: pytest.MonkeyPatch, close_held: bool) -> None:
    """close() on another thread while symmetric_alloc maps the daemon's answer (held
    here): the allocation fails as on a closed backend and its mapping goes, whether
    close() has ended or is still letting go of its stream events (before: it was added
    after close() had let go of the others, and stayed mapped for good; or, while close()
    was under way, its pointer was returned and unmapped right after)."""
    memory = hostmem.HostMemory()
    comm = DaemonBackend(str(daemon.socket_path), world_name(), 0, 1, timeout=5, memory=memory)
    if close_held:
        slowed(monkeypatch, comm._order, "close", "", 0.6)
    adopt = memory.adopt
    adopted: list[hostmem.HostBuffer] = []
    mapping = threading.Event()

    def slow_adopt(fd: int, nbytes: int, buffer_id: int) -> hostmem.HostBuffer:
        adopted.append(adopt(fd, nbytes, buffer_id))
        mapping.set()
        time.sleep(0.3)  # close() runs here
        return adopted[-1]

    monkeypatch.setattr(memory, "adopt", slow_adopt)
    with ThreadPoolExecutor(1) as allocating:
        alloc = allocating.submit(comm.symmetric_alloc, 64)
        assert mapping.wait(5)
        comm.close()
        with pytest.raises(MisuseError, match="closed"):
            alloc.result(10)
    assert adopted[0].closed and memory.locate(adopted[0].ptr) is None


def test_a_group_opened_after_the_new_epoch_but_before_the_reconnect_ends_is_kept(
        daemon: DaemonProcess, monkeypatch: pytest.MonkeyPatch) -> None:
    """After a daemon restart rank 0's heartbeat rejoins: the world is rebuilt (a new
    epoch), then it registers rank 0's buffer again (held here: the round trips of a rank
    with registrations). The training thread opens a group in between; once the world
    reads healthy it sends and receives in it, paired with rank 1's group (before: the
    reconnect's end dropped that group; refused, the thread's handler voted a second
    rebuild, which timed out)."""
    with joined(daemon, timeout=3) as comms:
        send = [hostmem.alloc(8) for _ in range(2)]
        recv = [hostmem.alloc(8) for _ in range(2)]
        comms[0].register_buffer(send[0].ptr, 8)
        restart_daemon(daemon, comms)
        epoch = comms[0].epoch
        registering = slowed(monkeypatch, comms[0]._registrations, "register_again", "", 1.0)
        for r in range(2):
            send[r].view(np.int32)[:] = [r + 1, r + 1]
        with ThreadPoolExecutor(2) as heartbeats:
            rebuilt = [heartbeats.submit(comms[r].attempt_reconnect) for r in range(2)]
            assert registering.wait(10)
            assert comms[0].epoch > epoch
            comms[0].group_start()  # (this thread: rank 0's training loop)
            wait_until(comms[0].is_healthy, "the rebuilt world", timeout=10)
            for f in rebuilt:
                f.result(10)
        comms[0].send_to(send[0].ptr, 8, 1)
        comms[0].recv_from(recv[0].ptr, 8, 1)

        def rank1_group() -> None:
            comms[1].group_start()
            comms[1].send_to(send[1].ptr, 8, 0)
            comms[1].recv_from(recv[1].ptr, 8, 0)
            comms[1].group_end()

        with ThreadPoolExecutor(1) as rank1:
            other = rank1.submit(rank1_group)
            comms[0].group_end()
            other.result(10)
        assert [r.view(np.int32).tolist() for r in recv] == [[2, 2], [1, 1]]


def test_symmetric_free_racing_a_rejoin_frees_the_orphan(
        daemon: DaemonProcess, monkeypatch: pytest.MonkeyPatch) -> None:
    """After a daemon restart, a thread frees a symmetric buffer (host memory) while another
    thread rejoins: the free has claimed the entry and is unmapping it (held here) when the
    rejoin replaces the daemon. The buffer was the dead daemon's: the free succeeds, as for
    any buffer of a daemon that is gone (before: the SymFree went to the new daemon, which
    refused it, 'not a symmetric allocation')."""
    memory = hostmem.HostMemory()
    comm = DaemonBackend(str(daemon.socket_path), world_name(), 0, 1, timeout=3, memory=memory)
    try:
        ptr, other = comm.symmetric_alloc(64), comm.symmetric_alloc(64)
        restart_daemon(daemon, [comm])
        # (the rejoin runs meanwhile)
        unmapping = slowed(monkeypatch, memory, "_releasing", "freeing", 1.0, after=True)
        with ThreadPoolExecutor(1, thread_name_prefix="freeing") as freeing:
            freed = freeing.submit(comm.symmetric_free, ptr)
            assert unmapping.wait(5)
            comm.attempt_reconnect()
            try:
                freed.result(10)
                outcome = "ok"
            except CommError as exc:
                outcome = f"{type(exc).__name__}: {exc}"
        assert outcome == "ok"
        comm.symmetric_free(other)  # (an orphan made before: freed without the daemon)
    finally:
        comm.close()
