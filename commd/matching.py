"""Matching call k across ranks (DESIGN §5). Pure logic: no I/O, no engine.

Collectives match by their index among each rank's collectives; a non-root's
`recv_command_u32` is the same collective as the root's 4-byte broadcast.
Point-to-point calls match by their index per (sender, receiver) pair. Calls
that disagree raise `Mismatch`, whose message names both ranks and both calls.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

import proto

from . import ops

T = TypeVar("T")  # the caller's token for a call (the world's Arrival)


class Mismatch(Exception):
    """Matched calls disagree; `ranks` are the ranks involved."""

    def __init__(self, message: str, ranks: tuple[int, ...]) -> None:
        super().__init__(message)
        self.ranks = ranks


@dataclass(slots=True)  # not frozen: built per call, and frozen init costs ~1 µs
class Call(Generic[T]):
    rank: int
    op: proto.Op
    token: T


@dataclass(slots=True)
class CollectiveMatch(Generic[T]):
    index: int
    calls: dict[int, Call[T]]  # by rank, all world_size ranks

    @property
    def op(self) -> proto.Op:
        return next(iter(self.calls.values())).op


@dataclass(slots=True)
class P2PMatch(Generic[T]):
    index: int
    send: Call[T]
    recv: Call[T]


@dataclass(slots=True)
class RemoteP2P(Generic[T]):
    """A send or receive whose other side is on another daemon: the engine pairs it there."""

    index: int
    call: Call[T]


Match = CollectiveMatch[T] | P2PMatch[T] | RemoteP2P[T]


@dataclass
class Matcher(Generic[T]):
    """Matches the calls of the ranks on this daemon (`local_ranks`; all ranks when empty)."""

    world_size: int
    local_ranks: tuple[int, ...] = ()
    _coll_next: dict[int, int] = field(default_factory=dict, init=False)
    _coll: dict[int, dict[int, Call[T]]] = field(default_factory=dict, init=False)
    _coll_fingerprint: dict[int, tuple[object, ...]] = field(default_factory=dict, init=False)
    _p2p_next: dict[tuple[int, int, bool], int] = field(default_factory=dict, init=False)
    _p2p: dict[tuple[int, int, int], dict[bool, Call[T]]] = field(default_factory=dict, init=False)

    def __post_init__(self) -> None:
        # Empty local_ranks: every rank is here (kept implicit: worlds may be large).
        self._local = frozenset(self.local_ranks)
        self._local_count = len(self._local) or self.world_size

    def add(self, call: Call[T]) -> Match[T] | None:
        """Record one rank's call; return the match it completes, if any."""
        if ops.is_p2p(call.op):
            return self._add_p2p(call)
        return self._add_collective(call)

    def pending(self) -> list[Call[T]]:
        """Every call still waiting for its partners."""
        out = [c for group in self._coll.values() for c in group.values()]
        out += [c for pair in self._p2p.values() for c in pair.values()]
        return out

    def _add_collective(self, call: Call[T]) -> CollectiveMatch[T] | None:
        index = self._coll_next.get(call.rank, 0)
        self._coll_next[call.rank] = index + 1
        group = self._coll.get(index)
        if group is None:
            group = self._coll[index] = {}
            self._coll_fingerprint[index] = ops.fingerprint(call.op)
        elif ops.fingerprint(call.op) != self._coll_fingerprint[index]:
            _raise_mismatch(index, next(iter(group.values())), call, "collective")
        group[call.rank] = call
        if len(group) < self._local_count:
            return None
        del self._coll[index], self._coll_fingerprint[index]
        return CollectiveMatch(index, group)

    def _add_p2p(self, call: Call[T]) -> P2PMatch[T] | RemoteP2P[T] | None:
        is_send = isinstance(call.op, proto.Send)
        peer: int = call.op.peer  # type: ignore[union-attr]
        src, dst = (call.rank, peer) if is_send else (peer, call.rank)
        counter = (src, dst, is_send)
        index = self._p2p_next.get(counter, 0)
        self._p2p_next[counter] = index + 1
        if self._local and peer not in self._local:
            return RemoteP2P(index, call)
        pair = self._p2p.setdefault((src, dst, index), {})
        other = pair.get(not is_send)
        if other is not None and ops.fingerprint(other.op) != ops.fingerprint(call.op):
            _raise_mismatch(index, other, call, f"point-to-point {src}->{dst}")
        pair[is_send] = call
        if len(pair) < 2:
            return None
        del self._p2p[(src, dst, index)]
        return P2PMatch(index, pair[True], pair[False])


def _raise_mismatch(index: int, first: Call[Any], call: Call[Any], kind: str) -> None:
    raise Mismatch(
        f"mismatched {kind} call {index}: rank {first.rank} called {ops.describe(first.op)}, "
        f"rank {call.rank} called {ops.describe(call.op)}",
        (first.rank, call.rank),
    )
