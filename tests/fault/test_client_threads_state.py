"""What one thread of a rank frees, groups or closes while another calls or reconnects,
against a real daemon: a buffer freed on one thread never lends its cached op to a new
buffer at the same address; an op built from the old daemon's imports is not kept; a group
opened in the rebuilt world is kept; close() during another thread's rejoin leaves no
connection holding the rank. Each ends with a call whose data is checked."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from client import CommError, DaemonBackend, MisuseError, hostmem
from commd.launch import DaemonProcess
from tests.fault.ranks import join, met_the_failure, on_both, own_daemon, summed
from tests.integration.harness import wait_until, world_status

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
    comms = join(daemon, timeout=3)
    try:
        # 64 MiB (sparse): the kernel hands a freed hole of that size out again first
        old = [hostmem.alloc(_BIG) for _ in range(2)]
        assert summed(comms, old) == [[3, 30], [3, 30]]
        clear = comms[0]._ops.clear
        heard = threading.Event()

        def late_clear() -> None:
            if threading.current_thread().name.startswith("freeing"):
                heard.set()
                time.sleep(1.0)
            clear()

        monkeypatch.setattr(comms[0]._ops, "clear", late_clear)
        with ThreadPoolExecutor(1, thread_name_prefix="freeing") as freeing:
            freed = freeing.submit(old[0].close)
            assert heard.wait(5)  # unmapped; the backend not told yet
            new = [hostmem.alloc(_BIG), hostmem.alloc(_BIG)]
            assert new[0].ptr == old[0].ptr  # (mmap hands the address out again)
            assert summed(comms, new) == [[3, 30], [3, 30]]
            freed.result(10)
    finally:
        for comm in comms:
            comm.close()


def test_an_op_built_while_a_rejoin_drops_the_old_imports_is_not_kept(
        daemon: DaemonProcess, monkeypatch: pytest.MonkeyPatch) -> None:
    """After a daemon restart a training thread retries its all_reduce while the heartbeat
    rejoins (held at the old connection's close here; unheld, 11 of 20 runs met it). The
    op it built then named buffers the old daemon had imported; it must not be reused with
    the new daemon (before: every later all_reduce on that pointer was refused as 'never
    imported', and rank 1's timed out)."""
    comms = join(daemon, timeout=3)
    bufs = [hostmem.alloc(8) for _ in range(2)]
    training = ThreadPoolExecutor(1)
    try:
        assert summed(comms, bufs) == [[3, 30], [3, 30]]  # imported by the old daemon
        daemon.kill()
        daemon.start()
        for comm in comms:
            met_the_failure(comm)
        old = comms[0]._transport
        close = old.close
        closing = threading.Event()

        def slow_close() -> None:
            closing.set()
            time.sleep(1.0)
            close()

        monkeypatch.setattr(old, "close", slow_close)
        with ThreadPoolExecutor(1) as heartbeat:
            rebuilt = heartbeat.submit(on_both, lambda r: comms[r].attempt_reconnect())
            assert closing.wait(10)
            with pytest.raises(CommError):  # (refused: the world is not rebuilt yet)
                training.submit(comms[0].all_reduce, bufs[0].ptr, 8, dtype="i32").result(10)
            rebuilt.result(30)
        assert summed(comms, bufs) == [[3, 30], [3, 30]]
    finally:
        training.shutdown(wait=True)
        for comm in comms:
            comm.close()


def test_a_group_opened_once_the_rebuilt_world_is_healthy_is_kept(
        daemon: DaemonProcess, monkeypatch: pytest.MonkeyPatch) -> None:
    """This thread holds a group open across a failure; both ranks reconnect on other
    threads. As soon as rank 0 reads the world healthy, this thread opens a new group (a
    send and a receive, paired with rank 1's). The reconnect ends the old world's groups
    before the world reads healthy (the ending held back here), so the new group is whole
    (before: it was dropped, its receive went out alone, group_end said 'without
    group_start', and rank 1's receive timed out). The old group is refused once, at its
    next call, rather than sent in pieces."""
    comms = join(daemon, timeout=3)
    send = [hostmem.alloc(8) for _ in range(2)]
    recv = [hostmem.alloc(8) for _ in range(2)]
    try:
        comms[0].group_start()
        with pytest.raises(CommError):
            comms[1].barrier()  # rank 0 never calls it: the world fails
        groups = comms[0]._groups
        drop_all = groups.drop_all
        dropping = threading.Event()

        def slow_drop_all() -> None:
            dropping.set()
            time.sleep(1.0)
            drop_all()

        monkeypatch.setattr(groups, "drop_all", slow_drop_all)
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
    finally:
        for comm in comms:
            comm.close()


def test_close_during_another_threads_rejoin_leaves_the_rank_free(daemon: DaemonProcess) -> None:
    """Rank 0's attempt_reconnect waits in its hello to a restarted daemon (rank 1 not back
    yet) when the worker closes the backend and starts afresh. The reconnect ends with a
    CommError, and the fresh rank 0 and rank 1 form the world (before: the hello's
    connection lived on, holding rank 0: the fresh one was refused as already connected,
    and the closed backend's reconnect waited out its whole timeout)."""
    comms = join(daemon, timeout=8)
    bufs = [hostmem.alloc(8) for _ in range(2)]
    try:
        daemon.kill()
        daemon.start()
        for comm in comms:
            met_the_failure(comm)
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
    finally:
        for comm in comms:
            comm.close()
