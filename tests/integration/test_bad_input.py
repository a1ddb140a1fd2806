"""Bad input gets a clear, typed error; the daemon keeps serving a world that runs throughout."""

from __future__ import annotations

import gc
import multiprocessing as mp
import os
import random
import re
import shutil
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import proto
from client import (
    CommTimeout,
    DaemonBackend,
    MismatchError,
    MisuseError,
    hostmem,
)
from commd.launch import DaemonProcess
from commd.status import query_status
from proto import ErrorCode
from tests.conftest import FaultReport, Steady
from tests.fault.ranks import on_both
from tests.integration import workers
from tests.integration.data import make_input, reduce_reference
from tests.integration.harness import RankPool, short_tmpdir, world_name
from tests.integration.rawclient import RawClient, barrier_took

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def raw(sock: str, steady: None) -> Iterator[RawClient]:
    client = RawClient(sock)
    yield client
    client.close()


def test_garbage_before_hello_is_refused_and_closed(raw: RawClient) -> None:
    raw.send_bytes(b"\xc1\x00garbage")
    err = raw.error()
    assert (err.id, err.code) == (0, ErrorCode.BAD_MESSAGE)
    assert raw.closed()


def test_call_before_hello_is_a_state_error(raw: RawClient) -> None:
    raw.send(proto.Submit(1, (proto.Barrier(),)))
    err = raw.error()
    assert err.code is ErrorCode.BAD_MESSAGE and "state" in err.message
    assert raw.closed()


def test_a_hello_past_any_epoch_is_refused_and_leaves_the_world_name_free(raw: RawClient, sock: str) -> None:
    """A world formed from a hello goes on at its epoch + 1, which no reply could carry
    for the largest u64 (before: the daemon failed in the middle of forming, answered
    INTERNAL, and kept the dead connection as the rank, the name taken for good)."""
    world = world_name()
    raw.send_map({"t": "hello", "id": 1, "version": proto.PROTOCOL_VERSION, "pid": os.getpid(),
                  "world": world, "rank": 0, "world_size": 1, "timeout_ms": 5000, "epoch": (1 << 64) - 1})
    err = raw.error()
    assert err.code is ErrorCode.BAD_MESSAGE and "epoch" in err.message
    with DaemonBackend(sock, world, 0, 1, timeout=5) as comm:
        comm.barrier()


def test_a_call_for_another_epoch_is_refused_and_the_world_goes_on(raw: RawClient) -> None:
    """Calls made before a reconnect (on another thread of the rank) moved the world on
    are refused as stale, not matched in the rebuilt world; calls for its epoch, or for
    whichever is current (0), run."""
    welcome = raw.join(world_name())
    assert isinstance(welcome, proto.Welcome)
    raw.send(proto.Reconnect(2))
    failed = raw.recv()  # (the vote fails the world first)
    assert isinstance(failed, proto.Event) and failed.epoch == welcome.epoch
    moved = raw.recv()
    assert isinstance(moved, proto.Ok) and moved.value == welcome.epoch + 1
    for request_id, epoch in ((3, welcome.epoch), (4, moved.value + 1)):
        raw.send(proto.Submit(request_id, (proto.Barrier(),), epoch))
        err = raw.error()
        assert (err.id, err.code) == (request_id, ErrorCode.STALE_EPOCH)
        assert f"made for epoch {epoch} " in err.message and f"at epoch {moved.value}" in err.message
    raw.send(proto.StreamSubmit(5, (proto.Barrier(),), 7, epoch=welcome.epoch))
    assert raw.error().code is ErrorCode.MISUSE  # (no stream events on this connection: asked first)
    for request_id, epoch in ((6, moved.value), (7, 0)):
        raw.send(proto.Submit(request_id, (proto.Barrier(),), epoch))
        assert raw.recv() == proto.Ok(request_id)


def test_a_second_attempt_reconnect_supersedes_the_first_and_the_world_forms_once(sock: str,
                                                                                   steady: None) -> None:
    """A rank asks to reconnect twice before the other rank does (another thread of it, or
    a retry after its own timeout): the first request is refused, MISUSE 'superseded', the
    second holds the rank's place, and the world is rebuilt once, at the next epoch, when
    the other rank asks; a barrier of both runs there."""
    world = world_name()
    with RawClient(sock) as a, RawClient(sock) as b:
        for client, rank in ((a, 0), (b, 1)):
            client.send(proto.Hello(1, proto.PROTOCOL_VERSION, os.getpid(), world, rank, 2, 10_000))
        first, second = a.recv(), b.recv()
        assert isinstance(first, proto.Welcome) and isinstance(second, proto.Welcome), (first, second)
        epoch = first.epoch
        a.send(proto.Reconnect(2))
        for client in (a, b):  # (the vote fails the world first)
            failed = client.recv()
            assert isinstance(failed, proto.Event) and failed.epoch == epoch, failed
        a.send(proto.Reconnect(3))
        err = a.error()
        assert (err.id, err.code) == (2, ErrorCode.MISUSE), err
        assert err.message == "superseded by a newer attempt_reconnect", err
        b.send(proto.Reconnect(4))
        assert (a.recv(), b.recv()) == (proto.Ok(3, epoch + 1), proto.Ok(4, epoch + 1))
        for client in (a, b):
            client.send(proto.Submit(5, (proto.Barrier(),), epoch + 1))
        assert (a.recv(), b.recv()) == (proto.Ok(5), proto.Ok(5))


