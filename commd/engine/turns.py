"""Per-rank turns: the order in which a communicator's work reaches NCCL and the streams."""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Iterable


class Turns:
    """Each local rank's work, in turn, in the order it was asked for (`take`, at once,
    when the launch or wait is created), so that NCCL sees each rank's calls in the order
    they matched, whatever other ranks a turn waits for too; ranks not shared go on
    independently. A turn goes when it is first in every queue it is in: the oldest turn
    always is, so none waits forever on another."""

    def __init__(self, ranks: Iterable[int]) -> None:
        self._queues: dict[int, deque[asyncio.Future[None]]] = {rank: deque() for rank in ranks}

    def take(self, ranks: Iterable[int]) -> Turn:
        turn = Turn(self, sorted(set(ranks) & self._queues.keys()))
        for rank in turn.ranks:
            self._queues[rank].append(turn.ready)
        self._wake(turn.ranks)
        return turn

    def leave(self, turn: Turn) -> None:
        for rank in turn.ranks:
            queue = self._queues[rank]
            if turn.ready in queue:
                queue.remove(turn.ready)
        self._wake(turn.ranks)

    def _wake(self, ranks: Iterable[int]) -> None:
        for rank in ranks:
            queue = self._queues[rank]
            head = queue[0] if queue else None
            if head is not None and not head.done() and all(
                    self._queues[r][0] is head for r in self._queues if head in self._queues[r]):
                head.set_result(None)


class Turn:
    """One holder's place in the ranks' queues; `async with` waits for it and leaves."""

    def __init__(self, turns: Turns, ranks: list[int]) -> None:
        self._turns = turns
        self.ranks = ranks
        self.ready: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        if not ranks:
            self.ready.set_result(None)

    async def __aenter__(self) -> None:
        try:
            await asyncio.shield(self.ready)
        except BaseException:
            self._turns.leave(self)
            raise

    async def __aexit__(self, *exc: object) -> None:
        self._turns.leave(self)
