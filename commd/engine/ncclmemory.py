"""Device memory and worker events the NCCL engine opened, and when they may go.

Memory an op uses is held from the op's creation until the device is done with it;
closing lets it go once nothing holds it (releasing memory under a running kernel
would fault the GPU). The frees themselves run off the event loop (`Freer`).
"""

from __future__ import annotations

import contextlib
import functools
import logging
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

from proto import ErrorCode

from ..errors import CallError
from .gpu import Gpu, GpuError, Imported, Origin
from .launches import Launches
from .ncclgate import NcclGate, loop_running
from .stuckwatch import StuckWatch

log = logging.getLogger("commd.engine.nccl")


class NcclRegion:
    """A bounds-checked window of device memory, valid in the daemon's contexts."""

    __slots__ = ("mapping", "nbytes", "ptr")

    def __init__(self, mapping: NcclMapping, ptr: int, nbytes: int) -> None:
        self.mapping = mapping
        self.ptr = ptr
        self.nbytes = nbytes

    @property
    def device(self) -> int:
        return self.mapping.device


class UsedByOps:
    """Something ops on the device may still use: closing lets it go (`free`) once none
    holds it."""

    def __init__(self, free: Callable[[], None]) -> None:
        self._free = free
        self._users = 0
        self._closing = False
        self._on_released: Callable[[], None] | None = None
        self._on_let_go: Callable[[], None] | None = None

    def hold(self) -> None:
        """An op will use it: refused once it is closing (released, or about to be), so an
        op queued before its buffer was forgotten never runs on freed memory."""
        if self._closing:
            raise CallError(ErrorCode.UNKNOWN_BUFFER, "memory of this op was released before it ran")
        self._users += 1

    def let_go(self) -> None:
        self._users -= 1
        if self._closing and self._users == 0:
            self._release()

    def close(self, on_released: Callable[[], None] | None = None,
              on_let_go: Callable[[], None] | None = None) -> None:
        if self._closing:
            return
        self._closing = True
        self._on_released, self._on_let_go = on_released, on_let_go
        if self._users == 0:
            self._release()

    def _release(self) -> None:
        self._free()
        done = (self._on_let_go, self._on_released)
        self._on_let_go = self._on_released = None
        for told in done:
            if told is not None:
                told()


class Freer:
    """Lets go of device memory off the event loop's thread. cuMemFree and cuMemUnmap may
    wait for the whole device, and a kernel in flight there may wait for a launch that
    needs this loop (another daemon's, waiting for word from this one): on the loop that
    would hang the daemon. Nor does a free start inside a launch (see launches.py).
    ncclMemAlloc's memory goes by ncclMemFree, an NCCL call, so through the NcclGate,
    which keeps it out of an abort's way; the gate's thread must never wait (an abort may
    be next), so a free it finds inside a launch goes back to the loop until that ends.
    Every free is watched by the StuckWatch (the gate's by the gate): one that never
    returns would hold the next frees, and the daemon's stop, for ever."""

    def __init__(self, gpu: Gpu, gate: NcclGate, stuck: StuckWatch) -> None:
        self._gpu = gpu
        self._gate = gate
        self._stuck = stuck
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="commd-cuda-free")
        self._closed = False
        self.launches = Launches()

    def free(self, memory: Imported) -> None:
        if memory.origin is Origin.NCCL:
            self.launches.after(functools.partial(self._nccl_free, memory))
            return
        if not self._closed:
            try:
                self._thread.submit(self._release_between_launches, memory)
                return
            except RuntimeError:  # closed meanwhile: free it here
                pass
        self._watched_release(memory)

    def _nccl_free(self, memory: Imported) -> None:
        looped = loop_running()  # (without a loop nothing launches)
        handed_back = False

        def job() -> None:  # on the gate's thread, maybe long after it was asked
            nonlocal handed_back
            if not looped or self.launches.quiet():
                self._release(memory)  # (the gate watches its jobs)
            else:
                handed_back = True

        def then() -> None:
            # Through the gate's `then`, not a callback of its own: the gate's close runs
            # it, after the launches closed (so it frees at once), before the engine's
            # close returns; a callback could come after, or never once the loop stopped
            if handed_back:
                self.launches.after(functools.partial(self._nccl_free, memory))

        self._gate.run(_freeing(memory), job, then=then, closes=False)

    def _release_between_launches(self, memory: Imported) -> None:
        with self.launches.between():
            self._watched_release(memory)

    def _watched_release(self, memory: Imported) -> None:
        with self._stuck.guard(_freeing(memory)):
            self._release(memory)

    def _release(self, memory: Imported) -> None:
        try:
            self._gpu.release(memory)
        except GpuError as exc:  # nothing waits for it; the driver frees it with the process
            log.warning("could not let go of device memory at %#x: %s", memory.ptr, exc)

    def close(self) -> None:
        """Wait for the frees asked so far (one that never returns: see StuckWatch); later
        ones run on the caller's thread."""
        self._closed = True
        self.launches.close()
        self._thread.shutdown(wait=True)


_FREED_BY = {Origin.IPC: "cuIpcCloseMemHandle", Origin.VMM: "cuMemUnmap", Origin.NCCL: "ncclMemFree",
             Origin.PLAIN: "cuMemFree"}


def _freeing(memory: Imported) -> str:
    """The free, as the StuckWatch (and the gate, in `commd status`) name it."""
    return f"{_FREED_BY[memory.origin]} of {memory.size} bytes at {memory.ptr:#x}"


class NcclMapping(UsedByOps):
    """Device memory the daemon opened (or allocated). Closing lets it go once no op
    in flight uses it: releasing memory under a running kernel would fault the GPU."""

    def __init__(self, freer: Freer, memory: Imported) -> None:
        super().__init__(self._release)
        self._freer = freer
        self.launches = 0  # ops launched on it (a deregistration's drain watches this)
        self._memory: Imported | None = memory
        self._size = memory.size
        self._device = memory.device
        # NCCL registers cuMem memory; legacy cudaMalloc memory (opened by IPC here) only
        # with NCCL_LEGACY_CUDA_REGISTER=1, which its guide calls unsafe (hangs, and faults
        # on failure and abort): ops use that memory through its plain mapping
        self.registrable = memory.origin in (Origin.VMM, Origin.NCCL)

    @property
    def size(self) -> int:
        return self._size

    @property
    def device(self) -> int:
        return self._device

    def region(self, offset: int, nbytes: int) -> NcclRegion:
        if self._memory is None or self._closing:
            raise CallError(ErrorCode.UNKNOWN_BUFFER, "buffer was released")
        if offset < 0 or nbytes < 0 or offset + nbytes > self._size:
            raise CallError(ErrorCode.BAD_MEMORY, f"bytes [{offset}, {offset + nbytes}) are outside "
                                                  f"the {self._size}-byte allocation")
        return NcclRegion(self, self._memory.ptr + offset, nbytes)

    def _release(self) -> None:
        memory, self._memory = self._memory, None
        if memory is not None:
            self._freer.free(memory)


class NcclEvents(UsedByOps):
    """A worker's ready and done events, opened in the daemon. Closing destroys them once
    no op that names them is queued or running (an op records `done` after it launched)."""

    def __init__(self, gpu: Gpu, ready: int, done: int) -> None:
        super().__init__(self._release)
        self._gpu = gpu
        self.ready = ready
        self.done = done

    def _release(self) -> None:
        for event in (self.ready, self.done):
            with contextlib.suppress(GpuError):  # the driver has let it go already
                self._gpu.event_destroy(event)
        self.ready = self.done = 0