def test_a_request_sent_again_under_an_id_still_unanswered_is_a_bad_packet(sock: str, steady: None) -> None:
    """Rank 0 sends a status query under the id of its barrier that waits for rank 1:
    answered with that id too (as it was), the client could not tell the answers apart. It
    is a bad packet (id 0, naming the id, the connection closed, the world failed for rank
    1); an id whose request was answered is free again; the unrelated world goes on."""
    world = world_name()
    with RawClient(sock) as a, RawClient(sock) as b:
        for client, rank in ((a, 0), (b, 1)):
            client.send(proto.Hello(1, proto.PROTOCOL_VERSION, os.getpid(), world, rank, 2, 10_000))
        assert isinstance(a.recv(), proto.Welcome) and isinstance(b.recv(), proto.Welcome)
        assert barrier_took(a, b, 2) < 5
        a.send(proto.StatusQuery(2))  # (the barrier's id, answered)
        report = a.recv()
        assert isinstance(report, proto.StatusReport) and report.id == 2, report
        a.send(proto.Submit(3, (proto.Barrier(),)))  # waits for rank 1's
        a.send(proto.StatusQuery(3))
        err = a.error()
        assert (err.id, err.code) == (0, ErrorCode.BAD_MESSAGE), err
        assert "request id 3 is taken: Submit #3 is not answered yet" in err.message, err
        assert a.closed()
        failed = b.recv()
        assert isinstance(failed, proto.Event) and failed.kind is proto.EventKind.WORLD_FAILED, failed
        b.send(proto.Submit(3, (proto.Barrier(),)))
        assert b.error().code is ErrorCode.WORLD_FAILED


def test_oversized_packet(raw: RawClient) -> None:
    raw.send_bytes(b"\x00" * (proto.MAX_MESSAGE_BYTES + 100))
    err = raw.error()
    assert err.code is ErrorCode.BAD_MESSAGE and "limit" in err.message
    assert raw.closed()


def test_an_empty_packet_is_refused_not_taken_for_a_hang_up(sock: str, steady: None) -> None:
    """SOCK_SEQPACKET carries empty packets, and the daemon read one as the peer closing:
    the rank was dropped without a word (it read EOF, no error) and its world failed as
    "connection lost". A client still connected gets BAD_MESSAGE for it, as for any
    packet that does not parse."""
    world = world_name()
    with RawClient(sock) as a, RawClient(sock) as b:
        a.send(proto.Hello(1, proto.PROTOCOL_VERSION, os.getpid(), world, 0, 2, 5000))
        b.send(proto.Hello(1, proto.PROTOCOL_VERSION, os.getpid(), world, 1, 2, 5000))
        assert isinstance(a.recv(), proto.Welcome) and isinstance(b.recv(), proto.Welcome)
        a.send_bytes(b"")
        err = a.error()
        assert (err.id, err.code) == (0, ErrorCode.BAD_MESSAGE) and "undecodable" in err.message, err
        assert a.closed()
        failed = b.recv()  # (its world fails with the refused rank, as for any bad packet)
        assert isinstance(failed, proto.Event) and failed.code is ErrorCode.WORLD_FAILED, failed


def test_wrong_protocol_version(raw: RawClient) -> None:
    raw.send(proto.Hello(1, 99, os.getpid(), world_name(), 0, 1, 1000))
    err = raw.error()
    assert err.code is ErrorCode.VERSION and "99" in err.message
    assert raw.closed()


def test_invalid_hello_values(raw: RawClient, sock: str) -> None:
    raw.send_map({"t": "hello", "id": 1, "version": proto.PROTOCOL_VERSION, "pid": 1, "world": "w", "rank": 5,
                  "world_size": 2, "timeout_ms": 1000})
    err = raw.error()
    assert err.code is ErrorCode.BAD_MESSAGE and "rank=5" in err.message
    with pytest.raises(MisuseError, match="rank=4"):
        DaemonBackend(sock, world_name(), 4, 4, timeout=2)
    with pytest.raises(MisuseError, match="world name"):
        DaemonBackend(sock, "bad name with spaces", 0, 1, timeout=2)


