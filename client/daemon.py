"""`DaemonBackend`: the CommBackend that sends every call to the node's commd."""

from __future__ import annotations

import contextlib
import functools
import os
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from typing import Concatenate, ParamSpec, TypeVar

import proto
from proto import DType, ReduceOp

from .backend import CommBackend, DTypeLike, OpLike, as_dtype, as_ints, as_op
from .cuda import available_driver
from .errors import (
    UNHEALTHY,
    CommError,
    CommTimeout,
    DaemonUnavailable,
    LimitExceeded,
    MisuseError,
    WorldFailed,
    from_code,
)
from .groups import Basis, Groups
from .health import Health
from .hostmem import HostMemory, default_memory
from .imported import ImportedBuffers
from .memory import DriverFactory, MemoryResolver
from .opcache import OpCache
from .registrations import Registrations
from .rpc import Answer, Superseded
from .streams import StreamOrder
from .symmetric import SymmetricMemory
from .transport import Transport, Undo

T = TypeVar("T")
P = ParamSpec("P")
Method = Callable[Concatenate["DaemonBackend", P], T]


def _interruptible(method: Method[P, T]) -> Method[P, T]:
    """A public call cut short by an interrupt (KeyboardInterrupt, SystemExit) drops the
    connection before the interrupt goes on (see Transport.interrupted): its bookkeeping
    may be half done (a buffer the daemon imported and this side did not record), or the
    daemon may hold its collective. The world fails for every rank, and attempt_reconnect
    rejoins afresh."""
    @functools.wraps(method)
    def call(backend: DaemonBackend, /, *args: P.args, **kwargs: P.kwargs) -> T:
        try:
            return method(backend, *args, **kwargs)
        except Exception:
            raise
        except BaseException as exc:
            backend._interrupted(exc)
            raise

    return call


# a timeout is a number of seconds a deadline adds to time.monotonic(), and milliseconds
# in the hello (u64): a year is beyond any use and far inside both
_MAX_TIMEOUT_S = 365 * 86400.0
_JOIN_GRACE_S = 2.0  # the daemon enforces the join deadline; this covers its reply in flight


