"""A daemon asked to stop (SIGTERM, SIGINT, SIGHUP) while a call is under way across two
daemons: each rank's call ends with a typed error saying why, the daemon exits 0 in a
bounded time, its socket file goes, and once it is back attempt_reconnect rebuilds.
(One daemon's stop under idle and waiting worlds: test_lifecycle.py; a member daemon's stop
under an idle world: test_multi_daemon_faults.py.)"""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
import signal
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import proto
from client import DaemonBackend, DaemonShutdown, hostmem
from commd.daemon import PEER_FAREWELL_S
from commd.launch import DaemonProcess
from commd.peering import PeerNode
from commd.peerlink import PeerSettings
from commd.status import query_status
from tests.fault.test_kill_daemon import restart, start
from tests.integration import workers
from tests.integration.data import make_input, reduce_reference
from tests.integration.harness import RankPool, last_call, short_tmpdir, wait_until, world_name, world_status
from tests.integration.rawclient import RawClient
from tests.integration.test_multi_daemon import SECRET
from tests.integration.test_multi_daemon_faults import RawPeer, _unused_port

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def tmp() -> Iterator[Path]:
    path = Path(short_tmpdir())
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.mark.parametrize(("victim", "frozen_s"), [("root", 0.3), ("member", 0.3), ("member", 3.0)])
def test_a_daemon_stopping_with_data_queued_for_its_peer_says_so_to_the_peers_ranks(
        pool: RankPool, tmp: Path, victim: str, frozen_s: float) -> None:
    """The stopping daemon's rank sends 64 MiB to a rank on the other daemon, which is slow
    to read (frozen `frozen_s`): data waits in the stopping daemon's queue for the link when
    the stop fails the world. The other daemon's rank must hear that the daemon is shutting
    down (before: the stop dropped the queue, the failure's notice with it, and reset the
    link: 'daemon A was lost: closed by the peer (reset)', as if it had died). A daemon
    that does not read for longer holds the stop up PEER_FAREWELL_S at most."""
    daemons = {"A": restart(tmp / "A" / "commd.sock", "A", _unused_port()),  # (back at its address)
               "B": start(tmp / "B" / "commd.sock", "B")}
    stopping, other = ("A", "B") if victim == "root" else ("B", "A")
    sender = "AB".index(stopping)
    world, root, go = world_name("st"), daemons["A"].peer_address(), str(tmp / "go")
    try:
        started = pool.start(workers.across_a_stop, [(f"{daemons[d].socket_path}@{root}", world, r, 2,
                                                      sender, 64 << 20, go, 5) for r, d in enumerate("AB")])
        wait_until(lambda: all(last_call(daemons[d], world, r).get("state") == "done"
                               for r, d in enumerate("AB")), "both ranks past the barrier", 30)
        proc = daemons[stopping].proc
        assert proc is not None
        os.kill(daemons[other].pid, signal.SIGSTOP)
        try:
            open(go, "w").close()
            wait_until(lambda: last_call(daemons[stopping], world, sender).get("seq") == 1,
                       "the send under way", 10)
            time.sleep(0.5)  # (what the other daemon's socket takes, and more, is queued)
            asked = time.monotonic()
            proc.send_signal(signal.SIGTERM)
            wait_until(lambda: proc.poll() is not None or time.monotonic() - asked >= frozen_s,
                       "the stop or the end of the freeze", 10)
        finally:
            os.kill(daemons[other].pid, signal.SIGCONT)
        assert proc.wait(20) == 0
        took = time.monotonic() - asked
        assert not daemons[stopping].socket_path.exists()
        port = int(root.rsplit(":", 1)[1]) if victim == "root" else 0
        daemons[stopping] = restart(tmp / stopping / "commd.sock", stopping, port)
        outcomes = [o.unwrap() for o in pool.collect(started, 60)]
    finally:
        for daemon in daemons.values():
            daemon.stop()
    assert took < min(frozen_s, PEER_FAREWELL_S) + 1.0, took
    want = reduce_reference([make_input(5, r, 64, "i32", "sum") for r in range(2)], "i32", "sum")
    for res in outcomes:
        assert res["epoch"] == 2 and res["result"] == want.tobytes(), res
    told, heard = outcomes[sender], outcomes[1 - sender]
    assert told["error"] == "DaemonShutdown", told
    assert heard["error"] == "PeerLost" and heard["received"] < 64 << 20, heard  # (not all came)
    if frozen_s < PEER_FAREWELL_S:
        assert f"daemon {stopping} is shutting down" in heard["message"], heard


