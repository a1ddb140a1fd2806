"""The NCCL engine's own logic, over the stand-in for CUDA and NCCL (tests/contract/fakegpu.py):
opening workers' memory, non-blocking init, ops that wait on other daemons, async
errors, abort, and memory let go only when no op uses it."""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import logging
import os
import re
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from pathlib import Path

import numpy as np
import pytest

from commd.cluster import Inbox
from commd.engine.base import (
    EMPTY,
    NO_TAG,
    AllReduceOp,
    BarrierOp,
    CallTag,
    Order,
    RecvOp,
    SendOp,
    StillOnDevice,
    TransferOp,
)
from commd.engine.bindings import BindingsGpu
from commd.engine.completion import WaitNotStarted
from commd.engine.gpu import CommState, GpuError, Imported, Origin
from commd.engine.nccl import NcclEngine
from commd.engine.ncclbatch import Launch, _by_request
from commd.engine.ncclcomm import NcclCommunicator
from commd.engine.ncclmemory import NcclEvents, NcclMapping, NcclRegion
from commd.engine.stuckwatch import StuckWatch
from commd.errors import CallError
from proto import DType, ErrorCode, MemKind, ReduceOp
from proto import peer as p
from tests import fakecuda
from tests.contract.fakegpu import FakeGpu
from tests.integration.data import make_input, reduce_reference
from tests.integration.harness import eventually as until

pytestmark = pytest.mark.timeout(30)
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def gpu() -> Iterator[FakeGpu]:
    device = FakeGpu(devices=2, init_polls=3, multi_rank_gpu=True)
    yield device
    assert device.violations == []  # nothing a GPU would not have let pass


@pytest.fixture
def engine(gpu: FakeGpu) -> Iterator[NcclEngine]:
    eng = NcclEngine(gpu)
    yield eng
    eng.close()


def ipc_mapping(engine: NcclEngine, gpu: FakeGpu, data: bytes, device: int = 0) -> NcclMapping:
    ptr = gpu.worker_alloc(data, device)
    return engine.import_memory(MemKind.CUDA_IPC, len(data), gpu.export_ipc(ptr), None)


def vmm_mapping(engine: NcclEngine, gpu: FakeGpu, data: bytes, device: int = 0) -> NcclMapping:
    """Memory NCCL registers (a worker's cuMem allocation; cudaMalloc's it does not)."""
    fd = gpu.export_vmm(gpu.worker_alloc(data, device))
    try:
        return engine.import_memory(MemKind.CUDA_VMM, len(data), b"", fd)
    finally:
        os.close(fd)


def fd_is_open(fd: int) -> bool:
    try:
        os.fstat(fd)
        return True
    except OSError:
        return False


def test_ipc_memory_is_opened_at_another_address_over_the_same_bytes(engine: NcclEngine,
                                                                     gpu: FakeGpu) -> None:
    ptr = gpu.worker_alloc(b"abcdefgh")
    mapping = engine.import_memory(MemKind.CUDA_IPC, 8, gpu.export_ipc(ptr), None)
    region = mapping.region(2, 4)
    assert region.ptr != ptr + 2 and gpu.read(region.ptr, 4) == b"cdef"
    gpu.copy_in(region.ptr, b"WXYZ")
    assert gpu.read(ptr, 8) == b"abWXYZgh"  # the worker sees the daemon's writes
    with pytest.raises(CallError) as info:
        mapping.region(6, 3)
    assert info.value.code is ErrorCode.BAD_MEMORY and "outside the 8-byte allocation" in info.value.message
    mapping.close()
    with pytest.raises(CallError) as info:
        mapping.region(0, 1)
    assert info.value.code is ErrorCode.UNKNOWN_BUFFER


async def test_device_memory_is_let_go_off_the_loop(engine: NcclEngine, gpu: FakeGpu) -> None:
    """cuMemFree and cuMemUnmap may wait for the whole device, where a kernel may wait for
    an op only the loop would launch: they run on a thread of their own. ncclMemFree, an
    NCCL call none other may run beside while an abort does, runs through the NCCL gate."""
    before = gpu.allocations
    ipc = engine.import_memory(MemKind.CUDA_IPC, 8, gpu.export_ipc(gpu.worker_alloc(b"x" * 8)), None)
    vmm = vmm_mapping(engine, gpu, b"y" * 8)
    shared, fd = engine.allocate(64)
    os.close(fd)
    for mapping in (ipc, vmm, shared):
        mapping.close()
    engine.close()  # waits for the frees it was asked for
    assert dict(gpu.released_on) == {Origin.IPC: "commd-cuda-free_0", Origin.VMM: "commd-cuda-free_0",
                                     Origin.NCCL: "commd-nccl-wait_0"}
    assert len(gpu.released_on) == 3
    assert gpu.allocations == before + 2  # the workers' own two remain


def test_bad_handles_are_typed_errors_and_fds_stay_the_callers(engine: NcclEngine, gpu: FakeGpu) -> None:
    """(The session closes a client's fds, off the loop where that may wait: FdCloser.)"""
    for handle in (b"short", b"\x00" * 64):
        with pytest.raises(CallError) as info:
            engine.import_memory(MemKind.CUDA_IPC, 8, handle, None)
        assert info.value.code is ErrorCode.BAD_MEMORY
    stranger = os.memfd_create("not-exported")
    with pytest.raises(CallError) as info:
        engine.import_memory(MemKind.CUDA_VMM, 8, b"", stranger)
    assert info.value.code is ErrorCode.BAD_MEMORY and fd_is_open(stranger)
    host = os.memfd_create("host")
    with pytest.raises(CallError) as info:
        engine.import_memory(MemKind.HOST, 8, b"", host)
    assert info.value.code is ErrorCode.MISUSE and fd_is_open(host)
    os.close(stranger)
    os.close(host)


def test_vmm_memory_is_imported_from_its_fd(engine: NcclEngine, gpu: FakeGpu) -> None:
    ptr = gpu.worker_alloc(b"\x01" * 64, device=1)
    fd = gpu.export_vmm(ptr)
    mapping = engine.import_memory(MemKind.CUDA_VMM, 64, b"", fd)
    assert fd_is_open(fd) and mapping.device == 1
    os.close(fd)  # (the mapping needs it no more)
    assert gpu.read(mapping.region(0, 64).ptr, 64) == b"\x01" * 64
    mapping.close()


async def test_an_op_waits_for_the_non_blocking_init_then_runs_on_each_ranks_device(
        engine: NcclEngine, gpu: FakeGpu) -> None:
    bufs = {r: ipc_mapping(engine, gpu, bytes([r + 1]) * 8, device=r).region(0, 8) for r in range(2)}
    comm = engine.communicator("w", 1, 2, [0, 1], devices={0: 0, 1: 1})
    await comm.run(AllReduceOp(bufs, DType.U8, ReduceOp.SUM))
    assert [gpu.read(b.ptr, 8) for b in bufs.values()] == [b"\x03" * 8] * 2
    assert gpu.launches == 2  # the init group, then one group for both ranks' all_reduce


async def test_two_daemons_meet_through_the_roots_unique_id(gpu: FakeGpu) -> None:
    """Two engines on one fake machine stand for two daemons: each holds one rank, on a
    GPU of its own (NCCL refuses two ranks of a communicator on one GPU by default)."""
    root, member = NcclEngine(gpu), NcclEngine(gpu)
    try:
        uid = root.unique_id()
        a = ipc_mapping(root, gpu, b"\x05" * 4).region(0, 4)
        b = ipc_mapping(member, gpu, b"\x07" * 4, device=1).region(0, 4)
        ca = root.communicator("w", 1, 2, [0], devices={0: 0}, unique_id=uid)
        cb = member.communicator("w", 1, 2, [1], devices={1: 1}, unique_id=uid)
        first = asyncio.ensure_future(ca.run(AllReduceOp({0: a}, DType.U8, ReduceOp.MAX)))
        await asyncio.sleep(0.2)
        assert not first.done()  # rank 0's all_reduce waits on the device for rank 1
        await cb.run(AllReduceOp({1: b}, DType.U8, ReduceOp.MAX))
        await asyncio.wait_for(first, 5)
        assert gpu.read(a.ptr, 4) == gpu.read(b.ptr, 4) == b"\x07" * 4
        payload = ipc_mapping(root, gpu, b"hello").region(0, 5)
        landing = ipc_mapping(member, gpu, b"\x00" * 5, device=1).region(0, 5)
        await asyncio.gather(ca.run(SendOp(0, 1, payload, NO_TAG)), cb.run(RecvOp(0, 1, landing, NO_TAG)))
        assert gpu.read(landing.ptr, 5) == b"hello"
    finally:
        root.close()
        member.close()


async def test_a_world_across_daemons_needs_the_roots_id(engine: NcclEngine) -> None:
    with pytest.raises(CallError) as info:
        engine.communicator("w", 1, 2, [0])
    assert info.value.code is ErrorCode.ENGINE and "root's NCCL id" in info.value.message


async def test_an_async_error_is_reported_and_fails_the_next_op(engine: NcclEngine, gpu: FakeGpu) -> None:
    comm = engine.communicator("w", 1, 1, [0])
    await comm.run(BarrierOp((0,)))
    assert comm.async_error() is None
    gpu.fail(0, "ncclRemoteError: a peer's network failed")
    assert comm.async_error() == "rank 0's NCCL communicator failed: ncclRemoteError: a peer's network failed"
    with pytest.raises(CallError) as info:
        await comm.run(BarrierOp((0,)))
    assert info.value.code is ErrorCode.ENGINE


def fail_event_waits(gpu: FakeGpu, device: int, once_past: bool = False) -> None:
    """cuEventSynchronize fails on `device` from now on (a sticky error, as an illegal
    access leaves): at once, or `once_past` the event (the stream got there)."""
    event_wait = gpu.event_wait

    def failing(event: int, on: int) -> None:
        if on == device and not once_past:
            raise GpuError("cuEventSynchronize: an illegal memory access was encountered")
        event_wait(event, on)
        if on == device:
            raise GpuError("cuEventSynchronize: an illegal memory access was encountered")

    gpu.event_wait = failing  # type: ignore[method-assign]


async def test_abort_ends_an_op_stuck_on_a_missing_peer(gpu: FakeGpu) -> None:
    engine = NcclEngine(gpu)
    try:
        comm = engine.communicator("w", 1, 2, [0], unique_id=engine.unique_id())
        mapping = ipc_mapping(engine, gpu, b"\x01" * 4)
        stuck = asyncio.ensure_future(comm.run(AllReduceOp({0: mapping.region(0, 4)}, DType.U8,
                                                           ReduceOp.SUM)))
        await asyncio.sleep(0.2)
        before = gpu.allocations
        mapping.close()  # the worker left: its memory must outlive the kernel that uses it
        assert gpu.allocations == before and not stuck.done()
        comm.abort()
        with pytest.raises(CallError) as info:
            await asyncio.wait_for(stuck, 5)
        assert info.value.code is ErrorCode.WORLD_FAILED
        # let go once the op was over (the answer comes when the abort returned: see
        # test_a_rank_is_answered_once_its_own_stream_is_past_an_aborted_op_not_the_others)
        await until(lambda: gpu.allocations == before - 1)
    finally:
        engine.close()


async def test_zero_byte_ops_pass_null_pointers(engine: NcclEngine, gpu: FakeGpu) -> None:
    comm = engine.communicator("w", 1, 1, [0])
    await comm.run(AllReduceOp({0: EMPTY}, DType.BF16, ReduceOp.SUM))
    assert isinstance(ipc_mapping(engine, gpu, b"x").region(0, 1), NcclRegion)


@pytest.mark.parametrize("abort_takes_s", [0.0, 1.1])
async def test_an_abort_that_does_not_return_ends_the_process(gpu: FakeGpu, abort_takes_s: float,
                                                               caplog: pytest.LogCaptureFixture) -> None:
    """ncclCommAbort waits for the device, and NCCL takes no other call meanwhile: one
    that takes past the limit (here 0.3 s) is reported from the watch's own thread, which
    by default ends the daemon for its service manager to restart it. How long it took is
    logged (a warning past 1 s: the daemon's NCCL worlds waited as long)."""
    caplog.set_level(logging.INFO, logger="commd.engine.nccl")
    stuck: list[str] = []
    engine = NcclEngine(gpu, stuck=StuckWatch(0.3, stuck.append))
    try:
        comm = engine.communicator("w", 1, 2, [0, 1])
        await comm.run(BarrierOp((0, 1)))
        gpu.abort_takes_s = abort_takes_s / 2  # each of the two ranks' communicators
        comm.abort()
        await asyncio.sleep(abort_takes_s + 0.3)
        reported = ["ncclCommAbort (world w, ranks 0, 1) has not returned in 0.3 s"]
        assert stuck == (reported if abort_takes_s else [])
        (record,) = [r for r in caplog.records if "ncclCommAbort of 2 communicators took" in r.message]
        assert record.levelno == (logging.WARNING if abort_takes_s else logging.INFO)
    finally:
        engine.close()


async def test_an_abort_runs_off_the_loop_and_no_nccl_call_runs_beside_it(gpu: FakeGpu) -> None:
    """While one world's ncclCommAbort waits for the device, the event loop goes on (every
    other world, the peer links, the clients), and another world's ops wait for it to
    return before they call NCCL (which forbids any call during an abort), then run."""
    engine = NcclEngine(gpu, stuck=StuckWatch(7.0))
    try:
        failing = engine.communicator("a", 1, 1, [0])
        other = engine.communicator("b", 1, 2, [0, 1], devices={0: 0, 1: 1})
        bufs = {r: ipc_mapping(engine, gpu, bytes([r + 1]) * 8, device=r).region(0, 8) for r in range(2)}
        await asyncio.gather(failing.run(BarrierOp((0,))), other.run(BarrierOp((0, 1))))
        gpu.abort_takes_s = 0.6
        ticks_while_aborting = 0

        async def tick() -> None:
            nonlocal ticks_while_aborting
            while True:
                await asyncio.sleep(0.01)
                ticks_while_aborting += gpu.aborting > 0

        ticker = asyncio.ensure_future(tick())
        started = time.monotonic()
        failing.abort()  # it only asks: were it to wait, the abort would be over, not started
        await abort_started(engine, gpu)
        assert failing.busy() is False and gpu.abort_threads == ["commd-nccl-wait_0"]
        assert re.search(r"; ncclCommAbort \(world a, rank 0\) running for \d+\.\d s$", engine.describe())
        op = asyncio.ensure_future(other.run(AllReduceOp(bufs, DType.U8, ReduceOp.SUM)))
        assert other.async_error() is None  # not asked while the gate is closed
        await asyncio.sleep(0.2)
        assert not op.done()  # it waits for the abort: NCCL would not take its launch now
        await asyncio.wait_for(op, 5)
        assert time.monotonic() - started >= 0.6
        ticker.cancel()
        # the loop ran all along: ~60 ticks of 10 ms in the 0.6 s (an abort holding it, ~1)
        assert ticks_while_aborting >= 10, ticks_while_aborting
        assert "running" not in engine.describe()
        assert [gpu.read(b.ptr, 8) for b in bufs.values()] == [b"\x03" * 8] * 2
    finally:
        engine.close()


