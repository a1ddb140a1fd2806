"""Value types shared by messages: element types, reductions, memory kinds."""

from __future__ import annotations

import enum


class DType(enum.Enum):
    """Element types of reducing calls. The value is the wire name."""

    __hash__ = object.__hash__  # members are singletons; Enum hashes the name in Python

    BF16 = "bf16"
    F16 = "f16"
    F32 = "f32"
    F64 = "f64"
    I32 = "i32"
    I64 = "i64"
    U8 = "u8"

    @property
    def itemsize(self) -> int:
        return _ITEMSIZE[self]


_ITEMSIZE = {
    DType.BF16: 2,
    DType.F16: 2,
    DType.F32: 4,
    DType.F64: 8,
    DType.I32: 4,
    DType.I64: 8,
    DType.U8: 1,
}


class ReduceOp(enum.Enum):
    __hash__ = object.__hash__  # members are singletons; Enum hashes the name in Python

    SUM = "sum"
    PROD = "prod"
    MIN = "min"
    MAX = "max"


class MemKind(enum.Enum):
    """How a worker's memory is handed to the daemon (DESIGN §4)."""

    __hash__ = object.__hash__  # members are singletons; Enum hashes the name in Python

    HOST = "host"  # memfd, fd by SCM_RIGHTS; mmap in the daemon
    CUDA_IPC = "cuda-ipc"  # 64-byte cudaIpcMemHandle_t bytes
    CUDA_VMM = "cuda-vmm"  # POSIX fd from cuMemExportToShareableHandle

    @property
    def carries_fd(self) -> bool:
        return self is not MemKind.CUDA_IPC


class EventKind(enum.Enum):
    """Notifications the daemon pushes without a request."""

    __hash__ = object.__hash__  # members are singletons; Enum hashes the name in Python

    WORLD_FAILED = "world_failed"
    SHUTDOWN = "shutdown"
