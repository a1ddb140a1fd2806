"""register_buffer's memory with one world's NCCL communicators: registered in its rank's
turn once the communicator is ready (a non-blocking one takes no other call before), and
deregistered only once the ops that may still use it, on every local rank, are done.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Coroutine, Iterable, Mapping

from ..errors import CallError
from .base import Region
from .completion import Completions
from .gpu import Gpu, GpuError
from .launches import Launches
from .ncclmemory import NcclRegion
from .turns import Turn, Turns

log = logging.getLogger("commd.engine.nccl")


class NcclRegistrations:
    """One communicator's registrations, for one epoch (NCCL forgets them with its
    communicators: `release` lets go of their memory at teardown)."""

    def __init__(self, gpu: Gpu, world: str, ranks: tuple[int, ...], devices: Mapping[int, int],
                 turns: Turns, completions: Completions, streams: Mapping[int, int],
                 launches: Launches, comm_of: Callable[[int], int],
                 settle: Callable[[Iterable[int]], Awaitable[None]],
                 spawn: Callable[[Coroutine[None, None, None]], asyncio.Task[None]],
                 aborted: Callable[[], bool], on_drained: Callable[[], None]) -> None:
        self._gpu = gpu
        self._world = world
        self._ranks = ranks
        self._devices = devices
        self._turns = turns
        self._completions = completions
        self._streams = streams  # (the communicator's, as they are made and destroyed)
        self._launches = launches
        self._comm_of = comm_of  # a rank's NCCL communicator
        self._settle = settle
        self._spawn = spawn
        self._aborted = aborted
        self._on_drained = on_drained  # the drain of deregistrations ended (teardown may follow)
        # (rank, key) -> the memory, until its communicator is ready
        self._to_register: dict[tuple[int, int], NcclRegion] = {}
        self._registered: dict[tuple[int, int], tuple[int, NcclRegion]] = {}  # -> (NCCL's handle, memory)
        self._to_deregister: list[tuple[int, int, NcclRegion]] = []  # (rank, NCCL's handle, memory)
        self.draining = False  # a drain of deregistrations runs: the communicator is busy

    def register(self, rank: int, key: int, region: Region) -> None:
        if (isinstance(region, NcclRegion) and region.mapping.registrable and rank in self._ranks
                and not self._aborted()):
            self._to_register[(rank, key)] = region

    def deregister(self, rank: int, key: int) -> None:
        self._to_register.pop((rank, key), None)
        if self._aborted():  # NCCL forgets it with the communicator; the memory goes at teardown
            return
        registered = self._registered.pop((rank, key), None)
        if registered is None:
            return
        self._to_deregister.append((rank, *registered))
        if not self.draining:  # one drain takes every deregistration asked by then
            self.draining = True
            self._spawn(self._deregister_pending())

    async def _deregister_pending(self) -> None:
        """ncclCommDeregister unmaps the peers' view of the buffer at once: only once the
        ops queued so far finished, on every local rank (a peer's kernel may still read the
        buffer after its owner's ended). That wait holds no turn, and each rank's mark takes
        its own (an op may wait for a peer that waits for another launch of ours); if an op
        launched on one of these buffers meanwhile, it drains again (a buffer in constant
        use stays registered until it rests). The deregistrations then go together in one
        turn (NCCL must see all of a world's registrations or none in an op)."""
        try:
            while self._to_deregister and not self._aborted():
                pending = list(self._to_deregister)
                # (counted before the marks' turns are taken: a launch counted after it may
                # come after a mark, and is waited for in the next round)
                seen = [region.mapping.launches for _, _, region in pending]
                drained = await self._mark_each_rank()
                await self._completions.wait(drained)
                ranks = sorted({rank for rank, _, _ in pending})
                async with self._turns.take(ranks):
                    if [region.mapping.launches for _, _, region in pending] != seen:
                        continue  # one of them was launched on meanwhile: wait for that too
                    await self._settle(ranks)
                    while not self._launches.quiet():  # another world's (see launches.py)
                        await self._launches.idle()
                        await self._settle(ranks)  # (the gate may have closed meanwhile)
                    self._to_deregister = [p for p in self._to_deregister if p not in pending]
                    for rank, handle, _ in pending:
                        try:
                            self._gpu.use_device(self._devices[rank])
                            self._gpu.comm_deregister(self._comm_of(rank), handle)
                        except GpuError as exc:  # NCCL forgets it with the communicator anyway
                            log.debug("rank %d: NCCL deregistration: %s", rank, exc)
                    for _, _, region in pending:  # (past the turn's NCCL calls: a free may follow)
                        region.mapping.let_go()
        except CallError as exc:  # aborted or failed meanwhile: NCCL forgets them with it
            log.debug("world %s: deregistrations: %s", self._world, exc)
        finally:  # those left (aborted meanwhile) go at teardown, once the abort returned
            self.draining = False
            self._on_drained()

    async def _mark_each_rank(self) -> dict[int, int]:
        """An event behind the work queued so far on each local rank's stream, each in its
        own rank's turn: one turn of all the ranks would wait for a launch still connecting
        on one of them, and hold back the others' launches meanwhile, which that launch's
        peer may be waiting for first."""
        turns = [self._turns.take([rank]) for rank in self._ranks]  # (their places, now)
        marked: dict[int, int] = {}

        async def mark(turn: Turn) -> None:
            async with turn:
                marked.update(self._completions.record(self._streams, turn.ranks))

        try:
            outcomes = await asyncio.gather(*(mark(turn) for turn in turns), return_exceptions=True)
        except BaseException:
            self._completions.give_back(marked)  # not waited on: reusable
            raise
        finally:
            for turn in turns:  # (a mark cancelled before it began would keep its place)
                self._turns.leave(turn)
        for outcome in outcomes:
            if isinstance(outcome, BaseException):
                self._completions.give_back(marked)
                raise outcome
        return marked

    def register_pending(self, ranks: Iterable[int]) -> None:
        """The registrations waiting for these ranks' communicators (in their turn)."""
        wanted = set(ranks)
        pending = {which: region for which, region in self._to_register.items() if which[0] in wanted}
        for which in pending:
            del self._to_register[which]
        for (rank, key), region in pending.items():
            try:
                region.mapping.hold()  # registered memory stays until NCCL let go of it
            except CallError:
                continue  # forgotten meanwhile: nothing to register
            try:
                handle = self._gpu.comm_register(self._comm_of(rank), region.ptr, region.nbytes)
                self._registered[(rank, key)] = (handle, region)
            except GpuError as exc:  # NCCL refuses some memory (legacy cudaMalloc by default): fine
                region.mapping.let_go()
                log.debug("rank %d: NCCL did not register %d bytes: %s", rank, region.nbytes, exc)

    def release(self) -> None:
        """At teardown: NCCL dropped the registrations with the communicators, so their
        memory may go (those deregistered since included)."""
        registered, self._registered = self._registered, {}
        unregistered, self._to_deregister = self._to_deregister, []
        for region in [region for _, region in registered.values()] + [r for _, _, r in unregistered]:
            region.mapping.let_go()
