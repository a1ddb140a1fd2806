"""Host memory the daemon can open: memfd-backed buffers with raw pointers.

Without a GPU, workers allocate here and pass `buffer.ptr + offset` exactly as
they would pass a device pointer. `HostMemory` is this process's table of such
allocations, the host counterpart of the CUDA driver's own table (what
`cuMemGetAddressRange` answers from): a pointer is resolved by looking it up.
Buffer ids are never reused, so a freed and re-used address can never be
mistaken for the old buffer (CUDA's BUFFER_ID plays that part on the GPU).

`alloc()` uses the process's default table; pass a `HostMemory` of your own to
`DaemonBackend(memory=...)` to keep separate tables.
"""

from __future__ import annotations

import bisect
import contextlib
import ctypes
import errno
import fcntl
import itertools
import mmap
import os
import stat
import sys
import threading
import weakref
from collections.abc import Callable, Collection
from typing import Any

import numpy as np

from .backend import as_ints
from .errors import LimitExceeded, MisuseError, ProtocolError
from .moves import Moves, despite_interrupts

ReleaseListener = Callable[[int], None]
# Ids for every table of the process (buffers, and the backends' register_buffer handles):
# a backend with a table of its own must not hand out another backend's handle numbers
# (a count of its own gave both their first handle as 2). (next() on it is atomic.)
_IDS = itertools.count(1)


_LIBC = ctypes.CDLL(None, use_errno=True)
_LIBC.mmap.restype = ctypes.c_void_p
_LIBC.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                       ctypes.c_long]


def _map_over(ptr: int, size: int, fd: int) -> None:
    """Put `fd`'s memory at [ptr, ptr+size), in place of what is mapped there, in one step."""
    placed = _LIBC.mmap(ptr, size, mmap.PROT_READ | mmap.PROT_WRITE, mmap.MAP_SHARED | _MAP_FIXED, fd, 0)
    if placed != ptr:
        err = ctypes.get_errno()
        raise OSError(err, f"cannot map memory at 0x{ptr:x}: {os.strerror(err)}")


_MAP_FIXED = 0x10  # (Linux, every architecture; Python's mmap module does not name it)


def _sealed_memfd(nbytes: int) -> int:
    fd = os.memfd_create("commd-host", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        os.ftruncate(fd, nbytes)
        # The daemon refuses memory that could shrink under its mapping (SIGBUS).
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL)
    except BaseException:
        os.close(fd)
        raise
    return fd


_F_SEAL_FUTURE_WRITE = 0x10  # (Linux 5.1; Python's fcntl does not name it)


def _unfit_memfd(fd: int, size: int) -> str | None:
    """Why `fd` cannot back `size` bytes mapped shared and writable here for as long as the
    mapping lives (None: it can). Touching a page past the file's end kills the process
    with SIGBUS, so the file must hold them all now and be sealed so that it never holds
    fewer; the checks are the daemon's for the worker's memory (HostMapping)."""
    try:
        # first, as it asks the file's filesystem nothing (a FUSE file's fstat may never end)
        seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
        info = os.fstat(fd)
    except OSError:
        return "is not a memfd"
    if not stat.S_ISREG(info.st_mode):
        return "is not a memfd"
    if info.st_size < size:
        return f"holds {info.st_size} bytes, {size} were claimed"
    if not seals & fcntl.F_SEAL_SHRINK:
        return "is not sealed against shrinking (a shrink would kill this process)"
    if seals & (fcntl.F_SEAL_WRITE | _F_SEAL_FUTURE_WRITE):
        return "is sealed against writing"
    return None


class _Name:
    """A buffer's id, which a detach changes: its finalizer releases the one it has then."""

    __slots__ = ("id",)

    def __init__(self, buffer_id: int) -> None:
        self.id = buffer_id


