"""The host engine runs small ops on the event loop's own thread, within a budget per turn
of the loop: a group of hundreds of small ops, all matched in one turn, must not hold the
loop (and every other world's calls) for all of them; past the budget an op waits for a
later turn, after the loop has served the rest."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import numpy as np
import pytest

from client import hostmem
from commd.engine.host import InlineBudget
from commd.launch import DaemonProcess
from tests.fault.ranks import joined, on_both, own_daemon

pytestmark = pytest.mark.timeout(60)


async def test_small_ops_past_a_turns_budget_wait_for_the_next_turn() -> None:
    budget = InlineBudget(op_bytes=100, turn_bytes=300, op_cost=0)
    assert [budget.take(100) for _ in range(4)] == [True, True, True, False]
    assert not budget.take(1)  # (spent: nothing more this turn)
    await asyncio.sleep(0)  # the loop turns
    assert [budget.take(100) for _ in range(4)] == [True, True, True, False]
    assert not budget.small(101) and budget.small(100)  # too big to run inline in any turn


async def test_lone_small_ops_never_wait() -> None:
    """One op a turn: the budget starts afresh in the turn after half of it went, so it
    never runs out (a callback every other op here, every 32nd with the daemon's sizes)."""
    budget = InlineBudget(op_bytes=100, turn_bytes=300, op_cost=0)
    for _ in range(20):
        assert budget.take(100)
        await asyncio.sleep(0)


async def test_a_fresh_budget_takes_any_small_op() -> None:
    """However the sizes compare, an op never waits for a budget that cannot fit it."""
    budget = InlineBudget(op_bytes=0, turn_bytes=0)
    assert [budget.take(0), budget.take(0)] == [True, False]
    await asyncio.sleep(0)
    assert budget.take(0)


async def test_every_op_costs_something() -> None:
    budget = InlineBudget(op_bytes=100, turn_bytes=300, op_cost=50)
    assert [budget.take(0) for _ in range(7)] == [True] * 6 + [False]  # barriers: 50 each


@pytest.fixture
def daemon() -> Iterator[DaemonProcess]:
    yield from own_daemon()


def test_a_group_longer_than_the_budget_keeps_its_order(daemon: DaemonProcess) -> None:
    """40 all_reduces of one 64 KiB buffer in one group (the budget runs 16 of them in a
    turn): each doubles what the one before left, so only the calls' order gives 2**40."""
    mems = [hostmem.alloc(64 * 1024) for _ in range(2)]
    for mem in mems:
        mem.view(np.int64)[:] = 1
    with joined(daemon, 10) as comms:

        def grouped(r: int) -> None:
            comms[r].group_start()
            for _ in range(40):
                comms[r].all_reduce(mems[r].ptr, 64 * 1024, dtype="i64")
            comms[r].group_end()

        on_both(grouped)
    assert [set(mem.view(np.int64).tolist()) for mem in mems] == [{2 ** 40}, {2 ** 40}]
