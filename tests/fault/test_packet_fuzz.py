"""Ten thousand random and mutated packets at the daemon's socket, and garbage at its peer
port: only typed refusals, never a crash or a wedge; an unrelated world runs throughout."""

from __future__ import annotations

import asyncio
import os
import random
import shutil
import socket
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import proto
from client import CommError, DaemonBackend, MismatchError, WorldFailed, hostmem
from commd.cluster import parse_address
from commd.engine.crosscheck import pair_of
from commd.launch import DaemonProcess
from proto import ErrorCode
from proto import peer as p
from proto import peerframe as pf
from proto.codec import encode_peer
from tests.conftest import FaultReport, Steady, steady_world
from tests.integration.harness import back_to, held_at_rest, short_tmpdir, world_name
from tests.integration.rawclient import RawClient

pytestmark = pytest.mark.timeout(180)
PACKETS = 10_000


def valid_packets() -> list[bytes]:
    return [
        proto.encode(proto.Hello(1, proto.PROTOCOL_VERSION, 1, "fuzz", 0, 1, 1000)),
        proto.encode(proto.Submit(2, (proto.AllReduce(proto.Mem(1, 0), 8),))),
        proto.encode(proto.Import(3, 1, proto.MemKind.HOST, 4096)),
        proto.encode(proto.StatusQuery(4)),
        proto.encode(proto.Register(5, proto.Mem(1, 0), 64)),
    ]


def mutate(rng: random.Random, data: bytes) -> bytes:
    out = bytearray(data)
    for _ in range(rng.randint(1, 6)):
        kind = rng.randrange(4)
        if kind == 0 and out:
            out[rng.randrange(len(out))] = rng.getrandbits(8)
        elif kind == 1:
            out.insert(rng.randrange(len(out) + 1), rng.getrandbits(8))
        elif kind == 2 and len(out) > 1:
            del out[rng.randrange(len(out))]
        else:
            out = out[: rng.randrange(len(out) + 1)]
    return bytes(out) or b"\x00"


@pytest.fixture(scope="module")
def peer_daemon() -> Iterator[DaemonProcess]:
    tmp = short_tmpdir()
    daemon = DaemonProcess(Path(tmp) / "commd.sock", env={"COMMD_PEER_SECRET": "fuzz-secret-0123456789"},
                           args=["--peer-listen", "127.0.0.1:0", "--peer-name", "F"]).start()
    yield daemon
    assert daemon.stop() == 0
    shutil.rmtree(tmp, ignore_errors=True)


@pytest.fixture(scope="module")
def steady_f(peer_daemon: DaemonProcess) -> Iterator[Steady]:
    """An unrelated world on the fuzzed daemon, through every test of the module."""
    with steady_world([str(peer_daemon.socket_path)] * 2) as running:
        yield running


def test_ten_thousand_bad_packets(peer_daemon: DaemonProcess, steady_f: Steady,
                                  fault_report: FaultReport) -> None:
    sock = str(peer_daemon.socket_path)
    unrelated, base = steady_f.errors(), held_at_rest(peer_daemon.pid)
    rng = random.Random(20261130)
    seeds = valid_packets()
    client = RawClient(sock)
    refused = answered = 0
    for i in range(PACKETS):
        data = bytes(rng.getrandbits(8) for _ in range(rng.randint(1, 64))) if i % 3 == 0 \
            else mutate(rng, rng.choice(seeds))
        try:
            client.send_bytes(data)
            reply = client.recv()
        except OSError:
            reply = None
        if isinstance(reply, proto.Error | proto.Welcome | proto.Ok | proto.StatusReport):
            answered += 1
        if not isinstance(reply, proto.StatusReport | proto.Welcome | proto.Ok):
            refused += 1
            client.close()  # a refused connection is closed by the daemon: start a new one
            client = RawClient(sock)
    client.close()
    assert refused > PACKETS // 2 and answered > 0
    with DaemonBackend(sock, world_name(), 0, 1, timeout=5) as comm:
        comm.barrier()  # alive and serving
    fault_report.add(f"{PACKETS:,} random and mutated packets at the daemon socket", float("nan"),
                     float("nan"), steady_f.errors() - unrelated, settled(peer_daemon, base))


