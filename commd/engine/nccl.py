"""The NCCL engine: workers' device memory opened by CUDA IPC, ops run by NCCL (DESIGN §4-5).

`NcclEngine` is the daemon's entry: it opens memory and events, and makes a world's
communicators. Its parts, each in a module of its own:

- ncclcomm: one world's communicators on this daemon, and how its ops reach NCCL
- ncclbatch: which of a world's ops go to NCCL together, and in what order
- ncclcalls: the NCCL call each op becomes
- addpath: set_add_kernel's 2-rank bf16 sum (an exchange, then the daemon's own add)
- ncclmemory: opened memory and events, held by ops, let go off the event loop
- completion: events behind work on the streams, waited for on helper threads
- turns: the per-rank order in which work reaches NCCL and the streams
- ncclgate: ncclCommAbort and ncclMemFree, off the event loop, with no NCCL call beside them
- stuckwatch: the way out of such a call that never returns
- crosscheck: across daemons, the check that ranks called the same thing

Everything CUDA and NCCL is behind `gpu.Gpu`: the logic runs in CI against a fake
that keeps device memory in host buffers (tests/contract/fakegpu.py), and against
the same fake behind the real bindings (tests/fakecuda).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING

from proto import IPC_MEM_HANDLE_BYTES, ErrorCode, MemKind

from ..errors import CallError
from .gpu import Gpu, GpuError, Unshareable
from .ncclcomm import NcclCommunicator
from .ncclgate import NcclGate
from .ncclmemory import Freer, NcclEvents, NcclMapping
from .stuckwatch import StuckWatch

if TYPE_CHECKING:
    from ..cluster import WorldNet


class NcclEngine:
    name = "nccl"
    memory_kinds = frozenset({MemKind.CUDA_IPC, MemKind.CUDA_VMM})

    def __init__(self, gpu: Gpu, waiters: int = 64, stuck: StuckWatch | None = None) -> None:
        self.gpu = gpu
        self._stuck = stuck if stuck is not None else StuckWatch()
        # Threads that block in cuEventSynchronize, one per rank of each op awaited at once,
        # shared by every world: enough that ops answered early (still on the device) or
        # stuck in one world do not hold up completions in another. They sleep while they
        # wait (the events are BLOCKING_SYNC), so idle ones cost little.
        self._waiters = ThreadPoolExecutor(waiters, thread_name_prefix="commd-cuda-wait")
        self._compiler = ThreadPoolExecutor(1, thread_name_prefix="commd-nvrtc")
        self._gate = NcclGate(self._stuck)
        self._freer = Freer(gpu, self._gate, self._stuck)
        self._uuids: dict[bytes, int] | None = None  # each GPU's UUID -> its ordinal here
        self._device_count: int | None = None

    def import_memory(self, kind: MemKind, size: int, handle: bytes, fd: int | None,
                      device: int | None = None) -> NcclMapping:
        try:
            if kind is MemKind.CUDA_IPC:
                if len(handle) != IPC_MEM_HANDLE_BYTES:
                    raise CallError(ErrorCode.BAD_MEMORY,
                                    f"a cuda-ipc handle is {IPC_MEM_HANDLE_BYTES} bytes, got {len(handle)}")
                return NcclMapping(self._freer, self.gpu.ipc_open(handle, size, device or 0))
            if kind is MemKind.CUDA_VMM and fd is not None:
                return NcclMapping(self._freer, self.gpu.vmm_import(fd, size))
            raise CallError(ErrorCode.MISUSE, f"the nccl engine cannot open {kind.value} memory")
        except GpuError as exc:
            raise CallError(ErrorCode.BAD_MEMORY, f"cannot open {kind.value} memory: {exc}") from None

    def import_events(self, ready: bytes, done: bytes, device: int | None = None) -> NcclEvents:
        try:
            first = self.gpu.event_open(ready, device or 0)
            try:
                return NcclEvents(self.gpu, first, self.gpu.event_open(done, device or 0))
            except GpuError:
                self.gpu.event_destroy(first)
                raise
        except GpuError as exc:
            raise CallError(ErrorCode.MISUSE, f"cannot open the worker's CUDA events: {exc}") from None

    def allocate(self, nbytes: int, device: int | None = None) -> tuple[NcclMapping, int]:
        self._gate.wait()  # ncclMemAlloc
        try:
            memory, fd = self.gpu.alloc_shared(nbytes, device or 0)
        except Unshareable as exc:
            # ncclMemFree (a cudaFree: it waits for the device) not here on the loop, and
            # not inside a launch: as every free goes
            self._freer.free(exc.memory)
            raise CallError(ErrorCode.LIMIT, f"cannot allocate {nbytes} bytes: {exc}") from None
        except GpuError as exc:
            raise CallError(ErrorCode.LIMIT, f"cannot allocate {nbytes} bytes: {exc}") from None
        return NcclMapping(self._freer, memory), fd

    def broken(self) -> str | None:
        return self.gpu.broken()

    def on_loop_stall(self, announce: Callable[[float], None]) -> None:
        self._stuck.announce = announce

    def describe(self) -> str:
        try:  # (ncclGetVersion reads a constant, no communicator: safe beside an abort)
            version, gpus = self.gpu.nccl_version(), self.gpu.device_count()
        except GpuError as exc:
            return f"nccl ({exc})"
        holding = self._gate.holding()  # why its NCCL worlds wait, if they do
        return (f"nccl (NCCL {version // 10000}.{version // 100 % 100}.{version % 100}, "
                f"{gpus} GPU{'' if gpus == 1 else 's'})" + (f"; {holding}" if holding else ""))

    def device_of(self, uuid: bytes) -> int | None:
        uuids = self._gpus()
        if uuid in uuids:
            return uuids[uuid]
        raise CallError(ErrorCode.MISUSE, f"the worker's GPU (UUID {uuid.hex()}) is not one this daemon "
                                          f"sees (is the daemon's CUDA_VISIBLE_DEVICES narrower?)")

    def check_device(self, device: int) -> None:
        count = self._count_gpus()
        if not 0 <= device < count:
            raise CallError(ErrorCode.MISUSE, f"GPU {device} is not one this daemon sees "
                                              f"(it sees {count}: 0..{count - 1})")

    def _count_gpus(self) -> int:
        """(Read once: the GPUs a process sees do not change.)"""
        if self._device_count is None:
            try:
                self._device_count = self.gpu.device_count()
            except GpuError as exc:
                raise CallError(ErrorCode.ENGINE, f"cannot count the GPUs: {exc}") from None
        return self._device_count

    def _gpus(self) -> dict[bytes, int]:
        """Each GPU's UUID -> its ordinal here, read once (as their count)."""
        if self._uuids is None:
            try:
                uuids: dict[bytes, int] = {}
                for device in range(self._count_gpus()):
                    uuids.setdefault(self.gpu.device_uuid(device), device)
            except GpuError as exc:
                raise CallError(ErrorCode.ENGINE, f"cannot read the GPUs' UUIDs: {exc}") from None
            self._uuids = uuids
        return self._uuids

    def unique_id(self) -> bytes:
        """The bootstrap handle of a new communicator (the root's, handed to the others)."""
        self._gate.wait()
        try:
            return self.gpu.unique_id()
        except GpuError as exc:
            raise CallError(ErrorCode.ENGINE, f"ncclGetUniqueId failed: {exc}") from None

    def communicator(self, world: str, epoch: int, world_size: int, local_ranks: Sequence[int],
                     net: WorldNet | None = None, *, devices: Mapping[int, int] | None = None,
                     unique_id: bytes = b"") -> NcclCommunicator:
        if not unique_id and len(local_ranks) != world_size:  # (one all here makes its own)
            raise CallError(ErrorCode.ENGINE, f"world {world}: a world across daemons needs the "
                                              f"root's NCCL id")
        return NcclCommunicator(self.gpu, self._waiters, self._compiler, self._freer, self._gate, world,
                                world_size, local_ranks, devices or {}, unique_id, net)

    def close(self) -> None:
        self._waiters.shutdown(wait=False, cancel_futures=True)
        self._compiler.shutdown(wait=False)
        self._freer.close()
        self._gate.close()  # the aborts and frees asked, still watched
        self._stuck.close()

