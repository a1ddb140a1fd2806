"""The one interface every engine implements (host today, NCCL next).

The daemon matches calls across ranks; an engine only runs fully matched ops on
memory it imported. Ops name buffers per rank (`dict[rank, Region]`) and hold
only the ranks local to this daemon, which is what a multi-node NCCL engine
needs too. Nothing outside `commd/engine/` imports CUDA or NCCL.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

from proto import DType, MemKind, ReduceOp

from ..errors import CallError


class Region(Protocol):
    """A bounds-checked window of imported memory (engine-specific)."""

    @property
    def nbytes(self) -> int: ...


class MemoryMapping(Protocol):
    """One imported (or daemon-allocated) allocation."""

    @property
    def size(self) -> int: ...

    def region(self, offset: int, nbytes: int) -> Region:
        """The window [offset, offset+nbytes); raises CallError(BAD_MEMORY) outside."""
        ...

    def close(self) -> None: ...


@dataclass(frozen=True, slots=True)
class AllReduceOp:
    bufs: Mapping[int, Region]
    dtype: DType
    op: ReduceOp


@dataclass(frozen=True, slots=True)
class AllGatherOp:
    sends: Mapping[int, Region]
    recvs: Mapping[int, Region]  # each world_size × the send size, in rank order


@dataclass(frozen=True, slots=True)
class ReduceScatterOp:
    sends: Mapping[int, Region]  # each world_size × the share
    recvs: Mapping[int, Region]
    dtype: DType
    op: ReduceOp


@dataclass(frozen=True, slots=True)
class BroadcastOp:
    bufs: Mapping[int, Region]
    root: int


@dataclass(frozen=True, slots=True)
class BarrierOp:
    ranks: Sequence[int]


@dataclass(frozen=True, slots=True)
class TransferOp:
    """A matched send/recv pair. On one node both sides are local."""

    src_rank: int
    src: Region
    dst_rank: int
    dst: Region


EngineOp = AllReduceOp | AllGatherOp | ReduceScatterOp | BroadcastOp | BarrierOp | TransferOp


def op_nbytes(op: EngineOp) -> int:
    """Bytes the op touches on one rank: decides whether it may run on the event loop."""
    if isinstance(op, TransferOp):
        return op.src.nbytes
    if isinstance(op, BarrierOp):
        return 0
    bufs = op.recvs if isinstance(op, AllGatherOp) else (
        op.sends if isinstance(op, ReduceScatterOp) else op.bufs
    )
    return max((r.nbytes for r in bufs.values()), default=0)


class Communicator(Protocol):
    """One world's communicator for one epoch, over the ranks local to this daemon."""

    def try_inline(self, op: EngineOp) -> bool:
        """Run a small op right now on the caller's thread and return True, or return
        False (nothing done) if it must go through `run`. Saves a task hop per small call."""
        ...

    async def run(self, op: EngineOp) -> None:
        """Run one matched op to completion; raises CallError on failure."""
        ...

    def abort(self) -> None:
        """Stop using the communicator; pending and later runs fail."""
        ...


class Engine(Protocol):
    name: str
    memory_kinds: frozenset[MemKind]

    def import_memory(self, kind: MemKind, size: int, handle: bytes, fd: int | None) -> MemoryMapping:
        """Open a worker's allocation; takes ownership of `fd`. CallError on refusal."""
        ...

    def allocate(self, nbytes: int) -> tuple[MemoryMapping, int]:
        """Allocate `nbytes` to share with a worker: the mapping and an fd to send it."""
        ...

    def communicator(self, world: str, epoch: int, world_size: int,
                     local_ranks: Sequence[int]) -> Communicator: ...

    def close(self) -> None: ...


__all__ = [
    "AllGatherOp", "AllReduceOp", "BarrierOp", "BroadcastOp", "CallError", "Communicator",
    "Engine", "EngineOp", "MemoryMapping", "ReduceScatterOp", "Region", "TransferOp",
    "op_nbytes",
]