def test_a_socket_path_that_is_no_text_path_is_refused_before_connecting(sock: str, steady: None) -> None:
    # connect() cuts a path at its NUL: this one reached the daemon at `sock` and joined
    with pytest.raises(MisuseError, match="NUL"):
        DaemonBackend(sock + "\0junk", world_name(), 0, 1, timeout=2)
    with pytest.raises(MisuseError, match="socket_path must be a path, got int"):
        DaemonBackend(123, world_name(), 0, 1, timeout=2)  # type: ignore[arg-type]
    with pytest.raises(MisuseError, match="socket_path must be text"):
        DaemonBackend(sock.encode(), world_name(), 0, 1, timeout=2)  # type: ignore[arg-type]
    with DaemonBackend(Path(sock), world_name(), 0, 1, timeout=2) as comm:
        comm.barrier()


def test_a_stream_or_device_that_cannot_be_one_is_refused_by_name(sock: str, steady: None) -> None:
    with pytest.raises(MisuseError, match="stream=-1 is not a CUDA stream handle"):
        DaemonBackend(sock, world_name(), 0, 1, timeout=2, stream=-1)  # (was taken, a host-only run)
    with pytest.raises(MisuseError, match="device=-1 is not a GPU ordinal"):  # (said "not a rank")
        DaemonBackend(sock, world_name(), 0, 1, timeout=2, device=-1)


def test_a_calls_stream_that_cannot_be_one_is_refused_by_name_and_the_call_not_made(sock: str,
                                                                                    steady: None) -> None:
    """all_reduce_async's compute_stream went unchecked (send_to's stream, the same value,
    was refused): on host memory -1 or 2**64 was taken and the all_reduce made, and on a GPU
    it would reach the driver as a stream handle. Refused by name as send_to's is, the call
    takes no place in the order: rank 1's all_reduce pairs with rank 0's next one."""
    name = world_name()
    comms = on_both(lambda r: DaemonBackend(sock, name, r, 2, timeout=10))
    try:
        bufs = [hostmem.alloc(8) for _ in range(2)]
        for r, buf in enumerate(bufs):
            buf.view(np.int32)[:] = [r + 1, 10 * (r + 1)]

        def rank(r: int) -> list[str]:
            refused = []
            if r == 0:
                for stream in (-1, 1 << 64):
                    with pytest.raises(MisuseError) as in_reduce:
                        comms[0].all_reduce_async(bufs[0].ptr, 8, stream, dtype="i32")
                    with pytest.raises(MisuseError) as in_send:
                        comms[0].send_to(bufs[0].ptr, 8, 1, stream)
                    refused += [str(in_reduce.value), str(in_send.value)]
            comms[r].all_reduce_async(bufs[r].ptr, 8, 0, dtype="i32")
            return refused

        refused, _ = on_both(rank)
        assert refused == [f"{name}={stream} is not {what}" for stream in (-1, 1 << 64)
                           for name, what in (("compute_stream", "a CUDA stream handle"),
                                              ("stream", "an unsigned 64-bit integer"))]
        assert [buf.view(np.int32).tolist() for buf in bufs] == [[3, 30]] * 2
        assert all(comm.is_healthy() for comm in comms)
    finally:
        for comm in comms:
            comm.close()

def test_world_conflict_and_duplicate_rank(sock: str, steady: None) -> None:
    world = world_name()
    with RawClient(sock) as first:
        first.send(proto.Hello(1, proto.PROTOCOL_VERSION, os.getpid(), world, 0, 2, 5000))  # waits for rank 1
        time.sleep(0.05)
        with RawClient(sock) as other:
            reply = other.join(world, 1, 3)
            assert isinstance(reply, proto.Error) and reply.code is ErrorCode.WORLD_CONFLICT
            assert "2 ranks" in reply.message
        with RawClient(sock) as dup:
            reply = dup.join(world, 0, 2)
            assert isinstance(reply, proto.Error) and reply.code is ErrorCode.DUPLICATE_RANK
            assert dup.closed()
        with pytest.raises(MisuseError, match="already connected"):
            DaemonBackend(sock, world, 0, 2, timeout=2)


def test_join_timeout_names_missing_ranks(sock: str, steady: None) -> None:
    start = time.monotonic()
    with pytest.raises(CommTimeout, match=r"ranks \[1, 2\] did not arrive"):
        DaemonBackend(sock, world_name(), 0, 3, timeout=0.5)
    assert time.monotonic() - start < 5


