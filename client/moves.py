"""Host buffers moved off memory a daemon may still write (README "Deadlines").

A call sent and left unanswered (given up on, its connection lost, interrupted) may still
be run by its daemon, which then writes the worker's buffers after the worker heard the
error. `Moves.detach` moves each host buffer of such a call onto fresh memory at the same
address (HostBuffer.detach): at once, or, if another call in flight names it too (another
thread's, another world's), once that call ends, so that what that call's daemon writes
still reaches the worker. A call about to be sent names each buffer that moved since its
ops were built by its new id (`moved`), and waits for a move under way.
"""

from __future__ import annotations

import functools
import threading
import time
import weakref
from collections.abc import Callable, Collection
from typing import TYPE_CHECKING, TypeVar

import proto

from .errors import CommTimeout, LimitExceeded

if TYPE_CHECKING:
    from .hostmem import HostBuffer

# How long a lost call waits for another thread's move of a buffer it names (a copy and a
# remap of memory here: long only for many GiB on a loaded machine)
_MOVE_WAIT_S = 60.0

Names = Callable[[], Collection[int]]
_T = TypeVar("_T")


class Moves:
    """One host table's moves. `lock` is the table's, `live(ids)` its live buffers among
    those ids."""

    def __init__(self, lock: threading.RLock, live: Callable[[Collection[int]], list[HostBuffer]]) -> None:
        self._live = live
        self.in_forked_child(lock)
        # A moved buffer by each id it had before: an op built before the move names the
        # memory by one of those (see moved); gone with the buffer
        self._moved_from: weakref.WeakValueDictionary[int, HostBuffer] = weakref.WeakValueDictionary()
        # A buffer a lost call's daemon may still write that could not be moved (out of memory
        # or files), with why: the next call naming it is refused (see moved). Why in words:
        # the error's traceback holds the buffer, which would then never be freed
        self._unmoved: weakref.WeakKeyDictionary[HostBuffer, str] = weakref.WeakKeyDictionary()

    def in_forked_child(self, lock: threading.RLock) -> None:
        """(And at the start) No call in flight, no move under way: a fork's child has none
        of the parent's threads (the table's fresh lock is `lock`)."""
        self._lock = lock
        # The calls in flight (from before their request is sent until they end), each with
        # how to list the buffer ids it names: asked only when a buffer is to move (detach)
        self._calls: dict[object, Names] = {}
        self._to_move: set[int] = set()  # buffers to move once no call in flight names them
        self._leaving: set[int] = set()  # ids of buffers moving now (decided, not done)
        self._settled = threading.Condition(lock)  # notified as moves end

    def record(self, old_id: int, buffer: HostBuffer) -> None:
        """`buffer` moved off its id `old_id`."""
        with self._lock:
            self._moved_from[old_id] = buffer

    def moved(self, names: Names, due: float) -> dict[int, HostBuffer]:
        """Those of the ids `names()` lists whose buffers moved since (see HostBuffer.detach),
        each with its buffer, live under a new id; one moving now is waited for, by `due`.
        (For a call in flight, see `calling`: no buffer it names starts to move after.)
        LimitExceeded if one could not be moved: the call must not go, and the buffer is
        tried again as the call ends."""
        if not (self._leaving or self._moved_from or self._unmoved):  # (the common case: none lost)
            return {}
        buffer_ids = names()
        with self._lock:
            if not self._settled.wait_for(lambda: self._leaving.isdisjoint(buffer_ids),
                                          max(0.0, due - time.monotonic())):
                raise CommTimeout("the call's deadline passed while a buffer it names moved "
                                  "off memory a daemon may still write")
            if self._unmoved:  # (its walk costs a call 1 us)
                self._refuse_unmoved(buffer_ids)
            found = {buffer_id: self._moved_from.get(buffer_id) for buffer_id in buffer_ids}
        return {buffer_id: buffer for buffer_id, buffer in found.items()
                if buffer is not None and not buffer.closed and buffer.id != buffer_id}

    def _refuse_unmoved(self, buffer_ids: Collection[int]) -> None:
        """(Under the lock) LimitExceeded if a buffer of `buffer_ids` could not be moved: a
        lost call's daemon may have written it since, and may still. Told once: it moves
        once no call in flight names it (this one ends, not sent)."""
        unmoved = [(buffer, why) for buffer, why in self._unmoved.items()
                   if buffer.id in buffer_ids and not buffer.closed]
        if not unmoved:
            return
        for buffer, _why in unmoved:
            del self._unmoved[buffer]
            self._to_move.add(buffer.id)
        raise LimitExceeded("; ".join(
            f"host buffer {buffer.id} could not be moved off the memory a daemon may still "
            f"write for a call left unanswered ({why}): what it holds may be that daemon's"
            for buffer, why in unmoved) + "; this call was not sent, and the buffer moves as "
            "it ends: write it again, then make the call again")

    def calling(self, call: object, names: Names) -> None:
        """`call` (a token), naming the buffers `names()` lists, may be sent from now until
        `called(call)`: a buffer it names that another call's failure moves waits for it to
        end (what its daemon writes meanwhile must reach the worker)."""
        with self._lock:
            self._calls[call] = names

    def called(self, call: object) -> None:
        """`call` ended, answered or not: the buffers that waited for it alone move now."""
        # (cut short, the call would stay in flight for good, and the buffers waiting for it
        # where the lost call's daemon writes)
        despite_interrupts(functools.partial(self._end, call))  # (no lambda's frame: every call ends here)

    def _end(self, call: object) -> None:
        free: set[int] = set()  # waiting buffers no call in flight names any more
        try:
            with self._lock:
                self._calls.pop(call, None)
                if not self._to_move:
                    return
                free = self._to_move - self._named() - self._leaving
                self._to_move -= free
                self._leaving |= free
        finally:
            if free:  # (one that cannot move stays: the next call naming it is told)
                self._move(free)

    def detach(self, buffer_ids: Collection[int],
               call: object = None) -> tuple[dict[int, Exception], set[int]]:
        """Detach the live buffers of `buffer_ids`, named by `call` (see HostBuffer.detach):
        those that could not be (out of memory or files), by id, with why; and those that
        another call in flight names too, which move once it ends (see `calling`)."""
        # (cut short, the buffers would stay where the lost call's daemon writes)
        return despite_interrupts(lambda: self._detach(buffer_ids, call))

    def _detach(self, buffer_ids: Collection[int],
                call: object) -> tuple[dict[int, Exception], set[int]]:
        mine: set[int] = set()
        try:
            with self._lock:
                live = {buffer.id for buffer in self._live(buffer_ids)}
                waiting = live & self._named(but=call)
                self._to_move |= waiting
                elsewhere = (live - waiting) & self._leaving  # (another thread's lost call moves them)
                mine = live - waiting - elsewhere
                self._leaving |= mine  # (a call sent from now on waits for these: see moved)
        finally:
            failed = self._move(mine)
        with self._lock:  # (before the caller, told they moved, writes them)
            if not self._settled.wait_for(lambda: self._leaving.isdisjoint(elsewhere), _MOVE_WAIT_S):
                failed.update(dict.fromkeys(elsewhere & self._leaving, TimeoutError(
                    f"another thread's move of it did not end within {_MOVE_WAIT_S:g}s")))
        return failed, waiting

    def _named(self, but: object = None) -> set[int]:
        """(Under the lock) the buffer ids the calls in flight name, but `but`'s."""
        return {buffer_id for call, names in self._calls.items() if call is not but
                for buffer_id in names()}

    def _move(self, buffer_ids: Collection[int]) -> dict[int, Exception]:
        """Move the buffers of `buffer_ids` (among those _leaving): those that could not be."""
        if not buffer_ids:
            return {}
        failed: dict[int, Exception] = {}
        interrupted: list[BaseException] = []
        try:
            for buffer in self._live(buffer_ids):
                old = buffer.id
                try:
                    buffer.detach()
                except (OSError, ValueError) as exc:
                    failed[old] = exc
                    self._not_moved(buffer, str(exc))
                except BaseException as exc:  # (an interrupt: the others move all the same)
                    interrupted.append(exc)
                    if buffer.id == old and not buffer.closed:  # (its move, done again, failed)
                        self._not_moved(buffer, "interrupted, and failed when done again")
        finally:
            # (cut short, they would stay _leaving, and every call naming them wait for them)
            despite_interrupts(lambda: self._settle(buffer_ids))
        if interrupted:
            raise interrupted[0]
        return failed

    def _not_moved(self, buffer: HostBuffer, why: str) -> None:
        with self._lock:
            self._unmoved[buffer] = why

    def _settle(self, buffer_ids: Collection[int]) -> None:
        with self._lock:
            self._leaving -= set(buffer_ids)
            self._settled.notify_all()


