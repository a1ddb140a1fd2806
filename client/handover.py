"""How a call's pointers reach the daemon: each span resolved to its allocation, which
the daemon imports the first time it is named."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Collection
from typing import TypeVar

import proto

from .connection import Connection
from .errors import CommTimeout, MisuseError
from .hostmem import HostBuffer
from .imported import ImportedBuffers
from .memory import MemoryRef, MemoryResolver

# How often a call builds its op afresh when another thread's calls evicted its allocations
# meanwhile; the last build goes as it is (a cache too small for one op's buffers, which
# would evict them for ever, then gets the daemon's refusal instead of a loop)
_BUILDS = 3
_Built = TypeVar("_Built")


class Handover:
    """Names the worker's memory to the daemon of `conn`: a span becomes a `proto.Mem`
    (its allocation's buffer id and offset), the allocation imported into the daemon on
    its first use, by the deadline of the call that names it. CUDA allocations a request
    names stay pinned until it is sent (see ImportedBuffers). `lock` is the backend's,
    over `imports`."""

    def __init__(self, lock: threading.RLock, conn: Connection, resolver: MemoryResolver,
                 imports: ImportedBuffers) -> None:
        self._lock = lock
        # Its own lock, held over an import's round trip: a thread reading replies for
        # another call (and taking _lock for an event) must never wait for an import
        self._import_lock = threading.Lock()
        self._conn = conn
        self._resolver = resolver
        self._imports = imports

    def mem(self, ptr: int, nbytes: int, due: float) -> proto.Mem | None:
        """Resolve a span, importing its allocation into the daemon the first time (by `due`,
        the deadline of the call it is for)."""
        if nbytes < 0:
            raise MisuseError(f"bytes must not be negative, got {nbytes}")
        ref = self._resolver.resolve(ptr, nbytes)
        return None if ref is None else self._handed(ref, due)

    def moved(self, mem: proto.Mem, buffer: HostBuffer, due: float) -> proto.Mem:
        """`mem`, of a host buffer that has moved since (`buffer`, under its new id: see
        HostBuffer.detach), named by the buffer's id now, imported the first time."""
        return self._handed(self._resolver.host_ref(buffer, mem.offset), due)

    def _handed(self, ref: MemoryRef, due: float) -> proto.Mem:
        # Waited for by this call's deadline: another thread's import, begun later, may hold
        # the turn past it.
        taken = False
        try:  # (taken inside: an interrupt right after the acquire must not keep it)
            taken = self._import_lock.acquire(timeout=max(0.0, due - time.monotonic()))
            if not taken:
                raise CommTimeout("the call's deadline passed while another thread's import "
                                  "into the daemon held the turn this call's import waited for")
            if ref.buffer_id not in self._imports:
                self._import(ref, due)
        finally:
            if taken:
                self._import_lock.release()
        return proto.Mem(ref.buffer_id, ref.offset)

    def _import(self, ref: MemoryRef, due: float) -> None:
        """(Under _import_lock) Hand the daemon `ref`'s allocation, by `due`."""
        try:
            with self._resolver.import_fds(ref) as fds:  # a VMM fd is closed once sent
                answer = self._conn.request(lambda rid: proto.Import(
                    rid, ref.buffer_id, ref.kind, ref.size, ref.handle), due=due, fds=fds)
        except CommTimeout:  # the daemon may have mapped it (or never got it): forget it first
            with self._lock:
                self._imports.owe(ref.buffer_id)
            raise
        with self._lock:
            handed = answer.link == self._conn.link
            if handed:
                self._imports.add(ref.buffer_id)
                # freed or evicted meanwhile, its release heard before it was held
                # here: the daemon is owed a Forget all the same
                if not self._resolver.still_known(ref):
                    self._imports.release(ref.buffer_id)
        if not handed:
            raise self._conn.went_away(answer.epoch, "while this call handed it a buffer")

    def pinned(self, build: Callable[[], tuple[_Built, tuple[int, ...]]]) -> tuple[_Built, tuple[int, ...]]:
        """`build()` makes what a request will name memory by, and says which CUDA
        allocations it names: those come pinned (the caller unpins them once it is sent)."""
        for attempt in range(_BUILDS):
            made, device = build()
            if not device:
                break
            with self._lock:
                self._imports.pin(device)
            # Evicted before it was pinned, its Forget may be on its way: the request would be
            # refused. Built afresh, it imports the allocation again under a new id (its own
            # buffers are the cache's newest, so only another thread's calls evict them).
            if self._resolver.still_cached(device) or attempt == _BUILDS - 1:
                break
            self.unpin(device)
        return made, device

    def mem_pinned(self, ptr: int, nbytes: int, due: float) -> tuple[proto.Mem | None, tuple[int, ...]]:
        """`mem` for a request that names the span after it is resolved (register_buffer's):
        a CUDA allocation comes pinned, as an op's buffers do."""
        def resolve() -> tuple[proto.Mem | None, tuple[int, ...]]:
            with self._resolver.noting_device() as noted:
                mem = self.mem(ptr, nbytes, due)
            return mem, (mem.buf,) if mem is not None and mem.buf in noted else ()

        return self.pinned(resolve)

    def unpin(self, buffer_ids: Collection[int]) -> None:
        """The request naming these is sent (or never will be): their Forgets may go."""
        if not buffer_ids:
            return
        with self._lock:
            self._imports.unpin(buffer_ids)
