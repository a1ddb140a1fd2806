"""Per-rank turns (commd/engine/turns.py): each rank's work goes in the order it was
asked for, a turn over several ranks waits to be first in all of them, and ranks not
shared go on independently."""

from __future__ import annotations

import asyncio

import pytest

from commd.engine.turns import Turns

pytestmark = pytest.mark.timeout(10)


async def test_one_ranks_turns_go_in_the_order_taken() -> None:
    turns = Turns([0, 1])
    first, second = turns.take([0]), turns.take([0])
    assert first.ready.done() and not second.ready.done()
    turns.leave(first)
    assert second.ready.done()


async def test_other_ranks_go_on_and_a_shared_turn_overtakes_nobody() -> None:
    turns = Turns([0, 1, 2])
    holding = turns.take([0])
    both = turns.take([0, 1])
    later_on_1 = turns.take([1])
    elsewhere = turns.take([2])
    assert holding.ready.done() and elsewhere.ready.done()
    assert not both.ready.done() and not later_on_1.ready.done()  # rank 1 keeps its order
    turns.leave(holding)
    assert both.ready.done() and not later_on_1.ready.done()
    turns.leave(both)
    assert later_on_1.ready.done()


async def test_a_turn_given_up_while_waiting_leaves_its_place() -> None:
    turns = Turns([0])
    holding = turns.take([0])
    waiting = turns.take([0])
    entered = asyncio.Event()

    async def use() -> None:
        async with waiting:
            entered.set()

    task = asyncio.ensure_future(use())
    await asyncio.sleep(0.01)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    after = turns.take([0])
    turns.leave(holding)
    assert after.ready.done() and not entered.is_set()


async def test_ranks_not_of_the_communicator_wait_for_nothing() -> None:
    turns = Turns([0])
    turns.take([0])
    assert turns.take([5]).ready.done() and turns.take([]).ready.done()
