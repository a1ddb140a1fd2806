"""How the NCCL engine learns, without blocking the event loop, that its streams got somewhere."""

from __future__ import annotations

import asyncio
import contextlib
import functools
from collections.abc import Callable, Coroutine, Iterable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor

from proto import ErrorCode

from ..errors import CallError
from .base import StillOnDevice
from .gpu import Gpu, GpuError


class WaitNotStarted(CallError):
    """The engine's waiting threads were shut down (the daemon stops): nothing will tell
    when the device is past the op, so its memory must stay (see NcclCommunicator._leak)."""

    def __init__(self, why: str) -> None:
        super().__init__(ErrorCode.SHUTDOWN, f"the daemon is stopping: the wait for the device "
                                             f"could not start ({why})")


class WaitFailed(CallError):
    """A wait failed on a GPU, raised (with `on_error`) once every other wait of the op was
    over: nothing of the op runs any more, so its memory may go."""

    def __init__(self, exc: GpuError) -> None:
        super().__init__(ErrorCode.ENGINE, f"waiting for the device failed: {exc}")


class Completions:
    """Events recorded on a world's streams (one per local rank), each waited for by a
    helper thread blocked in cuEventSynchronize, then kept for reuse. Closed (the streams
    torn down), it destroys its events, and each still being waited on once its thread
    is done with it."""

    def __init__(self, gpu: Gpu, waiters: ThreadPoolExecutor, devices: Mapping[int, int]) -> None:
        self._gpu = gpu
        self._waiters = waiters  # shared by every world of the engine
        self._devices = dict(devices)
        self._free: dict[int, list[int]] = {rank: [] for rank in devices}
        self._closed = False
        self._given_up: set[asyncio.Task[None]] = set()  # waits that outlive their op's answer

    def record(self, streams: Mapping[int, int], ranks: Iterable[int]) -> dict[int, int]:
        """An event behind the work queued so far on each rank's stream (none for a rank
        whose stream is gone)."""
        events: dict[int, int] = {}
        try:
            for rank in ranks:
                if rank not in streams or self._closed:
                    continue  # torn down: nothing of ours runs there any more
                free = self._free[rank]
                events[rank] = free.pop() if free else self._gpu.event_create(self._devices[rank])
                self._gpu.event_record(events[rank], streams[rank])
        except GpuError as exc:
            self.give_back(events)
            raise CallError(ErrorCode.ENGINE, f"waiting for the device failed: {exc}") from None
        return events

    def give_back(self, events: Mapping[int, int]) -> None:
        """Recorded events nobody waits on: reusable (or destroyed, once closed)."""
        for rank, event in events.items():
            self._back_now(rank, event)

    async def wait(self, events: Mapping[int, int], on_error: Callable[[], None] | None = None,
                   past: Mapping[int, asyncio.Future[None]] | None = None) -> None:
        """Wait on helper threads. An event is reused only once its thread is done with it:
        a cancelled wait leaves the thread blocked in cuEventSynchronize. With `on_error`,
        a wait that fails on one GPU calls it, then raises only once the other ranks' waits
        are over: their work may still use the memory the caller lets go after (it calls
        it to stop that work, which may wait for the failed rank's for ever). `past[rank]`
        is done once that rank's wait is over, whichever way."""
        loop = asyncio.get_running_loop()  # not in `finally`: a coroutine closed unfinished has none
        try:
            waits = {rank: self._waiters.submit(self._gpu.event_wait, event, self._devices[rank])
                     for rank, event in events.items()}
        except RuntimeError as exc:  # (shut down: the first submit fails, the loop's thread closes it)
            self.give_back(events)
            raise WaitNotStarted(str(exc)) from None
        wrapped = [asyncio.wrap_future(wait) for wait in waits.values()]
        for rank, wait in zip(waits, wrapped, strict=True):
            if past is not None and rank in past:
                wait.add_done_callback(functools.partial(mark_past, past[rank]))
        try:
            await asyncio.gather(*wrapped)
        except GpuError as exc:
            if on_error is not None:
                on_error()
                await asyncio.wait(wrapped)
                for other in wrapped:
                    if not other.cancelled():
                        other.exception()  # (retrieved: the first failure is the one to report)
                _raise_if_dropped(waits.values())
                raise WaitFailed(exc) from None
            raise CallError(ErrorCode.ENGINE, f"waiting for the device failed: {exc}") from None
        except asyncio.CancelledError:
            current = asyncio.current_task()
            if current is not None and current.cancelling():  # the caller gave up: its own word
                raise
            _raise_if_dropped(waits.values())
            raise
        finally:
            for rank, event in events.items():
                if waits[rank].done():  # returned, or cancelled before its thread took it
                    self._back_now(rank, event)
                else:
                    waits[rank].add_done_callback(functools.partial(self._back, loop, rank, event))

    async def wait_past_abort(self, events: Mapping[int, int], abort: Callable[[], None],
                              aborted: asyncio.Event, then: Callable[[asyncio.Task[None]], None]) -> None:
        """`wait`, until `aborted` is set (the abort returned): a rank whose stream is past
        the op need not wait for the others' then (one may never get there: a worker's
        kernel ahead of it that never ends). StillOnDevice tells each rank's when, and
        `then` follows the end of the whole wait (the memory may go then). An abort for a
        wait that failed on a GPU is no such word: that error ends the op, once every
        wait is over."""
        loop = asyncio.get_running_loop()
        past = {rank: loop.create_future() for rank in events}
        failed: list[bool] = []

        def on_error() -> None:
            failed.append(True)
            abort()

        device = loop.create_task(self.wait(events, on_error, past))
        self._given_up.add(device)  # (a task nobody awaits is held only weakly by the loop)
        device.add_done_callback(self._given_up.discard)
        try:
            await _until(device, aborted)
            if failed:
                await device
        except asyncio.CancelledError:
            if device.done() and not device.cancelled():
                device.exception()  # (failed in the turn we were cancelled: no one else reads it)
            device.cancel()
            raise
        if device.done():
            device.result()
            return
        device.add_done_callback(then)
        for future in past.values():  # (a wait that could not start, the engine closing, told none)
            device.add_done_callback(functools.partial(mark_past, future))
        raise StillOnDevice(ErrorCode.WORLD_FAILED, "communicator was aborted", past)

    def close(self) -> None:
        self._closed = True
        free, self._free = self._free, {rank: [] for rank in self._devices}
        for events in free.values():
            for event in events:
                self._destroy(event)

    def _back(self, loop: asyncio.AbstractEventLoop, rank: int, event: int, _wait: object) -> None:
        """(On the helper thread.) An event whose waiting thread is done."""
        with contextlib.suppress(RuntimeError):  # the loop is closed: the process is ending
            loop.call_soon_threadsafe(self._back_now, rank, event)

    def _back_now(self, rank: int, event: int) -> None:
        if self._closed:
            self._destroy(event)
        else:
            self._free[rank].append(event)

    def _destroy(self, event: int) -> None:
        with contextlib.suppress(GpuError):  # a broken device: the driver frees it at exit
            self._gpu.event_destroy(event)


