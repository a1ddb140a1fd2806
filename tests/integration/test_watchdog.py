"""A call that stays open past the world's timeout fails the world, naming who is behind;
the flight recorder shows each rank's last calls."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from client import CommError, CommTimeout, DaemonBackend, hostmem
from commd.launch import DaemonProcess
from commd.status import query_status
from tests.integration import workers
from tests.integration.harness import RankPool, wait_until, world_name

pytestmark = pytest.mark.timeout(60)


def test_a_stalled_rank_times_the_call_out(pool: RankPool, daemon: DaemonProcess) -> None:
    sock, world = str(daemon.socket_path), world_name()
    started = pool.start(workers.stall, [(sock, world, r, 2, 1.0, 3.5) for r in range(2)])
    rank0, rank1 = [o.unwrap() for o in pool.collect(started, 30)]
    name, message, seconds = rank0
    assert name == "CommTimeout"
    assert "rank 0's call #1 all_reduce(bytes=64, dtype=bf16, op=sum) did not complete within 1s" in message
    assert "rank 1: #0 barrier() done" in message  # the rank that is behind, by its newest call
    assert 1.0 <= seconds <= 1.0 + 1.0 + 0.5  # the deadline, one watchdog interval, scheduling
    assert rank1[1] == "False"  # the stalled rank hears of the failure too


def test_a_rank_that_made_no_call_is_named_in_the_timeout(daemon: DaemonProcess) -> None:
    """Ranks 0 and 1 reach a barrier, rank 2 never calls: the CommTimeout must name rank 2
    (before, it named ranks 0 and 1 at the same call, and rank 2 nowhere)."""
    sock, world = str(daemon.socket_path), world_name()
    with ThreadPoolExecutor(3) as threads:
        comms = [j.result(20) for j in [threads.submit(DaemonBackend, sock, world, r, 3, timeout=1)
                                        for r in range(3)]]
        try:
            for call in [threads.submit(comm.barrier) for comm in comms[:2]]:
                with pytest.raises(CommTimeout, match=r"; rank 2: no call yet\)"):
                    call.result(20)
        finally:
            for comm in comms:
                comm.close()


def test_a_lone_send_to_itself_times_out_saying_it_waits_for_its_own_recv(daemon: DaemonProcess) -> None:
    """send_to(dest_rank=its own rank) pairs with that rank's own recv_from (the seed: "pairs
    with a recv_from of the same size on dest_rank"), which another thread may make, so the
    daemon cannot refuse it. Made alone, it waited out the world's timeout, and the
    CommTimeout named it as any late call ('send_to(bytes=16, peer=0) pending'), not what it
    waits for. So for a recv_from itself, alone."""
    sock, world = str(daemon.socket_path), world_name()
    with ThreadPoolExecutor(2) as threads:
        comms = [j.result(20) for j in [threads.submit(DaemonBackend, sock, world, r, 2, timeout=1)
                                        for r in range(2)]]
        try:
            out, into = hostmem.alloc(16), hostmem.alloc(16)
            out.view(np.uint8)[:] = np.arange(100, 116, dtype=np.uint8)
            receiving = threads.submit(comms[0].recv_from, into.ptr, 16, 0, 0)  # another thread's
            comms[0].send_to(out.ptr, 16, 0, 0)
            receiving.result(20)
            assert bytes(into.view(np.uint8)) == bytes(range(100, 116))
            alone = [(0, comms[0].send_to, out, "send_to(bytes=16, peer=0) pending, waiting for rank 0's "
                                                "own recv_from(bytes=16, peer=0)"),
                     (1, comms[1].recv_from, into, "recv_from(bytes=16, peer=1) pending, waiting for rank "
                                                   "1's own send_to(bytes=16, peer=1)")]
            for rank, call, buf, waits in alone:
                started = time.monotonic()
                with pytest.raises(CommTimeout, match="did not complete within 1s") as info:
                    call(buf.ptr, 16, rank, 0)
                assert 1.0 <= time.monotonic() - started <= 2.5
                assert waits in str(info.value), str(info.value)
                list(threads.map(lambda comm: comm.attempt_reconnect(), comms))
        finally:
            for comm in comms:
                comm.close()


def test_a_world_idle_for_a_while_still_times_its_next_call_out(daemon: DaemonProcess) -> None:
    """An idle world's watchdog sleeps until a call opens (it polls nothing meanwhile):
    the first call after a long idle must still time out, and the one after a failure too."""
    sock, world = str(daemon.socket_path), world_name()
    with ThreadPoolExecutor(2) as threads:
        comms = [j.result(20) for j in [threads.submit(DaemonBackend, sock, world, r, 2, timeout=0.3)
                                        for r in range(2)]]
        try:
            for attempt in range(2):
                time.sleep(1.0)  # several of the watchdog's 0.075 s intervals, nothing open
                with pytest.raises(CommTimeout, match=r"rank 0's call #\d+ barrier\(\) did not complete "
                                                      r"within 0.3s"):
                    comms[0].barrier()
                if attempt == 0:  # the world failed for it: both rejoin, and it idles again
                    list(threads.map(lambda comm: comm.attempt_reconnect(), comms))
                    bufs = [hostmem.alloc(4) for _ in comms]
                    for rank, buf in enumerate(bufs):
                        buf.view(np.int32)[0] = rank + 7
                    for call in [threads.submit(c.all_reduce, b.ptr, 4, dtype="i32")
                                 for c, b in zip(comms, bufs, strict=True)]:
                        call.result(20)
                    assert [int(b.view(np.int32)[0]) for b in bufs] == [15, 15]
        finally:
            for comm in comms:
                comm.close()


def test_recv_command_has_no_deadline_and_status_shows_recent_calls(pool: RankPool,
                                                                    daemon: DaemonProcess) -> None:
    sock, world = str(daemon.socket_path), world_name()
    # a command loop with a 1 s timeout where the root pauses 1.5 s between commands
    started = pool.start(workers.slow_commands, [(sock, world, r, 2, 1.0, 1.5) for r in range(2)])
    recent: dict[str, list[dict[str, object]]] = {}

    def rank_1_waits_for_a_command() -> bool:  # (for 1.5 s each time, twice)
        nonlocal recent
        try:
            recent = query_status(sock, 5, world)["worlds"][0]["recent_calls"]
        except CommError:  # (the world is not there yet)
            return False
        last = (recent.get("1") or [{}])[-1]
        return last.get("call") == "recv_command_u32(bytes=4, root=0)" and last.get("state") == "pending"

    wait_until(rank_1_waits_for_a_command, "rank 1 to wait in recv_command_u32", 20)
    assert recent["0"][0]["state"] == "done"
    results = [o.unwrap() for o in pool.collect(started, 30)]
    assert results == [[5, 6], [5, 6]]
