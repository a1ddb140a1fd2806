"""`Gpu` over the real libraries: cuda-bindings (`cuda.bindings.driver`) and nccl4py's
low-level `nccl.bindings.nccl`, both imported only when `BindingsGpu` is built, so the
daemon runs without them. Every failed call raises `GpuError` with the call's name and
the driver's or NCCL's own text.
"""

from __future__ import annotations

import ctypes
import threading
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any

from client.vmm import map_fd
from proto import DType, ReduceOp

from .addkernel import compile_add_bf16
from .gpu import CommState, GpuError, Imported, Origin, Unshareable

_UNIQUE_ID_BYTES = 128  # sizeof(ncclUniqueId)
# CUresults after which the context stays unusable, each so documented in cuda.h ("the
# process must be terminated and relaunched", or for ASSERT "the context cannot be used
# anymore"): CONTAINED (a bad NVLink access to a peer's memory, which NCCL's kernels make),
# ILLEGAL_ADDRESS, LAUNCH_TIMEOUT, ASSERT, HARDWARE_STACK_ERROR, ILLEGAL_INSTRUCTION,
# MISALIGNED_ADDRESS, INVALID_ADDRESS_SPACE, INVALID_PC, LAUNCH_FAILED, MPS_CLIENT_TERMINATED
_STICKY = frozenset({226, 700, 702, 710, 714, 715, 716, 717, 718, 719, 810})


