"""What each op means to the daemon: its memory spans, rank checks, fingerprint, engine form.

One table per concern, keyed by the op's type, so the matcher and the world
never dispatch on op names.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import proto
from proto import ErrorCode

from .engine.base import (
    NO_TAG,
    AllGatherOp,
    AllReduceOp,
    BarrierOp,
    BroadcastOp,
    CallTag,
    EngineOp,
    ReduceScatterOp,
    Region,
)
from .errors import CallError

Span = tuple[proto.Mem | None, int]


def spans(op: proto.Op, world_size: int) -> tuple[Span, ...]:
    """The (place, bytes) windows of worker memory the op reads or writes, in a fixed order."""
    if isinstance(op, proto.AllGather):
        return ((op.send, op.nbytes), (op.recv, op.nbytes * world_size))
    if isinstance(op, proto.ReduceScatter):
        return ((op.send, op.nbytes * world_size), (op.recv, op.nbytes))
    if isinstance(op, proto.Barrier):
        return ()
    return ((op.buf, op.nbytes),)


_RANK_FIELDS: dict[type, str] = {proto.Broadcast: "root", proto.Send: "peer", proto.Recv: "peer"}


def check_ranks(op: proto.Op, rank: int, world_size: int) -> None:
    """Refuse a root or peer outside the world, and a root asking for its own command."""
    name = _RANK_FIELDS.get(type(op))
    if name is None:
        return
    value: int = getattr(op, name)
    if value >= world_size:
        raise CallError(ErrorCode.BAD_RANK, f"{name}={value} is not a rank of a {world_size}-rank world")
    if name == "root" and op.command and value == rank:  # type: ignore[union-attr]
        raise CallError(ErrorCode.MISUSE, f"rank {rank} is the root: recv_command_u32 refuses root")


def check_overlap(op: proto.Op, rank: int, world_size: int) -> None:
    """Refuse an all_gather or reduce_scatter whose send and receive memory overlap other
    than in place (NCCL's rule: the rank's own block of the whole buffer is the other
    one): the op would read what it had already written (wrong data, no error)."""
    if not isinstance(op, proto.AllGather | proto.ReduceScatter) or op.send is None or op.recv is None:
        return
    (send, send_bytes), (recv, recv_bytes) = spans(op, world_size)
    assert send is not None and recv is not None
    if send.buf != recv.buf or send.offset + send_bytes <= recv.offset \
            or recv.offset + recv_bytes <= send.offset:
        return
    whole, block = (recv, send) if isinstance(op, proto.AllGather) else (send, recv)
    if block.offset != whole.offset + rank * op.nbytes:
        raise CallError(ErrorCode.MISUSE, f"{call_name(op)}: send and receive memory overlap; in "
                                          f"place, rank {rank}'s block starts {rank * op.nbytes} bytes "
                                          f"into the {world_size * op.nbytes}-byte buffer")


def writes(op: proto.Op, rank: int) -> tuple[bool, ...]:
    """For each of the op's `spans`, whether `rank`'s call writes it (else only reads it)."""
    if isinstance(op, proto.AllGather | proto.ReduceScatter):
        return (False, True)
    if isinstance(op, proto.Broadcast):
        return (op.root != rank,)
    if isinstance(op, proto.Barrier):
        return ()
    return (isinstance(op, proto.AllReduce | proto.Recv),)


def check_group_overlap(group: Sequence[proto.Op], rank: int, world_size: int) -> None:
    """Refuse a group where a call writes memory another of its calls uses, unless both are
    collectives: a group's point-to-point calls run as their peers' calls come, in no fixed
    order with each other or with its collectives (those run in the group's order), so the
    data would hang on which rank called last (wrong data, no error; NCCL's group alike)."""
    places: dict[int, list[tuple[int, int, int, bool]]] = {}  # buffer -> (start, end, call, writes)
    for index, op in enumerate(group):
        for (mem, nbytes), written in zip(spans(op, world_size), writes(op, rank), strict=True):
            if mem is not None and nbytes:
                places.setdefault(mem.buf, []).append((mem.offset, mem.offset + nbytes, index, written))
    for spans_in_buffer in places.values():
        # in order of start: a span overlaps an earlier one where it starts before that one
        # ends; of each kind of earlier span, (point-to-point, writes), the furthest end so far
        reach: dict[tuple[bool, bool], tuple[int, int]] = {}  # kind -> (end, call)
        for start, end, index, written in sorted(spans_in_buffer):
            p2p = is_p2p(group[index])
            for (other_p2p, other_writes), (other_end, other) in reach.items():
                if start < other_end and (written or other_writes) and (p2p or other_p2p):
                    writer, user = (index, other) if written else (other, index)
                    verb = "receives into" if isinstance(group[writer], proto.Recv) else "writes"
                    raise CallError(ErrorCode.MISUSE, f"group_end: call #{writer} of the group, "
                                                      f"{describe(group[writer])}, {verb} memory that "
                                                      f"call #{user}, {describe(group[user])}, uses: "
                                                      f"they run together")
            kind = (p2p, written)
            if kind not in reach or end > reach[kind][0]:
                reach[kind] = (end, index)


def waits_forever(op: proto.Op) -> bool:
    """recv_command_u32 waits for the next command with no deadline (the seed's rule)."""
    return isinstance(op, proto.Broadcast) and op.command


def is_p2p(op: proto.Op) -> bool:
    return isinstance(op, (proto.Send, proto.Recv))


def nbytes(op: proto.Op) -> int:
    return 0 if isinstance(op, proto.Barrier) else op.nbytes


_FINGERPRINT: dict[type, Callable[[Any], tuple[Any, ...]]] = {
    proto.AllReduce: lambda o: ("all_reduce", o.nbytes, o.dtype, o.op),
    proto.AllGather: lambda o: ("all_gather", o.nbytes),
    proto.ReduceScatter: lambda o: ("reduce_scatter", o.nbytes, o.dtype, o.op),
    proto.Broadcast: lambda o: ("broadcast", o.nbytes, o.root),  # a command is a broadcast
    proto.Barrier: lambda o: ("barrier",),
    proto.Send: lambda o: ("p2p", o.nbytes),
    proto.Recv: lambda o: ("p2p", o.nbytes),
}


def fingerprint(op: proto.Op) -> tuple[Any, ...]:
    """What matched calls must agree on (op, bytes, dtype, reduction, root)."""
    return _FINGERPRINT[type(op)](op)


_NAMES = {
    proto.AllReduce: "all_reduce", proto.AllGather: "all_gather",
    proto.ReduceScatter: "reduce_scatter", proto.Broadcast: "broadcast",
    proto.Barrier: "barrier", proto.Send: "send_to", proto.Recv: "recv_from",
}


def call_name(op: proto.Op) -> str:
    """The CommBackend method that made the call (a command is a broadcast that waits)."""
    return "recv_command_u32" if waits_forever(op) else _NAMES[type(op)]


def describe(op: proto.Op, canonical: bool = False) -> str:
    """A call as a user wrote it, for error messages: `all_reduce(bytes=8, dtype=bf16, op=sum)`.

    `canonical` names a command a broadcast and drops the peer: the form daemons compare
    (it holds exactly what `fingerprint` holds)."""
    name = _NAMES[type(op)] if canonical else call_name(op)
    args = []
    fields = ("nbytes", "dtype", "op", "root") + (() if canonical else ("peer",))
    for field in fields:
        value = getattr(op, field, None)
        if value is not None:
            label = "bytes" if field == "nbytes" else field
            args.append(f"{label}={getattr(value, 'value', value)}")
    return f"{name}({', '.join(args)})"


def _present(region: Region | None) -> Region:
    if region is None:
        raise CallError(ErrorCode.INTERNAL, "a non-empty op is missing its memory")
    return region


def to_engine(op: proto.Op, regions: Mapping[int, tuple[Region | None, ...]],
              tag: CallTag = NO_TAG) -> EngineOp:
    """The engine op for a complete, non-empty collective match; `regions[rank]` follows `spans`."""
    if isinstance(op, proto.Barrier):
        return BarrierOp(tuple(sorted(regions)), tag)
    regions = dict(sorted(regions.items()))  # rank order: float sums depend on it
    first = {rank: _present(r[0]) for rank, r in regions.items()}
    if isinstance(op, proto.AllReduce):
        return AllReduceOp(first, op.dtype, op.op, tag)
    if isinstance(op, proto.AllGather):
        return AllGatherOp(first, {rank: _present(r[1]) for rank, r in regions.items()}, tag)
    if isinstance(op, proto.ReduceScatter):
        second = {rank: _present(r[1]) for rank, r in regions.items()}
        return ReduceScatterOp(first, second, op.dtype, op.op, tag)
    if isinstance(op, proto.Broadcast):
        return BroadcastOp(first, op.root, tag)
    raise CallError(ErrorCode.INTERNAL, f"{type(op).__name__} is not a collective")
