"""The client against a daemon that misbehaves (buggy, of another version, or hostile):
every call ends in a typed CommError within its timeout, and the worker keeps its memory,
its fds and its mappings as they were."""

from __future__ import annotations

import collections
import fcntl
import json
import logging
import os
import random
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import msgpack
import numpy as np
import pytest

import proto
from client.daemon import DaemonBackend
from client.errors import (
    CommError,
    DaemonShutdown,
    DaemonUnavailable,
    LimitExceeded,
    MisuseError,
    PeerLost,
    ProtocolError,
    WorldFailed,
)
from client.hostmem import HostBuffer, HostMemory
from tests.fault.test_packet_fuzz import mutate
from tests.integration.harness import memfd_mappings, open_fds, short_tmpdir, wait_until, world_name
from tests.unit.standin import Packets, RecordingDaemon

# (this process's fds are counted: the collector's work of earlier tests is done first)
pytestmark = [pytest.mark.timeout(30), pytest.mark.usefixtures("collected")]

REPO = Path(__file__).resolve().parents[2]
NBYTES = 64 * 1024
MUTATIONS = 1000  # per seed (4 seeds)

# A worker: symmetric_alloc, then it writes every byte it was given (a memfd shorter than
# its mapping kills it there with SIGBUS). Prints what it saw and what it held before/after.
WORKER = r"""
import ctypes, json, os, sys
from client.daemon import DaemonBackend
from client.errors import CommError
from client.hostmem import HostMemory
from tests.integration.harness import memfd_mappings, open_fds

path, nbytes = sys.argv[1], int(sys.argv[2])
held = lambda: (open_fds(), memfd_mappings(os.getpid()))
before = held()
with DaemonBackend(path, "w", 0, 1, timeout=5, memory=HostMemory(), cuda_driver=lambda: None) as comm:
    try:
        ptr = comm.symmetric_alloc(nbytes)
    except CommError as exc:
        outcome = [type(exc).__name__, str(exc)]
    else:
        ctypes.memset(ptr, 7, nbytes)
        outcome = ["mapped", ctypes.string_at(ptr + nbytes - 1, 1).hex()]
        comm.symmetric_free(ptr)
print(json.dumps({"outcome": outcome, "before": before, "after": held()}))
"""


def lone_rank(path: str, memory: HostMemory | None = None, timeout: float = 3) -> DaemonBackend:
    """Rank 0 of a world of one, world "w", at the stand-in (host memory, no CUDA)."""
    return DaemonBackend(path, "w", 0, 1, timeout=timeout, memory=memory or HostMemory(),
                         cuda_driver=lambda: None)


@pytest.fixture
def standin() -> Iterator[tuple[RecordingDaemon, str]]:
    tmp = short_tmpdir()
    path = os.path.join(tmp, "d.sock")
    fake = RecordingDaemon(path)
    fake.close_when_done = True
    yield fake, path
    fake.close()
    os.unlink(path)
    os.rmdir(tmp)


def rejoins(comm: DaemonBackend, buf: HostBuffer) -> None:
    """The rank the failure left unhealthy rebuilds its world, and its next call works."""
    assert not comm.is_healthy()
    comm.attempt_reconnect()
    comm.all_reduce(buf.ptr, 64, dtype="f32")
    assert comm.is_healthy()


def back_to_fds(before: int) -> None:
    """This process holds the fds it held `before` (the stand-in's threads close their ends
    of the connections, and what they sent, soon after the client is done)."""
    wait_until(lambda: open_fds() == before, lambda: f"{open_fds()} fds open, {before} before", timeout=2)


def memfd(size: int, seals: int) -> int:
    fd = os.memfd_create("standin", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    os.ftruncate(fd, size)
    if seals:
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, seals)
    return fd


def read_end_of_a_pipe() -> int:
    read, write = os.pipe()
    os.close(write)
    return read


