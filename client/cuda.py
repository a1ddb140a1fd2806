"""CUDA device memory the daemon can open: the driver seam and the allocation cache (DESIGN §4).

    CudaDriver        what the client asks the CUDA driver (a Protocol: tests use a fake)
    ├── BindingsDriver  the real one, over cuda-bindings' `cuda.bindings.driver`
    CudaMemory        one backend's cache of device allocations, keyed by CUDA BUFFER_ID

cuda-bindings is optional: it is imported only when a backend first meets a
pointer that is not host memory, and `available_driver()` answers None when it
is missing or there is no driver or GPU, so the client runs on the host engine
without it. The client never creates a CUDA context: pointer queries run in the
calling thread's current context (torch makes the primary context current).

Allocation ids on the wire are the backend's own, drawn from the same counter
as host buffer ids, so the two kinds never collide on a connection. CUDA's
BUFFER_ID is only the cache key: a freed and re-used address has a new
BUFFER_ID, so the cache never hands the daemon stale memory, and the old id is
reported (`on_forget`) so the daemon closes its mapping.
"""

from __future__ import annotations

import ctypes
import importlib
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, Protocol

from proto import IPC_EVENT_BYTES, IPC_MEM_HANDLE_BYTES, MemKind

from .errors import MisuseError
from .vmm import map_fd

DEFAULT_MAX_ALLOCATIONS = 1024  # well under the daemon's per-connection buffer limit (4096)


@dataclass(frozen=True, slots=True)
class PointerInfo:
    """The device allocation holding a pointer, as the driver reports it."""

    base: int
    size: int
    buffer_id: int  # CU_POINTER_ATTRIBUTE_BUFFER_ID: unique per allocation for the process's life
    device: int  # CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL
    legacy_ipc: bool  # cudaMalloc memory (CUDA IPC handle); False: VMM memory (POSIX fd)


class CudaDriver(Protocol):
    """The few driver queries the client needs. Methods raise MisuseError on driver errors."""

    def buffer_id(self, ptr: int) -> int | None:
        """The BUFFER_ID of the allocation holding `ptr`, or None if CUDA does not know the address.

        The one query on a steady-state call, so it must stay cheap (one attribute read).
        """
        ...

    def pointer_info(self, ptr: int) -> PointerInfo | None:
        """The allocation holding `ptr`, or None if CUDA does not know the address."""
        ...

    def ipc_handle(self, base: int) -> bytes:
        """The 64-byte CUDA IPC handle of the cudaMalloc allocation at `base`."""
        ...

    def device_uuid(self, device: int) -> bytes:
        """The 16-byte UUID of this process's CUDA device `device` (which another process,
        with other CUDA_VISIBLE_DEVICES, numbers differently)."""
        ...

    def export_fd(self, base: int) -> int:
        """A POSIX fd for the VMM allocation at `base`; the caller owns (and closes) it."""
        ...

    def current_device(self) -> int | None:
        """The device of the calling thread's current CUDA context (None: no context is
        current): where the legacy default stream, and events created now, belong."""
        ...

    def synchronize(self, stream: int) -> None:
        """Wait until the work queued on `stream` (0: every stream of the current context)
        is done, so the daemon reads what the worker's kernels wrote."""
        ...

    def create_ipc_event(self) -> tuple[int, bytes]:
        """An interprocess event (no timing) and its 64-byte IPC handle for the daemon."""
        ...

    def record_event(self, event: int, stream: int) -> None: ...

    def stream_wait_event(self, stream: int, event: int) -> None:
        """Work queued on `stream` from now on waits for `event`'s latest record."""
        ...

    def destroy_event(self, event: int) -> None: ...

    def map_shared(self, fd: int, nbytes: int, device: int) -> tuple[int, int]:
        """Map the daemon's symmetric allocation (a VMM fd; not consumed) for `device`:
        its pointer here and the size mapped (the allocation's, at least `nbytes`)."""
        ...

    def unmap_shared(self, ptr: int, size: int) -> None: ...