def despite_interrupts(step: Callable[[], _T]) -> _T:
    """`step()`, done whole: an interrupt (a BaseException that is no Exception: Ctrl-C,
    landing as a lock is waited for or a long call returns) that cuts it short has it done
    again before it goes on. For steps that may be done twice. If the step fails when
    done again, the interrupt still goes on (a note says why), not the failure: the caller
    tells a step undone by its effect."""
    try:
        return step()
    except BaseException as exc:
        if isinstance(exc, Exception):
            raise
        try:
            step()
        except Exception as again:
            exc.add_note(f"done again after the interrupt, it failed: {again!r}")
        raise


class InFlight:
    """A call from before its request is sent until it ends (a context: `Moves.calling`
    to `called`): its ops, renamed if a buffer they name moved first."""

    __slots__ = ("_moves", "ops")

    def __init__(self, moves: Moves, ops: tuple[proto.Op, ...]) -> None:
        self._moves = moves
        self.ops = ops

    def __enter__(self) -> InFlight:
        try:
            self._moves.calling(self, self.names)
        except BaseException:
            # (an interrupt as the table's lock is left, the call recorded: a `with` runs no
            # exit for an enter that raised, and the call would stay in flight for good)
            self._moves.called(self)
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self._moves.called(self)

    def names(self) -> set[int]:
        """The buffer ids the ops name."""
        return {mem.buf for op in self.ops for mem in proto.mems_of(op)}

    def follow_moves(self, rename: Callable[[proto.Mem, HostBuffer], proto.Mem], due: float) -> None:
        """(In flight, so no buffer the call names starts to move from now on) Each host buffer
        that moved since the ops were built (another call on it was lost) named as
        `rename(mem, buffer)` names it, by its new id (imported there the first time): the
        old id names memory the worker no longer sees."""
        while moved := self._moves.moved(self.names, due):
            self.ops = tuple(proto.with_mems(op, lambda mem: mem if mem.buf not in moved else
                                             rename(mem, moved[mem.buf]))
                             for op in self.ops)

    def let_go(self, error: BaseException) -> None:
        """The call went out and is left unanswered: its daemon may have started its ops, and
        may go on writing their memory after the caller hears `error` and makes it its own
        again. Their host buffers move to fresh memory (`Moves.detach`), those another call
        in flight names once that call ends, its own writes kept. Device memory stays: the
        world's failure aborts its communicator, which stops what runs there."""
        failed, waiting = self._moves.detach(self.names(), self)
        for buffer_id, why in failed.items():
            error.add_note(f"host buffer {buffer_id} could not be moved off the memory the daemon "
                           f"may still write ({why}): what it holds is not safe to use, and the "
                           "next call naming it is refused (LimitExceeded) as it moves")
        for buffer_id in sorted(waiting):
            error.add_note(f"host buffer {buffer_id} is named by another call in flight too: it "
                           "moves off the memory the daemon may still write once that call ends, "
                           "and until then what it holds may still change")
