"""Peer links are authenticated and watched, epochs are enforced, failures cross daemons."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import msgpack
import numpy as np
import pytest

import proto
from client import (
    CommError,
    CommTimeout,
    DaemonBackend,
    DaemonShutdown,
    LimitExceeded,
    MisuseError,
    PeerLost,
    WorldFailed,
    hostmem,
)
from commd.cluster import Cluster, parse_address
from commd.launch import DaemonProcess
from commd.peering import PeerNode
from commd.peerlink import PeerLink, PeerSettings
from commd.status import query_status
from proto import ErrorCode
from proto import peer as p
from proto import peerframe as pf
from proto.codec import encode_peer
from proto.fields import U64_MAX
from tests.conftest import FaultReport, Steady, steady_world
from tests.integration import workers
from tests.integration.data import make_input, reduce_reference
from tests.integration.harness import (
    RankPool,
    eventually,
    last_call,
    memfd_mappings,
    raise_nofile,
    short_tmpdir,
    started_together,
    wait_until,
    world_name,
    world_status,
)
from tests.integration.rawclient import RawClient, dialed, each_refused, said_hello
from tests.integration.test_multi_daemon import SECRET

pytestmark = pytest.mark.timeout(90)
FAST = ["--peer-heartbeat", "0.2", "--peer-window", "1.0"]


@pytest.fixture
def pair() -> Iterator[list[DaemonProcess]]:
    """Two daemons that declare a silent peer lost after 1 s."""
    tmp = short_tmpdir()
    procs = [DaemonProcess(Path(tmp) / name / "commd.sock", env=SECRET, args=[
        "--peer-listen", "127.0.0.1:0", "--peer-name", name, *FAST]) for name in "AB"]
    try:
        with started_together(*procs):
            try:
                yield procs
            finally:  # (a test may leave one SIGSTOPped: the stop would wait it out)
                for proc in procs:
                    if proc.proc is not None and proc.proc.poll() is None:
                        os.kill(proc.pid, signal.SIGCONT)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


@pytest.fixture
def steady_ac(pair: list[DaemonProcess]) -> Iterator[Steady]:
    """An unrelated world over the root daemon A and a third daemon C, running through
    each scenario (faults hit daemon B or the A-B link): it must see no error."""
    tmp = short_tmpdir()
    try:
        with DaemonProcess(Path(tmp) / "C" / "commd.sock", env=SECRET, args=[
                "--peer-listen", "127.0.0.1:0", "--peer-name", "C", *FAST]) as bystander:
            root = pair[0]
            with steady_world([spec(root, root), spec(bystander, root)]) as running:
                yield running
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def spec(daemon: DaemonProcess, root: DaemonProcess) -> str:
    return f"{daemon.socket_path}@{root.peer_address()}"


def mappings_settle(daemon: DaemonProcess, base: int) -> str:
    """The world's memory is let go on `daemon` (whose other worlds keep theirs)."""
    wait_until(lambda: memfd_mappings(daemon.pid) == base, timeout=10)
    return "none (memfd mappings at baseline on the surviving root daemon)"


def test_a_peer_without_the_secret_is_refused(pool: RankPool, pair: list[DaemonProcess]) -> None:
    root = pair[0]
    tmp = short_tmpdir()
    try:
        with DaemonProcess(Path(tmp) / "x.sock", env={"COMMD_PEER_SECRET": "another-secret-123456"},
                           args=["--peer-name", "X"]) as stranger:
            (outcome,) = pool.run(workers.join_only, [(spec(stranger, root), world_name(), 1, 2, 5)])
            name, message = outcome.unwrap()
            assert name == "PeerLost" and "does not hold our secret" in message
        # garbage on the peer port is refused too, and the root goes on serving
        host, port = parse_address(root.peer_address())
        with socket.create_connection((host, port), timeout=5) as raw:
            raw.sendall(b"\x00\x00\x00\x05\x00\x00\x00\x00hello")
            raw.settimeout(5)
            assert raw.recv(100) == b""  # closed on us
        # the root counts the stranger's refusal when it reads it, maybe after the worker heard
        wait_until(lambda: query_status(str(root.socket_path), 5)["peers"]["refused_handshakes"] >= 2)
        world = world_name()
        results = pool.run(workers.all_reduce, [(spec(d, root), world, r, 2, 64, "i32", "sum", 1)
                                                for r, d in enumerate(pair)])
        want = reduce_reference([make_input(1, r, 64, "i32", "sum") for r in range(2)], "i32", "sum")
        assert [o.unwrap() for o in results] == [want.tobytes()] * 2
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def test_a_stopped_daemon_is_declared_lost(pool: RankPool, pair: list[DaemonProcess],
                                           fault_report: FaultReport, steady_ac: Steady) -> None:
    root, member = pair
    world = world_name()
    base, unrelated = memfd_mappings(root.pid), steady_ac.errors()
    started = pool.start(workers.timed_barrier, [(spec(root, root), world, 0, 2, 4.0),
                                                (spec(member, root), world, 1, 2, 4.0)])
    wait_until(lambda: (world_status(root, world) or {}).get("pending_calls") == 1)
    stopped = time.time()
    os.kill(member.pid, signal.SIGSTOP)
    try:  # (stopped past the window: until the root's verdict has failed the world)
        wait_until(lambda: (world_status(root, world) or {}).get("state") != "ready",
                   "the root to declare B lost", 12)
    finally:
        os.kill(member.pid, signal.SIGCONT)
    rank0, rank1 = [o.unwrap() for o in pool.collect(started, 30)]
    assert rank0[0].startswith("PeerLost") and "daemon B was lost" in rank0[0]
    assert rank0[1] - stopped <= 1.0 + 1.0  # the window, plus a heartbeat and scheduling
    assert rank0[2] is False
    assert rank1[2] is False  # B found its link to the root gone when it woke
    fault_report.add("SIGSTOP a member daemon (window 1s), SIGCONT once the root declared it lost",
                     rank0[1] - stopped,
                     float("nan"), steady_ac.errors() - unrelated, mappings_settle(root, base))


def test_a_lost_rank_fails_every_daemon_and_a_new_process_rejoins(
        pool: RankPool, pair: list[DaemonProcess], steady_ac: Steady) -> None:
    root, member = pair
    world = world_name()
    outcomes = pool.run(workers.leave_early, [(spec(root, root), world, 0, 2),
                                              (spec(member, root), world, 1, 2)])
    rank0, rank1 = [o.unwrap() for o in outcomes]
    assert rank0["barrier"] == "WorldFailed" and rank0["healthy"] is False
    assert rank0["epoch"] == 2 and rank1["epoch"] == 2 and rank0["healthy_end"] is True


@pytest.mark.parametrize("kind", ["bytes", "op", "dtype"])
def test_mismatch_across_daemons(pool: RankPool, pair: list[DaemonProcess], steady_ac: Steady,
                                fault_report: FaultReport, kind: str) -> None:
    root, member = pair
    world = world_name()
    base, unrelated = memfd_mappings(root.pid), steady_ac.errors()
    # rank 1, the odd one, alone on its daemon: no daemon's own matcher sees both calls, only
    # the root's comparison across daemons does (rank 2 with rank 1 would be caught locally)
    places = [root, member, root]
    results = [o.unwrap() for o in pool.run(workers.mismatch, [(spec(d, root), world, r, 3, kind)
                                                             for r, d in enumerate(places)])]
    for res in results:
        name, message = res["error"]
        assert name == "MismatchError" and "call 1" in message and "rank 1 called" in message
        assert res["epoch"] == 2 and res["healthy_end"] is True
    fault_report.add(f"mismatched collectives across 2 daemons ({kind})", float("nan"), float("nan"),
                     steady_ac.errors() - unrelated, mappings_settle(root, base))


def test_a_point_to_point_mismatch_across_daemons_names_each_call_s_peer(
        pool: RankPool, pair: list[DaemonProcess]) -> None:
    """Rank 0 sends rank 1 16 bytes, rank 1 receives 8. On one daemon the error named each
    call's peer; across daemons (the receiver's daemon compares the size the sender's sent)
    it said only 'rank 0 called send_to(bytes=16), rank 1 called recv_from(bytes=8)'."""
    root, member = pair
    said = {}
    for where, places in (("one daemon", [root, root]), ("two daemons", [root, member])):
        world = world_name()
        results = [o.unwrap() for o in pool.run(workers.mismatch, [(spec(d, root), world, r, 2, "p2p")
                                                                   for r, d in enumerate(places)])]
        want = reduce_reference([make_input(5, r, 16, "f32", "sum") for r in range(2)], "f32", "sum")
        for res in results:
            assert res["error"][0] == "MismatchError", res["error"]
            assert res["epoch"] == 2 and res["result"] == want.tobytes()  # and the rebuilt world works
        said[where] = [res["error"][1] for res in results]
    # (one daemon names first the call that came first)
    for message in said["one daemon"] + said["two daemons"]:
        assert "mismatched point-to-point 0->1 call 0: " in message, said
        assert "rank 0 called send_to(bytes=16, peer=1)" in message, said
        assert "rank 1 called recv_from(bytes=8, peer=0)" in message, said


def test_join_timeout_names_the_missing_ranks(pool: RankPool, pair: list[DaemonProcess]) -> None:
    root, member = pair
    world = world_name()
    outcomes = pool.run(workers.join_only, [(spec(root, root), world, 0, 3, 1.0),
                                            (spec(member, root), world, 2, 3, 1.0)])
    for outcome in outcomes:
        name, message = outcome.unwrap()
        assert name == "CommTimeout" and "ranks [1] did not arrive" in message


def test_stale_epoch_messages_are_refused(pool: RankPool, pair: list[DaemonProcess],
                                         steady_ac: Steady) -> None:
    root, member = pair
    world = world_name()
    started = pool.start(workers.reconnect_then_wait, [(spec(root, root), world, 0, 2),
                                                      (spec(member, root), world, 1, 2)])
    wait_until(lambda: (world_status(root, world) or {}).get("epoch") == 2
             and (world_status(root, world) or {}).get("pending_calls") == 1)
    before = query_status(str(root.socket_path), 5)["peers"]["stale_refused"]
    asyncio.run(_send_stale(root, world, before + 2))
    assert (world_status(root, world) or {}).get("state") == "ready"
    results = [o.unwrap() for o in pool.collect(started, 30)]
    want = reduce_reference([make_input(3, r, 32, "i64", "sum") for r in range(2)], "i64", "sum")
    assert results == [want.tobytes()] * 2


async def _send_stale(root: DaemonProcess, world: str, refused: int) -> None:
    """As an authenticated daemon, say epoch 1 of the world failed, and send epoch-1 data;
    close the link once the root's stale_refused count reached `refused`."""
    settings = PeerSettings("intruder", SECRET["COMMD_PEER_SECRET"].encode())
    node = PeerNode(settings, lambda link, msg, payload: None, lambda link, reason: None)
    link = await node.dial(*parse_address(root.peer_address()))
    link.send(p.WorldFailed(world, 1, ErrorCode.WORLD_FAILED, "old news"))
    link.send(p.Data(world, 1, "up", 0, 0, 1, "barrier()"), b"")
    await link.drain()
    await eventually(lambda: query_status(str(root.socket_path), 5)["peers"]["stale_refused"] >= refused,
                     "the root refusing both as stale", timeout=15)
    link.close("done")


# fault: (how long it lasts, its line in the fault report, the bound on noticing it: a cut
# closes the links at once; bytes that vanish while TCP stays up only the heartbeat window
# (1 s) tells, plus a heartbeat and scheduling)
_NETWORK_FAULTS = {
    "cut": (1.5, "cut the network between 2 daemons for 1.5 s (TCP proxy), heal", None),
    "drop": (2.5, "black-hole network between 2 daemons for 2.5 s (window 1s), heal", 2.0),
    "half_open": (2.5, "half-open network between 2 daemons for 2.5 s (window 1s), heal", 2.0),
}


@pytest.mark.parametrize("fault", list(_NETWORK_FAULTS))
def test_a_network_fault_heals_and_the_world_is_rebuilt(pool: RankPool, pair: list[DaemonProcess],
                                                        fault_report: FaultReport, steady_ac: Steady,
                                                        fault: str) -> None:
    """The links are cut, or bytes vanish (both ways, or only toward the member): the ranks
    hear the world fail, and after the heal it is rebuilt over new links."""
    from tests.integration.faultproxy import FaultProxy

    lasts, label, notice_bound = _NETWORK_FAULTS[fault]
    root, member = pair
    base, unrelated = memfd_mappings(root.pid), steady_ac.errors()
    proxy = FaultProxy(*parse_address(root.peer_address()))
    try:
        world = world_name()
        # the member reaches the root only through the proxy; the root's own rank dials itself
        args = [(spec(root, root), world, 0, 2, 6), (f"{member.socket_path}@{proxy.address}", world, 1, 2, 6)]
        started = pool.start(workers.ride_out_a_cut, args)
        # the fault comes as they watch for it, their all_reduce and barrier (#1) done: a call
        # it broke would fail the worker (after a sleep it was, had the ranks come in time)
        wait_until(lambda: all((call.get("seq"), call.get("state")) == (1, "done")
                               for call in (last_call(d, world, r) for r, d in enumerate(pair))),
                   "both ranks' barrier done")
        began = time.time()
        getattr(proxy, fault)()
        time.sleep(lasts)
        healed_at = time.time()
        proxy.heal()
        results = [o.unwrap() for o in pool.collect(started, 60)]
    finally:
        proxy.close()
    want = reduce_reference([make_input(6, r, 64, "i32", "sum") for r in range(2)], "i32", "sum")
    assert all(res["epoch"] == 2 and res["result"] == want.tobytes() for res in results)
    noticed = min(res["at"] for res in results) - began
    if notice_bound is not None:
        assert noticed <= notice_bound
    fault_report.add(label, noticed, max(res["rebuilt_at"] for res in results) - healed_at,
                     steady_ac.errors() - unrelated, mappings_settle(root, base))


def test_a_slow_network_is_not_a_failure(pool: RankPool, pair: list[DaemonProcess],
                                         fault_report: FaultReport, steady_ac: Steady) -> None:
    """40 ms each way between the daemons: every call is slower, and none fails."""
    from tests.integration.faultproxy import FaultProxy

    root, member = pair
    proxy = FaultProxy(*parse_address(root.peer_address()))
    try:
        proxy.delay(0.04)
        world = world_name()
        args = [(spec(root, root), world, 0, 2, 8), (f"{member.socket_path}@{proxy.address}", world, 1, 2, 8)]
        outcomes = pool.run(workers.command_loop, [(*a[:4], [1, 2, 3, 4, 5]) for a in args], timeout=60)
    finally:
        proxy.close()
    assert [o.unwrap() for o in outcomes] == [[1, 2, 3, 4, 5]] * 2
    fault_report.add("delay 40 ms each way between 2 daemons (TCP proxy): no failure", float("nan"),
                     float("nan"), steady_ac.errors(), "n/a (the world never failed)")


def backend(daemon: DaemonProcess, root: DaemonProcess, world: str, rank: int, size: int) -> DaemonBackend:
    return DaemonBackend(str(daemon.socket_path), world, rank, size, timeout=8, bootstrap=root.peer_address())


def summed_i32(comms: list[DaemonBackend]) -> list[list[int]]:
    bufs = [hostmem.alloc(8) for _ in comms]
    for r, buf in enumerate(bufs):
        buf.view(np.int32)[:] = [r + 1, 10 * (r + 1)]
    with ThreadPoolExecutor(len(comms)) as threads:
        calls = [threads.submit(c.all_reduce, b.ptr, 8, dtype="i32")
                 for c, b in zip(comms, bufs, strict=True)]
        for call in calls:
            call.result(20)
    return [buf.view(np.int32).tolist() for buf in bufs]