class HostBuffer:
    """One shared allocation: `.ptr` is valid in this process, `.fd` lets the daemon map it."""

    def __init__(self, owner: HostMemory, buffer_id: int, fd: int, nbytes: int, *,
                 adopted: bool = False) -> None:
        self._name = _Name(buffer_id)
        self.nbytes = nbytes
        self.size = max(nbytes, 1)  # mmap cannot map 0 bytes; ptr stays valid for 0-byte calls
        self.fd = fd  # (a detach puts fresh memory under this same number)
        self.adopted = adopted  # the daemon's memory (symmetric_alloc): never detached
        self._owner = owner
        self._closing = threading.Lock()  # close() from two threads unmaps once
        # A move under way (see _copy_and_put_on): the fresh memory's fd, the new id, and
        # whether the copy is done, for a fork's child to finish or drop
        self._onto: tuple[int, int, bool] | None = None
        _BUFFERS.add(self)  # (a fork's child gives it a fresh lock, whatever its table holds)
        # Anonymous memory holds the address, and the memfd goes over it: mapped from the fd,
        # the mmap object would keep a duplicate of it open, and with it the memory a detach
        # moves the buffer off, for as long as the buffer lives.
        self._mmap: mmap.mmap | None = mmap.mmap(-1, self.size, mmap.MAP_SHARED,
                                                 mmap.PROT_READ | mmap.PROT_WRITE)
        self._bytes: np.ndarray | None = np.frombuffer(self._mmap, np.uint8)
        self.ptr: int = self._bytes.ctypes.data
        try:
            _map_over(self.ptr, self.size, fd)
        except BaseException:
            self._bytes = None
            self._mmap.close()
            raise
        # A buffer dropped without close() still gives back its fd, its table entry and
        # the daemon's mapping (the listeners tell the backends).
        self._reclaim = weakref.finalize(self, _reclaim, owner, self._name, self.ptr, self._mmap, fd)

    @property
    def id(self) -> int:
        return self._name.id

    @property
    def closed(self) -> bool:
        return self._mmap is None

    def view(self, dtype: Any = np.uint8) -> np.ndarray:
        """A numpy view of the whole buffer as `dtype` (whole elements only)."""
        if self._bytes is None:
            raise MisuseError(f"host buffer {self.id} is closed")
        dt = np.dtype(dtype)
        # (bytes through the interface, then the dtype: it carries only numpy's own types,
        # and would make ml_dtypes' bfloat16 a void type)
        whole = self._bytes[: self.nbytes - self.nbytes % dt.itemsize]
        return np.asarray(_View(whole, self)).view(dt)

    def offset_of(self, ptr: int, nbytes: int) -> int:
        """The offset of `ptr` in this buffer; MisuseError if [ptr, ptr+nbytes) runs past its end."""
        offset = ptr - self.ptr
        if offset + nbytes > self.nbytes:
            raise MisuseError(
                f"[0x{ptr:x}, +{nbytes}) runs past the end of host buffer {self.id} "
                f"({self.nbytes} bytes at 0x{self.ptr:x})")
        return offset

    def close(self) -> None:
        """Unmap and free. Views returned by `view()` must be gone first."""
        with self._closing:
            if self._mmap is None:
                return
            self._bytes = None
            self._owner._releasing()
            try:
                self._mmap.close()
            except BufferError:
                self._bytes = np.frombuffer(self._mmap, np.uint8)
                raise MisuseError(f"host buffer {self.id} still has live views; drop them first") from None
            self._mmap = None
        self._reclaim()

    def detach(self) -> bool:
        """Move this buffer, in place, onto fresh memory holding the same bytes, under a new
        id (False: closed, or the daemon's own memory, which stays). What mapped the old
        memory, a daemon still running a call the worker gave up on, no longer reaches
        what the worker reads and writes at `.ptr`; the release listeners hear of the old
        id, so every daemon connection that had imported it forgets it, and a later call
        imports the new memory."""
        old: int | None = None
        try:
            with self._closing:
                if self._mmap is None or self.adopted:
                    return False
                old = self._name.id
                self._move(self._mmap, self._owner.next_id())
        finally:
            if old is not None and self._name.id != old:  # (moved, if cut short after)
                self._owner._released(old, self.ptr)
        return True

    def _move(self, mapped: mmap.mmap, new_id: int) -> None:
        """(Under _closing) detach's work: onto a copy of `mapped`, under `new_id`. Cut short
        (an interrupt lands as a long call returns: for a big buffer the copy, unmapping the
        old), the worker's mapping, the fd and the id would name two memories, or none
        would have moved where the lost call's daemon may still write."""
        despite_interrupts(lambda: self._copy_and_put_on(mapped, new_id))

    def _copy_and_put_on(self, mapped: mmap.mmap, new_id: int) -> None:
        fresh = _sealed_memfd(self.size)
        try:
            self._onto = (fresh, new_id, False)
            self._owner._releasing()  # (ops built from the address before are stale now)
            # Written through the fd, not a mapping of it: an mmap object holds a duplicate
            # of the fd, which a fork's child would keep open, with the fresh memory
            with memoryview(mapped) as source:
                copied = 0
                while copied < self.size:  # (one write takes at most 2 GiB)
                    copied += os.pwrite(fresh, source[copied:], copied)
            self._onto = (fresh, new_id, True)
            self._put_on(fresh, new_id)
        finally:
            self._onto = None  # (before the close: a child forked between would close another fd)
            os.close(fresh)

    def _finish_move(self) -> None:
        """(In a fork's child) A parent thread's move of this buffer, cut short by the fork:
        done if the copy was (the address may be on the fresh memory, the fd and the id
        not yet), and the fresh memory's fd, which nothing else would close, closed."""
        if self._onto is None:
            return
        fresh, new_id, copied = self._onto
        self._onto = None
        try:
            if copied:
                self._put_on(fresh, new_id)
        finally:
            os.close(fresh)

    def _put_on(self, fresh: int, new_id: int) -> None:
        _map_over(self.ptr, self.size, fresh)
        # The same number, so an import on another thread sends one memory or the other,
        # never a closed (or reused) fd; the old memory goes with the last map
        os.dup2(fresh, self.fd, inheritable=False)
        if self._name.id != new_id:  # (once, if done again after an interrupt)
            self._owner.moves.record(self._name.id, self)
        self._name.id = new_id
        self._owner._enter(self)

    def __enter__(self) -> HostBuffer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self.closed else f"ptr=0x{self.ptr:x}"
        return f"HostBuffer(id={self.id}, nbytes={self.nbytes}, {state})"


