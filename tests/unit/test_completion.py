"""Completion events over the fake device: recorded behind a stream's work, waited for
on helper threads, reused, and destroyed once the streams are torn down, never under a
thread still waiting on one."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import pytest

from commd.engine.completion import Completions
from commd.engine.gpu import GpuError
from commd.errors import CallError
from proto import ErrorCode
from tests.contract.fakegpu import FakeGpu

pytestmark = pytest.mark.timeout(30)


@pytest.fixture
def gpu() -> Iterator[FakeGpu]:
    device = FakeGpu(devices=2)
    yield device
    assert device.violations == []


@pytest.fixture
def waiters() -> Iterator[ThreadPoolExecutor]:
    pool = ThreadPoolExecutor(4)
    yield pool
    pool.shutdown(wait=True)


async def test_an_event_waits_for_the_work_before_it_and_is_reused(gpu: FakeGpu,
                                                                  waiters: ThreadPoolExecutor) -> None:
    streams = {0: gpu.stream_create(0), 1: gpu.stream_create(1)}
    completions = Completions(gpu, waiters, {0: 0, 1: 1})
    kernel = gpu.worker_kernel(streams[1], gpu.worker_alloc(b"\x00" * 4, 1), b"\x01" * 4)
    events = completions.record(streams, [0, 1])
    waited = asyncio.ensure_future(completions.wait(events))
    await asyncio.sleep(0.1)
    assert not waited.done()  # rank 1's stream is still busy
    gpu.finish_kernel(kernel)
    await asyncio.wait_for(waited, 5)
    assert completions.record(streams, [0, 1]) == events  # the same two, reused
    assert completions.record(streams, [1, 2]).keys() == {1}  # rank 2 has no stream here


async def test_closed_while_a_thread_waits_the_event_goes_once_the_thread_is_done(
        gpu: FakeGpu, waiters: ThreadPoolExecutor) -> None:
    stream = gpu.stream_create(0)
    completions = Completions(gpu, waiters, {0: 0})
    before = gpu.live_events
    kernel = gpu.worker_kernel(stream, gpu.worker_alloc(b"\x00" * 4), b"\x01" * 4)
    events = completions.record({0: stream}, [0])
    waited = asyncio.ensure_future(completions.wait(events))
    await asyncio.sleep(0.1)
    waited.cancel()  # the run gave up: its thread stays in cuEventSynchronize
    with pytest.raises(asyncio.CancelledError):
        await waited
    completions.close()
    assert gpu.live_events == before + 1  # not under the waiting thread (the fixture checks)
    assert completions.record({0: stream}, [0]) == {}  # closed: nothing more is recorded
    gpu.finish_kernel(kernel)
    for _ in range(100):
        if gpu.live_events == before:
            break
        await asyncio.sleep(0.01)
    assert gpu.live_events == before


async def test_events_given_back_unwaited_are_reused_or_destroyed_once_closed(
        gpu: FakeGpu, waiters: ThreadPoolExecutor) -> None:
    stream = gpu.stream_create(0)
    completions = Completions(gpu, waiters, {0: 0})
    before = gpu.live_events
    events = completions.record({0: stream}, [0])
    completions.give_back(events)
    assert completions.record({0: stream}, [0]) == events
    completions.close()
    completions.give_back(events)
    assert gpu.live_events == before


async def test_a_failed_wait_is_an_engine_error(gpu: FakeGpu, waiters: ThreadPoolExecutor) -> None:
    stream = gpu.stream_create(0)
    completions = Completions(gpu, waiters, {0: 0})
    events = completions.record({0: stream}, [0])

    def broken(event: int, device: int) -> None:
        raise GpuError("cuEventSynchronize: an illegal memory access was encountered")

    gpu.event_wait = broken  # type: ignore[method-assign]
    with pytest.raises(CallError) as info:
        await completions.wait(events)
    assert info.value.code is ErrorCode.ENGINE and "illegal memory access" in info.value.message