def test_a_new_rank_0_and_a_reconnecting_member_meet_at_a_newer_epoch(pair: list[DaemonProcess]) -> None:
    """Rank 0's process ends (its daemon, the root, forgets the world); a new process takes
    rank 0 (its hello says epoch 0) while rank 1 reconnects from epoch 1. The root must
    form the world at an epoch newer than the member's (before: epoch 1, which the member
    dropped as stale, and both timed out)."""
    root, member = pair
    world = world_name()
    with ThreadPoolExecutor(2) as threads:
        first = threads.submit(backend, root, root, world, 0, 2)
        rank1 = backend(member, root, world, 1, 2)
        first.result(20).close()
        wait_until(lambda: world_status(root, world) is None)
        reconnected = threads.submit(rank1.attempt_reconnect)
        rank0 = backend(root, root, world, 0, 2)
        reconnected.result(20)
    try:
        assert rank0.epoch == rank1.epoch == 2
        assert summed_i32([rank0, rank1]) == [[3, 30], [3, 30]]
    finally:
        rank0.close()
        rank1.close()


def test_the_roots_world_for_a_members_vote_ends_with_the_vote(pair: list[DaemonProcess]) -> None:
    """A member's rank comes, rank 0 never does: when the vote times out, the world the root
    made for it is gone (before: kept for ever, and the name refused to a job of another size)."""
    root, member = pair
    world = world_name()
    with pytest.raises(CommTimeout):
        DaemonBackend(str(member.socket_path), world, 1, 2, timeout=1, bootstrap=root.peer_address())
    wait_until(lambda: world_status(root, world) is None, timeout=5)
    with backend(root, root, world, 0, 1) as alone:  # a new job under the name, of another size
        assert summed_i32([alone]) == [[1, 10]]


def joined(daemons: list[DaemonProcess], root: DaemonProcess, world: str) -> list[DaemonBackend]:
    """One rank on each of `daemons` (in rank order), joined together."""
    with ThreadPoolExecutor(len(daemons)) as threads:
        joining = [threads.submit(backend, d, root, world, r, len(daemons)) for r, d in enumerate(daemons)]
        return [j.result(20) for j in joining]


def a_new_world_sums(daemons: list[DaemonProcess], root: DaemonProcess) -> None:
    """A new world, one rank on each of `daemons`, forms and sums right (the daemons serve)."""
    comms = joined(daemons, root, world_name())
    try:
        assert summed_i32(comms) == [[3, 30], [3, 30]]
    finally:
        for comm in comms:
            comm.close()


def test_worlds_rooted_on_either_daemon_live_side_by_side(pair: list[DaemonProcess]) -> None:
    """World X is rooted on A with a rank on B; world Y on B with a rank on A: each daemon
    dials the other. Both links stay (before, the second replaced the first: X failed when
    Y formed, and each reconnect of one failed the other)."""
    a, b = pair
    x = joined([a, b], a, world_name("x"))
    y = joined([b, a], b, world_name("y"))
    try:
        assert summed_i32(x) == [[3, 30], [3, 30]] and summed_i32(y) == [[3, 30], [3, 30]]
        with ThreadPoolExecutor(2) as threads:
            for reconnect in [threads.submit(c.attempt_reconnect) for c in x]:
                reconnect.result(20)
        assert [c.epoch for c in x] == [2, 2]
        assert all(c.is_healthy() for c in x + y)
        assert summed_i32(y) == [[3, 30], [3, 30]] and summed_i32(x) == [[3, 30], [3, 30]]
        assert query_status(str(a.socket_path), 5)["peers"]["links"] == ["B"]
    finally:
        for comm in x + y:
            comm.close()


def test_a_restarted_daemon_replaces_its_old_links(pair: list[DaemonProcess]) -> None:
    """B is killed and restarted under the same name while A still holds links to the old
    process (a kill closes them, but A may not have read that yet): the new process's link
    ends the old process's worlds on A, and a world between A and the new B works."""
    a, b = pair
    old = joined([a, b], a, world_name())
    try:
        b.kill()
        b.start()
        fresh = joined([a, b], a, world_name())
        assert summed_i32(fresh) == [[3, 30], [3, 30]]
        wait_until(lambda: not old[0].is_healthy(), timeout=5)
        for comm in fresh:
            comm.close()
    finally:
        for comm in old:
            comm.close()


def test_a_members_rank_killed_while_the_world_forms_is_not_counted(pair: list[DaemonProcess]) -> None:
    """Rank 1 says hello on the member daemon and is killed before rank 0 comes: the root
    must forget its vote (before, rank 0 was told the world was ready, and its first call
    hung until the timeout), and a new process for rank 1 joins as usual."""
    a, b = pair
    world = world_name()
    code = ("from client import DaemonBackend; DaemonBackend("
            f"{str(b.socket_path)!r}, {world!r}, 1, 2, timeout=30, bootstrap={a.peer_address()!r})")
    child = subprocess.Popen([sys.executable, "-c", code], cwd=str(Path(__file__).resolve().parents[2]))
    try:
        wait_until(lambda: (world_status(b, world) or {}).get("waiting") == [1], timeout=20)
    finally:
        child.kill()
        child.wait(10)
    wait_until(lambda: world_status(b, world) is None, timeout=5)
    with pytest.raises(CommTimeout, match=r"ranks \[1\] did not arrive"):
        DaemonBackend(str(a.socket_path), world, 0, 2, timeout=1.5, bootstrap=a.peer_address())
    comms = joined([a, b], a, world)
    try:
        assert summed_i32(comms) == [[3, 30], [3, 30]]
    finally:
        for comm in comms:
            comm.close()


@pytest.mark.parametrize("first_on", ["member", "root"])
def test_a_rank_gone_after_its_vote_reached_the_root_may_come_again_on_the_other_daemon(
        pair: list[DaemonProcess], first_on: str) -> None:
    """Rank 1 says hello on one daemon, its vote reaches the root A, and its connection goes
    before rank 0 comes. The root forgets the vote (and the world, which has no other), so
    a new process for rank 1 on the other daemon is no duplicate of the one that left: the
    world forms with it and sums right (a vote kept would refuse it as 'already on daemon
    B' or 'A', or form the world with a rank that is gone)."""
    a, b = pair
    world = world_name()
    first, then = (b, a) if first_on == "member" else (a, b)
    with contextlib.closing(dialed(str(first.socket_path))) as gone:
        gone.send(proto.Hello(1, proto.PROTOCOL_VERSION, os.getpid(), world, 1, 2, 60_000,
                              bootstrap=a.peer_address()))
        wait_until(lambda: (world_status(first, world) or {}).get("waiting") == [1], timeout=10)
        # (a vote on the root is counted by a task of its own, after the hello)
        wait_until(lambda: (world_status(a, world) or {}).get("votes_held") == 1, "the vote at the root",
                   timeout=10)
    wait_until(lambda: world_status(a, world) is None and world_status(b, world) is None,
               "both daemons forgot the world", timeout=10)
    comms = joined([a, then], a, world)
    try:
        assert [c.epoch for c in comms] == [1, 1]
        assert summed_i32(comms) == [[3, 30], [3, 30]]
    finally:
        for comm in comms:
            comm.close()


def rank_process(daemon: DaemonProcess, root: DaemonProcess, world: str, rank: int, size: int,
                 then: str = "") -> subprocess.Popen[bytes]:
    """A worker process that joins (and then runs `then`, Python with `comm` in scope)."""
    code = (f"from client import DaemonBackend, hostmem\nimport numpy as np, time\n"
            f"comm = DaemonBackend({str(daemon.socket_path)!r}, {world!r}, {rank}, {size}, timeout=8, "
            f"bootstrap={root.peer_address()!r})\n{then}")
    return subprocess.Popen([sys.executable, "-c", code], cwd=str(Path(__file__).resolve().parents[2]),
                            stdout=subprocess.PIPE)


def test_a_rank_that_left_while_its_world_formed_fails_it_at_once(pair: list[DaemonProcess]) -> None:
    """Ranks 1 and 2 wait on the member daemon B; rank 1 is killed while B is stopped, so its
    withdrawal crosses the root's WorldReady. B must fail the world it formed without rank 1
    (before, every call waited for rank 1 until the call timeout)."""
    a, b = pair
    world = world_name()
    doomed = rank_process(b, a, world, 1, 3, "time.sleep(60)")
    survivor = rank_process(b, a, world, 2, 3, (
        "buf = hostmem.alloc(8)\nstarted = time.monotonic()\ntry:\n"
        "    comm.all_reduce(buf.ptr, 8, dtype='i32')\n    print('ok')\n"
        "except Exception as exc:\n    print(type(exc).__name__, round(time.monotonic() - started, 1))\n"))
    try:
        wait_until(lambda: (world_status(b, world) or {}).get("waiting") == [1, 2], timeout=20)
        wait_until(lambda: (world_status(a, world) or {}).get("votes_held") == 2, "both votes at the root")
        os.kill(b.pid, signal.SIGSTOP)
        doomed.kill()
        doomed.wait(10)
        with ThreadPoolExecutor(1) as threads:
            joining = threads.submit(backend, a, a, world, 0, 3)
            # the root forms the world; its WorldReady waits for B
            wait_until(lambda: (world_status(a, world) or {}).get("state") == "ready", "the world formed")
            os.kill(b.pid, signal.SIGCONT)
            rank0 = joining.result(20)
        try:
            with pytest.raises(WorldFailed, match=r"ranks \[1\] left before it formed"):
                summed_i32([rank0])
        finally:
            rank0.close()
        out, _ = survivor.communicate(timeout=30)
        name, seconds = out.decode().split()
        assert name == "WorldFailed" and float(seconds) < 5  # (its timeout is 8 s)
    finally:
        os.kill(b.pid, signal.SIGCONT)
        for proc in (doomed, survivor):
            proc.kill()
            proc.wait(10)


def test_ranks_of_a_daemon_lost_while_the_world_forms_are_named_missing(pair: list[DaemonProcess]) -> None:
    a, b = pair
    world = world_name()
    member = rank_process(b, a, world, 1, 3, "time.sleep(60)")
    try:
        wait_until(lambda: world_status(a, world) is not None)  # rank 1's vote is at the root
        with ThreadPoolExecutor(1) as threads:
            joining = threads.submit(DaemonBackend, str(a.socket_path), world, 0, 3, timeout=2,
                                     bootstrap=a.peer_address())
            wait_until(lambda: (world_status(a, world) or {}).get("votes_held") == 2, "rank 0's vote counted")
            b.kill()
            with pytest.raises(CommTimeout, match=r"ranks \[1, 2\] did not arrive"):
                joining.result(20)
    finally:
        member.kill()
        member.wait(10)


class Relay:
    """A TCP relay to `target` on a thread of its own (what a worker could run to make its
    daemon's handshake pass through): bytes both ways, until `cut`."""

    def __init__(self, target: str) -> None:
        self._target = parse_address(target)
        self._loop = asyncio.new_event_loop()
        self._writers: list[asyncio.StreamWriter] = []
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._thread.start()
        self._server = asyncio.run_coroutine_threadsafe(
            asyncio.start_server(self._relay, "127.0.0.1", 0), self._loop).result(10)
        self.address = f"127.0.0.1:{self._server.sockets[0].getsockname()[1]}"

    async def _relay(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        far_reader, far_writer = await asyncio.open_connection(*self._target)
        self._writers += [writer, far_writer]

        async def pump(source: asyncio.StreamReader, sink: asyncio.StreamWriter) -> None:
            with contextlib.suppress(ConnectionError):
                while data := await source.read(65536):
                    sink.write(data)
                    await sink.drain()
            sink.close()

        await asyncio.gather(pump(reader, far_writer), pump(far_reader, writer))

    def cut(self) -> None:
        for writer in self._writers:
            self._loop.call_soon_threadsafe(writer.close)

    def close(self) -> None:
        self.cut()
        self._loop.call_soon_threadsafe(self._server.close)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)


def test_a_relayed_link_that_goes_away_fails_only_its_own_worlds(pair: list[DaemonProcess]) -> None:
    """A worker on B makes its daemon dial a relay to A (its own world's bootstrap), so A and
    B hold a second link through it. When the relay cuts it, the world that used it fails;
    a world between A and B over their own link goes on (before, all links to a daemon died
    together: anyone could fail every world between two daemons)."""
    a, b = pair
    kept, world = joined([a, b], a, world_name("kept")), world_name("relayed")
    relay = Relay(a.peer_address())
    try:
        assert summed_i32(kept) == [[3, 30], [3, 30]]
        with ThreadPoolExecutor(2) as threads:
            joining = [threads.submit(DaemonBackend, str(d.socket_path), world, r, 2, timeout=8,
                                      bootstrap=address)
                       for r, (d, address) in enumerate([(a, a.peer_address()), (b, relay.address)])]
            relayed = [j.result(20) for j in joining]
        assert summed_i32(relayed) == [[3, 30], [3, 30]]
        relay.cut()
        wait_until(lambda: not relayed[1].is_healthy(), timeout=5)
        assert all(comm.is_healthy() for comm in kept)
        assert summed_i32(kept) == [[3, 30], [3, 30]]
        for comm in relayed:
            comm.close()
    finally:
        relay.close()
        for comm in kept:
            comm.close()


def votes_lost(daemon: DaemonProcess) -> int:
    """How many votes the daemon, as a root, dropped because the link they came over went."""
    lost: int = query_status(str(daemon.socket_path), 5)["peers"]["votes_lost_with_links"]
    return lost


def test_a_link_to_the_root_lost_while_the_world_forms_casts_its_votes_again(
        pair: list[DaemonProcess]) -> None:
    """Rank 1's vote went to the root over a link that is then cut: B casts it again over a
    new link, so rank 0 joining then forms the world (before fed61d5, rank 1 waited out its
    whole timeout for a world that could not form; after it, rank 1 was refused at once,
    PeerLost, also when the root was only restarting). The root counts the vote it dropped
    with the link (peers.votes_lost_with_links), once."""
    a, b = pair
    relay = Relay(a.peer_address())
    world = world_name()
    comms: list[DaemonBackend] = []
    try:
        with ThreadPoolExecutor(1) as threads:
            joining = threads.submit(DaemonBackend, str(b.socket_path), world, 1, 2, timeout=8,
                                     bootstrap=relay.address)
            wait_until(lambda: (world_status(a, world) or {}).get("votes_held") == 1, "the vote at the root")
            assert votes_lost(a) == 0
            relay.cut()
            # (votes_held goes 1 -> 0 -> 1 within milliseconds: once the count says the vote
            # over the cut link is gone, a vote the root holds is one cast over a new link)
            wait_until(lambda: votes_lost(a) == 1, "the root dropping the vote over the cut link")
            wait_until(lambda: (world_status(a, world) or {}).get("votes_held") == 1,
                       "B's vote over a new link")
            comms.append(DaemonBackend(str(a.socket_path), world, 0, 2, timeout=8,
                                       bootstrap=a.peer_address()))
            comms.append(joining.result(20))
        assert summed_i32(comms) == [[3, 30], [3, 30]]
        assert [votes_lost(a), votes_lost(b)] == [1, 0]  # (one vote lost, once; B held none)
    finally:
        for comm in comms:
            comm.close()
        relay.close()


def test_a_stray_hello_on_a_member_daemon_leaves_a_healthy_world_alone(pair: list[DaemonProcess]) -> None:
    """Ranks 0 and 2 on the root A, rank 1 on B, ready. Another process says hello for rank
    2 on B: a duplicate, refused as the same hello on A is (before: B voted it in, and the
    root failed the healthy world for everyone as if rank 2 had called attempt_reconnect)."""
    a, b = pair
    world = world_name()
    comms = joined([a, b, a], a, world)
    try:
        assert summed_i32(comms) == [[6, 60]] * 3
        with pytest.raises(MisuseError, match=r"rank 2 .* is already on daemon A"):
            backend(b, a, world, 2, 3)
        time.sleep(0.3)  # (a vote would have reached the root by now)
        assert all(c.is_healthy() for c in comms)
        assert summed_i32(comms) == [[6, 60]] * 3
    finally:
        for comm in comms:
            comm.close()