def test_a_reconnect_the_stop_ends_says_the_daemon_shut_down(pool: RankPool, tmp: Path) -> None:
    """Rank 0 waits in attempt_reconnect (rank 1 left) when its daemon stops and is not back
    within the call's time: the call must say the daemon shut down (before: DaemonUnavailable
    'cannot connect to the daemon at PATH: [Errno 2] No such file or directory', the last
    of its tries to join a restarted daemon, which says nothing of the stop). Once the
    daemon is back, rank 0's attempt_reconnect and a new process for rank 1 rebuild it."""
    daemon = DaemonProcess(tmp / "commd.sock").start()
    world, noted, back = world_name("st"), str(tmp / "noted"), str(tmp / "back")
    try:
        started = pool.start(workers.reconnect_through_a_stop,
                             [(str(daemon.socket_path), world, r, 2, noted, back, 6) for r in range(2)])
        wait_until(lambda: world_state(daemon, world) == ("forming", 1), "rank 0's reconnect", 20)
        assert daemon.stop() == 0
        wait_until(lambda: os.path.exists(noted), "rank 0's reconnect to end", 30)
        daemon.start()
        open(back, "w").close()
        rank0, rank1 = [o.unwrap() for o in pool.collect(started, 30)]
    finally:
        daemon.stop()
    assert rank0["error"] == "DaemonShutdown", rank0
    assert "shut down" in rank0["message"] and str(daemon.socket_path) in rank0["message"], rank0
    assert rank0["took"] < 3 + 2 + 1.0 + 1.0, rank0  # its timeout, the join's grace, slack
    want = reduce_reference([make_input(6, r, 128, "i64", "sum") for r in range(2)], "i64", "sum")
    assert rank0["result"] == rank1["result"] == want.tobytes()


def world_state(daemon: DaemonProcess, world: str) -> tuple[object, object] | None:
    """The world's state and epoch on `daemon` (None: it has no such world)."""
    worlds = query_status(str(daemon.socket_path), 5, None)["worlds"]
    return next(((w["state"], w["epoch"]) for w in worlds if w["name"] == world), None)


def test_a_buffer_is_the_workers_once_its_call_failed_with_the_shutdown(pool: RankPool, tmp: Path) -> None:
    """The daemon stops in the middle of a 256 MiB all_reduce on its engine's threads; both
    ranks get DaemonShutdown and write their buffers at once. Nothing the daemon still did
    may reach them (before: it answered the calls first and let the jobs under way end
    after, which wrote over what the workers had written: 393,216 and 1,703,936 of rank 0's
    67,108,864 elements in two runs)."""
    for _ in range(5):
        outcomes = stopped_mid_all_reduce(pool, tmp, 256 << 20)
        if outcomes is not None:
            assert outcomes == [("DaemonShutdown", 0)] * 2
            return
    pytest.fail("the stop never landed in the middle of the all_reduce (5 tries)")


def stopped_mid_all_reduce(pool: RankPool, tmp: Path, nbytes: int) -> list[tuple[str, int]] | None:
    """What `workers.reuse_after_a_stop` says on both ranks of a fresh daemon stopped while
    their all_reduce runs; None if the stop did not land in the middle of it."""
    daemon = DaemonProcess(tmp / "commd.sock").start()
    world = world_name("st")
    try:
        started = pool.start(workers.reuse_after_a_stop,
                             [(str(daemon.socket_path), world, r, 2, nbytes) for r in range(2)])
        wait_until(lambda: last_call(daemon, world, 0).get("seq") == 1, "the all_reduce", 30)
        running = last_call(daemon, world, 0).get("state") == "running"
        assert daemon.stop() == 0
        outcomes = [o.unwrap() for o in pool.collect(started, 30)]
    finally:
        daemon.stop()
    if not running or any(name == "no error" for name, _ in outcomes):
        return None
    return [tuple(o) for o in outcomes]


def said(call: Callable[[], object]) -> str:
    """What `call` raised: it must be DaemonShutdown."""
    with pytest.raises(DaemonShutdown) as raised:
        call()
    return str(raised.value)


