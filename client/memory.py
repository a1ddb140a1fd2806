"""Turning a worker's (pointer, bytes) into something the daemon can open (DESIGN §4).

`resolve` is the one place that knows memory kinds. Host memory today; the
cuda-ipc and cuda-vmm kinds of the GPU engine plug in here.
"""

from __future__ import annotations

from dataclasses import dataclass

from proto import MemKind

from .hostmem import HostMemory


@dataclass(frozen=True, slots=True)
class MemoryRef:
    """Where a span lives: an allocation (id, kind, size, how to open it) and an offset."""

    kind: MemKind
    buffer_id: int
    size: int
    offset: int
    fd: int | None  # sent beside the first Import; the backend keeps it open
    handle: bytes = b""


def resolve(memory: HostMemory, ptr: int, nbytes: int) -> MemoryRef | None:
    """The allocation holding [ptr, ptr+nbytes), or None for an empty span.

    Raises MisuseError for a pointer the daemon could not open or a span that
    runs past its allocation.
    """
    if nbytes == 0:
        return None
    buffer, offset = memory.find(ptr, nbytes)
    return MemoryRef(MemKind.HOST, buffer.id, buffer.size, offset, buffer.fd)