def _joined_raw(sock: str) -> RawClient:
    client = RawClient(sock)
    welcome = client.join(world_name())
    assert isinstance(welcome, proto.Welcome) and welcome.epoch == 1
    return client


def test_out_of_bounds_and_unknown_buffers(sock: str, steady: None) -> None:
    with _joined_raw(sock) as raw:
        assert isinstance(raw.import_memfd(2, 7, 4096), proto.Ok)
        cases = [
            (proto.AllReduce(proto.Mem(7, 4000), 200), ErrorCode.BAD_MEMORY, "outside"),
            (proto.AllReduce(proto.Mem(7, 1 << 40), 2), ErrorCode.BAD_MEMORY, "outside"),
            (proto.AllGather(proto.Mem(7, 1), proto.Mem(7, 0), 4096), ErrorCode.BAD_MEMORY, "outside"),
            (proto.AllReduce(proto.Mem(99, 0), 2), ErrorCode.UNKNOWN_BUFFER, "99"),
            (proto.Broadcast(proto.Mem(7, 0), 8, 3), ErrorCode.BAD_RANK, "root=3"),
            (proto.Send(proto.Mem(7, 0), 8, 1), ErrorCode.BAD_RANK, "peer=1"),
        ]
        for i, (op, code, text) in enumerate(cases, start=10):
            raw.send(proto.Submit(i, (op,)))
            err = raw.error()
            assert (err.id, err.code) == (i, code) and text in err.message, err
        raw.send(proto.Submit(50, (proto.AllReduce(proto.Mem(7, 0), 4096),)))  # still usable
        assert raw.recv() == proto.Ok(50)


def test_a_refused_group_names_its_call_at_fault(sock: str, steady: None) -> None:
    """Rank 0's group of two all_reduces, the second on memory freed before group_end, is
    refused whole, and the error says which call and why (before: "buffer 2 was never
    imported or was freed", an id the worker never saw). Made again on live memory, the
    group pairs with rank 1's and both sums are right."""
    name = world_name()
    comms = on_both(lambda r: DaemonBackend(sock, name, r, 2, timeout=10))
    try:
        bufs = [[hostmem.alloc(8) for _ in range(2)] for _ in range(2)]
        for r in range(2):
            for i in range(2):
                bufs[r][i].view(np.int32)[:] = [r + 1, 10 * (i + 1) * (r + 1)]

        def group(r: int) -> None:
            comms[r].group_start()
            for buf in bufs[r]:
                comms[r].all_reduce(buf.ptr, 8, dtype="i32")
            comms[r].group_end()

        def rank(r: int) -> Exception | None:
            refused = None
            if r == 0:
                freed = hostmem.alloc(8)
                comms[0].group_start()
                comms[0].all_reduce(bufs[0][0].ptr, 8, dtype="i32")
                comms[0].all_reduce(freed.ptr, 8, dtype="i32")
                del freed  # (the daemon hears of it with the group's submit)
                gc.collect()
                with pytest.raises(MisuseError) as raised:
                    comms[0].group_end()
                refused = raised.value
            group(r)
            return refused

        refused, _ = on_both(rank)
        assert isinstance(refused, MisuseError)
        assert "call #1 of the group, all_reduce(bytes=8, dtype=i32, op=sum)" in str(refused), refused
        assert "freed" in str(refused), refused
        assert [[b.view(np.int32).tolist() for b in row] for row in bufs] == [[[3, 30], [3, 60]]] * 2
    finally:
        for comm in comms:
            comm.close()


def test_unknown_and_freed_handles(sock: str, steady: None) -> None:
    with _joined_raw(sock) as raw:
        assert isinstance(raw.import_memfd(2, 7, 4096), proto.Ok)
        raw.send(proto.Deregister(3, 12345))
        assert raw.error().code is ErrorCode.UNKNOWN_HANDLE
        raw.send(proto.SymFree(4, 7))  # an import, not a symmetric allocation
        assert raw.error().code is ErrorCode.UNKNOWN_HANDLE
        for nbytes in (0, 8):  # (an empty registration names its buffer all the same)
            raw.send(proto.Register(4, proto.Mem(99, 0), nbytes))
            err = raw.error()
            assert err.code is ErrorCode.UNKNOWN_BUFFER and "99" in err.message, err
        raw.send(proto.Forget((7,)))
        raw.send(proto.Submit(5, (proto.AllReduce(proto.Mem(7, 0), 8),)))
        assert raw.error().code is ErrorCode.UNKNOWN_BUFFER
        assert isinstance(raw.import_memfd(6, 7, 4096), proto.Ok)  # the id may be imported again