async def test_closing_the_engine_during_an_abort_lets_go_of_its_world_before_returning(
        gpu: FakeGpu) -> None:
    """A daemon shutting down aborts its worlds, then closes the engine, then tells the
    workers. The close waits for the abort; the world's teardown that follows it (its
    streams, its scratch memory) must be over by then too, not left to the loop: that
    would free after the engine closed (the freeing thread gone: on the loop), or never."""
    engine = NcclEngine(gpu)
    try:
        baseline = gpu.allocations
        comm = engine.communicator("w", 1, 2, [0, 1], devices={0: 0, 1: 1})
        await asyncio.wait_for(comm.run(BarrierOp((0, 1))), 5)
        assert gpu.allocations == baseline + 2 and gpu.streams_of(0) and gpu.streams_of(1)  # (scratch)
        gpu.abort_takes_s = 0.2  # (each rank's: the abort still runs when the close comes)
        comm.abort()
        await abort_started(engine, gpu)
    finally:
        engine.close()
    assert gpu.allocations == baseline and gpu.streams_of(0) == gpu.streams_of(1) == []
    assert [thread for _, thread in gpu.released_on] == ["MainThread"] * 2  # (the closing caller's)
    await asyncio.sleep(0.05)  # (nothing left for the loop)
    assert len(gpu.released_on) == 2


async def test_a_world_formed_during_an_abort_starts_after_it_and_the_loop_goes_on(gpu: FakeGpu) -> None:
    """A failed world's ranks reconnect at once, while its abort still runs: the new
    communicator's init waits for the abort in its ranks' turn, the loop going on; its ops
    run after it."""
    announced: list[float] = []
    engine = NcclEngine(gpu, stuck=StuckWatch(7.0))
    engine.on_loop_stall(announced.append)
    try:
        comm = engine.communicator("w", 1, 2, [0, 1])
        await comm.run(BarrierOp((0, 1)))
        aborted: list[int] = []
        real_abort, real_init = gpu.comm_abort, gpu.comm_init
        gpu.abort_takes_s = 0.5  # long enough to still run when the new world asks
        gpu.comm_abort = lambda handle: (real_abort(handle), aborted.append(handle))[0]  # type: ignore[method-assign]
        inits: list[int] = []  # how many aborts had returned at each init
        gpu.comm_init = lambda *args: (inits.append(len(aborted)), real_init(*args))[-1]  # type: ignore[method-assign]
        comm.abort()
        await abort_started(engine, gpu)
        again = engine.communicator("w", 2, 2, [0, 1])
        assert inits == [] and gpu.aborting == 1  # it did not wait for the abort
        bufs = {r: ipc_mapping(engine, gpu, bytes([r + 1]) * 8).region(0, 8) for r in range(2)}
        await asyncio.wait_for(again.run(AllReduceOp(bufs, DType.U8, ReduceOp.SUM)), 5)
        assert inits == [2, 2] and [gpu.read(b.ptr, 8) for b in bufs.values()] == [b"\x03" * 8] * 2
        assert announced == []
    finally:
        engine.close()


async def test_a_world_whose_init_after_an_abort_fails_fails_with_why() -> None:
    gpu = FakeGpu(devices=1, multi_rank_gpu=False)  # two ranks on one GPU: NCCL refuses the init
    engine = NcclEngine(gpu, stuck=StuckWatch(7.0))
    try:
        await abort_started_in(engine, gpu, 0.2)
        comm = engine.communicator("w", 1, 2, [0, 1])  # refused at once were the gate open
        with pytest.raises(CallError) as info:
            await asyncio.wait_for(comm.run(BarrierOp((0, 1))), 5)
        assert info.value.code is ErrorCode.ENGINE  # the op says why, as a refused hello would
        assert "NCCL init failed: Duplicate GPU detected" in info.value.message
        assert "NCCL init failed: Duplicate GPU detected" in (comm.async_error() or "")
    finally:
        engine.close()
    assert gpu.violations == []


@pytest.mark.parametrize("where", ["init", "launch"])
async def test_a_call_that_failed_in_a_group_is_told_not_the_group_end_after_it(where: str) -> None:
    """The group end after a failed call fails too; its error was the one told (the init's
    'ncclGroupEnd: invalid usage' in place of the duplicate GPU), naming no call."""
    gpu = FakeGpu(devices=1 if where == "init" else 2, multi_rank_gpu=False)
    real_end = gpu.group_end
    failed: list[str] = []

    def group_end() -> None:
        real_end()
        if failed or where == "init":
            raise GpuError("ncclGroupEnd: invalid usage")

    def all_reduce(*args: object) -> None:
        failed.append("all_reduce")
        raise GpuError("ncclAllReduce: invalid argument")

    gpu.group_end = group_end  # type: ignore[method-assign]
    gpu.all_reduce = all_reduce  # type: ignore[method-assign,assignment]
    engine = NcclEngine(gpu)
    try:
        bufs = {r: ipc_mapping(engine, gpu, bytes([r + 1]) * 8, device=r if where == "launch" else 0)
                .region(0, 8) for r in range(2)}
        with pytest.raises(CallError) as info:  # (an init fails at once: no abort holds NCCL up)
            comm = engine.communicator("w", 1, 2, [0, 1], devices={0: 0, 1: 0 if where == "init" else 1})
            await asyncio.wait_for(comm.run(AllReduceOp(bufs, DType.U8, ReduceOp.SUM)), 5)
        assert info.value.code is ErrorCode.ENGINE
        said = ("NCCL init failed: Duplicate GPU detected" if where == "init"
                else "NCCL launch failed: ncclAllReduce: invalid argument")
        assert said in info.value.message, info.value.message
    finally:
        engine.close()


async def test_a_call_that_must_wait_for_an_abort_on_the_loop_is_announced(gpu: FakeGpu) -> None:
    """ncclGetUniqueId (the root's id for a world across daemons) and ncclMemAlloc are made
    on the loop and cannot wait asynchronously: behind a running abort the loop waits, and
    Engine.on_loop_stall's callback hears of it first, with the longest it may take (the
    daemon tells its peers). An abort with nothing waiting for it is not announced."""
    announced: list[float] = []
    engine = NcclEngine(gpu, stuck=StuckWatch(7.0))
    engine.on_loop_stall(announced.append)
    try:
        await abort_started_in(engine, gpu, 0.2, ranks=(0, 1))
        assert announced == []
        engine.unique_id()
        assert announced == [7.0] and len(gpu.abort_threads) == 2  # (both ranks', one abort)
        shared, fd = engine.allocate(64)
        os.close(fd)
        shared.close()
        assert announced == [7.0]  # nothing to wait for: no announcement
    finally:
        engine.close()


async def test_a_wait_on_the_loop_lasts_one_abort_not_all_that_wait(gpu: FakeGpu) -> None:
    """The loop lets each abort start (so none starts in the middle of its NCCL calls): a
    synchronous call behind a running abort waits for that one only, told to the peers,
    and runs before the next starts."""
    announced: list[float] = []
    engine = NcclEngine(gpu, stuck=StuckWatch(7.0))
    engine.on_loop_stall(announced.append)
    try:
        await abort_started_in(engine, gpu, 1.0, names="abc")
        assert re.search(r"ncclCommAbort \(world a, rank 0\) running for \d+\.\d s, 2 more aborts waiting$",
                         engine.describe())  # what `commd status` shows
        started = time.monotonic()
        engine.unique_id()  # the loop waits here, for world a's only
        assert time.monotonic() - started < 1.5 and announced == [7.0]  # (two: 2 s)
        assert len(gpu.abort_threads) == 1  # (the fake records an NCCL call during an abort)
        await until(lambda: len(gpu.abort_threads) == 3 and "running" not in engine.describe())
    finally:
        engine.close()


async def test_an_abort_behind_a_waiting_ncclmemfree_holds_no_launch_up() -> None:
    """An abort queued behind an ncclMemFree that waits for the device keeps the gate
    open: here the free waits for a receive whose sender waits for a launch of this
    daemon's, which a closed gate would hold back for ever. Daemon a hosts ranks 0, 1 of
    world w, daemon b rank 2; rank 2 sends to 0 only after it received from 1. (Both
    daemons share this process, but not a gate: launches ready at once keep b from any NCCL
    call once the send it makes last ran, which a's abort follows.)"""
    gpu = FakeGpu(devices=3, launch_polls=0)
    a, b = NcclEngine(gpu, stuck=StuckWatch(20.0)), NcclEngine(gpu, stuck=StuckWatch(20.0))
    try:
        uid = a.unique_id()
        ca = a.communicator("w", 1, 3, [0, 1], devices={0: 0, 1: 1}, unique_id=uid)
        cb = b.communicator("w", 1, 3, [2], devices={2: 2}, unique_id=uid)
        x = a.communicator("x", 1, 1, [0])
        await asyncio.gather(ca.run(BarrierOp((0, 1, 2))), cb.run(BarrierOp((0, 1, 2))),
                             x.run(BarrierOp((0,))))
        shared, fd = a.allocate(64)
        os.close(fd)
        landing = ipc_mapping(a, gpu, b"." * 4).region(0, 4)
        z = ipc_mapping(a, gpu, b"Z" * 4, device=1).region(0, 4)
        got, y = (ipc_mapping(b, gpu, data * 4, device=2).region(0, 4) for data in (b".", b"Y"))
        received = asyncio.ensure_future(ca.run(RecvOp(2, 0, landing, NO_TAG)))
        real_release = gpu.release
        free_waited: list[float] = []

        def release(memory: Imported) -> None:
            if memory.origin is Origin.NCCL:  # as cuMemUnmap waiting for the device
                since = time.monotonic()
                while gpu.read(landing.ptr, 4) != b"YYYY" and time.monotonic() - since < 3.0:
                    time.sleep(0.01)
                free_waited.append(time.monotonic() - since)
            real_release(memory)

        gpu.release = release  # type: ignore[method-assign]
        shared.close()  # the free holds a's gate thread until rank 0's receive landed
        await asyncio.sleep(0.05)
        x.abort()  # queued behind the free
        sent = asyncio.ensure_future(ca.run(SendOp(1, 2, z, NO_TAG)))
        await asyncio.wait_for(cb.run(RecvOp(1, 2, got, NO_TAG)), 10)
        await asyncio.wait_for(cb.run(SendOp(2, 0, y, NO_TAG)), 10)
        await asyncio.wait_for(asyncio.gather(received, sent), 10)
        await until(lambda: bool(free_waited) and len(gpu.abort_threads) == 1, 10)
        assert free_waited[0] < 2.0 and gpu.read(got.ptr, 4) == b"ZZZZ"  # (3 s: the launch was held)
    finally:
        a.close()
        b.close()
    assert gpu.violations == []


def test_aborts_without_a_running_loop_never_overlap() -> None:
    """With no loop running (a daemon closing, a tool), an abort runs on the caller's
    thread once every abort asked before returned: those start without a loop's leave."""
    gpu = FakeGpu(devices=1)
    engine = NcclEngine(gpu, stuck=StuckWatch(20.0))

    async def two_aborting() -> NcclCommunicator:
        comms = [engine.communicator(name, 1, 1, [0]) for name in "abc"]
        await asyncio.gather(*(comm.run(BarrierOp((0,))) for comm in comms))
        gpu.abort_takes_s = 0.3
        comms[0].abort()
        comms[1].abort()
        await abort_started(engine, gpu)  # a's runs, b's waits
        return comms[2]

    last = asyncio.run(two_aborting())
    try:
        last.abort()  # here, after b's
        engine.communicator("d", 1, 1, [0])  # (made here too: no loop to wait on)
        assert len(gpu.abort_threads) == 3 and gpu.violations == []
    finally:
        engine.close()


async def test_a_failed_init_after_an_abort_keeps_its_streams_until_its_own_abort_returned() -> None:
    gpu = FakeGpu(devices=1, multi_rank_gpu=False)  # two ranks on one GPU: NCCL refuses the init
    engine = NcclEngine(gpu, stuck=StuckWatch(20.0))
    aborts_returned: list[int] = []
    early: list[int] = []  # the world's streams destroyed before the abort of its init returned
    real_destroy, real_abort = gpu.stream_destroy, gpu.comm_abort
    gpu.comm_abort = lambda comm: (real_abort(comm), aborts_returned.append(comm))[0]  # type: ignore[method-assign]
    try:
        await abort_started_in(engine, gpu, 0.3)
        others = set(gpu.streams_of(0))  # (world x's, which goes once its abort returned)
        gpu.stream_destroy = lambda stream: (  # type: ignore[method-assign]
            early.append(stream) if len(aborts_returned) < 2 and stream not in others else None,
            real_destroy(stream))[-1]
        comm = engine.communicator("w", 1, 2, [0, 1])
        with pytest.raises(CallError):
            await asyncio.wait_for(comm.run(BarrierOp((0, 1))), 5)
        await until(lambda: len(aborts_returned) == 2 and "running" not in engine.describe())
        assert early == []
    finally:
        engine.close()


async def test_registered_memory_goes_only_once_its_abort_returned(gpu: FakeGpu) -> None:
    """NCCL holds a registration until the abort returned: memory the worker let go of,
    deregistered after the abort began, is released only then."""
    engine = NcclEngine(gpu, stuck=StuckWatch(7.0))
    try:
        comm = engine.communicator("w", 1, 1, [0])
        mapping = vmm_mapping(engine, gpu, b"\x01" * 64)
        region = mapping.region(0, 64)
        comm.register(0, 7, region)
        await comm.run(BarrierOp((0,)))
        assert len(gpu.registered) == 1
        mapping.close()  # the worker forgot the buffer: only the registration holds it
        still_registered: list[bool] = []  # at its release
        real_release = gpu.release

        def release(memory: Imported) -> None:
            if memory.ptr == region.ptr:
                still_registered.append(any(ptr == memory.ptr for _, ptr, _ in gpu.registered.values()))
            real_release(memory)

        gpu.release = release  # type: ignore[method-assign]
        gpu.abort_takes_s = 0.3
        comm.abort()
        comm.deregister(0, 7)
        await until(lambda: bool(still_registered))
        assert still_registered == [False]
    finally:
        engine.close()


async def test_an_ncclmemfree_holds_no_launch_up(gpu: FakeGpu) -> None:
    """ncclMemFree need only keep out of an abort's way: while one waits for the device,
    launches go on (one it waits for might be among them)."""
    engine = NcclEngine(gpu, stuck=StuckWatch(7.0))
    try:
        comm = engine.communicator("w", 1, 1, [0])
        await comm.run(BarrierOp((0,)))
        shared, fd = engine.allocate(64)
        os.close(fd)
        before = gpu.allocations
        real_release = gpu.release
        gpu.release = lambda memory: (time.sleep(0.6), real_release(memory))[-1]  # type: ignore[method-assign]
        shared.close()
        await asyncio.wait_for(comm.run(BarrierOp((0,))), 0.4)
        assert gpu.allocations == before  # the free still waits
        await until(lambda: gpu.allocations == before - 1)
    finally:
        engine.close()


