"""Shared fixtures: a real daemon process and a pool of real worker processes."""

from __future__ import annotations

import multiprocessing as mp
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest

from commd.launch import DaemonProcess
from tests.integration import workers
from tests.integration.harness import RankPool, short_tmpdir, world_name


@pytest.fixture(scope="session")
def daemon() -> Iterator[DaemonProcess]:
    tmp = short_tmpdir()
    log = open(Path(tmp) / "daemon.log", "wb")  # noqa: SIM115 - lives as long as the daemon
    proc = DaemonProcess(Path(tmp) / "run" / "commd.sock", log=log)
    proc.start()
    try:
        yield proc
    finally:
        code = proc.stop()
        log.close()
        shutil.rmtree(tmp, ignore_errors=True)
        assert code == 0, f"daemon exited with {code}"


class _Pools:
    """One live pool for the session, replaced when a test leaves it broken."""

    def __init__(self) -> None:
        self.current: RankPool | None = None

    def get(self) -> RankPool:
        if self.current is None or self.current.broken:
            if self.current is not None:
                self.current.close(force=True)
            self.current = RankPool(4)
        return self.current


@pytest.fixture(scope="session")
def _pools() -> Iterator[_Pools]:
    pools = _Pools()
    yield pools
    if pools.current is not None:
        pools.current.close()


@pytest.fixture
def pool(_pools: _Pools) -> RankPool:
    return _pools.get()


@pytest.fixture(scope="module")
def steady(daemon: DaemonProcess) -> Iterator[None]:
    """Two ranks of an unrelated world all_reduce and check, from first test to last."""
    ctx = mp.get_context("spawn")
    stop, running, results = ctx.Event(), ctx.Event(), ctx.Queue()
    world = world_name("steady")
    procs = [ctx.Process(target=workers.steady_loop,
                         args=(str(daemon.socket_path), world, r, 2, stop, results, running))
             for r in range(2)]
    for p in procs:
        p.start()
    assert running.wait(30), "the steady world never got going"
    yield
    stop.set()
    outcomes = [results.get(timeout=30) for _ in procs]
    for p in procs:
        p.join(10)
    for rank, iterations, errors in outcomes:
        assert errors == [], f"steady rank {rank} saw errors: {errors}"
        assert iterations > 0, f"steady rank {rank} never ran"


@pytest.fixture
def sock(daemon: DaemonProcess) -> str:
    return str(daemon.socket_path)
