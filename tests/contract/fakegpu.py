"""A stand-in for CUDA and NCCL behind `commd.engine.gpu.Gpu`, so the NCCL engine's
own logic runs in CI (DESIGN §8).

Device memory is host memory. Streams are in-order queues: an NCCL call is work
on its rank's stream, and a collective runs only when every rank's call of it
is at the head of its stream, as on a GPU; an event completes when the stream
reaches it. Communicators created non-blocking stay "in progress" for a few
polls. A communicator can be failed (NCCL's async error) or aborted (its
waiting work is dropped, which unblocks its streams). The arithmetic is the
tests' reference, so results compare exactly.
"""

from __future__ import annotations

import bisect
import itertools
import os
import threading
import time
from collections import Counter, deque
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from commd.engine.gpu import CommState, GpuError, Imported, Origin
from proto import DType, ReduceOp
from tests.integration.data import reduce_reference

_NP = {DType.U8: np.uint8, DType.I32: np.int32, DType.I64: np.int64, DType.F16: np.float16,
       DType.F32: np.float32, DType.F64: np.float64}


def _np(dtype: DType) -> Any:
    if dtype is DType.BF16:
        import ml_dtypes

        return ml_dtypes.bfloat16
    return _NP[dtype]


@dataclass
class _Comm:
    unique_id: bytes
    rank: int
    size: int
    device: int
    polls_left: int
    failed: str | None = None
    aborted: bool = False
    collectives: int = 0
    p2p: dict[tuple[int, int], int] = field(default_factory=dict)


@dataclass
class _Work:
    comm: _Comm
    key: tuple[object, ...]
    kind: str
    args: tuple[Any, ...]
    done: bool = False
    # the collectives of its communicator in its NCCL group: NCCL picks a collective's
    # algorithm by them (enqueue.cc, numPipeOps), so ranks grouping one differently may
    # run different algorithms against each other
    aggregated: int = 1


@dataclass
class _Batch:
    """The calls one NCCL group put on a stream: they run concurrently (a send and a recv
    of one group do not wait for each other), and the stream moves on when all are done."""

    works: list[_Work]


@dataclass
class _Mark:
    event: int
    generation: int


@dataclass
class _Wait:
    """The stream waits until the event reaches this record (cuStreamWaitEvent)."""

    event: int
    generation: int


@dataclass
class _Kernel:
    """A worker's kernel: writes `data` at `ptr` once the test lets it run."""

    ptr: int
    data: bytes
    released: bool = False
    run: Callable[[], None] | None = None  # instead of writing `data`: the daemon's own kernel


class _Group(threading.local):
    """A thread's open NCCL group: its depth, and its calls by stream."""

    def __init__(self) -> None:
        self.depth = 0
        self.calls: dict[int, list[_Work]] = {}


