"""The seam between the NCCL engine and CUDA/NCCL themselves (DESIGN §8).

`Gpu` is everything the engine asks of the driver and of NCCL, in plain ints and
bytes. `bindings.BindingsGpu` implements it over cuda-bindings and nccl4py, both
imported only when it is built, so the daemon runs without them. Tests drive the
engine through a fake `Gpu` that keeps "device memory" in host buffers, which lets
the engine's logic (bounds, grouping, completion, abort) run on machines without a
GPU.

Errors: every failed call raises `GpuError` with the call's name and the
driver's or NCCL's own text.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Protocol

from proto import DType, ReduceOp


class GpuError(Exception):
    """A CUDA or NCCL call failed."""


class Unshareable(GpuError):
    """alloc_shared's memory has no fd for a worker: `memory` is still allocated, and the
    caller lets it go as it lets go of any (its free may wait for the device)."""

    def __init__(self, message: str, memory: Imported) -> None:
        super().__init__(message)
        self.memory = memory


class CommState(enum.Enum):
    """A communicator's state, from ncclCommGetAsyncError."""

    READY = "ready"
    IN_PROGRESS = "in_progress"  # non-blocking init or op still being set up
    FAILED = "failed"


class Origin(enum.Enum):
    """How device memory came to the daemon, which decides how it is let go."""

    IPC = "ipc"  # a worker's cudaMalloc memory, opened by IPC handle
    VMM = "vmm"  # a worker's cuMem allocation, imported from its fd and mapped here
    NCCL = "nccl"  # ncclMemAlloc'd here (symmetric memory)
    PLAIN = "plain"  # cuMemAlloc'd here (the engine's own scratch)


@dataclass(frozen=True, slots=True)
class Imported:
    """Device memory the daemon holds: its pointer here, size, device, and origin.
    `context`: the device whose context opened it, where that is not `device` (an IPC
    handle of another GPU's memory, opened for a rank and then refused): the driver
    lets go of a mapping in the context that made it."""

    ptr: int
    size: int
    device: int
    origin: Origin
    context: int | None = None