def test_what_a_worker_reads_when_its_daemon_stops(tmp: Path) -> None:
    """One SIGTERM meets a call waiting for its match, a join under way, and the calls and
    the attempt_reconnect made after it (the daemon not back): each names the world, says
    the daemon is shutting down (or shut down), and ends with the one thing to do (before:
    the call in flight said 'call attempt_reconnect on every rank', a second call after
    the stop 'call attempt_reconnect', the join 'the daemon is shutting down' alone)."""
    daemon = DaemonProcess(tmp / "commd.sock").start()
    sock, world, joining = str(daemon.socket_path), world_name("st"), world_name("sj")
    back = "; call attempt_reconnect once it is back"
    comms: list[DaemonBackend] = []
    try:
        with ThreadPoolExecutor(3) as threads:
            comms += [j.result(20) for j in [threads.submit(DaemonBackend, sock, world, r, 2, timeout=2)
                                             for r in range(2)]]
            waiting = threads.submit(comms[0].barrier)
            join = threads.submit(DaemonBackend, sock, joining, 0, 2, timeout=30)
            wait_until(lambda: (world_status(daemon, world) or {}).get("pending_calls") == 1
                       and world_status(daemon, joining) is not None, "the barrier and the join", 20)
            assert daemon.stop() == 0
            in_flight = f"world {world} epoch 1 failed: the daemon is shutting down{back}"
            assert said(lambda: waiting.result(20)) == in_flight
            assert said(comms[0].barrier) == in_flight  # (what it met, again)
            after = f"world {world} is not healthy: the daemon is shutting down{back}"
            assert said(comms[1].barrier) == after  # (the stop's word still unread)
            assert said(comms[1].barrier) == after
            assert said(lambda: join.result(20)) == (
                f"world {joining} is not ready: the daemon is shutting down; join again once it is back")
            gone = said(comms[1].attempt_reconnect)
            assert gone == (f"the daemon shut down, and none was back in time to rebuild world {world}: "
                            f"cannot connect to the daemon at {sock}: [Errno 2] No such file or "
                            f"directory{back}"), gone
    finally:
        for comm in comms:
            comm.close()
        daemon.stop()


def test_a_registration_or_allocation_after_the_stop_names_the_world(tmp: Path) -> None:
    """register_buffer and symmetric_alloc after the daemon's stop, before and after
    is_healthy() told of it, say what a collective says then, naming the world (before:
    "the daemon is shutting down; call attempt_reconnect once it is back", no world: a
    worker in several worlds cannot tell which one to reconnect)."""
    daemon = DaemonProcess(tmp / "commd.sock").start()
    worlds = [world_name("sr"), world_name("sa")]
    comms = [DaemonBackend(str(daemon.socket_path), w, 0, 1, timeout=2) for w in worlds]
    buf = hostmem.alloc(64)
    try:
        assert daemon.stop() == 0
        for told in (False, True):
            if told:
                assert [comm.is_healthy() for comm in comms] == [False, False]
            for comm, world, call in zip(comms, worlds, (lambda: comms[0].register_buffer(buf.ptr, 64),
                                                         lambda: comms[1].symmetric_alloc(64)), strict=True):
                assert said(call) == (f"world {world} is not healthy: the daemon is shutting down; "
                                      "call attempt_reconnect once it is back"), told
                assert said(comm.barrier).startswith(f"world {world} is not healthy: ")
    finally:
        for comm in comms:
            comm.close()
        daemon.stop()


def test_a_call_beside_a_reconnect_the_stop_answered_says_the_daemon_is_shutting_down(tmp: Path) -> None:
    """Rank 0's attempt_reconnect waits for rank 1 when the daemon stops: the stop answers it
    'shutting down', and it leaves that connection to join a daemon once one is back. A call
    made meanwhile on another thread of rank 0 must say the daemon is shutting down, and the
    rebuilt world then serve it (before: DaemonUnavailable "world W is not healthy: the
    backend was closed; call attempt_reconnect", as if the worker had closed the backend,
    read by the soak's --side thread after a failure on the main one)."""
    daemon = DaemonProcess(tmp / "commd.sock").start()
    sock, world = str(daemon.socket_path), world_name("sc")
    buf = hostmem.alloc(64)
    comms: list[DaemonBackend] = []
    try:
        with ThreadPoolExecutor(2) as threads:
            comms += [j.result(20) for j in [threads.submit(DaemonBackend, sock, world, r, 2, timeout=4)
                                             for r in range(2)]]
            comms.pop().close()
            reconnect = threads.submit(comms[0].attempt_reconnect)
            wait_until(lambda: world_state(daemon, world) == ("forming", 1), "rank 0's reconnect", 20)
            assert daemon.stop() == 0
            # (its rejoin moves the connection's number on once it has left the old one)
            wait_until(lambda: comms[0]._conn.link == 1, "rank 0's rejoin", 10)
            stopping = (f"world {world} is not ready: the daemon is shutting down; "
                        "call attempt_reconnect once it is back")
            assert said(lambda: comms[0].register_buffer(buf.ptr, 64)) == stopping
            daemon.start()
            comms.append(threads.submit(DaemonBackend, sock, world, 1, 2, timeout=4).result(20))
            reconnect.result(20)
        handle = comms[0].register_buffer(buf.ptr, 64)
        inputs = [make_input(3, r, 16, "i32", "sum") for r in range(2)]
        buf.view(np.uint8)[:] = inputs[0].view(np.uint8)
        other = hostmem.alloc(64)
        other.view(np.uint8)[:] = inputs[1].view(np.uint8)
        with ThreadPoolExecutor(2) as threads:
            calls = [threads.submit(comm.all_reduce, b.ptr, 64, dtype="i32")
                     for comm, b in zip(comms, (buf, other), strict=True)]
            for call in calls:
                call.result(20)
        want = reduce_reference(inputs, "i32", "sum").tobytes()
        assert bytes(buf.view(np.uint8)) == bytes(other.view(np.uint8)) == want
        comms[0].deregister_buffer(handle)
        other.close()
    finally:
        for comm in comms:
            comm.close()
        daemon.stop()
        buf.close()