async def test_ncclmemfree_is_watched(gpu: FakeGpu) -> None:
    """ncclMemFree may wait for the device like an abort: it runs off the loop, and the
    watch ends a daemon it never returns to."""
    stuck: list[str] = []
    engine = NcclEngine(gpu, stuck=StuckWatch(0.2, stuck.append))
    try:
        shared, fd = engine.allocate(64)
        os.close(fd)
        ptr = shared.region(0, 1).ptr
        real_release = gpu.release
        released: list[int] = []
        gpu.release = lambda memory: (time.sleep(0.6), real_release(memory),  # type: ignore[method-assign]
                                      released.append(memory.ptr))[1]
        shared.close()
        assert released == []  # it did not wait for the free
        await asyncio.sleep(0.8)
        assert stuck == [f"ncclMemFree of 64 bytes at {ptr:#x} has not returned in 0.2 s"]
    finally:
        engine.close()


class HungFrees:
    """The fake's frees made to hang until the watch (`self.watch`) reports one, as the
    process's end would end it, or for 5 s; what the watch said, and per free whether it
    was the watch that ended it."""

    def __init__(self, gpu: FakeGpu) -> None:
        self.stuck: list[str] = []
        self.ended_by_the_watch: list[bool] = []
        self.watch = StuckWatch(0.2, self._report)
        self._reported = threading.Event()
        release = gpu.release

        def hung(memory: Imported) -> None:
            self.ended_by_the_watch.append(self._reported.wait(5))
            release(memory)

        gpu.release = hung  # type: ignore[method-assign]

    def _report(self, why: str) -> None:
        self.stuck.append(why)
        self._reported.set()


@pytest.mark.parametrize("closing", [False, True])
async def test_a_cuda_free_that_does_not_return_ends_the_process(gpu: FakeGpu, closing: bool) -> None:
    """cuIpcCloseMemHandle (as cuMemUnmap, cuMemFree) may wait for the device as ncclMemFree
    does, on the Freer's thread: one that never returns holds the frees after it, and the
    daemon's stop (the engine's close waits for the frees asked). The watch reports it as
    it does a stuck ncclMemFree, which by default ends the daemon; while the engine runs,
    and while it closes (before: nothing said, the close held for as long as the free)."""
    frees = HungFrees(gpu)
    engine = NcclEngine(gpu, stuck=frees.watch)
    mapping = ipc_mapping(engine, gpu, b"x" * 64)
    ptr = mapping.region(0, 1).ptr
    try:
        mapping.close()
        if not closing:
            await asyncio.sleep(0.6)
            assert frees.stuck
    finally:
        engine.close()
    assert frees.stuck == [f"cuIpcCloseMemHandle of 64 bytes at {ptr:#x} has not returned in 0.2 s"]
    assert frees.ended_by_the_watch == [True]  # (the close waited for the watch, not the free's 5 s)
    assert [origin for origin, _ in gpu.released_on] == [Origin.IPC]


@pytest.mark.parametrize("allocated", [False, True])
async def test_a_free_after_the_engine_closed_is_watched_too(gpu: FakeGpu, allocated: bool) -> None:
    """The daemon's stop closes the engine, then the connections, whose buffers go then
    (Server.shutdown): those frees run on the loop's thread, the gate's ncclMemFree too.
    One that never returns held the stop for ever with nothing said: the engine's close
    had ended the watch (before: stuck == [] once the fake free gave up after 5 s)."""
    frees = HungFrees(gpu)
    engine = NcclEngine(gpu, stuck=frees.watch)
    if allocated:
        mapping, fd = engine.allocate(64)
        os.close(fd)
        freed_by = "ncclMemFree"
    else:
        mapping, freed_by = ipc_mapping(engine, gpu, b"x" * 64), "cuIpcCloseMemHandle"
    ptr = mapping.region(0, 1).ptr
    engine.close()
    mapping.close()  # (here, as on the loop's thread: the engine's threads are gone)
    assert frees.stuck == [f"{freed_by} of 64 bytes at {ptr:#x} has not returned in 0.2 s"]
    assert frees.ended_by_the_watch == [True]


# A process with logging set up as the daemon's, in a call under the watch that never returns
STUCK_CHILD = """
import time
from commd.engine.stuckwatch import StuckWatch
from commd.logs import setup_logging

setup_logging("INFO", "text")
with StuckWatch(0.2).guard("ncclCommAbort of world w"):
    time.sleep(20)
print("returned", flush=True)
"""


@pytest.mark.parametrize("stderr_full", [False, True])
def test_the_watch_ends_the_process_saying_why_even_with_its_log_stalled(stderr_full: bool) -> None:
    """The watch's default way out, in a process of its own: exit 1 with the reason as the
    last log line, the call never back; and with stderr a full pipe nobody reads (a
    stalled journal), still exit 1, the line given up after the flush's bounded wait."""
    filler = b"f" * 4096
    r, w = os.pipe()
    if stderr_full:
        fcntl.fcntl(w, fcntl.F_SETPIPE_SZ, len(filler))
        assert os.write(w, filler) == len(filler)
    with open(r, "rb") as err:
        try:
            child = subprocess.Popen([sys.executable, "-c", STUCK_CHILD], cwd=REPO, stdin=subprocess.DEVNULL,
                                     stdout=subprocess.PIPE, stderr=w)
        finally:
            os.close(w)
        try:
            out, _ = child.communicate(timeout=15)
        finally:
            child.kill()
            child.wait()
        logged = err.read()
    assert (child.returncode, out) == (1, b"")
    if stderr_full:
        assert logged == filler
    else:
        assert logged.decode().endswith(
            " CRITICAL commd.engine.nccl: ncclCommAbort of world w has not returned in 0.2 s: the "
            "daemon's NCCL and CUDA calls cannot go on; exiting, for the service manager to start "
            "the daemon afresh\n"), logged
        assert logged.count(b"\n") == 1, logged


async def test_a_zero_byte_collective_across_daemons_still_meets_its_peers(gpu: FakeGpu) -> None:
    """NCCL drops a collective of no bytes at once; across daemons the world sends it to
    the engine so that it still meets the other daemons' ranks: it runs as a barrier."""
    root, member, ca, cb = two_daemon_world(gpu)
    try:
        tag = CallTag(0, "all_reduce(bytes=0, dtype=u8, op=sum)")
        # the member's rank first: nothing else holds it (the root's, it would wait for the
        # member's fingerprint anyway)
        first = asyncio.ensure_future(cb.run(AllReduceOp({1: EMPTY}, DType.U8, ReduceOp.SUM, tag)))
        await asyncio.sleep(0.2)
        assert not first.done()  # rank 0 has not called it yet
        await ca.run(AllReduceOp({0: EMPTY}, DType.U8, ReduceOp.SUM, tag))
        await asyncio.wait_for(first, 5)
    finally:
        root.close()
        member.close()


class PairNet:
    """The two daemons' view of a world across them, linked in memory: what the NCCL
    communicator uses of a WorldNet (the fingerprints travel over it, the data does not)."""

    def __init__(self, me: str, placement: tuple[str, ...]) -> None:
        self.world, self.epoch, self.me, self.placement = "w", 1, me, placement
        self.inbox = Inbox()
        self.other: PairNet | None = None

    @property
    def is_root(self) -> bool:
        return self.me == self.placement[0]

    def members(self) -> list[str]:
        return sorted(set(self.placement) - {self.placement[0]})

    def ranks_of(self, daemon: str) -> tuple[int, ...]:
        return tuple(r for r, d in enumerate(self.placement) if d == daemon)

    def send(self, daemon: str, msg: p.Data, payload: bytes = b"") -> None:
        assert self.other is not None
        self.other.inbox.deliver(msg, payload)


async def sends_crossing_a_connecting_one(gpu: FakeGpu, a: NcclEngine, b: NcclEngine,
                                          ca: NcclCommunicator, cb: NcclCommunicator,
                                          meanwhile: Callable[[], None] = lambda: None) -> None:
    """Rank 0 sends X to rank 2, whose connection NCCL makes only once rank 2 posts its side;
    while it is connecting (and after `meanwhile`), rank 1 sends Z to rank 2, which receives
    Z first: rank 1's launch must not wait for rank 0's."""
    gpu.lazy_connect = {(0, 2)}
    x = ipc_mapping(a, gpu, b"X" * 4).region(0, 4)
    z = ipc_mapping(a, gpu, b"Z" * 4, device=1).region(0, 4)
    got_x = ipc_mapping(b, gpu, b"." * 4, device=2).region(0, 4)
    got_z = ipc_mapping(b, gpu, b"." * 4, device=2).region(0, 4)
    sent_x = asyncio.ensure_future(ca.run(SendOp(0, 2, x, NO_TAG)))
    await asyncio.sleep(0.05)  # rank 0's launch: connecting
    meanwhile()
    await asyncio.sleep(0)
    sent_z = asyncio.ensure_future(ca.run(SendOp(1, 2, z, NO_TAG)))
    await asyncio.wait_for(cb.run(RecvOp(1, 2, got_z, NO_TAG)), 5)
    await asyncio.wait_for(cb.run(RecvOp(0, 2, got_x, NO_TAG)), 5)
    await asyncio.wait_for(asyncio.gather(sent_x, sent_z), 5)
    assert (gpu.read(got_x.ptr, 4), gpu.read(got_z.ptr, 4)) == (b"XXXX", b"ZZZZ")


async def three_rank_world(gpu: FakeGpu
                           ) -> tuple[NcclEngine, NcclEngine, NcclCommunicator, NcclCommunicator]:
    """Ranks 0 and 1 on one daemon's engine (GPUs 0, 1), rank 2 on another's (GPU 2), one
    world, its communicators ready (a first barrier)."""
    a, b = NcclEngine(gpu), NcclEngine(gpu)
    uid = a.unique_id()
    ca = a.communicator("w", 1, 3, [0, 1], devices={0: 0, 1: 1}, unique_id=uid)
    cb = b.communicator("w", 1, 3, [2], devices={2: 2}, unique_id=uid)
    await asyncio.gather(ca.run(BarrierOp((0, 1, 2))), cb.run(BarrierOp((0, 1, 2))))
    return a, b, ca, cb


def two_daemon_world(gpu: FakeGpu) -> tuple[NcclEngine, NcclEngine, NcclCommunicator, NcclCommunicator]:
    """Rank 0 on a root daemon's engine, rank 1 on a member's, one world: engines, then
    their communicators."""
    root, member, a, b = across_two_daemons(gpu)
    uid = root.unique_id()
    return (root, member, root.communicator("w", 1, 2, [0], a, unique_id=uid),  # type: ignore[arg-type]
            member.communicator("w", 1, 2, [1], b, unique_id=uid))  # type: ignore[arg-type]


def across_two_daemons(gpu: FakeGpu) -> tuple[NcclEngine, NcclEngine, PairNet, PairNet]:
    root, member = NcclEngine(gpu), NcclEngine(gpu)
    placement = ("A", "B")
    a, b = PairNet("A", placement), PairNet("B", placement)
    a.other, b.other = b, a
    return root, member, a, b


async def test_fingerprints_cross_to_the_root_and_a_mismatch_fails_it(gpu: FakeGpu) -> None:
    root, member, ca, cb = two_daemon_world(gpu)
    try:
        x = ipc_mapping(root, gpu, b"\x02" * 8).region(0, 8)
        y = ipc_mapping(member, gpu, b"\x03" * 8).region(0, 8)
        same = CallTag(0, "all_reduce(bytes=8, dtype=u8, op=sum)")
        await asyncio.gather(ca.run(AllReduceOp({0: x}, DType.U8, ReduceOp.SUM, same)),
                             cb.run(AllReduceOp({1: y}, DType.U8, ReduceOp.SUM, same)))
        assert gpu.read(x.ptr, 8) == gpu.read(y.ptr, 8) == b"\x05" * 8
        # call 1: the same bytes to NCCL, but the ranks meant different calls (a u8 sum and
        # a u8 max of the same size): NCCL runs it; the root's comparison fails it
        mine = CallTag(1, "all_reduce(bytes=8, dtype=u8, op=sum)")
        theirs = CallTag(1, "all_reduce(bytes=8, dtype=u8, op=max)")
        outcomes = await asyncio.gather(ca.run(AllReduceOp({0: x}, DType.U8, ReduceOp.SUM, mine)),
                                        cb.run(AllReduceOp({1: y}, DType.U8, ReduceOp.MAX, theirs)),
                                        return_exceptions=True)
        assert isinstance(outcomes[0], CallError) and outcomes[0].code is ErrorCode.MISMATCH
        assert "rank 0 called all_reduce(bytes=8, dtype=u8, op=sum), rank 1 called" in outcomes[0].message
    finally:
        root.close()
        member.close()


async def test_a_mismatch_that_would_hang_nccl_is_aborted(gpu: FakeGpu) -> None:
    """The member called something else, which NCCL would wait on forever: the root
    aborts its communicator, lets the device finish, and reports the mismatch."""
    root, member, a, b = across_two_daemons(gpu)
    try:
        ca = root.communicator("w", 1, 2, [0], a, unique_id=root.unique_id())  # type: ignore[arg-type]
        mapping = ipc_mapping(root, gpu, b"\x01" * 4)
        tag = CallTag(0, "all_reduce(bytes=4, dtype=u8, op=sum)")
        run = asyncio.ensure_future(ca.run(AllReduceOp({0: mapping.region(0, 4)}, DType.U8, ReduceOp.SUM,
                                                       tag)))
        await asyncio.sleep(0.2)
        assert not run.done()  # waiting on the device for rank 1
        before = gpu.allocations
        mapping.close()  # its memory stays until the aborted op is over
        b.send("root", p.Data("w", 1, "check", 0, 0, 1, "broadcast(bytes=4, root=1)"))
        with pytest.raises(CallError) as info:
            await asyncio.wait_for(run, 5)
        assert info.value.code is ErrorCode.MISMATCH and "rank 1 called broadcast" in info.value.message
        # (answered once the abort returned: the memory goes once the wait sees the stream past)
        await until(lambda: gpu.allocations == before - 1)
        assert ca.async_error() is None  # aborted: nothing more to report
    finally:
        root.close()
        member.close()