class Gpu(Protocol):
    """What the NCCL engine needs; pointers, streams, events and comms are opaque ints."""

    def device_count(self) -> int: ...

    def nccl_version(self) -> int:
        """NCCL's version code (ncclGetVersion: 22803 is 2.28.3)."""
        ...

    def device_uuid(self, device: int) -> bytes:
        """The GPU's 16-byte CUDA UUID: the same whatever a process's CUDA_VISIBLE_DEVICES."""
        ...

    def broken(self) -> str | None:
        """The first sticky CUDA error seen (an illegal address, a failed launch: the
        process's context is unusable until it exits), or None."""
        ...

    # ---- memory ---------------------------------------------------------------------
    def ipc_open(self, handle: bytes, size: int, device: int) -> Imported:
        """Open a worker's cudaIpcMemHandle (64 bytes) in `device`'s context (where the
        rank's kernels run); GpuError if the allocation is smaller than `size`."""
        ...

    def vmm_import(self, fd: int, size: int) -> Imported:
        """Import a worker's VMM allocation (POSIX fd, not consumed) and map it here."""
        ...

    def release(self, memory: Imported) -> None: ...

    def alloc(self, nbytes: int, device: int) -> Imported:
        """Device memory for the engine's own use."""
        ...

    def alloc_shared(self, nbytes: int, device: int) -> tuple[Imported, int]:
        """Memory for symmetric_alloc (ncclMemAlloc) and a POSIX fd a worker can import;
        Unshareable if the memory has no such fd."""
        ...

    def copy_in(self, ptr: int, data: bytes) -> None:
        """Host to device, synchronous (tests and checks only, never on a call's path)."""
        ...

    def copy_out(self, ptr: int, nbytes: int) -> bytes: ...

    # ---- streams and events ---------------------------------------------------------
    def stream_create(self, device: int) -> int: ...

    def stream_destroy(self, stream: int) -> None: ...

    def event_create(self, device: int) -> int: ...

    def event_destroy(self, event: int) -> None: ...

    def event_record(self, event: int, stream: int) -> None: ...

    def event_open(self, handle: bytes, device: int) -> int:
        """A worker's interprocess event (64-byte cudaIpcEventHandle_t), opened in `device`'s
        context, the one its stream's work runs in."""
        ...

    def stream_wait_event(self, stream: int, event: int) -> None:
        """Work queued on `stream` from now on waits for `event`'s latest record."""
        ...

    def event_wait(self, event: int, device: int) -> None:
        """Block the calling thread (never the event loop's) until the event completed;
        `device` is the event's, made current on this (helper) thread first."""
        ...

    # ---- NCCL -----------------------------------------------------------------------
    def unique_id(self) -> bytes: ...

    def comm_init(self, world_size: int, unique_id: bytes, rank: int, device: int) -> int:
        """A non-blocking communicator (it can be aborted); call inside a group when one
        thread creates several."""
        ...

    def comm_state(self, comm: int) -> tuple[CommState, str]: ...

    def comm_abort(self, comm: int) -> None: ...

    def group_start(self) -> None: ...

    def comm_register(self, comm: int, ptr: int, nbytes: int) -> int:
        """ncclCommRegister: a handle, for comm_deregister."""
        ...

    def add_bf16(self, dst: int, src: int, count: int, device: int, stream: int) -> None:
        """dst[i] += src[i] over `count` bf16 values, rounded to nearest even, queued on
        `stream` (the daemon's own kernel, compiled with NVRTC: see prepare_add)."""
        ...

    def add_ready(self, device: int) -> bool:
        """Whether the add kernel is loaded for `device`."""
        ...

    def prepare_add(self, device: int, loading: Callable[[], AbstractContextManager[None]]) -> None:
        """Compile and load the add kernel for `device`: slow (NVRTC), so never on the
        event loop; safe from any thread. The module load (which may wait for the device)
        runs inside `loading()`."""
        ...

    def comm_deregister(self, comm: int, handle: int) -> None: ...

    def group_end(self) -> None: ...

    def use_device(self, device: int) -> None:
        """Make `device` current on this thread: NCCL launches on the current device."""
        ...

    def all_reduce(self, send: int, recv: int, count: int, dtype: DType, op: ReduceOp, comm: int,
                   stream: int) -> None: ...

    def all_gather(self, send: int, recv: int, count: int, dtype: DType, comm: int,
                   stream: int) -> None: ...

    def reduce_scatter(self, send: int, recv: int, count: int, dtype: DType, op: ReduceOp, comm: int,
                       stream: int) -> None: ...

    def broadcast(self, send: int, recv: int, count: int, dtype: DType, root: int, comm: int,
                  stream: int) -> None: ...

    def send(self, buf: int, count: int, dtype: DType, peer: int, comm: int, stream: int) -> None: ...

    def recv(self, buf: int, count: int, dtype: DType, peer: int, comm: int, stream: int) -> None: ...


MIN_NCCL_VERSION = 22700  # 2.27: a group job per non-blocking group (older ones share one per thread)


def load() -> Gpu:
    """The real thing, or GpuError saying what is missing (no bindings, no driver, no GPU,
    an NCCL too old: the engine has several non-blocking groups in progress at once, which
    NCCL before 2.27 cannot keep apart)."""
    from .bindings import BindingsGpu  # (it imports this module)

    gpu = BindingsGpu()
    if gpu.device_count() < 1:
        raise GpuError("the CUDA driver sees no GPU")
    version = gpu.nccl_version()
    if version < MIN_NCCL_VERSION:
        raise GpuError(f"NCCL {version // 10000}.{version // 100 % 100}.{version % 100} is older than 2.27")
    return gpu