class BindingsDriver:
    """`CudaDriver` over cuda-bindings (13.x). Every call returns `(CUresult, values...)`;
    a failure becomes a MisuseError naming the call and the driver's error string.

    `module` is `cuda.bindings.driver`, imported here when not given. Raises ImportError
    without cuda-bindings, and whatever `cuInit` raises without a driver (cuda-bindings
    raises `cuda.pathfinder.DynamicLibNotFoundError` then, rather than returning an error).
    """

    def __init__(self, module: Any = None) -> None:
        cu = module if module is not None else importlib.import_module("cuda.bindings.driver")
        self._cu = cu
        self._success = cu.CUresult.CUDA_SUCCESS
        # what the driver answers for an address it has no allocation for
        self._unknown = (cu.CUresult.CUDA_ERROR_INVALID_VALUE, cu.CUresult.CUDA_ERROR_NOT_FOUND)
        attr = cu.CUpointer_attribute
        self._buffer_id_attr = attr.CU_POINTER_ATTRIBUTE_BUFFER_ID
        self._device_attr = attr.CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL
        self._legacy_attr = attr.CU_POINTER_ATTRIBUTE_IS_LEGACY_CUDA_IPC_CAPABLE
        self._type_attr = attr.CU_POINTER_ATTRIBUTE_MEMORY_TYPE
        self._managed_attr = attr.CU_POINTER_ATTRIBUTE_IS_MANAGED
        self._device_type = int(cu.CUmemorytype.CU_MEMORYTYPE_DEVICE)
        self._posix_fd = cu.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
        self._check("cuInit", cu.cuInit(0))  # idempotent; creates no context
        (count,) = self._check("cuDeviceGetCount", cu.cuDeviceGetCount())
        if int(count) < 1:
            raise MisuseError("the CUDA driver reports no device")

    def buffer_id(self, ptr: int) -> int | None:
        err, value = self._cu.cuPointerGetAttribute(self._buffer_id_attr, ptr)
        if err in self._unknown:
            return None
        self._check("cuPointerGetAttribute(BUFFER_ID)", (err, value))
        return int(value) or None  # 0 is never a live allocation's id

    def pointer_info(self, ptr: int) -> PointerInfo | None:
        buffer_id = self.buffer_id(ptr)
        if buffer_id is None:
            return None
        (mem_type,) = self._attribute("MEMORY_TYPE", self._type_attr, ptr)
        (managed,) = self._attribute("IS_MANAGED", self._managed_attr, ptr)
        if int(mem_type) != self._device_type or managed:
            what = "managed" if managed else "pinned host"
            raise MisuseError(
                f"pointer 0x{ptr:x} is CUDA {what} memory: the daemon opens device memory "
                "(cudaMalloc or cuMemCreate) or host memory from client.hostmem.alloc")
        base, size = self._check("cuMemGetAddressRange", self._cu.cuMemGetAddressRange(ptr))
        (device,) = self._attribute("DEVICE_ORDINAL", self._device_attr, ptr)
        (legacy,) = self._attribute("IS_LEGACY_CUDA_IPC_CAPABLE", self._legacy_attr, ptr)
        return PointerInfo(int(base), int(size), buffer_id, int(device), bool(legacy))

    def device_uuid(self, device: int) -> bytes:
        (dev,) = self._check("cuDeviceGet", self._cu.cuDeviceGet(device))
        (uuid,) = self._check("cuDeviceGetUuid", self._cu.cuDeviceGetUuid(dev))
        return bytes(uuid.bytes)

    def ipc_handle(self, base: int) -> bytes:
        (handle,) = self._check("cuIpcGetMemHandle", self._cu.cuIpcGetMemHandle(base))
        # cuda-bindings >= 13.4 has no `.reserved`: copy the struct's bytes out (DESIGN §4)
        return ctypes.string_at(handle.getPtr(), IPC_MEM_HANDLE_BYTES)

    def export_fd(self, base: int) -> int:
        cu = self._cu
        (handle,) = self._check(
            "cuMemRetainAllocationHandle", cu.cuMemRetainAllocationHandle(base),
            hint="only cudaMalloc and cuMemCreate memory can be shared with the daemon; memory of a "
                 "stream-ordered pool (cudaMallocAsync, PyTorch's backend:cudaMallocAsync) cannot")
        try:
            (fd,) = self._check(
                "cuMemExportToShareableHandle(POSIX_FILE_DESCRIPTOR)",
                cu.cuMemExportToShareableHandle(handle, self._posix_fd, 0),
                hint="VMM memory must be created with CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR "
                     "in requestedHandleTypes to be shared with the daemon")
        finally:
            cu.cuMemRelease(handle)  # the retain's reference; the fd keeps the memory alive
        return int(fd)

    def create_ipc_event(self) -> tuple[int, bytes]:
        cu = self._cu
        flags = int(cu.CUevent_flags.CU_EVENT_INTERPROCESS) | int(cu.CUevent_flags.CU_EVENT_DISABLE_TIMING)
        (event,) = self._check("cuEventCreate(INTERPROCESS)", cu.cuEventCreate(flags))
        try:
            (handle,) = self._check("cuIpcGetEventHandle", cu.cuIpcGetEventHandle(event))
        except MisuseError:
            cu.cuEventDestroy(event)
            raise
        return int(event), ctypes.string_at(handle.getPtr(), IPC_EVENT_BYTES)

    def record_event(self, event: int, stream: int) -> None:
        self._check("cuEventRecord", self._cu.cuEventRecord(event, stream))

    def stream_wait_event(self, stream: int, event: int) -> None:
        self._check("cuStreamWaitEvent", self._cu.cuStreamWaitEvent(stream, event, 0))

    def destroy_event(self, event: int) -> None:
        self._cu.cuEventDestroy(event)

    def map_shared(self, fd: int, nbytes: int, device: int) -> tuple[int, int]:
        cu = self._cu

        def granular(prop: Any) -> int:
            (granularity,) = self._check("cuMemGetAllocationGranularity", cu.cuMemGetAllocationGranularity(
                prop, cu.CUmemAllocationGranularity_flags.CU_MEM_ALLOC_GRANULARITY_MINIMUM))
            return -(-nbytes // int(granularity)) * int(granularity)

        ptr, size, _owner = map_fd(cu, fd, self._value, granular, lambda _owner: [device])
        return ptr, size

    def unmap_shared(self, ptr: int, size: int) -> None:
        self._check("cuMemUnmap", self._cu.cuMemUnmap(ptr, size))
        self._check("cuMemAddressFree", self._cu.cuMemAddressFree(ptr, size))

    def current_device(self) -> int | None:
        err, device = self._cu.cuCtxGetDevice()
        if err == self._cu.CUresult.CUDA_ERROR_INVALID_CONTEXT:
            return None
        self._check("cuCtxGetDevice", (err, device))
        return int(device)

    def synchronize(self, stream: int) -> None:
        if stream:
            self._check("cuStreamSynchronize", self._cu.cuStreamSynchronize(stream))
        else:
            self._check("cuCtxSynchronize", self._cu.cuCtxSynchronize())

    def _attribute(self, name: str, attribute: Any, ptr: int) -> tuple[Any, ...]:
        return self._check(f"cuPointerGetAttribute({name})", self._cu.cuPointerGetAttribute(attribute, ptr))

    def _value(self, call: str, result: tuple[Any, ...]) -> Any:
        """`_check` for a call with at most one value (None for none)."""
        values = self._check(call, result)
        return values[0] if values else None

    def _check(self, call: str, result: tuple[Any, ...], hint: str = "") -> tuple[Any, ...]:
        err = result[0]
        if err == self._success:
            return tuple(result[1:])
        message = f"{call} failed: {self._describe(err)}"
        if err == self._cu.CUresult.CUDA_ERROR_INVALID_CONTEXT:  # whatever the call's own hint says
            hint = "make the pointer's device current in this thread (torch.cuda.set_device)"
        raise MisuseError(f"{message}; {hint}" if hint else message)

    def _describe(self, err: Any) -> str:
        name_err, name = self._cu.cuGetErrorName(err)
        text_err, text = self._cu.cuGetErrorString(err)
        name = _text(name) if name_err == self._success else f"CUresult {int(err)}"
        return f"{name}: {_text(text)}" if text_err == self._success else name


def _text(value: bytes | str | None) -> str:
    if isinstance(value, bytes):
        return value.decode(errors="replace")
    return str(value)


def available_driver() -> CudaDriver | None:
    """The CUDA driver through cuda-bindings, or None without cuda-bindings, a driver or a GPU."""
    try:
        return BindingsDriver()
    except Exception:  # ImportError (no cuda-bindings), pathfinder's (no driver), no device, cuInit
        return None


@dataclass(frozen=True, slots=True)
class CudaAllocation:
    """One cached device allocation: our wire id and how the daemon opens it."""

    id: int  # the backend's buffer id on the wire
    cuda_id: int  # CUDA's BUFFER_ID: the cache key, and the proof the allocation still lives
    base: int
    size: int
    device: int
    kind: MemKind  # CUDA_IPC (handle below) or CUDA_VMM (an fd exported per Import)
    handle: bytes = b""
    adopted: bool = False  # the daemon's (symmetric_alloc), not an import of ours

    def offset_of(self, ptr: int, nbytes: int) -> int:
        offset = ptr - self.base
        if offset < 0 or offset + nbytes > self.size:
            spans = ("; VMM memory is shared one allocation at a time, and a buffer that spans "
                     "several (as PyTorch's expandable segments can place it) cannot be used"
                     if self.kind is MemKind.CUDA_VMM else "")
            raise MisuseError(
                f"[0x{ptr:x}, +{nbytes}) runs past the end of the CUDA allocation at 0x{self.base:x} "
                f"({self.size} bytes){spans}")
        return offset


class CudaMemory:
    """One backend's cache of device allocations it has handed the daemon.

    Keyed by CUDA BUFFER_ID, so a resolve costs one attribute query once the allocation is
    known. We cannot observe frees, so a stale entry is dropped when it is noticed: a new
    allocation overlapping its range, a failed `still_valid`, or a sweep when the cache is
    full; each dropped id goes to `on_forget` (outside our lock) so the daemon forgets it.
    The daemon's own allocations (`adopt`) are neither counted nor dropped when full: the
    daemon ignores their Forget, and the next call would import its memory again as a
    second buffer, which outlives symmetric_free.
    """

    def __init__(self, driver: CudaDriver, next_id: Callable[[], int], *, device: int | None = None,
                 on_forget: Callable[[int], None] = lambda _id: None,
                 max_allocations: int = DEFAULT_MAX_ALLOCATIONS) -> None:
        self._driver = driver
        self._next_id = next_id
        self._device = device
        self._on_forget = on_forget
        self._max = max_allocations
        self._lock = threading.Lock()
        # least recently found first: the op being built found its other buffers just now,
        # so making room for one of them never drops another
        self._by_cuda_id: dict[int, CudaAllocation] = {}
        self._by_id: dict[int, CudaAllocation] = {}
        self._adopted = 0  # of those, the daemon's

    @property
    def driver(self) -> CudaDriver:
        return self._driver

    def find(self, ptr: int, nbytes: int) -> tuple[CudaAllocation, int] | None:
        """The allocation holding [ptr, ptr+nbytes) and ptr's offset in it; None if CUDA does
        not know `ptr`. Raises MisuseError for a span past the end or a wrong device."""
        cuda_id = self._driver.buffer_id(ptr)
        if cuda_id is None:
            return None
        with self._lock:
            allocation = self._by_cuda_id.pop(cuda_id, None)
            if allocation is not None:  # now the newest: a full cache drops the least recently found
                self._by_cuda_id[cuda_id] = allocation
        if allocation is None:
            allocation = self._add(ptr)
            if allocation is None:
                return None
        return allocation, allocation.offset_of(ptr, nbytes)

    # owns() and still_valid() read without the lock: they run on every call of a cached op, a
    # dict read is atomic, and a racing eviction only makes the next call rebuild its op.
    def owns(self, buffer_id: int) -> bool:
        return buffer_id in self._by_id

    def still_valid(self, buffer_ids: Iterable[int]) -> bool:
        """Whether these ids' allocations are all alive (a cached op may be reused): one BUFFER_ID
        query at each base. An allocation found freed is forgotten."""
        for buffer_id in buffer_ids:
            allocation = self._by_id.get(buffer_id)
            if allocation is None:
                return False
            if self._driver.buffer_id(allocation.base) != allocation.cuda_id:
                self._forget([allocation])
                return False
        return True

    def adopt(self, ptr: int, buffer_id: int) -> None:
        """Memory the daemon allocated as `buffer_id` (symmetric_alloc), mapped here at `ptr`:
        calls on it name that id, with no Import (the daemon has it)."""
        info = self._driver.pointer_info(ptr)
        if info is None:
            raise MisuseError(f"the daemon's allocation mapped at 0x{ptr:x} is not known to CUDA")
        allocation = CudaAllocation(buffer_id, info.buffer_id, info.base, info.size, info.device,
                                    MemKind.CUDA_VMM, adopted=True)
        with self._lock:
            stale = self._insert(allocation)
        self._notify(stale)

    def discard(self, buffer_id: int) -> None:
        """Drop an adopted allocation (symmetric_free told the daemon already)."""
        with self._lock:
            allocation = self._by_id.get(buffer_id)
            if allocation is not None:
                self._drop([allocation])

    def export_fd(self, buffer_id: int) -> int:
        """A fresh fd for a VMM allocation's Import; the caller owns it (SCM_RIGHTS copies it)."""
        allocation = self._by_id.get(buffer_id)
        if allocation is None or allocation.kind is not MemKind.CUDA_VMM:
            raise MisuseError(f"buffer {buffer_id} is not a live VMM allocation")
        return self._driver.export_fd(allocation.base)

    def _add(self, ptr: int) -> CudaAllocation | None:
        info = self._driver.pointer_info(ptr)
        if info is None:  # freed since the BUFFER_ID query
            return None
        if self._device is not None and info.device != self._device:
            raise MisuseError(
                f"pointer 0x{ptr:x} is memory of CUDA device {info.device}, "
                f"but this backend serves device {self._device}")
        if info.legacy_ipc:
            kind, handle = MemKind.CUDA_IPC, self._driver.ipc_handle(info.base)
        else:
            kind, handle = MemKind.CUDA_VMM, b""  # the fd is exported when the daemon imports it
        with self._lock:
            known = self._by_cuda_id.get(info.buffer_id)
            if known is not None:  # another thread added it meanwhile
                return known
            allocation = CudaAllocation(self._next_id(), info.buffer_id, info.base, info.size,
                                        info.device, kind, handle)
            stale = self._insert(allocation)
        self._notify(stale)
        if len(self._by_id) - self._adopted > self._max:
            self._shrink()
        return allocation

    def _shrink(self) -> None:
        """Over the limit: drop freed allocations, then the least recently found (re-imported
        if used again)."""
        with self._lock:
            candidates = list(self._by_cuda_id.values())
        freed = [a for a in candidates if self._driver.buffer_id(a.base) != a.cuda_id]
        self._forget(freed)
        with self._lock:
            excess = len(self._by_id) - self._adopted - self._max
            oldest = [a for a in self._by_cuda_id.values() if not a.adopted][:max(0, excess)]
        self._forget(oldest)

    def _insert(self, allocation: CudaAllocation) -> list[CudaAllocation]:
        """(Lock held) Cache a live allocation; returns the cached ones it proves freed, dropped."""
        # Live allocations never overlap: any cached one that does was freed (the daemon's
        # symmetric memory, too, may be mapped where a worker's allocation was).
        base, end = allocation.base, allocation.base + allocation.size
        stale = self._drop([a for a in self._by_cuda_id.values() if a.base < end and base < a.base + a.size])
        self._by_cuda_id[allocation.cuda_id] = allocation
        self._by_id[allocation.id] = allocation
        self._adopted += allocation.adopted
        return stale

    def _forget(self, allocations: list[CudaAllocation]) -> None:
        with self._lock:
            dropped = self._drop(allocations)
        self._notify(dropped)

    def _drop(self, allocations: list[CudaAllocation]) -> list[CudaAllocation]:
        """Remove from the tables (lock held); returns those that were still there."""
        dropped = []
        for allocation in allocations:
            if self._by_id.pop(allocation.id, None) is not None:
                del self._by_cuda_id[allocation.cuda_id]
                self._adopted -= allocation.adopted
                dropped.append(allocation)
        return dropped

    def _notify(self, allocations: list[CudaAllocation]) -> None:
        for allocation in allocations:
            self._on_forget(allocation.id)