@pytest.mark.parametrize("ending", ["the world fails", "an abort"])
async def test_a_root_op_past_on_the_device_whose_member_never_checks_in_ends_with_the_world(
        gpu: FakeGpu, ending: str) -> None:
    """The member ran its side, but its fingerprint never reaches the root (the link went
    silent): the root's op, past on the device, waits for it until the world fails (in
    the daemon, World.fail fails the inbox), then ends with the world's error; or, the
    communicator aborted while the inbox stays open, the abort ends it as it ends every
    other wait, with its words. Not StillOnDevice either way (the device is past): its
    memory is let go (nothing of the op runs any more)."""
    root, member, a, b = across_two_daemons(gpu)
    b.other = PairNet("A", b.placement)  # (what the member sends reaches nobody)
    try:
        uid = root.unique_id()
        ca = root.communicator("w", 1, 2, [0], a, unique_id=uid)  # type: ignore[arg-type]
        cb = member.communicator("w", 1, 2, [1], b, unique_id=uid)  # type: ignore[arg-type]
        x = ipc_mapping(root, gpu, b"\x02" * 4)
        y = ipc_mapping(member, gpu, b"\x03" * 4)
        tag = CallTag(0, "all_reduce(bytes=4, dtype=u8, op=sum)")
        run = asyncio.ensure_future(ca.run(AllReduceOp({0: x.region(0, 4)}, DType.U8, ReduceOp.SUM, tag)))
        await asyncio.wait_for(cb.run(AllReduceOp({1: y.region(0, 4)}, DType.U8, ReduceOp.SUM, tag)), 5)
        await asyncio.sleep(0.3)
        assert not run.done() and gpu.read(x.region(0, 4).ptr, 4) == b"\x05" * 4  # ran; waits for the word
        x.close()
        before = gpu.allocations
        lost = "daemon B was lost: silent for 3.0s"
        if ending == "the world fails":
            a.inbox.fail(CallError(ErrorCode.PEER_LOST, lost))
            said = (ErrorCode.PEER_LOST, lost)
        else:
            ca.abort()
            said = (ErrorCode.WORLD_FAILED, "communicator was aborted")
        with pytest.raises(CallError) as info:
            await asyncio.wait_for(run, 5)
        assert (info.value.code, info.value.message) == said
        assert not isinstance(info.value, StillOnDevice) and not ca.busy()
        await until(lambda: gpu.allocations == before - 1)  # (on the free's thread)
    finally:
        root.close()
        member.close()


@pytest.mark.parametrize("failure", ["world failed", "mismatch"])
async def test_a_root_rank_across_daemons_is_answered_once_its_own_stream_is_past_an_aborted_op(
        gpu: FakeGpu, failure: str) -> None:
    """Ranks 0 and 1 on the root daemon, rank 2 on a member; rank 1's stream waits for its
    worker's kernel, which never ends during the call. Aborted (the world failed, or the
    root found the member called something else), the op answers rank 0 once rank 0's
    stream is past it, not once rank 1's is: `past` tells each rank's when. The memory
    goes only once both are."""
    root, member = NcclEngine(gpu), NcclEngine(gpu)
    placement = ("A", "A", "B")
    a, b = PairNet("A", placement), PairNet("B", placement)
    a.other, b.other = b, a
    try:
        uid = root.unique_id()
        ca = root.communicator("w", 1, 3, [0, 1], a, devices={0: 0, 1: 1},  # type: ignore[arg-type]
                               unique_id=uid)
        cb = member.communicator("w", 1, 3, [2], b, devices={2: 1}, unique_id=uid)  # type: ignore[arg-type]
        stream = gpu.worker_stream(device=1)
        ptrs = [gpu.worker_alloc(b"\x01" * 4), gpu.worker_alloc(b"\x02" * 4, device=1)]
        mappings = [root.import_memory(MemKind.CUDA_IPC, 4, gpu.export_ipc(ptr), None) for ptr in ptrs]
        theirs = ipc_mapping(member, gpu, b"\x03" * 4, device=1)
        kernel = gpu.worker_kernel(stream, ptrs[1], b"\x09" * 4)  # rank 1's, ahead of the op
        (ready, ready_handle), (_, done_handle) = gpu.worker_event(device=1), gpu.worker_event(device=1)
        pair = root.import_events(ready_handle, done_handle, device=1)
        gpu.event_record(ready, stream)
        mine = CallTag(0, "all_reduce(bytes=4, dtype=u8, op=sum)")
        tag = mine if failure == "world failed" else CallTag(0, "all_reduce(bytes=4, dtype=u8, op=max)")
        regions = {rank: mapping.region(0, 4) for rank, mapping in enumerate(mappings)}
        run = asyncio.ensure_future(ca.run(AllReduceOp(regions, DType.U8, ReduceOp.SUM, mine),
                                           Order({1: pair})))
        await asyncio.sleep(0.2)
        for mapping in mappings:
            mapping.close()  # the session forgot the buffers: they go once the op is over
        before = gpu.allocations
        other = asyncio.ensure_future(cb.run(AllReduceOp({2: theirs.region(0, 4)}, DType.U8,
                                                         ReduceOp.SUM if failure == "world failed"
                                                         else ReduceOp.MAX, tag)))
        if failure == "world failed":
            await asyncio.sleep(0.2)
            assert not run.done()  # rank 1's stream waits for the kernel, and the others for rank 1
            ca.abort()  # as the world does when it fails
        await asyncio.wait({run}, timeout=5)
        assert run.done(), "rank 0's answer is held behind rank 1's stream"
        with pytest.raises(StillOnDevice) as info:
            await run
        if failure == "world failed":
            assert info.value.code is ErrorCode.WORLD_FAILED
            assert info.value.message == "communicator was aborted"
        else:
            assert info.value.code is ErrorCode.MISMATCH
            assert "rank 2 called all_reduce(bytes=4, dtype=u8, op=max)" in info.value.message
        await asyncio.wait_for(info.value.past[0], 5)
        await asyncio.sleep(0.2)
        assert not info.value.past[1].done() and ca.busy()
        assert gpu.allocations == before  # rank 1's stream has yet to get past the op
        cb.abort()  # the member's world fails too
        with pytest.raises(CallError):
            await asyncio.wait_for(other, 5)
        gpu.finish_kernel(kernel)
        await asyncio.wait_for(info.value.past[1], 5)
        await until(lambda: gpu.allocations == before - 2)
        # the aborted op never ran; the kernel's write landed
        assert [gpu.read(ptr, 4) for ptr in ptrs] == [b"\x01" * 4, b"\x09" * 4]
    finally:
        gpu.finish_kernel(kernel)  # (a failed check left it held: what waits for it ends)
        root.close()
        member.close()


async def test_an_op_whose_wait_cannot_start_once_the_engine_closed_keeps_its_memory(
        gpu: FakeGpu, caplog: pytest.LogCaptureFixture) -> None:
    """The daemon stops (engine.close: the waiting threads shut down) while an op is in its
    launch, behind its worker's kernel, and its loop runs on (the peers' farewell). The op
    launches, but its wait on the device cannot start: it fails as the daemon stopping,
    and its memory stays mapped (the op still runs once the kernel ends), logged."""
    engine = NcclEngine(gpu)
    stream = gpu.worker_stream()
    ptrs = [gpu.worker_alloc(b"\x01" * 4), gpu.worker_alloc(b"\x02" * 4, device=1)]
    kernel = gpu.worker_kernel(stream, ptrs[0], b"\x07" * 4)  # rank 0's, ahead of the op
    try:
        comm = engine.communicator("w", 1, 2, [0, 1], devices={0: 0, 1: 1})
        mappings = [engine.import_memory(MemKind.CUDA_IPC, 4, gpu.export_ipc(ptr), None) for ptr in ptrs]
        ready, _, pair = worker_events(engine, gpu)
        gpu.event_record(ready, stream)
        run = asyncio.ensure_future(comm.run(AllReduceOp({r: m.region(0, 4) for r, m in enumerate(mappings)},
                                                         DType.U8, ReduceOp.SUM), Order({0: pair})))
        await asyncio.sleep(0)  # it joined a launch, which waits for the init to settle
        for mapping in mappings:
            mapping.close()  # the session forgot the buffers: they go once the op is over
        before = gpu.allocations
        engine.close()
        with pytest.raises(WaitNotStarted) as info:
            await asyncio.wait_for(run, 5)
        assert info.value.code is ErrorCode.SHUTDOWN
        assert gpu.launches >= 1 and gpu.allocations == before  # launched, and its memory kept
        (left,) = [r.getMessage() for r in caplog.records if "stay mapped" in r.getMessage()]
        assert "the wait for the device could not start" in left and "its 8 bytes" in left, left
        gpu.finish_kernel(kernel)
        assert [gpu.read(ptr, 4) for ptr in ptrs] == [b"\x09" * 4] * 2  # 7 + 2, in the memory it kept
    finally:
        gpu.finish_kernel(kernel)
        engine.close()


async def test_an_op_whose_wait_the_closing_engine_dropped_from_its_queue_keeps_its_memory(
        gpu: FakeGpu, caplog: pytest.LogCaptureFixture) -> None:
    """Every waiting thread is taken (here the only one, by an op behind its worker's
    kernel) and a second op's wait is queued when the daemon stops: engine.close drops
    it from the queue (cancel_futures). That op was not cancelled, and nothing will tell
    when the device is past it: it fails as the daemon stopping, and its memory stays
    mapped, logged, as for a wait that could not start; the first op is left to end."""
    engine = NcclEngine(gpu, waiters=1)
    stream = gpu.worker_stream()
    ptrs = [gpu.worker_alloc(b"\x01" * 4), gpu.worker_alloc(b"\x02" * 4)]
    kernel = gpu.worker_kernel(stream, ptrs[0], b"\x07" * 4)  # ahead of both ops
    try:
        comm = engine.communicator("w", 1, 1, [0])
        await asyncio.wait_for(comm.run(BarrierOp((0,))), 5)  # (the init settled)
        mappings = [engine.import_memory(MemKind.CUDA_IPC, 4, gpu.export_ipc(ptr), None) for ptr in ptrs]
        ready, _, pair = worker_events(engine, gpu)
        gpu.event_record(ready, stream)
        runs = [asyncio.ensure_future(comm.run(AllReduceOp({0: m.region(0, 4)}, DType.U8, ReduceOp.SUM),
                                               Order({0: pair}))) for m in mappings]
        await asyncio.sleep(0.3)  # both launched: the first's wait has the thread, the second's queues
        assert not any(run.done() for run in runs)
        for mapping in mappings:
            mapping.close()  # the session forgot the buffers: they go once the ops are over
        before = gpu.allocations
        engine.close()
        done, _ = await asyncio.wait({runs[1]}, timeout=5)
        assert done, "the op whose wait was dropped is never answered"
        assert not runs[1].cancelled(), "the op ended as cancelled, which nothing asked"
        with pytest.raises(WaitNotStarted) as info:
            runs[1].result()
        assert info.value.code is ErrorCode.SHUTDOWN
        assert gpu.allocations == before and comm.busy()  # its memory kept
        (left,) = [r.getMessage() for r in caplog.records if "stay mapped" in r.getMessage()]
        assert "the wait for the device could not start" in left and "its 4 bytes" in left, left
        assert not runs[0].done()  # still behind the kernel, on its thread
        gpu.finish_kernel(kernel)
        await asyncio.wait_for(runs[0], 5)  # (a one-rank sum: the kernel's write, as it was)
        assert [gpu.read(ptr, 4) for ptr in ptrs] == [b"\x07" * 4, b"\x02" * 4]
        await until(lambda: gpu.allocations == before - 1)  # the first op's memory went
    finally:
        gpu.finish_kernel(kernel)
        engine.close()


async def test_a_wait_dropped_by_the_closing_engine_after_another_failed_keeps_the_memory(
        gpu: FakeGpu, caplog: pytest.LogCaptureFixture) -> None:
    """Three local ranks, one waiting thread: rank 0's wait fails on its GPU (the
    communicator is aborted), rank 1's takes the thread behind its worker's kernel, and
    rank 2's is still queued, behind its own worker's kernel, when the daemon stops
    (engine.close drops it). Rank 1's stream getting past the op says nothing of rank
    2's: the memory stays mapped, logged, and the op fails as the daemon stopping."""
    engine = NcclEngine(gpu, waiters=1)
    streams = [gpu.worker_stream(1), gpu.worker_stream(1)]
    ptrs = [gpu.worker_alloc(b"\x01" * 4), gpu.worker_alloc(b"\x02" * 4, device=1),
            gpu.worker_alloc(b"\x03" * 4, device=1)]
    kernels = [gpu.worker_kernel(stream, ptr, b"\x09" * 4)
               for stream, ptr in zip(streams, ptrs[1:], strict=True)]
    try:
        comm = engine.communicator("w", 1, 3, [0, 1, 2], devices={0: 0, 1: 1, 2: 1})
        await asyncio.wait_for(comm.run(BarrierOp((0, 1, 2))), 5)  # (the init settled)
        mappings = [engine.import_memory(MemKind.CUDA_IPC, 4, gpu.export_ipc(ptr), None, device=min(r, 1))
                    for r, ptr in enumerate(ptrs)]
        pairs = {}
        for rank, stream in zip((1, 2), streams, strict=True):
            (ready, ready_handle), (_, done_handle) = gpu.worker_event(1), gpu.worker_event(1)
            pairs[rank] = engine.import_events(ready_handle, done_handle, device=1)
            gpu.event_record(ready, stream)
        fail_event_waits(gpu, 0)
        run = asyncio.ensure_future(comm.run(AllReduceOp({r: m.region(0, 4) for r, m in enumerate(mappings)},
                                                         DType.U8, ReduceOp.SUM), Order(pairs)))
        await asyncio.sleep(0.3)  # rank 0's wait failed; rank 1's has the thread, rank 2's queues
        assert not run.done()
        for mapping in mappings:
            mapping.close()  # the session forgot the buffers: they go once the op is over
        before = gpu.allocations
        engine.close()
        gpu.finish_kernel(kernels[0])  # rank 1's stream gets past the (aborted) op
        with pytest.raises(WaitNotStarted) as info:
            await asyncio.wait_for(run, 5)
        assert info.value.code is ErrorCode.SHUTDOWN
        await asyncio.sleep(0.1)
        assert gpu.allocations == before  # rank 2's stream has yet to get past it
        (left,) = [r.getMessage() for r in caplog.records if "stay mapped" in r.getMessage()]
        assert "the wait for the device could not start" in left and "its 12 bytes" in left, left
        gpu.finish_kernel(kernels[1])
        # the aborted op never ran; the kernels' writes landed in the memory it kept
        assert [gpu.read(ptr, 4) for ptr in ptrs] == [b"\x01" * 4, b"\x09" * 4, b"\x09" * 4]
    finally:
        for kernel in kernels:
            gpu.finish_kernel(kernel)
        engine.close()


def worker_events(engine: NcclEngine, gpu: FakeGpu) -> tuple[int, int, NcclEvents]:
    ready, ready_handle = gpu.worker_event()
    done, done_handle = gpu.worker_event()
    return ready, done, engine.import_events(ready_handle, done_handle)


