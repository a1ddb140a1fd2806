"""What another daemon sends a world's host-engine data path that no correct daemon would:
the world fails with a typed error naming that daemon, never with wrong data."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import numpy as np
import pytest

from client import DaemonBackend, MismatchError, WorldFailed, hostmem
from commd.cluster import parse_address
from commd.engine.crosscheck import pair_of
from commd.engine.hostnet import CHUNK_BYTES, WINDOW_CHUNKS
from commd.launch import DaemonProcess
from commd.status import query_status
from commd.watchdog import _MIN_ASK_GAP_S
from proto import peer as p
from tests.integration.faultproxy import FaultProxy
from tests.integration.harness import wait_until, world_name, world_status
from tests.integration.test_multi_daemon_faults import RawPeer, peer_daemon, summed_i32

pytestmark = pytest.mark.timeout(60)


@pytest.fixture(scope="module")
def daemon() -> Iterator[DaemonProcess]:
    """A daemon with a peer port: the root of worlds whose member is a raw peer or daemon B,
    or a member of worlds whose root is a raw peer."""
    yield from peer_daemon("A")


@pytest.fixture
def fresh_pair() -> Iterator[tuple[DaemonProcess, DaemonProcess]]:
    """Daemons A and B that have served no call: whatever their memory rises by is new."""
    for root in peer_daemon("A"):
        for member in peer_daemon("B"):
            yield root, member


@contextlib.contextmanager
def raw_member(daemon: DaemonProcess,
               timeout: float = 8) -> Iterator[tuple[RawPeer, Any, DaemonBackend, str]]:
    """A world of 2 ranks: rank 0 on `daemon`, its root, with `timeout`; rank 1 on a raw peer X."""
    world, x = world_name(), RawPeer("X")
    try:
        link = x.dial(daemon)
        x.send(link, p.JoinWorld(world, 2, 1, 0, 30_000, vote=1))
        comm = DaemonBackend(str(daemon.socket_path), world, 0, 2, timeout=timeout,
                             bootstrap=daemon.peer_address())
        try:
            yield x, link, comm, world
        finally:
            comm.close()
    finally:
        x.close()


@contextlib.contextmanager
def raw_root(daemon: DaemonProcess) -> Iterator[tuple[RawPeer, Any, DaemonBackend, str]]:
    """A world of 2 ranks: rank 0 on a raw peer R, its root; rank 1 on `daemon`."""
    world, r = world_name(), RawPeer("R")
    try:
        address = r.listen()
        with ThreadPoolExecutor(1) as threads:
            joining = threads.submit(DaemonBackend, str(daemon.socket_path), world, 1, 2, timeout=8,
                                     bootstrap=address)
            wait_until(lambda: r.got(p.JoinWorld, world=world, rank=1), timeout=10)
            (link,) = r.accepted
            r.send(link, p.WorldReady(world, 1, ("R", "A")))
            comm = joining.result(10)
        try:
            yield r, link, comm, world
        finally:
            comm.close()
    finally:
        r.close()


def sent_up(peer: RawPeer, world: str) -> bool:
    return peer.got(p.Data, world=world, step="up")


def mine() -> Any:
    """8 bytes to send, then room for what comes (an all_gather's 16)."""
    buf = hostmem.alloc(24)
    buf.view(np.uint8)[:] = np.arange(24, dtype=np.uint8)
    return buf


def all_gather(comm: DaemonBackend, buf: Any) -> None:
    comm.all_gather(buf.ptr, buf.ptr + 8, 8)


def recv(comm: DaemonBackend, buf: Any) -> None:
    comm.recv_from(buf.ptr + 8, 8, 1)


def broadcast(comm: DaemonBackend, buf: Any) -> None:
    comm.broadcast(buf.ptr + 8, 8, 0)


# what the raw peer sends, in its role, for each call: one byte where 8 (16: the member's
# all_gather result) are due
SHORT = b"\x07"
CASES: dict[str, tuple[Callable[[DaemonBackend, Any], None], Callable[[str], p.Data]]] = {
    "root:all_gather": (all_gather, lambda w: p.Data(w, 1, "up", 0, 0, 1, "all_gather(bytes=8)", (1,))),
    "root:recv_from": (recv, lambda w: p.Data(w, 1, "p2p", 0, 0, pair_of(1, 0), "8", (0,))),
    "member:all_gather": (all_gather, lambda w: p.Data(w, 1, "down", 0, 0, 0, "all_gather(bytes=8)")),
    "member:broadcast": (broadcast, lambda w: p.Data(w, 1, "down", 0, 0, 0, "broadcast(bytes=8, root=0)")),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_chunk_of_the_wrong_size_fails_the_world(daemon: DaemonProcess, case: str) -> None:
    """A peer sends 1 byte for an 8-byte chunk. Written as it came, numpy spread the byte
    over the whole chunk: the call succeeded with the peer's part all 7s."""
    role, _ = case.split(":")
    call, frame = CASES[case]
    peer_is = "X" if role == "root" else "R"
    with (raw_member if role == "root" else raw_root)(daemon) as (peer, link, comm, world):
        buf = mine()
        with ThreadPoolExecutor(1) as threads:
            running: Future[None] = threads.submit(call, comm, buf)
            if role == "member":  # (the root answers a member that is in the call)
                wait_until(lambda: sent_up(peer, world), timeout=10)
            peer.send(link, frame(world), SHORT)
            wrong = rf"daemon {peer_is} sent 1 bytes for the (8|16)-byte chunk 0"
            with pytest.raises(MismatchError, match=wrong):
                running.result(10)
                pytest.fail(f"the call succeeded with {buf.view(np.uint8)[8:].tolist()}")
        assert comm.is_healthy() is False


def test_data_no_op_takes_is_held_up_to_a_limit_then_fails_the_world(daemon: DaemonProcess) -> None:
    """A member daemon sends 16 MiB frames for calls no rank makes. The root held them until
    the world ended, however many came, while the world stayed ready (before: 1056 MiB held,
    past the 1 GiB default of max_peer_held_bytes, and counting). (Rank 0's barrier waits
    30 s: under load the 1 GiB took X longer to send than a timeout of 8 s, which failed the
    world first, and was forgotten as rank 0 gave up; and a world failed by its timeout would
    pass for one failed by the limit.)"""
    junk = bytes(16 << 20)
    with raw_member(daemon, timeout=30) as (x, link, comm, world):
        def summary() -> tuple[object, object]:
            status = world_status(daemon, world) or {}
            return status.get("state"), status.get("peer_bytes_held")

        with ThreadPoolExecutor(1) as threads:
            waiting = threads.submit(comm.barrier)
            wait_until(lambda: (world_status(daemon, world) or {}).get("pending_calls") == 1, timeout=10)
            for call in range(1000, 1066):
                x.send(link, p.Data(world, 1, "up", call, 0, 1, "barrier()", (1,)), junk)
            wait_until(lambda: summary() == ("failed", 0), lambda: f"(state, bytes held) {summary()}",
                       timeout=10)
            limit = r"data from daemon X: .* \(max_peer_held_bytes\) of 1073741824"
            with pytest.raises(WorldFailed, match=limit):
                waiting.result(10)
        # the member heard why (its link's reader may take a moment past the rank's answer)
        wait_until(lambda: x.got(p.WorldFailed, world=world, epoch=1), timeout=5)
    # the daemon serves on
    world = world_name()
    with ThreadPoolExecutor(2) as threads:
        comms = list(threads.map(lambda r: DaemonBackend(str(daemon.socket_path), world, r, 2, timeout=8),
                                 [0, 1]))
    try:
        assert summed_i32(comms) == [[3, 30], [3, 30]]
    finally:
        for c in comms:
            c.close()


def anon_bytes(pid: int) -> int:
    """The process's private memory in use (its mappings of workers' memory are not)."""
    with open(f"/proc/{pid}/status") as status:
        line = next(line for line in status if line.startswith("RssAnon:"))
    return int(line.split()[1]) << 10


@contextlib.contextmanager
def peak_growth(pid: int) -> Iterator[list[int]]:
    """How far the process's private memory rose over its level at the start (sampled)."""
    start, peak, done = anon_bytes(pid), [0], threading.Event()

    def sample() -> None:
        while not done.wait(0.005):
            peak[0] = max(peak[0], anon_bytes(pid) - start)

    sampler = threading.Thread(target=sample)
    sampler.start()
    try:
        yield peak
    finally:
        done.set()
        sampler.join()


class Ranks:
    """One rank per backend, each with `share` bytes to send and room for the result: all
    shares (all_gather) or rank 0's (broadcast)."""

    def __init__(self, comms: list[DaemonBackend], call: str, share: int) -> None:
        self.comms, self.call, self.share = comms, call, share
        self.bufs = [hostmem.alloc((len(comms) + 1) * share) for _ in comms]

    def run(self, threads: ThreadPoolExecutor, seed: int) -> None:
        """Every rank makes the call on fresh inputs; each must get the result."""
        share, n = self.share, len(self.comms)
        inputs = [np.random.default_rng((seed, r)).integers(0, 256, share, np.uint8) for r in range(n)]
        for buf, data in zip(self.bufs, inputs, strict=True):
            buf.view(np.uint8)[:share] = data
        pairs = list(zip(self.comms, self.bufs, strict=True))
        if self.call == "broadcast":
            calls = [threads.submit(c.broadcast, b.ptr, share, 0) for c, b in pairs]
            want, got = inputs[0], [b.view(np.uint8)[:share] for b in self.bufs]
        else:
            calls = [threads.submit(c.all_gather, b.ptr, b.ptr + share, share) for c, b in pairs]
            want, got = np.concatenate(inputs), [b.view(np.uint8)[share:] for b in self.bufs]
        for running in calls:
            running.result(30)
        for rank, out in enumerate(got):
            assert np.array_equal(out, want), f"rank {rank}'s {self.call} result is wrong"


@pytest.mark.parametrize("call", ["broadcast", "all_gather"])
def test_the_root_sends_a_slow_member_its_result_a_chunk_at_a_time(
        fresh_pair: tuple[DaemonProcess, DaemonProcess], call: str) -> None:
    """The last rank's daemon reaches the root over a slow link (a proxy forwarding 64 KiB a
    millisecond). The root sealed a broadcast's or all_gather's whole 64 MiB result for each
    member in one turn of its loop and queued it: its memory held a copy of the result per
    member until the network took it (and its loop, every world's heartbeats, stood still
    while it sealed). Before: the root's private memory rose by 60-64 MiB in a broadcast,
    95 MiB in an all_gather; now 8 and 39."""
    result = 64 << 20
    # all_gather: 3 ranks on the root, 1 on the member, whose share the root gathers by design
    # (and holds a window of, as it comes)
    n, share = (2, result) if call == "broadcast" else (4, result // 4)
    allowed = (0 if call == "broadcast" else share + WINDOW_CHUNKS * CHUNK_BYTES) + (24 << 20)
    daemon, member = fresh_pair
    proxy = FaultProxy(*parse_address(daemon.peer_address()))
    try:
        proxy.delay(0.001)
        world = world_name()
        places = [(daemon, daemon.peer_address())] * (n - 1) + [(member, proxy.address)]
        with ThreadPoolExecutor(n) as threads:
            joining = [threads.submit(DaemonBackend, str(d.socket_path), world, r, n, timeout=30,
                                      bootstrap=address) for r, (d, address) in enumerate(places)]
            ranks = Ranks([j.result(30) for j in joining], call, share)
            try:
                # (the daemon's first call: what a call frees, its allocator keeps for the next)
                with peak_growth(daemon.pid) as grown:
                    ranks.run(threads, 1)
            finally:
                for comm in ranks.comms:
                    comm.close()
    finally:
        proxy.close()
    assert grown[0] <= allowed, f"the root's memory rose by {grown[0] >> 20} MiB for a 64 MiB {call}"


def test_a_member_sending_data_in_another_daemons_name_fails_the_world(daemon: DaemonProcess) -> None:
    """Daemon X (a raw peer) holds rank 1 of a world rooted on A, and sends A an "up" chunk
    in rank 0's name, which is on A: read as that rank's part, it would stand for data its
    daemon never sent. A fails the world, naming X (before: A kept the frame, for a call to
    read as another daemon's)."""
    with raw_member(daemon) as (x, link, comm, world):
        # (the rank's hello is answered as the root sends it: X may read it a moment later)
        wait_until(lambda: x.got(p.WorldReady, world=world, epoch=1), timeout=5)
        x.send(link, p.Data(world, 1, "up", 0, 0, 0, "barrier()", (0,)))
        wait_until(lambda: not comm.is_healthy(), timeout=5)
        with pytest.raises(WorldFailed, match="daemon X sent 'up' data of call 0 for rank 0, which is "
                                              "not one of its"):
            comm.barrier()


def test_a_daemon_asking_for_calls_without_pause_is_answered_once_a_moment(daemon: DaemonProcess) -> None:
    """Member X sends its root 200 CallsQuery at once. The root answered every one (and
    would pass each on to every other member: M daemons, M·(M−1) answers of O(ranks) each,
    for as long as one kept asking). A watch asks at most once a watch interval (50 ms at
    the least): the root answers the first of the burst, and the next question once a
    moment passed."""
    with raw_member(daemon) as (x, link, _comm, world):
        stale_refused = lambda: query_status(str(daemon.socket_path), 5)["peers"]["stale_refused"]  # noqa: E731
        before, started = stale_refused(), time.monotonic()
        # ended by a query of epoch 2, which the root counts as stale once it has read the burst
        x.send_burst(link, [(p.CallsQuery(world, epoch, ask, "X"), b"")
                            for epoch, ask in [*((1, ask) for ask in range(1, 201)), (2, 999)]])
        wait_until(lambda: stale_refused() == before + 1, timeout=10)
        took = time.monotonic() - started
        time.sleep(0.1)  # (past the gap since the root's last answer, which came before the count)
        x.send(link, p.CallsQuery(world, 1, 1001, "X"))
        wait_until(lambda: x.got(p.CallsReport, world=world, ask=1001), timeout=10)  # (so the burst's too)
        reports = [m for _, m in x.received if isinstance(m, p.CallsReport)]
        asks = [r.ask for r in reports]
        # at most one a gap while the root read the burst (a stall of its loop mid-burst may
        # let a second through); never the 200
        assert asks[0] == 1 and asks[-1] == 1001 and len(asks) - 1 <= 1 + took / _MIN_ASK_GAP_S, (asks, took)
        assert (reports[-1].daemon, reports[-1].asker, reports[-1].ranks, reports[-1].calls) == \
            ("A", "X", (0,), ("no call yet",))
        # X broke no rule a world fails for
        assert world_status(daemon, world)["state"] == "ready"


def test_a_member_answers_the_root_only_for_daemons_of_the_world(daemon: DaemonProcess) -> None:
    """The root R passes on to member A a CallsQuery whose asker, Q, is no daemon of the
    world: A ignores it (it would remember each such name, a hostile root's without end);
    R's own question A answers."""
    with raw_root(daemon) as (r, link, _comm, world):
        r.send(link, p.CallsQuery(world, 1, 1, "Q"))
        r.send(link, p.CallsQuery(world, 1, 2, "R"))
        wait_until(lambda: r.got(p.CallsReport, world=world, ask=2), timeout=10)
        reports = [m for _, m in r.received if isinstance(m, p.CallsReport)]
        assert [(m.ask, m.asker, m.daemon, m.ranks, m.calls) for m in reports] == \
            [(2, "R", "A", (1,), ("no call yet",))]
