"""`DaemonBackend`: the CommBackend that sends every call to the node's commd."""

from __future__ import annotations

import functools
import os
import threading
import time
import weakref
from collections.abc import Callable
from typing import Concatenate, ParamSpec, TypeVar

import proto
from proto import DType, ReduceOp

from .addkernel import AddKernel
from .backend import (
    CommBackend,
    DTypeLike,
    OpLike,
    as_dtype,
    as_ints,
    as_op,
    as_path,
    as_seconds,
    check_stream,
)
from .calls import Calls, about_world
from .connection import Connection
from .cuda import available_driver
from .errors import CommTimeout, DaemonUnavailable, MisuseError
from .groups import Groups, OpenGroup
from .handover import Handover
from .health import Health
from .hostmem import HostMemory, default_memory
from .imported import ImportedBuffers
from .memory import DriverFactory, MemoryResolver
from .opcache import OpCache
from .reconnect import Reconnector
from .registrations import Registrations
from .rpc import built
from .streams import StreamOrder
from .symmetric import SymmetricMemory

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
            backend._conn.interrupted(exc)
            raise

    return call


def _names_world(method: Method[P, T]) -> Method[P, T]:
    """A call besides the ops (a registration, symmetric memory, the add kernel) that finds
    the daemon gone, or gives up on it (a CommTimeout that left the world unhealthy), says
    so as an op does, naming the world: a worker in several worlds tells by it which one to
    reconnect."""
    @functools.wraps(method)
    def call(backend: DaemonBackend, /, *args: P.args, **kwargs: P.kwargs) -> T:
        try:
            return method(backend, *args, **kwargs)
        except (DaemonUnavailable, CommTimeout) as exc:
            if backend._conn.closed:  # (close() on another thread: no world to speak of)
                raise
            # (one that left the world be, nothing sent: another thread's import held the
            # turn past the deadline; a reconnect is no advice for it)
            if isinstance(exc, CommTimeout) and backend._health.failure()[0] is None:
                raise
            raise about_world(backend._world, exc) from exc

    return call