def test_a_repeated_call_finds_its_buffer_freed_or_replaced(sock: str, steady: None) -> None:
    """The daemon keeps what it checked of a repeated call's ops (the same bytes each time);
    its buffer it looks up at every call: freed, or imported again smaller, the same
    packet is refused for it, and answered again once the buffer fits."""
    call = proto.AllReduce(proto.Mem(7, 60), 8)
    with _joined_raw(sock) as raw:
        assert isinstance(raw.import_memfd(2, 7, 4096), proto.Ok)
        for request_id in (3, 4):
            raw.send(proto.Submit(request_id, (call,)))
            assert raw.recv() == proto.Ok(request_id)
        raw.send(proto.Forget((7,)))
        raw.send(proto.Submit(5, (call,)))
        err = raw.error()
        assert (err.id, err.code) == (5, ErrorCode.UNKNOWN_BUFFER) and "buffer 7" in err.message, err
        assert isinstance(raw.import_memfd(6, 7, 64), proto.Ok)
        raw.send(proto.Submit(7, (call,)))
        err = raw.error()
        assert (err.id, err.code) == (7, ErrorCode.BAD_MEMORY) and "[60, 68)" in err.message, err
        raw.send(proto.Forget((7,)))
        assert isinstance(raw.import_memfd(8, 7, 4096), proto.Ok)
        raw.send(proto.Submit(9, (call,)))
        assert raw.recv() == proto.Ok(9)


def test_bad_memory_handles(sock: str, steady: None) -> None:
    with _joined_raw(sock) as raw:
        unsealed = os.memfd_create("unsealed")
        os.ftruncate(unsealed, 4096)
        reader, writer = os.pipe()
        sealed_small = os.memfd_create("small", os.MFD_ALLOW_SEALING)
        os.ftruncate(sealed_small, 100)
        import fcntl

        fcntl.fcntl(sealed_small, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK)
        # (its refusal said "cannot map host memory: [Errno 1] Operation not permitted")
        read_only = os.memfd_create("read-only", os.MFD_ALLOW_SEALING)
        os.ftruncate(read_only, 4096)
        fcntl.fcntl(read_only, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_WRITE)
        for i, (fd, text) in enumerate([(unsealed, "sealed"), (reader, "memfd"),
                                        (sealed_small, "claimed"),
                                        (read_only, "memfd is sealed against writing")], start=2):
            raw.send(proto.Import(i, 10 + i, proto.MemKind.HOST, 4096), [fd])
            err = raw.error()
            assert err.code is ErrorCode.BAD_MEMORY and text in err.message, err
        raw.send(proto.Import(9, 30, proto.MemKind.CUDA_IPC, 4096, b"\x00" * 64))
        assert raw.error().code is ErrorCode.MISUSE
        for fd in (unsealed, reader, writer, sealed_small, read_only):
            os.close(fd)
        raw.send(proto.Import(10, 31, proto.MemKind.HOST, 4096))  # the fd is missing
        assert raw.error().code is ErrorCode.BAD_MESSAGE
        assert raw.closed()


def test_bytes_not_a_multiple_of_the_dtype(sock: str, steady: None) -> None:
    with _joined_raw(sock) as raw:
        raw.send_map({"t": "submit", "id": 2, "ops": [
            {"t": "all_reduce", "buf": [1, 0], "nbytes": 3, "dtype": "bf16", "op": "sum"}]})
        err = raw.error()
        assert err.code is ErrorCode.BAD_MESSAGE and "multiple" in err.message
    with DaemonBackend(sock, world_name(), 0, 1, timeout=5) as comm:
        buf = hostmem.alloc(64)
        with pytest.raises(MisuseError, match="multiple"):
            comm.all_reduce(buf.ptr, 3)
        with pytest.raises(MisuseError, match="multiple"):
            comm.reduce_scatter(buf.ptr, buf.ptr, 6, dtype="f32")
        with pytest.raises(MisuseError, match="dtype"):
            comm.all_reduce(buf.ptr, 8, dtype="f128")
        # (unhashable: no member's value, but the lookup by value raised TypeError)
        with pytest.raises(MisuseError, match=re.escape("dtype ['f32'] is not one of")):
            comm.all_reduce(buf.ptr, 8, dtype=["f32"])  # type: ignore[arg-type]
        with pytest.raises(MisuseError, match=re.escape("op {'sum': 1} is not one of")):
            comm.reduce_scatter(buf.ptr, buf.ptr, 4, op={"sum": 1})  # type: ignore[arg-type]
        with pytest.raises(MisuseError, match="not in host memory"):
            comm.all_reduce(12345, 8)
        with pytest.raises(MisuseError, match="past the end"):
            comm.all_reduce(buf.ptr + 60, 8)
        with pytest.raises(MisuseError, match="root=3"):
            comm.broadcast(buf.ptr, 8, 3)
        with pytest.raises(MisuseError, match="group_end without"):
            comm.group_end()
        comm.all_reduce(buf.ptr, 64)  # the backend still works after its misuse
        assert comm.is_healthy()


