"""Which of a world's ops go to NCCL together, and in what order (DESIGN §5)."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from dataclasses import dataclass, field

from proto import ErrorCode

from ..errors import CallError
from .addpath import Add
from .base import Order
from .ncclcalls import Call
from .ncclmemory import NcclMapping
from .turns import Turn, Turns


@dataclass(frozen=True, slots=True)
class Launch:
    """One op's part of a launch: its NCCL calls, what orders it (the workers' events),
    its add-kernel plan, the ranks it touches, and the future its run awaits."""

    calls: list[Call]
    order: Order | None
    adds: list[Add]
    touched: list[int]
    launched: asyncio.Future[None]
    mappings: list[NcclMapping]  # the memory it uses
    requests: frozenset[object]  # the client requests its calls came in (see Batcher.launch_soon)
    # the events recorded behind the op at its launch, in its turn: one recorded later
    # would follow whatever launched meanwhile, and wait for it (see NcclCommunicator._launch_batch)
    completion: dict[int, int] = field(default_factory=dict)


class Batcher:
    """Gathers one communicator's ops into launches: which go in one NCCL group, in
    what order their ranks' turns are taken, and each op told how its launch went.
    What a launch calls is the communicator's (`launch`, run in the launch's turn)."""

    def __init__(self, turns: Turns,
                 spawn: Callable[[Coroutine[None, None, None], Turn], object],
                 launch: Callable[[list[Launch], list[int]], Awaitable[None]]) -> None:
        self._turns = turns
        self._spawn = spawn  # keeps the launch's task, and leaves its turn however it ends
        self._launch = launch  # (the batch, its ranks): raises CallError for every op of it
        self._batch: list[Launch] = []  # ops to launch at the end of this turn of the loop

    async def launch_soon(self, entry: Launch) -> None:
        """Launch at the end of this turn of the event loop, in one NCCL group with the
        ops of this turn that came in the same client request (a worker's group, whose
        calls match one by one, all in the turn its last rank's request arrived): its
        sends and receives then pair up inside NCCL, as they must (two ranks sending each
        other large messages in separate groups would each wait for the other's receive
        forever). Ops of other requests go in groups of their own: NCCL picks a
        collective's algorithm by what else is in its group (enqueue.cc, updateCollCostTable's
        numPipeOps), so every daemon must group a world's collectives alike, and only the
        workers' requests are alike everywhere; an op merged with an unrelated one would
        also complete only with it.

        An add-path op launches alone: its sum lands in its buffer only with its add, after
        every NCCL call of its launch, so an op launched with it could read (or write) the
        buffer on the wrong side of that add. It launches right after the rest of its
        launch, whatever its place in the request: the other daemon's rank (whose side of
        the exchange launches alone as well) may have called its sends and receives of the
        group on the other side of the sum, and a send to it launched alone before the
        exchange, its receive after, would each wait for the other's for ever. (A group's
        calls run in no order among themselves, in NCCL as here.)"""
        if not self._batch:
            asyncio.get_running_loop().call_soon(self._flush)
        self._batch.append(entry)
        await entry.launched

    def _flush(self) -> None:
        batch, self._batch = self._batch, []
        for launch in _by_request(batch):
            together = [entry for entry in launch if not entry.adds]
            if together:
                self._launch_now(together)
            for entry in launch:
                if entry.adds:
                    self._launch_now([entry])

    def _launch_now(self, batch: list[Launch]) -> None:
        """Its turn is taken here, at once, so launches keep the order they were asked for."""
        turn = self._turns.take({rank for entry in batch for rank in entry.touched})
        self._spawn(self._launch_batch(batch, turn), turn)

    async def _launch_batch(self, batch: list[Launch], turn: Turn) -> None:
        try:
            async with turn:
                await self._launch(batch, turn.ranks)
        except BaseException as exc:  # whatever it was, every op of the batch must hear of it
            code, message = (exc.code, exc.message) if isinstance(exc, CallError) else (
                ErrorCode.ENGINE, f"NCCL launch failed: {type(exc).__name__}: {exc}")
            for entry in batch:  # each its own: a shared one would gather tracebacks
                if not entry.launched.done():
                    entry.launched.set_exception(CallError(code, message))
            if not isinstance(exc, Exception):
                raise
            return
        for entry in batch:
            if not entry.launched.done():  # its run was cancelled meanwhile
                entry.launched.set_result(None)


def _by_request(batch: Sequence[Launch]) -> list[list[Launch]]:
    """The batch cut into launches, in order: an op joins the launch of an earlier op
    sharing a request with it, and so does every op between them (on a rank they share,
    NCCL must see the calls in the order they matched)."""
    last = {request: i for i, entry in enumerate(batch) for request in entry.requests}
    launches: list[list[Launch]] = []
    reach = -1  # the last op the current launch must take in
    for i, entry in enumerate(batch):
        if i > reach:
            launches.append([])
        launches[-1].append(entry)
        reach = max(reach, i, *(last[request] for request in entry.requests))
    return launches
