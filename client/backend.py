"""`CommBackend`: the seed's trait in Python, and `SingleGpuBackend`, its one-rank backend.

Same method names and argument order as the seed; `(ptr, bytes)` are a raw
address and a byte count. A `Result` error becomes a raised `CommError`.
Methods the seed gives a default keep that default here.
"""

from __future__ import annotations

import abc
import operator
import os
from typing import TypeVar

from proto import DType, ReduceOp

from .errors import CommError, MisuseError

DTypeLike = DType | str
OpLike = ReduceOp | str


E = TypeVar("E", DType, ReduceOp)


def _member(kind: type[E], what: str, value: E | str) -> E:
    if isinstance(value, kind):
        return value
    try:
        member = kind._value2member_map_.get(value)
    except TypeError:  # unhashable (a list, a dict): no member's value, and no CommError
        member = None
    if member is None:
        names = ", ".join(m.value for m in kind)
        raise MisuseError(f"{what} {value!r} is not one of {names}")
    return member  # type: ignore[return-value]


def as_dtype(value: DTypeLike) -> DType:
    # (a member already, the common case, without _member's call: an enum with members has
    # no subclasses, so `type(...) is` is isinstance here)
    return value if type(value) is DType else _member(DType, "dtype", value)


def as_op(value: OpLike) -> ReduceOp:
    return value if type(value) is ReduceOp else _member(ReduceOp, "op", value)


def as_ints(**values: object) -> tuple[int, ...]:
    """The arguments, in their order, as plain ints (numpy integers too: np.prod(shape) * 2
    is one); MisuseError for anything else. msgpack cannot pack numpy's, and the daemon
    drops a connection that sends a float where an integer goes."""
    ints = []
    for name, value in values.items():
        if type(value) is int:  # (the common case: a plain int is its own index)
            ints.append(value)
            continue
        try:
            if isinstance(value, bool):
                raise TypeError
            ints.append(int(operator.index(value)))  # type: ignore[arg-type]
        except TypeError:
            raise MisuseError(f"{name} must be an integer, got {type(value).__name__} {value!r}") from None
    return tuple(ints)


def check_stream(name: str, stream: int) -> None:
    """A CUstream is a pointer: one that cannot be one would be found wrong only by the
    driver, on a GPU (and on host memory never looked at)."""
    if not 0 <= stream < 1 << 64:
        raise MisuseError(f"{name}={stream} is not a CUDA stream handle")


# a timeout is a number of seconds a deadline adds to time.monotonic(), and milliseconds
# in the hello (u64): a year is beyond any use and far inside both
MAX_TIMEOUT_S = 365 * 86400.0


def as_seconds(**values: object) -> float:
    """The one argument, seconds in (0, MAX_TIMEOUT_S); MisuseError for anything else."""
    (name, value), = values.items()
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 < value < MAX_TIMEOUT_S:
        raise MisuseError(f"{name} must be seconds in (0, {MAX_TIMEOUT_S:g}), got {value!r}")
    return value


def as_path(**values: object) -> str:
    """The one argument, a path as text; MisuseError for anything else: connect() would cut a
    path at a NUL and reach whichever socket the prefix names."""
    (name, given), = values.items()
    try:
        path = os.fspath(given)  # type: ignore[call-overload]
    except TypeError:
        raise MisuseError(f"{name} must be a path, got {type(given).__name__} {given!r}") from None
    if not isinstance(path, str):
        raise MisuseError(f"{name} must be text, got {type(path).__name__} {path!r}")
    if not path or "\0" in path:
        raise MisuseError(f"{name} must be a non-empty path without NUL, got {path!r}")
    return path