async def test_an_op_waits_for_the_workers_kernel_and_its_stream_for_the_op(engine: NcclEngine,
                                                                           gpu: FakeGpu) -> None:
    """The ordering proof on the fake device: rank 0's long kernel writes its buffer right
    before all_reduce_async; the sum includes that write, the call is answered before the
    op is done, and the worker's stream waits for the op."""
    comm = engine.communicator("w", 1, 2, [0, 1])
    streams = [gpu.worker_stream(), gpu.worker_stream()]
    ptrs = [gpu.worker_alloc(b"\x00" * 4), gpu.worker_alloc(b"\x01" * 4)]
    regions = {r: engine.import_memory(MemKind.CUDA_IPC, 4, gpu.export_ipc(ptr), None).region(0, 4)
               for r, ptr in enumerate(ptrs)}
    events = [worker_events(engine, gpu) for _ in range(2)]
    kernel = gpu.worker_kernel(streams[0], ptrs[0], b"\x07" * 4)  # still running at the call
    for r in range(2):
        gpu.event_record(events[r][0], streams[r])
    order = Order({r: events[r][2] for r in range(2)}, early=True)
    await asyncio.wait_for(comm.run(AllReduceOp(regions, DType.U8, ReduceOp.SUM), order), 5)  # ordered
    after = gpu.worker_kernel(streams[0], ptrs[0], b"\x09" * 4)  # rank 0's next kernel...
    gpu.stream_wait_event(streams[0], events[0][1])  # ...behind the op (what the client does)
    assert [gpu.read(p, 4) for p in ptrs] == [b"\x00" * 4, b"\x01" * 4]  # the op waits for the kernel
    gpu.finish_kernel(kernel)
    await asyncio.sleep(0.1)
    assert [gpu.read(p, 4) for p in ptrs] == [b"\x08" * 4] * 2  # 7 + 1: the sum saw the kernel's write
    gpu.finish_kernel(after)
    assert gpu.read(ptrs[0], 4) == b"\x09" * 4
    assert comm.async_error() is None


async def test_a_failure_after_an_early_answer_is_the_worlds(gpu: FakeGpu) -> None:
    engine = NcclEngine(gpu)
    try:
        comm = engine.communicator("w", 1, 2, [0], unique_id=engine.unique_id())  # rank 1 never comes
        region = ipc_mapping(engine, gpu, b"\x01" * 4).region(0, 4)
        _, _, pair = worker_events(engine, gpu)
        await asyncio.wait_for(comm.run(AllReduceOp({0: region}, DType.U8, ReduceOp.SUM),
                                        Order({0: pair}, early=True)), 5)
        assert comm.async_error() is None  # still waiting on the device for rank 1
        gpu.fail(0, "ncclRemoteError: rank 1's node went away")
        assert comm.async_error() is not None and "rank 1's node went away" in str(comm.async_error())
    finally:
        engine.close()


def test_worker_events_that_do_not_open_are_misuse(engine: NcclEngine) -> None:
    with pytest.raises(CallError) as info:
        engine.import_events(bytes(64), bytes(64))
    assert info.value.code is ErrorCode.MISUSE and "CUDA events" in info.value.message


async def test_registered_memory_reaches_nccl_once_the_communicator_is_ready(engine: NcclEngine,
                                                                             gpu: FakeGpu) -> None:
    comm = engine.communicator("w", 1, 1, [0])
    region = vmm_mapping(engine, gpu, b"\x01" * 64).region(0, 64)
    comm.register(0, 7, region)
    assert gpu.registered == {}  # a non-blocking communicator takes no call while it starts
    await comm.run(BarrierOp((0,)))
    assert [(ptr, n) for _, ptr, n in gpu.registered.values()] == [(region.ptr, 64)]
    comm.deregister(0, 7)
    await until(lambda: gpu.registered == {})  # once the work queued so far is done
    comm.register(0, 8, region)
    await comm.run(BarrierOp((0,)))
    assert len(gpu.registered) == 1
    comm.abort()  # NCCL drops registrations with the communicator; nothing to undo after
    comm.deregister(0, 8)
    await until(lambda: gpu.registered == {})  # once the abort returned


async def abort_started(engine: NcclEngine, gpu: FakeGpu) -> None:
    """Until an abort runs on the engine's gate thread (the loop let it start) and has
    reached the device: the gate names the job before its thread gets to ncclCommAbort
    (the StuckWatch's guard, which may start a thread, comes in between)."""
    await until(lambda: "ncclCommAbort" in engine.describe() and gpu.aborting > 0)


async def abort_started_in(engine: NcclEngine, gpu: FakeGpu, takes_s: float, names: str = "x",
                           ranks: tuple[int, ...] = (0,)) -> None:
    """Worlds `names` (one letter each, all of `ranks` here) made and aborted, each abort
    taking `takes_s`: until the first runs."""
    comms = [engine.communicator(name, 1, len(ranks), list(ranks)) for name in names]
    await asyncio.gather(*(comm.run(BarrierOp(ranks)) for comm in comms))
    gpu.abort_takes_s = takes_s
    for comm in comms:
        comm.abort()
    await abort_started(engine, gpu)


async def test_each_launch_waits_until_the_one_before_left_ncclinprogress() -> None:
    """A non-blocking group end may leave its communicators in progress (kernels not yet
    on the streams) until a state poll answers ncclSuccess; NCCL refuses them any call
    before that, and nothing may be queued behind them. Ops that start turn after turn
    (here: launches that stay in progress for three polls) go one launch after another."""
    gpu = FakeGpu(devices=2, launch_polls=3)
    engine = NcclEngine(gpu)
    try:
        comm = engine.communicator("w", 1, 2, [0, 1], devices={0: 0, 1: 1})
        await comm.run(BarrierOp((0, 1)))  # past the init
        bufs = [{r: ipc_mapping(engine, gpu, bytes([i + r]) * 4, device=r).region(0, 4) for r in range(2)}
                for i in range(3)]
        launches = gpu.launches
        runs = []
        for op in bufs:
            runs.append(asyncio.ensure_future(comm.run(AllReduceOp(op, DType.U8, ReduceOp.SUM))))
            await asyncio.sleep(0)  # the next op starts a turn later: a launch of its own
        await asyncio.wait_for(asyncio.gather(*runs), 5)
        assert [gpu.read(op[r].ptr, 4) for op in bufs for r in range(2)] == [
            bytes([2 * i + 1]) * 4 for i in range(3) for _ in range(2)]
        assert gpu.launches - launches == 3
    finally:
        engine.close()


@pytest.mark.parametrize("same_buffer", [False, True])
async def test_add_path_sums_started_together_each_see_the_others_result(gpu: FakeGpu,
                                                                        same_buffer: bool) -> None:
    """Two bf16 sums by exchange and add started in one turn (one client group): launched
    together, their receives would share a landing place, and the second would read the
    buffer before the first's add wrote it. Each launches alone."""
    import ml_dtypes

    engine = NcclEngine(gpu)
    try:
        comm = engine.communicator("w", 1, 2, [0, 1], devices={0: 0, 1: 1})
        comm.use_add_kernel(frozenset({0, 1}))

        def buf(rank: int, value: float) -> NcclRegion:
            mapping, fd = engine.allocate(16, rank)
            os.close(fd)
            gpu.copy_in(mapping.region(0, 16).ptr, np.full(8, value, ml_dtypes.bfloat16).tobytes())
            return mapping.region(0, 16)

        x = {0: buf(0, 1.0), 1: buf(1, 2.0)}
        y = x if same_buffer else {0: buf(0, 10.0), 1: buf(1, 20.0)}
        await asyncio.gather(comm.run(AllReduceOp(x, DType.BF16, ReduceOp.SUM)),
                             comm.run(AllReduceOp(y, DType.BF16, ReduceOp.SUM)))
        got = {(name, r): float(np.frombuffer(gpu.copy_out(b[r].ptr, 16), ml_dtypes.bfloat16)[0])
               for name, b in (("x", x), ("y", y)) for r in (0, 1)}
        want = {"x": 6.0, "y": 6.0} if same_buffer else {"x": 3.0, "y": 30.0}  # (1 + 2) * 2 on one buffer
        assert got == {(name, r): value for name, value in want.items() for r in (0, 1)}
        assert gpu.adds == 4  # both took the add path
    finally:
        engine.close()


async def test_a_launch_still_connecting_holds_back_only_its_own_ranks() -> None:
    """NCCL connects a pair at its first launch, and the sender's launch stays in progress
    until the receiver launches its side. Ranks 0 and 1 here, rank 2 on another daemon,
    which receives from 1 before it receives from 0: rank 1's send must launch while rank
    0's is still connecting (a valid program with a process per rank)."""
    gpu = FakeGpu(devices=3)
    a, b, ca, cb = await three_rank_world(gpu)
    try:
        await sends_crossing_a_connecting_one(gpu, a, b, ca, cb)
    finally:
        a.close()
        b.close()


async def test_ops_launch_in_the_order_they_started_while_the_init_settles() -> None:
    """Ops 1 and 2 start while the communicator still initialises, op 3 in the very turn
    its init settles: NCCL must get them 1, 2, 3 (the other daemon's rank calls them in
    that order), or the sums pair the wrong buffers."""
    gpu = FakeGpu(devices=2, init_polls=3)
    a, b = NcclEngine(gpu), NcclEngine(gpu)
    try:
        uid = a.unique_id()
        ca = a.communicator("w", 1, 2, [0], devices={0: 0}, unique_id=uid)
        cb = b.communicator("w", 1, 2, [1], devices={1: 1}, unique_id=uid)
        mine = [ipc_mapping(a, gpu, bytes([v]) * 4).region(0, 4) for v in (1, 2, 3)]
        theirs = [ipc_mapping(b, gpu, bytes([v]) * 4, device=1).region(0, 4) for v in (10, 20, 30)]
        runs: list[asyncio.Future[None]] = []
        polled = gpu.comm_state
        comm_0 = ca._comms[0]
        third: list[asyncio.Future[None]] = []

        def state(comm: int) -> tuple[CommState, str]:
            got = polled(comm)
            if comm == comm_0 and got[0] is CommState.READY and not third:  # op 3 starts now
                third.append(asyncio.ensure_future(ca.run(AllReduceOp({0: mine[2]}, DType.U8, ReduceOp.SUM))))
            return got

        gpu.comm_state = state  # type: ignore[method-assign]
        runs += [asyncio.ensure_future(ca.run(AllReduceOp({0: mine[i]}, DType.U8, ReduceOp.SUM)))
                 for i in (0, 1)]
        for i in range(3):
            runs.append(asyncio.ensure_future(cb.run(AllReduceOp({1: theirs[i]}, DType.U8, ReduceOp.SUM))))
            await asyncio.sleep(0.05)
        await asyncio.wait_for(asyncio.gather(*runs, *third), 5)
        assert [gpu.read(r.ptr, 1)[0] for r in mine] == [11, 22, 33]
    finally:
        a.close()
        b.close()


async def test_an_ops_completion_does_not_wait_for_what_launched_after_it() -> None:
    """Ranks 0 and 1 here, 2 elsewhere. All three sum C; rank 1 then sends to 2 (answered
    early); rank 0 waits for its C, then sends to 2; rank 2 receives from 0, then from 1.
    C's completion must be recorded behind C itself: recorded when C's run came back to
    it, it sat behind rank 1's send, which waits for rank 2, which waits for rank 0."""
    gpu = FakeGpu(devices=3)
    a, b, ca, cb = await three_rank_world(gpu)
    try:
        c = {r: ipc_mapping(a, gpu, bytes([r + 1]) * 4, device=r).region(0, 4) for r in (0, 1)}
        c2 = ipc_mapping(b, gpu, b"\x04" * 4, device=2).region(0, 4)
        x = ipc_mapping(a, gpu, b"X" * 4).region(0, 4)
        z = ipc_mapping(a, gpu, b"Z" * 4, device=1).region(0, 4)
        got = [ipc_mapping(b, gpu, b"." * 4, device=2).region(0, 4) for _ in range(2)]
        summed = asyncio.ensure_future(ca.run(AllReduceOp(c, DType.U8, ReduceOp.SUM)))
        there = asyncio.ensure_future(cb.run(AllReduceOp({2: c2}, DType.U8, ReduceOp.SUM)))
        await asyncio.sleep(0)
        later = asyncio.ensure_future(ca.run(SendOp(1, 2, z, NO_TAG)))
        await asyncio.wait_for(there, 5)
        await asyncio.wait_for(summed, 5)  # rank 0's synchronous sum returns
        first = asyncio.ensure_future(ca.run(SendOp(0, 2, x, NO_TAG)))
        await asyncio.wait_for(cb.run(RecvOp(0, 2, got[0], NO_TAG)), 5)
        await asyncio.wait_for(cb.run(RecvOp(1, 2, got[1], NO_TAG)), 5)
        await asyncio.wait_for(asyncio.gather(later, first), 5)
        assert [gpu.read(r.ptr, 4) for r in (c[0], c2, *got)] == [b"\x07" * 4, b"\x07" * 4, b"XXXX", b"ZZZZ"]
    finally:
        a.close()
        b.close()


async def test_a_deregistration_holds_no_rank_while_it_waits_for_the_device() -> None:
    """Rank 0's receive from rank 2 is queued; rank 0's worker drops a registered buffer;
    rank 1 sends to 2, which rank 2 receives before it sends to 0. The deregistration
    waits for rank 0's receive, but rank 1's send must launch meanwhile."""
    gpu = FakeGpu(devices=3)
    a, b = NcclEngine(gpu), NcclEngine(gpu)
    try:
        uid = a.unique_id()
        ca = a.communicator("w", 1, 3, [0, 1], devices={0: 0, 1: 1}, unique_id=uid)
        cb = b.communicator("w", 1, 3, [2], devices={2: 2}, unique_id=uid)
        ca.register(0, 7, vmm_mapping(a, gpu, b"R" * 4).region(0, 4))
        await asyncio.gather(ca.run(BarrierOp((0, 1, 2))), cb.run(BarrierOp((0, 1, 2))))
        assert len(gpu.registered) == 1
        landing = ipc_mapping(a, gpu, b"." * 4).region(0, 4)
        z = ipc_mapping(a, gpu, b"Z" * 4, device=1).region(0, 4)
        got, y = (ipc_mapping(b, gpu, data * 4, device=2).region(0, 4) for data in (b".", b"Y"))
        received = asyncio.ensure_future(ca.run(RecvOp(2, 0, landing, NO_TAG)))
        await asyncio.sleep(0.05)
        ca.deregister(0, 7)
        await asyncio.sleep(0)
        sent = asyncio.ensure_future(ca.run(SendOp(1, 2, z, NO_TAG)))
        await asyncio.wait_for(cb.run(RecvOp(1, 2, got, NO_TAG)), 5)
        await asyncio.wait_for(cb.run(SendOp(2, 0, y, NO_TAG)), 5)
        await asyncio.wait_for(asyncio.gather(received, sent), 5)
        await until(lambda: gpu.registered == {})
        assert (gpu.read(landing.ptr, 4), gpu.read(got.ptr, 4)) == (b"YYYY", b"ZZZZ")
        assert gpu.violations == []
        await until(lambda: not ca.busy())
    finally:
        a.close()
        b.close()


