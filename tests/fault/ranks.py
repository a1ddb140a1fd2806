"""Two ranks as threads of the test process, against a daemon of the test's own
(restartable: `kill()` then `start()`), for the client's harder paths."""

from __future__ import annotations

import contextlib
import shutil
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor, wait
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from client import CommError, DaemonBackend, hostmem
from commd.launch import DaemonProcess
from tests.integration.harness import short_tmpdir, world_name


def own_daemon(args: Sequence[str] = ()) -> Iterator[DaemonProcess]:
    """A fixture's body: a daemon started with `args`, stopped after the test."""
    tmp = short_tmpdir()
    process = DaemonProcess(Path(tmp) / "commd.sock", args=args).start()
    try:
        yield process
    finally:
        process.stop()
        shutil.rmtree(tmp, ignore_errors=True)


def on_both(fn: Callable[[int], Any]) -> list[Any]:
    """`fn(0)` and `fn(1)` on two threads; a failure raises the first rank's error with
    the other rank's outcome noted on it (one rank's error alone often hides the cause)."""
    pool = ThreadPoolExecutor(2)
    futures = [pool.submit(fn, r) for r in range(2)]
    wait(futures, 30)
    pool.shutdown(wait=False)  # (a rank still running is reported, not waited for)
    failed = [(r, f.exception(0)) for r, f in enumerate(futures) if f.done() and f.exception(0)]
    if failed or not all(f.done() for f in futures):
        first = failed[0][1] if failed else TimeoutError("on_both: a rank did not return in 30 s")
        assert first is not None
        for r, f in enumerate(futures):
            outcome = (("raised " + repr(f.exception(0))) if f.exception(0) else "returned")
            first.add_note(f"rank {r} {outcome if f.done() else 'still running'}")
        raise first
    return [f.result(0) for f in futures]


def join(daemon: DaemonProcess, timeout: float, world: str | None = None) -> list[DaemonBackend]:
    """Both ranks of `world` (default: a new name)."""
    name = world or world_name()
    return on_both(lambda r: DaemonBackend(str(daemon.socket_path), name, r, 2, timeout=timeout))


@contextlib.contextmanager
def joined(daemon: DaemonProcess, timeout: float,
           world: str | None = None) -> Iterator[list[DaemonBackend]]:
    """Both ranks of `world` (default: a new name), closed at the end."""
    comms = join(daemon, timeout, world)
    try:
        yield comms
    finally:
        for comm in comms:
            comm.close()


def summed(comms: list[DaemonBackend], bufs: list[hostmem.HostBuffer]) -> list[list[int]]:
    """Both ranks all_reduce two int32s at the start of their buffer: [3, 30] on both."""
    for r, buf in enumerate(bufs):
        buf.view(np.int32)[:2] = [r + 1, 10 * (r + 1)]
    on_both(lambda r: comms[r].all_reduce(bufs[r].ptr, 8, dtype="i32"))
    return [buf.view(np.int32)[:2].tolist() for buf in bufs]


def restart_daemon(daemon: DaemonProcess, comms: Sequence[DaemonBackend]) -> None:
    """kill -9 the ranks' daemon and start it again; each rank's calling thread meets the
    failure (so its attempt_reconnect rejoins the new daemon)."""
    daemon.kill()
    daemon.start()
    for comm in comms:
        met_the_failure(comm)


def met_the_failure(comm: DaemonBackend) -> None:
    """The calling thread meets the world's failure, as a worker's thread would."""
    with pytest.raises(CommError):
        comm.barrier()


def slowed(monkeypatch: pytest.MonkeyPatch, target: object, method: str, thread: str,
           seconds: float, *, after: bool = False,
           when: Callable[..., bool] = lambda *args, **kwargs: True) -> threading.Event:
    """Make `target.method` sleep `seconds` (before the call, or `after` it) on threads named
    `thread*` ('': any) when `when` holds for its arguments, to open a race's window wide. The event
    is set as the sleep starts."""
    real = getattr(target, method)
    sleeping = threading.Event()

    def pause(args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        if threading.current_thread().name.startswith(thread) and when(*args, **kwargs):
            sleeping.set()
            time.sleep(seconds)

    def slow(*args: Any, **kwargs: Any) -> Any:
        if not after:
            pause(args, kwargs)
        result = real(*args, **kwargs)
        if after:
            pause(args, kwargs)
        return result

    monkeypatch.setattr(target, method, slow)
    return sleeping
