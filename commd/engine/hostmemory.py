"""Workers' host memory in the daemon: a memfd mapped here (HostMapping), and unmapped
off the event loop once no op holds it (Unmapper).

Memory arrives as a memfd over SCM_RIGHTS; it must be sealed against shrinking, since a
worker that truncated a mapped file would make the daemon fault (SIGBUS) on the next
access.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import fcntl
import gc
import mmap
import os
import stat
import weakref
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from proto import ErrorCode

from ..errors import CallError

_SEALS_NEEDED = fcntl.F_SEAL_SHRINK


class HostRegion:
    __slots__ = ("array",)

    def __init__(self, array: np.ndarray) -> None:
        self.array = array

    @property
    def nbytes(self) -> int:
        return int(self.array.nbytes)


class Unmapper:
    """Unmaps closed mappings on a thread of its own: the last unmap of a departed
    worker's memory frees every page of it, ~1.5 s for 10 GiB, time the loop would not
    serve anyone (its peers would take that for a lost daemon). Mappings closed while
    something still held a view of them (an op in flight, or a failed op's traceback in
    a reference cycle) are retried until they unmap, so a departed client's memory is
    let go within about a second, not at the next collection, which the daemon's tuned
    collector may not run for a long time. `on_released` runs on the loop, once unmapped."""

    RETRY_S = 0.5
    # What the loop unmaps itself in one turn, of mappings no view holds (~0.1 ms of page
    # frees, less than the thread's round trip); more (a departing worker's thousands of
    # buffers, or one large one) goes on the thread
    AT_ONCE_BYTES = 1 << 20

    def __init__(self) -> None:
        self._maps: list[tuple[mmap.mmap, Callable[[], None] | None]] = []  # and who waits for it
        self._timer: asyncio.TimerHandle | None = None
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="commd-unmap")
        self._in_flight = 0  # handed to the thread, not yet back
        self._at_once = 0  # bytes the loop unmapped itself this turn

    def release(self, mapped: mmap.mmap, on_released: Callable[[], None] | None = None) -> None:
        if self._unmapped_at_once(mapped, on_released):
            return
        try:
            loop = asyncio.get_running_loop()
            self._thread.submit(self._unmap, loop, mapped, on_released)
        except RuntimeError:  # no loop (closed by hand), or shut down: here and now
            if not unmap(mapped, on_released) and on_released is not None:
                on_released()  # (unmapped with the last view; nobody can wait for that)
            return
        self._in_flight += 1

    def _unmapped_at_once(self, mapped: mmap.mmap, on_released: Callable[[], None] | None) -> bool:
        """Unmapped here, on the loop, within this turn's AT_ONCE_BYTES (no view held it)."""
        size = len(mapped)
        if self._at_once + size > self.AT_ONCE_BYTES:
            return False
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return False
        if not unmap(mapped, on_released):
            return False
        if self._at_once == 0:
            loop.call_soon(self._new_turn)
        self._at_once += size
        return True

    def _new_turn(self) -> None:
        self._at_once = 0

    def _unmap(self, loop: asyncio.AbstractEventLoop, mapped: mmap.mmap,
               on_released: Callable[[], None] | None) -> None:
        """(on the thread)"""
        done = unmap(mapped, None)
        with contextlib.suppress(RuntimeError):  # the loop is gone, and whoever waited with it
            loop.call_soon_threadsafe(self._back, mapped, on_released, done)

    def _back(self, mapped: mmap.mmap, on_released: Callable[[], None] | None, done: bool) -> None:
        self._in_flight -= 1
        if not done:
            self._maps.append((mapped, on_released))
            self._schedule()
        elif on_released is not None:
            on_released()

    def __len__(self) -> int:
        return len(self._maps) + self._in_flight

    def _schedule(self) -> None:
        if self._timer is None and self._maps:
            self._timer = asyncio.get_running_loop().call_later(self.RETRY_S, self._sweep)

    def _sweep(self) -> None:
        self._timer = None
        gc.collect()  # views kept only by garbage cycles go now
        maps, self._maps = self._maps, []
        for mapped, on_released in maps:
            self.release(mapped, on_released)

    def close(self) -> None:
        """Wait for the unmaps under way."""
        self._thread.shutdown(wait=True)


