"""A rank's count of calls not yet done (`--max-pending-ops`) and the world's call deadline
are about the current epoch: an op of a failed epoch that finishes after the rebuild does
not count against the new one, nor fail it."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

import proto
from commd.engine.base import EngineOp, Region
from commd.errors import CallError
from commd.world import World, WorldState
from proto import ErrorCode

pytestmark = pytest.mark.timeout(30)


class Held:
    """A communicator whose ops run until `go` is set."""

    launches_in_order = False

    def __init__(self) -> None:
        self.go = asyncio.Event()

    def try_inline(self, op: EngineOp) -> bool:
        return False

    async def run(self, op: EngineOp, order: Any = None, requests: frozenset[object] = frozenset()) -> None:
        await self.go.wait()

    def abort(self) -> None:
        pass

    def busy(self) -> bool:
        return not self.go.is_set()

    def async_error(self) -> str | None:
        return None

    def use_add_kernel(self, enabled: bool) -> None:
        pass

    def register(self, rank: int, key: int, region: Region) -> None:
        pass

    def deregister(self, rank: int, key: int) -> None:
        pass


class HeldEngine:
    name = "held"

    def __init__(self) -> None:
        self.made: list[Held] = []

    def communicator(self, *args: Any, **kwargs: Any) -> Held:
        self.made.append(Held())
        return self.made[-1]


class Peer:
    def __init__(self) -> None:
        self.sent: list[proto.Message] = []

    def send(self, msg: proto.Message) -> None:
        self.sent.append(msg)

    def close_if_hung_up(self) -> None:
        pass  # (always connected)


def barrier(world: World, rank: int, request_id: int) -> None:
    world.submit(rank, request_id, [(proto.Barrier(), ())])


def rebuilt_while_a_barrier_runs(world: World, peers: dict[int, Peer], why: str) -> None:
    """Epoch 1's barrier of both ranks runs in the (held) engine; the world fails (`why`)
    and forms again at epoch 2, with the same connections."""
    world.form(1, (0, 1), ())
    world.members.update(peers)
    barrier(world, 0, 1)
    barrier(world, 1, 1)  # matched: epoch 1's barrier runs (held)
    world.fail(ErrorCode.WORLD_FAILED, why)
    world.form(2, (0, 1), ())
    world.members.update(peers)


async def test_an_op_of_a_failed_epoch_finishing_late_leaves_the_new_epochs_count() -> None:
    engine = HeldEngine()
    world = World("w", 2, None, engine, lambda _: None, max_pending_ops=1)  # type: ignore[arg-type]
    peers = {0: Peer(), 1: Peer()}
    try:
        rebuilt_while_a_barrier_runs(world, peers, "a rank asked for a rebuild")
        barrier(world, 0, 2)  # epoch 2: rank 0's one call allowed, waiting for rank 1's
        engine.made[0].go.set()  # epoch 1's barrier ends now
        for _ in range(5):
            await asyncio.sleep(0)
        assert proto.Ok(1) in peers[0].sent  # (the old barrier answered)
        with pytest.raises(CallError) as refused:  # still one pending in epoch 2: no room
            barrier(world, 0, 3)
        assert refused.value.code is ErrorCode.LIMIT
    finally:
        world.shutdown("the test ends")
        world.forget_if_empty()


async def test_an_op_of_a_failed_epoch_still_running_does_not_time_the_rebuilt_epoch_out() -> None:
    """A rank's connection is lost while both ranks' barrier runs in the engine (NCCL: one
    waiting for the lost peer until its communicator is aborted, after a grace of 2 s);
    the world is rebuilt at once and stays idle. Before: the new epoch's watch found epoch
    1's barrier still open past the 0.2 s call deadline and failed the healthy epoch 2
    with TIMEOUT ("rank 0's call #0 barrier() did not complete within 0.2s")."""
    engine = HeldEngine()
    world = World("w", 2, None, engine, lambda _: None, call_timeout_s=0.2)  # type: ignore[arg-type]
    peers = {0: Peer(), 1: Peer()}
    try:
        rebuilt_while_a_barrier_runs(world, peers, "rank 1's connection was lost")
        await asyncio.sleep(0.6)  # past the deadline, several watch intervals
        assert world.state is WorldState.READY, world.cause
        assert world.epoch == 2
        engine.made[0].go.set()  # epoch 1's barrier ends: answered, as ops in the engine are
        for _ in range(5):
            await asyncio.sleep(0)
        assert proto.Ok(1) in peers[0].sent and proto.Ok(1) in peers[1].sent
        barrier(world, 0, 2)
        barrier(world, 1, 2)  # and the new epoch runs its calls
        engine.made[1].go.set()
        for _ in range(5):
            await asyncio.sleep(0)
        assert proto.Ok(2) in peers[0].sent and proto.Ok(2) in peers[1].sent
        assert world.state is WorldState.READY, world.cause
    finally:
        for made in engine.made:
            made.go.set()
        world.shutdown("the test ends")
        world.forget_if_empty()
