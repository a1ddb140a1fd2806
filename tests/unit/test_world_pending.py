"""A rank's count of calls not yet done (`--max-pending-ops`) and the world's call deadline
are about the current epoch: an op of a failed epoch that finishes after the rebuild does
not count against the new one, nor fail it."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

import proto
from commd import __version__
from commd.engine.base import EngineOp, Region
from commd.errors import MAX_TEXT, CallError, from_peer
from commd.world import World, WorldState
from proto import ErrorCode
from proto import peer as p
from proto.fields import MAX_RANKS, MAX_WORLD_NAME

pytestmark = pytest.mark.timeout(30)


class Held:
    """A communicator whose ops run until `go` is set."""

    launches_in_order = False
    reports_async_errors = False

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

    def use_add_kernel(self, ranks: frozenset[int]) -> None:
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

    def close_if_hung_up(self) -> bool:
        return False  # (always connected)


def barrier(world: World, rank: int, request_id: int) -> None:
    world.submit(rank, world.members[rank], request_id, [(proto.Barrier(), ())])  # (its connection's)


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


class HangingUp(Peer):
    """A connection whose client hangs up (gives up on its call) when told to: asked
    next, it closes, and its rank leaves the world, as a Session does."""

    def __init__(self, world: World, rank: int) -> None:
        super().__init__()
        self._world, self._rank = world, rank
        self.hung_up = self.closed = False

    def close_if_hung_up(self) -> bool:
        if self.hung_up and not self.closed:
            self.closed = True
            self._world.leave(self._rank, self)
        return self.closed


async def test_an_op_waiting_its_turn_does_not_start_once_a_rank_of_it_hung_up() -> None:
    """Both ranks' barrier #1 runs in the (held) engine; their op #2 (a barrier here, an
    all_reduce writing their buffers alike) is matched and waits its turn. Rank 0's client
    then gives up on it (CommTimeout) and hangs up, and may write its buffer. Before: op #2
    ran once #1 was done. Now it never starts, and rank 1 gets the world's failure."""
    engine = HeldEngine()
    world = World("w", 2, None, engine, lambda _: None)  # type: ignore[arg-type]
    peers = {0: HangingUp(world, 0), 1: HangingUp(world, 1)}
    ran: list[EngineOp] = []
    try:
        world.form(1, (0, 1), ())
        world.members.update(peers)
        held = engine.made[0]
        real_run = held.run

        async def run(op: EngineOp, *args: Any, **kwargs: Any) -> None:
            ran.append(op)
            await real_run(op, *args, **kwargs)

        held.run = run  # type: ignore[method-assign]
        barrier(world, 0, 1)
        barrier(world, 1, 1)  # matched: runs (held)
        barrier(world, 0, 2)
        barrier(world, 1, 2)  # matched: waits its turn
        await asyncio.sleep(0)
        assert len(ran) == 1
        peers[0].hung_up = True
        held.go.set()
        for _ in range(10):
            await asyncio.sleep(0)
        assert len(ran) == 1, ran  # (#1 only)
        assert world.state is WorldState.FAILED
        assert proto.Ok(1) in peers[1].sent
        failed = [m for m in peers[1].sent if isinstance(m, proto.Error) and m.id == 2]
        assert failed and "rank 0's connection was lost" in failed[0].message, peers[1].sent
    finally:
        engine.made[0].go.set()
        world.shutdown("the test ends")
        world.forget_if_empty()


async def test_a_call_s_error_keeps_its_advice_and_note_at_the_longest_name_epoch_and_size() -> None:
    """The room a world's cause leaves (errors.MAX_CAUSE) holds what a call's error says around
    it at the longest world name, epoch and world size: the note naming a code this daemon
    lacks and the advice end the error whole, within what the wire takes (the integration test
    in test_mixed_versions reaches neither that epoch nor that size)."""
    world = World("w" * MAX_WORLD_NAME, MAX_RANKS, None, HeldEngine(), lambda _: None)  # type: ignore[arg-type]
    peers = {0: Peer(), 1: Peer()}
    world.form(2**64 - 1, (0, 1), ())
    world.members.update(peers)
    note = f" (code 'quota_exceeded' from daemon {'d' * p.MAX_DAEMON_NAME}, unknown to commd {__version__})"
    try:
        barrier(world, 0, 1)  # waits for rank 1's
        world.fail(*from_peer("d" * p.MAX_DAEMON_NAME, "quota_exceeded", "x" * proto.MAX_ERROR_TEXT))
        (error,) = [m for m in peers[0].sent if isinstance(m, proto.Error)]
        with pytest.raises(CallError) as again:
            barrier(world, 1, 2)
        for message, advice in [
                (error.message, "; call attempt_reconnect on every rank"),
                (again.value.message, f"; call attempt_reconnect (0/{MAX_RANKS} ranks have)")]:
            assert message.startswith(f"world {world.name} epoch {2**64 - 1} failed: xxx"), message[:300]
            assert message.endswith(f" ... (cut){note}{advice}"), message[-400:]
            assert len(message) <= MAX_TEXT, len(message)
    finally:
        world.shutdown("the test ends")
        world.forget_if_empty()
