"""The real cuda-bindings and nccl4py over a fake device: commd's own CUDA/NCCL code
(`BindingsGpu`, `BindingsDriver`) run end to end without a GPU.

fakecuda.c is built here (gcc) as libcuda.so.1, libnccl.so.2 and libnvrtc.so.13 and
loaded before the bindings look for those libraries, so they find it as if it were the
driver, NCCL and NVRTC.
Every call then crosses the real bindings (their argument conversion, struct layouts,
output tuples and enums) into the C ABI, and `AbiDevice` answers it from a
`FakeGpu` (tests/contract/fakegpu.py), the device the engine's logic is tested on.
What it checks, then, is the layer between: the call forms, which are otherwise first
run on a lent GPU. It also checks what the driver itself would refuse: an event shared
without CU_EVENT_INTERPROCESS|CU_EVENT_DISABLE_TIMING, a communicator created
blocking, an IPC open without lazy peer access, a VMM mapping without read-write
access, an NCCL launch with another device current.

The libraries stay loaded for the process; `bind(gpu)` points them at a device and
`unbind()` makes them a driver with no GPU, which is what every other test sees.
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import os
import shutil
import subprocess
import tempfile
import threading
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from commd.engine.gpu import GpuError, Imported, Origin
from proto import DType, ReduceOp
from tests.contract.fakegpu import FakeGpu

_SOURCE = Path(__file__).with_name("fakecuda.c")
_LIBRARIES = ("libcuda.so.1", "libnccl.so.2", "libnvrtc.so.13")  # the sonames the bindings look for
COMPILE_FLAGS = ("-O1", "-shared", "-fPIC", "-Wall", "-Wextra", "-Werror")
SOURCE = _SOURCE
_DISPATCH = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_char_p, ctypes.POINTER(ctypes.c_uint64), ctypes.c_int)

# CUresult and ncclResult_t values (cuda.h, nccl.h)
CUDA_SUCCESS, CUDA_ERROR_INVALID_VALUE, CUDA_ERROR_NO_DEVICE = 0, 1, 100
CUDA_ERROR_INVALID_DEVICE, CUDA_ERROR_INVALID_CONTEXT, CUDA_ERROR_INVALID_HANDLE = 101, 201, 400
CUDA_ERROR_NOT_FOUND, CUDA_ERROR_UNKNOWN = 500, 999
NCCL_INTERNAL_ERROR, NCCL_INVALID_ARGUMENT, NCCL_INVALID_USAGE, NCCL_REMOTE_ERROR = 3, 4, 5, 6
NCCL_IN_PROGRESS = 7
_CUDA_NAMES = {0: "CUDA_SUCCESS", 1: "CUDA_ERROR_INVALID_VALUE", 100: "CUDA_ERROR_NO_DEVICE",
               101: "CUDA_ERROR_INVALID_DEVICE", 201: "CUDA_ERROR_INVALID_CONTEXT",
               400: "CUDA_ERROR_INVALID_HANDLE", 500: "CUDA_ERROR_NOT_FOUND", 999: "CUDA_ERROR_UNKNOWN"}
# what cuGetErrorString answers: the driver's fixed texts (cuda.h), never why this call failed
_CUDA_TEXTS = {0: "no error", 1: "invalid argument", 100: "no CUDA-capable device is detected",
               101: "invalid device ordinal", 201: "invalid device context", 400: "invalid resource handle",
               500: "named symbol not found", 700: "an illegal memory access was encountered",
               999: "unknown error"}
_NCCL_NAMES = {0: "no error", 1: "unhandled cuda error (run with NCCL_DEBUG=INFO for details)",
               2: "unhandled system error (run with NCCL_DEBUG=INFO for details)",
               3: "internal error - please report this issue to the NCCL developers",
               4: "invalid argument (run with NCCL_DEBUG=WARN for details)",
               5: "invalid usage (run with NCCL_DEBUG=WARN for details)",
               6: "remote process exited or there was a network error", 7: "NCCL operation in progress"}
_BLOCKING = {"cuEventSynchronize", "cuStreamSynchronize", "cuCtxSynchronize"}  # run without the fake's lock

# the enums commd passes, by their cuda.h / nccl.h values
_ATTR_MEMORY_TYPE, _ATTR_BUFFER_ID, _ATTR_IS_MANAGED, _ATTR_DEVICE_ORDINAL, _ATTR_LEGACY_IPC = 2, 7, 8, 9, 10
_MEMORYTYPE_DEVICE = 2
_DEVICE_ATTR_CC_MAJOR, _DEVICE_ATTR_CC_MINOR = 75, 76
_IPC_LAZY_PEER_ACCESS = 1
_EVENT_DISABLE_TIMING, _EVENT_INTERPROCESS = 2, 4
_HANDLE_POSIX_FD, _LOCATION_DEVICE, _ACCESS_READWRITE, _ALLOCATION_PINNED = 1, 1, 3, 1
_NCCL_CONFIG_MAGIC = 0xCAFEBEEF
_NCCL_DTYPES = {1: DType.U8, 2: DType.I32, 4: DType.I64, 6: DType.F16, 7: DType.F32, 8: DType.F64,
                9: DType.BF16}
_NCCL_OPS = {0: ReduceOp.SUM, 1: ReduceOp.PROD, 2: ReduceOp.MAX, 3: ReduceOp.MIN}
GRANULARITY = 1 << 16  # what cuMemGetAllocationGranularity answers (a real GPU: 2 MiB)
_CONTEXT_BASE = 0xC0_0000  # device d's primary context is this + d
_ADD_KERNEL = 0xADD0  # the one function a loaded module has
_CUBIN = b"FAKE-CUBIN "
NVRTC_ERROR_COMPILATION = 6


class FakeDriverError(Exception):
    """The fake refuses a call as the driver or NCCL would: (result code, message)."""

    def __init__(self, code: int, message: str) -> None:
        super().__init__(message)
        self.code = code


def _signed(value: int) -> int:
    return value - (1 << 64) if value >= 1 << 63 else value


def _put(address: int, ctype: Any, value: int) -> None:
    ctype.from_address(address).value = value


def _get(address: int, ctype: Any) -> int:
    return int(ctype.from_address(address).value)


class AbiDevice:
    """Answers the C calls from a FakeGpu. Pointers, streams, events and comms are the
    FakeGpu's own numbers; contexts are _CONTEXT_BASE + device; stream 0 is the legacy
    default stream of the calling thread's current device."""

    def __init__(self, gpu: FakeGpu, compute_capability: tuple[int, int] = (9, 0)) -> None:
        self.gpu = gpu
        self.compute_capability = compute_capability
        self.crashes: list[str] = []  # the fake's own bugs: a test fails on any
        self.refusals: list[str] = []  # why each refused call was refused (the driver says less)
        self.calls: dict[str, int] = {}
        self._local = threading.local()  # the thread's current device
        # Held for every call but the blocking ones: the fake's tables are shared by the
        # daemon's loop, its helper threads and the workers' threads.
        self._book = threading.RLock()
        self._nccl_last_error = ""  # NCCL's is one string for the process, kept until the next
        self._buffer_ids: dict[int, int] = {}
        self._next_buffer_id = 1
        self._vmm_bases: set[int] = set()  # not cudaMalloc memory: no legacy IPC
        self._physical: dict[int, int] = {}  # a VMM mapping (or ncclMemAlloc base) -> its memory
        self._handles: dict[int, int] = {}  # a generic allocation handle -> the memory it holds
        self._handle_props: dict[int, int] = {}  # memory -> requestedHandleTypes
        self._next_handle = 0x4000
        self._reserved: dict[int, int] = {}  # address ranges reserved: base -> size
        self._event_flags: dict[int, int] = {}
        self._created_event_flags: list[int] = []
        self._ipc_open: dict[tuple[bytes, int], tuple[int, int]] = {}  # (handle, device) -> (ptr, opens)
        self._ipc_handles: dict[int, bytes] = {}
        self._defaults: dict[int, int] = {}  # device -> its legacy default stream
        self._plain: set[int] = set()  # cuMemAlloc'd: what cuMemFree takes
        self._mapped: dict[int, int] = {}  # a VMM mapping -> the size mapped
        self.access: dict[int, set[int]] = {}  # a VMM mapping -> the devices given access
        self._modules: dict[int, bytes] = {}
        self._programs: dict[int, list[bytes]] = {}  # NVRTC program -> [source, log, cubin]
        self._next_program = 0x9000
        self.compile_error: bytes | None = None  # set: NVRTC fails with this log
        self.fail_with: dict[str, int] = {}  # call -> the result it answers from now on
        self.nccl_version = 23203  # what ncclGetVersion answers (2.32.3)
        self.nccl_cumem = True  # False: ncclMemAlloc gives cudaMalloc memory (NCCL_CUMEM_ENABLE=0)
        self._nccl_memory: set[int] = set()

    # ---- plumbing ---------------------------------------------------------------------
    def dispatch(self, name: bytes, args: Any, nargs: int) -> int:
        call = name.decode()
        values = [int(args[i]) for i in range(nargs)]
        nccl = call.startswith("nccl")
        with self._book:
            self.calls[call] = self.calls.get(call, 0) + 1
            failure = self.fail_with.get(call)
        if failure is not None:  # as the device would answer after, say, a kernel's bad access
            return failure
        try:
            if call in _BLOCKING:
                result = getattr(self, call)(*values)
            else:
                with self._book:
                    result = getattr(self, call)(*values)
            return int(result or 0)
        except (FakeDriverError, GpuError) as exc:  # refused, as the driver or NCCL would
            code = exc.code if isinstance(exc, FakeDriverError) else (
                NCCL_INVALID_USAGE if nccl else CUDA_ERROR_INVALID_VALUE)
            with self._book:
                self.refusals.append(f"{call}: {exc}")
                if nccl:
                    self._nccl_last_error = str(exc)
            return code
        except Exception:
            self.crashes.append(f"{call}{tuple(values)}:\n{traceback.format_exc()}")
            return NCCL_INTERNAL_ERROR if nccl else CUDA_ERROR_UNKNOWN

    @staticmethod
    def _text(text: str, out: int, size: int) -> None:
        data = text.encode()[:size - 1] + b"\0"
        ctypes.memmove(out, data, len(data))

    # A worker thread may see the GPUs numbered otherwise (restrict: as CUDA_VISIBLE_DEVICES
    # does to a process); CUdevice values and pointer attributes are in the thread's numbering.
    def restrict(self, visible: list[int]) -> None:
        """The calling thread sees GPUs `visible` (their real numbers) as 0, 1, ..."""
        self._local.visible = list(visible)

    def _real(self, ordinal: int) -> int:
        visible = getattr(self._local, "visible", None)
        if visible is None:
            return ordinal
        if not 0 <= ordinal < len(visible):
            raise FakeDriverError(CUDA_ERROR_INVALID_DEVICE, f"no device {ordinal} here")
        return int(visible[ordinal])

    def _seen(self, real: int) -> int:
        visible = getattr(self._local, "visible", None)
        return real if visible is None else visible.index(real)

    def _device(self) -> int:
        device = getattr(self._local, "device", None)
        if device is None:
            raise FakeDriverError(CUDA_ERROR_INVALID_CONTEXT, "no context is current on this thread")
        return int(device)

    def _stream(self, stream: int) -> int:
        if stream:
            return stream
        device = self._device()
        with self._book:
            if device not in self._defaults:
                self._defaults[device] = self.gpu.worker_stream(device)
            return self._defaults[device]

    def event_flags(self) -> list[int]:
        """The flags of every event created so far (cuEventCreate)."""
        with self._book:
            return list(self._created_event_flags)

    def leaked_handles(self) -> list[int]:
        """Generic allocation handles retained or imported and never cuMemRelease'd."""
        with self._book:
            return sorted(self._handles)

    def ipc_opens(self) -> dict[tuple[bytes, int], tuple[int, int]]:
        """The IPC handles open now: (handle, context's device) -> (pointer, times opened)."""
        with self._book:
            return dict(self._ipc_open)

    def _wait_streams(self, streams: list[int]) -> None:
        device = self._device()
        events = []
        with self._book:
            for stream in streams:
                event = self.gpu.event_create(device)
                self.gpu.event_record(event, stream)
                events.append(event)
        for event in events:
            self.gpu.event_wait(event, device)
        with self._book:
            for event in events:
                self.gpu.event_destroy(event)

    def _memory(self, ptr: int) -> tuple[int, int, int]:
        found = self.gpu.locate(ptr)
        if found is None:
            raise FakeDriverError(CUDA_ERROR_INVALID_VALUE, f"{ptr:#x} is no device memory")
        return found

    def _new_handle(self, memory: int) -> int:
        self._next_handle += 1
        self._handles[self._next_handle] = memory
        return self._next_handle

    # ---- the driver -------------------------------------------------------------------
    def cuGetErrorString(self, code: int, out: int, size: int) -> None:
        self._text(_CUDA_TEXTS.get(code, "unknown error"), out, size)

    def cuGetErrorName(self, code: int, out: int, size: int) -> None:
        self._text(_CUDA_NAMES.get(code, f"CUDA_ERROR_{code}"), out, size)

    def cuInit(self, flags: int) -> None:
        if flags != 0:
            raise FakeDriverError(CUDA_ERROR_INVALID_VALUE, "cuInit takes flags 0")

    def cuDeviceGetCount(self, out: int) -> None:
        visible = getattr(self._local, "visible", None)
        _put(out, ctypes.c_int, self.gpu.devices if visible is None else len(visible))

    def cuDeviceGet(self, out: int, ordinal: int) -> None:
        visible = getattr(self._local, "visible", None)
        if not 0 <= _signed(ordinal) < (self.gpu.devices if visible is None else len(visible)):
            raise FakeDriverError(CUDA_ERROR_INVALID_DEVICE, f"no device {_signed(ordinal)}")
        _put(out, ctypes.c_int, ordinal)

    def cuDeviceGetUuid(self, out: int, device: int) -> None:
        real = self._real(device)  # a GPU's UUID is the same in every process's numbering
        ctypes.memmove(out, bytes([0xC0, 0xDA, real]) + bytes(13), 16)

    def cuDeviceGetAttribute(self, out: int, attribute: int, device: int) -> None:
        values = {_DEVICE_ATTR_CC_MAJOR: self.compute_capability[0],
                  _DEVICE_ATTR_CC_MINOR: self.compute_capability[1]}
        if attribute not in values:
            raise FakeDriverError(CUDA_ERROR_INVALID_VALUE, f"attribute {attribute} is not faked")
        _put(out, ctypes.c_int, values[attribute])

    def cuDeviceCanAccessPeer(self, out: int, device: int, peer: int) -> None:
        if not (0 <= device < self.gpu.devices and 0 <= peer < self.gpu.devices):
            raise FakeDriverError(CUDA_ERROR_INVALID_DEVICE, f"no device {device} or {peer}")
        _put(out, ctypes.c_int, int(device != peer))  # every pair of GPUs here is NVLinked

    def cuDevicePrimaryCtxRetain(self, out: int, device: int) -> None:
        _put(out, ctypes.c_uint64, _CONTEXT_BASE + self._real(device))

    def cuCtxSetCurrent(self, context: int) -> None:
        device = context - _CONTEXT_BASE
        if not 0 <= device < self.gpu.devices:
            raise FakeDriverError(CUDA_ERROR_INVALID_CONTEXT, f"{context:#x} is no context")
        self._local.device = device

    def cuCtxGetDevice(self, out: int) -> None:
        _put(out, ctypes.c_int, self._seen(self._device()))  # as this thread numbers its GPUs

    def cuCtxSynchronize(self) -> None:
        """Every stream of the context, the legacy one too, as the driver waits for them."""
        self._stream(0)
        self._wait_streams(self.gpu.streams_of(self._device()))

    def cuPointerGetAttribute(self, out: int, attribute: int, ptr: int) -> None:
        found = self.gpu.locate(ptr)
        if found is None:
            raise FakeDriverError(CUDA_ERROR_INVALID_VALUE, f"{ptr:#x} is not an address CUDA knows")
        base, _, device = found
        if attribute == _ATTR_BUFFER_ID:
            if base not in self._buffer_ids:
                self._buffer_ids[base] = self._next_buffer_id
                self._next_buffer_id += 1
            _put(out, ctypes.c_ulonglong, self._buffer_ids[base])
        elif attribute == _ATTR_DEVICE_ORDINAL:
            _put(out, ctypes.c_int, self._seen(device))
        elif attribute == _ATTR_MEMORY_TYPE:
            _put(out, ctypes.c_uint, _MEMORYTYPE_DEVICE)
        elif attribute == _ATTR_IS_MANAGED:
            _put(out, ctypes.c_int, 0)
        elif attribute == _ATTR_LEGACY_IPC:
            _put(out, ctypes.c_int, int(base not in self._vmm_bases))
        else:
            raise FakeDriverError(CUDA_ERROR_INVALID_VALUE, f"pointer attribute {attribute} is not faked")

    def cuMemGetAddressRange(self, base_out: int, size_out: int, ptr: int) -> None:
        base, size, _ = self._memory(ptr)
        if base_out:
            _put(base_out, ctypes.c_uint64, base)
        if size_out:
            _put(size_out, ctypes.c_size_t, size)

    def cuMemAlloc(self, out: int, nbytes: int) -> None:
        ptr = self.gpu.alloc(nbytes, self._device()).ptr
        self._plain.add(ptr)
        _put(out, ctypes.c_uint64, ptr)

    def cuMemFree(self, ptr: int) -> None:
        self._device()  # a context must be current
        if ptr not in self._plain:  # an IPC mapping, a VMM mapping, ncclMemAlloc's: each has its own call
            raise FakeDriverError(CUDA_ERROR_INVALID_VALUE, f"{ptr:#x} is not from cuMemAlloc")
        self._plain.discard(ptr)
        self.gpu.release(Imported(ptr, 0, 0, Origin.PLAIN))

    def cuMemcpyHtoD(self, dst: int, src: int, nbytes: int) -> None:
        self.gpu.copy_in(dst, ctypes.string_at(src, nbytes))

    def cuMemcpyDtoH(self, dst: int, src: int, nbytes: int) -> None:
        data = self.gpu.copy_out(src, nbytes)
        ctypes.memmove(dst, data, nbytes)

    def cuIpcGetMemHandle(self, out: int, ptr: int) -> None:
        base, _, _ = self._memory(ptr)
        if base != ptr or base in self._vmm_bases:
            raise FakeDriverError(CUDA_ERROR_INVALID_VALUE, "not the base of a cudaMalloc allocation")
        if base not in self._ipc_handles:  # one handle per allocation, however often asked
            self._ipc_handles[base] = self.gpu.export_ipc(base)
        ctypes.memmove(out, self._ipc_handles[base], 64)

    def cuIpcOpenMemHandle(self, out: int, handle: int, flags: int) -> None:
        """As the driver: a handle this context has open already gives the same pointer
        again, counted (cuda.h: "the reference count on the handle is incremented")."""
        if flags != _IPC_LAZY_PEER_ACCESS:
            raise FakeDriverError(CUDA_ERROR_INVALID_VALUE,
                                  f"flags {flags}: want CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS")
        key = (ctypes.string_at(handle, 64), self._device())
        base = self.gpu.exported(key[0])
        if base is None:
            raise FakeDriverError(CUDA_ERROR_INVALID_HANDLE, "no such IPC handle")
        if key in self._ipc_open:
            ptr, count = self._ipc_open[key]
        else:
            ptr, count = self.gpu.ipc_open(key[0], self._memory(base)[1], 0).ptr, 0
        self._ipc_open[key] = (ptr, count + 1)
        _put(out, ctypes.c_uint64, ptr)

    def cuIpcCloseMemHandle(self, ptr: int) -> None:
        key = next((k for k, (p, _) in self._ipc_open.items() if p == ptr), None)
        if key is None:
            raise FakeDriverError(CUDA_ERROR_INVALID_VALUE, f"{ptr:#x} is no open IPC mapping")
        if key[1] != self._device():  # the mapping is the opening context's
            raise FakeDriverError(CUDA_ERROR_INVALID_CONTEXT, f"{ptr:#x} was opened in device "
                                                              f"{key[1]}'s context, not {self._device()}'s")
        _, count = self._ipc_open[key]
        if count > 1:
            self._ipc_open[key] = (ptr, count - 1)
            return
        del self._ipc_open[key]
        self.gpu.release(Imported(ptr, 0, 0, Origin.IPC))

    def cuIpcGetEventHandle(self, out: int, event: int) -> None:
        flags = self._event_flags.get(event)
        if flags is None or flags & (_EVENT_INTERPROCESS | _EVENT_DISABLE_TIMING) != (
                _EVENT_INTERPROCESS | _EVENT_DISABLE_TIMING):
            raise FakeDriverError(CUDA_ERROR_INVALID_VALUE, "the event was not created with "
                                  "CU_EVENT_INTERPROCESS | CU_EVENT_DISABLE_TIMING")
        ctypes.memmove(out, self.gpu.export_event(event), 64)

    def cuIpcOpenEventHandle(self, out: int, handle: int) -> None:
        event = self.gpu.event_open(ctypes.string_at(handle, 64), self._device())
        _put(out, ctypes.c_uint64, event)

    # VMM: "memory" is a FakeGpu allocation no one addresses directly; mappings alias it.
    def cuMemCreate(self, out: int, size: int, prop: int, flags: int) -> None:
        kind, handle_types = _get(prop, ctypes.c_int), _get(prop + 4, ctypes.c_int)
        location, device = _get(prop + 8, ctypes.c_int), self._real(_get(prop + 12, ctypes.c_int))
        if kind != _ALLOCATION_PINNED or location != _LOCATION_DEVICE or size % GRANULARITY or flags:
            raise FakeDriverError(CUDA_ERROR_INVALID_VALUE, "cuMemCreate: bad properties or size")
        memory = self.gpu.alloc(size, device).ptr
        self._vmm_bases.add(memory)
        self._handle_props[memory] = handle_types
        _put(out, ctypes.c_uint64, self._new_handle(memory))

    def cuMemRetainAllocationHandle(self, out: int, ptr: int) -> None:
        base, _, _ = self._memory(ptr)
        memory = self._physical.get(base)
        if memory is None or base != ptr:
            raise FakeDriverError(CUDA_ERROR_INVALID_VALUE, "not the start of a VMM mapping")
        _put(out, ctypes.c_uint64, self._new_handle(memory))

    def cuMemExportToShareableHandle(self, out: int, handle: int, kind: int, flags: int) -> None:
        memory = self._handles.get(handle)
        if memory is None:
            raise FakeDriverError(CUDA_ERROR_INVALID_HANDLE, f"no allocation handle {handle:#x}")
        if kind != _HANDLE_POSIX_FD or not self._handle_props.get(memory, 0) & _HANDLE_POSIX_FD:
            raise FakeDriverError(CUDA_ERROR_INVALID_VALUE, "not exportable as a POSIX fd")
        _put(out, ctypes.c_int, self.gpu.export_vmm(memory))

    def cuMemImportFromShareableHandle(self, out: int, fd: int, kind: int) -> None:
        if kind != _HANDLE_POSIX_FD:
            raise FakeDriverError(CUDA_ERROR_INVALID_VALUE, f"handle type {kind}")
        memory = self.gpu.imported(int(fd))
        if memory is None:
            raise FakeDriverError(CUDA_ERROR_INVALID_HANDLE, f"fd {fd} is no exported allocation")
        _put(out, ctypes.c_uint64, self._new_handle(memory))

    def cuMemGetAllocationPropertiesFromHandle(self, prop: int, handle: int) -> None:
        memory = self._handles.get(handle)
        if memory is None:
            raise FakeDriverError(CUDA_ERROR_INVALID_HANDLE, f"no allocation handle {handle:#x}")
        _, _, device = self._memory(memory)
        for offset, value in ((0, _ALLOCATION_PINNED), (4, self._handle_props.get(memory, 0)),
                              (8, _LOCATION_DEVICE), (12, self._seen(device))):
            _put(prop + offset, ctypes.c_int, value)

    def cuMemGetAllocationGranularity(self, out: int, prop: int, option: int) -> None:
        if _get(prop + 8, ctypes.c_int) != _LOCATION_DEVICE:
            raise FakeDriverError(CUDA_ERROR_INVALID_VALUE, "granularity of a non-device location")
        _put(out, ctypes.c_size_t, GRANULARITY)

    def cuMemAddressReserve(self, out: int, size: int, alignment: int, addr: int, flags: int) -> None:
        if size % GRANULARITY:
            raise FakeDriverError(CUDA_ERROR_INVALID_VALUE, f"size {size}: not a multiple of the granularity")
        va = -(-self.gpu.reserve(size + GRANULARITY) // GRANULARITY) * GRANULARITY  # aligned, as the driver's
        self._reserved[va] = size
        _put(out, ctypes.c_uint64, va)

    def cuMemAddressFree(self, va: int, size: int) -> None:
        if self._reserved.get(va) != size or any(va <= m < va + size for m in self._mapped):
            raise FakeDriverError(CUDA_ERROR_INVALID_VALUE, "not a reserved, unmapped range")
        del self._reserved[va]

    def cuMemMap(self, va: int, size: int, offset: int, handle: int, flags: int) -> None:
        """Anywhere in a reservation, so several allocations can sit side by side in one
        (as PyTorch's expandable segments map theirs)."""
        memory = self._handles.get(handle)
        reserved = any(r <= va and va + size <= r + n for r, n in self._reserved.items())
        overlaps = any(m < va + size and va < m + n for m, n in self._mapped.items())
        if memory is None or offset or flags or not reserved or overlaps:
            raise FakeDriverError(CUDA_ERROR_INVALID_VALUE, "cuMemMap: bad handle, range or flags")
        if va % GRANULARITY or size % GRANULARITY:  # cuda.h: "multiple of ... granularity"
            raise FakeDriverError(CUDA_ERROR_INVALID_VALUE, f"cuMemMap of [{va:#x}, +{size}): not aligned")
        _, memory_size, _ = self._memory(memory)
        if size > memory_size:
            raise FakeDriverError(CUDA_ERROR_INVALID_VALUE,
                                  f"maps {size} bytes of a {memory_size}-byte allocation")
        self.gpu.map_at(va, memory)
        self._physical[va] = memory
        self._mapped[va] = size
        self._vmm_bases.add(va)

    def cuMemSetAccess(self, va: int, size: int, desc: int, count: int) -> None:
        """Records which devices may touch the mapping (`access`): a test can check that
        the GPUs of a world's other ranks were given it."""
        memory = self._physical.get(va)
        if memory is None or count < 1 or self._mapped.get(va) != size:
            raise FakeDriverError(CUDA_ERROR_INVALID_VALUE, "cuMemSetAccess: not one whole mapping")
        devices = set()
        for i in range(count):  # CUmemAccessDesc: location {type, id}, flags: 12 bytes each
            location, device, flags = (_get(desc + 12 * i + at, ctypes.c_int) for at in (0, 4, 8))
            device = self._real(device)
            known = 0 <= device < self.gpu.devices
            if location != _LOCATION_DEVICE or not known or flags != _ACCESS_READWRITE:
                raise FakeDriverError(CUDA_ERROR_INVALID_VALUE,
                                      f"access descriptor ({location}, {device}, {flags})")
            devices.add(device)
        if self._memory(memory)[2] not in devices:
            raise FakeDriverError(CUDA_ERROR_INVALID_VALUE, "the owning device itself gets no access")
        self.access[va] = devices

    def cuMemUnmap(self, va: int, size: int) -> None:
        if self._mapped.get(va) != size:  # cuda.h: "the entire contiguous address range that was mapped"
            raise FakeDriverError(CUDA_ERROR_INVALID_VALUE, f"[{va:#x}, +{size}) is not one whole mapping")
        del self._physical[va], self._mapped[va]
        self._vmm_bases.discard(va)
        self.gpu.release(Imported(va, size, 0, Origin.VMM))

    def cuMemRelease(self, handle: int) -> None:
        if self._handles.pop(handle, None) is None:
            raise FakeDriverError(CUDA_ERROR_INVALID_HANDLE, f"no allocation handle {handle:#x}")

    def cuStreamCreate(self, out: int, flags: int) -> None:
        _put(out, ctypes.c_uint64, self.gpu.stream_create(self._device()))

    def cuStreamDestroy(self, stream: int) -> None:
        self.gpu.stream_destroy(stream)

    def cuStreamSynchronize(self, stream: int) -> None:
        self._wait_streams([self._stream(stream)])

    def cuStreamWaitEvent(self, stream: int, event: int, flags: int) -> None:
        self.gpu.stream_wait_event(self._stream(stream), event)

    def cuEventCreate(self, out: int, flags: int) -> None:
        event = self.gpu.event_create(self._device())
        self._event_flags[event] = flags
        self._created_event_flags.append(flags)
        _put(out, ctypes.c_uint64, event)

    def cuEventDestroy(self, event: int) -> None:
        self._event_flags.pop(event, None)
        self.gpu.event_destroy(event)

    def cuEventRecord(self, event: int, stream: int) -> None:
        self.gpu.event_record(event, self._stream(stream))

    def cuEventSynchronize(self, event: int) -> None:
        self.gpu.event_wait(event, self._device())  # blocks: without the fake's lock

    def cuModuleLoadData(self, out: int, image: int) -> None:
        arch = "sm_{}{}".format(*self.compute_capability).encode()
        if ctypes.string_at(image, len(_CUBIN + arch)) != _CUBIN + arch:
            raise FakeDriverError(CUDA_ERROR_INVALID_VALUE, "not a cubin NVRTC made for this device")
        module = 0xF00 + len(self._modules)
        self._modules[module] = arch
        _put(out, ctypes.c_uint64, module)

    def cuModuleGetFunction(self, out: int, module: int, name: int) -> None:
        if module not in self._modules or ctypes.string_at(name) != b"commd_add_bf16":
            raise FakeDriverError(CUDA_ERROR_NOT_FOUND, f"no function {ctypes.string_at(name)!r}")
        _put(out, ctypes.c_uint64, _ADD_KERNEL)

    def cuLaunchKernel(self, function: int, gx: int, gy: int, gz: int, bx: int, by: int, bz: int,
                       shared: int, stream: int, params: int, extra: int) -> None:
        if function != _ADD_KERNEL or extra or not params or gy != 1 or gz != 1 or by != 1 or bz != 1:
            raise FakeDriverError(CUDA_ERROR_INVALID_VALUE, "cuLaunchKernel: not the add kernel's launch")
        slots = (ctypes.c_void_p * 3).from_address(params)  # each points at one argument's value
        if not all(slots):
            raise FakeDriverError(CUDA_ERROR_INVALID_VALUE, "a kernel argument slot is NULL")
        dst, src, count = (_get(int(slots[i] or 0), ctypes.c_uint64) for i in range(3))
        if gx * bx < 1:
            raise FakeDriverError(CUDA_ERROR_INVALID_VALUE, "an empty grid")
        self.gpu.add_bf16(dst, src, count, self._device(), self._stream(stream))

    # ---- NVRTC ------------------------------------------------------------------------
    # A "compile" checks the source and options and yields a marker the module load checks.
    def nvrtcGetErrorString(self, code: int, out: int, size: int) -> None:
        text = {0: "NVRTC_SUCCESS", 6: "NVRTC_ERROR_COMPILATION"}.get(code, f"NVRTC error {code}")
        self._text(text, out, size)

    def nvrtcCreateProgram(self, out: int, source: int, name: int, headers: int, contents: int,
                           names: int) -> None:
        self._programs[self._next_program] = [ctypes.string_at(source), b"", b""]
        _put(out, ctypes.c_uint64, self._next_program)
        self._next_program += 1

    def nvrtcCompileProgram(self, program: int, count: int, options: int) -> int:
        pointers = (ctypes.c_char_p * count).from_address(options) if count else []
        given = [ctypes.string_at(p) for p in pointers]
        source = self._programs[program][0]
        arch = "sm_{}{}".format(*self.compute_capability).encode()
        if self.compile_error is not None:
            self._programs[program][1] = self.compile_error
            return NVRTC_ERROR_COMPILATION
        if given != [b"--gpu-architecture=" + arch] or b"commd_add_bf16" not in source:
            self._programs[program][1] = f"unexpected options {given} or source".encode()
            return NVRTC_ERROR_COMPILATION
        self._programs[program][2] = _CUBIN + arch
        return 0

    def nvrtcGetProgramLogSize(self, program: int, out: int) -> None:
        _put(out, ctypes.c_size_t, len(self._programs[program][1]) + 1)

    def nvrtcGetProgramLog(self, program: int, out: int) -> None:
        log = self._programs[program][1] + b"\0"
        ctypes.memmove(out, log, len(log))

    def nvrtcGetCUBINSize(self, program: int, out: int) -> None:
        _put(out, ctypes.c_size_t, len(self._programs[program][2]))

    def nvrtcGetCUBIN(self, program: int, out: int) -> None:
        cubin = self._programs[program][2]
        ctypes.memmove(out, cubin, len(cubin))

    def nvrtcDestroyProgram(self, program: int) -> None:
        del self._programs[_get(program, ctypes.c_uint64)]

    # ---- NCCL -------------------------------------------------------------------------
    def ncclGetErrorString(self, code: int, out: int, size: int) -> None:
        self._text(_NCCL_NAMES.get(code, "unknown result code"), out, size)

    def ncclGetLastError(self, comm: int, out: int, size: int) -> None:
        """NCCL's last error of the whole process, whatever `comm` (its docs: "currently
        unused"), kept until the next: it may be about another call."""
        self._text(self._nccl_last_error, out, size)

    def ncclGetVersion(self, out: int) -> None:
        _put(out, ctypes.c_int, self.nccl_version)

    def ncclGetUniqueId(self, out: int) -> None:
        ctypes.memmove(out, self.gpu.unique_id(), 128)

    def ncclCommInitRankConfig(self, out: int, nranks: int, unique_id: int, rank: int, config: int) -> int:
        if not 0 <= _signed(rank) < _signed(nranks):
            raise FakeDriverError(NCCL_INVALID_ARGUMENT, f"Invalid rank requested : {_signed(rank)}/{nranks}")
        if not config:
            raise FakeDriverError(NCCL_INVALID_USAGE, "no config: the communicator would be blocking")
        magic, blocking = _get(config + 8, ctypes.c_uint), _get(config + 16, ctypes.c_int)
        if magic != _NCCL_CONFIG_MAGIC or blocking != 0:
            raise FakeDriverError(NCCL_INVALID_USAGE, f"config magic {magic:#x}, blocking {blocking}: "
                                                      "commd's communicators must be non-blocking")
        self.gpu.use_device(self._device())
        comm = self.gpu.comm_init(nranks, ctypes.string_at(unique_id, 128), rank, self._device())
        _put(out, ctypes.c_uint64, comm)
        return NCCL_IN_PROGRESS  # what a non-blocking init answers

    def ncclCommGetAsyncError(self, comm: int, out: int) -> None:
        from commd.engine.gpu import CommState

        state, why = self.gpu.comm_state(comm)
        if state is CommState.FAILED:
            self._nccl_last_error = why  # NCCL's WARN of the failure set it
        _put(out, ctypes.c_int, {CommState.READY: 0, CommState.IN_PROGRESS: NCCL_IN_PROGRESS,
                                 CommState.FAILED: NCCL_REMOTE_ERROR}[state])

    def ncclCommAbort(self, comm: int) -> None:
        self.gpu.comm_abort(comm)

    def ncclGroupStart(self) -> None:
        self.gpu.group_start()

    def ncclGroupEnd(self) -> int:
        self.gpu.group_end()
        return NCCL_IN_PROGRESS if self.gpu.enqueuing else 0  # as with non-blocking communicators

    def _comm_device_current(self, comm: int) -> None:
        if self.gpu.comm_device(comm) != self._device():
            raise FakeDriverError(NCCL_INVALID_USAGE, f"communicator of device {self.gpu.comm_device(comm)} "
                                                      f"used with device {self._device()} current")

    def ncclCommRegister(self, comm: int, ptr: int, size: int, out: int) -> None:
        self._comm_device_current(comm)
        _put(out, ctypes.c_uint64, self.gpu.comm_register(comm, ptr, size))

    def ncclCommDeregister(self, comm: int, handle: int) -> None:
        self._comm_device_current(comm)
        self.gpu.comm_deregister(comm, handle)

    def ncclMemAlloc(self, out: int, size: int) -> None:
        """cuMem memory exportable as an fd; with `nccl_cumem` off, cudaMalloc memory, as NCCL
        gives with NCCL_CUMEM_ENABLE=0 (or where cuMem is unsupported)."""
        rounded = -(-size // GRANULARITY) * GRANULARITY  # as NCCL rounds to the granularity
        memory = self.gpu.alloc(rounded, self._device()).ptr
        if self.nccl_cumem:
            self._vmm_bases.add(memory)
            self._physical[memory] = memory
            self._handle_props[memory] = _HANDLE_POSIX_FD
        self._nccl_memory.add(memory)
        _put(out, ctypes.c_uint64, memory)

    def ncclMemFree(self, ptr: int) -> None:
        if ptr not in self._nccl_memory:
            raise FakeDriverError(NCCL_INVALID_USAGE, f"{ptr:#x} is not from ncclMemAlloc")
        self._nccl_memory.discard(ptr)
        self._physical.pop(ptr, None)
        self.gpu.release(Imported(ptr, 0, 0, Origin.NCCL))

    def _nccl(self, launch: Callable[..., None], *args: Any) -> None:
        self.gpu.use_device(self._device())  # the fake device checks it against the communicator's
        launch(*args)

    def ncclAllReduce(self, send: int, recv: int, count: int, dtype: int, op: int, comm: int,
                      stream: int) -> None:
        self._nccl(self.gpu.all_reduce, send, recv, count, _NCCL_DTYPES[dtype], _NCCL_OPS[op], comm,
                   self._stream(stream))

    def ncclAllGather(self, send: int, recv: int, count: int, dtype: int, comm: int, stream: int) -> None:
        self._nccl(self.gpu.all_gather, send, recv, count, _NCCL_DTYPES[dtype], comm, self._stream(stream))

    def ncclReduceScatter(self, send: int, recv: int, count: int, dtype: int, op: int, comm: int,
                          stream: int) -> None:
        self._nccl(self.gpu.reduce_scatter, send, recv, count, _NCCL_DTYPES[dtype], _NCCL_OPS[op], comm,
                   self._stream(stream))

    def ncclBroadcast(self, send: int, recv: int, count: int, dtype: int, root: int, comm: int,
                      stream: int) -> None:
        self._nccl(self.gpu.broadcast, send, recv, count, _NCCL_DTYPES[dtype], _signed(root), comm,
                   self._stream(stream))

    def ncclSend(self, buf: int, count: int, dtype: int, peer: int, comm: int, stream: int) -> None:
        self._nccl(self.gpu.send, buf, count, _NCCL_DTYPES[dtype], _signed(peer), comm, self._stream(stream))

    def ncclRecv(self, buf: int, count: int, dtype: int, peer: int, comm: int, stream: int) -> None:
        self._nccl(self.gpu.recv, buf, count, _NCCL_DTYPES[dtype], _signed(peer), comm, self._stream(stream))


class _NoDevice:
    """What the libraries answer between tests: a driver that sees no GPU."""

    def dispatch(self, name: bytes, args: Any, nargs: int) -> int:
        if name == b"cuDeviceGetCount":
            _put(int(args[0]), ctypes.c_int, 0)
            return CUDA_SUCCESS
        if name in (b"cuGetErrorString", b"ncclGetErrorString", b"ncclGetLastError"):
            text = b"no device (tests/fakecuda's stand-in driver, loaded by an earlier test)\0"
            ctypes.memmove(int(args[1]), text, len(text))
            return CUDA_SUCCESS
        return CUDA_ERROR_NO_DEVICE


class FakeCuda:
    """The loaded libraries; `bind` a FakeGpu to answer through them."""

    def __init__(self, directory: Path, names: tuple[str, ...] = _LIBRARIES) -> None:
        """`names`: which of the libraries stand in (the others are then missing, unless
        the machine has them)."""
        self._libraries = [ctypes.CDLL(str(directory / name), mode=ctypes.RTLD_GLOBAL)
                           for name in names]
        self._target: Any = _NoDevice()
        self._callback = _DISPATCH(lambda name, args, nargs: self._target.dispatch(name, args, nargs))
        for library in self._libraries:
            library.commd_fake_set_dispatch(self._callback)

    def bind(self, gpu: FakeGpu, compute_capability: tuple[int, int] = (9, 0)) -> AbiDevice:
        device = AbiDevice(gpu, compute_capability)
        self._target = device
        return device

    def unbind(self) -> None:
        self._target = _NoDevice()


_loaded: FakeCuda | None = None
_load_lock = threading.Lock()


def load() -> FakeCuda:
    """Build (once per source version) and load the libraries, before cuda-bindings and
    nccl4py look for theirs. Raises RuntimeError naming what is missing, or when this
    machine has a real CUDA driver: loaded first, the fake would stand in for it in every
    later test of the process, the real-NCCL ones included."""
    global _loaded
    with _load_lock:
        if _loaded is None:
            try:
                ctypes.CDLL("libcuda.so.1")
            except OSError:
                pass
            else:
                raise RuntimeError("this machine has a real CUDA driver (libcuda.so.1), which the fake "
                                   "would shadow")
            _loaded = FakeCuda(build())
        return _loaded


def build() -> Path:
    source = _SOURCE.read_bytes()
    directory = Path(tempfile.gettempdir()) / f"commd-fakecuda-{hashlib.sha256(source).hexdigest()[:12]}"
    if all((directory / name).exists() for name in _LIBRARIES):
        return directory
    compiler = shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc")
    if compiler is None:
        raise RuntimeError("no C compiler to build the fake CUDA driver")
    building = Path(tempfile.mkdtemp(prefix="commd-fakecuda-"))
    for name in _LIBRARIES:
        subprocess.run([compiler, *COMPILE_FLAGS, f"-Wl,-soname,{name}", "-o", str(building / name),
                        str(_SOURCE)], check=True, capture_output=True, timeout=120)
    try:
        building.rename(directory)  # atomic: a concurrent build of the same source loses harmlessly
    except OSError:
        shutil.rmtree(building, ignore_errors=True)
    return directory


@contextlib.contextmanager
def bound(gpu: FakeGpu, compute_capability: tuple[int, int] = (9, 0)) -> Iterator[AbiDevice]:
    """The fake libraries answering from `gpu` for the block, for tests: skips without
    cuda-bindings, nccl4py or a C compiler; fails if the fake itself broke."""
    import pytest

    pytest.importorskip("cuda.bindings.driver", reason="the cuda13 (or cuda12) extra is not installed")
    pytest.importorskip("nccl.bindings.nccl", reason="nccl4py is not installed")
    try:
        libraries = load()
    except (RuntimeError, subprocess.SubprocessError) as exc:
        pytest.skip(f"cannot build the fake CUDA driver: {exc}")
    device = libraries.bind(gpu, compute_capability)
    try:
        yield device
    finally:
        libraries.unbind()
    assert not device.crashes, "the fake driver broke:\n" + "\n".join(device.crashes)
    assert not device.leaked_handles(), f"allocation handles never released: {device.leaked_handles()}"
