"""Turning a worker's (pointer, bytes) into something the daemon can open (DESIGN §4).

`MemoryResolver` is the one place that knows memory kinds: host buffers first
(a bisect in the process's table), then CUDA device memory (`client.cuda`) when
a driver is available. The CUDA side starts lazily, on the first pointer that
is not host memory, so a host-only process never imports cuda-bindings.

fd ownership for an Import: a host buffer owns its memfd and keeps it open (the
daemon gets its own copy by SCM_RIGHTS); a VMM allocation's fd is exported for
that one Import and closed right after it is sent (`import_fds`).
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

from proto import MemKind

from .cuda import CudaDriver, CudaMemory, available_driver
from .errors import MisuseError
from .hostmem import HostBuffer, HostMemory

DriverFactory = Callable[[], CudaDriver | None]


@dataclass(frozen=True, slots=True)
class MemoryRef:
    """Where a span lives: an allocation (id, kind, size, how to open it) and an offset."""

    kind: MemKind
    buffer_id: int
    size: int
    offset: int
    fd: int | None  # a host buffer's own fd, sent beside the first Import; the buffer keeps it open
    handle: bytes = b""
    # a host buffer, held while its ref is: a collection must not free it (and close its fd)
    # in the middle of its import
    owner: HostBuffer | None = None


def resolve(memory: HostMemory, ptr: int, nbytes: int) -> MemoryRef | None:
    """The host allocation holding [ptr, ptr+nbytes), or None for an empty span.

    Raises MisuseError for a pointer the daemon could not open or a span that
    runs past its allocation.
    """
    if nbytes == 0:
        return None
    buffer, offset = memory.find(ptr, nbytes)
    return _host_ref(buffer, offset)


def _host_ref(buffer: HostBuffer, offset: int) -> MemoryRef:
    return MemoryRef(MemKind.HOST, buffer.id, buffer.size, offset, buffer.fd, owner=buffer)


class MemoryResolver:
    """One backend's view of the memory it hands its daemon.

    CUDA buffer ids come from `host.next_id()`, the counter host buffers use, so ids on
    one connection never collide. `on_forget(id)` hears of CUDA allocations found freed
    (or evicted); the backend tells the daemon to close them.
    """

    def __init__(self, host: HostMemory, *, driver: DriverFactory = available_driver,
                 device: int | None = None, on_forget: Callable[[int], None] = lambda _id: None) -> None:
        self._host = host
        self._driver_factory = driver
        self._device = device
        self._on_forget = on_forget
        self._probe_lock = threading.Lock()
        self._probed = False
        self._cuda: CudaMemory | None = None
        self._building = threading.local()  # see noting_device

    def host_releases(self) -> int:
        """How many host buffers have begun to be released (see HostMemory.releases)."""
        return self._host.releases

    def resolve(self, ptr: int, nbytes: int) -> MemoryRef | None:
        """The allocation holding [ptr, ptr+nbytes), or None for an empty span.

        Raises MisuseError for a pointer the daemon could not open, a span that runs
        past its allocation, or device memory of another device than the backend's.
        """
        if nbytes == 0:
            return None
        buffer = self._host.locate(ptr)
        if buffer is not None:
            return _host_ref(buffer, buffer.offset_of(ptr, nbytes))
        cuda = self._cuda_memory()
        if cuda is None:
            return resolve(self._host, ptr, nbytes)  # raises the host table's own error
        found = cuda.find(ptr, nbytes)
        if found is None:
            raise MisuseError(
                f"pointer 0x{ptr:x} is neither in host memory the daemon can open "
                "(client.hostmem.alloc) nor in CUDA device memory")
        allocation, offset = found
        device: set[int] | None = getattr(self._building, "device", None)
        if device is not None:
            device.add(allocation.id)
        return MemoryRef(allocation.kind, allocation.id, allocation.size, offset, None, allocation.handle)

    def host_ref(self, buffer: HostBuffer, offset: int) -> MemoryRef:
        return _host_ref(buffer, offset)

    def still_known(self, ref: MemoryRef) -> bool:
        """Whether `ref`'s allocation was not let go of since it was resolved (freed, evicted,
        moved: HostBuffer.detach): if it was, its release listener has run already."""
        if ref.owner is not None:
            return not ref.owner.closed and ref.owner.id == ref.buffer_id
        cuda = self._cuda
        return cuda is not None and cuda.owns(ref.buffer_id)

    def still_cached(self, buffer_ids: Iterable[int]) -> bool:
        """Whether these CUDA allocations are all still in the cache (none evicted or found freed)."""
        cuda = self._cuda
        return all(cuda is not None and cuda.owns(b) for b in buffer_ids)

    @contextlib.contextmanager
    def noting_device(self) -> Iterator[set[int]]:
        """The ids of the CUDA allocations this thread resolves meanwhile (an op's build).
        Known as device memory when resolved: asked after, an allocation another thread's
        call has evicted from the cache since would pass for host memory."""
        outer = getattr(self._building, "device", None)
        device: set[int] = set()
        self._building.device = device
        try:
            yield device
        finally:
            self._building.device = outer

    def device_uuid(self) -> bytes:
        """The backend's GPU's CUDA UUID, for the daemon to find the GPU by (its ordinal of
        it may differ from ours); empty without a device or a driver."""
        if self._device is None:
            return b""
        cuda = self._cuda_memory()
        if cuda is None:
            return b""
        try:
            return cuda.driver.device_uuid(self._device)
        except MisuseError:  # the daemon then takes our ordinal for its own, as before
            return b""

    def map_symmetric(self, fd: int, nbytes: int, buffer_id: int) -> tuple[int, int]:
        """Map the daemon's device allocation `buffer_id` (its fd, not consumed): the pointer
        and the size mapped."""
        cuda = self._cuda_memory()
        if cuda is None:
            raise MisuseError("the daemon allocated device memory, but this process has no CUDA driver")
        ptr, size = cuda.driver.map_shared(fd, nbytes, self._device or 0)
        try:
            cuda.adopt(ptr, buffer_id)
        except BaseException:
            cuda.driver.unmap_shared(ptr, size)
            raise
        return ptr, size

    def unmap_symmetric(self, buffer_id: int, ptr: int, size: int, *, discard: bool = True) -> None:
        """Unmap the daemon's device allocation `buffer_id`; `discard`: drop it from the cache
        too (False: for a closed backend, whose cache nothing reads again)."""
        cuda = self._cuda
        if cuda is not None:
            if discard:
                cuda.discard(buffer_id)
            cuda.driver.unmap_shared(ptr, size)

    @property
    def driver(self) -> CudaDriver | None:
        """The CUDA driver, once a device pointer was seen (None before, and without one)."""
        return self._cuda.driver if self._cuda is not None else None

    def still_valid(self, buffer_ids: Iterable[int]) -> bool:
        """Whether these CUDA allocations are all alive; the freed ones are forgotten."""
        cuda = self._cuda
        return cuda is not None and cuda.still_valid(buffer_ids)

    @contextlib.contextmanager
    def import_fds(self, ref: MemoryRef) -> Iterator[list[int]]:
        """The fds to send beside `ref`'s Import. An fd exported for it (VMM) is ours and closed
        on exit, sent or not: the daemon holds its own copy once SCM_RIGHTS delivered it."""
        if ref.kind is not MemKind.CUDA_VMM:
            yield [ref.fd] if ref.fd is not None else []
            return
        cuda = self._cuda
        if cuda is None:
            raise MisuseError(f"buffer {ref.buffer_id} is not CUDA memory")
        fd = cuda.export_fd(ref.buffer_id)
        try:
            yield [fd]
        finally:
            os.close(fd)

    def _cuda_memory(self) -> CudaMemory | None:
        """The CUDA side, started once: None without a driver (asked once, then remembered)."""
        if not self._probed:
            with self._probe_lock:
                if not self._probed:
                    driver = self._driver_factory()
                    if driver is not None:
                        self._cuda = CudaMemory(driver, self._host.next_id, device=self._device,
                                                on_forget=self._on_forget)
                    self._probed = True
        return self._cuda