async def test_a_deregistration_goes_through_while_other_buffers_keep_the_ranks_busy(gpu: FakeGpu) -> None:
    """Ops on other buffers keep both ranks launching; the deregistration waits only for
    what used its own buffer, so it does not wait for the traffic to stop."""
    engine = NcclEngine(gpu)
    waited = gpu.event_wait

    def slow_wait(event: int, device: int) -> None:
        time.sleep(0.002)  # the device's time for an op
        waited(event, device)

    gpu.event_wait = slow_wait  # type: ignore[method-assign]
    stop = False
    try:
        comm = engine.communicator("w", 1, 2, [0, 1], devices={0: 0, 1: 1})
        comm.register(0, 7, vmm_mapping(engine, gpu, b"R" * 4).region(0, 4))
        await comm.run(BarrierOp((0, 1)))
        assert len(gpu.registered) == 1

        async def traffic() -> None:
            bufs = {r: ipc_mapping(engine, gpu, b"\x01" * 4, device=r).region(0, 4) for r in (0, 1)}
            while not stop:
                await comm.run(AllReduceOp(bufs, DType.U8, ReduceOp.MAX))

        loops = [asyncio.ensure_future(traffic()) for _ in range(4)]
        await asyncio.sleep(0.1)
        comm.deregister(0, 7)
        await until(lambda: gpu.registered == {}, timeout=2)
        assert not any(loop.done() for loop in loops)  # the traffic went on all along
        stop = True
        await asyncio.wait_for(asyncio.gather(*loops), 5)
        assert gpu.violations == []
    finally:
        stop = True
        engine.close()


async def test_a_ranks_calls_reach_nccl_in_the_order_they_matched() -> None:
    """Rank 0's send to rank 2 (elsewhere) is still connecting; a transfer from 0 to 1,
    then rank 1's send to 2, follow. The transfer waits for rank 0; rank 1's send, which
    matched after it, must not pass it on rank 1 (a peer expects rank 1's calls in that
    order): each rank's calls keep their order, whatever else the first waits for."""
    gpu = FakeGpu(devices=3)
    a, b, ca, cb = await three_rank_world(gpu)
    try:
        gpu.lazy_connect = {(0, 2)}
        buf = [ipc_mapping(a, gpu, bytes([65 + r]) * 4, device=r).region(0, 4) for r in (0, 1)]
        there = [ipc_mapping(b, gpu, b"." * 4, device=2).region(0, 4) for _ in range(2)]
        landing = ipc_mapping(a, gpu, b"." * 4, device=1).region(0, 4)
        runs = [asyncio.ensure_future(ca.run(SendOp(0, 2, buf[0], NO_TAG)))]
        await asyncio.sleep(0.05)  # connecting
        runs.append(asyncio.ensure_future(ca.run(TransferOp(0, buf[0], 1, landing))))
        await asyncio.sleep(0)
        runs.append(asyncio.ensure_future(ca.run(SendOp(1, 2, buf[1], NO_TAG))))
        await asyncio.sleep(0.1)
        on_rank_1 = [(kind, src, dst) for kind, src, dst in gpu.p2p_log if 1 in (src, dst)]
        assert on_rank_1 == []  # the transfer waits for rank 0, and rank 1's send behind it
        await asyncio.wait_for(cb.run(RecvOp(0, 2, there[0], NO_TAG)), 5)
        await asyncio.wait_for(cb.run(RecvOp(1, 2, there[1], NO_TAG)), 5)
        await asyncio.wait_for(asyncio.gather(*runs), 5)
        log = gpu.p2p_log
        assert log.index(("recv", 0, 1)) < log.index(("send", 1, 2))  # rank 1: the transfer first
        assert [gpu.read(r.ptr, 4) for r in (*there, landing)] == [b"AAAA", b"BBBB", b"AAAA"]
    finally:
        a.close()
        b.close()


async def test_an_op_started_right_after_a_deregistration_is_never_deregistered_under(gpu: FakeGpu) -> None:
    """An op started on the buffer while its deregistration drains the device: either it
    launches after the deregistration, or the deregistration sees the launch and waits for
    it too; never ncclCommDeregister under it."""
    root, member, ca, cb = two_daemon_world(gpu)
    try:
        mine = vmm_mapping(root, gpu, b"\x02" * 8).region(0, 8)
        theirs = ipc_mapping(member, gpu, b"\x03" * 8, device=1).region(0, 8)
        ca.register(0, 1, mine)
        tag = CallTag(0, "all_reduce(bytes=8, dtype=u8, op=sum)")
        await asyncio.gather(ca.run(AllReduceOp({0: mine}, DType.U8, ReduceOp.SUM, tag)),
                             cb.run(AllReduceOp({1: theirs}, DType.U8, ReduceOp.SUM, tag)))
        assert len(gpu.registered) == 1
        ca.deregister(0, 1)
        tag = CallTag(1, "all_reduce(bytes=8, dtype=u8, op=sum)")
        second = asyncio.ensure_future(ca.run(AllReduceOp({0: mine}, DType.U8, ReduceOp.SUM, tag)))
        await asyncio.sleep(0.2)  # rank 0's op waits for rank 1 on the device
        await cb.run(AllReduceOp({1: theirs}, DType.U8, ReduceOp.SUM, tag))
        await asyncio.wait_for(second, 5)
        await until(lambda: gpu.registered == {})
        assert gpu.violations == []
        assert gpu.read(mine.ptr, 8) == b"\x0a" * 8  # (2 + 3) twice
    finally:
        root.close()
        member.close()


async def test_a_run_cancelled_on_the_device_stops_it_before_its_memory_goes(gpu: FakeGpu) -> None:
    """A run given up while its op waits on the device (for the other daemon's rank):
    the communicator is aborted (the op is dropped), and only then is the memory let go;
    cancelled twice, nothing stays counted as running."""
    root, member, ca, _ = two_daemon_world(gpu)
    try:
        mapping = ipc_mapping(root, gpu, b"\x02" * 8)
        tag = CallTag(0, "all_reduce(bytes=8, dtype=u8, op=sum)")
        op = AllReduceOp({0: mapping.region(0, 8)}, DType.U8, ReduceOp.SUM, tag)
        run = asyncio.ensure_future(ca.run(op))
        await asyncio.sleep(0.2)
        mapping.close()  # the session forgot the buffer: it goes once the op is over
        run.cancel()
        await asyncio.sleep(0)
        run.cancel()  # and again, while it stops
        with pytest.raises(asyncio.CancelledError):
            await run
        await until(lambda: not ca.busy())
        with pytest.raises(CallError) as info:  # the communicator was aborted for it
            await ca.run(BarrierOp((0, 1)))
        assert info.value.code is ErrorCode.WORLD_FAILED
        await until(lambda: (Origin.IPC, "commd-cuda-free_0") in gpu.released_on)
        assert gpu.violations == []
    finally:
        root.close()
        member.close()


async def test_memory_of_a_run_cancelled_twice_goes_only_once_the_device_let_go_of_it(gpu: FakeGpu) -> None:
    """The op waits on the device behind the worker's kernel (its ready event). Cancelled,
    the run aborts and waits for the stream; cancelled again meanwhile, it ends at once,
    but the memory stays until the stream got past the op (the aborted kernel still
    launches there), then goes."""
    root, member, ca, _ = two_daemon_world(gpu)
    try:
        stream = gpu.worker_stream()
        ptr = gpu.worker_alloc(b"\x02" * 8)
        mapping = root.import_memory(MemKind.CUDA_IPC, 8, gpu.export_ipc(ptr), None)
        ready, _, pair = worker_events(root, gpu)
        kernel = gpu.worker_kernel(stream, ptr, b"\x03" * 8)
        gpu.event_record(ready, stream)
        tag = CallTag(0, "all_reduce(bytes=8, dtype=u8, op=sum)")
        op = AllReduceOp({0: mapping.region(0, 8)}, DType.U8, ReduceOp.SUM, tag)
        run = asyncio.ensure_future(ca.run(op, Order({0: pair})))
        await asyncio.sleep(0.2)
        mapping.close()
        run.cancel()
        await asyncio.sleep(0.05)
        run.cancel()  # while it waits for the device
        with pytest.raises(asyncio.CancelledError):
            await asyncio.wait_for(run, 5)
        await asyncio.sleep(0.2)
        assert ca.busy() and Origin.IPC not in dict(gpu.released_on)  # the op is still queued
        gpu.finish_kernel(kernel)
        await until(lambda: (Origin.IPC, "commd-cuda-free_0") in gpu.released_on)
        await until(lambda: not ca.busy())
    finally:
        root.close()
        member.close()


async def test_deregistration_waits_for_the_ops_that_use_the_buffer(gpu: FakeGpu) -> None:
    """ncclCommDeregister unmaps the peers' view of the buffer at once: never under an op
    still on the device (here: waiting for the other daemon's rank)."""
    root, member = NcclEngine(gpu), NcclEngine(gpu)
    try:
        uid = root.unique_id()
        mine = vmm_mapping(root, gpu, b"\x02" * 8)
        theirs = ipc_mapping(member, gpu, b"\x03" * 8, device=1).region(0, 8)
        ca = root.communicator("w", 1, 2, [0], devices={0: 0}, unique_id=uid)
        cb = member.communicator("w", 1, 2, [1], devices={1: 1}, unique_id=uid)
        ca.register(0, 1, mine.region(0, 8))
        first = asyncio.ensure_future(ca.run(AllReduceOp({0: mine.region(0, 8)}, DType.U8, ReduceOp.SUM)))
        await until(lambda: len(gpu.registered) == 1)
        ca.deregister(0, 1)
        mine.close()  # the session forgets the buffer: it goes once NCCL let go of it
        await asyncio.sleep(0.2)
        assert len(gpu.registered) == 1 and not first.done()  # the sum still waits for rank 1
        await cb.run(AllReduceOp({1: theirs}, DType.U8, ReduceOp.SUM))
        await asyncio.wait_for(first, 5)
        await until(lambda: gpu.registered == {})
        assert gpu.read(theirs.ptr, 8) == b"\x05" * 8
    finally:
        root.close()
        member.close()


async def test_a_send_and_a_receive_started_together_pair_up_in_one_nccl_group(gpu: FakeGpu) -> None:
    """Two ranks (on two daemons) each send the other a message and receive the other's,
    as one client group: launched apart, both sends would wait for the other's receive
    forever (the fake device, like NCCL with large messages, pairs them at the streams'
    heads); launched in one NCCL group they pair up."""
    root, member, ca, cb = two_daemon_world(gpu)
    try:
        tag = CallTag(0, "barrier()")
        await asyncio.gather(ca.run(BarrierOp((0, 1), tag)), cb.run(BarrierOp((0, 1), tag)))  # both ready
        engines = (root, member)
        out = [ipc_mapping(e, gpu, bytes([r + 1]) * 32).region(0, 32) for r, e in enumerate(engines)]
        into = [ipc_mapping(engine, gpu, b"\x00" * 32).region(0, 32) for engine in engines]
        launches = gpu.launches
        group_a, group_b = frozenset({"rank 0's group"}), frozenset({"rank 1's group"})
        await asyncio.wait_for(asyncio.gather(
            ca.run(SendOp(0, 1, out[0], NO_TAG), None, group_a),
            ca.run(RecvOp(1, 0, into[0], NO_TAG), None, group_a),
            cb.run(SendOp(1, 0, out[1], NO_TAG), None, group_b),
            cb.run(RecvOp(0, 1, into[1], NO_TAG), None, group_b)), 10)
        assert gpu.read(into[0].ptr, 32) == b"\x02" * 32 and gpu.read(into[1].ptr, 32) == b"\x01" * 32
        assert gpu.launches - launches == 2  # one group per daemon
    finally:
        root.close()
        member.close()


async def test_ops_of_other_requests_started_together_launch_apart() -> None:
    """Rank 0 sends to rank 1 (both here) and, in another request of the same turn, to
    rank 2 (elsewhere), which has not received yet. The local transfer completes on its
    own: merged in one NCCL group with the send, it would wait for rank 2."""
    gpu = FakeGpu(devices=3)
    a, b, ca, cb = await three_rank_world(gpu)
    try:
        x = ipc_mapping(a, gpu, b"X" * 4).region(0, 4)
        landing = ipc_mapping(a, gpu, b"." * 4, device=1).region(0, 4)
        y = ipc_mapping(a, gpu, b"Y" * 4).region(0, 4)
        got = ipc_mapping(b, gpu, b"." * 4, device=2).region(0, 4)
        launches = gpu.launches
        local = asyncio.ensure_future(ca.run(TransferOp(0, x, 1, landing), None, frozenset({"t0", "t1"})))
        remote = asyncio.ensure_future(ca.run(SendOp(0, 2, y, NO_TAG), None, frozenset({"t2"})))
        await asyncio.wait_for(local, 5)
        assert gpu.read(landing.ptr, 4) == b"XXXX" and not remote.done()
        assert gpu.launches - launches == 2
        await asyncio.wait_for(cb.run(RecvOp(0, 2, got, NO_TAG)), 5)
        await asyncio.wait_for(remote, 5)
        assert gpu.read(got.ptr, 4) == b"YYYY"
    finally:
        a.close()
        b.close()


@pytest.mark.parametrize("grouped", [False, True])
async def test_collectives_are_grouped_alike_on_every_daemon(gpu: FakeGpu, grouped: bool) -> None:
    """Two sums reach one daemon in the same turn, the other daemon one after the other.
    NCCL picks a collective's algorithm by what else is in its group, so both daemons
    must group them alike: apart, unless one request of each worker holds both (then
    both daemons see them in one turn, and group them)."""
    root, member, ca, cb = two_daemon_world(gpu)
    try:
        mine = [ipc_mapping(root, gpu, bytes([v]) * 4).region(0, 4) for v in (1, 2)]
        theirs = [ipc_mapping(member, gpu, bytes([v]) * 4).region(0, 4) for v in (10, 20)]
        tags = [CallTag(i, "all_reduce(bytes=4, dtype=u8, op=sum)") for i in (0, 1)]
        requests_a = [frozenset({"a"})] * 2 if grouped else [frozenset({"a0"}), frozenset({"a1"})]
        requests_b = [frozenset({"b"})] * 2 if grouped else [frozenset({"b0"}), frozenset({"b1"})]
        here = [asyncio.ensure_future(ca.run(AllReduceOp({0: mine[i]}, DType.U8, ReduceOp.SUM, tags[i]),
                                             None, requests_a[i])) for i in (0, 1)]
        there = [cb.run(AllReduceOp({1: theirs[i]}, DType.U8, ReduceOp.SUM, tags[i]), None, requests_b[i])
                 for i in (0, 1)]
        if grouped:
            await asyncio.wait_for(asyncio.gather(*there), 5)
        else:
            for run in there:
                await asyncio.wait_for(run, 5)
        await asyncio.wait_for(asyncio.gather(*here), 5)
        assert [gpu.read(r.ptr, 1)[0] for r in (*mine, *theirs)] == [11, 22, 11, 22]
        assert gpu.violations == []
    finally:
        root.close()
        member.close()


def test_a_batch_is_cut_into_launches_by_request_keeping_its_order() -> None:
    def entry(*requests: str) -> Launch:
        return Launch([], None, [], [], asyncio.Future(loop=loop), [], frozenset(requests))

    loop = asyncio.new_event_loop()
    try:
        a1, b, a2, c, d1, d2, e = (entry("a"), entry("b"), entry("a"), entry(), entry("d", "x"),
                                   entry("x"), entry("e"))
        # b lies between a's two ops: on a rank they share it must stay between them
        assert _by_request([a1, b, a2, c, d1, d2, e]) == [[a1, b, a2], [c], [d1, d2], [e]]
        assert _by_request([]) == []
    finally:
        loop.close()


