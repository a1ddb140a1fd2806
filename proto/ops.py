"""Ops: what a rank asks its world to do, and the places in its buffers they name (`Mem`).

Ops travel inside a `Submit` (messages.py); one op is a plain call, several are a
`group_start`/`group_end` batch. Like the messages, they validate themselves.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from .errors import InvalidMessage
from .fields import check_positive, check_rank, check_u64
from .types import DType, ReduceOp


@dataclass(frozen=True, slots=True)
class Mem:
    """A place in an imported buffer: the buffer's id and a byte offset into it."""

    buf: int
    offset: int

    def __post_init__(self) -> None:
        check_positive("buf", self.buf)
        check_u64("offset", self.offset)


def _sized(name: str, mem: Mem | None, nbytes: int, itemsize: int = 1) -> None:
    check_u64("nbytes", nbytes)
    if nbytes % itemsize:
        raise InvalidMessage(f"nbytes={nbytes} is not a multiple of the element size {itemsize}")
    if nbytes and mem is None:
        raise InvalidMessage(f"{name} is required when nbytes > 0")


@dataclass(frozen=True, slots=True)
class AllReduce:
    buf: Mem | None
    nbytes: int
    dtype: DType = DType.BF16
    op: ReduceOp = ReduceOp.SUM

    def __post_init__(self) -> None:
        _sized("buf", self.buf, self.nbytes, self.dtype.itemsize)


@dataclass(frozen=True, slots=True)
class AllGather:
    """`nbytes` is each rank's contribution; `recv` holds world_size × nbytes."""

    send: Mem | None
    recv: Mem | None
    nbytes: int

    def __post_init__(self) -> None:
        _sized("send", self.send, self.nbytes)
        _sized("recv", self.recv, self.nbytes)


@dataclass(frozen=True, slots=True)
class ReduceScatter:
    """`nbytes` is each rank's share; `send` holds world_size × nbytes."""

    send: Mem | None
    recv: Mem | None
    nbytes: int
    dtype: DType = DType.U8
    op: ReduceOp = ReduceOp.SUM

    def __post_init__(self) -> None:
        _sized("send", self.send, self.nbytes, self.dtype.itemsize)
        _sized("recv", self.recv, self.nbytes, self.dtype.itemsize)


@dataclass(frozen=True, slots=True)
class Broadcast:
    """`command` marks a non-root's `recv_command_u32`: the same collective, no deadline."""

    buf: Mem | None
    nbytes: int
    root: int
    command: bool = False

    def __post_init__(self) -> None:
        _sized("buf", self.buf, self.nbytes)
        check_rank("root", self.root)
        if self.command and self.nbytes != 4:
            raise InvalidMessage("a command broadcast carries exactly 4 bytes")


@dataclass(frozen=True, slots=True)
class Barrier:
    pass


@dataclass(frozen=True, slots=True)
class _PointToPoint:
    """A send's or a receive's fields and checks (the two differ only in direction; a Send
    never equals a Recv: a dataclass compares its class too)."""

    buf: Mem | None
    nbytes: int
    peer: int
    stream: int = 0

    def __post_init__(self) -> None:
        _sized("buf", self.buf, self.nbytes)
        check_rank("peer", self.peer)
        check_u64("stream", self.stream)


@dataclass(frozen=True, slots=True)
class Send(_PointToPoint):
    pass


@dataclass(frozen=True, slots=True)
class Recv(_PointToPoint):
    pass


Op = AllReduce | AllGather | ReduceScatter | Broadcast | Barrier | Send | Recv
OP_TYPES: tuple[type, ...] = (AllReduce, AllGather, ReduceScatter, Broadcast, Barrier, Send, Recv)


def mems_of(op: Op) -> Iterator[Mem]:
    """The memory an op names."""
    for field in dataclasses.fields(op):
        value = getattr(op, field.name)
        if isinstance(value, Mem):
            yield value


def with_mems(op: Op, change: Callable[[Mem], Mem]) -> Op:
    """`op` naming `change(mem)` for each memory it names."""
    original: Any = op  # (mypy cannot type a replace over the union of ops)
    changed: Op = dataclasses.replace(original, **{
        field.name: change(value) for field in dataclasses.fields(op)
        if isinstance(value := getattr(op, field.name), Mem)})
    return changed