def test_a_registration_of_memory_the_daemon_cannot_open_is_misuse_and_the_ranks_go_on(
        sock: str, steady: None) -> None:
    """register_buffer of no bytes, of fewer than none, past its buffer's end, or of a pointer
    into no host buffer is a MisuseError saying which (found in the client, before a request
    is made); then both ranks register their buffers, sum on them, and let go of them as
    usual, and a handle let go of is no longer known."""
    name = world_name()
    comms = on_both(lambda r: DaemonBackend(sock, name, r, 2, timeout=10))
    try:
        bufs = [hostmem.alloc(64) for _ in range(2)]
        for r, buf in enumerate(bufs):
            buf.view(np.int32)[:2] = [r + 1, 10 * (r + 1)]
        for (ptr, nbytes), words in (((bufs[0].ptr, 0), "cannot register an empty buffer"),
                                     ((bufs[0].ptr, -1), "bytes must not be negative, got -1"),
                                     ((bufs[0].ptr, 65), "runs past the end of host buffer"),
                                     ((bufs[0].ptr + 64, 8), "is not in host memory the daemon can open"),
                                     ((0, 8), "pointer 0x0 is not in host memory")):
            with pytest.raises(MisuseError, match=re.escape(words)):
                comms[0].register_buffer(ptr, nbytes)

        def rank(r: int) -> list[int]:
            handle = comms[r].register_buffer(bufs[r].ptr, 64)
            comms[r].all_reduce(bufs[r].ptr, 8, dtype="i32")
            comms[r].deregister_buffer(handle)
            with pytest.raises(MisuseError, match=f"^handle {handle} is not registered$"):
                comms[r].deregister_buffer(handle)
            return [int(v) for v in bufs[r].view(np.int32)[:2]]

        assert on_both(rank) == [[3, 30], [3, 30]]
        assert all(comm.is_healthy() for comm in comms)
    finally:
        for comm in comms:
            comm.close()


def test_calls_after_close(sock: str, steady: None) -> None:
    comm = DaemonBackend(sock, world_name(), 0, 1, timeout=5)
    buf = hostmem.alloc(8)
    comm.close()
    comm.close()  # idempotent
    for call in (lambda: comm.all_reduce(buf.ptr, 8), comm.barrier, comm.attempt_reconnect,
                 lambda: comm.register_buffer(buf.ptr, 8), comm.group_start):
        with pytest.raises(MisuseError, match="closed"):
            call()
    assert not comm.is_healthy()


@pytest.mark.parametrize("kind", ["bytes", "op", "dtype"])
def test_mismatched_collectives(pool: RankPool, sock: str, steady: Steady, fault_report: FaultReport,
                                kind: str) -> None:
    world, n, unrelated = world_name(), 3, steady.errors()
    results = [o.unwrap() for o in pool.run(workers.mismatch, [(sock, world, r, n, kind) for r in range(n)])]
    for res in results:
        name, message = res["error"]
        assert name == MismatchError.__name__
        # rank 1 is the odd one out; whichever rank arrived first is named beside it
        assert "call 1" in message and "rank 1 called" in message
        assert "rank 0 called" in message or "rank 2 called" in message
        assert res["healthy_after"] is False
        assert res["epoch"] == 2 and res["healthy_end"] is True
        want = reduce_reference([make_input(5, r, 16, "f32", "sum") for r in range(n)], "f32", "sum")
        assert res["result"] == want.tobytes()
    odd_call = {"bytes": "bytes=16", "op": "broadcast(bytes=8, root=0)", "dtype": "dtype=f32"}[kind]
    assert all(odd_call in res["error"][1] for res in results)
    fault_report.add(f"mismatched collectives on one daemon ({kind})", float("nan"), float("nan"),
                     steady.errors() - unrelated, "n/a")


def test_rank_leaving_fails_the_world_and_a_new_process_rejoins(pool: RankPool, sock: str,
                                                                  steady: None) -> None:
    world = world_name()
    outcomes = pool.run(workers.leave_early, [(sock, world, r, 2) for r in range(2)])
    rank0, rank1 = [o.unwrap() for o in outcomes]
    assert rank0["barrier"] == "WorldFailed"
    assert rank0["healthy"] is False and rank0["fast_fail"] == "WorldFailed"
    assert rank0["epoch"] == 2 and rank0["healthy_end"] is True
    assert rank1["epoch"] == 2


