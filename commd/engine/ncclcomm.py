"""One world's NCCL communicators on this daemon, and how its ops reach them (DESIGN §4-5).

One communicator per (world, epoch, local rank), created non-blocking so that a
hung or failed one can be aborted; the ranks a daemon hosts are initialised, and
their ops launched, inside one NCCL group (NCCL's rule for one thread driving
several ranks). Each local rank has its own stream. An op is launched on the
event loop's thread, then its completion is awaited on a helper thread that blocks
in cuEventSynchronize, so the loop never waits on the device; an abort, which may,
runs through the NcclGate, which keeps the loop's NCCL calls out meanwhile.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
from collections.abc import Callable, Coroutine, Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING

from proto import ErrorCode

from ..errors import CallError
from ..tasks import HeldTasks
from .addagree import AddAgreement, Admissions
from .addpath import AddPath
from .base import EngineOp, Order, Region, StillOnDevice
from .completion import Completions, WaitFailed, WaitNotStarted, unless_mismatched
from .crosscheck import device_check
from .gpu import CommState, Gpu, GpuError
from .ncclbatch import Batcher, Launch
from .ncclcalls import launch, nccl_calls, nccl_group, regions_of
from .ncclgate import NcclGate, loop_running
from .ncclmemory import Freer, NcclEvents, NcclMapping, NcclRegion, UsedByOps
from .ncclregister import NcclRegistrations
from .turns import Turn, Turns

if TYPE_CHECKING:
    from ..cluster import WorldNet

log = logging.getLogger("commd.engine.nccl")
_SETTLE_MAX_S = 0.005  # longest pause between polls of a communicator still in progress


@dataclass(frozen=True, slots=True)
class _Held:
    """What an op uses until the device is done with it."""

    regions: list[NcclRegion]
    events: list[NcclEvents]


class NcclCommunicator:
    """One world's communicators (one per local rank) for one epoch."""

    launches_in_order = True  # see run and Batcher.launch_soon
    reports_async_errors = True  # ncclCommGetAsyncError, and ops answered before they ended

    def __init__(self, gpu: Gpu, waiters: ThreadPoolExecutor, compiler: ThreadPoolExecutor, freer: Freer,
                 gate: NcclGate, world: str, world_size: int, local_ranks: Sequence[int],
                 devices: Mapping[int, int], unique_id: bytes, net: WorldNet | None = None) -> None:
        self._gpu = gpu
        self._freer = freer
        self._gate = gate
        # NCCL moves the data; the daemons' links only carry each collective's fingerprint
        # to the root, so that ranks calling different things fail as a mismatch, not a hang.
        self._net = net if net is not None and net.members() else None
        self._inbox = net.inbox if net is not None else None  # this epoch's (see NetRunner)
        self._epoch = net.epoch if net is not None else 0
        self._world = world
        self._ranks = tuple(local_ranks)
        self._devices = {r: devices.get(r, 0) for r in self._ranks}
        # sum 2-rank bf16 by exchange and our own add (use_add_kernel); with the other rank on
        # another daemon, the two agree from which collective on, and the root holds its ops
        # back meanwhile (addagree)
        self._world_size = world_size
        self._admissions = Admissions()
        agreement = None
        if self._net is not None and self._inbox is not None and world_size == 2 and len(self._ranks) == 1:
            agreement = AddAgreement(self._net, self._inbox, self._epoch, self._ranks[0], self._admissions,
                                     self._spawn, self._agreement_failed)
        self._adds = AddPath(gpu, compiler, world, world_size, self._devices, self._new_mapping,
                             freer.launches, agreement)
        self._aborted = False
        self._aborting = False  # the abort is still running (on the gate's thread)
        self._abort_over = asyncio.Event()  # set once it returned
        self._launches_to_end = 0  # launches it cut short: half made until it returned
        self._init_failure: CallError | None = None  # of an init made after an abort (see __init__)
        self._failure: str | None = None  # of an op answered before it was done
        self._later: set[asyncio.Task[None]] = set()  # such ops, still on the device
        # A non-blocking communicator takes no NCCL call, and its stream no work, from a
        # launch (or its init) until its state reads ncclSuccess again: everything that
        # calls NCCL on a rank's communicator or queues work on its stream does it in the
        # rank's turn, until then (see _launch_batch, Turns). Per rank, not for all: a
        # launch still in progress (NCCL connecting to a peer that has yet to post its
        # side) must not hold back another rank's, which that peer may be waiting for first.
        self._turns = Turns(self._ranks)
        self._batcher = Batcher(self._turns, self._spawn, self._launch_batch)
        self._tasks = HeldTasks()  # launches, drains, deregistrations under way
        self._running = 0
        self._streams: dict[int, int] = {}
        self._completions = Completions(gpu, waiters, self._devices)  # events behind work on the streams
        self._scratch: dict[int, NcclMapping] = {}
        self._comms: dict[int, int] = {}
        self._registrations = NcclRegistrations(
            gpu, world, self._ranks, self._devices, self._turns, self._completions, self._streams,
            freer.launches, lambda rank: self._comms[rank], self._settle, self._spawn,
            lambda: self._aborted, self._maybe_teardown)
        if not gate.closed or not loop_running():
            gate.wait()
            self._init(world_size, unique_id)
            return
        # An abort runs, and NCCL takes no init meanwhile: the init comes once it returned,
        # in every rank's turn (so the ops wait behind it), and the loop goes on; a failure
        # then fails the world (async_error), as a refusal would have here.
        turn = self._turns.take(self._ranks)
        self._spawn(self._init_after_abort(turn, world_size, unique_id), turn)

    def _init(self, world_size: int, unique_id: bytes) -> None:
        """Streams and communicators, all ranks' in one group (`unique_id` empty: a world
        all on this daemon, whose id is made here)."""
        gpu, world = self._gpu, self._world
        try:
            unique_id = unique_id or gpu.unique_id()
            for rank in self._ranks:
                self._streams[rank] = gpu.stream_create(self._devices[rank])
            with nccl_group(gpu):
                for rank in self._ranks:
                    self._comms[rank] = gpu.comm_init(world_size, unique_id, rank, self._devices[rank])
        except GpuError as exc:
            self._abort_comms(": the init failed")  # never left half-made
            raise CallError(ErrorCode.ENGINE, f"world {world}: NCCL init failed: {exc}") from None

    async def _init_after_abort(self, turn: Turn, world_size: int, unique_id: bytes) -> None:
        async with turn:
            await self._gate.opened()
            if self._aborted:
                return
            try:
                self._init(world_size, unique_id)
            except CallError as exc:  # its ops fail with it (_check), and so the world
                self._init_failure = exc

    # ---- Communicator -----------------------------------------------------------------

    def try_inline(self, op: EngineOp) -> bool:
        return False  # every op goes to the device, and its completion is awaited off the loop

    async def run(self, op: EngineOp, order: Order | None = None,
                  requests: frozenset[object] = frozenset()) -> None:
        # Nothing is awaited before the op joins a launch: launches form in the order the
        # ops matched, which NCCL needs on every rank. (The init's settling is the first
        # launch's: _launch_batch settles its ranks before it calls NCCL.) The one wait before
        # is the add path's agreement's, which lets the ops it held back through in order.
        await self._admissions.admit()
        self._check()
        adds = self._adds.plan(op)
        calls = (nccl_calls(self._gpu, op, self._ranks, self._scratch_ptr, self._net is not None)
                 if not adds else self._adds.exchanges(adds))
        touched = sorted({rank for rank, _ in calls})
        held = _Held(regions_of(op) + [scratch for _, _, scratch in adds],
                     [p for p in (order.events.values() if order else ()) if isinstance(p, NcclEvents)])
        self._hold(held)
        entry = Launch(calls, order, adds, touched, asyncio.get_running_loop().create_future(),
                       [region.mapping for region in held.regions], requests)
        try:
            await self._batcher.launch_soon(entry)  # from here work may be on the streams, even if it failed
            verdict = device_check(self._net, self._inbox, self._epoch, self._ranks, op)
        except BaseException:
            self._completions.give_back(entry.completion)  # not waited on: reusable
            await self._stop_and_drain(touched, held)
            raise
        finished = self._finish(touched, entry.completion, verdict, held)
        if order is None or not order.early:
            await finished
            return
        # Ordered: the calls are answered now; what goes wrong later fails the world.
        task = asyncio.get_running_loop().create_task(finished)
        self._later.add(task)
        task.add_done_callback(self._landed)

    async def _finish(self, touched: list[int], events: dict[int, int],
                      verdict: Coroutine[None, None, None] | None, held: _Held) -> None:
        try:
            device = self._completions.wait_past_abort(events, self.abort, self._abort_over,
                                                       functools.partial(self._drained, held))
            await (device if verdict is None
                   else unless_mismatched(device, verdict, self.abort, self._abort_over))
            self._check()  # aborted meanwhile: NCCL dropped the op, the memory is not the result
        except asyncio.CancelledError:
            await self._stop_and_drain(touched, held)
            raise
        except StillOnDevice:  # (its memory goes with the device's wait)
            raise
        except WaitNotStarted as exc:  # (the engine closed as the op launched: it may still run)
            self._leak(held, exc.message)
            raise
        except BaseException:
            self._let_go(held)
            raise
        self._let_go(held)

    async def _stop_and_drain(self, touched: list[int], held: _Held) -> None:
        """An op given up with work of it perhaps still queued: stop the communicators,
        and let go of its memory once the device is past it (an aborted kernel still
        launches when its stream gets there). A cancellation ends the wait, not the
        drain: the memory stays until then, for ever if the device never gets there.
        The caller raises its own error, so the drain's is dropped."""
        try:
            self.abort()
            drained = self._spawn(self._complete(touched))
        except BaseException as exc:  # no drain to hand the memory to
            self._leak(held, f"{type(exc).__name__}: {exc}")
            raise
        drained.add_done_callback(functools.partial(self._drained, held))
        with contextlib.suppress(Exception):
            await asyncio.shield(drained)

    def _drained(self, held: _Held, drained: asyncio.Future[None]) -> None:
        if drained.cancelled():  # (the loop ending: asyncio.run cancels what is left)
            self._leak(held, "its wait was cancelled")
        elif (exc := drained.exception()) is None or isinstance(exc, WaitFailed):
            self._let_go(held)  # (a GPU's error: told once every stream's wait was over)
        else:  # (a stop shut the waiting threads down)
            self._leak(held, exc.message if isinstance(exc, CallError) else f"{type(exc).__name__}: {exc}")

    def _leak(self, held: _Held, why: str) -> None:
        """An op's memory (aborted, or launched as the engine closed), with no word that its
        streams got past it: on a GPU its kernel still launches when they do, so a close now
        would unmap it under that kernel. It stays held (and the streams with it) until the
        process exits."""
        log.warning("world %s: the device was not seen past an op (%s): its %d bytes of "
                    "memory stay mapped until the daemon exits", self._world, why,
                    sum(region.nbytes for region in held.regions))

    def _landed(self, task: asyncio.Task[None]) -> None:
        """An op answered early finished: its failure is the world's (see async_error), also
        when it aborted the communicator itself (a mismatch found by the root)."""
        self._later.discard(task)
        if not task.cancelled() and task.exception() is not None and self._failure is None:
            exc = task.exception()
            self._failure = exc.message if isinstance(exc, CallError) else f"{type(exc).__name__}: {exc}"

    def _hold(self, held: _Held) -> None:
        taken: list[UsedByOps] = []
        try:
            for thing in [*(region.mapping for region in held.regions), *held.events]:
                thing.hold()
                taken.append(thing)
        except CallError:
            for thing in taken:
                thing.let_go()
            raise
        self._running += 1

    def _let_go(self, held: _Held) -> None:
        self._running -= 1
        for region in held.regions:
            region.mapping.let_go()
        for pair in held.events:
            pair.let_go()
        self._maybe_teardown()

    def _device_call(self, fn: Callable[..., None], *args: object) -> None:
        try:
            fn(*args)
        except GpuError as exc:
            raise CallError(ErrorCode.ENGINE, str(exc)) from None

    def abort(self) -> None:
        """Stop the communicators: ncclCommAbort ends kernels still waiting on peers. It
        runs through the gate (the loop goes on, its NCCL calls wait); the streams go once
        it and the ops are done. Nothing calls these communicators after this."""
        if not self._aborted:
            self._abort_comms()

    def _abort_comms(self, why: str = "") -> None:
        self._aborted = True
        self._admissions.open(CallError(ErrorCode.WORLD_FAILED, "communicator was aborted"))
        comms, self._comms = self._comms, {}
        if comms:
            self._aborting = True  # the streams stay until the abort returned
            self._gate.run(f"ncclCommAbort (world {self._world}, {_ranks(comms)}{why})",
                           functools.partial(self._abort, comms), then=self._abort_returned)
        self._maybe_teardown()

    def _abort(self, comms: Mapping[int, int]) -> None:
        """On the gate's thread."""
        started = time.monotonic()
        for rank, comm in comms.items():
            with contextlib.suppress(GpuError):  # (already broken: nothing more to stop)
                self._gpu.use_device(self._devices[rank])
                self._gpu.comm_abort(comm)
        took = time.monotonic() - started  # the NCCL worlds of this daemon waited this long
        log.log(logging.WARNING if took > 1.0 else logging.INFO,
                "world %s: ncclCommAbort of %d communicators took %.2f s", self._world, len(comms), took)

    def _abort_returned(self) -> None:
        self._aborting = False
        self._abort_over.set()
        ended, self._launches_to_end = self._launches_to_end, 0
        for _ in range(ended):
            self._freer.launches.end()
        self._maybe_teardown()

    def busy(self) -> bool:
        return self._running > 0 or self._registrations.draining

    def _maybe_teardown(self) -> None:
        if self._aborted and not self.busy() and not self._aborting:
            self._teardown()

    def register(self, rank: int, key: int, region: Region) -> None:
        self._registrations.register(rank, key, region)

    def deregister(self, rank: int, key: int) -> None:
        self._registrations.deregister(rank, key)

    def async_error(self) -> str | None:
        if self._failure is not None:
            return self._failure
        if self._init_failure is not None:
            return self._init_failure.message
        if self._aborted or self._gate.closed:  # (asked again next round)
            return None
        for rank, comm in self._comms.items():
            state, why = self._gpu.comm_state(comm)
            if state is CommState.FAILED:
                return f"rank {rank}'s NCCL communicator failed: {why}"
        return None

    # ---- internals ----------------------------------------------------------------------

    def _check(self) -> None:
        if self._init_failure is not None:
            raise CallError(self._init_failure.code, self._init_failure.message)
        if self._aborted:
            raise CallError(ErrorCode.WORLD_FAILED, "communicator was aborted")

    async def _settle(self, ranks: Iterable[int] | None = None) -> None:
        """Wait while NCCL is still setting communicators up (init, or a group's launch
        returning ncclInProgress): those of `ranks`, or all; fail if one failed. Also
        while an abort runs (the gate is closed): it returns with the gate open, so the
        NCCL calls its caller makes next, with no await between, run with no abort beside."""
        pause = 0.0
        wanted = set(self._ranks if ranks is None else ranks)
        while True:
            self._check()
            if self._gate.closed:
                await self._gate.opened()
                continue
            pending = False
            for rank, comm in [(r, c) for r, c in self._comms.items() if r in wanted]:
                try:
                    state, why = self._gpu.comm_state(comm)
                except GpuError as exc:
                    raise CallError(ErrorCode.ENGINE, f"rank {rank}'s NCCL communicator: {exc}") from None
                if state is CommState.FAILED:
                    raise CallError(ErrorCode.ENGINE, f"rank {rank}'s NCCL communicator failed: {why}")
                pending |= state is CommState.IN_PROGRESS
            if not pending:
                return
            await asyncio.sleep(pause)
            pause = min(_SETTLE_MAX_S, pause * 2 or 0.0001)

    def use_add_kernel(self, ranks: frozenset[int]) -> None:
        self._adds.enable(self._world_size == 2 and ranks.issuperset(self._ranks))

    def _agreement_failed(self, message: str) -> None:
        """Another daemon broke the add path's agreement: the world fails (async_error)."""
        if self._failure is None:
            self._failure = message
        self.abort()

    def _spawn(self, work: Coroutine[None, None, None], turn: Turn | None = None) -> asyncio.Task[None]:
        task = self._tasks.spawn(work)
        if turn is not None:  # cancelled before it began, it would keep its place for ever
            task.add_done_callback(lambda _task: self._turns.leave(turn))
        return task

    async def _launch_batch(self, batch: list[Launch], ranks: list[int]) -> None:
        """The launch, in its ranks' turn (the Batcher's) from before NCCL is called until
        their state is ncclSuccess again: only then are the kernels on the streams (a
        non-blocking group end may return ncclInProgress and enqueue them later, from
        NCCL's own thread), so only then may the add kernels and the done events follow
        them there."""
        self._check()
        await self._settle(ranks)  # their previous launch (or the init) returned ncclSuccess
        self._registrations.register_pending(ranks)
        for entry in batch:
            for mapping in entry.mappings:
                mapping.launches += 1
        self._freer.launches.begin()
        try:
            launch(self._gpu, [(entry.calls, entry.order) for entry in batch], self._comms, self._streams,
                   self._devices)
            await self._settle(ranks)
        finally:
            if self._aborting:  # NCCL's thread may enqueue it until the abort returned
                self._launches_to_end += 1
            else:
                self._freer.launches.end()
        for entry in batch:
            self._adds.launch_adds(entry.adds, self._streams)
            self._record_done(entry)
            entry.completion.update(self._completions.record(self._streams, entry.touched))

    def _record_done(self, entry: Launch) -> None:
        """The workers' streams wait for these, not for our reply."""
        if entry.order is None:
            return
        for rank in entry.touched:
            pair = entry.order.events.get(rank)
            if isinstance(pair, NcclEvents):
                self._device_call(self._gpu.event_record, pair.done, self._streams[rank])

    async def _complete(self, ranks: Iterable[int]) -> None:
        """Record an event behind the op on each stream and wait for all of them."""
        ranks = list(ranks)
        if self._aborting:  # a launch that failed half made may still be enqueued by NCCL's
            await self._abort_over.wait()  # thread until the abort returned: an event now would precede it
        async with self._turns.take(ranks):  # no work on a stream during its rank's launch
            # (none to wait for on a rank without a stream: its init never came)
            events = self._completions.record(self._streams, [r for r in ranks if r in self._streams])
        await self._completions.wait(events, on_error=self.abort)

    def _scratch_ptr(self, rank: int) -> int:
        mapping = self._scratch.get(rank)
        if mapping is None:
            mapping = self._scratch[rank] = self._new_mapping(8, rank)
        return mapping.region(0, 1).ptr

    def _new_mapping(self, nbytes: int, rank: int) -> NcclMapping:
        """Device memory of the engine's own on the rank's GPU."""
        try:
            return NcclMapping(self._freer, self._gpu.alloc(nbytes, self._devices[rank]))
        except GpuError as exc:
            raise CallError(ErrorCode.LIMIT, f"cannot allocate {nbytes} bytes on GPU "
                                             f"{self._devices[rank]}: {exc}") from None

    def _teardown(self) -> None:
        """Free streams, events and scratch once nothing runs on them and the abort
        returned, and the registrations' memory (NCCL dropped them with the communicators)."""
        self._registrations.release()
        self._completions.close()
        for stream in self._streams.values():
            with contextlib.suppress(GpuError):  # a broken device: the driver frees it at exit
                self._gpu.stream_destroy(stream)
        self._streams.clear()
        for mapping in self._scratch.values():
            mapping.close()
        self._scratch.clear()
        self._adds.close()


def _ranks(comms: Mapping[int, int]) -> str:
    return f"rank{'s' if len(comms) > 1 else ''} {', '.join(map(str, comms))}"