# The daemon enforces a join's deadline, with a backstop of its own across nodes: the
# client waits past both, so what it hears is the daemon's word on which ranks are missing,
# not a timeout of its own that cannot say (when they were equal, either could come first)
_JOIN_GRACE_S = proto.JOIN_BACKSTOP_S + 1.0


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
    available, CUDA device memory of `device`. `cuda_driver` is asked once: in the
    constructor when `device` is given (the hello carries the GPU's UUID), else on the
    first pointer that is not host memory (tests pass a fake).
    """

    def __init__(self, socket_path: str | os.PathLike[str], world: str, rank: int,
                 world_size: int, *, device: int | None = None, bootstrap: str | None = None,
                 timeout: float = 60.0, token: str | None = None,
                 memory: HostMemory | None = None, stream: int = 0,
                 cuda_driver: DriverFactory = available_driver) -> None:
        rank, world_size, stream = as_ints(rank=rank, world_size=world_size, stream=stream)
        check_stream("stream", stream)
        if device is not None:
            device, = as_ints(device=device)
        timeout = as_seconds(timeout=timeout)
        for name, text in (("world", world), ("bootstrap", bootstrap), ("token", token)):
            if text is not None and not isinstance(text, str):
                raise MisuseError(f"{name} must be a string, got {type(text).__name__}")
        path = as_path(socket_path=socket_path)
        self._rank = rank
        self._world_size = world_size
        self._world = world
        self._timeout = timeout
        self._device, self._bootstrap, self._token = device, bootstrap, token
        self._memory = memory if memory is not None else default_memory()
        self._lock = threading.RLock()  # buffer bookkeeping, never over I/O
        self._health = Health(self._lock)
        self._imports = ImportedBuffers()
        self._groups = Groups(on_dropped=self._group_dropped)
        # (its link is the daemon connection our bookkeeping of imports, registrations and
        # events is about)
        self._conn = Connection(path, timeout, self._lock, self._health, self._hello,
                                self._take_owed, self._groups.drop_all, self._forget_daemon,
                                self._owes)
        # (with an engine with streams)
        self._order = StreamOrder(device, self._send_events, self._conn.current_link)
        self._unmap_symmetric: Callable[[], None] | None = None  # close()'s, until it has run
        self._add_kernel = AddKernel(self._lock, self._conn)
        self._resolver = MemoryResolver(self._memory, driver=cuda_driver, device=device,
                                        on_forget=_weak_listener(self._on_buffer_released))
        self._ops = OpCache(self._resolver)
        self._handover = Handover(self._lock, self._conn, self._resolver, self._imports)
        self._calls = Calls(world, self._conn, self._health, self._handover, self._ops, self._groups,
                            self._resolver, self._memory, self._order, stream, self._due)
        # (they hold the connection's bound request: patch theirs to reach their requests)
        self._registrations = Registrations(self._lock, self._conn.request, self._handover.mem_pinned,
                                            self._handover.unpin, self._conn.current_link,
                                            self._conn.gone, self._memory.next_id)
        self._symmetric = SymmetricMemory(self._lock, self._conn.request, self._due, self._memory,
                                          self._resolver, self._imports, self._conn.current_link,
                                          self._conn.gone, lambda: self._conn.closed)
        self._reconnector = Reconnector(self._world, self._lock, self._conn, self._health,
                                        self._registrations, self._add_kernel, self._due, _JOIN_GRACE_S)
        self._conn.open(time.monotonic() + timeout + _JOIN_GRACE_S)
        try:
            self._memory.on_release(self._on_host_buffer_released)
            _ALIVE.add(self)
        except BaseException:  # (an interrupt: nobody could close the rank's connection)
            self._conn.transport.close()
            raise

    @property
    def epoch(self) -> int:
        """The epoch of the world this rank is in (each rebuild moves it on)."""
        return self._conn.epoch

    @property
    def engine(self) -> str:
        """The engine of the daemon: `host` or `nccl`."""
        return self._conn.engine

    def _hello(self, epoch: int) -> proto.Hello:
        uuid = self._resolver.device_uuid()
        return built(lambda: proto.Hello(
            1, proto.PROTOCOL_VERSION, os.getpid(), self._world, self._rank, self._world_size,
            max(1, int(self._timeout * 1000)), self._device, self._bootstrap, self._token,
            epoch, uuid))

    # ---- the seed's calls --------------------------------------------------------

    @_interruptible
    def all_reduce(self, ptr: int, bytes: int, *, dtype: DTypeLike = DType.BF16,
                   op: OpLike = ReduceOp.SUM) -> None:
        d, o = as_dtype(dtype), as_op(op)
        ptr, bytes = as_ints(ptr=ptr, bytes=bytes)
        self._calls.call(("ar", ptr, bytes, d, o),
                         lambda due: proto.AllReduce(self._handover.mem(ptr, bytes, due), bytes, d, o))

    @_interruptible
    def all_gather(self, send_ptr: int, recv_ptr: int, bytes: int) -> None:
        send_ptr, recv_ptr, bytes = as_ints(send_ptr=send_ptr, recv_ptr=recv_ptr, bytes=bytes)
        mem = self._handover.mem
        self._calls.call(("ag", send_ptr, recv_ptr, bytes), lambda due: proto.AllGather(
            mem(send_ptr, bytes, due), mem(recv_ptr, bytes * self._world_size, due), bytes))

    @_interruptible
    def reduce_scatter(self, send_ptr: int, recv_ptr: int, bytes: int, *,
                       dtype: DTypeLike = DType.U8, op: OpLike = ReduceOp.SUM) -> None:
        d, o = as_dtype(dtype), as_op(op)
        send_ptr, recv_ptr, bytes = as_ints(send_ptr=send_ptr, recv_ptr=recv_ptr, bytes=bytes)
        mem = self._handover.mem
        self._calls.call(("rs", send_ptr, recv_ptr, bytes, d, o), lambda due: proto.ReduceScatter(
            mem(send_ptr, bytes * self._world_size, due), mem(recv_ptr, bytes, due), bytes, d, o))

    @_interruptible
    def broadcast(self, ptr: int, bytes: int, root: int) -> None:
        ptr, bytes, root = as_ints(ptr=ptr, bytes=bytes, root=root)
        self._calls.call(("bc", ptr, bytes, root),
                         lambda due: proto.Broadcast(self._handover.mem(ptr, bytes, due), bytes, root))

    @_interruptible
    def barrier(self) -> None:
        self._calls.call(("barrier",), lambda due: proto.Barrier())

    @_interruptible
    def send_to(self, ptr: int, bytes: int, dest_rank: int, stream: int = 0) -> None:
        ptr, bytes, dest_rank, stream = as_ints(ptr=ptr, bytes=bytes, dest_rank=dest_rank, stream=stream)
        self._calls.call(("send", ptr, bytes, dest_rank, stream), lambda due: proto.Send(
            self._handover.mem(ptr, bytes, due), bytes, dest_rank, stream), stream=stream or None, early=True)

    @_interruptible
    def recv_from(self, ptr: int, bytes: int, src_rank: int, stream: int = 0) -> None:
        ptr, bytes, src_rank, stream = as_ints(ptr=ptr, bytes=bytes, src_rank=src_rank, stream=stream)
        self._calls.call(("recv", ptr, bytes, src_rank, stream), lambda due: proto.Recv(
            self._handover.mem(ptr, bytes, due), bytes, src_rank, stream), stream=stream or None, early=True)

    @_interruptible
    def recv_command_u32(self, ptr: int, root: int) -> None:
        ptr, root = as_ints(ptr=ptr, root=root)
        if root == self._rank:
            raise MisuseError(f"rank {root} is the root: recv_command_u32 refuses root")
        self._calls.call(("cmd", ptr, root),
                         lambda due: proto.Broadcast(self._handover.mem(ptr, 4, due), 4, root, command=True),
                         timed=False)

    @_interruptible
    def all_reduce_async(self, ptr: int, bytes: int, compute_stream: int, *,
                         dtype: DTypeLike = DType.BF16, op: OpLike = ReduceOp.SUM) -> None:
        # Host memory (or the host engine): done when this returns. A GPU engine answers once
        # the op is ordered after `compute_stream`, which then waits for it on the device.
        d, o = as_dtype(dtype), as_op(op)
        ptr, bytes, compute_stream = as_ints(ptr=ptr, bytes=bytes, compute_stream=compute_stream)
        check_stream("compute_stream", compute_stream)  # (no op carries it to be checked there)
        self._calls.call(("ar", ptr, bytes, d, o),
                         lambda due: proto.AllReduce(self._handover.mem(ptr, bytes, due), bytes, d, o),
                         stream=compute_stream or None, early=True)

    def rank(self) -> int:
        return self._rank

    def world_size(self) -> int:
        return self._world_size

    @_interruptible
    @_names_world
    def register_buffer(self, ptr: int, bytes: int) -> int:
        self._conn.check_open()
        ptr, bytes = as_ints(ptr=ptr, bytes=bytes)
        return self._registrations.register(ptr, bytes, self._due())

    @_interruptible
    @_names_world
    def deregister_buffer(self, handle: int) -> None:
        self._conn.check_open()
        handle, = as_ints(handle=handle)
        self._registrations.deregister(handle, self._due())

    @_interruptible
    @_names_world
    def symmetric_alloc(self, bytes: int) -> int:
        self._conn.check_open()
        bytes, = as_ints(bytes=bytes)
        return self._symmetric.alloc(bytes, self._due())

    @_interruptible
    @_names_world
    def symmetric_free(self, ptr: int) -> None:
        self._conn.check_open()
        ptr, = as_ints(ptr=ptr)
        self._symmetric.free(ptr, self._due())

    @_interruptible
    @_names_world
    def set_add_kernel(self, handle: int) -> None:
        self._conn.check_open()
        handle, = as_ints(handle=handle)
        self._add_kernel.set(handle, self._due())

    @_interruptible
    def group_start(self) -> None:
        self._conn.check_open()
        with self._lock:  # with the epoch it is for: a reconnect moves both under _lock
            self._groups.start(self._conn.basis())

    @_interruptible
    def group_end(self) -> None:
        self._conn.check_open()
        group = self._groups.end()
        if group is not None and group.ops:
            try:
                self._calls.device_submit(tuple(group.ops), list(group.streams), group.early,
                                          self._due() if group.timed else None, group.basis)
            finally:
                self._handover.unpin(group.pinned)

    def _group_dropped(self, group: OpenGroup) -> None:
        self._health.met(group.basis.epoch)
        self._handover.unpin(group.pinned)

    @_interruptible
    def is_healthy(self) -> bool:
        if self._conn.closed:
            return False
        self._conn.take_news()
        failure, _ = self._health.tell_thread()
        return failure is None

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
        self._conn.check_open()
        self._reconnector.attempt()

    def _forget_daemon(self, link: int) -> None:
        """A rejoin left the daemon behind: nothing imported into it or registered with it
        holds for the daemon of the connection `link`."""
        with self._lock:
            self._imports.new_daemon()
            self._registrations.new_daemon(link)
        # after the imports went (an op built from them meanwhile is not kept); not under _lock:
        # a finalizer may reach the cache's lock while this thread holds it
        self._ops.clear()

    # ---- lifetime -------------------------------------------------------------------

    def close(self) -> None:
        """Leave the world and drop the connection; symmetric allocations are unmapped."""
        if self._conn.inherited:  # (let go of at the fork; a thread the child lacks may hold _lock)
            return
        _ALIVE.discard(self)
        self._conn.close(self._let_go_of_symmetric)
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

    def _let_go_of_symmetric(self) -> None:
        """(Under _lock, once closed) what close() unmaps: an interrupt may cut the first
        close() short, and the next does the rest."""
        self._unmap_symmetric = self._symmetric.let_go()

    def __enter__(self) -> DaemonBackend:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"DaemonBackend(world={self._world!r}, rank={self._rank}, size={self._world_size})"

    # ---- plumbing ---------------------------------------------------------------------

    def _take_owed(self, freed_only: bool = False) -> list[int]:
        """The Forgets to send now (under _lock; see ImportedBuffers.take_owed)."""
        for group in self._groups.abandoned():  # (a thread that ended between group_start and _end)
            self._imports.unpin(group.pinned)
        return self._imports.take_owed(freed_only)

    def _owes(self) -> bool:
        """Whether _take_owed may find anything (asked without _lock)."""
        return self._imports.owes() or self._groups.any_open()

    def _due(self) -> float:
        """The deadline of a call starting now: every request the call makes shares it."""
        return time.monotonic() + self._timeout

    def _send_events(self, stream: int, ready: bytes, done: bytes, due: float | None) -> int:
        return self._conn.request(lambda rid: proto.StreamEvents(rid, stream, ready, done),
                                  due=self._due() if due is None else due).link

    def _on_buffer_released(self, buffer_id: int) -> None:
        # (cached ops that name it are stale already: see OpCache)
        # A forked child has nothing to tell, and _lock may be held there for good (by a parent
        # thread): by the pid, since a collection may free a buffer in the at-fork hooks that
        # run before this backend is marked inherited
        if os.getpid() != self._conn.pid:
            return
        with self._lock:
            self._imports.release(buffer_id)

    def _on_host_buffer_released(self, buffer_id: int) -> None:
        self._on_buffer_released(buffer_id)
        # Told now, not with this rank's next request: a process in several worlds frees a
        # buffer that some of them will not call on for long (or ever), and their daemon
        # connections kept the freed memory mapped, counted against the daemon's limits
        if os.getpid() == self._conn.pid:
            self._conn.forget_now(self._owe_again)

    def _owe_again(self, buffer_ids: list[int]) -> None:
        with self._lock:
            self._imports.owe_freed(buffer_ids)


# The backends of this process that a fork's child must let go of (see _in_forked_child).
_ALIVE: weakref.WeakSet[DaemonBackend] = weakref.WeakSet()


def _in_forked_child() -> None:
    """A fork copies every backend into the child, which must not speak as the parent's
    rank (MisuseError); its copies of the sockets are closed by the transports' own hook."""
    for backend in list(_ALIVE):
        backend._conn.let_go_of_inherited()


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