def test_random_garbage_never_takes_the_daemon_down(sock: str, steady: None) -> None:
    rng = random.Random(1234)
    valid = proto.encode(proto.Hello(1, proto.PROTOCOL_VERSION, 1, "w", 0, 1, 1000))
    for i in range(300):
        if i % 2:
            data = bytes(rng.getrandbits(8) for _ in range(rng.randint(1, 300)))
        else:
            mutated = bytearray(valid)
            for _ in range(rng.randint(1, 4)):
                mutated[rng.randrange(len(mutated))] = rng.getrandbits(8)
            data = bytes(mutated)
        with RawClient(sock) as raw:
            raw.send_bytes(data)
            reply = raw.recv()
            assert isinstance(reply, proto.Error | proto.Welcome | None), reply
    with DaemonBackend(sock, world_name(), 0, 1, timeout=5) as comm:
        comm.barrier()


def test_peer_credentials_are_checked(daemon: DaemonProcess, steady: None) -> None:
    """A uid outside the allow-list is refused even when the file mode would let it connect."""
    sock = str(daemon.socket_path)
    top = os.path.dirname(os.path.dirname(sock))
    os.chmod(top, 0o711)
    os.chmod(os.path.dirname(sock), 0o755)
    os.chmod(sock, 0o666)
    try:
        ctx = mp.get_context("spawn")
        results = ctx.Queue()
        proc = ctx.Process(target=_connect_as_nobody, args=(sock, results))
        proc.start()
        outcome = results.get(timeout=20)
        proc.join(10)
    finally:
        os.chmod(sock, 0o660)
        os.chmod(os.path.dirname(sock), 0o750)
        os.chmod(top, 0o700)
    assert outcome[0] == "AccessDenied" and "uid 65534" in outcome[1]


def _connect_as_nobody(sock: str, results: Any, groups: list[int] | None = None) -> None:
    os.setgroups(groups or [])
    os.setgid(65534)
    os.setuid(65534)
    try:
        with DaemonBackend(sock, world_name(), 0, 1, timeout=5) as comm:
            comm.barrier()
        results.put(("joined", ""))
    except Exception as exc:
        results.put((type(exc).__name__, str(exc)))


@pytest.mark.parametrize("member", [True, False])
def test_a_supplementary_group_admits(member: bool) -> None:
    """`--allow-gid G` admits a process holding G only as a supplementary group (a worker
    added to the group `commd`), which SO_PEERCRED alone does not show."""
    tmp = short_tmpdir()
    try:
        with DaemonProcess(Path(tmp) / "run" / "commd.sock", args=["--allow-gid", "4242"]) as d:
            os.chmod(tmp, 0o711)
            os.chmod(d.socket_path.parent, 0o755)
            os.chmod(d.socket_path, 0o666)
            ctx = mp.get_context("spawn")
            results = ctx.Queue()
            proc = ctx.Process(target=_connect_as_nobody, args=(str(d.socket_path), results,
                                                                [4242] if member else []))
            proc.start()
            outcome = results.get(timeout=20)
            proc.join(10)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    if member:
        assert outcome == ("joined", "")
    else:
        assert outcome[0] == "AccessDenied" and "uid 65534" in outcome[1]


def test_socket_is_private(daemon: DaemonProcess) -> None:
    mode = os.stat(daemon.socket_path).st_mode & 0o777
    assert mode == 0o660
    assert os.stat(os.path.dirname(daemon.socket_path)).st_mode & 0o777 == 0o750
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as stream, \
            socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as packets:
        with pytest.raises(OSError):  # (EPROTOTYPE) the daemon's socket is no stream socket
            stream.connect(str(daemon.socket_path))
        packets.connect(str(daemon.socket_path))
        assert packets.getsockopt(socket.SOL_SOCKET, socket.SO_TYPE) == socket.SOCK_SEQPACKET


def test_a_world_with_a_join_token_refuses_other_tokens(sock: str, steady: None) -> None:
    from client import AccessDenied

    world = world_name()
    with RawClient(sock) as first:
        first.send(proto.Hello(1, proto.PROTOCOL_VERSION, os.getpid(), world, 0, 2, 5000, token="job-a"))
        time.sleep(0.05)
        for token in ("job-b", None):
            with pytest.raises(AccessDenied, match="join token"):
                DaemonBackend(sock, world, 1, 2, timeout=2, token=token)
        with DaemonBackend(sock, world, 1, 2, timeout=5, token="job-a") as comm:
            welcome = first.recv()
            assert isinstance(welcome, proto.Welcome) and comm.epoch == welcome.epoch == 1


