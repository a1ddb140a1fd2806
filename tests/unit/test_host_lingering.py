"""A mapping closed while something still holds a view of it is unmapped once the view
goes, even when only a garbage cycle held it and the collector has not run."""

from __future__ import annotations

import asyncio
import gc
import os
import threading
from collections.abc import Iterator

import pytest

from commd.engine.host import HostEngine
from commd.engine.hostmemory import HostMapping, create_memfd
from proto import MemKind

pytestmark = pytest.mark.timeout(30)
NAME = "commd-lingering-test"


def mapped() -> int:
    with open("/proc/self/maps") as maps:
        return sum(1 for line in maps if NAME in line)


@pytest.fixture
def no_collector() -> Iterator[None]:
    """As in the daemon, whose collector rarely runs (commd.daemon._tune_gc)."""
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


async def until(predicate: object, timeout: float = 5.0) -> bool:
    for _ in range(int(timeout / 0.05)):
        if predicate():  # type: ignore[operator]
            return True
        await asyncio.sleep(0.05)
    return False


def imported(engine: HostEngine, size: int = 4096) -> HostMapping:
    fd = create_memfd(size, NAME)
    try:
        return engine.import_memory(MemKind.HOST, size, b"", fd)
    finally:
        os.close(fd)  # (the caller's: the mapping needs it no more)


async def test_a_view_in_a_garbage_cycle_does_not_keep_the_mapping(no_collector: None) -> None:
    engine = HostEngine(threads=1)
    try:
        mapping = imported(engine)
        cycle: list[object] = [mapping.region(0, 64)]
        cycle.append(cycle)  # like a failed op's traceback: frame -> future -> exception -> frame
        mapping.close()
        assert mapped() == 1 and len(engine.unmapper) == 1
        del cycle
        # (unmapped on the unmap thread; the loop hears of it a moment later)
        assert await until(lambda: mapped() == 0 and len(engine.unmapper) == 0), \
            "the mapping outlived its last (garbage) view"
    finally:
        engine.close()


async def test_a_view_in_use_keeps_the_mapping_until_it_goes(no_collector: None) -> None:
    engine = HostEngine(threads=1)
    try:
        mapping = imported(engine)
        region = mapping.region(0, 64)
        mapping.close()
        await asyncio.sleep(3 * engine.unmapper.RETRY_S)
        region.array[:] = 7  # still mapped: an op in flight finishes on it
        assert mapped() == 1 and len(engine.unmapper) == 1
        del region
        assert await until(lambda: mapped() == 0)
    finally:
        engine.close()


async def test_the_unmap_runs_off_the_loop() -> None:
    """The last unmap of a departed worker's memory frees every page (seconds for tens of
    GiB): it runs on the engine's unmap thread, and whoever waits for it hears on the loop."""
    engine = HostEngine(threads=1)
    held = threading.Event()
    try:
        mapping = imported(engine, engine.unmapper.AT_ONCE_BYTES + 4096)  # (a small one goes at once)
        engine.unmapper._thread.submit(held.wait, 10)  # the unmap thread is busy for now
        released: list[str] = []
        mapping.close(lambda: released.append(threading.current_thread().name))
        assert mapped() == 1 and released == [] and len(engine.unmapper) == 1  # not done here
        held.set()
        assert await until(lambda: released and mapped() == 0)
        assert released == [threading.current_thread().name] and len(engine.unmapper) == 0
    finally:
        held.set()
        engine.close()


async def test_a_small_mapping_no_view_holds_is_unmapped_at_once() -> None:
    """(Its connection's limits are free before the client's next packet.) Past
    AT_ONCE_BYTES in one turn of the loop, the rest go on the thread; one a view holds
    still waits for the view to go."""
    engine = HostEngine(threads=1)
    busy = threading.Event()
    try:
        released: list[str] = []
        imported(engine).close(lambda: released.append("free"))
        assert released == ["free"] and mapped() == 0 and len(engine.unmapper) == 0
        await asyncio.sleep(0)
        turn = [imported(engine) for _ in range(engine.unmapper.AT_ONCE_BYTES // 4096 + 2)]
        engine.unmapper._thread.submit(busy.wait, 10)  # (so the thread's two are seen waiting)
        for mapping in turn:
            mapping.close()
        assert mapped() == 2 and len(engine.unmapper) == 2
        busy.set()
        assert await until(lambda: mapped() == 0)
        mapping = imported(engine)
        region = mapping.region(0, 64)
        mapping.close(lambda: released.append("held"))
        assert released == ["free"] and mapped() == 1
        del region
        assert await until(lambda: released == ["free", "held"] and mapped() == 0)
    finally:
        busy.set()
        engine.close()


async def test_a_mapping_no_view_holds_is_let_go_before_its_unmap() -> None:
    """(Its connection's limits are free before the client's next packet, which may come
    before a large mapping's unmap is back from the thread.) One a view holds is let go
    as it unmaps, once the view went."""
    engine = HostEngine(threads=1)
    busy = threading.Event()
    try:
        told: list[str] = []
        mapping = imported(engine, engine.unmapper.AT_ONCE_BYTES + 4096)
        engine.unmapper._thread.submit(busy.wait, 10)  # the unmap thread is busy for now
        mapping.close(lambda: told.append("unmapped"), lambda: told.append("let go"))
        assert told == ["let go"] and mapped() == 1
        busy.set()
        assert await until(lambda: told == ["let go", "unmapped"] and mapped() == 0)
        told.clear()
        mapping = imported(engine, engine.unmapper.AT_ONCE_BYTES + 4096)
        region = mapping.region(0, 64)
        mapping.close(lambda: told.append("unmapped"), lambda: told.append("let go"))
        await asyncio.sleep(2 * engine.unmapper.RETRY_S)
        region.array[:] = 7  # (an op in flight finishes on it)
        assert told == [] and mapped() == 1
        del region
        assert await until(lambda: told == ["let go", "unmapped"] and mapped() == 0)
    finally:
        busy.set()
        engine.close()