def unmap(mapped: mmap.mmap, on_released: Callable[[], None] | None) -> bool:
    """Unmap now and tell `on_released`; False (nothing done) while a view is still held."""
    try:
        mapped.close()
    except BufferError:
        return False
    if on_released is not None:
        on_released()
    return True


_OUT_OF_RESOURCES = (errno.EMFILE, errno.ENFILE, errno.ENOMEM)


def open_files_hint(exc: OSError) -> str:
    """What to do, said after `exc`, if the daemon's open-file limit caused it: the client
    hears it too, and a worker near its own limit would take it for that one."""
    if exc.errno != errno.EMFILE:
        return ""
    return "; each buffer the daemon maps holds one of its open files: raise its LimitNOFILE"


class HostMapping:
    """A shared mapping of one memfd (`fd` stays the caller's). Closing drops it; a view
    still held keeps it (see Unmapper)."""

    def __init__(self, fd: int, size: int, unmapper: Unmapper) -> None:
        try:
            # first, as it asks the file's filesystem nothing: a client's fd may be of a
            # FUSE file, whose fstat waits on its server (for good, if it never answers)
            try:
                seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
            except OSError:
                raise CallError(ErrorCode.BAD_MEMORY, "host memory must be a sealable memfd") from None
            info = os.fstat(fd)
            if not stat.S_ISREG(info.st_mode):
                raise CallError(ErrorCode.BAD_MEMORY, "host memory must be a memfd")
            if info.st_size < size:
                raise CallError(ErrorCode.BAD_MEMORY,
                                f"memfd holds {info.st_size} bytes, {size} were claimed")
            if not seals & _SEALS_NEEDED:
                raise CallError(ErrorCode.BAD_MEMORY, "memfd must be sealed against shrinking")
            if seals & fcntl.F_SEAL_WRITE:  # (mmap's EPERM would say only "Operation not permitted")
                raise CallError(ErrorCode.BAD_MEMORY, "memfd is sealed against writing: results "
                                "are written into host memory")
            self._mmap: mmap.mmap | None = mmap.mmap(fd, size, mmap.MAP_SHARED,
                                                     mmap.PROT_READ | mmap.PROT_WRITE)
        except OSError as exc:
            # out of fds (the mmap keeps a copy of the fd) or of memory: the daemon's limits
            code = ErrorCode.LIMIT if exc.errno in _OUT_OF_RESOURCES else ErrorCode.BAD_MEMORY
            raise CallError(code, f"cannot map host memory: {exc}{open_files_hint(exc)}") from None
        self._array: np.ndarray | None = np.frombuffer(self._mmap, np.uint8)
        self._size = size
        self._unmapper = unmapper

    @property
    def size(self) -> int:
        return self._size

    @property
    def device(self) -> int | None:
        return None

    def region(self, offset: int, nbytes: int) -> HostRegion:
        if self._array is None:
            raise CallError(ErrorCode.UNKNOWN_BUFFER, "buffer was released")
        if offset + nbytes > self._size:
            raise CallError(
                ErrorCode.BAD_MEMORY,
                f"bytes [{offset}, {offset + nbytes}) are outside the {self._size}-byte allocation",
            )
        return HostRegion(self._array[offset:offset + nbytes])

    def close(self, on_released: Callable[[], None] | None = None,
              on_let_go: Callable[[], None] | None = None) -> None:
        mapped, self._mmap = self._mmap, None
        if mapped is None or self._array is None:
            return
        # every region is a view of the array and keeps it alive: gone with our reference,
        # no op holds the memory, and the caller hears so now, not when the unmap (on the
        # thread, for a large mapping) comes back, which is after the client's next packet
        views = weakref.ref(self._array)
        self._array = None
        if on_let_go is not None:
            if views() is None:
                on_let_go()
            else:  # (an op holds it: it lets go as the unmap succeeds)
                on_released = _one_then_other(on_let_go, on_released)
        self._unmapper.release(mapped, on_released)


def _one_then_other(first: Callable[[], None], then: Callable[[], None] | None) -> Callable[[], None]:
    def both() -> None:
        first()
        if then is not None:
            then()
    return both


def create_memfd(nbytes: int, name: str) -> int:
    """A memfd of `nbytes`, sealed so neither side can shrink or grow it."""
    fd = os.memfd_create(name, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        os.ftruncate(fd, nbytes)
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS,
                    fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL)
    except BaseException:
        os.close(fd)
        raise
    return fd