def test_hypothesis_packets(peer_daemon: DaemonProcess, steady_f: Steady) -> None:
    """Packets hypothesis draws (raw bytes, and valid packets with bytes changed, inserted
    or cut) each get a typed answer or none, never a crash; the daemon serves on."""
    sock = str(peer_daemon.socket_path)
    unrelated = steady_f.errors()
    seeds = valid_packets()
    edits = st.lists(st.tuples(st.integers(0, 3), st.integers(0, 1 << 16), st.integers(0, 255)), max_size=6)

    def edited(seed: bytes, changes: list[tuple[int, int, int]]) -> bytes:
        out = bytearray(seed)
        for kind, where, byte in changes:
            at = where % (len(out) + 1)
            if kind == 0 and out:
                out[at % len(out)] = byte
            elif kind == 1:
                out.insert(at, byte)
            elif kind == 2 and len(out) > 1:
                del out[at % len(out)]
            else:
                out = out[:at]
        return bytes(out) or b"\x00"

    packets = st.one_of(st.binary(min_size=1, max_size=128),
                        st.builds(edited, st.sampled_from(seeds), edits))
    conn = [RawClient(sock, timeout=0.5)]  # a Hello may wait for its world: do not wait long

    @settings(max_examples=2000, deadline=None, derandomize=True, database=None)
    @given(packet=packets)
    def one(packet: bytes) -> None:
        try:
            conn[0].send_bytes(packet)
            reply = conn[0].recv()
        except OSError:
            reply = None
        assert reply is None or isinstance(reply, proto.Error | proto.Welcome | proto.Ok | proto.StatusReport)
        if not isinstance(reply, proto.StatusReport | proto.Welcome | proto.Ok):
            conn[0].close()
            conn[0] = RawClient(sock, timeout=0.5)

    try:
        one()
    finally:
        conn[0].close()
    with DaemonBackend(sock, world_name(), 0, 1, timeout=5) as comm:
        comm.barrier()
    assert steady_f.errors() == unrelated


def settled(daemon: DaemonProcess, base: tuple[int, int]) -> str:
    """Every connection the scenario opened is gone, and so is its memory."""
    back_to(daemon.pid, base)
    return "none (fds, memfd mappings at baseline)"


def test_garbage_at_the_peer_port(peer_daemon: DaemonProcess, steady_f: Steady,
                                  fault_report: FaultReport) -> None:
    unrelated, base = steady_f.errors(), held_at_rest(peer_daemon.pid)
    host, port = parse_address(peer_daemon.peer_address())
    rng = random.Random(7)
    hello = pf.FRAME.pack(1, 0)
    good_header = encode_peer(p.PeerHello(p.PEER_VERSION, "x", os.urandom(p.NONCE_BYTES),
                                          os.urandom(p.INCARNATION_BYTES)))
    frames = [hello + b"\xc1", pf.FRAME.pack(len(good_header), 1 << 30) + good_header,
              pf.FRAME.pack(0, 0), b"GET / HTTP/1.1\r\n\r\n"]
    for i in range(300):
        data = frames[i % len(frames)] if i < len(frames) else \
            mutate(rng, pf.FRAME.pack(len(good_header), 0) + good_header)
        with socket.create_connection((host, port), timeout=5) as conn:
            try:
                conn.sendall(data)
                conn.shutdown(socket.SHUT_WR)  # all it will say: the daemon must not wait for more
            except OSError:
                continue  # refused (and closed) before we finished talking
            conn.settimeout(5)
            try:
                while conn.recv(4096):
                    pass  # a challenge or a refusal, then the daemon hangs up
            except (ConnectionResetError, TimeoutError):
                pass
    from commd.status import query_status

    peers = query_status(str(peer_daemon.socket_path), 5)["peers"]
    assert peers["refused_handshakes"] >= 250 and peers["links"] == []
    with DaemonBackend(str(peer_daemon.socket_path), world_name(), 0, 1, timeout=5) as comm:
        comm.barrier()
    fault_report.add("300 garbage and mutated handshakes at the peer port", float("nan"), float("nan"),
                     steady_f.errors() - unrelated, settled(peer_daemon, base))


