"""What another daemon sends a world's host-engine data path that no correct daemon would:
the world fails with a typed error naming that daemon, never with wrong data."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from client import DaemonBackend, MismatchError, WorldFailed, hostmem
from commd.engine.crosscheck import pair_of
from commd.launch import DaemonProcess
from proto import peer as p
from tests.integration.harness import short_tmpdir, wait_until, world_name, world_status
from tests.integration.test_multi_daemon import SECRET
from tests.integration.test_multi_daemon_faults import FAST, RawPeer, summed_i32

pytestmark = pytest.mark.timeout(60)


@pytest.fixture(scope="module")
def daemon() -> Iterator[DaemonProcess]:
    """One daemon with a peer port: the root of worlds whose member is a raw peer, or a
    member of worlds whose root is one."""
    tmp = short_tmpdir()
    proc = DaemonProcess(Path(tmp) / "A" / "commd.sock", env=SECRET, args=[
        "--peer-listen", "127.0.0.1:0", "--peer-name", "A", *FAST])
    try:
        yield proc.start()
    finally:
        if proc.proc is not None and proc.proc.poll() is None:
            os.kill(proc.pid, signal.SIGCONT)
        proc.stop()
        shutil.rmtree(tmp, ignore_errors=True)


@contextlib.contextmanager
def raw_member(daemon: DaemonProcess) -> Iterator[tuple[RawPeer, Any, DaemonBackend, str]]:
    """A world of 2 ranks: rank 0 on `daemon`, its root; rank 1 on a raw peer X."""
    world, x = world_name(), RawPeer("X")
    try:
        link = x.dial(daemon)
        x.send(link, p.JoinWorld(world, 2, 1, 0, 30_000, vote=1))
        comm = DaemonBackend(str(daemon.socket_path), world, 0, 2, timeout=8, bootstrap=daemon.peer_address())
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
    past the 1 GiB default of max_peer_held_bytes, and counting)."""
    junk = bytes(16 << 20)
    with raw_member(daemon) as (x, link, comm, world):
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
        assert x.got(p.WorldFailed, world=world, epoch=1)  # the member heard why
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