async def test_the_add_kernel_is_compiled_off_the_loop_and_used_once_loaded(engine: NcclEngine,
                                                                           gpu: FakeGpu) -> None:
    gpu.compiled = set()  # as on a GPU: NVRTC has to compile it first
    comm = engine.communicator("w", 1, 2, [0, 1], devices={0: 0, 1: 1})
    comm.use_add_kernel(frozenset({0, 1}))
    for _ in range(100):
        if gpu.compiled == {0, 1}:
            break
        await asyncio.sleep(0.01)
    assert gpu.compiled == {0, 1} and gpu.compile_thread.startswith("commd-nvrtc")  # not the loop's
    inputs = [make_input(5, r, 64, "bf16", "sum") for r in range(2)]
    bufs = {r: ipc_mapping(engine, gpu, inputs[r].tobytes(), device=r).region(0, 128) for r in range(2)}
    await comm.run(AllReduceOp(bufs, DType.BF16, ReduceOp.SUM))
    assert gpu.adds == 2
    want = reduce_reference(inputs, "bf16", "sum").tobytes()
    assert [gpu.read(b.ptr, 128) for b in bufs.values()] == [want, want]


async def test_a_send_and_a_receive_of_different_sizes_across_daemons_are_a_mismatch(gpu: FakeGpu) -> None:
    """The sender's daemon tells the receiver's the size it sends; a receive of another
    size fails as a mismatch (NCCL would truncate, fail or wait), its communicator aborted."""
    root, member, a, b = across_two_daemons(gpu)
    try:
        ca = root.communicator("w", 1, 2, [0], a, unique_id=root.unique_id())  # type: ignore[arg-type]
        landing = ipc_mapping(root, gpu, b"\x00" * 16).region(0, 16)
        tag = CallTag(0, "recv_from(bytes=16, peer=1)")
        run = asyncio.ensure_future(ca.run(RecvOp(1, 0, landing, tag)))
        await asyncio.sleep(0.1)
        b.send("root", p.Data("w", 1, "p2p-check", 0, 0, (1 << 16) * 1 + 0, "32"))  # rank 1 sends 32
        with pytest.raises(CallError) as info:
            await asyncio.wait_for(run, 5)
        assert info.value.code is ErrorCode.MISMATCH
        assert info.value.message == ("mismatched point-to-point 1->0 call 0: rank 1 called "
                                      "send_to(bytes=32, peer=0), rank 0 called recv_from(bytes=16, peer=1)")
    finally:
        root.close()
        member.close()


@pytest.mark.parametrize("receiver", ["root", "member"])
@pytest.mark.parametrize("end", ["inbox fails", "abort"])
async def test_a_receive_past_on_the_device_whose_senders_size_never_comes_ends_with_the_world(
        gpu: FakeGpu, receiver: str, end: str) -> None:
    """The p2p cross-check's case of the test above: the sender's daemon sent its size to
    nobody (the link went silent), the receive ran on the device and waits for it; the
    world's failure (or an abort) ends it with its words, the memory let go."""
    root, member, a, b = across_two_daemons(gpu)
    src, dst = (1, 0) if receiver == "root" else (0, 1)
    sending, receiving = (b, a) if receiver == "root" else (a, b)
    sending.other = PairNet("C", sending.placement)  # (what the sender's daemon sends reaches nobody)
    try:
        uid = root.unique_id()
        ca = root.communicator("w", 1, 2, [0], a, unique_id=uid)  # type: ignore[arg-type]
        cb = member.communicator("w", 1, 2, [1], b, unique_id=uid)  # type: ignore[arg-type]
        engines, comms = {0: root, 1: member}, {0: ca, 1: cb}
        sent = ipc_mapping(engines[src], gpu, b"S" * 4, device=src)
        landing = ipc_mapping(engines[dst], gpu, b"." * 4, device=dst)
        run = asyncio.ensure_future(comms[dst].run(
            RecvOp(src, dst, landing.region(0, 4), CallTag(0, f"recv_from(bytes=4, peer={src})"))))
        await asyncio.wait_for(comms[src].run(
            SendOp(src, dst, sent.region(0, 4), CallTag(0, f"send_to(bytes=4, peer={dst})"))), 5)
        await asyncio.sleep(0.3)
        assert not run.done() and gpu.read(landing.region(0, 4).ptr, 4) == b"SSSS"  # landed, waits
        landing.close()
        before = gpu.allocations
        if end == "abort":
            comms[dst].abort()
            expected = (ErrorCode.WORLD_FAILED, "communicator was aborted")
        else:
            expected = (ErrorCode.PEER_LOST, f"daemon {sending.me} was lost: silent for 3.0s")
            receiving.inbox.fail(CallError(*expected))
        with pytest.raises(CallError) as info:
            await asyncio.wait_for(run, 5)
        assert (info.value.code, info.value.message) == expected
        assert not isinstance(info.value, StillOnDevice) and not comms[dst].busy()
        await until(lambda: gpu.allocations == before - 1)  # (on the free's thread)
    finally:
        root.close()
        member.close()


async def test_an_op_whose_memory_was_released_before_it_ran_is_refused(engine: NcclEngine,
                                                                       gpu: FakeGpu) -> None:
    """A matched op still queued when its worker forgot the buffer (or left) must not run
    on freed memory: it fails, and nothing reaches the device."""
    comm = engine.communicator("w", 1, 1, [0])
    await comm.run(BarrierOp((0,)))
    mapping = ipc_mapping(engine, gpu, b"\x01" * 8)
    region = mapping.region(0, 8)
    mapping.close()  # released now: no op held it
    launches = gpu.launches
    with pytest.raises(CallError) as info:
        await comm.run(AllReduceOp({0: region}, DType.U8, ReduceOp.SUM))
    assert info.value.code is ErrorCode.UNKNOWN_BUFFER and gpu.launches == launches
    assert not comm.busy()


def test_the_engine_describes_its_nccl_and_gpus_or_why_it_cannot(engine: NcclEngine, gpu: FakeGpu) -> None:
    assert engine.describe() == "nccl (NCCL 2.30.0, 2 GPUs)"

    def broken() -> int:
        raise GpuError("ncclGetVersion: unhandled cuda error")

    gpu.nccl_version = broken  # type: ignore[method-assign]
    assert engine.describe() == "nccl (ncclGetVersion: unhandled cuda error)"


class _FreesDuringLaunches(FakeGpu):
    """Notes each device-wide call (free, module load, deregistration) made while a
    launch reads ncclInProgress."""

    def __init__(self) -> None:
        super().__init__(devices=1, multi_rank_gpu=True, launch_polls=50)
        self.launching: set[int] = set()
        self.inside: list[str] = []

    def comm_state(self, comm: int) -> tuple[CommState, str]:
        state, why = super().comm_state(comm)
        (self.launching.add if state is CommState.IN_PROGRESS else self.launching.discard)(comm)
        return state, why

    def release(self, memory: Imported) -> None:
        if self.launching:
            self.inside.append(f"{memory.origin.value} free")
        super().release(memory)

    def prepare_add(self, device: int, loading: Callable[[], AbstractContextManager[None]]) -> None:
        @contextlib.contextmanager
        def noting() -> Iterator[None]:
            with loading():
                if self.launching:
                    self.inside.append("module load")
                yield
        super().prepare_add(device, noting)

    def comm_deregister(self, comm: int, handle: int) -> None:
        if self.launching:
            self.inside.append("deregistration")
        super().comm_deregister(comm, handle)

    def comm_abort(self, comm: int) -> None:
        super().comm_abort(comm)
        self.launching.discard(comm)  # NCCL's thread enqueues none of its launch after this


def _after_the_first_release(gpu: FakeGpu, then: Callable[[], object]) -> None:
    """The first free (on the gate's thread) runs `then` once it has let go."""
    real_release = gpu.release

    def release(memory: Imported) -> None:
        real_release(memory)
        if len(gpu.released_on) == 1:
            then()

    gpu.release = release  # type: ignore[method-assign]


async def _send_left_half_made(engine: NcclEngine, gpu: _FreesDuringLaunches
                               ) -> tuple[NcclCommunicator, asyncio.Future[None]]:
    """World w's rank 0 sends to rank 1, whose receive never comes: NCCL connects lazily,
    so the launch stays ncclInProgress."""
    gpu.lazy_connect = {(0, 1)}
    comm = engine.communicator("w", 1, 2, [0, 1], devices={0: 0, 1: 0})
    payload = ipc_mapping(engine, gpu, b"p" * 8).region(0, 8)
    await comm.run(BarrierOp((0, 1)))
    sent = asyncio.ensure_future(comm.run(SendOp(0, 1, payload, NO_TAG)))
    await until(lambda: bool(gpu.launching))
    return comm, sent


async def _cancelled(task: asyncio.Future[None]) -> None:
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError, CallError):
        await task


async def test_no_free_and_no_module_load_starts_inside_a_launch() -> None:
    """A non-blocking group end leaves NCCL's thread to enqueue the ranks' kernels one
    after the other; a call that waits for the device meanwhile (cuMemFree, cuIpcClose,
    ncclMemFree, cuModuleLoad) can deadlock with it. Those asked during the launch start
    once it settled, and each still happens."""
    gpu = _FreesDuringLaunches()
    gpu.compiled = set()
    engine = NcclEngine(gpu)
    try:
        comm = engine.communicator("w", 1, 2, [0, 1], devices={0: 0, 1: 0})
        bufs = {r: ipc_mapping(engine, gpu, b"\x80\x3f" * 32).region(0, 64) for r in (0, 1)}  # bf16 1.0
        await comm.run(BarrierOp((0, 1)))
        other, cached = ipc_mapping(engine, gpu, b"x" * 64), vmm_mapping(engine, gpu, b"y" * 64)
        shared, fd = engine.allocate(64)
        os.close(fd)
        run = asyncio.ensure_future(comm.run(AllReduceOp(bufs, DType.BF16, ReduceOp.SUM)))
        await until(lambda: bool(gpu.launching))
        other.close()  # a worker forgot a buffer
        cached.close()
        shared.close()  # symmetric_free
        comm.use_add_kernel(frozenset({0, 1}))  # compiles and loads the add kernel
        await asyncio.wait_for(run, 5)
        await until(lambda: len(gpu.released_on) == 3 and gpu.add_ready(0))
    finally:
        engine.close()
    assert gpu.inside == []
    assert sorted(origin.value for origin, _ in gpu.released_on) == ["ipc", "nccl", "vmm"]
    assert [gpu.read(b.ptr, 64) for b in bufs.values()] == [b"\x00\x40" * 32] * 2  # 1 + 1


async def test_a_free_asked_between_launches_still_waits_for_one_begun_before_it_ran() -> None:
    """The gate's thread is busy (a slow ncclMemFree) when a launch begins: the frees
    queued behind it were asked between launches, yet must not start inside this one."""
    gpu = _FreesDuringLaunches()
    gpu.lazy_connect = {(0, 1)}  # the send stays in progress until its receive comes
    engine = NcclEngine(gpu)
    try:
        comm = engine.communicator("w", 1, 2, [0, 1], devices={0: 0, 1: 0})
        payload, landing = (ipc_mapping(engine, gpu, data * 8).region(0, 8) for data in (b"p", b"."))
        await comm.run(BarrierOp((0, 1)))
        allocated = [engine.allocate(64) for _ in range(3)]
        for _, fd in allocated:
            os.close(fd)
        _after_the_first_release(gpu, lambda: time.sleep(0.3))  # (it waits for the device a while)
        for shared, _ in allocated:
            shared.close()  # no launch yet: each goes to the gate's thread
        sent = asyncio.ensure_future(comm.run(SendOp(0, 1, payload, NO_TAG)))
        await until(lambda: bool(gpu.launching))
        await asyncio.sleep(0.5)
        assert len(gpu.released_on) <= 1 and gpu.inside == []  # the others wait for the launch
        await asyncio.wait_for(asyncio.gather(sent, comm.run(RecvOp(0, 1, landing, NO_TAG))), 5)
        await until(lambda: len(gpu.released_on) == 3)
        assert gpu.inside == [] and gpu.read(landing.ptr, 8) == b"p" * 8
    finally:
        engine.close()


async def test_the_add_kernel_module_loads_between_launches_however_long_it_compiled() -> None:
    gpu = _FreesDuringLaunches()
    gpu.compiled, gpu.compile_takes_s = set(), 0.3
    gpu.lazy_connect = {(0, 1)}
    engine = NcclEngine(gpu)
    try:
        comm = engine.communicator("w", 1, 2, [0, 1], devices={0: 0, 1: 0})
        payload, landing = (ipc_mapping(engine, gpu, data * 8).region(0, 8) for data in (b"p", b"."))
        await comm.run(BarrierOp((0, 1)))
        comm.use_add_kernel(frozenset({0, 1}))  # no launch open now: NVRTC starts
        await asyncio.sleep(0.05)
        sent = asyncio.ensure_future(comm.run(SendOp(0, 1, payload, NO_TAG)))
        await until(lambda: bool(gpu.launching))
        await asyncio.sleep(0.5)  # compiled by now: the load waits for the launch
        assert not gpu.add_ready(0)
        await asyncio.wait_for(asyncio.gather(sent, comm.run(RecvOp(0, 1, landing, NO_TAG))), 5)
        await until(lambda: gpu.add_ready(0))
        assert gpu.inside == []
    finally:
        engine.close()


async def test_a_deregistration_waits_for_another_worlds_launch() -> None:
    """ncclCommDeregister unmaps the peers' views (a free in all but name), on the loop."""
    gpu = _FreesDuringLaunches()
    gpu.lazy_connect = {(0, 1)}
    engine = NcclEngine(gpu)
    try:
        a = engine.communicator("a", 1, 2, [0, 1], devices={0: 0, 1: 0})
        b = engine.communicator("b", 1, 1, [0], devices={0: 0})
        b.register(0, 7, vmm_mapping(engine, gpu, b"R" * 64).region(0, 64))
        await asyncio.gather(a.run(BarrierOp((0, 1))), b.run(BarrierOp((0,))))
        assert len(gpu.registered) == 1
        payload, landing = (ipc_mapping(engine, gpu, data * 8).region(0, 8) for data in (b"p", b"."))
        sent = asyncio.ensure_future(a.run(SendOp(0, 1, payload, NO_TAG)))
        await until(lambda: bool(gpu.launching))
        b.deregister(0, 7)
        await asyncio.sleep(0.3)
        assert len(gpu.registered) == 1  # it waits for world a's launch
        await asyncio.wait_for(asyncio.gather(sent, a.run(RecvOp(0, 1, landing, NO_TAG))), 5)
        await until(lambda: gpu.registered == {})
        assert gpu.inside == []
    finally:
        engine.close()


