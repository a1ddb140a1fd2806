"""WorldSweep: when the full collections after worlds' ends run, on a real event loop
(the collector itself counted in place of run)."""

from __future__ import annotations

import asyncio
import types

import pytest

import commd.sweep
from commd.sweep import WorldSweep

pytestmark = pytest.mark.timeout(30)

AT_LEAST_S = 0.2
DELAY_S = 2 * AT_LEAST_S  # (the daemon's: 30 s after the first end, at least 3 s after the last)


@pytest.fixture
def collections(monkeypatch: pytest.MonkeyPatch) -> list[float]:
    """The loop's clock at each collection the sweep runs (its delay made `DELAY_S`)."""
    ran: list[float] = []
    monkeypatch.setattr(commd.sweep, "SWEEP_AFTER_S", DELAY_S)
    monkeypatch.setattr(commd.sweep, "gc", types.SimpleNamespace(
        collect=lambda: ran.append(asyncio.get_running_loop().time())))
    return ran


async def test_a_world_forgotten_just_before_a_collection_gets_another(collections: list[float]) -> None:
    """The second world ends within `at_least_s` of the collection the first one's end
    armed, so may still be held at it: before, nothing collected it until some later
    world's end (one collection here, for ever)."""
    sweep = WorldSweep(AT_LEAST_S)
    sweep.world_forgotten()
    await asyncio.sleep(DELAY_S - AT_LEAST_S / 2)
    sweep.world_forgotten()
    await asyncio.sleep(DELAY_S * 3)
    assert len(collections) == 2, collections
    assert collections[1] - collections[0] >= DELAY_S * 0.99  # (still at most one per delay)
    sweep.close()


async def test_worlds_ending_long_before_the_collection_get_only_it(collections: list[float]) -> None:
    sweep = WorldSweep(AT_LEAST_S)
    sweep.world_forgotten()
    sweep.world_forgotten()
    await asyncio.sleep(DELAY_S * 3)
    assert len(collections) == 1, collections
    sweep.close()


async def test_worlds_forgotten_after_close_arm_nothing(collections: list[float]) -> None:
    """The daemon's stop closes the sweep (Registry.shutdown), then closes the ranks'
    connections, whose departures forget their worlds: before, that armed a collection
    again on a loop that was stopping."""
    sweep = WorldSweep(AT_LEAST_S)
    sweep.world_forgotten()
    sweep.close()
    sweep.world_forgotten()
    await asyncio.sleep(DELAY_S * 2)
    assert collections == []