def test_an_authenticated_peer_talking_nonsense(peer_daemon: DaemonProcess, steady_f: Steady,
                                                fault_report: FaultReport) -> None:
    """A daemon that holds the secret but sends random, well-formed messages about real and
    made-up worlds: the daemon refuses or ignores them and keeps its own worlds working."""
    from commd.peering import PeerNode
    from commd.peerlink import PeerSettings

    sock = str(peer_daemon.socket_path)
    unrelated = steady_f.errors()
    world = world_name("victim")
    ready = threading.Event()
    result: list[int] = []

    def victim() -> None:  # a 1-rank world on the fuzzed daemon, spread-capable (bootstrap: itself)
        with DaemonBackend(sock, world, 0, 1, timeout=10, bootstrap=peer_daemon.peer_address()) as comm:
            ready.set()
            buf = __import__("client").hostmem.alloc(8)
            for _ in range(200):
                comm.all_reduce(buf.ptr, 8, dtype="u8", op="max")
            result.append(comm.epoch)

    rng = random.Random(99)
    worlds = [world, "ghost", "w" * 128]

    def nonsense() -> p.PeerMessage:
        name = rng.choice(worlds)
        kind = rng.randrange(6)
        if kind == 0:
            return p.JoinWorld(name, rng.randint(1, 8), 0, rng.randint(0, 3), rng.randint(1, 500))
        if kind == 1:
            placement = tuple(rng.choice(["F", "x", "y"]) for _ in range(rng.randint(1, 4)))
            return p.WorldReady(name, rng.randint(0, 5), placement)
        if kind == 2:
            return p.WorldFailed(name, rng.randint(0, 1), ErrorCode.WORLD_FAILED, "nonsense")
        if kind == 3:
            return p.JoinRefused(name, rng.randint(0, 3), ErrorCode.TIMEOUT, "nonsense")
        step = rng.choice(["up", "down", "p2p", "p2p-ack", "junk"])
        return p.Data(name, rng.randint(0, 2), step, rng.randint(0, 3), rng.randint(0, 2),
                      rng.randint(0, 70000 * 4), "barrier()", (rng.randint(0, 3),))

    async def talk() -> int:
        node = PeerNode(PeerSettings("intruder", b"fuzz-secret-0123456789"),
                        lambda link, msg, payload: None, lambda link, reason: None)
        sent = 0
        link = await node.dial(*parse_address(peer_daemon.peer_address()))
        for _ in range(PACKETS):
            if link.closed:  # the daemon dropped us for something it could not take: dial again
                link = await node.dial(*parse_address(peer_daemon.peer_address()))
            link.send(nonsense(), bytes(rng.randint(0, 64)))
            sent += 1
            if sent % 50 == 0:
                await link.drain()
                await asyncio.sleep(0)
        await asyncio.sleep(0.2)
        link.close("done")
        return sent

    thread = threading.Thread(target=victim)
    thread.start()
    assert ready.wait(10)
    assert asyncio.run(talk()) == PACKETS
    thread.join(60)
    assert result == [1]  # the victim world ran its 200 calls, untouched at epoch 1
    from commd.status import query_status

    info = query_status(sock, 5)
    assert info["pid"] == peer_daemon.pid and info["peers"]["foreign_refused"] > 0
    with DaemonBackend(sock, world_name(), 0, 1, timeout=5) as comm:
        comm.barrier()
    fault_report.add(f"{PACKETS:,} well-formed nonsense messages from an authenticated peer", float("nan"),
                     float("nan"), steady_f.errors() - unrelated, "n/a (the intruder's link is kept)")


def as_rank1s_daemon(peer_daemon: DaemonProcess, world: str, data: Callable[[int], tuple[p.Data, bytes]],
                     done: Callable[[], object]) -> None:
    """A daemon with the secret joins `world` (rooted on the fuzzed daemon) as rank 1's, and
    once it formed sends `data(epoch)`; then waits (10 s at most) for `done`."""
    from commd.peering import PeerNode
    from commd.peerlink import PeerSettings

    async def member() -> None:
        ready: asyncio.Queue[p.WorldReady] = asyncio.Queue()

        def heard(link: object, msg: p.PeerMessage, payload: object) -> None:
            if isinstance(msg, p.WorldReady):
                ready.put_nowait(msg)

        node = PeerNode(PeerSettings("intruder", b"fuzz-secret-0123456789"), heard, lambda link, reason: None)
        link = await node.dial(*parse_address(peer_daemon.peer_address()))
        link.send(p.JoinWorld(world, 2, 1, 0, 10_000))
        formed = await asyncio.wait_for(ready.get(), 10)
        assert formed.placement == ("F", "intruder")
        link.send(*data(formed.epoch))
        await link.drain()
        for _ in range(1000):  # the world failed once rank 0 heard it
            if done():
                break
            await asyncio.sleep(0.01)
        link.close("done")
        node.close()

    asyncio.run(member())