def test_a_bootstrap_address_where_the_daemon_has_no_peers_or_the_world_has_none_is_misuse() -> None:
    """A rank that gives a bootstrap address to a daemon with no peer secret, or to a world
    its other ranks joined without one, gets a MisuseError that says which; the world's
    ranks that agree still form it and compute, and the daemon serves on."""
    tmp = short_tmpdir()
    try:
        with DaemonProcess(Path(tmp) / "run" / "commd.sock", log=subprocess.DEVNULL) as daemon:
            sock = str(daemon.socket_path)
            with pytest.raises(MisuseError, match="this daemon has no peer secret configured, so it "
                                                  "cannot take part in a world spread over daemons"):
                DaemonBackend(sock, world_name(), 0, 2, bootstrap="127.0.0.1:1", timeout=5)
            world = world_name()
            with RawClient(sock) as first:
                first.send(proto.Hello(1, proto.PROTOCOL_VERSION, os.getpid(), world, 0, 2, 10_000))
                with pytest.raises(MisuseError, match=f"world {world} is not spread over daemons here; "
                                                      "every rank must give .or omit. the bootstrap address"):
                    DaemonBackend(sock, world, 1, 2, bootstrap="127.0.0.1:1", timeout=5)
                with DaemonBackend(sock, world, 1, 2, timeout=5) as second:
                    assert isinstance(first.recv(), proto.Welcome)
                    first.send(proto.Submit(2, (proto.Barrier(),)))
                    second.barrier()
                    assert first.recv() == proto.Ok(2)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


@pytest.mark.parametrize(("bootstrap", "why"), [
    ("nonsense", "'nonsense' is not HOST:PORT"),
    ("127.0.0.1:99999", "port 99999 is not a TCP port"),
    ("::1:7420", "'::1:7420': an IPv6 host goes in brackets, [ADDRESS]:PORT"),
])
def test_a_bootstrap_address_that_is_not_host_and_port_is_misuse(bootstrap: str, why: str) -> None:
    """A rank whose bootstrap address does not read as HOST:PORT (a typo) gets a MisuseError
    naming it, and no world is made of it: the ranks that give the right address form theirs
    and compute (before: the daemon made the world, its dial failed, and the rank got
    PeerLost, "cannot reach the daemon at nonsense: ...", a WorldFailed that asks for
    attempt_reconnect, which fails the same way)."""
    tmp = short_tmpdir()
    try:
        with DaemonProcess(Path(tmp) / "run" / "commd.sock", log=subprocess.DEVNULL,
                           env={"COMMD_PEER_SECRET": "test-secret-0123456789"},
                           args=["--peer-listen", "127.0.0.1:0"]) as daemon:
            sock, world = str(daemon.socket_path), world_name()
            with pytest.raises(MisuseError) as refused:
                DaemonBackend(sock, world, 1, 2, bootstrap=bootstrap, timeout=5)
            assert str(refused.value) == ("the bootstrap address is not the root daemon's peer "
                                          f"HOST:PORT: {why}")
            assert query_status(sock, 5)["worlds"] == []
            ranks = on_both(lambda rank: DaemonBackend(sock, world, rank, 2, timeout=5,
                                                       bootstrap=daemon.peer_address()))
            try:
                assert on_both(lambda rank: _sum_of_ranks(ranks[rank])) == [3.0, 3.0]
            finally:
                for comm in ranks:
                    comm.close()
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _sum_of_ranks(comm: DaemonBackend) -> float:
    """The f32 all_reduce of rank + 1 over the world."""
    with hostmem.alloc(4) as buf:
        buf.view(np.float32)[0] = comm.rank() + 1
        comm.all_reduce(buf.ptr, 4, dtype="f32")
        return float(buf.view(np.float32)[0])


def test_stream_events_sent_to_the_host_engine_are_refused_and_the_rank_goes_on() -> None:
    """A client that sends CUDA stream events to a host-engine daemon (another build's, or a
    hand-made one: ours sends none to it) is told the host engine has no streams, a call on
    that stream is refused as having no events, and the rank's world goes on."""
    tmp = short_tmpdir()
    try:
        with DaemonProcess(Path(tmp) / "run" / "commd.sock", log=subprocess.DEVNULL) as daemon, \
                RawClient(str(daemon.socket_path)) as rank:
            assert isinstance(rank.join(world_name()), proto.Welcome)
            rank.send(proto.StreamEvents(2, 5, bytes(64), bytes(64)))
            assert rank.error() == proto.Error(2, proto.ErrorCode.MISUSE, "the host engine has no streams: "
                                               "stream events need a GPU engine")
            rank.send(proto.StreamSubmit(3, (proto.Barrier(),), 5))
            assert rank.error() == proto.Error(3, proto.ErrorCode.MISUSE,
                                               "stream 5 has no events: send stream_events first")
            rank.send(proto.Submit(4, (proto.Barrier(),)))
            assert rank.recv() == proto.Ok(4)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
