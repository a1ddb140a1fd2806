"""symmetric_alloc's memory: made by the daemon, mapped into the worker."""

from __future__ import annotations

import contextlib
import functools
import os
import threading
from collections.abc import Callable

import proto

from .errors import CommError, LimitExceeded, MisuseError, ProtocolError
from .hostmem import HostBuffer, HostMemory
from .imported import ImportedBuffers
from .memory import MemoryResolver
from .rpc import Requester, Superseded


class SymmetricMemory:
    """The pointers symmetric_alloc handed out: host memory (the daemon's memfd, mapped
    here) or device memory (ncclMemAlloc in the daemon, exported as an fd and mapped
    through the driver). Each is freed at the daemon that made it (the connection, `link`,
    it came on); if a rejoin replaced that one, ours is the only copy, and the new daemon
    may have imported it as a plain buffer. Safe from several threads; `lock` is the
    backend's, the one `link()` changes under."""

    def __init__(self, lock: threading.RLock, request: Requester, fresh_due: Callable[[], float],
                 memory: HostMemory, resolver: MemoryResolver, imports: ImportedBuffers,
                 link: Callable[[], int], gone: Callable[[int], bool],
                 closed: Callable[[], bool]) -> None:
        self._lock = lock
        self._request = request
        self._fresh_due = fresh_due  # the deadline of a call starting now (a clean-up's own)
        self._memory = memory
        self._resolver = resolver
        self._imports = imports
        self._link = link
        self._gone = gone  # whether a daemon connection is no more (its memory went with it)
        self._host: dict[int, tuple[HostBuffer, int]] = {}  # ptr -> (the mapping, its link)
        self._device: dict[int, tuple[int, int, int]] = {}  # ptr -> (buffer id, size mapped, link)
        # host ptrs let go of here whose free the daemon did not confirm (its call failed): a
        # free made again is told so, not that the pointer was never ours (unless the address
        # is in use again: symmetric_alloc's, or a plain host buffer's)
        self._unconfirmed: set[int] = set()
        self._closed = closed  # the backend's: set under the lock, as it takes our buffers (let_go)

    def alloc(self, nbytes: int, due: float) -> int:
        buffer_id = self._memory.next_id()
        answer = self._request(lambda rid: proto.SymAlloc(rid, buffer_id, nbytes), due=due,
                               undo=functools.partial(_sym_free_late, buffer_id))
        # device memory (ncclMemAlloc) from a daemon whose engine has it, mapped through the
        # driver (the answering daemon's: a rejoin may have replaced the one of the request)
        on_device = answer.engine != "host"
        adopted: int | None = None  # the fd a host buffer keeps; the others are closed here
        try:
            if len(answer.fds) != 1:
                raise ProtocolError(f"symmetric_alloc reply carried {len(answer.fds)} fds, expected 1")
            fd = answer.fds[0]
            if on_device:
                ptr, size = self._resolver.map_symmetric(fd, nbytes, buffer_id)
                unmap: Callable[[], None] = functools.partial(self._resolver.unmap_symmetric,
                                                              buffer_id, ptr, size)
            else:
                try:
                    buffer = self._memory.adopt(fd, nbytes, buffer_id)
                except (OSError, ValueError) as exc:  # cannot map it here (RLIMIT_AS, ENOMEM, max_map_count)
                    raise LimitExceeded(f"cannot map {nbytes} bytes of symmetric memory here: {exc}") from exc
                adopted = fd
                ptr, unmap = buffer.ptr, buffer.close
        except BaseException:  # unusable here: the daemon lets go of it now, not at our close
            with contextlib.suppress(CommError):  # (by a deadline of its own: the call's may be spent)
                self._sym_free(buffer_id, answer.link, self._fresh_due())
            raise
        finally:
            for fd in answer.fds:
                if fd != adopted:
                    os.close(fd)
        with self._lock:
            if not self._closed():
                if answer.link == self._link():  # (else a rejoin replaced that daemon meanwhile)
                    self._imports.add(buffer_id)
                if on_device:
                    self._device[ptr] = (buffer_id, size, answer.link)
                else:
                    self._host[ptr] = (buffer, answer.link)
                    self._unconfirmed.discard(ptr)  # (the address, taken again)
                return ptr
        unmap()  # close() came meanwhile, and let go of the rest
        raise MisuseError("the backend is closed")

    def free(self, ptr: int, due: float) -> None:
        with self._lock:  # claimed, so that close() on another thread does not free it too
            device = self._device.pop(ptr, None)
            host = self._host.pop(ptr, None)
        if device is not None:
            buffer_id, size, link = device
            try:
                self._sym_free(buffer_id, link, due)
            except BaseException:
                with self._lock:
                    kept = not self._closed()
                    if kept:  # not freed: the caller may try again
                        self._device[ptr] = device
                if not kept:  # close() came meanwhile and no longer saw it
                    self._resolver.unmap_symmetric(buffer_id, ptr, size)
                raise
            self._resolver.unmap_symmetric(buffer_id, ptr, size)
            return
        if host is None:
            # (a plain hostmem.alloc may have taken the address again since: a buffer the
            # worker holds, not the one freed here)
            reused = self._memory.locate(ptr) is not None
            with self._lock:
                if reused:
                    self._unconfirmed.discard(ptr)
                unconfirmed = ptr in self._unconfirmed
            if unconfirmed:
                raise MisuseError(f"0x{ptr:x} was freed here already; the daemon had not confirmed it "
                                  "when that symmetric_free failed: it lets go of the memory once it "
                                  "reads the request (or went, and the memory with it)")
            raise MisuseError(f"0x{ptr:x} is not a pointer from this backend's symmetric_alloc")
        buffer, link = host
        # Ours first: with views of it alive this refuses, and nothing has changed (told the
        # daemon first, the memory would be gone there and the pointer unknown here for good)
        try:
            buffer.close()
        except MisuseError:
            with self._lock:
                if not self._closed():  # (else close() has let go of the rest)
                    self._host[ptr] = host
            raise
        try:
            self._sym_free(buffer.id, link, due)
        except BaseException:
            with self._lock:
                self._unconfirmed.add(ptr)
            raise

    def let_go(self) -> Callable[[], None]:
        """(Under the lock, as the backend closes) Take every buffer; the call returned unmaps
        them, outside the lock (host ones the worker still holds views of stay mapped until
        the views go)."""
        host, self._host = [buffer for buffer, _ in self._host.values()], {}
        device, self._device = self._device, {}
        self._unconfirmed.clear()

        def unmap() -> None:
            for ptr, (buffer_id, size, _) in device.items():
                with contextlib.suppress(MisuseError):  # the driver or the mapping is gone: nothing to undo
                    # Left in the cache (a closed backend's, read no more): close() may run
                    # in a signal handler that cut into the cache's bookkeeping on this
                    # thread, under its lock, and a reentrant lock would let it change the
                    # tables part way through (find takes an entry out and puts it back,
                    # _insert loops over them)
                    self._resolver.unmap_symmetric(buffer_id, ptr, size, discard=False)
            for buffer in host:
                with contextlib.suppress(MisuseError):
                    buffer.close()

        return unmap

    def _sym_free(self, buffer_id: int, link: int, due: float) -> None:
        """Tell the daemon that made it (on connection `link`), unless it is gone."""
        try:
            self._request(lambda rid: proto.SymFree(rid, buffer_id), due=due, link=link)
        except (Superseded, CommError) as exc:
            # Gone (replaced, or broken: the daemon died, or the connection was dropped), and
            # its memory with it: ours is the only copy, and this free is done
            if isinstance(exc, CommError) and not self._gone(link):
                raise
        with self._lock:
            # a daemon a rejoin put in place since may have imported it as a plain buffer: it
            # forgets it as one (the one that made it dropped it from its imports with it)
            self._imports.release(buffer_id, forget=link != self._link())


def _sym_free_late(buffer_id: int, reply: proto.Message, request_id: int) -> proto.Message | None:
    """A symmetric allocation that timed out but was made: the daemon frees it."""
    return proto.SymFree(request_id, buffer_id) if isinstance(reply, proto.Ok) else None