@pytest.mark.parametrize("step", ["down", "up-credit", "junk"])
def test_a_member_sending_data_no_member_sends_fails_its_world_saying_so(
        peer_daemon: DaemonProcess, steady_f: Steady, step: str) -> None:
    """A daemon with the secret, rank 1's daemon of a world rooted on the fuzzed daemon, sends
    the root data of a step only the root sends (or none does): the world fails, its rank told
    which step came (the campaign's 'data of call 0 for rank None' named no rank, and no step
    that was wrong), and the unrelated world runs on."""
    sock = str(peer_daemon.socket_path)
    unrelated = steady_f.errors()
    world = world_name("member")
    failed: list[str] = []

    def rank0() -> None:
        with DaemonBackend(sock, world, 0, 2, timeout=10, bootstrap=peer_daemon.peer_address()) as comm:
            try:
                comm.barrier()
            except CommError as exc:
                failed.append(str(exc))

    thread = threading.Thread(target=rank0)
    thread.start()
    try:
        as_rank1s_daemon(peer_daemon, world,
                         lambda epoch: (p.Data(world, epoch, step, 0, 0, 0, "barrier()"), b""),
                         lambda: failed)
    finally:
        thread.join(30)
    assert len(failed) == 1 and f"daemon intruder sent {step!r} data of call 0, which a member never sends " \
        "the root" in failed[0], failed
    assert "None" not in failed[0]
    assert steady_f.errors() == unrelated


@pytest.mark.parametrize("size", ["all_reduce(8 i32 sum)", "-8", "16"])
def test_a_member_saying_a_send_of_no_byte_count_fails_the_world_naming_it(
        peer_daemon: DaemonProcess, steady_f: Steady, size: str) -> None:
    """Rank 1's daemon sends rank 0's receive of 8 bytes data whose size (the p2p frame's
    fingerprint) is no byte count: the world fails naming that daemon and what it sent. In the
    fuzz campaign the receive failed as a mismatch, saying rank 1 'called send_to(bytes=all_reduce(8
    i32 sum), peer=0)': a call no rank made, which sent the operator to the workers' code. A size
    that is a byte count, other than the receive's, stays a mismatch of the two ranks' calls."""
    sock = str(peer_daemon.socket_path)
    unrelated = steady_f.errors()
    world = world_name("member")
    failed: list[CommError] = []

    def rank0() -> None:
        landing = hostmem.alloc(8)
        with DaemonBackend(sock, world, 0, 2, timeout=10, bootstrap=peer_daemon.peer_address()) as comm:
            try:
                comm.recv_from(landing.ptr, 8, 1)
            except CommError as exc:
                failed.append(exc)

    thread = threading.Thread(target=rank0)
    thread.start()
    try:
        as_rank1s_daemon(peer_daemon, world, lambda epoch: (
            p.Data(world, epoch, "p2p", 0, 0, pair_of(1, 0), size, (0,)), bytes(8)), lambda: failed)
    finally:
        thread.join(30)
    assert len(failed) == 1, failed
    if size == "16":
        assert isinstance(failed[0], MismatchError), failed
        assert "mismatched point-to-point 1->0 call 0: rank 1 called send_to(bytes=16, peer=0), " \
            "rank 0 called recv_from(bytes=8, peer=1)" in str(failed[0]), failed
    else:
        assert type(failed[0]) is WorldFailed and failed[0].code is ErrorCode.WORLD_FAILED, failed
        assert f"point-to-point 1->0 call 0: daemon intruder sent the size {size!r}, which is not a byte " \
            "count" in str(failed[0]), failed
        assert "send_to" not in str(failed[0])
    assert steady_f.errors() == unrelated
