"""A rank's ops on their way to its daemon: each built once from its call's arguments
(cached), added to the calling thread's open group or submitted, ordered with the
worker's CUDA streams, and the failure a call meets raised naming the world."""

from __future__ import annotations

import functools
from collections.abc import Callable

import proto

from .connection import Connection
from .errors import CommError, CommTimeout, DaemonShutdown, DaemonUnavailable, WorldFailed
from .groups import Basis, Groups
from .handover import Handover
from .health import Health
from .hostmem import HostMemory
from .memory import MemoryResolver
from .moves import InFlight
from .opcache import OpCache
from .rpc import Superseded, built
from .streams import StreamOrder

_VERDICT_GRACE_S = 2.0  # a call's: the daemon's verdict on a call open past its timeout, in flight


def about_world(world: str, error: CommError) -> CommError:
    """`error` as a call raises it: naming the world (a worker in several tells them
    apart by it) and what to do, each once. The daemon's word on a failed call has both
    ('world W epoch E failed: ...; call attempt_reconnect on every rank'); a cause may
    have the advice alone ('... once it is back') or only name a call ('rank 0 called
    attempt_reconnect'). A stopping daemon's world failure, on record, has none: what
    to do is the stop's, as its other words say (a reconnect before it is back fails)."""
    said = str(error)
    if not said.startswith(f"world {world} "):
        said = f"world {world} is not healthy: {said}"
    if "call attempt_reconnect" not in said:
        said += "; call attempt_reconnect once it is back" if isinstance(error, DaemonShutdown) \
            else "; call attempt_reconnect"
    return type(error)(said, error.code)


class Calls:
    """The calls of one DaemonBackend, from any of its threads."""

    def __init__(self, world: str, conn: Connection, health: Health, handover: Handover,
                 ops: OpCache, groups: Groups, resolver: MemoryResolver, memory: HostMemory,
                 order: StreamOrder, stream: int, due: Callable[[], float]) -> None:
        self._world = world
        self._conn = conn
        self._health = health
        self._handover = handover
        self._ops = ops
        self._groups = groups
        self._resolver = resolver
        self._memory = memory
        self._order = order
        # the worker's stream its calls follow (0: the legacy default stream; the host engine
        # waits for the whole context there)
        self._stream = stream
        self._due = due

    def call(self, key: tuple[object, ...], make_op: Callable[[float], proto.Op],
             timed: bool = True, stream: int | None = None, early: bool = False) -> None:
        """Submit one op, or add it to this thread's open group. The built op is cached by
        `key`, its arguments; `make_op(due)` builds it, importing its buffers by `due`. An op
        on device memory follows `stream` (default: the backend's); `early`: it may be
        answered once ordered on the device (the async calls). `timed`: the submission
        waits no longer than the call's deadline (False: recv_command_u32, without one)."""
        self._conn.check_open()
        due = self._due()
        basis = self._conn.basis()  # (before the op: a cached one names the buffers of that connection)
        try:
            op, device = self._handover.pinned(
                functools.partial(self._ops.get, key, lambda: built(lambda: make_op(due))))
        except CommError:
            if self._conn.transport.broken is not None:  # (its imports asked a connection gone
                self.raise_failure()  # with the world: its end, as a call words it)
            raise
        follows = (self._stream if stream is None else stream) if device else None
        try:
            group = self._groups.current()
            if group is not None:
                group.add(op, follows, early, timed, device)
                return
            self.device_submit((op,), [] if follows is None else [follows], early,
                               due if timed else None, basis)
        except BaseException:
            self._handover.unpin(device)
            raise
        if device:
            self._handover.unpin(device)

    def device_submit(self, ops: tuple[proto.Op, ...], streams: list[int], early: bool,
                      due: float | None, basis: Basis) -> None:
        """Submit ops; those on device memory follow the worker's `streams`: with an engine
        that has streams, through their events (`StreamOrder`; all but the first are
        waited for here); otherwise all are waited for here."""
        if not streams:  # (host memory: asked first, the driver is a property's call)
            self._submit(ops, due, basis)
            return
        driver = self._resolver.driver
        if driver is None:
            self._submit(ops, due, basis)
            return
        by_events = self._conn.engine != "host"  # the host engine has no streams (and refuses device memory)
        for stream in streams[1:] if by_events else streams:
            driver.synchronize(stream)
        if not by_events:
            self._submit(ops, due, basis)
            return
        self._order.submit(driver, streams, early, due,
                           lambda first: self._submit(ops, due, basis, stream=first, early=early))

    def _submit(self, ops: tuple[proto.Op, ...], due: float | None, basis: Basis,
                stream: int | None = None, early: bool = False) -> None:
        self.raise_failure()
        with InFlight(self._memory.moves, ops) as call:
            make: Callable[[int], proto.Request] = (
                (lambda rid: proto.Submit(rid, call.ops, basis.epoch)) if stream is None
                else (lambda rid: proto.StreamSubmit(rid, call.ops, stream, early, basis.epoch)))
            try:
                imports_due = self._due() if due is None else due
                call.follow_moves(lambda mem, buffer: self._handover.moved(mem, buffer, imports_due),
                                  imports_due)
                # The daemon fails a call open past the timeout and says which rank is behind;
                # wait a little longer than that for its answer before deciding alone.
                self._conn.request(make, due=due, grace=_VERDICT_GRACE_S, link=basis.link,
                                   abandon=call.let_go)
            except Superseded:  # built against a daemon a rejoin replaced meanwhile
                raise about_world(self._world, self._conn.went_away(basis.epoch, "during this call")) \
                    from None
            except DaemonUnavailable as exc:
                if self._conn.closed:  # (close() on another thread, or in a signal handler)
                    raise
                raise about_world(self._world, exc) from exc  # its daemon died under the call
            except CommTimeout as exc:  # (the daemon's own verdict names the world already)
                raise about_world(self._world, exc) from exc
            except WorldFailed as exc:
                if exc.code is proto.ErrorCode.STALE_EPOCH:  # a reconnect on another thread came first
                    self._health.met(basis.epoch)  # (which that reconnect has repaired)
                raise
        self._health.behind()  # it saw the world work: a later attempt_reconnect is meant

    def raise_failure(self) -> None:
        """Raise the world's failure on record, if there is one (the calling thread met it)."""
        failure, about = self._health.failure()
        if failure is not None:
            self._health.met(about)
            raise about_world(self._world, failure)
