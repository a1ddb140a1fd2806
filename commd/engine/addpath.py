"""The add path of set_add_kernel: a 2-rank bf16 sum as an exchange over NCCL, then the
daemon's own add kernel on each rank's stream (the seed's NcclBackend path)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor

from proto import DType, ErrorCode, ReduceOp

from ..errors import CallError
from .addagree import AddAgreement
from .base import AllReduceOp, EngineOp, RecvOp, SendOp, TransferOp
from .gpu import Gpu, GpuError
from .launches import Launches
from .ncclcalls import Call, bind
from .ncclmemory import NcclMapping, NcclRegion

log = logging.getLogger("commd.engine.nccl")

Add = tuple[int, NcclRegion, NcclRegion]  # (rank, its buffer, where the peer's lands)


class AddPath:
    """One world's add path: off until `enable`, taken once the kernel is loaded on every
    local device. With both ranks here, one communicator runs both sides of each op, so
    they always agree on it; with the other rank on another daemon, `agreement` tells
    from which collective both daemons take it (addagree)."""

    def __init__(self, gpu: Gpu, compiler: ThreadPoolExecutor, world: str, world_size: int,
                 devices: Mapping[int, int], new_mapping: Callable[[int, int], NcclMapping],
                 launches: Launches, agreement: AddAgreement | None = None) -> None:
        self._gpu = gpu
        self._launches = launches  # loading the module may wait for the device: not inside one
        self._compiler = compiler  # where NVRTC compiles the kernel, off the loop
        self._world = world
        self._world_size = world_size
        self._devices = devices
        self._new_mapping = new_mapping  # (bytes, rank) -> device memory on the rank's GPU
        self._agreement = agreement
        self._enabled = False
        self._landing: dict[int, NcclMapping] = {}  # rank -> where the peer's buffer lands

    def enable(self, enabled: bool) -> None:
        """Compiling the kernel (NVRTC) runs on the engine's thread; until it is loaded,
        NCCL sums as before."""
        self._enabled = enabled
        devices = sorted(set(self._devices.values()))
        if not enabled:
            return
        if all(self._gpu.add_ready(d) for d in devices):
            self._loaded()
            return
        loop = asyncio.get_running_loop() if self._agreement is not None else None

        def prepare() -> None:
            try:
                for device in devices:
                    self._gpu.prepare_add(device, self._launches.between)
            except GpuError as exc:
                log.warning("world %s: the add kernel is not available, NCCL sums: %s", self._world, exc,
                            extra={"world": self._world})
                return
            log.info("world %s: the add kernel is ready on GPU %s", self._world,
                     ", ".join(map(str, devices)), extra={"world": self._world})
            if loop is not None:
                with contextlib.suppress(RuntimeError):  # (the loop closed meanwhile: the daemon stops)
                    loop.call_soon_threadsafe(self._loaded)

        self._compiler.submit(prepare)  # once loaded, add_ready turns true

    def _loaded(self) -> None:
        """The kernel is ready here: across daemons, the other must hear it (addagree)."""
        if self._agreement is not None and self._enabled:
            self._agreement.start()

    def plan(self, op: EngineOp) -> list[Add]:
        """For each rank here of a 2-rank bf16 sum: its buffer and where the peer's lands.
        Empty when NCCL sums the op. Called for every op as it goes to the device."""
        agreement = self._agreement
        if agreement is not None and not isinstance(op, TransferOp | SendOp | RecvOp):
            agreement.ran(op.tag.index)
        if not (isinstance(op, AllReduceOp) and op.dtype is DType.BF16 and op.op is ReduceOp.SUM
                and self._world_size == 2):
            return []
        if agreement is None:
            taken = (self._enabled and len(op.bufs) == 2
                     and all(self._gpu.add_ready(d) for d in set(self._devices.values())))
        else:  # (agreed only once the kernel was loaded here)
            taken = agreement.first is not None and op.tag.index >= agreement.first
        if not taken:
            return []
        plan = []
        for rank, buf in sorted(op.bufs.items()):
            if not isinstance(buf, NcclRegion):
                return []  # nothing to add
            plan.append((rank, buf, self._landing_region(rank, buf.nbytes)))
        return plan

    def exchanges(self, adds: Sequence[Add]) -> list[Call]:
        """The NCCL part: each rank sends its buffer to the other."""
        gpu = self._gpu
        return [call for rank, buf, landing in adds
                for call in ((rank, bind(gpu.send, buf.ptr, buf.nbytes, DType.U8, 1 - rank)),
                             (rank, bind(gpu.recv, landing.ptr, landing.nbytes, DType.U8, 1 - rank)))]

    def launch_adds(self, adds: Sequence[Add], streams: Mapping[int, int]) -> None:
        """On each stream, after the exchange: buffer += what the peer sent."""
        for rank, buf, landing in adds:
            try:
                self._gpu.add_bf16(buf.ptr, landing.ptr, buf.nbytes // 2, self._devices[rank], streams[rank])
            except GpuError as exc:
                raise CallError(ErrorCode.ENGINE, str(exc)) from None

    def close(self) -> None:
        """Let go of the landing buffers (once the ops that use them are done)."""
        landing, self._landing = self._landing, {}
        for mapping in landing.values():
            mapping.close()

    def _landing_region(self, rank: int, nbytes: int) -> NcclRegion:
        """One per rank, as add-path ops launch alone and launches follow one another on
        the streams."""
        mapping = self._landing.get(rank)
        if mapping is None or mapping.size < nbytes:
            if mapping is not None:
                del self._landing[rank]  # (an allocation failing next leaves none, not a closed one)
                mapping.close()  # let go once the ops that use it are done
            mapping = self._landing[rank] = self._new_mapping(nbytes, rank)
        return mapping.region(0, nbytes)