class FakeGpu:
    def __init__(self, devices: int = 1, init_polls: int = 2, multi_rank_gpu: bool = False,
                 launch_polls: int = 1) -> None:
        self.devices = devices
        self.init_polls = init_polls
        self.launch_polls = launch_polls  # state polls a launch stays ncclInProgress
        # NCCL >= 2.30 with NCCL_MULTI_RANK_GPU_ENABLE=1: ranks of one communicator may
        # share a GPU; else its init refuses ("Duplicate GPU detected")
        self.multi_rank_gpu = multi_rank_gpu
        self._cv = threading.Condition()
        self._bases: list[int] = []
        self._allocs: dict[int, tuple[bytearray, int]] = {}  # base -> (bytes, device)
        self._next_ptr = 0x7F00_0000_0000
        self._ids = itertools.count(1)
        self._streams: dict[int, deque[_Batch | _Mark | _Wait | _Kernel]] = {}
        # NCCL's group is the calling thread's: daemons on loop threads of one process (tests'
        # GpuDaemon pairs) sharing this device each open and end their own
        self._group = _Group()
        self._enqueuing: list[dict[int, list[_Work]]] = []  # ended groups NCCL still enqueues
        self._event_handles: dict[bytes, int] = {}  # IPC handle -> the worker's event
        self._device_of: dict[int, int] = {}  # stream or event -> the device whose context has it
        self._same: dict[int, int] = {}  # an event opened by IPC -> the worker's event it is
        self._recorded: dict[int, int] = {}
        self._waited_on: dict[int, int] = {}  # event -> threads in event_wait on it
        self._reached: dict[int, int] = {}
        self._comms: dict[int, _Comm] = {}
        self._stream_comms: dict[int, list[_Comm]] = {}  # stream -> communicators launched on it
        self._exported: dict[bytes, int] = {}  # IPC handle -> base, of "worker" memory
        self._vmm: dict[tuple[int, int], int] = {}  # (st_dev, st_ino) of an exported fd -> base
        self.launches = 0  # group_end calls: how many NCCL submissions the engine made
        self.registered: dict[int, tuple[int, int, int]] = {}  # handle -> (comm, ptr, bytes)
        self.adds = 0  # launches of the daemon's add kernel
        self.compiled: set[int] | None = None  # devices whose add kernel is loaded (None: all)
        self.compile_thread = ""
        self.compile_takes_s = 0.0  # how long NVRTC takes, before the module load
        self._current = threading.local()  # each thread's current device, as CUDA's contexts are
        self.abort_takes_s = 0.0  # how long ncclCommAbort blocks
        self._aborting = 0  # ncclCommAbort calls running now
        self.abort_threads: list[str] = []
        self.violations: list[str] = []  # what a GPU would not have let pass (undefined behaviour)
        # (src, dst) pairs NCCL has yet to connect: a send's launch stays in progress until
        # the receiver launches its side (NCCL's runtime connect)
        self.lazy_connect: set[tuple[int, int]] = set()
        self.p2p_log: list[tuple[str, int, int]] = []  # each send and recv NCCL was given, in order
        self._connecting: dict[int, tuple[int, int]] = {}
        self.broken_reason: str | None = None  # set: a sticky CUDA error, as BindingsGpu reports it
        self.released_on: list[tuple[Origin, str]] = []  # each release: the memory's origin, the thread

    # ---- what a test does as the worker -------------------------------------------------
    def worker_alloc(self, data: bytes, device: int = 0) -> int:
        return self._new(bytearray(data), device)

    def export_ipc(self, ptr: int) -> bytes:
        handle = os.urandom(64)
        self._exported[handle] = ptr
        return handle

    def export_vmm(self, ptr: int) -> int:
        fd = os.memfd_create("fake-vmm")
        info = os.fstat(fd)
        self._vmm[(info.st_dev, info.st_ino)] = ptr
        return fd

    def worker_stream(self, device: int = 0) -> int:
        return self.stream_create(device)

    def worker_event(self, device: int = 0) -> tuple[int, bytes]:
        """An interprocess event of the worker, and its IPC handle."""
        event = self.event_create(device)
        handle = os.urandom(64)
        self._event_handles[handle] = event
        return event, handle

    def worker_kernel(self, stream: int, ptr: int, data: bytes) -> _Kernel:
        """A long kernel on the worker's stream that writes `data` at `ptr` when released."""
        kernel = _Kernel(ptr, data)
        with self._cv:
            self._streams[stream].append(kernel)
        return kernel

    def finish_kernel(self, kernel: _Kernel) -> None:
        with self._cv:
            kernel.released = True
            self._progress()

    def fail(self, rank: int, why: str) -> None:
        """NCCL's async error on rank `rank`'s communicators."""
        with self._cv:
            for comm in self._comms.values():
                if comm.rank == rank:
                    comm.failed = why

    def read(self, ptr: int, nbytes: int) -> bytes:
        buf, offset = self._find(ptr, nbytes)
        return bytes(buf[offset:offset + nbytes])

    # ---- what a driver over this device asks (tests/fakecuda) ----------------------------
    def locate(self, ptr: int) -> tuple[int, int, int] | None:
        """The allocation holding `ptr`: (base, size, device), or None."""
        with self._cv:
            i = bisect.bisect_right(self._bases, ptr) - 1
            if i < 0:
                return None
            base = self._bases[i]
            buf, device = self._allocs[base]
        return (base, len(buf), device) if ptr < base + max(len(buf), 1) else None

    def reserve(self, size: int) -> int:
        """An address range nothing is at yet (cuMemAddressReserve)."""
        with self._cv:
            va = self._next_ptr
            self._next_ptr += (size + 0xFFFF) & ~0xFFF
            return va

    def map_at(self, va: int, base: int) -> None:
        """The allocation at `base`, seen at `va` as well (cuMemMap)."""
        with self._cv:
            self._allocs[va] = self._allocs[base]
            bisect.insort(self._bases, va)

    def exported(self, handle: bytes) -> int | None:
        """The allocation an IPC handle names."""
        return self._exported.get(bytes(handle))

    def imported(self, fd: int) -> int | None:
        """The allocation a VMM fd (one of export_vmm's or alloc_shared's) shares."""
        info = os.fstat(fd)
        return self._vmm.get((info.st_dev, info.st_ino))

    def export_event(self, event: int) -> bytes:
        handle = os.urandom(64)
        self._event_handles[handle] = event
        return handle

    @property
    def live_events(self) -> int:
        """Events that exist (created or opened, not destroyed)."""
        with self._cv:
            return sum(1 for handle in self._device_of if handle in self._recorded or handle in self._same)

    @property
    def allocations(self) -> int:
        return len(self._allocs)

    @property
    def enqueuing(self) -> bool:
        """Whether ended groups are still being enqueued (a non-blocking group end's
        ncclInProgress)."""
        return bool(self._enqueuing)

    # ---- Gpu: memory --------------------------------------------------------------------
    def nccl_version(self) -> int:
        return 23000  # 2.30.0: the first with NCCL_MULTI_RANK_GPU_ENABLE

    def device_count(self) -> int:
        return self.devices

    def broken(self) -> str | None:
        return self.broken_reason

    def device_uuid(self, device: int) -> bytes:
        if not 0 <= device < self.devices:
            raise GpuError(f"cuDeviceGet: invalid device {device}")
        return bytes([0xC0, 0xDA, device]) + bytes(13)

    def _new(self, buf: bytearray, device: int) -> int:
        with self._cv:  # workers' threads and the daemon's share the device
            base = self._next_ptr
            self._next_ptr += (len(buf) + 0xFFFF) & ~0xFFF
            self._allocs[base] = (buf, device)
            bisect.insort(self._bases, base)
            return base

    def _find(self, ptr: int, nbytes: int) -> tuple[bytearray, int]:
        if nbytes == 0:
            return bytearray(), 0  # NCCL touches no memory for a zero count, so any pointer goes
        with self._cv:
            i = bisect.bisect_right(self._bases, ptr) - 1
            if i < 0:
                raise GpuError(f"illegal address {ptr:#x}")
            base = self._bases[i]
            buf, _ = self._allocs[base]
        if ptr + nbytes > base + len(buf):
            raise GpuError(f"illegal address: [{ptr:#x}, +{nbytes}) leaves its allocation")
        return buf, ptr - base

    def _alias(self, base: int, size: int, origin: Origin) -> Imported:
        buf, device = self._allocs[base]
        if size > len(buf):
            raise GpuError(f"the allocation holds {len(buf)} bytes, not {size}")
        with self._cv:
            alias = self._next_ptr
            self._next_ptr += (len(buf) + 0xFFFF) & ~0xFFF
            self._allocs[alias] = (buf, device)  # the same bytes at another address, as IPC maps them
            bisect.insort(self._bases, alias)
        return Imported(alias, size, device, origin)

    def ipc_open(self, handle: bytes, size: int, device: int) -> Imported:
        base = self._exported.get(bytes(handle))
        if base is None:
            raise GpuError("cuIpcOpenMemHandle: invalid argument")
        return self._alias(base, size, Origin.IPC)

    def vmm_import(self, fd: int, size: int) -> Imported:
        info = os.fstat(fd)
        base = self._vmm.get((info.st_dev, info.st_ino))
        if base is None:
            raise GpuError("cuMemImportFromShareableHandle: invalid handle")
        return self._alias(base, size, Origin.VMM)

    def release(self, memory: Imported) -> None:
        if memory.origin is Origin.NCCL:
            self._nccl("ncclMemFree")
        with self._cv:
            if memory.ptr not in self._allocs:
                raise GpuError(f"release of unknown memory {memory.ptr:#x}")
            if self._queued_on(memory.ptr, memory.size):
                self.violations.append(f"released [{memory.ptr:#x}, +{memory.size}) under an op still "
                                       f"queued on a stream")
            del self._allocs[memory.ptr]
            self._bases.remove(memory.ptr)
            self.released_on.append((memory.origin, threading.current_thread().name))

    def alloc(self, nbytes: int, device: int) -> Imported:
        return Imported(self._new(bytearray(nbytes), device), nbytes, device, Origin.PLAIN)

    def alloc_shared(self, nbytes: int, device: int) -> tuple[Imported, int]:
        self._nccl("ncclMemAlloc")
        memory = Imported(self._new(bytearray(nbytes), device), nbytes, device, Origin.NCCL)
        fd = os.memfd_create("fake-nccl-mem")  # stands for its VMM export: a worker imports it
        info = os.fstat(fd)
        self._vmm[(info.st_dev, info.st_ino)] = memory.ptr
        return memory, fd

    def copy_in(self, ptr: int, data: bytes) -> None:
        buf, offset = self._find(ptr, len(data))
        buf[offset:offset + len(data)] = data

    def copy_out(self, ptr: int, nbytes: int) -> bytes:
        return self.read(ptr, nbytes)

    # ---- Gpu: streams and events --------------------------------------------------------
    # Workers' threads, the daemon's loop and its helper threads all come here: every
    # table changes under _cv, which _progress holds while it walks them.
    def stream_create(self, device: int) -> int:
        with self._cv:
            stream = next(self._ids)
            self._streams[stream] = deque()
            self._device_of[stream] = device
            return stream

    def stream_destroy(self, stream: int) -> None:
        with self._cv:
            self._streams.pop(stream)

    def streams_of(self, device: int) -> list[int]:
        """Every stream of `device` (what cuCtxSynchronize waits for)."""
        with self._cv:
            return [s for s in self._streams if self._device_of.get(s) == device]

    def event_create(self, device: int) -> int:
        with self._cv:
            event = next(self._ids)
            self._recorded[event] = self._reached[event] = 0
            self._device_of[event] = device
            return event

    def event_destroy(self, event: int) -> None:
        with self._cv:
            if self._waited_on.get(event):
                self.violations.append(f"destroyed event {event} while a thread waits on it")
            if self._same.pop(event, None) is None:  # an opened copy goes alone
                del self._recorded[event], self._reached[event]
            del self._device_of[event]

    def event_record(self, event: int, stream: int) -> None:
        if self._device_of.get(event) != self._device_of.get(stream):
            raise GpuError("cuEventRecord: invalid resource handle (the event and the stream "
                           "belong to different contexts)")
        self._stream_free(stream)
        event = self._same.get(event, event)
        with self._cv:
            self._recorded[event] += 1
            self._streams[stream].append(_Mark(event, self._recorded[event]))
            self._progress()

    def event_open(self, handle: bytes, device: int) -> int:
        event = self._event_handles.get(bytes(handle))
        if event is None:
            raise GpuError("cuIpcOpenEventHandle: invalid handle")
        opened = next(self._ids)  # the same event, as another context sees it
        self._same[opened] = event
        self._device_of[opened] = device
        return opened

    def stream_wait_event(self, stream: int, event: int) -> None:
        self._stream_free(stream)
        event = self._same.get(event, event)
        with self._cv:
            self._streams[stream].append(_Wait(event, self._recorded[event]))
            self._progress()

    def event_wait(self, event: int, device: int) -> None:
        handle, event = event, self._same.get(event, event)
        with self._cv:
            want = self._recorded[event]
            self._waited_on[handle] = self._waited_on.get(handle, 0) + 1
            try:
                if not self._cv.wait_for(lambda: self._reached.get(event, want) >= want, timeout=30):
                    raise GpuError("cuEventSynchronize: the fake device never got there (a hang)")
            finally:
                self._waited_on[handle] -= 1

    # ---- Gpu: NCCL ------------------------------------------------------------------------
    def _nccl(self, call: str) -> None:
        """NCCL allows no other NCCL call, on any communicator, while an abort runs."""
        if self._aborting:
            self.violations.append(f"{call} while an ncclCommAbort runs")

    def unique_id(self) -> bytes:
        self._nccl("ncclGetUniqueId")
        return os.urandom(128)

    def comm_init(self, world_size: int, unique_id: bytes, rank: int, device: int) -> int:
        self._nccl("ncclCommInitRank")
        if not 0 <= rank < world_size or len(unique_id) != 128:
            raise GpuError(f"Invalid rank requested : {rank}/{world_size}")
        if not self.multi_rank_gpu and any(c.unique_id == unique_id and c.device == device and not c.aborted
                                           for c in self._comms.values()):
            raise GpuError(f"Duplicate GPU detected : rank {rank} and another rank both on CUDA device "
                           f"{device}")
        comm = next(self._ids)
        self._comms[comm] = _Comm(unique_id, rank, world_size, device, self.init_polls)
        return comm

    def comm_device(self, comm: int) -> int:
        c = self._comms.get(comm)
        if c is None:
            raise GpuError("invalid communicator")
        return c.device

    def comm_state(self, comm: int) -> tuple[CommState, str]:
        self._nccl("ncclCommGetAsyncError")
        c = self._comms.get(comm)
        if c is None:
            raise GpuError("ncclCommGetAsyncError: invalid argument")
        self._finish_enqueuing()
        if c.failed is not None:
            return CommState.FAILED, c.failed
        if comm in self._connecting and not c.aborted:
            return CommState.IN_PROGRESS, ""
        if c.polls_left > 0:
            c.polls_left -= 1
            return CommState.IN_PROGRESS, ""
        return CommState.READY, ""

    def _finish_enqueuing(self) -> None:
        with self._cv:
            enqueuing, self._enqueuing = self._enqueuing, []
            for grouped in enqueuing:
                for stream, works in grouped.items():
                    self._streams[stream].append(_Batch(works))
            if enqueuing:
                self._progress()

    @property
    def aborting(self) -> int:
        """ncclCommAbort calls running now."""
        with self._cv:
            return self._aborting

    def comm_abort(self, comm: int) -> None:
        self._nccl("ncclCommAbort")
        with self._cv:
            self._aborting += 1
            self.abort_threads.append(threading.current_thread().name)
        try:
            if self.abort_takes_s:
                time.sleep(self.abort_takes_s)  # as NCCL waiting for the device
            self._finish_enqueuing()
            with self._cv:
                c = self._comms.pop(comm)
                c.aborted = True
                self.registered = {h: r for h, r in self.registered.items() if r[0] != comm}
                self._progress()
        finally:
            with self._cv:
                self._aborting -= 1

    def group_start(self) -> None:
        self._nccl("ncclGroupStart")
        self._group.depth += 1

    def add_bf16(self, dst: int, src: int, count: int, device: int, stream: int) -> None:
        import ml_dtypes

        def add() -> None:
            a = np.frombuffer(self.read(dst, 2 * count), ml_dtypes.bfloat16)
            b = np.frombuffer(self.read(src, 2 * count), ml_dtypes.bfloat16)
            total = a.astype(np.float32) + b.astype(np.float32)  # rounded once, as __hadd does
            self.copy_in(dst, total.astype(ml_dtypes.bfloat16).tobytes())

        self._stream_free(stream)
        self.adds += 1
        with self._cv:
            self._streams[stream].append(_Kernel(0, b"", released=True, run=add))
            self._progress()

    def add_ready(self, device: int) -> bool:
        return self.compiled is None or device in self.compiled

    def prepare_add(self, device: int, loading: Callable[[], AbstractContextManager[None]]) -> None:
        if self.compiled is not None:
            self.compile_thread = threading.current_thread().name
            time.sleep(self.compile_takes_s)  # NVRTC: no device involved
            with loading():  # the module load
                self.compiled.add(device)

    def _ready_for_use(self, comm: _Comm) -> None:
        """NCCL (ncclCommEnsureReady) refuses a non-blocking communicator any call until its
        last launch or init answered ncclSuccess to a state poll."""
        if comm.polls_left > 0:
            raise GpuError("Attempt to use communicator before the previous operation returned ncclSuccess")

    def _stream_free(self, stream: int) -> None:
        """nccl4py: no work on a stream behind an NCCL launch still in progress."""
        if any(c.polls_left > 0 and not c.aborted for c in self._stream_comms.get(stream, ())):
            raise GpuError(f"work queued on stream {stream} while an NCCL launch on it is in progress")

    def comm_register(self, comm: int, ptr: int, nbytes: int) -> int:
        self._nccl("ncclCommRegister")
        c = self._comms.get(comm)
        if c is None:
            raise GpuError("ncclCommRegister: invalid argument")
        self._ready_for_use(c)
        self._find(ptr, nbytes)  # NCCL checks the memory exists
        handle = next(self._ids)
        self.registered[handle] = (comm, ptr, nbytes)
        return handle

    def comm_deregister(self, comm: int, handle: int) -> None:
        self._nccl("ncclCommDeregister")
        c = self._comms.get(comm)
        if c is not None:
            self._ready_for_use(c)
        registered = self.registered.get(handle)
        if registered is None or registered[0] != comm:
            raise GpuError("ncclCommDeregister: invalid argument")
        _, ptr, nbytes = registered
        with self._cv:  # NCCL unmaps the peers' view at once: under an op still queued, undefined
            if self._queued_on(ptr, nbytes):
                self.violations.append(f"deregistered [{ptr:#x}, +{nbytes}) under an op on the device")
        del self.registered[handle]

    def _queued_on(self, ptr: int, nbytes: int) -> bool:
        """Whether an NCCL call not yet run, even of an aborted communicator (its kernel
        still launches when its stream gets there), uses these bytes (holds _cv)."""
        return any(isinstance(item, _Batch) and any(not w.done and self._touches(w, ptr, nbytes)
                                                    for w in item.works)
                   for queue in self._streams.values() for item in queue)

    @staticmethod
    def _touches(work: _Work, ptr: int, nbytes: int) -> bool:
        pointers = [a for a in work.args[:2] if isinstance(a, int)] if work.kind not in ("send", "recv") \
            else [work.args[0]]
        return any(ptr <= p < ptr + nbytes for p in pointers)

    def group_end(self) -> None:
        self._nccl("ncclGroupEnd")
        self.launches += 1
        self._group.depth -= 1
        if self._group.depth:
            return
        with self._cv:
            grouped, self._group.calls = self._group.calls, {}
            if grouped:
                # As a non-blocking communicator's group end may do: return ncclInProgress and
                # enqueue the kernels later. They reach the streams at the next state poll, so
                # work queued on a stream before the engine waited for that comes first (wrongly).
                self._enqueuing.append(grouped)
                collectives = Counter(id(w.comm) for works in grouped.values() for w in works
                                      if w.key[1] == "coll")
                for works in grouped.values():
                    for work in works:
                        work.aggregated = collectives[id(work.comm)]
                for stream, works in grouped.items():
                    for work in works:
                        work.comm.polls_left = max(work.comm.polls_left, self.launch_polls)
                        launched_here = self._stream_comms.setdefault(stream, [])
                        if not any(c is work.comm for c in launched_here):
                            launched_here.append(work.comm)

    def use_device(self, device: int) -> None:
        if not 0 <= device < self.devices:
            raise GpuError(f"cuDeviceGet: invalid device {device}")
        self._current.device = device

    @property
    def current_device(self) -> int | None:
        return getattr(self._current, "device", None)

    def _enqueue(self, comm_id: int, stream: int, kind: str, key: tuple[object, ...],
                 args: tuple[Any, ...]) -> None:
        self._nccl(f"nccl {kind}")
        comm = self._comms.get(comm_id)
        if comm is None:
            raise GpuError(f"{kind}: invalid communicator")
        self._ready_for_use(comm)
        if self.current_device != comm.device:
            raise GpuError(f"{kind}: launched with device {self.current_device} current, "
                           f"the communicator's is {comm.device}")
        work = _Work(comm, (comm.unique_id, *key), kind, args)
        with self._cv:
            if self._group.depth:
                self._group.calls.setdefault(stream, []).append(work)
            else:
                self._streams[stream].append(_Batch([work]))
                self._progress()

    def _collective(self, comm_id: int, stream: int, kind: str, args: tuple[Any, ...]) -> None:
        if args[2] == 0:  # NCCL: "Empty collectives can be discarded" (no work, no meeting)
            return
        comm = self._comms.get(comm_id)
        seq = comm.collectives if comm else 0
        if comm is not None:
            comm.collectives += 1
        self._enqueue(comm_id, stream, kind, ("coll", seq), args)

    def all_reduce(self, send: int, recv: int, count: int, dtype: DType, op: ReduceOp, comm: int,
                   stream: int) -> None:
        self._collective(comm, stream, "all_reduce", (send, recv, count, dtype, op))

    def all_gather(self, send: int, recv: int, count: int, dtype: DType, comm: int, stream: int) -> None:
        self._collective(comm, stream, "all_gather", (send, recv, count, dtype))

    def reduce_scatter(self, send: int, recv: int, count: int, dtype: DType, op: ReduceOp, comm: int,
                       stream: int) -> None:
        self._collective(comm, stream, "reduce_scatter", (send, recv, count, dtype, op))

    def broadcast(self, send: int, recv: int, count: int, dtype: DType, root: int, comm: int,
                  stream: int) -> None:
        self._collective(comm, stream, "broadcast", (send, recv, count, dtype, root))

    def _p2p(self, comm_id: int, stream: int, kind: str, src: int, dst: int, args: tuple[Any, ...]) -> None:
        self.p2p_log.append((kind, src, dst))
        if (src, dst) in self.lazy_connect:  # NCCL connects a new pair at its first launch
            if kind == "send":
                self._connecting[comm_id] = (src, dst)  # the sender waits for the receiver's side
            else:
                self.lazy_connect.discard((src, dst))
                self._connecting = {c: pair for c, pair in self._connecting.items() if pair != (src, dst)}
        comm = self._comms.get(comm_id)
        seq = comm.p2p.get((src, dst), 0) if comm else 0
        if comm is not None:
            comm.p2p[(src, dst)] = seq + 1
        self._enqueue(comm_id, stream, kind, ("p2p", src, dst, seq), args)

    def send(self, buf: int, count: int, dtype: DType, peer: int, comm: int, stream: int) -> None:
        rank = self._comms[comm].rank if comm in self._comms else -1
        self._p2p(comm, stream, "send", rank, peer, (buf, count * dtype.itemsize))

    def recv(self, buf: int, count: int, dtype: DType, peer: int, comm: int, stream: int) -> None:
        rank = self._comms[comm].rank if comm in self._comms else -1
        self._p2p(comm, stream, "recv", peer, rank, (buf, count * dtype.itemsize))

    # ---- the device ------------------------------------------------------------------------
    def _progress(self) -> None:
        """Run what the heads of the streams allow, until nothing moves (holds _cv)."""
        moved = True
        while moved:
            moved = False
            heads: dict[tuple[object, ...], list[_Work]] = {}
            for queue in list(self._streams.values()):
                while queue and self._passes(queue[0]):
                    item = queue.popleft()  # work of an aborted communicator never runs
                    if isinstance(item, _Mark):
                        self._reached[item.event] = max(self._reached.get(item.event, 0), item.generation)
                    elif isinstance(item, _Kernel):
                        item.run() if item.run is not None else self.copy_in(item.ptr, item.data)
                    moved = True
                if queue and isinstance(queue[0], _Batch):  # else it waits on an event or a kernel
                    for work in queue[0].works:
                        if not work.done:
                            heads.setdefault(work.key, []).append(work)
            for key, works in heads.items():
                expected = 2 if key[1] == "p2p" else works[0].comm.size
                if len(works) == expected:
                    if len({w.aggregated for w in works}) > 1:
                        self.violations.append(
                            f"collective #{key[2]} grouped with different numbers of collectives "
                            f"across ranks: {sorted((w.comm.rank, w.aggregated) for w in works)}")
                    self._execute(works)
                    for work in works:
                        work.done = True
                    moved = True
        self._cv.notify_all()

    def _passes(self, item: _Batch | _Mark | _Wait | _Kernel) -> bool:
        """Whether a stream's head item is done as soon as the stream gets to it."""
        if isinstance(item, _Mark):
            return True
        if isinstance(item, _Wait):
            return self._reached.get(item.event, item.generation) >= item.generation
        if isinstance(item, _Kernel):
            return item.released
        return all(work.done or work.comm.aborted for work in item.works)

    def _execute(self, works: list[_Work]) -> None:
        works.sort(key=lambda w: w.comm.rank)
        kind = works[0].kind
        if kind in ("send", "recv"):
            (src_buf, nbytes), (dst_buf, _) = [w.args for w in sorted(works, key=lambda w: w.kind != "send")]
            self.copy_in(dst_buf, self.read(src_buf, nbytes))
            return
        if kind == "all_reduce":
            _, _, count, dtype, op = works[0].args
            inputs = [np.frombuffer(self.read(w.args[0], count * dtype.itemsize), _np(dtype)) for w in works]
            out = reduce_reference(inputs, dtype.value, op.value).tobytes()
            for w in works:
                self.copy_in(w.args[1], out)
        elif kind == "all_gather":
            _, _, count, dtype = works[0].args
            out = b"".join(self.read(w.args[0], count * dtype.itemsize) for w in works)
            for w in works:
                self.copy_in(w.args[1], out)
        elif kind == "reduce_scatter":
            _, _, count, dtype, op = works[0].args
            share = count * dtype.itemsize
            inputs = [np.frombuffer(self.read(w.args[0], share * len(works)), _np(dtype)) for w in works]
            out = reduce_reference(inputs, dtype.value, op.value).tobytes()
            for w in works:
                self.copy_in(w.args[1], out[w.comm.rank * share:(w.comm.rank + 1) * share])
        else:
            _, _, count, dtype, root = works[0].args
            out = self.read(works[root].args[0], count * dtype.itemsize)
            for w in works:
                self.copy_in(w.args[1], out)