class DaemonBackend(CommBackend):
    """One rank of `world`, served by the daemon at `socket_path`.

    The constructor connects, says hello and blocks until all `world_size`
    ranks have joined (or `timeout` seconds pass). Every call has one deadline,
    `timeout` seconds from its start, shared by its steps, except
    `recv_command_u32`, which waits without one but wakes on any failure. Safe to
    use from several threads; not from a forked child, which lets go of its copy
    of the connection at the fork (it is the parent's): there every call is a
    MisuseError (and close() does nothing).

    Pointers may be host memory (`client.hostmem`) or, when a CUDA driver is
    available, CUDA device memory of `device`. `cuda_driver` is asked once, on the
    first pointer that is not host memory (tests pass a fake).
    """

    def __init__(self, socket_path: str | os.PathLike[str], world: str, rank: int,
                 world_size: int, *, device: int | None = None, bootstrap: str | None = None,
                 timeout: float = 60.0, token: str | None = None,
                 memory: HostMemory | None = None, stream: int = 0,
                 cuda_driver: DriverFactory = available_driver) -> None:
        rank, world_size, stream = as_ints(rank=rank, world_size=world_size, stream=stream)
        if device is not None:
            device, = as_ints(device=device)
        if isinstance(timeout, bool) or not isinstance(timeout, int | float) \
                or not 0 < timeout < _MAX_TIMEOUT_S:
            raise MisuseError(f"timeout must be seconds in (0, {_MAX_TIMEOUT_S:g}), got {timeout!r}")
        for name, text in (("world", world), ("bootstrap", bootstrap), ("token", token)):
            if text is not None and not isinstance(text, str):
                raise MisuseError(f"{name} must be a string, got {type(text).__name__}")
        self._rank = rank
        self._world_size = world_size
        self._world = world
        self._timeout = timeout
        self._path = os.fspath(socket_path)
        self._device, self._bootstrap, self._token = device, bootstrap, token
        self._memory = memory if memory is not None else default_memory()
        self._lock = threading.RLock()  # buffer bookkeeping, never over I/O
        self._import_lock = threading.Lock()
        self._reconnect_lock = threading.Lock()  # one attempt_reconnect of this rank at a time
        self._reconnects = 0  # that succeeded
        self._health = Health(self._lock)
        # The daemon connection our bookkeeping (imports, registrations, events) is about: a
        # rejoin's new one, under _lock with the transport and the epoch, so a reply that came
        # on the old one is never recorded as the new daemon's
        self._link = 0
        self._imports = ImportedBuffers()
        self._groups = Groups(on_dropped=self._health.met)
        # the worker's stream its calls follow (0: the legacy default stream; the host engine
        # waits for the whole context there)
        self._stream = stream
        # (with an engine with streams)
        self._order = StreamOrder(device, self._send_events, self._current_link)
        self._closed = False
        self._unmap_symmetric: Callable[[], None] | None = None  # close()'s, until it has run
        self._pid = os.getpid()  # (for the message a forked child's calls get)
        self._inherited = False  # set in a forked child: the connection is the parent's
        self._joining: Transport | None = None  # a rejoin's connection until its hello is answered
        self._add_kernel: int | None = None
        self.epoch = 0
        self._resolver = MemoryResolver(self._memory, driver=cuda_driver, device=device,
                                        on_forget=_weak_listener(self._on_buffer_released))
        self._ops = OpCache(self._resolver)
        # (they hold the bound methods: patch theirs, not the backend's, to reach their requests)
        self._registrations = Registrations(self._lock, self._request, self._mem, self._current_link)
        self._symmetric = SymmetricMemory(self._lock, self._request, self._due, self._memory,
                                          self._resolver, self._imports, self._current_link,
                                          lambda: self._closed)
        self._transport, self.epoch, self.engine = self._join(time.monotonic() + timeout + _JOIN_GRACE_S)
        try:
            self._memory.on_release(self._on_buffer_released)
            _ALIVE.add(self)
        except BaseException:  # (an interrupt: nobody could close the rank's connection)
            self._transport.close()
            raise

    def _join(self, deadline: float) -> tuple[Transport, int, str]:
        """Connect and say hello (at the last epoch seen); returns once the world is ready,
        with the new epoch and the daemon's engine (the caller puts all three in place)."""
        uuid = self._resolver.device_uuid()
        hello = self._build(lambda: proto.Hello(
            1, proto.PROTOCOL_VERSION, os.getpid(), self._world, self._rank, self._world_size,
            max(1, int(self._timeout * 1000)), self._device, self._bootstrap, self._token,
            self.epoch, uuid))
        transport = Transport(self._path, self._timeout, self._on_event)
        with self._lock:
            if not self._closed:
                self._joining = transport
        try:
            self._check_open()  # (close() came while connecting: it never saw this one)
            reply, _ = transport.request(hello, deadline)
            self._check(reply)
            assert isinstance(reply, proto.Welcome)
        except BaseException:
            transport.close()
            raise
        finally:
            with self._lock:
                self._joining = None
        return transport, reply.epoch, reply.engine

    # ---- the seed's calls --------------------------------------------------------

    @_interruptible
    def all_reduce(self, ptr: int, bytes: int, *, dtype: DTypeLike = DType.BF16,
                   op: OpLike = ReduceOp.SUM) -> None:
        d, o = as_dtype(dtype), as_op(op)
        ptr, bytes = as_ints(ptr=ptr, bytes=bytes)
        self._call(("ar", ptr, bytes, d, o),
                   lambda due: proto.AllReduce(self._mem(ptr, bytes, due), bytes, d, o))

    @_interruptible
    def all_gather(self, send_ptr: int, recv_ptr: int, bytes: int) -> None:
        send_ptr, recv_ptr, bytes = as_ints(send_ptr=send_ptr, recv_ptr=recv_ptr, bytes=bytes)
        self._call(("ag", send_ptr, recv_ptr, bytes), lambda due: proto.AllGather(
            self._mem(send_ptr, bytes, due), self._mem(recv_ptr, bytes * self._world_size, due), bytes))

    @_interruptible
    def reduce_scatter(self, send_ptr: int, recv_ptr: int, bytes: int, *,
                       dtype: DTypeLike = DType.U8, op: OpLike = ReduceOp.SUM) -> None:
        d, o = as_dtype(dtype), as_op(op)
        send_ptr, recv_ptr, bytes = as_ints(send_ptr=send_ptr, recv_ptr=recv_ptr, bytes=bytes)
        self._call(("rs", send_ptr, recv_ptr, bytes, d, o), lambda due: proto.ReduceScatter(
            self._mem(send_ptr, bytes * self._world_size, due), self._mem(recv_ptr, bytes, due), bytes,
            d, o))

    @_interruptible
    def broadcast(self, ptr: int, bytes: int, root: int) -> None:
        ptr, bytes, root = as_ints(ptr=ptr, bytes=bytes, root=root)
        self._call(("bc", ptr, bytes, root),
                   lambda due: proto.Broadcast(self._mem(ptr, bytes, due), bytes, root))

    @_interruptible
    def barrier(self) -> None:
        self._call(("barrier",), lambda due: proto.Barrier())

    @_interruptible
    def send_to(self, ptr: int, bytes: int, dest_rank: int, stream: int = 0) -> None:
        ptr, bytes, dest_rank, stream = as_ints(ptr=ptr, bytes=bytes, dest_rank=dest_rank, stream=stream)
        self._call(("send", ptr, bytes, dest_rank, stream),
                   lambda due: proto.Send(self._mem(ptr, bytes, due), bytes, dest_rank, stream),
                   stream=stream or None,
                   early=True)

    @_interruptible
    def recv_from(self, ptr: int, bytes: int, src_rank: int, stream: int = 0) -> None:
        ptr, bytes, src_rank, stream = as_ints(ptr=ptr, bytes=bytes, src_rank=src_rank, stream=stream)
        self._call(("recv", ptr, bytes, src_rank, stream),
                   lambda due: proto.Recv(self._mem(ptr, bytes, due), bytes, src_rank, stream),
                   stream=stream or None,
                   early=True)

    @_interruptible
    def recv_command_u32(self, ptr: int, root: int) -> None:
        ptr, root = as_ints(ptr=ptr, root=root)
        if root == self._rank:
            raise MisuseError(f"rank {root} is the root: recv_command_u32 refuses root")
        self._call(("cmd", ptr, root),
                   lambda due: proto.Broadcast(self._mem(ptr, 4, due), 4, root, command=True),
                   timed=False)

    @_interruptible
    def all_reduce_async(self, ptr: int, bytes: int, compute_stream: int, *,
                         dtype: DTypeLike = DType.BF16, op: OpLike = ReduceOp.SUM) -> None:
        # Host memory (or the host engine): done when this returns. A GPU engine answers once
        # the op is ordered after `compute_stream`, which then waits for it on the device.
        d, o = as_dtype(dtype), as_op(op)
        ptr, bytes, compute_stream = as_ints(ptr=ptr, bytes=bytes, compute_stream=compute_stream)
        self._call(("ar", ptr, bytes, d, o),
                   lambda due: proto.AllReduce(self._mem(ptr, bytes, due), bytes, d, o),
                   stream=compute_stream or None, early=True)

    def rank(self) -> int:
        return self._rank

    def world_size(self) -> int:
        return self._world_size

    @_interruptible
    def register_buffer(self, ptr: int, bytes: int) -> int:
        self._check_open()
        ptr, bytes = as_ints(ptr=ptr, bytes=bytes)
        return self._registrations.register(ptr, bytes, self._due())

    @_interruptible
    def deregister_buffer(self, handle: int) -> None:
        self._check_open()
        handle, = as_ints(handle=handle)
        self._registrations.deregister(handle, self._due())

    @_interruptible
    def symmetric_alloc(self, bytes: int) -> int:
        self._check_open()
        bytes, = as_ints(bytes=bytes)
        return self._symmetric.alloc(bytes, self._due())

    @_interruptible
    def symmetric_free(self, ptr: int) -> None:
        self._check_open()
        ptr, = as_ints(ptr=ptr)
        self._symmetric.free(ptr, self._due())

    @_interruptible
    def set_add_kernel(self, handle: int) -> None:
        # The seed's call cannot fail, and the handle holds from here on even if telling the
        # daemon fails (it went away, the world failed): a rejoin tells the new one, as it
        # does after a restart (undone, it could not be sure not to have told a rejoin's
        # daemon already). The failure shows as is_healthy() false and the next call's error.
        self._check_open()
        handle, = as_ints(handle=handle)
        self._build(lambda: proto.SetAddKernel(1, handle))  # (a bad one is never kept)
        with self._lock:
            self._add_kernel = handle
        with contextlib.suppress(*UNHEALTHY):
            self._tell_add_kernel(self._due())

    def _tell_add_kernel(self, due: float) -> None:
        """Tell the daemon the newest handle, again if a rejoin replaced it meanwhile (it may
        have told the new one an older handle, or none)."""
        while True:
            with self._lock:
                handle, link = self._add_kernel, self._link
            if handle is None:
                return
            self._set_add_kernel_at(handle, link, due)
            with self._lock:
                if (self._add_kernel, self._link) == (handle, link):
                    return

    def _set_add_kernel_at(self, handle: int, link: int, due: float) -> None:
        with contextlib.suppress(Superseded):  # (that daemon is gone: the caller tells the new one)
            self._request(lambda rid: proto.SetAddKernel(rid, handle), due=due, link=link)

    @_interruptible
    def group_start(self) -> None:
        self._check_open()
        with self._lock:  # with the epoch it is for: a reconnect moves both under _lock
            self._groups.start(self._basis())

    @_interruptible
    def group_end(self) -> None:
        self._check_open()
        group = self._groups.end()
        if group is not None and group.ops:
            self._device_submit(tuple(group.ops), list(group.streams), group.early,
                                self._due() if group.timed else None, group.basis)

    @_interruptible
    def is_healthy(self) -> bool:
        if self._closed:
            return False
        self._take_news()
        failure, _ = self._health.tell_thread()
        return failure is None

    def _take_news(self) -> None:
        """Read the events already waiting, and whether the connection broke."""
        transport = self._transport
        transport.drain_events()
        broken = transport.broken
        if broken is not None:
            self._mark_unhealthy(broken, transport=transport)

    @_interruptible
    def attempt_reconnect(self) -> None:
        """Rebuild the world at the next epoch. If the daemon itself went away (killed and
        restarted), connect again with backoff within the timeout and say hello at the
        last epoch. Then, by a deadline of its own, tell the daemon again what it lacks
        (registrations, the add kernel): after a rejoin all of it, after a rebuild on the
        same daemon what an earlier attempt left undone. A registration the daemon
        refuses (a limit) is given up on, and its LimitExceeded raised once the world is
        rebuilt. Threads of this rank that met the
        same failure (an error, or is_healthy() false) reconnect it once: a thread whose
        failure another thread's reconnect already replaced returns at once, however late it
        comes (a second vote would fail the world just rebuilt for every rank). A thread
        that saw a collective work or is_healthy() true since its failure asks for a new
        rebuild, as does any thread while the world is known to have failed again."""
        self._check_open()
        entered = self._reconnects
        failed_at = self._health.met_at()
        with self._reconnect_lock:
            self._take_news()  # (another rank's vote since the rebuild has failed it again)
            with self._lock:
                # another thread reconnected while this one waited, or since its failure
                repaired = self._reconnects != entered or (
                    failed_at is not None and failed_at < self.epoch)
                if repaired and self._health.failure()[0] is None:
                    self._health.behind()
                    return
            refusal = self._reconnect()
            self._reconnects += 1
            self._health.behind()
        if refusal is not None:  # (a limit: the world is rebuilt and healthy all the same)
            raise refusal

    def _reconnect(self) -> LimitExceeded | None:
        due = self._due()
        rejoin = self._transport.broken is not None
        if not rejoin:
            try:
                # like the hello: the daemon enforces the deadline and names missing ranks; give
                # its answer time to arrive rather than give up just before it does
                answer = self._request(proto.Reconnect, due=due, grace=_JOIN_GRACE_S)
                with self._lock:
                    self._new_epoch(answer.value())
            except DaemonUnavailable:  # it went away before we noticed: a restarted one, perhaps
                self._check_open()  # (or close() on another thread broke it)
                rejoin = True
        if rejoin:
            self._rejoin(due + _JOIN_GRACE_S)
        # What the daemon should know again: after a rejoin, all of it; after a rebuild on
        # the same daemon, what an earlier restoring left undone. By a deadline of its own:
        # the rebuild waited for the slowest rank, and may have taken all of the call's.
        restore = self._due()
        refusal: LimitExceeded | None = None
        try:
            self._registrations.register_again(restore)
        except LimitExceeded as exc:
            refusal = exc
        self._tell_add_kernel(restore)
        self._health.repaired_up_to(self.epoch)
        return refusal

    def _rejoin(self, deadline: float) -> None:
        self._transport.close()  # the daemon must see the old connection go, or the rank is taken
        with self._lock:
            # after the close, so no request on the old connection can succeed under the new
            # link; a reply that came on it before is recorded nowhere
            self._link += 1
            self._imports.new_daemon()
            self._registrations.new_daemon(self._link)
        # after the imports went (an op built from them meanwhile is not kept); not under _lock:
        # a finalizer may reach the cache's lock while this thread holds it
        self._ops.clear()
        delay = 0.05
        while True:
            self._check_open()  # closed by another thread meanwhile: never join behind its back
            try:
                transport, epoch, engine = self._join(deadline)
            except DaemonUnavailable:
                if time.monotonic() + delay >= deadline:
                    raise
                time.sleep(delay)  # not back yet (systemd restarts it): try again
                delay = min(1.0, delay * 2)
                continue
            try:
                with self._lock:  # close() takes _closed under it, then closes whichever transport is ours
                    installed = not self._closed
                    if installed:
                        self._transport, self.engine = transport, engine
                        self._new_epoch(epoch)
            except BaseException:  # (an interrupt: the welcomed connection must not keep the rank)
                transport.close()
                raise
            if installed:
                break
            transport.close()
            self._check_open()

    # ---- lifetime -------------------------------------------------------------------

    def close(self) -> None:
        """Leave the world and drop the connection; symmetric allocations are unmapped."""
        if self._inherited:  # (let go of at the fork; a thread the child lacks may hold _lock)
            return
        _ALIVE.discard(self)
        with self._lock:
            # (again, when an interrupt cut the last one short: the rest is done once)
            if not self._closed:
                self._closed = True
                self._unmap_symmetric = self._symmetric.let_go()
            transport, joining = self._transport, self._joining
        transport.close()
        if joining is not None:  # a rejoin's hello: it must not take the rank after we left
            joining.close()
        with self._lock:
            unmap_symmetric, self._unmap_symmetric = self._unmap_symmetric, None
        if unmap_symmetric is not None:
            try:
                self._order.close(self._resolver.driver)
                unmap_symmetric()
            except BaseException:  # (cut short: the next close() does it again)
                with self._lock:
                    if self._unmap_symmetric is None:
                        self._unmap_symmetric = unmap_symmetric
                raise

    def __enter__(self) -> DaemonBackend:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"DaemonBackend(world={self._world!r}, rank={self._rank}, size={self._world_size})"

    # ---- plumbing ---------------------------------------------------------------------

    def _check_open(self) -> None:
        if self._inherited:
            raise MisuseError(f"this DaemonBackend belongs to process {self._pid}; a forked "
                              "child must make its own")
        if self._closed:
            raise MisuseError("the backend is closed")

    def _interrupted(self, exc: BaseException) -> None:
        if self._inherited or self._closed:  # (nothing to drop, or not ours)
            return
        transport = self._transport
        self._health.met(self._mark_unhealthy(transport.interrupted(exc), transport=transport))

    def _let_go_of_inherited(self) -> None:
        """In a forked child (whose copies of the sockets the transports closed): the backend
        is the parent's; no lock is taken (a thread the child lacks may have held one)."""
        self._inherited = self._closed = True

    @staticmethod
    def _build(factory: Callable[[], T]) -> T:
        try:
            return factory()
        except proto.InvalidMessage as exc:
            raise MisuseError(str(exc)) from None

    def _mem(self, ptr: int, nbytes: int, due: float) -> proto.Mem | None:
        """Resolve a span, importing its allocation into the daemon the first time (by `due`,
        the deadline of the call it is for)."""
        if nbytes < 0:
            raise MisuseError(f"bytes must not be negative, got {nbytes}")
        ref = self._resolver.resolve(ptr, nbytes)
        if ref is None:
            return None
        # Its own lock, held over the round trip: a thread reading replies for another call
        # (and taking _lock for an event) must never wait for this one.
        with self._import_lock:
            if ref.buffer_id not in self._imports:
                try:
                    with self._resolver.import_fds(ref) as fds:  # a VMM fd is closed once sent
                        answer = self._request(lambda rid: proto.Import(
                            rid, ref.buffer_id, ref.kind, ref.size, ref.handle), due=due, fds=fds)
                except CommTimeout:  # the daemon may have mapped it (or never got it): forget it first
                    with self._lock:
                        self._imports.owe(ref.buffer_id)
                    raise
                with self._lock:
                    handed = answer.link == self._link
                    if handed:
                        self._imports.add(ref.buffer_id)
                        # freed or evicted meanwhile, its release heard before it was held
                        # here: the daemon is owed a Forget all the same
                        if not self._resolver.still_known(ref):
                            self._imports.release(ref.buffer_id)
                if not handed:
                    raise self._went_away(answer.epoch, "while this call handed it a buffer")
        return proto.Mem(ref.buffer_id, ref.offset)

    def _call(self, key: tuple[object, ...], make_op: Callable[[float], proto.Op],
              timed: bool = True, stream: int | None = None, early: bool = False) -> None:
        """Submit one op, or add it to this thread's open group. The built op is cached by
        `key`, its arguments; `make_op(due)` builds it, importing its buffers by `due`. An op
        on device memory follows `stream` (default: the backend's); `early`: it may be
        answered once ordered on the device (the async calls). `timed`: the submission
        waits no longer than the call's deadline (False: recv_command_u32, without one)."""
        self._check_open()
        due = self._due()
        basis = self._basis()  # (before the op: a cached one names the buffers of that connection)
        op, on_device = self._ops.get(key, lambda: self._build(lambda: make_op(due)))
        follows = (self._stream if stream is None else stream) if on_device else None
        group = self._groups.current()
        if group is not None:
            group.add(op, follows, early, timed)
            return
        self._device_submit((op,), [] if follows is None else [follows], early,
                            due if timed else None, basis)

    def _new_epoch(self, epoch: int) -> None:
        """(Under _lock) The world is rebuilt at `epoch`: every open group was for the one
        before (one opened from now on is the new one's, and kept)."""
        self.epoch = epoch
        self._groups.drop_all()

    def _current_link(self) -> int:
        return self._link

    def _due(self) -> float:
        """The deadline of a call starting now: every request the call makes shares it."""
        return time.monotonic() + self._timeout

    def _basis(self) -> Basis:
        with self._lock:
            return Basis(self._link, self.epoch)

    def _device_submit(self, ops: tuple[proto.Op, ...], streams: list[int], early: bool,
                       due: float | None, basis: Basis) -> None:
        """Submit ops; those on device memory follow the worker's `streams`: with an engine
        that has streams, through their events (`StreamOrder`; all but the first are
        waited for here); otherwise all are waited for here."""
        driver = self._resolver.driver
        if not streams or driver is None:
            self._submit(ops, due, basis)
            return
        by_events = self.engine != "host"  # the host engine has no streams (and refuses device memory)
        for stream in streams[1:] if by_events else streams:
            driver.synchronize(stream)
        if not by_events:
            self._submit(ops, due, basis)
            return
        self._order.submit(driver, streams, early, due,
                           lambda first: self._submit(ops, due, basis, stream=first, early=early))

    def _send_events(self, stream: int, ready: bytes, done: bytes, due: float | None) -> int:
        return self._request(lambda rid: proto.StreamEvents(rid, stream, ready, done),
                             due=self._due() if due is None else due).link

    def _submit(self, ops: tuple[proto.Op, ...], due: float | None, basis: Basis,
                stream: int | None = None, early: bool = False) -> None:
        failure, about = self._health.failure()
        if failure is not None:
            self._health.met(about)
            raise type(failure)(f"world {self._world} is not healthy: {failure}; "
                                "call attempt_reconnect", failure.code)
        # The daemon fails a call open past the timeout and says which rank is behind;
        # wait a little longer than that for its answer before deciding alone.
        make: Callable[[int], proto.Request] = (
            (lambda rid: proto.Submit(rid, ops, basis.epoch)) if stream is None
            else (lambda rid: proto.StreamSubmit(rid, ops, stream, early, basis.epoch)))
        try:
            self._request(make, due=due, grace=_JOIN_GRACE_S, link=basis.link)
        except Superseded:  # built against a daemon a rejoin replaced meanwhile
            raise self._went_away(basis.epoch, "during this call") from None
        except WorldFailed as exc:
            if exc.code is proto.ErrorCode.STALE_EPOCH:  # a reconnect on another thread came first
                self._health.met(basis.epoch)  # (which that reconnect has repaired)
            raise
        self._health.behind()  # it saw the world work: a later attempt_reconnect is meant

    def _request(self, make: Callable[[int], proto.Request], *, due: float | None,
                 fds: Sequence[int] = (), grace: float = 0.0, undo: Undo | None = None,
                 link: int | None = None) -> Answer:
        """One request/reply, answered by `due` (+ `grace`; None: no deadline); daemon errors
        become CommErrors. `make` builds the request from its id. `undo`: what undoes the
        request if it times out and the daemon did it all the same. `link`: only to that
        daemon connection (Superseded if a rejoin replaced it)."""
        self._check_open()
        # One transport for the id and the sending: another thread's rejoin may put a new one
        # in place meanwhile, whose own ids an old one's could collide with
        with self._lock:
            transport, used, epoch, engine = self._transport, self._link, self.epoch, self.engine
        if link is not None and link != used:
            raise Superseded
        try:
            self._send_releases(transport)
            msg = self._build(lambda: make(transport.next_id()))
            reply, got = transport.request(
                msg, None if due is None else due + grace, fds, undo)
            self._check(reply)
        except CommError as exc:
            if link is not None and link != self._link:
                raise Superseded from exc  # (sent on the connection a rejoin was replacing)
            # (a call refused as made for an older epoch says nothing of the current one)
            if isinstance(exc, UNHEALTHY) and exc.code is not proto.ErrorCode.STALE_EPOCH:
                self._health.met(self._mark_unhealthy(exc, epoch, transport))
            raise
        return Answer(reply, got, used, epoch, engine)

    def _check(self, reply: proto.Message) -> None:
        if isinstance(reply, proto.Error):
            raise from_code(reply.code, reply.message)

    def _mark_unhealthy(self, why: CommError, epoch: int = 0,
                        transport: Transport | None = None) -> int:
        """Record why the world is unhealthy, unless it is about an epoch (`epoch`; 0: the
        current one) or a connection (`transport`) this rank has left behind since: a
        reconnect on another thread must not inherit it. A hello's connection counts as
        ours: the world it joins may fail before its welcome. Returns the epoch it is about."""
        with self._lock:
            about = epoch or self.epoch
            # (_joining first: during the constructor's hello there is no _transport yet)
            left = (transport is not None and transport is not self._joining
                    and transport is not self._transport)
            if about >= self.epoch and not left:
                self._health.record(why, about)
        return about

    def _went_away(self, epoch: int, when: str) -> DaemonUnavailable:
        """The error of a call made with a daemon a rejoin replaced meanwhile: the calling
        thread met the end of the world of `epoch` (which that rejoin has repaired)."""
        self._health.met(epoch)
        return DaemonUnavailable(f"the daemon went away {when}; call attempt_reconnect")

    def _on_event(self, event: proto.Event, transport: Transport) -> None:
        # (one from a connection a rejoin has replaced, a SHUTDOWN's say, whose epoch 0 would
        # read as the rebuilt world's, is not about this rank's world any more)
        self._mark_unhealthy(from_code(event.code, event.message), event.epoch, transport)

    def _on_buffer_released(self, buffer_id: int) -> None:
        # (cached ops that name it are stale already: see OpCache)
        # A forked child has nothing to tell, and _lock may be held there for good (by a parent
        # thread): by the pid, since a collection may free a buffer in the at-fork hooks that
        # run before this backend is marked inherited
        if os.getpid() != self._pid:
            return
        with self._lock:
            self._imports.release(buffer_id)

    def _send_releases(self, transport: Transport) -> None:
        """The Forgets go with a request on the current connection (one a rejoin is replacing
        would lose them: the new daemon's, once it has imported some)."""
        with self._lock:
            if transport is not self._transport or transport.broken is not None:
                return
            released = self._imports.take_owed()
        for start in range(0, len(released), proto.MAX_GROUP_OPS):
            transport.post(proto.Forget(tuple(released[start:start + proto.MAX_GROUP_OPS])))


# The backends of this process that a fork's child must let go of (see _in_forked_child).
_ALIVE: weakref.WeakSet[DaemonBackend] = weakref.WeakSet()


def _in_forked_child() -> None:
    """A fork copies every backend into the child, which must not speak as the parent's
    rank (MisuseError); its copies of the sockets are closed by the transports' own hook."""
    for backend in list(_ALIVE):
        backend._let_go_of_inherited()


os.register_at_fork(after_in_child=_in_forked_child)


def _weak_listener(method: Callable[[int], None]) -> Callable[[int], None]:
    """`method`, held weakly: the backend's own resolver must not keep the backend alive."""
    ref = weakref.WeakMethod(method)

    def listener(buffer_id: int) -> None:
        target = ref()
        if target is not None:
            target(buffer_id)

    return listener


__all__ = ["DaemonBackend"]
