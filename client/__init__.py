"""commd's client: the `CommBackend` interface and the backends workers import.

    from client import DaemonBackend, hostmem
    with DaemonBackend("/run/commd/commd.sock", "tp0", rank, 4) as comm:
        buf = hostmem.alloc(1 << 20)
        comm.all_reduce(buf.ptr, buf.nbytes)          # bf16 sum, in place
"""

from . import hostmem
from .backend import CommBackend, SingleGpuBackend
from .daemon import DaemonBackend
from .errors import (
    AccessDenied,
    CommError,
    CommTimeout,
    DaemonInternalError,
    DaemonShutdown,
    DaemonUnavailable,
    EngineError,
    LimitExceeded,
    MismatchError,
    MisuseError,
    PeerLost,
    ProtocolError,
    WorldFailed,
)
from .hostmem import HostBuffer, HostMemory

__all__ = [
    "AccessDenied", "CommBackend", "CommError", "CommTimeout", "DaemonBackend",
    "DaemonInternalError", "DaemonShutdown", "DaemonUnavailable", "EngineError", "HostBuffer", "HostMemory",
    "LimitExceeded", "MismatchError", "MisuseError", "PeerLost", "ProtocolError", "SingleGpuBackend",
    "WorldFailed", "hostmem",
]