def test_two_processes_voting_for_one_rank_on_two_daemons_the_first_wins(pair: list[DaemonProcess]) -> None:
    """While the world forms, a process on B votes for rank 2, then another on the root A
    does: the second is refused as a duplicate, as two hellos on one daemon are (before: A's
    vote silently replaced B's, B welcomed its process too, and its data took the place of
    rank 1's in everyone's sums while rank 1 hung)."""
    a, b = pair
    world = world_name()
    with ThreadPoolExecutor(3) as threads:
        first = threads.submit(backend, b, a, world, 2, 3)
        wait_until(lambda: world_status(a, world) is not None)  # its vote is at the root
        with pytest.raises(MisuseError, match=r"rank 2 .* is already on daemon B"):
            backend(a, a, world, 2, 3)
        rest = [threads.submit(backend, d, a, world, r, 3) for r, d in enumerate([a, b])]
        comms = [j.result(20) for j in rest] + [first.result(20)]
    try:
        assert summed_i32(comms) == [[6, 60]] * 3
    finally:
        for comm in comms:
            comm.close()


def test_a_members_vote_for_a_rank_the_root_holds_is_refused_and_the_others_vote_on(
        pair: list[DaemonProcess]) -> None:
    """While the world forms, rank 2 votes on the root A and rank 1 on B; then a second
    process votes for rank 2 on B. The root refuses that vote over the link (the first came
    first): the process gets the duplicate's MisuseError naming A, B's vote for rank 1 stays
    counted, and the world forms with the first rank 2."""
    a, b = pair
    world = world_name()
    with ThreadPoolExecutor(3) as threads:
        first = threads.submit(backend, a, a, world, 2, 3)
        second = threads.submit(backend, b, a, world, 1, 3)
        wait_until(lambda: (world_status(a, world) or {}).get("waiting") == [2], "rank 2 at the root")
        wait_until(lambda: (world_status(b, world) or {}).get("waiting") == [1], "rank 1 on B")
        with pytest.raises(MisuseError, match=rf"rank 2 of world {world} is already on daemon A$"):
            backend(b, a, world, 2, 3)
        assert (world_status(b, world) or {}).get("waiting") == [1]
        rank_0 = backend(a, a, world, 0, 3)
        comms = [rank_0, second.result(20), first.result(20)]
    try:
        assert [c.epoch for c in comms] == [1, 1, 1]
        assert summed_i32(comms) == [[6, 60]] * 3
    finally:
        for comm in comms:
            comm.close()


def _two_named_daemons(stack: contextlib.ExitStack, names: dict[str, str], *args: str) -> list[DaemonProcess]:
    """Daemons A (a world's root) and B of these peer names, stopped with `stack`."""
    tmp = short_tmpdir()
    stack.callback(shutil.rmtree, tmp, ignore_errors=True)
    daemons = [DaemonProcess(Path(tmp) / d / "commd.sock", env=SECRET, args=[
        "--peer-listen", "127.0.0.1:0", "--peer-name", names[d], *FAST, *args]) for d in "AB"]
    stack.enter_context(started_together(*daemons))
    return daemons