class HeldNode(PeerNode):
    """A listener that answers a dialer's hello only once `go` is set (a root slow to answer)."""

    def __init__(self, settings: PeerSettings, handler: Any, on_lost: Any) -> None:
        super().__init__(settings, handler, on_lost)
        self.go = threading.Event()

    async def _answer(self, stream: Any) -> tuple[str, bytes, bytes]:
        while not self.go.is_set():
            await asyncio.sleep(0.01)
        return await super()._answer(stream)


def test_a_dial_that_ends_during_the_stops_farewell_makes_no_link(
        tmp: Path, caplog: pytest.LogCaptureFixture) -> None:
    """Daemon B dials the root R for a joining rank; R answers only once B's stop is under
    way, while B's farewell waits on a peer (A) that reads nothing. B must not take the link
    it dialed: R is told B is shutting down, adopts no link, and B exits 0 at the farewell's
    end (before: the handshake ended, R and B each kept a link, which B never closed: R heard
    of it only as B's process went, "closed by the peer")."""
    log_path = tmp / "B.log"
    quiet_peer, root = RawPeer("A"), RawPeer("R")
    root._node = held = HeldNode(PeerSettings("R", SECRET["COMMD_PEER_SECRET"].encode(), 0.2, 5.0),
                                 lambda link, msg, _payload: root.received.append((link.name, msg)),
                                 lambda link, _reason: root.lost.append(link.name))
    caplog.set_level(logging.WARNING, logger="commd.peering")
    b_exited = threading.Event()
    try:
        with open(log_path, "wb") as log:
            daemon = DaemonProcess(tmp / "B" / "commd.sock", env=SECRET, log=log, log_level="INFO",
                                   args=["--peer-listen", "127.0.0.1:0", "--peer-name", "B",
                                         "--peer-heartbeat", "0.2", "--peer-window", "5"]).start()
            try:
                quiet_peer.dial(daemon)
                address = root.listen()
                client = RawClient(str(daemon.socket_path), 10)
                client.send(proto.Hello(1, proto.PROTOCOL_VERSION, os.getpid(), world_name("sd"), 1, 2,
                                        8000, bootstrap=address))
                wait_until(lambda: held._handshakes, "B's dial", 10)
                # (A's loop reads nothing, ends nothing, until B has exited)
                quiet_peer._loop.call_soon_threadsafe(b_exited.wait, 10)
                stopped = time.monotonic()
                os.kill(daemon.pid, signal.SIGTERM)
                wait_until(lambda: "stopping" in log_path.read_text(errors="replace"), "B's stop", 10)
                held.go.set()
                assert daemon.proc is not None and daemon.proc.wait(10) == 0
                assert time.monotonic() - stopped < PEER_FAREWELL_S + 2.0
                b_exited.set()
                client.close()
            finally:
                daemon.stop()
        wait_until(lambda: not held._handshakes, "R's handshake to end", 10)
        assert [link.loss for link in root.accepted] == []
        said = "refused a peer from 127.0.0.1: daemon 'B' ended the handshake: daemon 'B' is shutting down"
        assert said in caplog.text, caplog.text
    finally:
        b_exited.set()
        root.close()
        quiet_peer.close()