class BindingsGpu:
    """`Gpu` over cuda-bindings and nccl4py. The event loop's thread makes the NCCL calls,
    but for ncclCommAbort and ncclMemFree (the NcclGate's thread, never beside another;
    use_device first, as the current context is per thread); event waits run on helper
    threads and touch nothing else."""

    def __init__(self) -> None:
        try:
            from cuda.bindings import driver
            from nccl.bindings import nccl
        except ImportError as exc:
            raise GpuError(f"the NCCL engine needs the cuda12 or cuda13 extra: {exc}") from None
        self._cu: Any = driver
        self._nccl: Any = nccl
        self._broken: str | None = None
        try:
            self._check(driver.cuInit(0), "cuInit")
        except GpuError:
            raise
        except Exception as exc:  # cuda-bindings raises when it finds no driver library at all
            raise GpuError(f"no CUDA driver: {exc}") from None
        self._contexts: dict[int, Any] = {}
        self._comms: dict[int, Any] = {}  # our int -> nccl4py's Comm (it refuses plain ints)
        self._comm_devices: dict[int, int] = {}
        self._kernels: dict[int, Any] = {}  # device -> the add kernel loaded in its context
        self._compile_lock = threading.Lock()
        self._lock = threading.Lock()
        self._dtypes = {
            DType.U8: nccl.DataType.Uint8, DType.I32: nccl.DataType.Int32, DType.I64: nccl.DataType.Int64,
            DType.F16: nccl.DataType.Float16, DType.F32: nccl.DataType.Float32,
            DType.F64: nccl.DataType.Float64, DType.BF16: nccl.DataType.Bfloat16,
        }
        self._ops = {ReduceOp.SUM: nccl.RedOp.Sum, ReduceOp.PROD: nccl.RedOp.Prod,
                     ReduceOp.MAX: nccl.RedOp.Max, ReduceOp.MIN: nccl.RedOp.Min}

    def _check(self, result: tuple[Any, ...], call: str) -> Any:
        err = result[0]
        if err != self._cu.CUresult.CUDA_SUCCESS:
            _, text = self._cu.cuGetErrorString(err)
            message = f"{call}: {text.decode() if isinstance(text, bytes) else err}"
            if int(err) in _STICKY and self._broken is None:
                self._broken = message
            raise GpuError(message)
        return result[1] if len(result) == 2 else result[1:]

    def broken(self) -> str | None:
        return self._broken

    def _nccl_call(self, call: str, fn: Any, *args: Any) -> Any:
        try:
            return fn(*args)
        except self._nccl.NCCLError as exc:
            raise GpuError(f"{call}: {exc}{self._nccl_detail()}") from None

    def _nccl_detail(self) -> str:
        """NCCL's last error text (ncclGetLastError): the result code alone only says "run
        with NCCL_DEBUG=WARN for details". NCCL keeps one such text for the whole process
        until the next error, so it may be about an earlier call, and is labelled so."""
        try:
            detail = str(self._nccl.get_last_error(self._nccl.Comm(0))).strip()
        except Exception:  # an older NCCL without it: the code has to do
            return ""
        return f" (NCCL's last error, maybe an earlier one: {detail})" if detail else ""

    def device_count(self) -> int:
        return int(self._check(self._cu.cuDeviceGetCount(), "cuDeviceGetCount"))

    def nccl_version(self) -> int:
        """The loaded libnccl's version code (2.27.3 is 22703). The first NCCL call, so the
        one that finds whether there is a libnccl at all."""
        try:
            return int(self._nccl_call("ncclGetVersion", self._nccl.get_version))
        except GpuError:
            raise
        except Exception as exc:  # no libnccl (loaded at first use): cuda-pathfinder raises its own
            raise GpuError(f"cannot load NCCL: {type(exc).__name__}: {str(exc).strip()}") from None

    def device_uuid(self, device: int) -> bytes:
        dev = self._check(self._cu.cuDeviceGet(device), "cuDeviceGet")
        return bytes(self._check(self._cu.cuDeviceGetUuid(dev), "cuDeviceGetUuid").bytes)

    def use_device(self, device: int) -> None:
        ctx = self._contexts.get(device)
        if ctx is None:
            with self._lock:
                dev = self._check(self._cu.cuDeviceGet(device), "cuDeviceGet")
                ctx = self._check(self._cu.cuDevicePrimaryCtxRetain(dev), "cuDevicePrimaryCtxRetain")
                self._contexts[device] = ctx
        self._check(self._cu.cuCtxSetCurrent(ctx), "cuCtxSetCurrent")

    def _device_of(self, ptr: int) -> int:
        attr = self._cu.CUpointer_attribute.CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL
        return int(self._check(self._cu.cuPointerGetAttribute(attr, ptr), "cuPointerGetAttribute"))

    def ipc_open(self, handle: bytes, size: int, device: int) -> Imported:
        cu = self._cu
        ipc = cu.CUipcMemHandle()
        ctypes.memmove(ipc.getPtr(), handle, 64)  # no .reserved since cuda-bindings 13.4
        self.use_device(device)
        ptr = int(self._check(cu.cuIpcOpenMemHandle(
            ipc, cu.CUipcMem_flags.CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS), "cuIpcOpenMemHandle"))
        try:
            # The worker's word for the size is checked: every bounds check rests on it.
            _, real = self._check(cu.cuMemGetAddressRange(ptr), "cuMemGetAddressRange")
            if int(real) < size:
                raise GpuError(f"the allocation holds {int(real)} bytes, not the {size} claimed")
            return Imported(ptr, size, self._device_of(ptr), Origin.IPC, context=device)
        except BaseException:
            cu.cuIpcCloseMemHandle(ptr)
            raise

    def vmm_import(self, fd: int, size: int) -> Imported:
        ptr, size, device = map_fd(self._cu, fd, lambda call, result: self._check(result, call),
                                   lambda _prop: size, self._peers_of)
        return Imported(ptr, size, device, Origin.VMM)

    def _peers_of(self, device: int) -> list[int]:
        """`device` and every GPU that can reach its memory: the kernels of a world's other
        ranks (other GPUs, same daemon) read and write it directly (NCCL's P2P transport
        within a process), as ncclMemAlloc grants."""
        cu = self._cu
        owner = self._check(cu.cuDeviceGet(device), "cuDeviceGet")
        peers = []
        for other in range(self.device_count()):
            if other != device:
                peer = self._check(cu.cuDeviceGet(other), "cuDeviceGet")
                if not self._check(cu.cuDeviceCanAccessPeer(peer, owner), "cuDeviceCanAccessPeer"):
                    continue
            peers.append(other)
        return peers

    def release(self, memory: Imported) -> None:
        cu = self._cu
        self.use_device(memory.device if memory.context is None else memory.context)
        if memory.origin is Origin.IPC:
            self._check(cu.cuIpcCloseMemHandle(memory.ptr), "cuIpcCloseMemHandle")
        elif memory.origin is Origin.VMM:
            self._check(cu.cuMemUnmap(memory.ptr, memory.size), "cuMemUnmap")
            self._check(cu.cuMemAddressFree(memory.ptr, memory.size), "cuMemAddressFree")
        elif memory.origin is Origin.NCCL:
            self._nccl_call("ncclMemFree", self._nccl.mem_free, memory.ptr)
        else:
            self._check(cu.cuMemFree(memory.ptr), "cuMemFree")

    def alloc(self, nbytes: int, device: int) -> Imported:
        self.use_device(device)
        ptr = self._check(self._cu.cuMemAlloc(nbytes), "cuMemAlloc")
        return Imported(int(ptr), nbytes, device, Origin.PLAIN)

    def alloc_shared(self, nbytes: int, device: int) -> tuple[Imported, int]:
        cu = self._cu
        self.use_device(device)
        ptr = int(self._nccl_call("ncclMemAlloc", self._nccl.mem_alloc, nbytes))
        try:
            handle = self._check(cu.cuMemRetainAllocationHandle(ptr), "cuMemRetainAllocationHandle")
            try:
                kind = cu.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
                fd = int(self._check(cu.cuMemExportToShareableHandle(handle, kind, 0),
                                     "cuMemExportToShareableHandle"))
            finally:
                cu.cuMemRelease(handle)
        except GpuError as exc:  # (its ncclMemFree is the caller's: see Unshareable)
            # (NCCL's cuMem allocator always asks for POSIX fds: only its cudaMalloc fallback
            # lacks one)
            raise Unshareable(f"ncclMemAlloc's memory cannot be handed to a worker as a POSIX fd: NCCL "
                              f"allocates with cudaMalloc when its cuMem allocator is off "
                              f"(NCCL_CUMEM_ENABLE=0, or no cuMem support) ({exc})",
                              Imported(ptr, nbytes, device, Origin.NCCL)) from None
        except BaseException:
            self._nccl.mem_free(ptr)
            raise
        return Imported(ptr, nbytes, device, Origin.NCCL), fd

    def copy_in(self, ptr: int, data: bytes) -> None:
        self._check(self._cu.cuMemcpyHtoD(ptr, data, len(data)), "cuMemcpyHtoD")

    def copy_out(self, ptr: int, nbytes: int) -> bytes:
        out = bytearray(nbytes)
        self._check(self._cu.cuMemcpyDtoH(out, ptr, nbytes), "cuMemcpyDtoH")
        return bytes(out)

    def stream_create(self, device: int) -> int:
        self.use_device(device)
        flags = self._cu.CUstream_flags.CU_STREAM_NON_BLOCKING
        return int(self._check(self._cu.cuStreamCreate(flags), "cuStreamCreate"))

    def stream_destroy(self, stream: int) -> None:
        self._cu.cuStreamDestroy(stream)

    def event_create(self, device: int) -> int:
        self.use_device(device)
        # BLOCKING_SYNC: a helper thread waiting in cuEventSynchronize sleeps instead of
        # spinning a core for as long as the op runs (the context's default may spin)
        flags = int(self._cu.CUevent_flags.CU_EVENT_DISABLE_TIMING) | int(
            self._cu.CUevent_flags.CU_EVENT_BLOCKING_SYNC)
        return int(self._check(self._cu.cuEventCreate(flags), "cuEventCreate"))

    def event_destroy(self, event: int) -> None:
        self._cu.cuEventDestroy(event)

    def event_record(self, event: int, stream: int) -> None:
        self._check(self._cu.cuEventRecord(event, stream), "cuEventRecord")

    def event_wait(self, event: int, device: int) -> None:
        self.use_device(device)  # a helper thread has no current context of its own
        self._check(self._cu.cuEventSynchronize(event), "cuEventSynchronize")

    def event_open(self, handle: bytes, device: int) -> int:
        ipc = self._cu.CUipcEventHandle()
        ctypes.memmove(ipc.getPtr(), handle, 64)
        self.use_device(device)
        return int(self._check(self._cu.cuIpcOpenEventHandle(ipc), "cuIpcOpenEventHandle"))

    def stream_wait_event(self, stream: int, event: int) -> None:
        self._check(self._cu.cuStreamWaitEvent(stream, event, 0), "cuStreamWaitEvent")

    def unique_id(self) -> bytes:
        return bytes(self._nccl_call("ncclGetUniqueId", self._nccl.get_unique_id))

    def comm_init(self, world_size: int, unique_id: bytes, rank: int, device: int) -> int:
        nccl = self._nccl
        self.use_device(device)
        uid = nccl.UniqueId()
        if len(unique_id) != _UNIQUE_ID_BYTES:  # it came over the network: never copy more
            raise GpuError(f"an ncclUniqueId is {_UNIQUE_ID_BYTES} bytes, got {len(unique_id)}")
        ctypes.memmove(uid.ptr, unique_id, _UNIQUE_ID_BYTES)
        config = nccl.Config()
        config.blocking = 0  # so a hung or failed communicator can be aborted
        comm = self._nccl_call("ncclCommInitRankConfig", nccl.comm_init_rank_config,
                               world_size, uid, rank, config)
        key = int(comm.handle)
        self._comms[key] = comm
        self._comm_devices[key] = device
        return key

    def comm_state(self, comm: int) -> tuple[CommState, str]:
        nccl = self._nccl
        state = self._nccl_call("ncclCommGetAsyncError", nccl.comm_get_async_error, self._comms[comm])
        if state == nccl.Result.Success:
            return CommState.READY, ""
        if state == nccl.Result.InProgress:
            return CommState.IN_PROGRESS, ""
        return CommState.FAILED, f"{nccl.get_error_string(state)}{self._nccl_detail()}"

    def comm_abort(self, comm: int) -> None:
        self._comm_devices.pop(comm, None)
        handle = self._comms.pop(comm, None)
        if handle is not None:
            self._nccl_call("ncclCommAbort", self._nccl.comm_abort, handle)

    def group_start(self) -> None:
        self._nccl_call("ncclGroupStart", self._nccl.group_start)

    def add_ready(self, device: int) -> bool:
        return device in self._kernels

    def prepare_add(self, device: int, loading: Callable[[], AbstractContextManager[None]]) -> None:
        with self._compile_lock:  # not _lock: compiling makes the device current, which takes it
            if device not in self._kernels:
                try:
                    self._kernels[device] = self._compile_add(device, loading)
                except GpuError:
                    raise
                except Exception as exc:  # no NVRTC library: cuda-pathfinder raises its own error
                    raise GpuError(f"cannot build the add kernel: {type(exc).__name__}: {exc}") from None

    def add_bf16(self, dst: int, src: int, count: int, device: int, stream: int) -> None:
        kernel = self._kernels.get(device)
        if kernel is None:
            raise GpuError(f"the add kernel is not loaded for device {device} (prepare_add)")
        self.use_device(device)
        threads = 256
        blocks = max(1, min(-(-count // threads), 4096))
        args = ((dst, src, count), (ctypes.c_void_p, ctypes.c_void_p, ctypes.c_uint64))
        self._check(self._cu.cuLaunchKernel(kernel, blocks, 1, 1, threads, 1, 1, 0, stream, args, 0),
                    "cuLaunchKernel(commd_add_bf16)")

    def _compile_add(self, device: int, loading: Callable[[], AbstractContextManager[None]]) -> Any:
        """The add kernel for `device`'s architecture: NVRTC, then a module in its context."""
        cu = self._cu
        dev = self._check(cu.cuDeviceGet(device), "cuDeviceGet")
        attr = cu.CUdevice_attribute
        major = self._check(cu.cuDeviceGetAttribute(attr.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, dev),
                            "cuDeviceGetAttribute")
        minor = self._check(cu.cuDeviceGetAttribute(attr.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR, dev),
                            "cuDeviceGetAttribute")
        cubin = compile_add_bf16(int(major), int(minor))
        self.use_device(device)
        with loading():
            module = self._check(cu.cuModuleLoadData(cubin), "cuModuleLoadData")
        return self._check(cu.cuModuleGetFunction(module, b"commd_add_bf16"), "cuModuleGetFunction")

    def comm_register(self, comm: int, ptr: int, nbytes: int) -> int:
        self.use_device(self._comm_devices[comm])  # as for a launch: the communicator's device
        handle = self._nccl_call("ncclCommRegister", self._nccl.comm_register, self._comms[comm], ptr, nbytes)
        return int(handle)

    def comm_deregister(self, comm: int, handle: int) -> None:
        self.use_device(self._comm_devices[comm])
        self._nccl_call("ncclCommDeregister", self._nccl.comm_deregister, self._comms[comm], handle)

    def group_end(self) -> None:
        self._nccl_call("ncclGroupEnd", self._nccl.group_end)

    def all_reduce(self, send: int, recv: int, count: int, dtype: DType, op: ReduceOp, comm: int,
                   stream: int) -> None:
        self._nccl_call("ncclAllReduce", self._nccl.all_reduce, send, recv, count, self._dtypes[dtype],
                        self._ops[op], self._comms[comm], stream)

    def all_gather(self, send: int, recv: int, count: int, dtype: DType, comm: int, stream: int) -> None:
        self._nccl_call("ncclAllGather", self._nccl.all_gather, send, recv, count, self._dtypes[dtype],
                        self._comms[comm], stream)

    def reduce_scatter(self, send: int, recv: int, count: int, dtype: DType, op: ReduceOp, comm: int,
                       stream: int) -> None:
        self._nccl_call("ncclReduceScatter", self._nccl.reduce_scatter, send, recv, count,
                        self._dtypes[dtype], self._ops[op], self._comms[comm], stream)

    def broadcast(self, send: int, recv: int, count: int, dtype: DType, root: int, comm: int,
                  stream: int) -> None:
        self._nccl_call("ncclBroadcast", self._nccl.broadcast, send, recv, count, self._dtypes[dtype],
                        root, self._comms[comm], stream)

    def send(self, buf: int, count: int, dtype: DType, peer: int, comm: int, stream: int) -> None:
        self._nccl_call("ncclSend", self._nccl.send, buf, count, self._dtypes[dtype], peer,
                        self._comms[comm], stream)

    def recv(self, buf: int, count: int, dtype: DType, peer: int, comm: int, stream: int) -> None:
        self._nccl_call("ncclRecv", self._nccl.recv, buf, count, self._dtypes[dtype], peer,
                        self._comms[comm], stream)
