"""The GPU path through the real cuda-bindings and nccl4py, on both sides, without a GPU.

test_gpu_path_fake.py runs the same stack with Python stand-ins for the client's
`CudaDriver` and the engine's `Gpu`. Here those are the real ones (`BindingsDriver`,
`BindingsGpu`), and so are the bindings under them; only the libraries the bindings
load are fakes (tests/fakecuda: the C ABI of libcuda and libnccl over the fake
device). The workers' own CUDA calls (cudaMalloc, cuMemCreate, streams) go through
the same bindings, as torch's would go through the driver.
"""

from __future__ import annotations

import ctypes
import logging
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import pytest

from client import CommError, DaemonBackend, EngineError, MisuseError, WorldFailed
from commd.engine import create_engine
from commd.engine.bindings import BindingsGpu
from commd.engine.gpu import GpuError
from commd.errors import ConfigError
from tests import fakecuda
from tests.contract.fakegpu import FakeGpu
from tests.integration.data import make_input, reduce_reference
from tests.integration.gpu_daemon import GpuDaemon
from tests.integration.harness import wait_until, world_name

pytestmark = pytest.mark.timeout(60)


class Worker:
    """One worker thread's CUDA, through cuda-bindings (as torch's calls reach the driver)."""

    def __init__(self, device: int) -> None:
        from cuda.bindings import driver

        self.cu: Any = driver
        self.device = device
        ctx = self._ok(driver.cuDevicePrimaryCtxRetain(self._ok(driver.cuDeviceGet(device))))
        self._ok(driver.cuCtxSetCurrent(ctx))  # this thread's, as torch.cuda.set_device makes it

    def _ok(self, result: tuple[Any, ...]) -> Any:
        assert result[0] == self.cu.CUresult.CUDA_SUCCESS, result
        return result[1] if len(result) == 2 else None

    def alloc(self, data: bytes) -> int:
        """cudaMalloc'd memory holding `data`."""
        ptr = int(self._ok(self.cu.cuMemAlloc(len(data))))
        self._ok(self.cu.cuMemcpyHtoD(ptr, data, len(data)))
        return ptr

    def vmm_alloc(self, data: bytes, shareable: bool = True, pieces: int = 1) -> int:
        """cuMemCreate'd memory mapped here, exportable as a POSIX fd when `shareable`; in
        `pieces` allocations side by side in one reserved range (as PyTorch's expandable
        segments grow)."""
        cu = self.cu
        prop = cu.CUmemAllocationProp()
        prop.type = cu.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
        prop.location.type = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        prop.location.id = self.device
        if shareable:
            prop.requestedHandleTypes = cu.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
        piece = -(-len(data) // (fakecuda.GRANULARITY * pieces)) * fakecuda.GRANULARITY
        ptr = int(self._ok(cu.cuMemAddressReserve(piece * pieces, 0, 0, 0)))
        access = cu.CUmemAccessDesc()
        access.location.type = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        access.location.id = self.device
        access.flags = cu.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
        for at in range(ptr, ptr + piece * pieces, piece):
            handle = self._ok(cu.cuMemCreate(piece, prop, 0))
            self._ok(cu.cuMemMap(at, piece, 0, handle, 0))
            self._ok(cu.cuMemRelease(handle))
            self._ok(cu.cuMemSetAccess(at, piece, [access], 1))
        for at in range(0, len(data), piece):
            chunk = data[at:at + piece]
            self._ok(cu.cuMemcpyHtoD(ptr + at, chunk, len(chunk)))
        return ptr

    def stream(self) -> int:
        return int(self._ok(self.cu.cuStreamCreate(self.cu.CUstream_flags.CU_STREAM_NON_BLOCKING)))

    def read(self, ptr: int, nbytes: int) -> bytes:
        out = bytearray(nbytes)
        self._ok(self.cu.cuMemcpyDtoH(out, ptr, nbytes))
        return bytes(out)


@pytest.fixture
def device() -> Iterator[fakecuda.AbiDevice]:
    with fakecuda.bound(FakeGpu(devices=2, multi_rank_gpu=True)) as abi:  # NCCL_MULTI_RANK_GPU_ENABLE=1
        yield abi
    assert abi.gpu.violations == []  # nothing a GPU would not have let pass


@pytest.fixture
def daemon(device: fakecuda.AbiDevice) -> Iterator[GpuDaemon]:
    d = GpuDaemon(BindingsGpu())
    yield d
    d.close()


def run_ranks(n: int, body: Any) -> list[Any]:
    with ThreadPoolExecutor(n) as pool:
        return list(pool.map(body, range(n)))


def test_every_call_on_cudamalloc_memory(daemon: GpuDaemon, device: fakecuda.AbiDevice) -> None:
    world, n, gpu = world_name("abi"), 2, device.gpu
    inputs = [make_input(31, r, 1000, "bf16", "sum") for r in range(n)]
    parts = [make_input(32, r, 64, "u8", "sum").tobytes() for r in range(n)]
    shares = [make_input(33, r, 2 * 96, "f32", "max") for r in range(n)]
    baseline = gpu.allocations

    def rank(r: int) -> dict[str, bytes]:
        worker = Worker(r)
        with DaemonBackend(str(daemon.socket_path), world, r, n, device=r, timeout=20) as comm:
            data = worker.alloc(inputs[r].tobytes())
            comm.all_reduce(data, inputs[r].nbytes)
            send, recv = worker.alloc(parts[r]), worker.alloc(bytes(64 * n))
            comm.all_gather(send, recv, 64)
            full, mine = worker.alloc(shares[r].tobytes()), worker.alloc(bytes(96 * 4))
            comm.reduce_scatter(full, mine, 96 * 4, dtype="f32", op="max")
            cast = worker.alloc(bytes([r + 1]) * 16)
            comm.broadcast(cast, 16, 1)
            comm.barrier()
            p2p = worker.alloc(bytes([r + 5]) * 32)
            if r == 0:
                comm.send_to(p2p, 32, 1)
            else:
                comm.recv_from(p2p, 32, 0)
            comm.barrier()  # recv_from returns once ordered: read after the next call is done
            return {"sum": worker.read(data, inputs[r].nbytes), "gathered": worker.read(recv, 64 * n),
                    "share": worker.read(mine, 96 * 4), "cast": worker.read(cast, 16),
                    "p2p": worker.read(p2p, 32)}

    out = run_ranks(n, rank)
    maxed = reduce_reference(shares, "f32", "max").tobytes()
    for r, res in enumerate(out):
        assert res["sum"] == reduce_reference(inputs, "bf16", "sum").tobytes()
        assert res["gathered"] == b"".join(parts)
        assert res["share"] == maxed[r * 384:(r + 1) * 384]
        assert res["cast"] == b"\x02" * 16
        assert res["p2p"] == b"\x05" * 32
    assert device.calls.get("cuIpcOpenMemHandle", 0) >= 2 * 6  # every buffer went by IPC handle
    assert device.calls["cuIpcOpenEventHandle"] >= 2  # and every call was ordered by events
    # the workers' events are interprocess; the daemon's own let its waiting threads sleep
    blocking_sync, interprocess = 1, 4
    assert all(flags & (blocking_sync | interprocess) for flags in device.event_flags())
    assert any(flags & blocking_sync for flags in device.event_flags())
    # the daemon let go of every buffer it opened: the workers' own allocations remain
    wait_until(lambda: gpu.allocations == baseline + 2 * 7, lambda: gpu.allocations)


def test_vmm_memory_goes_by_file_descriptor(daemon: GpuDaemon, device: fakecuda.AbiDevice) -> None:
    world = world_name("abi")
    inputs = [np.arange(r, r + 300, dtype=np.int64) for r in range(2)]

    def rank(r: int) -> bytes:
        worker = Worker(r)
        with DaemonBackend(str(daemon.socket_path), world, r, 2, device=r, timeout=20) as comm:
            ptr = worker.vmm_alloc(inputs[r].tobytes())
            comm.all_reduce(ptr + 8, 8 * 299, dtype="i64")  # an offset into the allocation
            comm.barrier()
            return worker.read(ptr, 8 * 300)

    summed = inputs[0][1:] + inputs[1][1:]
    assert run_ranks(2, rank) == [np.concatenate([inputs[r][:1], summed]).tobytes() for r in range(2)]
    assert device.calls["cuMemImportFromShareableHandle"] == 2 and "cuIpcOpenMemHandle" not in device.calls
    # the daemon's two mappings are open to both GPUs: the other rank's kernels touch them
    assert sorted(map(sorted, device.access.values())) == [[0], [0, 1], [0, 1], [1]]


def test_a_buffer_across_two_vmm_allocations_is_refused_and_one_inside_either_works(
        daemon: GpuDaemon, device: fakecuda.AbiDevice) -> None:
    """Memory in two allocations mapped side by side (PyTorch's expandable segments): a
    buffer within one of them is shared by that allocation's fd; one across the seam is a
    MisuseError saying why, not a fault."""
    piece = fakecuda.GRANULARITY
    worker = Worker(0)
    with DaemonBackend(str(daemon.socket_path), world_name("abi"), 0, 1, device=0, timeout=10) as comm:
        ptr = worker.vmm_alloc(bytes(range(256)) * (2 * piece // 256), pieces=2)
        with pytest.raises(MisuseError, match="spans several"):
            comm.all_reduce(ptr + piece - 8, 16, dtype="u8")
        comm.all_reduce(ptr + piece, 64, dtype="u8", op="max")  # inside the second: fine
        comm.all_reduce(ptr, 64, dtype="u8", op="max")  # and the first
        comm.barrier()
        # (read per allocation: the fake device cannot copy across the seam, a GPU could)
        assert worker.read(ptr, 64) + worker.read(ptr + piece, 64) == bytes(range(64)) * 2
    assert device.calls["cuMemImportFromShareableHandle"] == 2  # one fd per allocation


def test_memory_the_daemon_cannot_open_is_a_misuse_error(daemon: GpuDaemon,
                                                           device: fakecuda.AbiDevice) -> None:
    worker = Worker(0)
    with DaemonBackend(str(daemon.socket_path), world_name("abi"), 0, 1, device=0, timeout=10) as comm:
        ptr = worker.vmm_alloc(b"\x01" * 64, shareable=False)
        with pytest.raises(MisuseError, match="CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR"):
            comm.all_reduce(ptr, 64, dtype="u8")
        with pytest.raises(MisuseError, match=r"neither in host memory .* nor in CUDA device memory"):
            comm.all_reduce(0xDEAD_0000, 64, dtype="u8")  # an address no one allocated
        ok = worker.alloc(b"\x03" * 64)
        comm.all_reduce(ok, 64, dtype="u8")  # the connection serves on
        comm.barrier()
        assert worker.read(ok, 64) == b"\x03" * 64


def test_async_calls_are_ordered_on_the_workers_stream(daemon: GpuDaemon,
                                                        device: fakecuda.AbiDevice) -> None:
    """all_reduce_async returns before a kernel queued ahead of it ran, and the sum
    includes what that kernel wrote: the worker's stream and the daemon's are tied by
    interprocess events through the real bindings."""
    world, gpu = world_name("abi"), device.gpu
    ready, release = threading.Barrier(3), threading.Barrier(3)
    workers: dict[int, tuple[Worker, int, int]] = {}

    def rank(r: int) -> bytes:
        worker = Worker(0)
        stream = worker.stream()
        ptr = worker.alloc(bytes([r]) * 8)
        workers[r] = (worker, stream, ptr)
        with DaemonBackend(str(daemon.socket_path), world, r, 2, device=0, timeout=20) as comm:
            kernel = gpu.worker_kernel(stream, ptr, b"\x07" * 8) if r == 0 else None
            comm.all_reduce_async(ptr, 8, stream, dtype="u8")
            ready.wait(10)
            release.wait(10)
            if kernel is not None:
                gpu.finish_kernel(kernel)
            comm.barrier()
            worker._ok(worker.cu.cuStreamSynchronize(stream))
            return worker.read(ptr, 8)

    with ThreadPoolExecutor(2) as pool:
        running = [pool.submit(rank, r) for r in range(2)]
        ready.wait(10)  # both calls returned; rank 0's kernel has not run, so neither has the sum
        assert [gpu.read(workers[r][2], 8) for r in range(2)] == [b"\x00" * 8, b"\x01" * 8]
        release.wait(10)
        assert [f.result(20) for f in running] == [b"\x08" * 8] * 2  # 7 + 1


def test_symmetric_memory_maps_the_daemons_allocation(daemon: GpuDaemon,
                                                      device: fakecuda.AbiDevice) -> None:
    world, gpu = world_name("abi"), device.gpu
    baseline = gpu.allocations

    def rank(r: int) -> bytes:
        worker = Worker(r)
        with DaemonBackend(str(daemon.socket_path), world, r, 2, device=r, timeout=20) as comm:
            ptr = comm.symmetric_alloc(100)
            worker._ok(worker.cu.cuMemcpyHtoD(ptr, bytes([r + 2]) * 100, 100))  # the worker writes it
            comm.all_reduce(ptr, 100, dtype="u8", op="prod")
            comm.barrier()
            out = worker.read(ptr, 100)
            comm.symmetric_free(ptr)
            comm.barrier()
            return out

    assert run_ranks(2, rank) == [b"\x06" * 100] * 2
    assert device.calls["ncclMemAlloc"] == 2 and device.calls["cuMemMap"] == 2
    wait_until(lambda: gpu.allocations == baseline, lambda: (gpu.allocations, baseline))


def test_symmetric_alloc_where_ncclmemalloc_gives_cudamalloc_memory(daemon: GpuDaemon,
                                                                    device: fakecuda.AbiDevice) -> None:
    """With NCCL's cuMem allocator off, ncclMemAlloc's memory has no fd to hand over:
    symmetric_alloc is then an error saying so, the memory is freed, and the connection
    serves on."""
    device.nccl_cumem = False
    baseline = device.gpu.allocations
    worker = Worker(0)
    with DaemonBackend(str(daemon.socket_path), world_name("abi"), 0, 1, device=0, timeout=10) as comm:
        with pytest.raises(CommError, match="NCCL_CUMEM_ENABLE=0"):
            comm.symmetric_alloc(4096)
        # (ncclMemFree runs on the daemon's NCCL gate thread, as every ncclMemFree does)
        wait_until(lambda: device.gpu.allocations == baseline and device.calls.get("ncclMemFree") == 1,
                   lambda: (device.gpu.allocations, baseline, device.calls.get("ncclMemFree")))
        ptr = worker.alloc(b"\x02" * 8)
        comm.all_reduce(ptr, 8, dtype="u8")
        comm.barrier()
        assert worker.read(ptr, 8) == b"\x02" * 8


@pytest.mark.parametrize("log", [None, b"error: no such architecture", b""])
def test_the_add_kernel_path(daemon: GpuDaemon, device: fakecuda.AbiDevice, log: bytes | None,
                             caplog: pytest.LogCaptureFixture) -> None:
    """set_add_kernel on both ranks: NVRTC compiles the kernel for the device's
    architecture, the module loads, and each rank's bf16 sum is an exchange then one
    launch, with the kernel's arguments where it reads them. When NVRTC fails, its log is
    a warning and NCCL sums; the result is the same either way. (An empty log once
    overwrote CPython's shared one-byte b" ", which the log buffer was made from.)"""
    world = world_name("abi")
    device.compile_error = log
    inputs = [make_input(34, r, 512, "bf16", "sum") for r in range(2)]
    loaded = threading.Barrier(2)

    def rank(r: int) -> bytes:
        worker = Worker(0)
        with DaemonBackend(str(daemon.socket_path), world, r, 2, device=0, timeout=20) as comm:
            comm.set_add_kernel(0xADD)
            comm.barrier()
            if r == 0:  # compiling happens off the daemon's loop: sums wait for nothing
                # loaded (or given up): the kernel's module is in, or the warning is out
                wait_until(lambda: (daemon.engine.gpu.add_ready(0)
                                  or "add kernel is not available" in caplog.text), lambda: device.calls)
            loaded.wait(10)
            ptr = worker.alloc(inputs[r].tobytes())
            comm.all_reduce(ptr, inputs[r].nbytes)
            comm.barrier()
            return worker.read(ptr, inputs[r].nbytes)

    with caplog.at_level(logging.WARNING, logger="commd"):
        assert run_ranks(2, rank) == [reduce_reference(inputs, "bf16", "sum").tobytes()] * 2
    if log is None:
        assert device.calls["cuLaunchKernel"] == 2 and device.gpu.adds == 2
    else:
        assert "cuLaunchKernel" not in device.calls and device.gpu.adds == 0
        assert "add kernel is not available" in caplog.text and log.decode() in caplog.text
    assert ord(bytes([0x20])) == 0x20  # the interpreter's shared b" " is still a space


@pytest.mark.parametrize("legacy", [False, True])
def test_a_group_over_two_streams_swaps_buffers(daemon: GpuDaemon, device: fakecuda.AbiDevice,
                                                legacy: bool) -> None:
    """Each rank sends on one stream and receives on another inside a group: the pair
    goes to NCCL as one group (no deadlock), and the second stream is waited for here
    (`legacy`: it is the legacy default stream, waited for as the whole context)."""
    world = world_name("abi")

    def rank(r: int) -> bytes:
        worker = Worker(r)
        sending, receiving = worker.stream(), 0 if legacy else worker.stream()
        mine, theirs = worker.alloc(bytes([r + 1]) * 48), worker.alloc(bytes(48))
        with DaemonBackend(str(daemon.socket_path), world, r, 2, device=r, timeout=20) as comm:
            comm.group_start()
            comm.send_to(mine, 48, 1 - r, stream=sending)
            comm.recv_from(theirs, 48, 1 - r, stream=receiving)
            comm.group_end()
            comm.barrier()
            worker._ok(worker.cu.cuStreamSynchronize(receiving))
            return worker.read(theirs, 48)

    assert run_ranks(2, rank) == [b"\x02" * 48, b"\x01" * 48]
    # the client waited for its second stream (once per rank), then the test for it (once per rank)
    if legacy:
        assert device.calls["cuCtxSynchronize"] == 2 and device.calls["cuStreamSynchronize"] == 2
    else:
        assert device.calls["cuStreamSynchronize"] == 4 and "cuCtxSynchronize" not in device.calls


def test_registration_and_an_nccl_failure_through_the_bindings(daemon: GpuDaemon,
                                                              device: fakecuda.AbiDevice) -> None:
    """register_buffer reaches ncclCommRegister (handle out through a void**); NCCL's
    async error (with ncclGetLastError's text) fails the world with EngineError; the
    failed communicators are aborted, and after attempt_reconnect the new ones sum, with
    the registrations made again."""
    world, gpu = world_name("abi"), device.gpu
    failed, rebuilt = threading.Barrier(3), threading.Barrier(3)

    def rank(r: int) -> tuple[str, bytes]:
        worker = Worker(r)
        with DaemonBackend(str(daemon.socket_path), world, r, 2, device=r, timeout=20) as comm:
            ptr = worker.vmm_alloc(bytes([r + 1]) * 64)  # (NCCL registers cuMem memory)
            handle = comm.register_buffer(ptr, 64)
            comm.all_reduce(ptr, 64, dtype="u8")
            comm.barrier()
            failed.wait(10)  # the test injects NCCL's error now
            with pytest.raises(EngineError) as info:
                deadline = time.monotonic() + 10
                while time.monotonic() < deadline:
                    comm.barrier()
                    time.sleep(0.05)
            rebuilt.wait(10)
            deadline = time.monotonic() + 10
            while True:
                try:
                    comm.attempt_reconnect()
                    break
                except WorldFailed:
                    assert time.monotonic() < deadline
                    time.sleep(0.05)
            comm.all_reduce(ptr, 64, dtype="u8")
            comm.barrier()
            comm.deregister_buffer(handle)
            comm.barrier()  # the daemon has acted on the deregistration when the barrier returns
            return str(info.value), worker.read(ptr, 64)

    with ThreadPoolExecutor(2) as pool:
        running = [pool.submit(rank, r) for r in range(2)]
        failed.wait(10)
        assert device.calls["ncclCommRegister"] == 2
        gpu.fail(0, "injected: an NVLink error")
        rebuilt.wait(10)
        out = [f.result(30) for f in running]
    assert all("injected: an NVLink error" in message for message, _ in out)
    assert [data for _, data in out] == [b"\x06" * 64] * 2  # (1 + 2) summed twice
    assert device.calls["ncclCommAbort"] >= 2 and device.calls["ncclCommRegister"] == 4
    # (deregistration waits for the device: it may land after the ranks' last call)
    wait_until(lambda: device.calls.get("ncclCommDeregister") == 2 and not gpu.registered,
             lambda: (device.calls.get("ncclCommDeregister"), gpu.registered))


def test_cuda_and_nccl_errors_name_the_call_and_the_reason(device: fakecuda.AbiDevice) -> None:
    """The error paths of BindingsGpu through the bindings: a CUDA error's text comes
    from cuGetErrorString, an NCCL error from nccl4py's NCCLError with NCCL's last error
    text; each names the call."""
    gpu = BindingsGpu()
    with pytest.raises(GpuError, match=r"^cuIpcOpenMemHandle: invalid resource handle$"):
        gpu.ipc_open(os.urandom(64), 64, 0)
    worker = Worker(0)
    ptr = worker.alloc(bytes(100))
    ipc = worker._ok(worker.cu.cuIpcGetMemHandle(ptr))  # kept: string_at reads its memory
    handle = ctypes.string_at(ipc.getPtr(), 64)
    with pytest.raises(GpuError, match="the allocation holds 100 bytes, not the 101 claimed"):
        gpu.ipc_open(handle, 101, 0)
    opened = gpu.ipc_open(handle, 100, 0)  # the failed open was closed; this one is the only one
    gpu.release(opened)
    with pytest.raises(GpuError, match=r"ncclCommInitRankConfig: InvalidArgument \(4\): invalid argument "
                                       r".*NCCL's last error, maybe an earlier one: "
                                       r"Invalid rank requested : 7/2"):
        gpu.comm_init(2, gpu.unique_id(), 7, 0)  # rank 7 of 2
    with pytest.raises(GpuError, match=r"^cuDeviceGet: invalid device ordinal$"):
        gpu.use_device(5)
    assert device.gpu.allocations == 1  # the worker's allocation; every open was closed


def test_one_allocation_in_two_worlds_is_one_mapping_counted_twice(daemon: GpuDaemon,
                                                                   device: fakecuda.AbiDevice) -> None:
    """A worker in two worlds (say tensor- and pipeline-parallel) uses one allocation in
    both: the daemon opens its IPC handle once per connection and the driver hands back
    the same pointer, counted. One world's connection closing lets go of its opening
    only: the other world's calls on the allocation still run."""
    tp, pp, gpu = world_name("abi-tp"), world_name("abi-pp"), device.gpu
    baseline = gpu.allocations

    def rank(r: int) -> bytes:
        worker = Worker(r)
        ptr = worker.alloc(bytes([r + 1]) * 64)
        sock = str(daemon.socket_path)
        with DaemonBackend(sock, pp, r, 2, device=r, timeout=20) as second:
            with DaemonBackend(sock, tp, r, 2, device=r, timeout=20) as first:
                first.all_reduce(ptr, 64, dtype="u8")
                second.all_reduce(ptr, 64, dtype="u8")
                first.barrier()
            second.barrier()  # both ranks have closed their first world
            wait_until(lambda: sorted(opens for _, opens in device.ipc_opens().values()) == [1, 1],
                     device.ipc_opens)  # each rank's handle, still open once: the second world's
            second.all_reduce(ptr, 64, dtype="u8")
            second.barrier()
        return worker.read(ptr, 64)

    assert run_ranks(2, rank) == [bytes([12]) * 64] * 2  # (1 + 2) * 2 * 2
    assert device.calls["cuIpcOpenMemHandle"] == 4  # two opens of each rank's one handle
    wait_until(lambda: not device.ipc_opens() and gpu.allocations == baseline + 2,
             lambda: (device.ipc_opens(), gpu.allocations))


def test_two_ranks_on_one_gpu_without_nccls_leave_is_an_engine_error() -> None:
    """NCCL below 2.30, or without NCCL_MULTI_RANK_GPU_ENABLE=1, refuses two ranks of a
    communicator on one GPU: both ranks get EngineError with NCCL's reason, and the
    daemon serves a world that keeps to one rank per GPU right after."""
    with fakecuda.bound(FakeGpu(devices=2)) as device:
        daemon = GpuDaemon(BindingsGpu())
        try:
            def rank(r: int, gpu_of: list[int], world: str) -> bytes | str:
                worker = Worker(gpu_of[r])
                ptr = worker.alloc(bytes([r + 1]) * 16)
                try:  # the world's communicators are made as it forms: joining fails
                    with DaemonBackend(str(daemon.socket_path), world, r, 2, device=gpu_of[r],
                                       timeout=20) as comm:
                        comm.all_reduce(ptr, 16, dtype="u8")
                        comm.barrier()
                except EngineError as exc:
                    return str(exc)
                return worker.read(ptr, 16)

            dup, two = world_name("abi-dup"), world_name("abi-two")
            with ThreadPoolExecutor(2) as pool:
                shared = list(pool.map(lambda r: rank(r, [0, 0], dup), range(2)))
                apart = list(pool.map(lambda r: rank(r, [0, 1], two), range(2)))
        finally:
            daemon.close()
    assert all(isinstance(m, str) and "Duplicate GPU detected" in m for m in shared), shared
    assert apart == [b"\x03" * 16] * 2
    assert any("Duplicate GPU" in r for r in device.refusals)


def test_a_thread_without_a_current_context_gets_the_hint(daemon: GpuDaemon,
                                                          device: fakecuda.AbiDevice) -> None:
    """The client creates no CUDA context: a worker thread that never made its device
    current (torch.cuda.set_device) gets a MisuseError saying so, and once it has, the
    same call works."""
    ptr = Worker(0).alloc(b"\x04" * 32)  # allocated here, used from a thread with no context
    outcome: list[object] = []

    def bare_thread() -> None:
        with DaemonBackend(str(daemon.socket_path), world_name("abi"), 0, 1, device=0, timeout=10) as comm:
            try:
                comm.all_reduce(ptr, 32, dtype="u8")
            except MisuseError as exc:
                outcome.append(str(exc))
            Worker(0)  # makes device 0 current on this thread, as torch.cuda.set_device(0)
            comm.all_reduce(ptr, 32, dtype="u8")
            comm.barrier()
            outcome.append(Worker(0).read(ptr, 32))

    thread = threading.Thread(target=bare_thread)
    thread.start()
    thread.join(30)
    assert len(outcome) == 2 and "torch.cuda.set_device" in str(outcome[0]), outcome
    assert outcome[1] == b"\x04" * 32


def test_a_thread_with_another_gpu_current_is_refused(daemon: GpuDaemon, device: fakecuda.AbiDevice) -> None:
    """The worker's stream events (and stream 0) belong to the thread's current context:
    with GPU 1 current, a backend of GPU 0 would order its call after GPU 1's work. It is a
    MisuseError naming both, and the call works once GPU 0 is current."""
    ptr = Worker(0).alloc(b"\x06" * 16)
    outcome: list[object] = []

    def other_gpu_thread() -> None:
        Worker(1)  # GPU 1 current here
        with DaemonBackend(str(daemon.socket_path), world_name("abi"), 0, 1, device=0, timeout=10) as comm:
            try:
                comm.all_reduce(ptr, 16, dtype="u8")
            except MisuseError as exc:
                outcome.append(str(exc))
            Worker(0)
            comm.all_reduce(ptr, 16, dtype="u8")
            outcome.append(Worker(0).read(ptr, 16))

    thread = threading.Thread(target=other_gpu_thread)
    thread.start()
    thread.join(30)
    assert len(outcome) == 2, outcome
    assert "CUDA device 1 is current" in str(outcome[0]) and "serves device 0" in str(outcome[0])
    assert outcome[1] == b"\x06" * 16


def test_a_worker_that_numbers_its_gpus_otherwise_is_placed_by_uuid(daemon: GpuDaemon,
                                                                     device: fakecuda.AbiDevice) -> None:
    """Rank 0's process sees only GPU 1, as its device 0 (CUDA_VISIBLE_DEVICES=1, or a
    container given one GPU); rank 1 sees both and uses GPU 0. Both say device=0: the
    daemon places them by their GPUs' UUIDs, opens rank 0's memory on GPU 1, and sums."""
    world = world_name("abi")

    def rank(r: int) -> bytes:
        if r == 0:
            device.restrict([1])
        worker = Worker(0)
        ptr = worker.alloc(bytes([r + 1]) * 32)
        with DaemonBackend(str(daemon.socket_path), world, r, 2, device=0, timeout=20) as comm:
            comm.all_reduce(ptr, 32, dtype="u8")
            comm.barrier()
        return worker.read(ptr, 32)

    assert run_ranks(2, rank) == [b"\x03" * 32] * 2


def test_a_gpu_the_daemon_does_not_see_is_refused_at_join(daemon: GpuDaemon,
                                                           device: fakecuda.AbiDevice) -> None:
    def join() -> None:
        device.restrict([7])  # the worker's only GPU is none of the daemon's two
        with DaemonBackend(str(daemon.socket_path), world_name("abi"), 0, 1, device=0, timeout=10):
            pass

    with ThreadPoolExecutor(1) as pool, pytest.raises(MisuseError, match="is not one this daemon sees"):
        pool.submit(join).result(20)


def test_a_sticky_cuda_error_marks_the_engine_broken(daemon: GpuDaemon, device: fakecuda.AbiDevice) -> None:
    """After an illegal address the context is unusable: the call fails, and the engine
    says it is broken (the daemon then exits, for systemd to restart it)."""
    worker = Worker(0)
    with DaemonBackend(str(daemon.socket_path), world_name("abi"), 0, 1, device=0, timeout=10) as comm:
        ptr = worker.alloc(b"\x01" * 8)
        comm.all_reduce(ptr, 8, dtype="u8")
        assert daemon.engine.broken() is None
        device.fail_with["cuEventSynchronize"] = 700  # CUDA_ERROR_ILLEGAL_ADDRESS
        with pytest.raises(WorldFailed, match="illegal memory access"):
            comm.all_reduce(ptr, 8, dtype="u8")
    assert daemon.engine.broken() == "cuEventSynchronize: an illegal memory access was encountered"


# cuda.h documents each as leaving the context (ASSERT) or the process unusable: CONTAINED,
# LAUNCH_TIMEOUT, ASSERT, MPS_CLIENT_TERMINATED
@pytest.mark.parametrize("code", [226, 702, 710, 810])
def test_every_sticky_cuda_error_marks_the_engine_broken(daemon: GpuDaemon, device: fakecuda.AbiDevice,
                                                         code: int) -> None:
    worker = Worker(0)
    with DaemonBackend(str(daemon.socket_path), world_name("abi"), 0, 1, device=0, timeout=10) as comm:
        ptr = worker.alloc(b"\x01" * 8)
        comm.all_reduce(ptr, 8, dtype="u8")
        device.fail_with["cuEventSynchronize"] = code
        with pytest.raises(WorldFailed, match="cuEventSynchronize"):
            comm.all_reduce(ptr, 8, dtype="u8")
    assert daemon.engine.broken() == "cuEventSynchronize: unknown error"  # (the fake's text for these)


def test_the_engine_names_its_nccl_and_gpus(device: fakecuda.AbiDevice) -> None:
    engine = create_engine("auto")
    try:
        assert engine.describe() == "nccl (NCCL 2.32.3, 2 GPUs)"  # ncclGetVersion, cuDeviceGetCount
    finally:
        engine.close()


_WITHOUT_LIBNCCL = """
from cuda.pathfinder import load_nvidia_dynamic_lib
from commd.engine import create_engine
from commd.errors import ConfigError
from tests import fakecuda
from tests.contract.fakegpu import FakeGpu

try:
    load_nvidia_dynamic_lib("nccl")
except RuntimeError:
    pass
else:
    raise SystemExit("SKIP: this machine has a libnccl")
driver = fakecuda.FakeCuda(fakecuda.build(), names=("libcuda.so.1",))  # a driver and a GPU
driver.bind(FakeGpu())
engine = create_engine("auto")
print("auto:", engine.name)
engine.close()
try:
    create_engine("nccl")
except ConfigError as exc:
    print("nccl:", exc)
"""


def test_a_gpu_machine_without_libnccl_serves_on_the_host_engine() -> None:
    """cuda-bindings, a driver and a GPU, nccl4py but no libnccl (the cuda13 extra without
    its nvidia-nccl wheel): `auto` takes the host engine and `nccl` is refused, saying why.
    In a process of its own, where the fake NCCL was never loaded."""
    pytest.importorskip("nccl.bindings.nccl", reason="nccl4py is not installed")
    try:
        fakecuda.load()  # (built, and no real driver here to stand in for)
    except (RuntimeError, subprocess.SubprocessError) as exc:
        pytest.skip(f"cannot use the fake CUDA driver: {exc}")
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    done = subprocess.run([sys.executable, "-c", _WITHOUT_LIBNCCL], cwd=root, capture_output=True,
                          text=True, timeout=50, env={**os.environ, "PYTHONPATH": root})
    if done.stderr.startswith("SKIP: "):
        pytest.skip(done.stderr.strip())
    assert done.returncode == 0, done.stderr
    auto, nccl = done.stdout.strip().splitlines()
    assert auto == "auto: host"
    assert nccl.startswith("nccl: engine 'nccl' is not available here: cannot load NCCL")
    assert "libnccl.so.2" in nccl


def test_an_nccl_older_than_2_27_is_refused(device: fakecuda.AbiDevice) -> None:
    """The engine keeps several non-blocking groups in progress at once; NCCL before 2.27
    shares one group job per thread, so it is refused: `--engine nccl` says why, `auto`
    falls back to the host engine."""
    device.nccl_version = 22602
    with pytest.raises(ConfigError, match=r"NCCL 2\.26\.2 is older than 2\.27"):
        create_engine("nccl")
    engine = create_engine("auto")
    try:
        assert engine.name == "host"
    finally:
        engine.close()