def _hellos(stack: contextlib.ExitStack, daemons: list[DaemonProcess], world: str, size: int,
            ranks: range, timeout_ms: int = 60_000) -> list[RawClient]:
    """`ranks` of the world say hello, the lower half of the world's on A, the rest on B."""
    a, b = daemons
    bootstrap = a.peer_address()
    return said_hello(stack, [(str((a if rank < size // 2 else b).socket_path),
                               proto.Hello(rank + 1, proto.PROTOCOL_VERSION, os.getpid(), world, rank, size,
                                           timeout_ms, bootstrap=bootstrap)) for rank in ranks])


def test_a_world_whose_placement_is_over_64_kib_forms() -> None:
    """260 ranks over two daemons of 256-character names: the placement (each rank's daemon
    name) encodes to ~67 KB, past the 64 KiB a peer frame's header had (before: every rank
    refused, LimitExceeded, 'world_ready is 67406 bytes, over the 65536-byte limit'). A sealed
    frame's header may take 1 MiB: the world forms across both daemons and sums."""
    size = 260
    with contextlib.ExitStack() as stack:
        daemons = _two_named_daemons(stack, {"A": "a" * 256, "B": "b" * 256})
        world = world_name()
        ranks = _hellos(stack, daemons, world, size, range(size - 1))
        last = stack.enter_context(DaemonBackend(str(daemons[1].socket_path), world, size - 1, size,
                                                 timeout=20, bootstrap=daemons[0].peer_address()))
        for rank, client in enumerate(ranks):
            answer = client.recv()
            assert isinstance(answer, proto.Welcome) and answer.id == rank + 1, (rank, answer)
            assert answer.epoch == 1, (rank, answer)
        assert world_status(daemons[0], world)["state"] == "ready"
        assert world_status(daemons[1], world)["state"] == "ready"
        assert last.epoch == 1


@pytest.mark.timeout(120)
def test_a_world_whose_placement_does_not_fit_a_peer_message_is_refused_as_a_limit_saying_why() -> None:
    """4100 ranks over two daemons of 256-character names: the placement encodes past the
    1 MiB of a sealed frame's header, so the root cannot tell B that the world formed. Every
    rank, on either daemon, is refused with LIMIT, told what does not fit and what fits more
    ranks, and both daemons then form a world (before 79adbe5: WORLD_CONFLICT, a MisuseError,
    no word of what takes the room, or of a way out)."""
    size = 4100
    with contextlib.ExitStack() as stack:
        raise_nofile(stack, size + 1000)
        daemons = _two_named_daemons(stack, {"A": "a" * 256, "B": "b" * 256}, "--max-connections", "3000")
        world = world_name()
        ranks = _hellos(stack, daemons, world, size, range(size - 1))
        with pytest.raises(LimitExceeded) as last:
            DaemonBackend(str(daemons[1].socket_path), world, size - 1, size, timeout=60,
                          bootstrap=daemons[0].peer_address())
        assert re.fullmatch(
            rf"world {world} cannot be announced to its daemons: its placement of {size} ranks by "
            r"daemon names of up to 256 characters does not fit one peer message \(world_ready is "
            r"\d+ bytes, over the 1048576-byte limit\); shorter daemon names \(--peer-name\) fit more "
            "ranks", str(last.value)), last.value
        each_refused(ranks, ErrorCode.LIMIT, str(last.value))
        for client in ranks:
            client.close()
        wait_until(lambda: all(world_status(d, world) is None for d in daemons), "the world forgotten", 30)
        comms = joined(daemons, daemons[0], world_name())
        try:
            assert summed_i32(comms) == [[3, 30], [3, 30]]
        finally:
            for comm in comms:
                comm.close()


@pytest.mark.timeout(60)
def test_a_join_timeout_of_thousands_of_ranks_reaches_every_rank_without_stalling_the_root() -> None:
    """8000 ranks over A and B; all but the last say hello with a 2 s timeout. The root times
    each vote out and names the one rank that never came: every rank, on either daemon, hears
    it (before: each of the 7999 expiries listed the world's ranks anew, ~64 M steps that held
    A's loop for seconds; B, hearing nothing for its 1 s window, dropped the link, and its ranks
    were refused with PeerLost, "cannot reach the daemon at ...")."""
    size = 8000
    with contextlib.ExitStack() as stack:
        raise_nofile(stack, size + 1000)
        daemons = _two_named_daemons(stack, {"A": "A", "B": "B"}, "--max-connections", str(size // 2 + 100))
        world = world_name()
        ranks = _hellos(stack, daemons, world, size, range(size - 1), timeout_ms=2000)
        each_refused(ranks, ErrorCode.TIMEOUT, f"world {world}: ranks [{size - 1}] did not arrive within 2s")
        for client in ranks:
            client.close()
        wait_until(lambda: all(world_status(d, world) is None for d in daemons), "the world forgotten", 30)
        a_new_world_sums(daemons, daemons[0])


def test_a_vote_sent_to_a_daemon_whose_world_of_the_name_is_its_own_alone_is_refused(
        pair: list[DaemonProcess]) -> None:
    """Rank 0 of a 2-rank world waits on A with no bootstrap address (a one-daemon world);
    rank 1 of a world of that name says hello on B naming A as the root. A refuses the vote
    as no root of that world: rank 1 hears so at once, and A's world forms with a rank of its
    own."""
    a, b = pair
    world = world_name()
    with ThreadPoolExecutor(1) as threads:
        local_0 = threads.submit(DaemonBackend, str(a.socket_path), world, 0, 2, timeout=8)
        wait_until(lambda: (world_status(a, world) or {}).get("waiting") == [0], "rank 0 on A")
        started = time.monotonic()
        with pytest.raises(MisuseError, match=rf"^daemon A is not the root of world {world}$"):
            backend(b, a, world, 1, 2)
        assert time.monotonic() - started < 2
        assert world_status(b, world) is None
        comms = [DaemonBackend(str(a.socket_path), world, 1, 2, timeout=8)]
        comms.insert(0, local_0.result(20))
    try:
        assert summed_i32(comms) == [[3, 30], [3, 30]]
    finally:
        for comm in comms:
            comm.close()


def test_a_members_rank_whose_time_ran_out_while_its_root_stalled_hears_the_root_was_lost(
        pair: list[DaemonProcess]) -> None:
    """Rank 1's vote (0.5 s) is at the root A when A stops (SIGSTOP): A's timer cannot
    refuse it. When B declares A lost (1 s of silence) the vote's time is up, so it is not
    cast again: rank 1 is refused with PeerLost naming the root, before its own backstop;
    A, resumed, and B then form a world."""
    a, b = pair
    world = world_name()
    with ThreadPoolExecutor(1) as threads:
        joining = threads.submit(DaemonBackend, str(b.socket_path), world, 1, 2, timeout=0.5,
                                 bootstrap=a.peer_address())
        wait_until(lambda: world_status(a, world) is not None, "rank 1's vote at the root", timeout=5)
        os.kill(a.pid, signal.SIGSTOP)
        try:
            with pytest.raises(PeerLost, match=rf"^world {world}: the root daemon A was lost: silent for "):
                joining.result(20)
        finally:
            os.kill(a.pid, signal.SIGCONT)
    assert world_status(b, world) is None
    a_new_world_sums(pair, a)


def test_worlds_held_for_other_daemons_votes_are_bounded() -> None:
    """A daemon holding the secret (in no world) asks the root for world after made-up world
    with an hour's timeout: past max_forming_worlds it is refused with LIMIT, the root's
    worlds stay bounded, and a real job still forms there (before: each made a world that
    lived as long as the vote, ~8 KiB each, without end)."""
    tmp = short_tmpdir()
    refused: list[p.JoinRefused] = []
    try:
        with DaemonProcess(Path(tmp) / "A" / "commd.sock", env=SECRET, args=[
                "--peer-listen", "127.0.0.1:0", "--peer-name", "A", "--max-forming-worlds", "20",
                *FAST]) as root:

            async def flood() -> None:
                node = PeerNode(PeerSettings("intruder", SECRET["COMMD_PEER_SECRET"].encode()),
                                lambda _link, msg, _payload: refused.append(msg)  # type: ignore[arg-type]
                                if isinstance(msg, p.JoinRefused) else None,
                                lambda _link, _reason: None)
                link = await node.dial(*parse_address(root.peer_address()))
                for i in range(60):
                    link.send(p.JoinWorld(f"ghost-{i}", 2, 1, 0, 3_600_000))
                await link.drain()
                deadline = time.monotonic() + 10
                while len(refused) < 40 and time.monotonic() < deadline:
                    await asyncio.sleep(0.05)
                assert query_status(str(root.socket_path), 5)["worlds_total"] == 20
                with backend(root, root, world_name(), 0, 1) as job:  # rank 0 here: not limited
                    assert summed_i32([job]) == [[1, 10]]
                link.close("done")

            asyncio.run(flood())
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    assert len(refused) == 40 and {m.code for m in refused} == {ErrorCode.LIMIT}
    assert "max_forming_worlds" in refused[0].message


def test_a_member_that_never_reaches_its_root_says_so() -> None:
    """The bootstrap address answers TCP but never the handshake (a wrong port, a hung
    root): the rank's join times out saying the root did not form the world. Before, the
    member, not knowing yet that it was no root, said "ranks [0, 1] did not arrive"; and
    the client, waiting no longer than the member's own backstop, often timed out first
    with a message of its own that named nothing."""
    tmp = short_tmpdir()
    with socket.create_server(("127.0.0.1", 0)) as silent:  # accepts (the backlog), says nothing
        bootstrap = f"127.0.0.1:{silent.getsockname()[1]}"
        try:
            member = DaemonProcess(Path(tmp) / "B" / "commd.sock", env=SECRET, args=[
                "--peer-listen", "127.0.0.1:0", "--peer-name", "B", "--peer-heartbeat", "1",
                "--peer-window", "30"])
            with member, pytest.raises(CommTimeout, match=rf"world .*: the root daemon "
                                                          rf"\({bootstrap}\) did not form it within 1s"):
                DaemonBackend(str(member.socket_path), world_name(), 1, 2, timeout=1, bootstrap=bootstrap)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)


def test_a_member_daemon_stopping_tells_the_others_why(pair: list[DaemonProcess]) -> None:
    """Daemon B stops (SIGTERM) under an idle world: its rank hears DaemonShutdown, the
    root's rank hears that daemon B is shutting down (before: "rank 1's connection was
    lost", B's first closed connection failing the world before the shutdown did), and
    once B is back both rejoin."""
    a, b = pair
    comms = joined([a, b], a, world_name())
    try:
        assert summed_i32(comms) == [[3, 30], [3, 30]]
        assert b.stop() == 0
        with pytest.raises(PeerLost, match="daemon B is shutting down"):
            comms[0].barrier()
        with pytest.raises(DaemonShutdown, match="shutting down"):
            comms[1].barrier()
        b.start()
        with ThreadPoolExecutor(2) as threads:
            for rejoined in [threads.submit(comm.attempt_reconnect) for comm in comms]:
                rejoined.result(30)
        assert summed_i32(comms) == [[3, 30], [3, 30]]
    finally:
        for comm in comms:
            comm.close()


def test_votes_taken_while_looking_for_the_root_name_the_missing_ranks() -> None:
    """Daemon B's rank 0 waits while B dials a bootstrap address that never answers; daemon
    C, told B is the root, votes there for rank 1: B counts it (it may be the root: who it
    is is not known yet) and times it out naming rank 0 as missing, as a root would (the
    daemon still looking for its root must not name ranks of its own round, but these votes
    are its own round's)."""
    tmp = short_tmpdir()
    slow = ["--peer-heartbeat", "1", "--peer-window", "30"]
    with socket.create_server(("127.0.0.1", 0)) as silent:
        bootstrap = f"127.0.0.1:{silent.getsockname()[1]}"
        b = DaemonProcess(Path(tmp) / "B" / "commd.sock", env=SECRET,
                          args=["--peer-listen", "127.0.0.1:0", "--peer-name", "B", *slow])
        c = DaemonProcess(Path(tmp) / "C" / "commd.sock", env=SECRET,
                          args=["--peer-listen", "127.0.0.1:0", "--peer-name", "C", *slow])
        world = world_name()
        try:
            with started_together(b, c), ThreadPoolExecutor(1) as threads:
                rank0 = threads.submit(DaemonBackend, str(b.socket_path), world, 0, 2, timeout=2,
                                       bootstrap=bootstrap)
                wait_until(lambda: (world_status(b, world) or {}).get("waiting") == [0], timeout=10)
                with pytest.raises(CommTimeout, match=r"ranks \[0\] did not arrive within 1s"):
                    DaemonBackend(str(c.socket_path), world, 1, 2, timeout=1, bootstrap=b.peer_address())
                with pytest.raises(CommTimeout, match=r"the root daemon .* did not form it within 2s"):
                    rank0.result(20)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)


class SlowProxy:
    """A TCP relay to `target` that holds each connection `delay_s` before it relays: a
    daemon dialing through it finds out who is at the other end that much later."""

    def __init__(self, target: str, delay_s: float) -> None:
        self._target, self._delay_s = parse_address(target), delay_s
        self._server = socket.create_server(("127.0.0.1", 0))
        self.address = f"127.0.0.1:{self._server.getsockname()[1]}"
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        with contextlib.suppress(OSError):  # (closed)
            while True:
                near, _ = self._server.accept()
                threading.Thread(target=self._relay, args=(near,), daemon=True).start()

    def _relay(self, near: socket.socket) -> None:
        time.sleep(self._delay_s)
        with near, socket.create_connection(self._target, timeout=5) as far:
            far.settimeout(None)
            threading.Thread(target=self._pipe, args=(far, near), daemon=True).start()
            self._pipe(near, far)

    @staticmethod
    def _pipe(source: socket.socket, sink: socket.socket) -> None:
        with contextlib.suppress(OSError):
            while data := source.recv(65536):
                sink.sendall(data)
        with contextlib.suppress(OSError):
            sink.shutdown(socket.SHUT_WR)

    def close(self) -> None:
        self._server.close()


def test_votes_sent_to_a_daemon_that_is_no_root_are_refused_once_it_knows() -> None:
    """Daemon B reaches the root A slowly; meanwhile daemon C, told B is the root, votes at
    B for rank 2. Once B finds it is a member, it refuses that vote at once, saying who the
    root is (before: it held the vote until C's rank timed out, naming ranks missing that
    were on their way to A)."""
    world, tmp = world_name(), short_tmpdir()
    slow = ["--peer-heartbeat", "1", "--peer-window", "30"]  # (B's handshake waits for the relay)
    a, b, c = (DaemonProcess(Path(tmp) / name / "commd.sock", env=SECRET, args=[
        "--peer-listen", "127.0.0.1:0", "--peer-name", name, *slow]) for name in "ABC")
    try:
        with started_together(a, b, c), ThreadPoolExecutor(1) as threads, \
                contextlib.closing(SlowProxy(a.peer_address(), 1.5)) as proxy:
            rank1 = threads.submit(DaemonBackend, str(b.socket_path), world, 1, 3, timeout=2.5,
                                   bootstrap=proxy.address)
            wait_until(lambda: (world_status(b, world) or {}).get("waiting") == [1], timeout=10)
            started = time.monotonic()
            with pytest.raises(MisuseError, match=rf"daemon B is not the root of world {world}; "
                                                  rf"its root is the daemon at {proxy.address}"):
                DaemonBackend(str(c.socket_path), world, 2, 3, timeout=30, bootstrap=b.peer_address())
            assert time.monotonic() - started < 10  # (not C's rank's timeout)
            with pytest.raises(CommTimeout, match=r"ranks \[0, 2\] did not arrive"):
                rank1.result(20)  # (A, the root, names them)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


class RawPeer:
    """An authenticated daemon of the test's making, on a thread of its own: it dials whom
    it is told and sends the frames it is told, when it is told (what a real daemon's
    frames would be at a moment the test picks), and keeps what it receives."""

    def __init__(self, name: str) -> None:
        self.received: list[tuple[str, p.PeerMessage]] = []  # (the link's daemon, message)
        self.lost: list[str] = []
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._thread.start()
        self._links: list[Any] = []
        self._node = PeerNode(PeerSettings(name, SECRET["COMMD_PEER_SECRET"].encode(), 0.2, 1.0),
                              lambda link, msg, _payload: self.received.append((link.name, msg)),
                              lambda link, _reason: self.lost.append(link.name))

    def _call(self, coro: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(10)

    def listen(self) -> str:
        """Take links dialed to us (`accepted`); our address."""
        self.accepted: list[Any] = []

        def adopt(link: Any) -> None:
            self.accepted.append(link)
            self._links.append(link)

        return f"127.0.0.1:{self._call(self._node.listen('127.0.0.1', 0, adopt))}"

    def got(self, kind: type, **fields: object) -> bool:
        return any(isinstance(m, kind) and all(getattr(m, k) == v for k, v in fields.items())
                   for _, m in self.received)

    def dial(self, daemon: DaemonProcess) -> Any:
        link = self._call(self._node.dial(*parse_address(daemon.peer_address())))
        self._links.append(link)
        return link

    def send(self, link: Any, msg: p.PeerMessage, payload: bytes | memoryview = b"") -> None:
        self.send_burst(link, [(msg, payload)])

    def send_burst(self, link: Any, frames: list[tuple[p.PeerMessage, bytes | memoryview]]) -> None:
        """`frames` written at once, as a flood from one daemon comes."""
        async def send() -> None:
            for msg, payload in frames:
                link.send(msg, payload)
            await link.drain()

        self._call(send())

    def send_map(self, link: Any, raw: dict[str, Any]) -> None:
        """A frame whose header is `raw` as it is, sealed as the link seals its frames: what a
        daemon of another build may send, which no message of ours encodes to."""
        async def send() -> None:
            stream = link._stream  # (FrameStream.write takes messages of ours only)
            stream._transport.writelines(stream._seal.seal(msgpack.packb(raw, use_bin_type=True), b""))
            await link.drain()

        self._call(send())

    def close(self) -> None:
        async def close() -> None:
            self._node.close()
            for link in self._links:
                link.close("the test is over")
            await asyncio.sleep(0)  # (the links' tasks take their cancellation)

        self._call(close())
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)


def test_a_world_made_for_a_stray_vote_still_finds_its_root_for_its_own_ranks(
        pair: list[DaemonProcess]) -> None:
    """Daemon X, told B is the root, votes there for rank 2 before any rank of the world is
    on B; then rank 1 says hello on B naming the real root, A. B must send rank 1's vote to A
    and refuse X's saying who the root is, and the world forms on A (before: B kept the world
    it made for X's vote as its own root, counted rank 1 there, and ranks 0 and 1 each timed
    out naming the other missing)."""
    a, b = pair
    world = world_name()
    stray = RawPeer("X")
    try:
        link = stray.dial(b)
        stray.send(link, p.JoinWorld(world, 3, 2, 0, 30_000, vote=5))
        wait_until(lambda: world_status(b, world) is not None, timeout=5)  # B holds X's vote
        with ThreadPoolExecutor(3) as threads:
            joining = [threads.submit(DaemonBackend, str(d.socket_path), world, r, 3, timeout=4,
                                      bootstrap=a.peer_address()) for r, d in enumerate([a, b, a])]
            comms = [j.result(20) for j in joining]
        try:
            assert [c.epoch for c in comms] == [1, 1, 1]
            assert summed_i32(comms) == [[6, 60]] * 3
        finally:
            for comm in comms:
                comm.close()
        wait_until(lambda: any(isinstance(m, p.JoinRefused) for _, m in stray.received), timeout=5)
        (refusal,) = [m for _, m in stray.received if isinstance(m, p.JoinRefused)]
        assert refusal.rank == 2 and refusal.code == ErrorCode.WORLD_CONFLICT
        assert refusal.vote == 5  # (X's id for the vote, which X holds it by)
        assert f"its root is the daemon at {a.peer_address()}" in refusal.message
    finally:
        stray.close()



def joining_process(daemon: DaemonProcess, world: str, rank: int, world_size: int,
                    bootstrap: str) -> subprocess.Popen[bytes]:
    """A worker process that says hello (8 s timeout), then holds its rank for a minute;
    what it raises, it prints (type and message) on its stdout."""
    code = (f"from client import DaemonBackend\nimport time\ntry:\n    DaemonBackend("
            f"{str(daemon.socket_path)!r}, {world!r}, {rank}, {world_size}, timeout=8, "
            f"bootstrap={bootstrap!r})\n    time.sleep(60)\nexcept Exception as exc:\n"
            "    print(type(exc).__name__, exc)\n")
    return subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE,
                            cwd=str(Path(__file__).resolve().parents[2]))


def test_a_world_ready_a_member_cannot_take_is_answered_with_its_failure(pair: list[DaemonProcess]) -> None:
    """The root (a raw peer, R) formed the world with rank 1 on B; crossing its WorldReady,
    rank 1's process left B and a new one said hello there naming R by another address, so
    B's new world reaches R over another link. The WorldReady, on the old link, is not for
    that world: B must say the world cannot run there, as it does when it holds no world of
    the name (before: B dropped it with a warning, and R's ranks, told the world was ready,
    waited on rank 1 until their calls timed out)."""
    b = pair[1]
    world, root = world_name(), RawPeer("R")
    try:
        address = root.listen()
        alias = address.replace("127.0.0.1", "localhost")

        def rank_1_on_b(bootstrap: str) -> subprocess.Popen[bytes]:
            return joining_process(b, world, 1, 2, bootstrap)

        first = rank_1_on_b(address)
        second = None
        try:
            wait_until(lambda: root.got(p.JoinWorld, rank=1), timeout=20)
            first.kill()
            first.wait(10)
            wait_until(lambda: root.got(p.JoinWithdrawn, rank=1), timeout=10)
            second = rank_1_on_b(alias)
            votes = lambda: [m for _, m in root.received if isinstance(m, p.JoinWorld)]  # noqa: E731
            wait_until(lambda: len(root.accepted) == 2 and len(votes()) == 2, timeout=20)  # over the alias
            old = root.accepted[0]
            root.send(old, p.WorldReady(world, 1, ("R", "B")))
            wait_until(lambda: root.got(p.WorldFailed, world=world, epoch=1), timeout=5)
        finally:
            for proc in [first, *([second] if second is not None else [])]:
                proc.kill()
                proc.wait(10)
    finally:
        root.close()



class _MovedAway:
    """A 3-rank world: rank 0 on a raw root R; ranks 1 and 2 on B, each a RawClient (`r1`,
    `r2`). Both vote to rebuild, and R forms epoch 2 with rank 1 on daemon X: B's rank 1
    is refused, rank 2 goes on. `hello` says hello on B for a rank as they did."""

    def __init__(self, b: DaemonProcess, world: str, root: RawPeer, clients: list[RawClient]) -> None:
        self.b, self.world, self.root, self.clients = b, world, root, clients
        self.address = root.listen()
        self.r1, self.r2 = self.client(), self.client()
        self.hello(self.r1, 1)
        self.hello(self.r2, 2)
        wait_until(lambda: root.got(p.JoinWorld, rank=1) and root.got(p.JoinWorld, rank=2), timeout=10)
        (self.link,) = root.accepted
        root.send(self.link, p.WorldReady(world, 1, ("R", "B", "B")))
        assert isinstance(self.r1.recv(), proto.Welcome) and isinstance(self.r2.recv(), proto.Welcome)
        self.r1.send(proto.Reconnect(2))
        for client in (self.r1, self.r2):
            failed = client.recv()  # (rank 1's vote fails epoch 1)
            assert isinstance(failed, proto.Event) and failed.epoch == 1, failed
        self.r2.send(proto.Reconnect(2))
        wait_until(lambda: root.got(p.JoinWorld, rank=1, epoch=1) and root.got(p.JoinWorld, rank=2, epoch=1),
                   timeout=10)
        root.send(self.link, p.WorldReady(world, 2, ("R", "X", "B")))
        lost = self.r1.error()
        assert lost.code is ErrorCode.DUPLICATE_RANK and "is on daemon X" in lost.message, lost
        assert self.r2.recv() == proto.Ok(2, value=2)

    def client(self) -> RawClient:
        self.clients.append(RawClient(str(self.b.socket_path), 10))
        return self.clients[-1]

    def hello(self, client: RawClient, rank: int) -> None:
        client.send(proto.Hello(1, proto.PROTOCOL_VERSION, os.getpid(), self.world, rank, 3, 8000,
                                bootstrap=self.address))


@contextlib.contextmanager
def moved_away(b: DaemonProcess) -> Iterator[_MovedAway]:
    root, clients = RawPeer("R"), []
    try:
        yield _MovedAway(b, world_name(), root, clients)
    finally:
        for client in clients:
            client.close()
        root.close()


def test_a_rank_whose_rebuild_placed_it_on_another_daemon_no_longer_fails_the_world(
        pair: list[DaemonProcess]) -> None:
    """Ranks 1 and 2 of a 3-rank world are on B, rank 0 on a raw root R. Both vote to rebuild;
    R, which took another process's vote for rank 1 first, forms epoch 2 with rank 1 on
    daemon X. B's rank 1 is refused, and when that process ends, B's world, where rank 2
    runs, must go on. Before: B kept the refused connection as rank 1; its end failed the
    healthy epoch 2 ("rank 1's connection was lost"), on B and, through R, everywhere; its
    calls and votes were taken too."""
    b = pair[1]
    with moved_away(b) as moved:
        world, r1, r2, root = moved.world, moved.r1, moved.r2, moved.root
        sock = str(b.socket_path)
        assert (world_status(b, world) or {}).get("ranks") == [2]
        # what the process that lost rank 1 may still send is refused, and fails nothing
        for request in (proto.Submit(3, (proto.Barrier(),)), proto.Reconnect(4)):
            r1.send(request)
            refused = r1.error()
            assert refused.code is ErrorCode.DUPLICATE_RANK and "is on daemon X" in refused.message, refused
        r1.close()  # then it ends
        wait_until(lambda: query_status(sock, 5)["connections"] == 2, timeout=10)  # (r2 and the query)
        status = world_status(b, world) or {}
        assert (status.get("state"), status.get("epoch"), status.get("cause")) == ("ready", 2, None), status
        assert not root.got(p.WorldFailed, epoch=2)
        r2.sock.settimeout(0.3)
        with pytest.raises(TimeoutError):  # rank 2 heard of no failure
            r2.recv()


def test_a_rank_placed_on_another_daemon_cannot_vote_once_its_old_world_ended_there(
        pair: list[DaemonProcess]) -> None:
    """As above, R forms epoch 2 with rank 1 on daemon X, and B's rank 1 is refused. Then
    rank 2 leaves B, whose world ends and is forgotten there; the process that lost rank 1
    calls attempt_reconnect again on its old connection. It must be refused as before
    (rank 1 is on X). Before: the connection still held the forgotten world, and its vote
    went to R from a world B no longer knew; R's WorldReady was answered 'ranks ... left
    before it formed', failing the world, and the rank waited out its timeout."""
    b = pair[1]
    with moved_away(b) as moved:
        world, r1, root = moved.world, moved.r1, moved.root
        moved.r2.close()  # B's last rank of the world leaves: B forgets it
        wait_until(lambda: world_status(b, world) is None, timeout=10)
        r1.sock.settimeout(3)
        r1.send(proto.Reconnect(3))
        refused = r1.error()
        assert refused.id == 3 and refused.code is ErrorCode.DUPLICATE_RANK, refused
        assert "is on daemon X" in refused.message, refused
        assert world_status(b, world) is None  # no world made anew for it on B
        assert not root.got(p.JoinWorld, rank=1, epoch=2)  # and no vote reached the root


def test_a_rank_placed_on_another_daemon_cannot_call_as_the_connection_that_took_it_back(
        pair: list[DaemonProcess]) -> None:
    """R forms epoch 2 with rank 1 on daemon X, and B's rank 1 is refused; then epoch 2 fails
    and a new process takes rank 1 on B again (epoch 3). The refused connection's calls must
    be refused: rank 1 is the new connection's. Before: B took them as rank 1's calls and
    answered them on the new connection, which never made them (its world's failure there
    gave it an error for a request id it never used), and the refused one heard nothing;
    its set_add_kernel was taken as rank 1's too."""
    b = pair[1]
    with moved_away(b) as moved:
        world, r1, r2, root, link = moved.world, moved.r1, moved.r2, moved.root, moved.link
        root.send(link, p.WorldFailed(world, 2, ErrorCode.WORLD_FAILED, "X was lost"))
        assert isinstance(r2.recv(), proto.Event)
        new1 = moved.client()
        moved.hello(new1, 1)  # rank 1 comes back to B
        r2.send(proto.Reconnect(3))
        wait_until(lambda: root.got(p.JoinWorld, rank=1, epoch=2) and root.got(p.JoinWorld, rank=2, epoch=2),
                   timeout=10)
        root.send(link, p.WorldReady(world, 3, ("R", "B", "B")))
        assert isinstance(new1.recv(), proto.Welcome) and r2.recv() == proto.Ok(3, value=3)
        r1.sock.settimeout(3)
        r1.send(proto.Submit(7, (proto.Barrier(),)))
        refused = r1.error()
        assert refused.id == 7 and refused.code is ErrorCode.DUPLICATE_RANK, refused
        assert "not this connection's" in refused.message, refused
        r1.send(proto.SetAddKernel(8, 77))  # (nor may it choose how the rank's sums run)
        refused = r1.error()
        assert refused.id == 8 and refused.code is ErrorCode.DUPLICATE_RANK, refused
        status = world_status(b, world) or {}
        assert (status.get("pending_calls"), status.get("add_kernel")) == (0, {}), status
        root.send(link, p.WorldFailed(world, 3, ErrorCode.WORLD_FAILED, "R's rank 0 was lost"))
        for client in (new1, r2):  # each hears of the failure, and of no call it did not make
            event = client.recv()
            assert isinstance(event, proto.Event) and event.epoch == 3, event
            client.sock.settimeout(0.3)
            with pytest.raises(TimeoutError):
                client.recv()


def test_votes_over_a_link_the_member_moved_off_are_not_counted(pair: list[DaemonProcess]) -> None:
    """Daemon X (a raw peer) voted for rank 1 over link L1, then for rank 2 over a new link L2:
    a member reaches the root over one link per world, so it has moved off L1 (lost on its
    side, rank 1 refused there, its withdrawal unsendable), though the root has not seen L1
    end (half-open). The root must not count rank 1's vote (it counts it lost with its link
    instead, peers.votes_lost_with_links): rank 0 times out naming rank 1 (before: the world
    formed, rank 0 was told it was ready, and X got a WorldReady placing on it a rank it had
    let go, which a real daemon answers by failing the world)."""
    a = pair[0]
    world, x = world_name(), RawPeer("X")
    try:
        old, new = x.dial(a), x.dial(a)
        x.send(old, p.JoinWorld(world, 3, 1, 0, 30_000))
        wait_until(lambda: world_status(a, world) is not None, timeout=5)  # rank 1's vote is in
        x.send(new, p.JoinWorld(world, 3, 2, 0, 30_000))
        with pytest.raises(CommTimeout, match=r"ranks \[1\] did not arrive"):
            DaemonBackend(str(a.socket_path), world, 0, 3, timeout=1.5, bootstrap=a.peer_address())
        assert not x.got(p.WorldReady)
        assert votes_lost(a) == 1  # (rank 1's, dropped as X moved to L2; not again as L1 ends)
    finally:
        x.close()


def test_a_refusal_crossing_a_withdrawal_leaves_the_ranks_next_vote_alone(pair: list[DaemonProcess]) -> None:
    """The root (a raw peer, R) refused rank 1's vote from B just as rank 1's process left B:
    the refusal crossed the withdrawal, and a new process for rank 1 voted again. The
    refusal names the first vote, so it must not refuse the second, which stays until R
    refuses it by its own id (before: the stale refusal failed the new process's hello)."""
    b = pair[1]
    world, root = world_name(), RawPeer("R")
    processes: list[subprocess.Popen[bytes]] = []
    try:
        address = root.listen()
        votes = lambda: [m for _, m in root.received if isinstance(m, p.JoinWorld)]  # noqa: E731
        processes.append(joining_process(b, world, 1, 2, address))
        wait_until(lambda: len(votes()) == 1, timeout=20)
        processes[0].kill()
        processes[0].wait(10)
        wait_until(lambda: root.got(p.JoinWithdrawn, rank=1), timeout=10)
        processes.append(joining_process(b, world, 1, 2, address))
        wait_until(lambda: len(votes()) == 2, timeout=20)
        first, second = votes()
        assert first.vote != second.vote
        (link,) = root.accepted
        root.send(link, p.JoinRefused(world, 1, ErrorCode.TIMEOUT, "the first vote's refusal", first.vote))
        root.send(link, p.JoinRefused(world, 1, ErrorCode.TIMEOUT, "the second vote's refusal", second.vote))
        out, _ = processes[1].communicate(timeout=20)
        assert out.decode().strip() == "CommTimeout the second vote's refusal"
    finally:
        for proc in processes:
            proc.kill()
            proc.wait(10)
        root.close()


@pytest.mark.parametrize("placement", [("R",), ("B", "B"), ("R", "B", "B")],
                         ids=["too few ranks", "rank 0 not on the root", "too many ranks"])
def test_a_world_ready_that_does_not_fit_the_world_is_refused(pair: list[DaemonProcess],
                                                               placement: tuple[str, ...]) -> None:
    """The root (a raw peer, R) says the 2-rank world with rank 1 on B formed, with a
    placement that cannot be: of another length, or without rank 0 on R. B must refuse it,
    telling R and its rank why (before: B took it, and looked ranks up in it)."""
    b = pair[1]
    world, root = world_name(), RawPeer("R")
    try:
        address = root.listen()
        rank_1 = joining_process(b, world, 1, 2, address)
        try:
            wait_until(lambda: root.got(p.JoinWorld, rank=1), timeout=20)
            (link,) = root.accepted
            root.send(link, p.WorldReady(world, 1, placement))
            out, _ = rank_1.communicate(timeout=20)
        finally:
            rank_1.kill()
            rank_1.wait(10)
        assert out.decode().startswith(f"WorldFailed world {world} of 2 ranks cannot form as the root "
                                       "daemon R says: it places "), out
        wait_until(lambda: root.got(p.WorldFailed, world=world, epoch=1), timeout=5)
        assert world_status(b, world) is None  # (nothing of it left on B)
    finally:
        root.close()


def test_a_flood_of_stale_messages_logs_one_line_a_second_and_counts_every_one() -> None:
    """A daemon holding the secret sends stale messages without end (confused, or hostile):
    each is refused and counted, but the log takes one line a second, the next saying how
    many were left out (before: a line each, 41 here)."""
    tmp = short_tmpdir()
    log_path = Path(tmp) / "daemon.log"
    x = RawPeer("X")
    try:
        with open(log_path, "wb") as log, DaemonProcess(
                Path(tmp) / "A" / "commd.sock", env=SECRET, log=log,
                args=["--peer-listen", "127.0.0.1:0", "--peer-name", "A", *FAST]) as a:
            world = world_name()
            with DaemonBackend(str(a.socket_path), world, 0, 1, timeout=10,
                               bootstrap=a.peer_address()) as comm:
                assert comm.epoch == 1
                link = x.dial(a)
                for _ in range(40):
                    x.send(link, p.WorldFailed(world, 0, ErrorCode.WORLD_FAILED, "old news"))
                time.sleep(1.1)  # (past the interval: the next one is logged, with the count)
                x.send(link, p.WorldFailed(world, 0, ErrorCode.WORLD_FAILED, "old news"))
                wait_until(lambda: query_status(str(a.socket_path), 5)["peers"]["stale_refused"] == 41)
                assert comm.is_healthy()
        lines = [line for line in log_path.read_text().splitlines() if "refused a message of world" in line]
        left_out = [int(m.group(1)) for line in lines
                    if (m := re.search(r"\((\d+) more like it since the last such line", line))]
        assert 2 <= len(lines) < 10 and len(lines) + sum(left_out) == 41, lines
    finally:
        x.close()
        shutil.rmtree(tmp, ignore_errors=True)


def test_a_world_ready_for_a_world_running_here_fails_it_and_its_calls(pair: list[DaemonProcess]) -> None:
    """The root (a raw peer, R) formed the world at epoch 1 with rank 1 on B, and rank 1's
    barrier is under way; then R says the world formed again at epoch 2, which no rank of B
    voted for (a root that lost track, or a duplicated frame). B must refuse it, telling R,
    and fail epoch 1 so the barrier hears why (before: B formed epoch 2 over the running
    one, said rank 1 "left before it formed", and the barrier waited, unanswered, on data
    now routed to epoch 2's inbox)."""
    b = pair[1]
    world, root = world_name(), RawPeer("R")
    rank1 = RawClient(str(b.socket_path), 10)
    try:
        address = root.listen()
        rank1.send(proto.Hello(1, proto.PROTOCOL_VERSION, os.getpid(), world, 1, 2, 8000, bootstrap=address))
        wait_until(lambda: root.got(p.JoinWorld, rank=1), timeout=10)
        (link,) = root.accepted
        root.send(link, p.WorldReady(world, 1, ("R", "B")))
        assert isinstance(rank1.recv(), proto.Welcome)
        rank1.send(proto.Submit(2, (proto.Barrier(),)))
        wait_until(lambda: root.got(p.Data, world=world, epoch=1, step="up"), timeout=10)
        root.send(link, p.WorldReady(world, 2, ("R", "B")))
        why = "cannot form as the root daemon R says: daemon B's ranks run epoch 1 and voted for no other"
        replies = [rank1.recv(), rank1.recv()]  # (the failure's event, and the barrier's error)
        (event,) = [m for m in replies if isinstance(m, proto.Event)]
        (error,) = [m for m in replies if isinstance(m, proto.Error)]
        assert event.epoch == 1 and why in event.message, event
        assert error.id == 2 and error.code is ErrorCode.WORLD_FAILED and why in error.message, error
        wait_until(lambda: root.got(p.WorldFailed, world=world, epoch=2), timeout=5)
        status = world_status(b, world) or {}
        assert (status.get("state"), status.get("epoch"), status.get("pending_calls")) == ("failed", 1, 0), \
            status
    finally:
        rank1.close()
        root.close()


# The longest peer_name, each of its characters one that a quoted name escapes in 4: quoted
# whole, a refusal naming it would not fit in the 1024 characters a peer refusal may have
ESCAPED_NAME = "\x01" * p.MAX_DAEMON_NAME
# How a refusal names each: whole, or its start, clipped
SHOWN = {"A": "'A'", "B": "'B'", ESCAPED_NAME: r"'(\\x01)+.* \.\.\. \(cut\)"}


@pytest.mark.parametrize("name", ["A", ESCAPED_NAME], ids=["plain", "escaped-256"])
def test_a_daemon_with_this_daemons_name_is_refused_saying_so(name: str) -> None:
    """Daemon A2 was given A's peer_name (a copied config). Its rank 1 names A as the root:
    A must refuse A2's link at the handshake, naming the clash, and the rank hear it at once
    (before: A took A2's vote as its own daemon's, formed the world with rank 1 "here", rank
    0's first call hung until its timeout, and rank 1 timed out saying the root did not form
    the world; and with the escaped name, A's refusal did not fit a refusal's 1024 characters:
    A closed the connection without a word, and A2 dialed again until the window ended, the
    rank told 'too many handshakes under way?'); A keeps serving its other worlds."""
    tmp = short_tmpdir()
    try:
        a, a2 = (DaemonProcess(Path(tmp) / sock / "commd.sock", env=SECRET, args=[
            "--peer-listen", "127.0.0.1:0", "--peer-name", name, *FAST]) for sock in ("A", "A2"))
        with started_together(a, a2), ThreadPoolExecutor(1) as threads:
            world = world_name()
            rank0 = threads.submit(DaemonBackend, str(a.socket_path), world, 0, 2, timeout=3,
                                   bootstrap=a.peer_address())
            started = time.monotonic()
            with pytest.raises(PeerLost, match=rf"cannot reach the daemon at .*: daemon name {SHOWN[name]} "
                                               r"is this daemon's own: each daemon needs a peer_name of its "
                                               r"own"):
                DaemonBackend(str(a2.socket_path), world, 1, 2, timeout=3, bootstrap=a.peer_address())
            assert time.monotonic() - started < 2  # (not its timeout)
            with pytest.raises(CommTimeout, match=r"ranks \[1\] did not arrive"):
                rank0.result(20)
            assert query_status(str(a.socket_path), 5)["peers"]["links"] == []
            a_new_world_sums([a, a], a)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


@contextlib.contextmanager
def beside_a_namesake(fast: bool, first: Sequence[str] = (),
                      b: str = "B") -> Iterator[tuple[DaemonProcess, DaemonProcess]]:
    """Daemons A, B1 and B2, B1 and B2 both given the peer_name `b` (a copied config), B1 with
    `first` too: world x runs on A (root) and B1, summed right before the body and after it
    (which B2's ranks must not disturb). Yields A and B2."""
    tmp = short_tmpdir()
    try:
        common = FAST if fast else []
        a, b1, b2 = (DaemonProcess(Path(tmp) / sock / "commd.sock", env=SECRET, args=[
            "--peer-listen", "127.0.0.1:0", "--peer-name", name, *common, *extra])
            for sock, name, extra in (("A", "A", ()), ("B1", b, first), ("B2", b, ())))
        with started_together(a, b1, b2):
            comms = joined([a, b1], a, world_name())
            try:
                assert summed_i32(comms) == [[3, 30], [3, 30]]
                yield a, b2
                assert all(c.is_healthy() for c in comms)
                assert summed_i32(comms) == [[3, 30], [3, 30]]
            finally:
                for comm in comms:
                    comm.close()
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def test_a_second_running_daemon_of_one_name_is_refused_and_the_first_serves_on() -> None:
    """B2's rank joins world y rooted on A: A must refuse B2's link while B1 speaks, naming
    the clash, and world x go on (before: A took B2's link for B restarted, closed B1's
    links, and world x failed, 'replaced: the daemon runs as a new process'; and with the
    escaped name, A's refusal did not fit a refusal's 1024 characters: A closed without a word,
    and the rank heard 'cannot reach the daemon at ...: closed by the peer'). The escaped,
    longest name takes both paths; a plain name's refusal ('B', shown whole) is the
    beats-slower test's below."""
    with beside_a_namesake(fast=True, b=ESCAPED_NAME) as (a, b2), ThreadPoolExecutor(1) as threads:
        world = world_name()
        rank0 = threads.submit(DaemonBackend, str(a.socket_path), world, 0, 2, timeout=3,
                               bootstrap=a.peer_address())
        started = time.monotonic()
        with pytest.raises(PeerLost, match=rf"daemon name {SHOWN[ESCAPED_NAME]} is taken: another "
                                           r"process of that name is linked to daemon A \(heard"):
            DaemonBackend(str(b2.socket_path), world, 1, 2, timeout=3, bootstrap=a.peer_address())
        assert time.monotonic() - started < 1  # (at once: not dialed again over a window)
        with pytest.raises(CommTimeout, match=r"ranks \[1\] did not arrive"):
            rank0.result(20)


def test_a_daemon_dialing_a_second_of_one_name_refuses_it_saying_so() -> None:
    """Rank 1 on A joins world y rooted on B2 while B1, of the same (escaped, longest) name,
    speaks to A: A, the dialer, must refuse B2's challenge naming the clash, and world x go on
    (before: A's refusal did not fit a refusal's 1024 characters, and the rank heard that B2
    'does not speak the peer protocol: a reason is at most 1024 characters')."""
    with beside_a_namesake(fast=True, b=ESCAPED_NAME) as (a, b2), ThreadPoolExecutor(1) as threads:
        world = world_name()
        rank0 = threads.submit(DaemonBackend, str(b2.socket_path), world, 0, 2, timeout=3,
                               bootstrap=b2.peer_address())
        with pytest.raises(PeerLost, match=rf"daemon name {SHOWN[ESCAPED_NAME]} is taken: another "
                                           r"process of that name is linked to daemon A \(heard"):
            DaemonBackend(str(a.socket_path), world, 1, 2, timeout=3, bootstrap=b2.peer_address())
        with pytest.raises(CommTimeout, match=r"ranks \[1\] did not arrive"):
            rank0.result(20)


def test_a_second_daemon_of_one_name_is_refused_while_the_first_beats_slower() -> None:
    """As above, but B1 runs with --peer-heartbeat 2 (its own setting; A's is 0.5 s): B2's
    rank must be refused each time, however long since B1's last beat, and world x go on
    (before: A refused only while B1 was heard within two of A's heartbeats, 1 s; in B1's
    silences between beats B2's link was taken for B restarted, and world x failed)."""
    with beside_a_namesake(fast=False, first=["--peer-heartbeat", "2", "--peer-window", "12"]) as (a, b2):
        for _ in range(7):  # (over one of B1's beats and more)
            with pytest.raises(PeerLost, match=r"daemon name 'B' is taken"):
                DaemonBackend(str(b2.socket_path), world_name(), 1, 2, timeout=1,
                              bootstrap=a.peer_address())
            time.sleep(0.4)


def test_silent_connections_from_one_host_do_not_lock_other_daemons_out() -> None:
    """Someone on another host (127.0.0.2 here) who holds no secret keeps hundreds of
    connections to A's peer port open, saying nothing: each is cut at the handshake timeout
    (5 s here), and more come. A and B must still link and form a world (before: every
    handshake slot was the flood's; A's own dial to its bootstrap address was cut, or B's,
    and the ranks heard PeerLost 'closed by the peer')."""
    tmp = short_tmpdir()
    stop = threading.Event()

    def flood(host: str, port: int) -> None:
        held: list[socket.socket] = []
        try:
            while not stop.is_set():
                with contextlib.suppress(OSError):
                    held.append(socket.create_connection((host, port), timeout=1,
                                                         source_address=("127.0.0.2", 0)))
                if len(held) > 400:
                    held.pop(0).close()
                time.sleep(0.001)
        finally:
            for sock in held:
                sock.close()

    try:
        a, b = (DaemonProcess(Path(tmp) / name / "commd.sock", env=SECRET, args=[
            "--peer-listen", "127.0.0.1:0", "--peer-name", name, "--peer-window", "5"]) for name in "AB")
        with started_together(a, b):
            flooding = threading.Thread(target=flood, args=parse_address(a.peer_address()), daemon=True)
            flooding.start()
            try:
                wait_until(lambda: query_status(str(a.socket_path), 5)["peers"]["refused_handshakes"] > 200)
                a_new_world_sums([a, b], a)
            finally:
                stop.set()
                flooding.join(10)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def test_many_daemons_behind_one_address_dialing_at_once_all_link() -> None:
    """24 daemons behind one address (a NAT; 127.0.0.1 here) dial A at once, as at a job's
    start: each must link, and A refuse none (before: past 16 handshakes under way from one
    host, the rest were refused, '16 handshakes from 127.0.0.1 are under way already', and
    their ranks heard PeerLost; 20 at once lost 4)."""
    tmp = short_tmpdir()
    names = [f"n{i:02d}" for i in range(24)]

    async def dial_all(address: str) -> tuple[list[str], list[str]]:
        """What each dial reached (or why not), and the links A lists meanwhile."""
        nodes = [PeerNode(PeerSettings(name, SECRET["COMMD_PEER_SECRET"].encode()),
                          lambda link, msg, payload: None, lambda link, reason: None) for name in names]
        links = await asyncio.gather(*(node.dial(*parse_address(address)) for node in nodes),
                                     return_exceptions=True)
        try:
            status = await asyncio.to_thread(query_status, str(a.socket_path), 5)
            return [link.name if isinstance(link, PeerLink) else str(link) for link in links], \
                status["peers"]["links"]
        finally:
            for link in links:
                if isinstance(link, PeerLink):
                    link.close("done")

    try:
        with DaemonProcess(Path(tmp) / "A" / "commd.sock", env=SECRET, args=[
                "--peer-listen", "127.0.0.1:0", "--peer-name", "A"]) as a:
            assert asyncio.run(dial_all(a.peer_address())) == (["A"] * len(names), names)
            assert query_status(str(a.socket_path), 5)["peers"]["refused_handshakes"] == 0
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


class Heard:
    """A Cluster's router that keeps what the cluster is told."""

    def __init__(self) -> None:
        self.messages: list[p.PeerMessage] = []

    def on_peer_message(self, link: PeerLink, msg: p.PeerMessage, payload: bytes | bytearray) -> None:
        self.messages.append(msg)

    def on_peer_lost(self, link: PeerLink, reason: str) -> None:
        pass


def test_a_big_job_whose_daemons_all_dial_the_root_at_once_joins_every_rank() -> None:
    """150 daemons behind one address (127.0.0.1) each link to the root A at once, as each
    member daemon of a job starting does (Cluster.link_to), and vote for their rank: every
    rank must join (before: past 64 handshakes under way, the dials past 16 from one host were
    refused and not made again: 86 of 150 failed, CallError PEER_LOST 'cannot reach the daemon
    at ...: 16 handshakes from 127.0.0.1 are under way already', and their ranks with them)."""
    tmp = short_tmpdir()
    names = [f"n{i:03d}" for i in range(150)]
    world = world_name()

    async def join_all(a: DaemonProcess) -> tuple[list[str], list[list[p.PeerMessage]]]:
        """What each member's dial reached (or why not), and what each heard after its vote."""
        members = [Cluster(PeerSettings(name, SECRET["COMMD_PEER_SECRET"].encode())) for name in names]
        heard = [Heard() for _ in members]
        for member, router in zip(members, heard, strict=True):
            member.router = router
        # Held open, saying nothing, until the dials are under way: past 64 handshakes, all
        # from this host, so the per-host cap binds for every dial, however slowly this
        # machine makes them (the dials' own overlap alone did not always reach it)
        silent = [socket.create_connection(parse_address(a.peer_address()), timeout=5) for _ in range(80)]
        asyncio.get_running_loop().call_later(0.3, lambda: [s.close() for s in silent])
        try:
            links = await asyncio.gather(*(m.link_to(a.peer_address()) for m in members),
                                         return_exceptions=True)
            reached = [link.name if isinstance(link, PeerLink) else str(link) for link in links]
            if reached != ["A"] * len(names):
                return reached, []
            for rank, link in enumerate(links, 1):
                assert isinstance(link, PeerLink)
                link.send(p.JoinWorld(world, len(names) + 1, rank, 0, 20_000, vote=rank))
            root = await asyncio.to_thread(backend, a, a, world, 0, len(names) + 1)
            try:
                await eventually(lambda: all(h.messages for h in heard), "every member's WorldReady")
                return reached, [list(h.messages) for h in heard]  # (before rank 0 leaves)
            finally:
                await asyncio.to_thread(root.close)
        finally:
            for member in members:
                member.close()

    try:
        with DaemonProcess(Path(tmp) / "A" / "commd.sock", env=SECRET, args=[
                "--peer-listen", "127.0.0.1:0", "--peer-name", "A"]) as a:
            reached, heard = asyncio.run(join_all(a))
            assert reached == ["A"] * len(names)
            assert heard == [[p.WorldReady(world, 1, ("A", *names))]] * len(names)
            # (the cap bound: those past it were turned away, then came again; beyond the
            # silent connections' own)
            assert query_status(str(a.socket_path), 5)["peers"]["refused_handshakes"] > 80
    finally:
        shutil.rmtree(tmp, ignore_errors=True)

def test_the_status_of_a_daemon_linked_to_hundreds_of_daemons_fits_one_report() -> None:
    """300 daemons with names of the longest kind (256 characters) link to A: their names
    alone are past a packet. `commd status` must still answer, the names cut to what fits
    and their count kept, with A's world asked for by name (before: DaemonInternalError
    'daemon bug: InvalidMessage("the daemon's status does not fit a report even without
    its worlds")', and A closed the connection)."""
    tmp = short_tmpdir()
    names = [f"n{i:03d}".ljust(p.MAX_DAEMON_NAME, "x") for i in range(300)]
    world = world_name()

    async def link_all(a: DaemonProcess) -> dict[str, Any]:
        members = [Cluster(PeerSettings(name, SECRET["COMMD_PEER_SECRET"].encode())) for name in names]
        for member in members:
            member.router = Heard()
        try:
            for first in range(0, len(members), 50):  # (under the daemon's handshakes at once)
                await asyncio.gather(*(m.link_to(a.peer_address()) for m in members[first:first + 50]))
            return await asyncio.to_thread(query_status, str(a.socket_path), 5, world)
        finally:
            for member in members:
                member.close()

    try:
        with DaemonProcess(Path(tmp) / "A" / "commd.sock", env=SECRET, args=[
                "--peer-listen", "127.0.0.1:0", "--peer-name", "A"]) as a, \
                RawClient(str(a.socket_path)) as rank0:
            rank0.send(proto.Hello(1, proto.PROTOCOL_VERSION, os.getpid(), world, 0, 2, 20_000,
                                   bootstrap=a.peer_address()))
            wait_until(lambda: world_status(a, world) is not None, timeout=10)
            status = asyncio.run(link_all(a))
            links = status["peers"]["links"]
            assert status["peers"]["links_total"] == len(names)
            assert 0 < len(links) < len(names) and set(links) <= set(names)
            assert [w["name"] for w in status["worlds"]] == [world]
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def test_a_vote_from_an_epoch_past_any_worlds_is_refused(pair: list[DaemonProcess]) -> None:
    """Daemon X (a raw peer) votes for rank 1 at epoch 2^64 - 2 (a confused daemon). The root
    must refuse the vote, naming the epoch, and the world form with the real rank 1 and
    rebuild as usual (before: the vote was counted, the world formed with X at epoch 2^64 - 1,
    the real rank 1 was refused as a duplicate, and every rebuild after was refused: 'epoch
    18446744073709551616 is not an unsigned 64-bit integer')."""
    a, b = pair
    world, x = world_name(), RawPeer("X")
    try:
        link = x.dial(a)
        x.send(link, p.JoinWorld(world, 2, 1, (1 << 64) - 2, 30_000, vote=7))
        wait_until(lambda: x.got(p.JoinRefused, vote=7), timeout=5)
        (refusal,) = [m for _, m in x.received if isinstance(m, p.JoinRefused)]
        assert refusal.code is ErrorCode.BAD_MESSAGE and "epoch 18446744073709551614" in refusal.message
        comms = joined([a, b], a, world)
        try:
            assert [c.epoch for c in comms] == [1, 1] and summed_i32(comms) == [[3, 30], [3, 30]]
            with ThreadPoolExecutor(2) as threads:
                for reconnect in [threads.submit(c.attempt_reconnect) for c in comms]:
                    reconnect.result(20)
            assert [c.epoch for c in comms] == [2, 2] and summed_i32(comms) == [[3, 30], [3, 30]]
        finally:
            for comm in comms:
                comm.close()
        assert not x.got(p.WorldReady)
    finally:
        x.close()


def _unused_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def peer_daemon(name: str) -> Iterator[DaemonProcess]:
    """A started daemon named `name` that peers (a silent peer is lost after 1 s), stopped
    (continued first, if a test stopped it) at the end."""
    tmp = short_tmpdir()
    proc = DaemonProcess(Path(tmp) / name / "commd.sock", env=SECRET, args=[
        "--peer-listen", "127.0.0.1:0", "--peer-name", name, *FAST])
    try:
        yield proc.start()
    finally:
        if proc.proc is not None and proc.proc.poll() is None:
            os.kill(proc.pid, signal.SIGCONT)
        proc.stop()
        shutil.rmtree(tmp, ignore_errors=True)


def root_daemon(tmp: str, address: str) -> DaemonProcess:
    """A root daemon R listening for peers at `address` (not started)."""
    return DaemonProcess(Path(tmp) / "R" / "commd.sock", env=SECRET, args=[
        "--peer-listen", address, "--peer-name", "R", *FAST])


@pytest.fixture
def root_r() -> Iterator[tuple[DaemonProcess, str]]:
    """A root daemon R and the fixed peer address it listens at, not started: the test starts,
    stops and restarts it there. Stopped, and its directory gone, after the test."""
    tmp, address = short_tmpdir(), f"127.0.0.1:{_unused_port()}"
    root = root_daemon(tmp, address)
    try:
        yield root, address
    finally:
        root.stop()
        shutil.rmtree(tmp, ignore_errors=True)


def joined_before_the_root_starts(member: DaemonProcess, late_root: DaemonProcess, world: str,
                                  member_bootstrap: str, root_bootstrap: str) -> list[DaemonBackend]:
    """Rank 1 joins on `member` while nothing listens at the root's address; then `late_root`
    starts and rank 0 joins on it: the two ranks' backends, the world formed."""
    with ThreadPoolExecutor(1) as threads:
        joining = threads.submit(DaemonBackend, str(member.socket_path), world, 1, 2, timeout=20,
                                 bootstrap=member_bootstrap)
        wait_until(lambda: world_status(member, world) is not None, "rank 1's world on the member")
        time.sleep(0.5)  # (several dials refused meanwhile)
        assert not joining.done(), joining.exception()
        late_root.start()
        first = DaemonBackend(str(late_root.socket_path), world, 0, 2, timeout=20, bootstrap=root_bootstrap)
        try:
            return [first, joining.result(20)]
        except BaseException:
            first.close()
            raise


def test_a_member_waits_for_a_root_daemon_that_starts_after_it(
        pair: list[DaemonProcess], root_r: tuple[DaemonProcess, str]) -> None:
    """Daemons of one job start in no set order: rank 1 joins on B while nothing listens at
    the root's address yet; B dials it again until the join's timeout, so once the root
    daemon R starts there and rank 0 joins on it, the world forms and sums (before: rank 1
    was refused at once, PeerLost 'cannot reach the daemon at ...: Connection refused')."""
    b = pair[1]
    world = world_name()
    late_root, address = root_r
    comms: list[DaemonBackend] = []
    try:
        comms = joined_before_the_root_starts(b, late_root, world, address, address)
        assert [c.epoch for c in comms] == [1, 1] and summed_i32(comms) == [[3, 30], [3, 30]]
    finally:
        for comm in comms:
            comm.close()


def test_a_vote_that_dialed_its_root_a_while_keeps_its_ranks_deadline(
        pair: list[DaemonProcess], root_r: tuple[DaemonProcess, str]) -> None:
    """Rank 1 (timeout 5 s) joins on B 2 s before its root starts; rank 2 never comes. Its
    vote reached the root with the time left (2-3 s, the root's start included), so the root
    refuses it at the rank's deadline, naming the missing rank (before: with the whole 5 s,
    so B's own backstop, 2 s past the deadline, fired first or with the root's refusal,
    saying only "the root daemon ... did not form it within 5s"), and the rank's whole
    timeout (before: the time left, "within 1.3s", less than the rank was given). (The vote
    must reach the root by the rank's deadline: the root's start and B's next dial, up to
    1 s after it, have 3 s; they had 1.5 s, with a 4 s timeout and the root started at
    2.5 s, and under load the rank was refused 'cannot reach the daemon ... dialed 11 times
    in 4s'.)"""
    b = pair[1]
    world = world_name()
    late_root, address = root_r
    with ThreadPoolExecutor(2) as threads:
        started = time.monotonic()
        rank_1 = threads.submit(DaemonBackend, str(b.socket_path), world, 1, 3, timeout=5,
                                bootstrap=address)
        time.sleep(2.0)
        late_root.start()
        rank_0 = threads.submit(DaemonBackend, str(late_root.socket_path), world, 0, 3, timeout=3,
                                bootstrap=address)
        with pytest.raises(CommTimeout, match=r"ranks \[2\] did not arrive within 5s"):
            rank_1.result(15)
        took = time.monotonic() - started
        with pytest.raises(CommTimeout, match=r"ranks \[2\] did not arrive within 3s"):
            rank_0.result(15)
    assert 4.5 < took < 6.0, took


def test_a_root_daemon_that_never_starts_times_the_join_out_saying_where_it_dialed(
        pair: list[DaemonProcess]) -> None:
    """Nothing ever listens at the root's address: the join fails when its timeout ends, a
    CommTimeout naming the address and how often it was dialed, and B serves on."""
    b = pair[1]
    address = f"127.0.0.1:{_unused_port()}"
    started = time.monotonic()
    with pytest.raises(CommTimeout, match=rf"cannot reach the daemon at {address}: .*Connection refused "
                                          r"\(dialed \d+ times in 1.5s; is its daemon running\?\)"):
        DaemonBackend(str(b.socket_path), world_name(), 1, 2, timeout=1.5, bootstrap=address)
    assert 1.0 < time.monotonic() - started < 5
    a_new_world_sums(pair, pair[0])


def test_a_rank_that_leaves_while_its_root_is_not_up_stops_the_dialing(
        pair: list[DaemonProcess], root_r: tuple[DaemonProcess, str]) -> None:
    """Rank 1 joins on B with nothing at the root's address, then its process goes: B must
    stop dialing for it, so the root daemon that starts there later hears no dial from B."""
    b = pair[1]
    world = world_name()
    late_root, address = root_r
    rank_1 = RawClient(str(b.socket_path))
    try:
        rank_1.send(proto.Hello(1, proto.PROTOCOL_VERSION, os.getpid(), world, 1, 2, 20_000,
                                bootstrap=address))
        wait_until(lambda: world_status(b, world) is not None, "rank 1's world on B")
        rank_1.close()
        wait_until(lambda: world_status(b, world) is None, "B forgetting the world")
        with late_root:
            time.sleep(1.5)  # (B's pauses grow to 1 s: a dial still going on would come by now)
            peers = query_status(str(late_root.socket_path), 5)["peers"]
            assert peers["links"] == [] and peers["refused_handshakes"] == 0, peers
        assert query_status(str(b.socket_path), 5)["peers"]["links"] == []
    finally:
        rank_1.close()


def test_a_new_process_for_a_rank_whose_old_one_left_while_dialing_keeps_its_own_timeout(
        pair: list[DaemonProcess], root_r: tuple[DaemonProcess, str]) -> None:
    """Ranks 1 and 2 of a world of 3 join on B with nothing at the root's address (rank 1's
    hello allows 0.6 s); rank 1's process goes and a new one takes rank 1 (20 s). The old
    vote's dialing must stop with its process: before, it went on (rank 1 waited again) and,
    at the old process's deadline, refused the new one (CommTimeout 'dialed 5 times in 0.6s')."""
    b = pair[1]
    world = world_name()
    late_root, address = root_r
    old = RawClient(str(b.socket_path))
    comms: list[DaemonBackend] = []
    try:
        with ThreadPoolExecutor(2) as threads:
            joins = {2: threads.submit(DaemonBackend, str(b.socket_path), world, 2, 3, timeout=20,
                                       bootstrap=address)}
            old.send(proto.Hello(1, proto.PROTOCOL_VERSION, os.getpid(), world, 1, 3, 600,
                                 bootstrap=address))
            old_deadline = time.monotonic() + 0.6
            wait_until(lambda: (world_status(b, world) or {}).get("waiting") == [1, 2], "ranks 1, 2 on B")
            old.close()
            wait_until(lambda: (world_status(b, world) or {}).get("waiting") == [2], "rank 1 gone")
            joins[1] = threads.submit(DaemonBackend, str(b.socket_path), world, 1, 3, timeout=20,
                                      bootstrap=address)
            wait_until(lambda: (world_status(b, world) or {}).get("waiting") == [1, 2], "rank 1 back")
            time.sleep(max(0.0, old_deadline + 0.3 - time.monotonic()))
            assert not joins[1].done(), joins[1].exception()
            late_root.start()
            comms.append(DaemonBackend(str(late_root.socket_path), world, 0, 3, timeout=20,
                                       bootstrap=address))
            comms += [joins[1].result(20), joins[2].result(20)]
        assert [c.epoch for c in comms] == [1, 1, 1]
        assert summed_i32(comms) == [[6, 60]] * 3
    finally:
        old.close()
        for comm in comms:
            comm.close()


def test_a_member_dials_a_root_not_up_for_all_of_each_ranks_timeout(pair: list[DaemonProcess]) -> None:
    """Three ranks join on B, allowing 1.5 s each, with nothing ever at the root's address:
    each is refused when its own 1.5 s are over, not before (before: B gave up as soon as the
    next pause would pass the deadline, up to a whole pause early; seen: refused after 1.39 s,
    a root coming up in the time left would not have been found), and B serves on."""
    b = pair[1]
    address, world = f"127.0.0.1:{_unused_port()}", world_name()
    ranks = [RawClient(str(b.socket_path)) for _ in range(3)]
    try:
        started = time.monotonic()
        for rank, client in enumerate(ranks, 1):
            client.send(proto.Hello(1, proto.PROTOCOL_VERSION, os.getpid(), world, rank, 4, 1500,
                                    bootstrap=address))
        for client in ranks:
            refusal = client.error()
            assert refusal.code is ErrorCode.TIMEOUT and re.fullmatch(
                rf"world {world}: cannot reach the daemon at {address}: .*Connection refused "
                r"\(dialed \d+ times in 1.5s; is its daemon running\?\)", refusal.message), refusal
            assert time.monotonic() - started > 1.49  # (a millisecond: the daemon's clock ticks in them)
    finally:
        for client in ranks:
            client.close()
    a_new_world_sums(pair, pair[0])


def hosts_where(tmp: str, name: str, addresses: Sequence[str]) -> list[str]:
    """A command that runs the rest in a mount namespace whose /etc/hosts resolves `name` to
    `addresses` (and all else as here); the test is skipped where none can be made."""
    hosts = Path(tmp) / "hosts"
    hosts.write_text(Path("/etc/hosts").read_text() + "".join(f"\n{a} {name}" for a in addresses) + "\n")
    under = ["unshare", "--mount", "sh", "-c", 'mount --bind "$0" /etc/hosts && exec "$@"', str(hosts)]
    try:
        made = subprocess.run([*under, "getent", "ahosts", name], capture_output=True, text=True, timeout=10)
    except OSError:
        made = None
    if made is None or made.returncode != 0 or not all(a in made.stdout for a in addresses):
        pytest.skip(f"no mount namespace with its own /etc/hosts here ({made and made.stderr.strip()})")
    return under


def test_a_member_waits_for_a_root_whose_name_has_an_address_that_fails_otherwise() -> None:
    """The root's name resolves to two addresses: 127.0.0.1, where its daemon starts late,
    and one no connection can go to (network unreachable). While the root is not up, the
    loop's error for the name is a plain OSError ('Multiple exceptions: ... Connection
    refused, ... Network is unreachable'), since its addresses failed in two ways: the member
    must dial again all the same (before: rank 1 was refused at once, PeerLost), and the
    world forms once the root is up."""
    tmp = short_tmpdir()
    port = _unused_port()
    under = hosts_where(tmp, "commd-root", ["255.255.255.255", "127.0.0.1"])
    member = DaemonProcess(Path(tmp) / "B" / "commd.sock", env=SECRET, under=under, args=[
        "--peer-listen", "127.0.0.1:0", "--peer-name", "B", *FAST])
    late_root = root_daemon(tmp, f"127.0.0.1:{port}")
    comms: list[DaemonBackend] = []
    try:
        member.start()
        comms = joined_before_the_root_starts(member, late_root, world_name(), f"commd-root:{port}",
                                              f"127.0.0.1:{port}")
        assert [c.epoch for c in comms] == [1, 1] and summed_i32(comms) == [[3, 30], [3, 30]]
    finally:
        for comm in comms:
            comm.close()
        late_root.stop()
        member.stop()
        shutil.rmtree(tmp, ignore_errors=True)


def test_a_member_dialing_a_root_not_up_says_so_once_a_rank_in_a_line_of_its_world(tmp_path: Path) -> None:
    """The line saying a member dials its root again is a world's, logged once for the
    rank's dialing: in JSON it carries the world and the rank, as every line about a world
    does, for a pipeline to select (before: no world, no rank)."""
    tmp, address, world = short_tmpdir(), f"127.0.0.1:{_unused_port()}", world_name()
    with (tmp_path / "member.log").open("wb") as log:
        member = DaemonProcess(Path(tmp) / "B" / "commd.sock", env=SECRET, log=log, log_level="DEBUG", args=[
            "--peer-listen", "127.0.0.1:0", "--peer-name", "B", "--log-format", "json", *FAST])
        try:
            with member, pytest.raises(CommTimeout, match="is its daemon running"):
                DaemonBackend(str(member.socket_path), world, 1, 2, timeout=0.6, bootstrap=address)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    lines = [json.loads(line) for line in (tmp_path / "member.log").read_text().splitlines()]
    dialing = [line for line in lines if "dialing again" in line["message"]]
    assert [(line["world"], line["rank"], line["level"]) for line in dialing] == [(world, 1, "INFO")], lines
    assert dialing[0]["message"] == (f"world {world}: cannot reach the daemon at {address}: [Errno 111] "
                                     "Connection refused; dialing again for up to 0.6s")


def test_ranks_of_one_world_dialing_a_root_not_up_say_so_in_one_line(tmp_path: Path) -> None:
    """Three ranks of a world on one member, its root not up: one line says the member dials
    it again (before: one a rank, as many as the node's GPUs)."""
    tmp, address, world = short_tmpdir(), f"127.0.0.1:{_unused_port()}", world_name()
    with (tmp_path / "member.log").open("wb") as log:
        member = DaemonProcess(Path(tmp) / "B" / "commd.sock", env=SECRET, log=log, log_level="DEBUG", args=[
            "--peer-listen", "127.0.0.1:0", "--peer-name", "B", "--log-format", "json", *FAST])
        try:
            with member, ThreadPoolExecutor(3) as threads:
                joins = [threads.submit(DaemonBackend, str(member.socket_path), world, rank, 4, timeout=1.0,
                                        bootstrap=address) for rank in (1, 2, 3)]
                for join in joins:
                    with pytest.raises(CommTimeout, match="is its daemon running"):
                        join.result(15)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    lines = [json.loads(line) for line in (tmp_path / "member.log").read_text().splitlines()]
    dialing = [line for line in lines if "dialing again" in line["message"]]
    assert [(line["world"], line["level"]) for line in dialing] == [(world, "INFO")], lines


def test_a_root_daemon_restarted_while_a_members_rank_reconnects_takes_its_vote_again(
        pair: list[DaemonProcess], root_r: tuple[DaemonProcess, str]) -> None:
    """A serving job: rank 1 (on B) calls attempt_reconnect; its vote is at the root daemon R
    when R is restarted (SIGTERM, as systemd's restart), and rank 0 on R reconnects to the new
    R. B must cast the vote again over a new link, dialing R until the rank's timeout as it
    does for a root not up yet, so the world forms and sums (before: rank 1's
    attempt_reconnect failed at once, PeerLost 'the root daemon R was lost: closed by the
    peer', though R was back within a second)."""
    b = pair[1]
    world = world_name()
    root, address = root_r
    root.start()
    comms: list[DaemonBackend] = []
    try:
        with ThreadPoolExecutor(2) as threads:
            joins = [threads.submit(DaemonBackend, str(d.socket_path), world, r, 2, timeout=8,
                                    bootstrap=address) for r, d in enumerate([root, b])]
            comms = [j.result(20) for j in joins]
            assert summed_i32(comms) == [[3, 30], [3, 30]]
            reconnected = threads.submit(comms[1].attempt_reconnect)
            wait_until(lambda: (world_status(root, world) or {}).get("state") == "forming",
                       "rank 1's vote at R")
            root.stop()
            root.start()
            with pytest.raises(CommError):  # (the loop's next call meets the restart)
                comms[0].barrier()
            rejoined = threads.submit(comms[0].attempt_reconnect)
            reconnected.result(20)
            rejoined.result(20)
        assert comms[0].epoch == comms[1].epoch >= 2
        assert summed_i32(comms) == [[3, 30], [3, 30]]
    finally:
        for comm in comms:
            comm.close()


def test_a_join_whose_root_stopped_and_never_came_back_says_what_became_of_its_link(
        pair: list[DaemonProcess], root_r: tuple[DaemonProcess, str]) -> None:
    """Rank 1 joins on B (timeout 3 s); its vote is at the root daemon R when R stops
    (SIGTERM) for good. B dials R until the rank's timeout, and the CommTimeout must say that
    B had a link to R and how it ended (before: only 'cannot reach the daemon at ...:
    Connection refused (dialed N times in 3s; is its daemon running?)', as for a root that
    never started), and B serves on."""
    b = pair[1]
    world = world_name()
    root, address = root_r
    root.start()
    with ThreadPoolExecutor(1) as threads:
        started = time.monotonic()
        joining = threads.submit(DaemonBackend, str(b.socket_path), world, 1, 2, timeout=3,
                                 bootstrap=address)
        wait_until(lambda: world_status(root, world) is not None, "rank 1's vote at R")
        root.stop()
        stopped = time.monotonic() - started
        with pytest.raises(CommTimeout) as timed_out:
            joining.result(15)
        took = time.monotonic() - started
    message = str(timed_out.value)
    assert re.search(rf"world {world}: cannot reach the daemon at {address}: .*Connection refused "
                     r"\(dialed \d+ times in 3s; is its daemon running\?\); the link to it "
                     r"closed (\d+\.\d)s before: daemon R left: daemon shutting down", message), message
    closed_before = float(re.findall(r"closed (\d+\.\d)s before", message)[0])
    assert 2.5 < took < 5.0, took
    # (the link closed as R stopped: its age is the rest of the rank's 3 s, give or take)
    assert abs(closed_before - (took - stopped)) < 1.0, (closed_before, took, stopped)
    a_new_world_sums(pair, pair[0])


def test_a_first_join_whose_root_restarts_meanwhile_forms_at_the_new_root(
        pair: list[DaemonProcess], root_r: tuple[DaemonProcess, str]) -> None:
    """Rank 1's first hello on B is at the root daemon R when R is restarted (SIGTERM, as
    systemd's restart); rank 0 then joins on the new R. B casts the vote again within the
    rank's timeout, the world forms, and sums right (the reconnect's case is above; this is
    a world's first forming)."""
    b = pair[1]
    world = world_name()
    root, address = root_r
    root.start()
    comms: list[DaemonBackend] = []
    try:
        with ThreadPoolExecutor(1) as threads:
            joining = threads.submit(DaemonBackend, str(b.socket_path), world, 1, 2, timeout=10,
                                     bootstrap=address)
            wait_until(lambda: world_status(root, world) is not None, "rank 1's vote at R")
            root.stop()
            root.start()
            comms.append(DaemonBackend(str(root.socket_path), world, 0, 2, timeout=10, bootstrap=address))
            comms.append(joining.result(20))
        assert summed_i32(comms) == [[3, 30], [3, 30]]
    finally:
        for comm in comms:
            comm.close()


def timed_world(daemons: list[DaemonProcess], root: DaemonProcess, world: str,
                timeout: float) -> list[DaemonBackend]:
    """One rank on each of `daemons` (in rank order), joined with call timeout `timeout`."""
    with ThreadPoolExecutor(len(daemons)) as threads:
        joins = [threads.submit(DaemonBackend, str(d.socket_path), world, r, len(daemons), timeout=timeout,
                                bootstrap=root.peer_address()) for r, d in enumerate(daemons)]
        return [j.result(20) for j in joins]


def barrier_timeouts(comms: list[DaemonBackend], first: list[int], then: list[int], world: str,
                     held_on: DaemonProcess, gap_s: float = 0.7) -> dict[int, str]:
    """Ranks `first` enter a barrier, `then` `gap_s` later (their daemon's watchdog fires that
    much after theirs), the others never (until the world failed, when they call it too):
    each rank's CommTimeout message. The first of `first` calls alone until its daemon
    `held_on` holds the call: the call a timeout names is the oldest open one, and calls
    sent together reach their daemon in no promised order."""
    said: dict[int, str] = {}
    with ThreadPoolExecutor(len(comms)) as threads:
        calls = {first[0]: threads.submit(comms[first[0]].barrier)}
        wait_until(lambda: (world_status(held_on, world) or {}).get("pending_calls") == 1,
                   f"rank {first[0]}'s call held")
        calls |= {r: threads.submit(comms[r].barrier) for r in first[1:]}
        time.sleep(gap_s)
        calls |= {r: threads.submit(comms[r].barrier) for r in then}
        for rank, call in calls.items():
            with pytest.raises(CommTimeout) as timed_out:
                call.result(20)
            said[rank] = str(timed_out.value)
    for rank in set(range(len(comms))) - set(calls):
        with pytest.raises(CommTimeout) as timed_out:
            comms[rank].barrier()
        said[rank] = str(timed_out.value)
    return said


@pytest.mark.parametrize(("first", "then", "cause"), [
    # the rank behind (3) on the member B; the root's watchdog first, asking B
    ([0, 1], [2], "rank 0's call #0 barrier() did not complete within 1.5s (each rank's newest call: "
                  "ranks [0, 1]: #0 barrier() running; rank 2: #0 barrier() pending; rank 3: no call yet)"),
    # the rank behind (1) on the root; B's watchdog first (its ranks called first), asking the root
    ([2, 3], [0], "rank 2's call #0 barrier() did not complete within 1.5s (each rank's newest call: "
                  "rank 0: #0 barrier() pending; rank 1: no call yet; ranks [2, 3]: #0 barrier() running)"),
], ids=["behind on a member", "behind on the root"])
def test_a_call_timed_out_across_daemons_names_the_rank_behind(
        pair: list[DaemonProcess], first: list[int], then: list[int], cause: str) -> None:
    """Ranks 0 and 1 on the root A, 2 and 3 on B; ranks `first` reach a barrier, then `then`,
    and the other never does. The daemon whose watchdog fires first asks the other before it
    fails the world: every rank hears which rank is behind (before: '... ranks [2, 3]: on
    daemon B, no call known here (`commd status --world W` there shows their calls)', or the
    same of daemon A, and which rank was behind took asking the other daemon)."""
    a, b = pair
    daemons, world = [a, a, b, b], world_name()
    comms = timed_world(daemons, a, world, 1.5)
    try:
        said = barrier_timeouts(comms, first, then, world, daemons[first[0]])
    finally:
        for comm in comms:
            comm.close()
    for message in said.values():
        assert cause in message, message


def test_a_member_s_call_timeout_hears_the_other_members_through_the_root(pair: list[DaemonProcess]) -> None:
    """Three daemons, a rank on each: rank 1 (on B) calls first, rank 0 (on the root A) next,
    rank 2 (on C) never. B's watchdog asks the root, which answers and passes the question
    on to C, and C's answer back to B: B's ranks' timeout names C's rank as behind, and
    groups ranks 0 and 1 (on two daemons) at the same call."""
    tmp = short_tmpdir()
    try:
        with DaemonProcess(Path(tmp) / "C" / "commd.sock", env=SECRET, args=[
                "--peer-listen", "127.0.0.1:0", "--peer-name", "C", *FAST]) as c:
            a, b = pair
            world = world_name()
            comms = timed_world([a, b, c], a, world, 1.5)
            try:
                said = barrier_timeouts(comms, [1], [0], world, b)
            finally:
                for comm in comms:
                    comm.close()
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    for message in said.values():
        assert "rank 1's call #0 barrier() did not complete within 1.5s (each rank's newest call: ranks " \
               "[0, 1]: #0 barrier() running; rank 2: no call yet)" in message, message


def test_a_call_timeout_does_not_wait_long_for_a_frozen_daemon(pair: list[DaemonProcess]) -> None:
    """The member B is frozen (SIGSTOP) as the root's watchdog asks it for its ranks' calls:
    the root fails the world 1 s later at most, saying B did not answer (not the window
    later, and not when B comes back), and names its own ranks' calls."""
    tmp = short_tmpdir()
    try:
        # (a window longer than the question's 1 s: B is not lost meanwhile)
        a, b = (DaemonProcess(Path(tmp) / name / "commd.sock", env=SECRET, args=[
            "--peer-listen", "127.0.0.1:0", "--peer-name", name, "--peer-heartbeat", "0.2",
            "--peer-window", "4"]) for name in "AB")
        with started_together(a, b):
            world = world_name()
            comms = timed_world([a, a, b, b], a, world, 1.5)
            started = time.monotonic()
            try:
                said: dict[int, str] = {}
                with ThreadPoolExecutor(3) as threads:
                    # rank 0's first, held before the others go: the call named is the oldest
                    # open one, and two calls sent together reach A in no promised order
                    calls = [threads.submit(comms[0].barrier)]
                    wait_until(lambda: (world_status(a, world) or {}).get("pending_calls") == 1,
                               "rank 0's call on A")
                    calls += [threads.submit(comms[r].barrier) for r in (1, 2)]
                    wait_until(lambda: (world_status(b, world) or {}).get("pending_calls") == 1,
                               "rank 2's call on B")
                    os.kill(b.pid, signal.SIGSTOP)
                    frozen = time.monotonic()
                    for rank, call in enumerate(calls[:2]):
                        with pytest.raises(CommTimeout) as timed_out:
                            call.result(20)
                        said[rank] = str(timed_out.value)
                    failed = time.monotonic()
                    os.kill(b.pid, signal.SIGCONT)
                    with pytest.raises(CommTimeout):  # B's rank hears of it once B is back
                        calls[2].result(20)
            finally:
                os.kill(b.pid, signal.SIGCONT)
                for comm in comms:
                    comm.close()
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    # the call timeout, a watch interval, the 1 s question, scheduling
    assert failed - started <= 1.5 + 0.25 + 1.0 + 0.75, failed - started
    assert failed - frozen < 4  # (before the window: B was not declared lost)
    for message in said.values():
        assert "rank 0's call #0 barrier() did not complete within 1.5s (each rank's newest call: ranks " \
               "[0, 1]: #0 barrier() running; ranks [2, 3]: daemon B did not answer within 1s (`commd " \
               f"status --world {world}` there shows their calls))" in message, message


@pytest.mark.timeout(120)
def test_a_call_timeout_hears_a_member_of_thousands_of_ranks_in_time() -> None:
    """Rank 0 on the root A, ranks 1-12000 on B; all but rank 12000 reach a barrier, and the
    1 s call timeout (the operator's cap) fails the world. B's answer to the root's question
    must come within the 1 s the root waits: before, B listed its ranks with no call yet
    by copying its recorded ranks once for every rank (12000 × 12000 steps, about a second
    of B's loop), so the root said 'ranks [1, 2, ...]: daemon B did not answer within 1s'
    instead of naming rank 12000, and B's own verdict was as late. (The link's window is the
    default 3 s, not FAST's 1 s: on a loaded machine B's loop, taking 12000 hellos and
    barriers, fell silent for 1.1-1.2 s, and the root lost B before its question.)"""
    size = 12001
    with contextlib.ExitStack() as stack:
        raise_nofile(stack, size + 1000)
        a, b = _two_named_daemons(stack, {"A": "A", "B": "B"}, "--max-connections", str(size + 100),
                                  "--max-call-timeout", "1", "--peer-window", "3")
        world = world_name()
        ranks: list[RawClient] = []
        for rank in range(size):
            daemon = a if rank == 0 else b
            ranks.append(stack.enter_context(contextlib.closing(dialed(str(daemon.socket_path)))))
            ranks[-1].send(proto.Hello(rank + 1, proto.PROTOCOL_VERSION, os.getpid(), world, rank, size,
                                       60_000, bootstrap=a.peer_address()))
        for rank, client in enumerate(ranks):
            assert isinstance(client.recv(), proto.Welcome), rank
        for client in ranks[:-1]:
            client.send(proto.Submit(size + 2, (proto.Barrier(),)))
        behind = f"rank {size - 1}: no call yet)"
        for rank, client in enumerate(ranks[:-1]):
            # (the call's answer and the world's failure event, in either order)
            heard = sorted([client.recv(), client.recv()], key=lambda m: type(m).__name__)
            assert [type(m) for m in heard] == [proto.Error, proto.Event], (rank, heard)
            answer, event = heard
            assert isinstance(answer, proto.Error) and answer.code is ErrorCode.TIMEOUT, (rank, answer)
            assert answer.message.endswith(f"{behind}; call attempt_reconnect on every rank"), (rank, answer)
            assert isinstance(event, proto.Event) and event.message.endswith(behind), (rank, event)
        event = ranks[-1].recv()
        assert isinstance(event, proto.Event) and event.message.endswith(behind), event


def test_a_call_the_worlds_failure_ends_names_the_world_and_what_to_do(pair: list[DaemonProcess]) -> None:
    """A worker in several worlds (tensor- and data-parallel) reads an error in its log: the
    call the failure ended must say which world failed and what to do, as a call made after
    the failure does (before, a call waiting at the moment got the bare cause: 'PeerLost:
    daemon B is shutting down', 'WorldFailed: rank 0's connection was lost'; the next call
    after a daemon's stop: 'DaemonShutdown: the daemon is shutting down')."""
    a, b = pair
    world = world_name()
    comms = joined([a, b], a, world)
    try:
        with ThreadPoolExecutor(2) as threads:
            waiting = threads.submit(comms[0].barrier)
            wait_until(lambda: (world_status(a, world) or {}).get("pending_calls") == 1)
            assert b.stop() == 0
            with pytest.raises(PeerLost) as lost:
                waiting.result(20)
            assert str(lost.value) == (f"world {world} epoch 1 failed: daemon B is shutting down; "
                                       "call attempt_reconnect on every rank")
            with pytest.raises(DaemonShutdown) as shut:
                comms[1].barrier()
            assert str(shut.value) == (f"world {world} is not healthy: the daemon is shutting down; "
                                       "call attempt_reconnect once it is back")
            b.start()
            for rejoined in [threads.submit(comm.attempt_reconnect) for comm in comms]:
                rejoined.result(30)
            waiting = threads.submit(comms[1].barrier)
            wait_until(lambda: (world_status(b, world) or {}).get("pending_calls") == 1)
            comms[0].close()
            with pytest.raises(WorldFailed) as failed:
                waiting.result(20)
            assert str(failed.value) == (f"world {world} epoch 2 failed: rank 0's connection was lost; "
                                         "call attempt_reconnect on every rank")
            with pytest.raises(WorldFailed) as again:  # the next call: the world, the advice once
                comms[1].barrier()
            said = str(again.value)
            assert said.startswith(f"world {world} ") and said.count("attempt_reconnect") == 1, said
    finally:
        for comm in comms:
            comm.close()


class AnsweringListener:
    """A peer port of anyone's making (no secret needed): it answers every dial's hello with
    `answer`, in the clear, and closes."""

    def __init__(self, answer: p.PeerMessage) -> None:
        self._frame = b"".join(pf.frame(encode_peer(answer)))
        self._server = socket.create_server(("127.0.0.1", 0))
        self._server.settimeout(0.2)
        self.address = f"127.0.0.1:{self._server.getsockname()[1]}"
        self.dials = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self._server.accept()
            except TimeoutError:
                continue
            with conn:
                self.dials += 1
                conn.settimeout(5)
                with contextlib.suppress(OSError):
                    conn.recv(4096)  # (the hello)
                    conn.sendall(self._frame)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(10)
        self._server.close()


FORGED = "x\n\x1b[31mfake log line"


@pytest.mark.parametrize("answer", [p.PeerRefused(FORGED), p.PeerBusy(FORGED)], ids=["refused", "busy"])
def test_a_listeners_refusal_reaches_the_rank_escaped(answer: p.PeerMessage) -> None:
    """A listener that holds no secret answers B's dial with a refusal (or busy, which B
    dials again for) whose reason has a line break and a terminal's escape: the rank's error
    must carry them escaped, and B's log neither them nor a line of the reason's making
    (before: the rank's PeerLost held them as they are, "...: x<LF><ESC>[31mfake log line"); B
    serves on."""
    tmp = short_tmpdir()
    log_path = Path(tmp) / "B.log"
    listener = AnsweringListener(answer)
    try:
        with open(log_path, "wb") as log, DaemonProcess(
                Path(tmp) / "B" / "commd.sock", env=SECRET, log=log, log_level="DEBUG",
                args=["--peer-listen", "127.0.0.1:0", "--peer-name", "B", *FAST]) as b:
            with pytest.raises(PeerLost) as refused:
                DaemonBackend(str(b.socket_path), world_name(), 1, 2, timeout=5, bootstrap=listener.address)
            said = f"cannot reach the daemon at {listener.address}: x\\n\\x1b[31mfake log line"
            assert said in str(refused.value), str(refused.value)
            assert "\x1b" not in str(refused.value) and "\n" not in str(refused.value)
            if isinstance(answer, p.PeerBusy):  # (dialed again until the handshake window, which
                # may end between two tries or cut one short)
                assert re.search(r"fake log line \(dialed [0-9]+ times(, no handshake)? in 1s\)$",
                                 str(refused.value)), str(refused.value)
            a_new_world_sums([b, b], b)
            text = log_path.read_text(errors="replace")
            assert "\x1b" not in text and "\nfake log line" not in text, text
            assert listener.dials >= 1
    finally:
        listener.close()
        shutil.rmtree(tmp, ignore_errors=True)


@pytest.mark.parametrize("timeout_ms", [U64_MAX, U64_MAX - 1000])
def test_a_member_rank_with_the_longest_timeout_joins(pair: list[DaemonProcess], timeout_ms: int) -> None:
    """Rank 1 joins on B with a timeout at the top of the u64 a hello takes: B's vote to the
    root carries the time left and the whole timeout in milliseconds, which must stay in the
    u64 too (before: both rounded up to 2**64 through a float, the JoinWorld was invalid, B's
    vote was lost, and the rank waited for good). The world forms on both daemons."""
    a, b = pair
    world = world_name()
    with contextlib.closing(RawClient(str(b.socket_path), 20)) as rank_1:
        rank_1.send(proto.Hello(1, proto.PROTOCOL_VERSION, os.getpid(), world, 1, 2, timeout_ms,
                                bootstrap=a.peer_address()))
        with DaemonBackend(str(a.socket_path), world, 0, 2, timeout=20, bootstrap=a.peer_address()) as rank_0:
            welcome = rank_1.recv()
            assert isinstance(welcome, proto.Welcome) and welcome.epoch == rank_0.epoch == 1, welcome


def test_a_join_timeout_across_daemons_names_a_rank_refused_before_a_later_one_arrived(
        pair: list[DaemonProcess]) -> None:
    """Of 3 ranks, rank 1 says hello on B with a 0.5 s timeout and rank 0 on the root A with
    3 s; rank 1 is refused (rank 2 not there yet), then rank 2 comes on B with 1 s. Both later
    timeouts must name rank 1, which is what the world waits for (before: the root counted a
    refused rank as arrived for the rest of the round, so ranks 2 and 0 heard 'ranks [] did
    not arrive'), as on one daemon (test_big_worlds)."""
    a, b = pair
    world, root = world_name(), a.peer_address()

    def hello(daemon: DaemonProcess, rank: int, timeout_ms: int) -> RawClient:
        client = RawClient(str(daemon.socket_path), timeout=10)
        client.send(proto.Hello(rank + 1, proto.PROTOCOL_VERSION, os.getpid(), world, rank, 3, timeout_ms,
                                bootstrap=root))
        return client

    with contextlib.ExitStack() as stack:
        first = stack.enter_context(contextlib.closing(hello(b, 1, 500)))
        wait_until(lambda: world_status(a, world) is not None, "rank 1's vote at the root")
        zero = stack.enter_context(contextlib.closing(hello(a, 0, 3000)))
        assert first.recv() == proto.Error(2, ErrorCode.TIMEOUT, f"world {world}: ranks [2] did not "
                                                                 "arrive within 0.5s")
        last = stack.enter_context(contextlib.closing(hello(b, 2, 1000)))
        assert last.recv() == proto.Error(3, ErrorCode.TIMEOUT, f"world {world}: ranks [1] did not "
                                                                "arrive within 1s")
        assert zero.recv() == proto.Error(1, ErrorCode.TIMEOUT, f"world {world}: ranks [1] did not "
                                                                "arrive within 3s")


def test_a_call_timeout_names_a_rank_that_moved_daemons_once(pair: list[DaemonProcess]) -> None:
    """Ranks 0 and 1 on the root A, rank 2 on B, pass a barrier; rank 1's process goes, and
    its new one joins on B. In the rebuilt world ranks 0 and 2 reach a barrier and rank 1
    never does: A's flight recorder still holds rank 1's calls from before the move, and
    the timeout must name rank 1 once, as B says it (before: 'rank 1: #0 barrier() done'
    from A's old records, and 'rank 1: no call yet' from B, both), and A's status must not
    show rank 1's old calls as its newest."""
    a, b = pair
    world = world_name()
    comms = timed_world([a, a, b], a, world, 1.5)
    try:
        with ThreadPoolExecutor(3) as threads:
            for done in [threads.submit(comm.barrier) for comm in comms]:
                done.result(20)
            comms[1].close()
            moved = threads.submit(DaemonBackend, str(b.socket_path), world, 1, 3, timeout=1.5,
                                   bootstrap=a.peer_address())
            for r in (0, 2):
                with contextlib.suppress(CommError):  # (told of rank 1's leaving, or not yet)
                    comms[r].barrier()
            rebuilt = [threads.submit(comms[r].attempt_reconnect) for r in (0, 2)]
            comms[1] = moved.result(20)
            for done in rebuilt:
                done.result(20)
        # (A's status no longer shows rank 1's calls from before the move as its newest)
        assert sorted(world_status(a, world)["recent_calls"]) == ["0"]  # type: ignore[index]
        said = barrier_timeouts(comms, [0], [2], world, a)
    finally:
        for comm in comms:
            comm.close()
    message = said[0]
    newest = message[message.index("each rank's newest call: "):]
    assert newest.count("rank 1:") == 1 and "rank 1: no call yet" in newest, message