class CommBackend(abc.ABC):
    """Collective and point-to-point communication among the ranks of one world."""

    @abc.abstractmethod
    def all_reduce(self, ptr: int, bytes: int, *, dtype: DTypeLike = DType.BF16,
                   op: OpLike = ReduceOp.SUM) -> None:
        """Reduce `bytes` at `ptr` across all ranks, in place; every rank gets the result.
        The seed reduces bf16 with sum."""

    @abc.abstractmethod
    def all_gather(self, send_ptr: int, recv_ptr: int, bytes: int) -> None:
        """Each rank contributes `bytes` from `send_ptr`; every rank receives all
        contributions, in rank order, at `recv_ptr`."""

    @abc.abstractmethod
    def reduce_scatter(self, send_ptr: int, recv_ptr: int, bytes: int, *,
                       dtype: DTypeLike = DType.U8, op: OpLike = ReduceOp.SUM) -> None:
        """Reduce across ranks and give each rank its `bytes`-sized share at `recv_ptr`.
        The seed sums u8 elements."""

    @abc.abstractmethod
    def broadcast(self, ptr: int, bytes: int, root: int) -> None:
        """Copy `bytes` at `ptr` from rank `root` to every rank, in place."""

    @abc.abstractmethod
    def barrier(self) -> None:
        """A barrier across ranks."""

    @abc.abstractmethod
    def send_to(self, ptr: int, bytes: int, dest_rank: int, stream: int = 0) -> None:
        """Send `bytes` at `ptr` to `dest_rank`; pairs with a same-size recv_from there."""

    @abc.abstractmethod
    def recv_from(self, ptr: int, bytes: int, src_rank: int, stream: int = 0) -> None:
        """Receive `bytes` into `ptr` from `src_rank`; pairs with a same-size send_to there."""

    @abc.abstractmethod
    def rank(self) -> int:
        """This rank's index, from 0."""

    @abc.abstractmethod
    def world_size(self) -> int:
        """Number of ranks."""

    def recv_command_u32(self, ptr: int, root: int) -> None:
        """On a non-root rank, receive the first u32 of the next command from `root`
        (the receive side of a 4-byte broadcast), without a deadline. Refuses root."""
        if root == self.rank():
            raise MisuseError(f"rank {root} is the root: recv_command_u32 refuses root")
        self.broadcast(ptr, 4, root)

    def all_reduce_async(self, ptr: int, bytes: int, compute_stream: int, *,
                         dtype: DTypeLike = DType.BF16, op: OpLike = ReduceOp.SUM) -> None:
        """All-reduce ordered against `compute_stream`; the default ignores the stream."""
        self.all_reduce(ptr, bytes, dtype=dtype, op=op)

    def register_buffer(self, ptr: int, bytes: int) -> int:
        """Register a buffer and return an opaque handle; the default registers nothing."""
        return 0

    @abc.abstractmethod
    def deregister_buffer(self, handle: int) -> None:
        """Deregister a handle from register_buffer."""

    def symmetric_alloc(self, bytes: int) -> int:
        """Allocate from the backend's allocator and return the pointer; the default refuses."""
        raise CommError(f"{type(self).__name__} has no symmetric allocator")

    def symmetric_free(self, ptr: int) -> None:
        """Free a pointer from symmetric_alloc; the default refuses."""
        raise CommError(f"{type(self).__name__} has no symmetric allocator")

    @abc.abstractmethod
    def set_add_kernel(self, handle: int) -> None:
        """Hand the backend the bf16_add_inplace kernel handle."""

    def group_start(self) -> None:
        """Open a group: calls up to group_end are submitted together. Default: nothing."""

    def group_end(self) -> None:
        """Close the group opened by group_start. Default: nothing."""

    def is_healthy(self) -> bool:
        """False once the world failed (a transport error, a completion timeout, a mismatch,
        a lost rank), until a successful attempt_reconnect. Default: true."""
        return True

    def attempt_reconnect(self) -> None:
        """Replace a failed communicator; every rank calls this at the same time.
        Default: nothing."""


class SingleGpuBackend(CommBackend):
    """One rank: every collective and point-to-point call succeeds doing nothing;
    rank is 0 and world_size is 1."""

    def all_reduce(self, ptr: int, bytes: int, *, dtype: DTypeLike = DType.BF16,
                   op: OpLike = ReduceOp.SUM) -> None:
        pass

    def all_gather(self, send_ptr: int, recv_ptr: int, bytes: int) -> None:
        pass

    def reduce_scatter(self, send_ptr: int, recv_ptr: int, bytes: int, *,
                       dtype: DTypeLike = DType.U8, op: OpLike = ReduceOp.SUM) -> None:
        pass

    def broadcast(self, ptr: int, bytes: int, root: int) -> None:
        pass

    def barrier(self) -> None:
        pass

    def send_to(self, ptr: int, bytes: int, dest_rank: int, stream: int = 0) -> None:
        pass

    def recv_from(self, ptr: int, bytes: int, src_rank: int, stream: int = 0) -> None:
        pass

    def rank(self) -> int:
        return 0

    def world_size(self) -> int:
        return 1

    def deregister_buffer(self, handle: int) -> None:
        pass

    def set_add_kernel(self, handle: int) -> None:
        pass