class _View:
    """The base of a view: `x = alloc(n).view(...)` keeps only the view, and a collection
    must not free the buffer under it (its memory would stay mapped for the view, but a
    call on x.ctypes.data is refused, and the daemon told to let go of it)."""

    __slots__ = ("__array_interface__", "_array", "_buffer")

    def __init__(self, array: np.ndarray, buffer: HostBuffer) -> None:
        self.__array_interface__ = array.__array_interface__
        self._array = array  # (holds the mapping's export: close() still refuses while it lives)
        self._buffer = buffer


def _reclaim(owner: HostMemory, name: _Name, ptr: int, mapped: mmap.mmap, fd: int) -> None:
    if _FORKING and _FORKING[0] != os.getpid():  # a fork's child whose locks are not fresh yet
        _DEFERRED.append((owner, name, ptr, mapped, fd))
        return
    owner._releasing()
    with contextlib.suppress(BufferError):  # dropped with live views: unmapped when they go
        mapped.close()
    os.close(fd)
    owner._released(name.id, ptr)


class HostMemory:
    """A process's table of host buffers, searchable by address."""

    def __init__(self) -> None:
        # Reentrant: a buffer's finalizer may run (GC) while this thread holds the lock.
        self._lock = threading.RLock()
        self._starts: list[int] = []
        self._by_start: dict[int, tuple[int, weakref.ref[HostBuffer]]] = {}
        self._listeners: list[weakref.WeakMethod[ReleaseListener]] = []
        # Bumped before a buffer is unmapped, so before its address can be handed out again
        # (the listeners hear of it only after): what was built from an address before is
        # stale; and again once its entry is gone, for what was built from the entry meanwhile
        self.releases = 0
        self.moves = Moves(self._lock, self._live)  # (which buffers a lost call moves, and when)
        _TABLES.add(self)

    def next_id(self) -> int:
        return next(_IDS)

    def alloc(self, nbytes: int) -> HostBuffer:
        nbytes, = as_ints(nbytes=nbytes)
        if nbytes < 0:
            raise MisuseError(f"cannot allocate {nbytes} bytes")
        if nbytes > sys.maxsize:  # (ftruncate and mmap take a C long: past it Python's words name no size)
            raise LimitExceeded(f"cannot allocate {nbytes} bytes of host memory: more than the "
                                f"{sys.maxsize} bytes a mapping can hold")
        try:
            fd = _sealed_memfd(max(nbytes, 1))
            try:
                buffer = HostBuffer(self, self.next_id(), fd, nbytes)
            except BaseException:  # (never mapped: its finalizer, which closes the fd, never made)
                os.close(fd)
                raise
        except (OSError, OverflowError, ValueError) as exc:  # RLIMIT_AS, ENOMEM, EMFILE, max_map_count
            hint = ("; each host buffer holds one of this process's open files: raise its limit "
                    "(ulimit -n)" if getattr(exc, "errno", None) == errno.EMFILE else "")
            raise LimitExceeded(f"cannot allocate {nbytes} bytes of host memory here: {exc}{hint}") from exc
        return self._enter(buffer)

    def adopt(self, fd: int, nbytes: int, buffer_id: int) -> HostBuffer:
        """Map a memfd made elsewhere (the daemon's symmetric_alloc) into this table; the
        fd stays the caller's if this raises. A ProtocolError if the fd is unfit for it."""
        why = _unfit_memfd(fd, max(nbytes, 1))
        if why is not None:
            raise ProtocolError(f"the daemon's memory for buffer {buffer_id} {why}")
        return self._enter(HostBuffer(self, buffer_id, fd, nbytes, adopted=True))

    def _enter(self, buffer: HostBuffer) -> HostBuffer:
        with self._lock:
            # The address may be a buffer's just unmapped on another thread whose entry is not
            # gone yet: this one takes it over (the old one's release then leaves it be).
            if buffer.ptr not in self._by_start:
                bisect.insort(self._starts, buffer.ptr)
            self._by_start[buffer.ptr] = (buffer.id, weakref.ref(buffer))
        return buffer

    def _live(self, buffer_ids: Collection[int]) -> list[HostBuffer]:
        """The live buffers among `buffer_ids`."""
        with self._lock:
            found = [ref() for buffer_id, ref in self._by_start.values() if buffer_id in buffer_ids]
        return [buffer for buffer in found if buffer is not None]

    def find(self, ptr: int, nbytes: int) -> tuple[HostBuffer, int]:
        """The buffer holding [ptr, ptr+nbytes) and the offset of ptr in it."""
        buffer = self.locate(ptr)
        if buffer is None:
            raise MisuseError(
                f"pointer 0x{ptr:x} is not in host memory the daemon can open "
                "(allocate it with client.hostmem.alloc)")
        return buffer, buffer.offset_of(ptr, nbytes)

    def locate(self, ptr: int) -> HostBuffer | None:
        """The live buffer whose mapping holds `ptr`, or None (it may be device memory)."""
        with self._lock:
            i = bisect.bisect_right(self._starts, ptr) - 1
            buffer = self._by_start[self._starts[i]][1]() if i >= 0 else None
        if buffer is None or ptr >= buffer.ptr + buffer.size:
            return None
        return buffer

    def on_release(self, listener: ReleaseListener) -> None:
        """Call `listener(buffer_id)` when a buffer is freed (held weakly: a bound method)."""
        with self._lock:
            # Copy on write, never in place: an allocation here may start a collection that
            # runs a buffer's finalizer on this thread (the lock is reentrant), which reads
            # the list; one that rebound or pruned it would lose this listener.
            added = weakref.WeakMethod(listener)
            self._listeners = [ref for ref in self._listeners if ref() is not None] + [added]

    def _releasing(self) -> None:
        with self._lock:
            self.releases += 1

    def _released(self, buffer_id: int, ptr: int) -> None:
        with self._lock:
            entry = self._by_start.get(ptr)
            if entry is not None and entry[0] == buffer_id:
                del self._by_start[ptr]
                self._starts.remove(ptr)
            self.releases += 1
            listeners = self._listeners  # (never changed in place: see on_release)
        # Every listener hears of it, whichever raises: a backend skipped would never tell
        # its daemon (the first error is raised once all have heard)
        failed: list[BaseException] = []
        for ref in listeners:
            listener = ref()
            if listener is not None:
                try:
                    listener(buffer_id)
                except BaseException as exc:  # (an interrupt too: a finalizer runs only once)
                    failed.append(exc)
        if failed:
            raise failed[0]