async def unless_mismatched(device: Coroutine[None, None, None], verdict: Coroutine[None, None, None],
                            abort: Callable[[], None], aborted: asyncio.Event) -> None:
    """`device` (a wait_past_abort), and the members' fingerprints (`verdict`). On a
    mismatch NCCL may wait forever (or run calls that differ): `abort`, and the op ends
    as the device's wait lets it, with the mismatch's words (StillOnDevice's `past` as
    it was: each rank's answer waits for its own stream only, not for the others').
    The device past, a verdict still to come when `aborted` is set (the abort returned)
    is not waited for: it returns, and the caller answers for the abort (the peers'
    word may never come while the world's inbox stays open, and the op would hold its
    memory and the communicator until then)."""
    async def compare() -> None:
        try:
            await verdict
        except Exception:
            abort()
            raise

    compared = asyncio.ensure_future(compare())
    try:
        try:
            await device
        except StillOnDevice as exc:
            if (mismatch := _failure(compared)) is None:
                raise
            raise StillOnDevice(mismatch.code, mismatch.message, exc.past) from None
        except WaitNotStarted:
            raise  # (its memory must stay: a mismatch's words would let it go)
        except CallError:  # a GPU's wait failed, once every wait was over: the memory may go
            if (mismatch := _failure(compared)) is None:
                raise
            raise mismatch from None  # the aborted op's own error says less
        await _until(compared, aborted)
        if compared.done():  # (a mismatch found as the abort returned is still the better word)
            await compared
    finally:
        if compared.done() and not compared.cancelled():
            compared.exception()  # (retrieved: reported above, or the device's error was)
        compared.cancel()  # the device's wait ended the op first: nobody waits for the peers' word now


async def _until(task: asyncio.Future[None], aborted: asyncio.Event) -> None:
    """Until `task` ends or `aborted` is set, whichever comes first (`task` goes on)."""
    over: asyncio.Future[object] = asyncio.ensure_future(aborted.wait())
    try:
        await asyncio.wait((task, over), return_when=asyncio.FIRST_COMPLETED)
    finally:
        over.cancel()


def _raise_if_dropped(waits: Iterable[Future[None]]) -> None:
    """The engine closed (its pool's shutdown cancels the waits it had yet to start) with
    one of these still queued: nothing cancelled the op, and nothing will tell when the
    device is past it, as if the wait could not start at all."""
    if any(wait.cancelled() for wait in waits):
        raise WaitNotStarted("the waiting threads were shut down with it still queued")


def _failure(compared: asyncio.Future[None]) -> CallError | None:
    if not compared.done() or compared.cancelled():
        return None
    exc = compared.exception()
    return exc if isinstance(exc, CallError) else None


def mark_past(past: asyncio.Future[None], _wait: object = None) -> None:
    """(A done callback: `_wait`, what ended.)"""
    if not past.done():
        past.set_result(None)
