"""group_start ... group_end: each thread's calls between them, sent as one request."""

from __future__ import annotations

import dataclasses
import threading
import weakref
from collections.abc import Callable
from typing import NamedTuple

import proto

from .errors import MisuseError


class Basis(NamedTuple):
    """What a call's ops were built against: the daemon connection (Connection.link)
    and the world's epoch. Sent on another connection, they would name its buffers wrongly."""

    link: int
    epoch: int


@dataclasses.dataclass(slots=True)
class OpenGroup:
    """A thread's calls since its outermost group_start."""

    generation: int  # the Groups' at group_start (drop_all ends the group)
    basis: Basis  # at group_start
    depth: int = 0
    ops: list[proto.Op] = dataclasses.field(default_factory=list)
    pinned: list[int] = dataclasses.field(default_factory=list)  # the CUDA buffers they name
    # the streams its device calls follow (in order), and whether all may be answered once ordered
    streams: dict[int, None] = dataclasses.field(default_factory=dict)
    early: bool = True
    timed: bool = True  # False once it holds a call that waits without a deadline (recv_command_u32)

    def add(self, op: proto.Op, stream: int | None, early: bool, timed: bool = True,
            pinned: tuple[int, ...] = ()) -> None:
        """`stream`: the one a call on device memory follows (None: host memory). `pinned`:
        the buffers pinned for the op, unpinned once the group is sent or dropped."""
        if len(self.ops) >= proto.MAX_GROUP_OPS:
            raise MisuseError(f"a group holds at most {proto.MAX_GROUP_OPS} calls")
        self.ops.append(op)
        self.pinned.extend(pinned)
        self.timed &= timed
        if stream is not None:
            self.streams[stream] = None
            self.early &= early


class Groups:
    """Open groups per thread, as NCCL's are: another thread's call is never part of ours.
    A group a reconnect dropped is refused once, at the first group_start, call or group_end
    that meets it, and then forgotten: its calls, sent alone, would not be what the caller
    meant. `on_dropped(group)` hears of the refusal first: the thread met the end of the
    world of the group's epoch, and its pinned buffers are let go of.

    Groups are held here, by a token each thread keeps in its thread-locals, so that the
    group of a thread that ended inside it is found (`abandoned`: its locals, and the
    token, went with it): its pinned buffers would otherwise keep their Forgets, and the
    daemon the worker's memory, for the backend's life. (Not by `threading.current_thread()`:
    a thread `threading` did not start, native code calling in, is a `_DummyThread` that
    never ends and is handed to the next such thread with its id.)"""

    def __init__(self, on_dropped: Callable[[OpenGroup], None]) -> None:
        self._local = threading.local()
        self._open: dict[weakref.ref[_Token], OpenGroup] = {}
        self._generation = 0
        self._on_dropped = on_dropped

    def start(self, basis: Basis) -> None:
        group = self.current()
        if group is None:
            group = self._open[self._key()] = OpenGroup(self._generation, basis)
        group.depth += 1

    def end(self) -> OpenGroup | None:
        """The group to send once the outermost group_end closes it; None while nested."""
        group = self.current()
        if group is None:
            raise MisuseError("group_end without group_start")
        group.depth -= 1
        if group.depth:
            return None
        del self._open[self._key()]
        return group

    def any_open(self) -> bool:
        """Whether any thread's group is open (or was left open by a thread that ended)."""
        return bool(self._open)

    def current(self) -> OpenGroup | None:
        """This thread's open group."""
        if not self._open:  # (only this thread adds its own: none open here, the common case)
            return None
        key = self._key()
        group = self._open.get(key)
        if group is not None and group.generation != self._generation:
            del self._open[key]
            self._on_dropped(group)
            raise MisuseError("a reconnect ended this thread's group (its calls were for the world "
                              "before): make the calls again in a new group")
        return group

    def drop_all(self) -> None:
        """End every thread's open group (a reconnect: what they held was for the old world)."""
        self._generation += 1

    def abandoned(self) -> list[OpenGroup]:
        """The groups of threads that ended with them open, forgotten now: their calls
        will never be sent."""
        # (a copy: other threads add and remove their own groups meanwhile)
        ended = [key for key in list(self._open) if key() is None]
        return [group for key in ended if (group := self._open.pop(key, None)) is not None]

    def _key(self) -> weakref.ref[_Token]:
        """This thread's key (one ref per token: weakref.ref hands out the same one)."""
        token: _Token | None = getattr(self._local, "token", None)
        if token is None:
            token = self._local.token = _Token()
        return weakref.ref(token)


class _Token:
    """A thread's, held in its thread-locals alone: dead once the thread has ended."""

    __slots__ = ("__weakref__",)