SEALED = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL  # as the daemon's are
BAD_SYMMETRIC: dict[str, tuple[Callable[[], int], str]] = {
    "smaller than it claims": (lambda: memfd(NBYTES // 2, SEALED), f"holds {NBYTES // 2} bytes"),
    "not sealed against shrinking": (lambda: memfd(NBYTES, 0), "sealed against shrinking"),
    "sealed against writing": (lambda: memfd(NBYTES, SEALED | fcntl.F_SEAL_WRITE), "sealed against writing"),
    "not a memfd": (read_end_of_a_pipe, "not a memfd"),
}


@pytest.mark.parametrize("case", list(BAD_SYMMETRIC))
def test_symmetric_memory_the_worker_cannot_safely_map_is_refused(
        standin: tuple[RecordingDaemon, str], case: str) -> None:
    """Before: a memfd shorter than it claimed was mapped whole, and the worker writing the
    memory it was given died of SIGBUS; one not sealed against shrinking was mapped too (a
    later shrink by the daemon kills the worker the same way); one sealed against writing,
    or no memfd at all, failed the mapping with LimitExceeded, which tells the worker to
    raise its limits. Now each is a ProtocolError, and the daemon is told to free it."""
    fake, path = standin
    make, why = BAD_SYMMETRIC[case]

    def answer(msg: proto.Message) -> Packets | None:
        if isinstance(msg, proto.SymAlloc):
            return [(proto.encode(proto.Ok(msg.id, value=msg.nbytes, nfds=1)), [make()])]
        return None

    fake.answer = answer
    done = subprocess.run([sys.executable, "-c", WORKER, path, str(NBYTES)], cwd=REPO,
                          env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"},
                          capture_output=True, text=True, timeout=20)
    assert done.returncode == 0, (done.returncode, done.stderr[-2000:])
    report = json.loads(done.stdout)
    kind, message = report["outcome"]
    assert kind == "ProtocolError" and why in message, report
    assert report["after"] == report["before"]  # no fd, no mapping left behind
    allocated = [msg.buf for _, msg in fake.seen if isinstance(msg, proto.SymAlloc)]
    freed = [buf for _, msg in fake.seen if isinstance(msg, proto.SymFree) for buf in [msg.buf]]
    assert len(allocated) == 1 and freed == allocated  # the daemon lets go of it at once


def with_an_fd(request: type) -> Callable[[proto.Message], Packets | None]:
    """A stand-in's answer: the usual Ok to `request`, but with a memfd riding beside it."""
    def answer(msg: proto.Message) -> Packets | None:
        if isinstance(msg, request):
            return [(proto.encode(proto.Ok(msg.id, value=1, nfds=1)), [memfd(4096, SEALED)])]
        return None
    return answer


@pytest.mark.parametrize("request_kind", [proto.Import, proto.Register, proto.Submit],
                         ids=lambda kind: kind.__name__)
def test_an_fd_beside_a_reply_that_carries_none_is_refused_and_closed(
        standin: tuple[RecordingDaemon, str], request_kind: type) -> None:
    """Only symmetric_alloc's reply carries an fd. Before: one beside the Ok of an import,
    a registration or a collective was taken with the reply and never closed (observed: the
    worker held one more open file per call, for good). Now the call fails with
    ProtocolError, the fd is closed, and the connection, which the daemon broke, goes."""
    fake, path = standin
    fake.answer = with_an_fd(request_kind)
    memory = HostMemory()
    buf = memory.alloc(64)
    before = open_fds()
    comm = lone_rank(path, memory, timeout=5)
    try:
        with pytest.raises(ProtocolError, match="carried 1 fd"):
            if request_kind is proto.Register:
                comm.register_buffer(buf.ptr, 64)
            else:
                comm.all_reduce(buf.ptr, 64, dtype="f32")
        assert not comm.is_healthy()
    finally:
        comm.close()
    back_to_fds(before)
    buf.close()


def answering(request: type,
              *replies: Callable[[int], proto.Message]) -> Callable[[proto.Message], Packets | None]:
    """A stand-in's answer to `request`: `replies`, each made from the request's id."""
    def answer(msg: proto.Message) -> Packets | None:
        if isinstance(msg, request):
            return [(proto.encode(reply(msg.id)), []) for reply in replies]  # type: ignore[attr-defined]
        return None
    return answer


MISMATCHED: dict[str, tuple[Callable[[proto.Message], Packets | None], int]] = {
    # (the answer, how many all_reduce calls succeed before the ProtocolError)
    "an Ok to an id never asked": (answering(proto.Submit, lambda rid: proto.Ok(rid + 1000)), 0),
    "a StatusReport to a collective": (
        answering(proto.Submit, lambda rid: proto.StatusReport(rid, {"worlds": {}})), 0),
    "a request answered twice": (
        answering(proto.Submit, proto.Ok,
                  lambda rid: proto.Error(rid, proto.ErrorCode.INTERNAL, "again")), 1),
    "a Welcome to an id never asked": (
        answering(proto.Hello, lambda rid: proto.Welcome(rid + 7, proto.PROTOCOL_VERSION, "fake", "host", 1,
                                                         proto.MAX_MESSAGE_BYTES)), -1),
}


@pytest.mark.parametrize("case", list(MISMATCHED))
def test_a_reply_that_answers_no_request_of_ours_is_a_protocol_error(
        standin: tuple[RecordingDaemon, str], case: str) -> None:
    """Before: a reply to an id never asked was dropped as if late, and the call waited
    out its whole timeout for its own (CommTimeout, or for a hello the welcome never
    matched); a second answer to one request was dropped unnoticed; a StatusReport to a
    collective was taken for its success (the call returned, nothing written). Now each
    is a ProtocolError as soon as it is read, and the connection goes."""
    fake, path = standin
    fake.answer, calls = MISMATCHED[case]
    memory = HostMemory()
    buf = memory.alloc(64)
    before = open_fds()
    started = time.monotonic()
    with (pytest.raises(ProtocolError, match=r"never made or was answered already|answered Submit"),
          lone_rank(path, memory) as comm):
        for _ in range(calls):
            comm.all_reduce(buf.ptr, 64, dtype="f32")
        time.sleep(0.1)  # (a second answer is in the socket by then)
        started = time.monotonic()
        comm.all_reduce(buf.ptr, 64, dtype="f32")
    assert time.monotonic() - started < 1  # not the call's timeout
    back_to_fds(before)
    buf.close()


@pytest.mark.parametrize("rebuilt_at", [5, 3])
def test_a_rebuild_whose_epoch_does_not_move_on_is_a_protocol_error(
        standin: tuple[RecordingDaemon, str], rebuilt_at: int) -> None:
    """attempt_reconnect's answer is the world's new epoch, past the one it failed at.
    Before: an answer at the same epoch or an older one was taken: attempt_reconnect
    returned, yet the failure (at epoch 5) stayed unrepaired, and every call raised 'world
    is not healthy' again, however often the worker reconnected (observed: 4 rounds, the
    same). Now it raises ProtocolError naming both epochs, and a rebuild the daemon gets
    right afterwards repairs the world."""
    fake, path = standin
    rebuilds: list[int] = []

    def answer(msg: proto.Message) -> Packets | None:
        if isinstance(msg, proto.Hello):
            return [(proto.encode(proto.Welcome(msg.id, proto.PROTOCOL_VERSION, "fake", "host", 5,
                                                proto.MAX_MESSAGE_BYTES)), [])]
        if isinstance(msg, proto.Submit) and not rebuilds:
            return [(proto.encode(proto.Error(msg.id, proto.ErrorCode.WORLD_FAILED, "rank 1 lost")), [])]
        if isinstance(msg, proto.Reconnect):
            rebuilds.append(rebuilt_at if not rebuilds else 6)
            return [(proto.encode(proto.Ok(msg.id, value=rebuilds[-1])), [])]
        return None

    fake.answer = answer
    memory = HostMemory()
    buf = memory.alloc(64)
    with lone_rank(path, memory) as comm:
        with pytest.raises(WorldFailed, match="rank 1 lost"):
            comm.all_reduce(buf.ptr, 64, dtype="f32")
        with pytest.raises(ProtocolError, match=f"epoch {rebuilt_at}, not past 5"):
            comm.attempt_reconnect()
        assert not comm.is_healthy()
        comm.attempt_reconnect()
        assert (comm.epoch, comm.is_healthy()) == (6, True)
        comm.all_reduce(buf.ptr, 64, dtype="f32")
    submits = [msg for _, msg in fake.seen if isinstance(msg, proto.Submit)]
    assert [s.epoch for s in submits] == [5, 6]  # the last made for the rebuilt world
    buf.close()


def test_a_rejoin_welcomed_at_an_epoch_not_past_its_hellos_is_a_protocol_error(
        standin: tuple[RecordingDaemon, str]) -> None:
    """A rejoin's hello carries the last epoch the rank saw, and the world it forms starts
    past it. Before: a welcome at an older epoch was taken, and the lost connection's
    failure stayed unrepaired: attempt_reconnect returned, is_healthy() was False, and every
    call raised 'world is not healthy' (observed: welcomed at 3 after 5). Now that
    attempt_reconnect raises ProtocolError, and one the daemon welcomes right repairs it."""
    fake, path = standin
    hellos: list[int] = []

    def answer(msg: proto.Message) -> Packets | None:
        if isinstance(msg, proto.Hello):
            hellos.append(msg.epoch)
            epoch = {1: 5, 2: 3}.get(len(hellos), 6)
            return [(proto.encode(proto.Welcome(msg.id, proto.PROTOCOL_VERSION, "fake", "host", epoch,
                                                proto.MAX_MESSAGE_BYTES)), [])]
        if isinstance(msg, proto.Submit) and len(hellos) == 1:
            fake.drop()  # the daemon goes: the next attempt_reconnect rejoins
            return []
        return None

    fake.answer = answer
    memory = HostMemory()
    buf = memory.alloc(64)
    before = open_fds()
    with lone_rank(path, memory) as comm:
        with pytest.raises(DaemonUnavailable):
            comm.all_reduce(buf.ptr, 64, dtype="f32")
        with pytest.raises(ProtocolError, match="at epoch 3, not past 5"):
            comm.attempt_reconnect()
        assert not comm.is_healthy()
        comm.attempt_reconnect()
        assert (comm.epoch, comm.is_healthy()) == (6, True)
        comm.all_reduce(buf.ptr, 64, dtype="f32")
    assert hellos == [0, 5, 5]
    submits = [msg for _, msg in fake.seen if isinstance(msg, proto.Submit)]
    assert [s.epoch for s in submits] == [5, 6]
    back_to_fds(before)
    buf.close()


# ---- random mutations of the daemon's replies (as asyncpg's _testbase/fuzzer.py does) ----

ODD_VALUES: list[object] = [None, True, -1, 0, 1, 2**32, 2**63, 2**64 - 1, 1.5, "", "x" * 5000,
                            b"\xff\xfe", [], [1, 2], {}, {"t": "ok"}, "welcome", "ok", "error", "event",
                            "status_report", "internal", "world_failed", "shutdown"]


def mutated(rng: random.Random, packet: bytes) -> bytes:
    """`packet` with bytes flipped, added, cut (the daemon fuzz's mutate), or with one of
    its fields given an odd value, dropped, or added."""
    if rng.random() < 0.5:
        return mutate(rng, packet)
    fields = msgpack.unpackb(packet)
    name = rng.choice([*fields, "extra"])
    if rng.random() < 0.2:
        fields.pop(name, None)
    else:
        fields[name] = rng.choice(ODD_VALUES)
    return bytes(msgpack.packb(fields, use_bin_type=True))


def true_reply(msg: proto.Message) -> tuple[proto.Message, int]:
    """What a good daemon answers `msg` with, and how many fds ride beside it."""
    rid: int = msg.id  # type: ignore[union-attr]
    if isinstance(msg, proto.Hello):
        return proto.Welcome(rid, proto.PROTOCOL_VERSION, "fake", "host", 1, proto.MAX_MESSAGE_BYTES), 0
    if isinstance(msg, proto.SymAlloc):
        return proto.Ok(rid, value=msg.nbytes, nfds=1), 1
    if isinstance(msg, proto.Reconnect):
        return proto.Ok(rid, value=2), 0
    return proto.Ok(rid, value=7), 0


CALLS: dict[str, type] = {  # a call, and the request whose answer comes mutated
    "hello": proto.Hello, "all_reduce": proto.Submit, "register_buffer": proto.Register,
    "symmetric_alloc": proto.SymAlloc, "attempt_reconnect": proto.Reconnect,
}


@pytest.mark.parametrize("seed", range(4))
def test_random_mutations_of_the_daemons_replies_end_each_call_in_a_comm_error(
        standin: tuple[RecordingDaemon, str], sock: str, seed: int) -> None:
    """Each call whose reply (or an event before it) came mutated ends at once, in success
    or a CommError, never another exception or a wait for its timeout; the worker's fds
    and mappings come back to what they were, and a backend to a real daemon works."""
    fake, path = standin
    rng = random.Random(seed)
    mutate_next: list[type] = []

    def answer(msg: proto.Message) -> Packets | None:
        if not mutate_next or not isinstance(msg, mutate_next[0]):
            return None
        mutate_next.clear()
        reply, nfds = true_reply(msg)
        if rng.random() < 0.2:  # an event ahead of the reply instead
            event = proto.Event(proto.EventKind.WORLD_FAILED, proto.ErrorCode.PEER_LOST, "lost", 1)
            packets: Packets = [(mutated(rng, proto.encode(event)), [])]
        else:
            packets = [(mutated(rng, proto.encode(reply)), [memfd(4096, SEALED) for _ in range(nfds)])]
        if rng.random() < 0.2:  # fds where none belong, or too many
            packets[0][1].extend(memfd(4096, SEALED) for _ in range(rng.choice([1, 2, 5])))
        # the true reply after it: a mutation that went unnoticed does not leave the call waiting
        return [*packets, (proto.encode(reply), [memfd(4096, SEALED) for _ in range(nfds)])]

    fake.answer = answer
    memory = HostMemory()
    buf = memory.alloc(4096)
    before = open_fds(), memfd_mappings(os.getpid())
    outcomes: collections.Counter[str] = collections.Counter()
    for _ in range(MUTATIONS):
        call = rng.choice(list(CALLS))
        mutate_next[:] = [CALLS[call]]
        started = time.monotonic()
        try:
            with lone_rank(path, memory, timeout=1) as comm:
                if call == "all_reduce":
                    comm.all_reduce(buf.ptr, 64, dtype="f32")
                elif call == "register_buffer":
                    comm.register_buffer(buf.ptr, 64)
                elif call == "symmetric_alloc":
                    comm.symmetric_free(comm.symmetric_alloc(4096))
                elif call == "attempt_reconnect":
                    comm.attempt_reconnect()
            outcomes["done"] += 1
        except CommError as exc:
            outcomes[type(exc).__name__] += 1
        assert time.monotonic() - started < 0.5, call
    back_to_fds(before[0])
    assert memfd_mappings(os.getpid()) == before[1]
    assert outcomes["ProtocolError"] > MUTATIONS // 4, outcomes
    buf.close()
    with DaemonBackend(sock, world_name("fuzzed"), 0, 1, timeout=10, memory=memory) as comm:  # a real daemon
        data = memory.alloc(64)
        data.view(np.float32)[:] = np.arange(16)
        comm.all_reduce(data.ptr, 64, dtype="f32")
        assert data.view(np.float32).tolist() == list(range(16))
        data.close()


@pytest.mark.parametrize("named", [1000, 2**64 - 1])
def test_a_failure_event_of_an_epoch_the_world_never_reached_is_repaired_by_a_rebuild(
        standin: tuple[RecordingDaemon, str], named: int) -> None:
    """A world fails only at an epoch it reached. Before: an event naming a later one (the
    world at 1, the event at 1000 or 2^64-1) was kept as the failure on record past every
    rebuild: attempt_reconnect returned with is_healthy() False, and every call raised
    'world is not healthy' for good (observed: 3 rounds, epochs 2, 3, 4). Now a rebuild
    drops it: the world is healthy at the epoch the daemon rebuilt it at."""
    fake, path = standin

    def first_answer(msg: proto.Submit) -> Packets:
        event = proto.Event(proto.EventKind.WORLD_FAILED, proto.ErrorCode.PEER_LOST, "lost", named)
        return [(proto.encode(event), []), (proto.encode(proto.Ok(msg.id)), [])]

    fake.answer_the_first_submit(first_answer)
    memory = HostMemory()
    buf = memory.alloc(64)
    with lone_rank(path, memory) as comm:
        comm.all_reduce(buf.ptr, 64, dtype="f32")
        assert (comm.epoch, comm.is_healthy()) == (1, False)
        comm.attempt_reconnect()
        rebuilt = comm.epoch
        assert rebuilt > 1 and comm.is_healthy()
        comm.all_reduce(buf.ptr, 64, dtype="f32")
    submits = [msg for _, msg in fake.seen if isinstance(msg, proto.Submit)]
    assert [s.epoch for s in submits] == [1, rebuilt]
    buf.close()


@pytest.mark.parametrize("version", [proto.PROTOCOL_VERSION - 1, proto.PROTOCOL_VERSION + 1, 2**64 - 1])
def test_a_welcome_in_another_protocol_version_is_refused(
        standin: tuple[RecordingDaemon, str], version: int) -> None:
    """A daemon refuses a hello of another version (WIRE.md: a clear error, never a hang).
    Before: a daemon that welcomed one all the same (a buggy older or newer one) was taken
    at its word, and the worker went on speaking a protocol the daemon does not: the
    constructor returned. Now it raises ProtocolError naming both versions, and leaves
    nothing open."""
    fake, path = standin

    def answer(msg: proto.Message) -> Packets | None:
        if isinstance(msg, proto.Hello):
            welcome = proto.Welcome(msg.id, version, "fake", "host", 1, proto.MAX_MESSAGE_BYTES)
            return [(proto.encode(welcome), [])]
        return None

    fake.answer = answer
    before = open_fds()
    with pytest.raises(ProtocolError, match=f"protocol version {version}; this client speaks "
                                            f"{proto.PROTOCOL_VERSION}"):
        lone_rank(path)
    back_to_fds(before)
    assert [type(msg) for _, msg in fake.seen] == [proto.Hello]


def empty_packet(fake: RecordingDaemon, msg: proto.Message) -> Packets:
    return [(b"", [])]  # legal on SOCK_SEQPACKET, but no message: a msgpack map is never empty


def hang_up(fake: RecordingDaemon, msg: proto.Message) -> Packets:
    fake.drop()
    return []


@pytest.mark.parametrize(("first_answer", "error", "said"), [
    (empty_packet, ProtocolError, "empty packet"),
    (hang_up, DaemonUnavailable, "the daemon closed the connection"),
], ids=["empty packet", "hang-up"])
def test_an_empty_packet_is_a_protocol_error_not_a_hang_up(
        standin: tuple[RecordingDaemon, str],
        first_answer: Callable[[RecordingDaemon, proto.Message], Packets],
        error: type[CommError], said: str) -> None:
    """recvmsg returns no bytes both for a zero-length packet and at the end of the
    connection. Before: an empty packet, sent by a daemon that stays connected, was taken
    for its hanging up (DaemonUnavailable: 'the daemon closed the connection ... (the daemon
    stopped, with no word of why)'), which sends the operator looking for a crash. Now it
    is a ProtocolError naming the empty packet; a real hang-up is still DaemonUnavailable.
    Either way the call fails at once, and attempt_reconnect rejoins."""
    fake, path = standin
    fake.answer_the_first_submit(lambda msg: first_answer(fake, msg))
    memory = HostMemory()
    buf = memory.alloc(64)
    before = open_fds()
    with lone_rank(path, memory, timeout=10) as comm:
        started = time.monotonic()
        with pytest.raises(CommError, match=said) as failed:
            comm.all_reduce(buf.ptr, 64, dtype="f32")
        assert type(failed.value) is error
        assert time.monotonic() - started < 5  # not at the call's timeout (a loaded machine aside)
        rejoins(comm, buf)
    hellos = fake.connections(proto.Hello)
    submits = fake.connections(proto.Submit)
    assert (hellos, submits) == ([0, 1], [0, 1])  # the second call went on the rejoined connection
    back_to_fds(before)
    buf.close()


def raw_error(request_id: int, code: str, message: str) -> bytes:
    """An Error as a daemon may send it that this client's proto could not build before: a
    code it does not know (a newer daemon's), or a message over the wire's 4096 characters."""
    return bytes(msgpack.packb({"t": "error", "id": request_id, "code": code, "message": message},
                               use_bin_type=True))


LONG = "lock order inversion in daemon thread " * 1600  # 60 800 characters, in a 61 KiB packet
REFUSALS: dict[str, tuple[str, str, type[CommError], object, str]] = {
    # (code, message sent; the error the call raises, its .code, what its message starts with)
    "a code this client does not know": (
        "quota_exceeded", "world w used its 2 GiB", CommError, "quota_exceeded",
        "the daemon refused the request with error code 'quota_exceeded', which this client "
        "does not know: world w used its 2 GiB"),
    "a message over 4096 characters": (
        "misuse", LONG, MisuseError, proto.ErrorCode.MISUSE, LONG[:4000]),
    "both": (
        "quota_exceeded", LONG, CommError, "quota_exceeded",
        "the daemon refused the request with error code 'quota_exceeded', which this client "
        "does not know: " + LONG[:4000]),
}


@pytest.mark.parametrize("case", list(REFUSALS))
def test_a_refusal_with_an_unknown_code_or_a_long_message_fails_the_call_not_the_connection(
        standin: tuple[RecordingDaemon, str], case: str) -> None:
    """A daemon's Error refuses one request. Before: one with a code this client does not
    know (a newer daemon's), or with a message over 4096 characters, was taken for a bad
    packet: the call raised ProtocolError ('bad packet from the daemon: ... is not a
    ErrorCode', '... message is longer than 4096 characters'), the connection was dropped
    and the world marked unhealthy, so the next call failed too until attempt_reconnect.
    Now the call raises a CommError carrying the daemon's code (its string when unknown:
    then the base class, no subclass claims to know what it means) and its text, clipped
    to 4096 characters with a marker; the next call goes on the same connection."""
    fake, path = standin
    code, message, error, carried, starts = REFUSALS[case]

    def first_answer(msg: proto.Submit) -> Packets:
        return [(raw_error(msg.id, code, message), [])]

    fake.answer_the_first_submit(first_answer)
    memory = HostMemory()
    buf = memory.alloc(64)
    before = open_fds()
    with lone_rank(path, memory) as comm:
        with pytest.raises(CommError) as failed:
            comm.all_reduce(buf.ptr, 64, dtype="f32")
        said = str(failed.value)
        assert (type(failed.value), failed.value.code) == (error, carried), said[:300]
        assert said.startswith(starts), said[:300]
        if len(message) > proto.MAX_ERROR_TEXT:
            assert said.endswith(" ... (cut)") and len(said) < len(starts) + 100, said[-300:]
        assert comm.is_healthy()
        comm.all_reduce(buf.ptr, 64, dtype="f32")  # answered Ok, on the same connection
        assert comm.is_healthy()
    hellos = fake.connections(proto.Hello)
    submits = fake.connections(proto.Submit)
    assert (hellos, submits) == ([0], [0, 0])
    back_to_fds(before)
    buf.close()


def test_a_request_over_the_daemons_announced_limit_is_refused_before_it_is_sent(
        standin: tuple[RecordingDaemon, str]) -> None:
    """A daemon's welcome says the longest packet it reads (max_message). Before: the client
    sent whatever fit in its own 64 KiB, so a group of 400 calls (an 18 KiB Submit) reached
    a daemon that reads 8 KiB, which refused it as a bad packet and closed: the call raised
    ProtocolError ('packet of 18428 bytes is over the 8192-byte limit'), the connection was
    dropped and the world read unhealthy. Now the call raises LimitExceeded naming both
    sizes, nothing is sent, and a smaller group goes on the same connection."""
    fake, path = standin
    fake.max_message = 8192
    memory = HostMemory()
    buf = memory.alloc(64)
    buf.view(np.float32)[:] = np.arange(16)
    before = open_fds()

    def group(calls: int) -> None:
        comm.group_start()
        for _ in range(calls):
            comm.all_reduce(buf.ptr, 64, dtype="f32")
        comm.group_end()

    with lone_rank(path, memory) as comm:
        with pytest.raises(LimitExceeded, match=r"Submit is 1\d{4} bytes, over the daemon's 8192") as refused:
            group(400)
        assert refused.value.code is None  # the client's refusal, not the daemon's
        assert comm.is_healthy()
        group(100)
        assert comm.is_healthy()
    hellos = fake.connections(proto.Hello)
    submits = [(n, len(msg.ops)) for n, msg in fake.seen if isinstance(msg, proto.Submit)]
    assert (hellos, submits) == ([0], [(0, 100)])  # the long one never went
    assert buf.view(np.float32).tolist() == list(range(16))
    back_to_fds(before)
    buf.close()


# Every request but a group's Submit fits in a packet of this many bytes: its largest is a
# Forget of MAX_GROUP_OPS buffer ids, which the client must be able to send
LONGEST_FORGET = len(proto.encode(proto.Forget((2**64 - 1,) * proto.MAX_GROUP_OPS)))


@pytest.mark.parametrize("announced", [0, 1, LONGEST_FORGET - 1])
def test_a_welcome_announcing_a_limit_too_small_for_the_clients_requests_is_refused(
        standin: tuple[RecordingDaemon, str], announced: int) -> None:
    """Before: a welcome announcing max_message 1, or one byte short of the longest Forget,
    was taken (the constructor returned), though requests the client cannot do without
    would not fit; 0, which the protocol does not allow, was already a bad packet. Now each
    is a ProtocolError at connect naming max_message, and nothing is left open."""
    fake, path = standin

    def answer(msg: proto.Message) -> Packets | None:
        if isinstance(msg, proto.Hello):  # (raw: 0 is no valid Welcome)
            welcome = {"t": "welcome", "id": msg.id, "version": proto.PROTOCOL_VERSION,
                       "daemon_version": "fake", "engine": "host", "epoch": 1, "max_message": announced}
            return [(bytes(msgpack.packb(welcome)), [])]
        return None

    fake.answer = answer
    before = open_fds()
    said = (r"max_message=0 must be a positive" if not announced else
            rf"max_message {announced} bytes, below the {LONGEST_FORGET} its requests need")
    with pytest.raises(ProtocolError, match=said):
        lone_rank(path)
    back_to_fds(before)
    assert [type(msg) for _, msg in fake.seen] == [proto.Hello]


def raw_event(kind: str, code: str, message: str, epoch: int) -> bytes:
    """An Event as a newer daemon may send it: a kind or code this client's proto did not
    know, or a message over the wire's 4096 characters."""
    event = {"t": "event", "kind": kind, "code": code, "message": message, "epoch": epoch}
    return bytes(msgpack.packb(event, use_bin_type=True))


def told_ahead_of(told: list[int], ahead_of: type, event: bytes) -> Callable[[proto.Message], Packets | None]:
    """A stand-in's answer: `event` just before the true answer to the first `ahead_of`
    (the Hello: the event comes before the welcome, as a world failing at once does). A
    Reconnect gets a good daemon's answer (the stand-in's own counts the requests before it)."""
    def answer(msg: proto.Message) -> Packets | None:
        if isinstance(msg, proto.Reconnect):
            return [(proto.encode(true_reply(msg)[0]), [])]
        if not isinstance(msg, ahead_of) or told:
            return None
        told.append(msg.id)
        return [(event, []), (proto.encode(true_reply(msg)[0]), [])]

    return answer


AHEAD_OF = pytest.mark.parametrize("ahead_of", [proto.Hello, proto.Submit],
                                   ids=["before the welcome", "before a reply"])
FAILURES: dict[str, tuple[str, str, type[CommError], object, str]] = {
    # (code, message sent; the error the next call raises, its .code, what its message starts with)
    "a code this client does not know": (
        "quota_exceeded", "world w used its 2 GiB", WorldFailed, "quota_exceeded",
        "world w is not healthy: the world failed with error code 'quota_exceeded', which this "
        "client does not know: world w used its 2 GiB"),
    "a message over 4096 characters": (
        "peer_lost", LONG, PeerLost, proto.ErrorCode.PEER_LOST, "world w is not healthy: " + LONG[:4000]),
}


@AHEAD_OF
@pytest.mark.parametrize("case", list(FAILURES))
def test_a_world_failed_event_with_an_unknown_code_or_a_long_message_still_fails_the_world(
        standin: tuple[RecordingDaemon, str], case: str, ahead_of: type) -> None:
    """WIRE.md §7. Before: a world_failed event with a code this client does not know (a
    newer daemon's), or with a message over 4096 characters, was taken for a bad packet:
    the constructor or the call it came during raised ProtocolError ('bad packet from the
    daemon: 'quota_exceeded' is not a ErrorCode', '... message is longer than 4096
    characters') and the connection was dropped, which fails the world for every rank. Now
    the kind says what happened: the world failed, as the event's epoch; the next call
    raises WorldFailed carrying the code's string (a known code: its own class), the text
    clipped; attempt_reconnect rebuilds on the same connection."""
    fake, path = standin
    code, message, error, carried, starts = FAILURES[case]
    told: list[int] = []
    fake.answer = told_ahead_of(told, ahead_of, raw_event("world_failed", code, message, 1))
    memory = HostMemory()
    buf = memory.alloc(64)
    buf.view(np.float32)[:] = np.arange(16)
    before = open_fds()
    with lone_rank(path, memory) as comm:
        if ahead_of is proto.Submit:
            comm.all_reduce(buf.ptr, 64, dtype="f32")  # the daemon answered it, after the event
        assert told and not comm.is_healthy()
        with pytest.raises(CommError) as failed:
            comm.all_reduce(buf.ptr, 64, dtype="f32")
        said = str(failed.value)
        assert (type(failed.value), failed.value.code) == (error, carried), said[:300]
        assert said.startswith(starts), said[:300]
        if len(message) > proto.MAX_ERROR_TEXT:
            assert said.endswith(" ... (cut); call attempt_reconnect") and len(said) < len(starts) + 150, \
                said[-300:]
        comm.attempt_reconnect()
        assert comm.is_healthy()
        comm.all_reduce(buf.ptr, 64, dtype="f32")
    hellos = fake.connections(proto.Hello)
    submits = [(n, msg.epoch) for n, msg in fake.seen if isinstance(msg, proto.Submit)]
    assert hellos == [0]  # one connection throughout
    # (after the failure, none made for the failed epoch)
    assert submits == ([(0, 1)] if ahead_of is proto.Submit else []) + [(0, 2)]
    assert buf.view(np.float32).tolist() == list(range(16))
    back_to_fds(before)
    buf.close()


def test_a_shutdown_event_with_an_unknown_code_is_the_daemon_stopping(
        standin: tuple[RecordingDaemon, str]) -> None:
    """Before: a shutdown event with a code this client does not know was a bad packet
    (ProtocolError "'draining' is not a ErrorCode"), which says nothing of the daemon
    stopping. Now the call it came during raises DaemonShutdown carrying the code's string
    and the daemon's text, and attempt_reconnect rejoins once the daemon is back."""
    fake, path = standin

    def first_answer(msg: proto.Submit) -> Packets:
        fake.last_word(raw_event("shutdown", "draining", "the node is draining", 0))
        return []

    fake.answer_the_first_submit(first_answer)
    memory = HostMemory()
    buf = memory.alloc(64)
    before = open_fds()
    with lone_rank(path, memory, timeout=10) as comm:
        started = time.monotonic()
        with pytest.raises(CommError) as failed:
            comm.all_reduce(buf.ptr, 64, dtype="f32")
        said = str(failed.value)
        assert (type(failed.value), failed.value.code) == (DaemonShutdown, "draining"), said
        assert said == ("world w is not healthy: the daemon is shutting down with error code 'draining', "
                        "which this client does not know: the node is draining; call attempt_reconnect once "
                        "it is back")
        assert time.monotonic() - started < 5  # not at the call's timeout (a loaded machine aside)
        rejoins(comm, buf)
    hellos = fake.connections(proto.Hello)
    submits = fake.connections(proto.Submit)
    assert (hellos, submits) == ([0, 1], [0, 1])
    back_to_fds(before)
    buf.close()


NOTICES: dict[str, tuple[str, str]] = {  # an event kind this client does not know: (code, message)
    "a known code": ("limit", "world w used 90% of its 2 GiB"),
    "an unknown code": ("quota_exceeded", "world w used 90% of its 2 GiB"),
    "a message over 4096 characters": ("quota_exceeded", LONG),
}


@AHEAD_OF
@pytest.mark.parametrize("case", list(NOTICES))
def test_an_event_of_a_kind_this_client_does_not_know_is_ignored(
        standin: tuple[RecordingDaemon, str], case: str, ahead_of: type,
        caplog: pytest.LogCaptureFixture) -> None:
    """WIRE.md §7: a daemon adds an event kind without a new version only for a notice a
    client may do without. Before: an event of a kind this client does not know was a bad
    packet: the constructor or the call raised ProtocolError ("'quota_warning' is not a
    EventKind"), and the connection was dropped, which fails the world for every rank.
    Now it is ignored (logged at debug level): the calls go on, on the same connection,
    and the world stays healthy."""
    fake, path = standin
    code, message = NOTICES[case]
    told: list[int] = []
    fake.answer = told_ahead_of(told, ahead_of, raw_event("quota_warning", code, message, 1))
    memory = HostMemory()
    buf = memory.alloc(64)
    before = open_fds()
    with (caplog.at_level(logging.DEBUG, logger="client"),
          lone_rank(path, memory) as comm):
        comm.all_reduce(buf.ptr, 64, dtype="f32")
        assert told and comm.is_healthy()
        comm.all_reduce(buf.ptr, 64, dtype="f32")
        assert comm.is_healthy()
    hellos = fake.connections(proto.Hello)
    submits = [(n, msg.epoch) for n, msg in fake.seen if isinstance(msg, proto.Submit)]
    assert (hellos, submits) == ([0], [(0, 1), (0, 1)])
    (logged,) = [r.getMessage() for r in caplog.records if "quota_warning" in r.getMessage()]
    assert logged.startswith(f"ignored an event of kind 'quota_warning' (code {code!r}), which this "
                             f"client does not know: {message[:100]}"), logged[:300]
    back_to_fds(before)
    buf.close()


PARTINGS: dict[str, tuple[str, type[CommError], object, str]] = {
    # code; the error the call raises, its .code, what it says (after "world w is not healthy: ")
    "a code this client does not know": (
        "evicted", DaemonUnavailable, "evicted",
        "the daemon closed the connection with error code 'evicted', which this client does not "
        "know: rank 0 was evicted"),
    "a code it knows": (
        "bad_message", ProtocolError, proto.ErrorCode.BAD_MESSAGE,
        "rank 0 was evicted (the daemon closed the connection)"),
    "a code that alone is no failure of the world": (
        "limit", LimitExceeded, proto.ErrorCode.LIMIT,
        "rank 0 was evicted (the daemon closed the connection)"),
}


@pytest.mark.parametrize("case", list(PARTINGS))
def test_an_error_that_answers_no_request_says_the_daemon_closed_the_connection(
        standin: tuple[RecordingDaemon, str], case: str) -> None:
    """An Error with id 0 is the daemon's last word before it closes the connection. Before:
    one with a code this client does not know raised a plain CommError ('the daemon refused
    the request with error code 'evicted' ...'), as if one request were refused, and the
    next call raised it again; with a code it knows, the code's class and the text alone.
    Neither said the connection went. Now both do: a known code keeps its class, an
    unknown one is DaemonUnavailable (the connection went, as at a hang-up), with the
    code's string in .code; attempt_reconnect rejoins."""
    fake, path = standin
    code, error, carried, said = PARTINGS[case]

    def first_answer(msg: proto.Submit) -> Packets:
        fake.last_word(raw_error(0, code, "rank 0 was evicted"))
        return []

    fake.answer_the_first_submit(first_answer)
    memory = HostMemory()
    buf = memory.alloc(64)
    before = open_fds()
    with lone_rank(path, memory) as comm:
        with pytest.raises(CommError) as failed:
            comm.all_reduce(buf.ptr, 64, dtype="f32")
        assert (type(failed.value), failed.value.code) == (error, carried), str(failed.value)
        assert said in str(failed.value)
        with pytest.raises(CommError) as again:  # (is_healthy() not asked first: the call records it)
            comm.all_reduce(buf.ptr, 64, dtype="f32")
        assert type(again.value) is error and said in str(again.value), str(again.value)
        # (the connection is gone, whatever the code: only a rejoin helps, and the call says so)
        assert str(again.value).startswith("world w is not healthy: ") and \
            str(again.value).endswith("; call attempt_reconnect"), str(again.value)
        rejoins(comm, buf)
    hellos = fake.connections(proto.Hello)
    submits = fake.connections(proto.Submit)
    assert (hellos, submits) == ([0, 1], [0, 1])
    back_to_fds(before)
    buf.close()


# How a daemon refuses a rank's rejoin with a code this client does not know (a newer
# daemon's): (the id its Error carries; the error attempt_reconnect raises)
REJOIN_REFUSALS: dict[str, tuple[Callable[[proto.Hello], int], type[CommError], str]] = {
    "at accept (id 0)": (lambda hello: 0, DaemonUnavailable, "the daemon closed the connection with"),
    "answering the hello": (lambda hello: hello.id, CommError, "the daemon refused the request with"),
}


@pytest.mark.parametrize("case", list(REJOIN_REFUSALS))
def test_a_rejoin_the_daemon_refuses_with_a_code_this_client_does_not_know_is_not_tried_again(
        standin: tuple[RecordingDaemon, str], case: str) -> None:
    """A rejoin connects again with backoff while no daemon is back to answer (none
    listening, a hang-up, one shutting down). Before: a daemon that was back, and refused
    the rejoin at accept (an Error with id 0, then it closed) with a code this client does
    not know, was taken for one not back yet, since that error is DaemonUnavailable: the
    rejoin said hello 9 times more and raised after 4.6 s (timeout 2 s, and the join's 3 s
    grace), where the same refusal answering the hello's id, or a known code at accept
    (limit), is raised at once. Now it is raised at once too, after one hello; once the
    daemon takes the rank again, attempt_reconnect rejoins."""
    fake, path = standin
    refusal_id, error, said = REJOIN_REFUSALS[case]
    refusing = [False]

    def answer(msg: proto.Message) -> Packets | None:
        if isinstance(msg, proto.Hello) and refusing[0]:
            fake.last_word(raw_error(refusal_id(msg), "evicted", "rank 0 was evicted"))
            return []
        return None

    fake.answer = answer
    memory = HostMemory()
    buf = memory.alloc(64)
    buf.view(np.float32)[:] = np.arange(16)
    before = open_fds()
    with lone_rank(path, memory, timeout=2) as comm:
        refusing[0] = True
        fake.drop()
        with pytest.raises(CommError) as refused:
            comm.attempt_reconnect()
        assert (type(refused.value), refused.value.code) == (error, "evicted"), str(refused.value)
        assert str(refused.value).startswith(said), str(refused.value)
        assert fake.connections(proto.Hello) == [0, 1]  # one try
        refusing[0] = False
        comm.attempt_reconnect()
        comm.all_reduce(buf.ptr, 64, dtype="f32")
        assert comm.is_healthy()
    hellos = fake.connections(proto.Hello)
    submits = fake.connections(proto.Submit)
    assert (hellos, submits) == ([0, 1, 2], [2])
    assert buf.view(np.float32).tolist() == list(range(16))  # (the stand-in writes nothing)
    back_to_fds(before)
    buf.close()


UNREADABLE = "the daemon's status report is not what this commd reads"
UNREADABLE_STATUS: dict[str, tuple[list[str], Callable[[int], proto.Message], str]] = {
    # (status's flags, the stand-in's answer, what `commd status` says)
    "a world without its rows": (
        [], lambda rid: proto.StatusReport(rid, {"worlds": [{"name": "w"}]}),
        f"{UNREADABLE}: KeyError: 'ranks'"),
    "a number JSON cannot carry": (
        ["--json"], lambda rid: proto.StatusReport(rid, {"uptime_s": float("nan")}),
        f"{UNREADABLE}: ValueError: "),
    # (the protocol's state machine refuses it before status.py could: its own check is a guard)
    "another reply": ([], proto.Ok, "bad packet from the daemon: daemon may not send Ok"),
}


@pytest.mark.parametrize("case", list(UNREADABLE_STATUS))
def test_a_status_report_this_commd_cannot_read_is_a_protocol_error_not_a_traceback(
        standin: tuple[RecordingDaemon, str], case: str) -> None:
    """A daemon of another version (here a stand-in) answers `commd status` with a report
    whose shape this commd does not render, or with another reply: one line naming what
    was wrong, exit 1."""
    fake, path = standin
    flags, reply, words = UNREADABLE_STATUS[case]
    fake.answer = answering(proto.StatusQuery, reply)
    root = Path(__file__).resolve().parents[2]
    done = subprocess.run([sys.executable, "-m", "commd", "status", "--socket", path, "--timeout", "5",
                           *flags], capture_output=True, text=True, timeout=20,
                          env={"PYTHONPATH": str(root), "PATH": "/usr/bin:/bin"})
    assert done.returncode == 1 and done.stdout == "", done.stderr
    assert done.stderr.startswith(f"commd: ProtocolError: {words}"), done.stderr
    assert done.stderr.count("\n") == 1, done.stderr  # one line, no traceback