async def test_a_launch_cut_short_by_an_abort_holds_the_frees_until_the_abort_returned() -> None:
    """NCCL's thread may still enqueue an aborted world's launch until ncclCommAbort
    returned: a free waits for that, not just for the launch's coroutine to end."""
    gpu = _FreesDuringLaunches()
    engine = NcclEngine(gpu)
    try:
        comm, sent = await _send_left_half_made(engine, gpu)
        ipc_mapping(engine, gpu, b"x" * 64).close()
        gpu.abort_takes_s = 0.5
        comm.abort()
        await until(lambda: gpu.aborting == 1)
        await asyncio.sleep(0.2)
        assert gpu.released_on == []  # the abort still runs
        with pytest.raises(CallError):  # (its drain, and so its answer, waits for the abort)
            await asyncio.wait_for(sent, 5)
        await until(lambda: gpu.released_on != [])
        assert gpu.aborting == 0
    finally:
        engine.close()


async def test_a_launch_that_never_settles_keeps_no_free_past_the_engine_closing() -> None:
    """A send whose receive never comes stays ncclInProgress; a free asked meanwhile
    waits for it, until the engine closes: then it goes, and closing does not hang."""
    gpu = _FreesDuringLaunches()
    engine = NcclEngine(gpu)
    _, sent = await _send_left_half_made(engine, gpu)
    ipc_mapping(engine, gpu, b"x" * 64).close()
    await asyncio.sleep(0.5)
    assert gpu.released_on == [] and gpu.launching  # (still half made)
    engine.close()  # (cancelled first, the launch would end its window itself)
    assert [origin for origin, _ in gpu.released_on] == [Origin.IPC]
    await _cancelled(sent)


async def test_a_free_handed_back_to_the_loop_by_a_launch_goes_before_the_engine_closed() -> None:
    """The gate's thread finds a launch half made when an ncclMemFree's turn comes and
    hands the free back (it must never wait), just as the loop stops the daemon: the
    world aborted, the engine closed. The memory must be gone when close returns (the
    workers hear of the stop then, and no loop may run after), not inside the launch."""
    gpu = _FreesDuringLaunches()
    engine = NcclEngine(gpu)
    allocated = [engine.allocate(64) for _ in range(2)]
    for _, fd in allocated:
        os.close(fd)
    go = threading.Event()
    _after_the_first_release(gpu, lambda: go.wait(5))  # (it keeps the gate's thread until `go`)
    for shared, _ in allocated:
        shared.close()  # no launch yet: both go to the gate's thread
    await until(lambda: len(gpu.released_on) == 1)  # (the first: before any launch began)
    comm, sent = await _send_left_half_made(engine, gpu)
    live = gpu.allocations  # (the second's among them)
    try:
        go.set()
        time.sleep(0.5)  # (the loop blocked) the second free's turn: it finds the launch half made
        assert [origin for origin, _ in gpu.released_on] == [Origin.NCCL]
        comm.abort()  # (a daemon stopping: every world, then the engine)
    finally:
        go.set()
        engine.close()
    assert [origin for origin, _ in gpu.released_on] == [Origin.NCCL] * 2  # (no await since close)
    assert gpu.allocations == live - 1
    await _cancelled(sent)
    await asyncio.sleep(0.1)  # what the loop still had: no second ncclMemFree
    assert [origin for origin, _ in gpu.released_on].count(Origin.NCCL) == 2
    assert gpu.inside == [] and gpu.violations == []


async def test_ncclmemalloc_memory_that_cannot_be_handed_over_goes_between_launches() -> None:
    """With NCCL's cuMem allocator off, ncclMemAlloc gives cudaMalloc memory, which has no
    fd for the worker: symmetric_alloc fails and the memory goes (ncclMemFree, a cudaFree
    that waits for the device). Through the real bindings, asked while a launch is half
    made: it must not go inside it, yet must go."""
    gpu = _FreesDuringLaunches()
    with fakecuda.bound(gpu) as abi:
        engine = NcclEngine(BindingsGpu())
        try:
            baseline = gpu.allocations
            shared, fd = engine.allocate(8)  # (the payload: cuMem memory, shareable)
            os.close(fd)
            gpu.lazy_connect = {(0, 1)}
            comm = engine.communicator("w", 1, 2, [0, 1], devices={0: 0, 1: 0})
            landing = engine.allocate(8)
            os.close(landing[1])
            await comm.run(BarrierOp((0, 1)))
            sent = asyncio.ensure_future(comm.run(SendOp(0, 1, shared.region(0, 8), NO_TAG)))
            await until(lambda: bool(gpu.launching))
            abi.nccl_cumem = False
            with pytest.raises(CallError) as info:
                engine.allocate(64)
            assert info.value.code is ErrorCode.LIMIT and "NCCL_CUMEM_ENABLE=0" in info.value.message
            assert gpu.inside == [] and gpu.launching  # not inside the launch, still half made
            await asyncio.wait_for(asyncio.gather(sent, comm.run(RecvOp(0, 1, landing[0].region(0, 8),
                                                                         NO_TAG))), 5)
            await until(lambda: abi.calls.get("ncclMemFree", 0) == 1)  # once the launch settled
            assert gpu.inside == []
            for mapping in (shared, landing[0]):
                mapping.close()
            comm.abort()
            await until(lambda: not comm.busy() and abi.calls.get("ncclMemFree", 0) == 3)
        finally:
            engine.close()
        assert gpu.allocations == baseline and gpu.violations == []


async def test_a_launch_that_fails_in_progress_keeps_its_memory_until_the_device_is_past_it(
        engine: NcclEngine, gpu: FakeGpu) -> None:
    """A communicator fails while its launch is still in progress (queued behind the
    worker's kernel on rank 0's stream): the run aborts, and its memory stays until the
    stream got past the op (the aborted kernel still launches there), not at once."""
    comm = engine.communicator("w", 1, 2, [0, 1])
    await asyncio.wait_for(comm.run(BarrierOp((0, 1))), 5)
    stream = gpu.worker_stream()
    ptrs = [gpu.worker_alloc(b"\x01" * 8), gpu.worker_alloc(b"\x02" * 8, device=1)]
    mappings = [engine.import_memory(MemKind.CUDA_IPC, 8, gpu.export_ipc(ptr), None, device=r)
                for r, ptr in enumerate(ptrs)]
    ready, _, pair = worker_events(engine, gpu)
    kernel = gpu.worker_kernel(stream, ptrs[0], b"\x03" * 8)
    gpu.event_record(ready, stream)
    group_end = gpu.group_end

    def failing_group_end() -> None:
        group_end()
        gpu.fail(1, "ncclSystemError: a peer's connection broke mid-launch")

    gpu.group_end = failing_group_end  # type: ignore[method-assign]
    gpu.abort_takes_s = 0.2
    op = AllReduceOp({r: m.region(0, 8) for r, m in enumerate(mappings)}, DType.U8, ReduceOp.SUM)
    run = asyncio.ensure_future(comm.run(op, Order({0: pair})))
    await asyncio.sleep(0)  # (the run holds its memory)
    for mapping in mappings:
        mapping.close()  # the session forgot the buffers: they go once the op is over
    await asyncio.sleep(0.5)  # the abort returned; rank 0's stream still waits for the kernel
    assert Origin.IPC not in dict(gpu.released_on) and comm.busy()
    gpu.finish_kernel(kernel)
    with pytest.raises(CallError) as info:
        await asyncio.wait_for(run, 5)
    assert info.value.code is ErrorCode.ENGINE and "mid-launch" in info.value.message
    await until(lambda: [o for o, _ in gpu.released_on].count(Origin.IPC) == 2)
    await until(lambda: not comm.busy())
    assert gpu.violations == []


async def test_a_wait_that_fails_on_one_gpu_keeps_the_memory_until_the_others_are_past_the_op(
        gpu: FakeGpu) -> None:
    """cuEventSynchronize fails on rank 0's GPU (a sticky error there) while rank 1's side
    of the op still waits on its GPU behind the worker's kernel: the communicator is
    aborted, and the memory stays until rank 1's stream got past the op."""
    engine = NcclEngine(gpu)
    try:
        comm = engine.communicator("w", 1, 2, [0, 1], devices={0: 0, 1: 1})
        await asyncio.wait_for(comm.run(BarrierOp((0, 1))), 5)
        stream = gpu.worker_stream(1)
        ptrs = [gpu.worker_alloc(b"\x01" * 8), gpu.worker_alloc(b"\x02" * 8, device=1)]
        mappings = [engine.import_memory(MemKind.CUDA_IPC, 8, gpu.export_ipc(ptr), None, device=r)
                    for r, ptr in enumerate(ptrs)]
        ready, ready_handle = gpu.worker_event(1)
        _, done_handle = gpu.worker_event(1)
        pair = engine.import_events(ready_handle, done_handle, device=1)
        kernel = gpu.worker_kernel(stream, ptrs[1], b"\x03" * 8)
        gpu.event_record(ready, stream)
        fail_event_waits(gpu, 0)
        op = AllReduceOp({r: m.region(0, 8) for r, m in enumerate(mappings)}, DType.U8, ReduceOp.SUM)
        run = asyncio.ensure_future(comm.run(op, Order({1: pair})))
        await asyncio.sleep(0)  # (the run holds its memory)
        for mapping in mappings:
            mapping.close()  # the session forgot the buffers: they go once the op is over
        await asyncio.sleep(0.3)
        assert Origin.IPC not in dict(gpu.released_on) and comm.busy() and not run.done()
        gpu.finish_kernel(kernel)
        with pytest.raises(CallError) as info:
            await asyncio.wait_for(run, 5)
        assert info.value.code is ErrorCode.ENGINE and "illegal memory access" in info.value.message
        await until(lambda: [o for o, _ in gpu.released_on].count(Origin.IPC) == 2)
        with pytest.raises(CallError) as info:  # aborted for it
            await comm.run(BarrierOp((0, 1)))
        assert info.value.code is ErrorCode.WORLD_FAILED
        assert gpu.violations == []
    finally:
        engine.close()


async def test_a_wait_that_fails_once_the_stream_is_past_an_aborted_op_lets_its_memory_go(
        gpu: FakeGpu, caplog: pytest.LogCaptureFixture) -> None:
    """The world failed (the communicator aborted) while rank 1's side of an op waits
    behind its worker's kernel: rank 0 is answered, the memory waits for rank 1's
    stream. Once it gets there, its wait fails on the GPU (a sticky error). Every wait of
    the op is over then, as when a wait fails before the abort: the memory goes, and the
    communicator, busy no more, tears its streams down; it is not kept for ever."""
    engine = NcclEngine(gpu)
    stream = gpu.worker_stream(1)
    ptrs = [gpu.worker_alloc(b"\x01" * 4), gpu.worker_alloc(b"\x02" * 4, device=1)]
    kernel = gpu.worker_kernel(stream, ptrs[1], b"\x09" * 4)  # rank 1's, ahead of the op
    try:
        comm = engine.communicator("w", 1, 2, [0, 1], devices={0: 0, 1: 1})
        await asyncio.wait_for(comm.run(BarrierOp((0, 1))), 5)  # (the init settled)
        mappings = [engine.import_memory(MemKind.CUDA_IPC, 4, gpu.export_ipc(ptr), None, device=r)
                    for r, ptr in enumerate(ptrs)]
        (ready, ready_handle), (_, done_handle) = gpu.worker_event(1), gpu.worker_event(1)
        pair = engine.import_events(ready_handle, done_handle, device=1)
        gpu.event_record(ready, stream)
        fail_event_waits(gpu, 1, once_past=True)
        run = asyncio.ensure_future(comm.run(AllReduceOp({r: m.region(0, 4) for r, m in enumerate(mappings)},
                                                         DType.U8, ReduceOp.SUM), Order({1: pair})))
        await asyncio.sleep(0.2)
        for mapping in mappings:
            mapping.close()  # the session forgot the buffers: they go once the op is over
        daemon_streams = set(gpu.streams_of(0)) | set(gpu.streams_of(1))
        comm.abort()  # as the world does when it fails
        with pytest.raises(StillOnDevice) as info:
            await asyncio.wait_for(run, 5)
        # (rank 0's wait ends on its thread once the abort let its stream go: a moment after
        # the abort returned, when the op raised)
        await asyncio.wait_for(info.value.past[0], 5)
        assert not info.value.past[1].done()
        assert Origin.IPC not in dict(gpu.released_on) and comm.busy()
        gpu.finish_kernel(kernel)
        await asyncio.wait_for(info.value.past[1], 5)
        await until(lambda: [o for o, _ in gpu.released_on].count(Origin.IPC) == 2)
        await until(lambda: not comm.busy())
        assert not daemon_streams & (set(gpu.streams_of(0)) | set(gpu.streams_of(1))) - {stream}
        assert not [r for r in caplog.records if "stay mapped" in r.getMessage()]
        # the aborted op never ran; the kernel's write landed
        assert [gpu.read(ptr, 4) for ptr in ptrs] == [b"\x01" * 4, b"\x09" * 4]
    finally:
        gpu.finish_kernel(kernel)
        engine.close()


async def test_a_deregistration_asked_during_a_launch_still_connecting_holds_back_no_other_rank() -> None:
    """Rank 0's send to rank 2 (another daemon) is still connecting: rank 2 receives from
    rank 1 first. A buffer of rank 1 is deregistered meanwhile; rank 1's send must still
    launch (a valid program with a process per rank), and the deregistration goes after."""
    gpu = FakeGpu(devices=3)
    a, b = NcclEngine(gpu), NcclEngine(gpu)
    try:
        uid = a.unique_id()
        ca = a.communicator("w", 1, 3, [0, 1], devices={0: 0, 1: 1}, unique_id=uid)
        cb = b.communicator("w", 1, 3, [2], devices={2: 2}, unique_id=uid)
        ca.register(1, 7, vmm_mapping(a, gpu, b"R" * 4, device=1).region(0, 4))
        await asyncio.wait_for(asyncio.gather(ca.run(BarrierOp((0, 1, 2))), cb.run(BarrierOp((0, 1, 2)))), 5)
        assert len(gpu.registered) == 1
        await sends_crossing_a_connecting_one(gpu, a, b, ca, cb, meanwhile=lambda: ca.deregister(1, 7))
        await until(lambda: gpu.registered == {})
        await until(lambda: not ca.busy())
        assert gpu.violations == []
    finally:
        a.close()
        b.close()


def test_a_gpu_ordinal_is_checked_against_the_count_alone(engine: NcclEngine, gpu: FakeGpu,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """A hello naming a GPU by ordinal needs only the count: a driver that cannot give UUIDs
    (they find a worker's GPU by UUID, a separate question) refused every such hello."""
    def no_uuid(device: int) -> bytes:
        raise GpuError("cuDeviceGetUuid: not supported")

    monkeypatch.setattr(gpu, "device_uuid", no_uuid)
    engine.check_device(0)
    engine.check_device(1)
    for device in (2, -1):
        with pytest.raises(CallError, match=f"GPU {device} is not one this daemon sees") as caught:
            engine.check_device(device)
        assert caught.value.code is ErrorCode.MISUSE
    with pytest.raises(CallError, match="cannot read the GPUs' UUIDs") as caught:
        engine.device_of(bytes(16))
    assert caught.value.code is ErrorCode.ENGINE