# Every table of this process (see _in_forked_child).
_TABLES: weakref.WeakSet[HostMemory] = weakref.WeakSet()
_BUFFERS: weakref.WeakSet[HostBuffer] = weakref.WeakSet()  # every live buffer
_FORKING: list[int] = []  # the pid of the process a fork is under way from
_DEFERRED: list[tuple[HostMemory, _Name, int, mmap.mmap, int]] = []  # the child's, till then


def _before_fork() -> None:
    # A collection in the child's at-fork hooks that run before ours (threading's) would run
    # a dropped buffer's finalizer on its table's old lock: in a child whose locks are not
    # fresh yet, _reclaim defers it to _in_forked_child. (Switching gc off and on around
    # the fork would undo a gc.disable() another thread makes meanwhile.)
    _FORKING[:] = [os.getpid()]


def _after_in_parent() -> None:
    _FORKING.clear()


def _in_forked_child() -> None:
    """A fork copies every table with its lock as it was: held, perhaps, by a parent thread
    the child lacks, midway through an update, and every buffer with its own lock (one a
    parent thread was closing). The child's allocations, closes and collected buffers would
    wait for them for good, so each gets a fresh lock, and each table's index is rebuilt
    from its entries (all an update can leave half done; a close cut short is safe to do
    again). The fork itself never waits for a table: a thread holding one may be waiting
    for another (a collection's finalizer) or for the forking thread."""
    try:
        for table in list(_TABLES):
            table._lock = threading.RLock()
            table._starts = sorted(table._by_start)
            table.moves.in_forked_child(table._lock)
        for buffer in list(_BUFFERS):  # (one whose address another took over is in no table)
            buffer._closing = threading.Lock()
            buffer._finish_move()
    finally:
        _FORKING.clear()
    deferred, _DEFERRED[:] = list(_DEFERRED), []
    for args in deferred:
        _reclaim(*args)


os.register_at_fork(before=_before_fork, after_in_parent=_after_in_parent, after_in_child=_in_forked_child)

_DEFAULT = HostMemory()


def default_memory() -> HostMemory:
    """The table `alloc()` uses."""
    return _DEFAULT


def alloc(nbytes: int) -> HostBuffer:
    """Allocate `nbytes` of shared host memory in the default table."""
    return _DEFAULT.alloc(nbytes)
