"""Shared fixtures: a real daemon process, a pool of real worker processes, a stand-in
daemon (recording), garbage and a lock held elsewhere."""

from __future__ import annotations

import compileall
import contextlib
import gc
import json
import multiprocessing as mp
import os
import queue
import shutil
import tempfile
import threading
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest

from commd.launch import DaemonProcess
from tests.integration import workers
from tests.integration.harness import RankPool, short_tmpdir, world_name
from tests.unit.standin import RecordingDaemon


def pytest_configure(config: pytest.Config) -> None:
    """Byte-compile the project once, before any xdist worker starts. The tests start
    many interpreters (daemons, spawned ranks, `python -c` programs), and where
    PYTHONDONTWRITEBYTECODE is set (as in the environment the suite was timed in) none
    of them writes the .pyc it compiled, so each compiled proto, commd and client from
    source again: about 0.2 s of every daemon's start, a fifth of the time of
    test_client_recovery and test_lifecycle. The flag stops only the writing: a .pyc
    that is there is read, and ignored once its source changes."""
    if os.environ.get("PYTEST_XDIST_WORKER"):  # (the controller compiled before it started them)
        return
    root = Path(__file__).resolve().parent.parent
    for package in ("proto", "commd", "client", "tests"):
        compileall.compile_dir(root / package, quiet=1)


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


@contextlib.contextmanager
def steady_world(specs: Sequence[str]) -> Iterator[Steady]:
    """Two ranks of an unrelated world, rank r through `specs[r]` (a socket path, or
    `path@host:port` across daemons), all_reduce and check until the block ends; then
    any error they saw fails the test."""
    ctx = mp.get_context("spawn")
    stop, running, results = ctx.Event(), ctx.Event(), ctx.Queue()
    errors = ctx.Value("i", 0)
    world = world_name("steady")
    procs = [ctx.Process(target=workers.steady_loop,
                         args=(spec, world, r, len(specs), stop, results, running, errors))
             for r, spec in enumerate(specs)]
    for p in procs:
        p.start()
    outcomes = []
    try:
        assert running.wait(30), "the steady world never got going"
        yield Steady(errors)
    finally:
        stop.set()
        with contextlib.suppress(queue.Empty):  # a rank that died says nothing: the check below tells
            for _ in procs:
                outcomes.append(results.get(timeout=30))
        for p in procs:
            p.join(10)
            if p.is_alive():
                p.kill()
                p.join(10)
    assert len(outcomes) == len(procs), f"only {len(outcomes)} of the steady world's ranks reported"
    for rank, iterations, seen in outcomes:
        assert seen == [], f"steady rank {rank} saw errors: {seen}"
        assert iterations > 0, f"steady rank {rank} never ran"


@pytest.fixture(scope="module")
def steady(daemon: DaemonProcess) -> Iterator[Steady]:
    """An unrelated world on the session's daemon, from the module's first test to its last."""
    with steady_world([str(daemon.socket_path)] * 2) as running:
        yield running


class Steady:
    """The unrelated world's error count so far (each fault scenario reports its share)."""

    def __init__(self, errors: Any) -> None:
        self._errors = errors

    def errors(self) -> int:
        return int(self._errors.value)


class FaultReport:
    """Rows for scripts/fault_report.sh: written as JSON where $FAULT_REPORT_JSON says."""

    def __init__(self) -> None:
        self.rows: list[dict[str, Any]] = []

    def add(self, scenario: str, detection_s: float, recovery_s: float,
            unrelated_errors: int | None, leaked: str) -> None:
        self.rows.append({"scenario": scenario, "detection_s": round(detection_s, 3),
                          "recovery_s": round(recovery_s, 3), "unrelated_errors": unrelated_errors,
                          "leaked": leaked})


@pytest.fixture(scope="session")
def fault_report() -> Iterator[FaultReport]:
    report = FaultReport()
    yield report
    path = os.environ.get("FAULT_REPORT_JSON")
    if path:
        with open(path, "w") as out:
            json.dump(report.rows, out, indent=2)


@pytest.fixture
def collected() -> None:
    """What earlier tests in this process left for the garbage collector (a backend never
    closed: its socket and memfd; an open log file) is closed now, not in the middle of a
    test that counts this process's fds or mappings (seen: 16 fds open against 18 before)."""
    gc.collect()


@pytest.fixture
def sock(daemon: DaemonProcess) -> str:
    return str(daemon.socket_path)


@pytest.fixture
def no_automatic_collection() -> Iterator[None]:
    """Garbage waits for the collection a test starts (gc.collect())."""
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


def garbage(obj: object) -> None:
    """Put `obj` in a reference cycle: once the caller drops it, only a collection frees it."""
    cycle: list[object] = [obj]
    cycle.append(cycle)


@contextlib.contextmanager
def held_elsewhere(lock: contextlib.AbstractContextManager[object]) -> Iterator[None]:
    """`lock` held by another thread for the whole block (as a fork or a finalizer meets it)."""
    held, release = threading.Event(), threading.Event()

    def hold() -> None:
        with lock:
            held.set()
            release.wait(30)

    holder = threading.Thread(target=hold)
    holder.start()
    try:
        assert held.wait(5)
        yield
    finally:
        release.set()
        holder.join(10)


@pytest.fixture
def recording() -> Iterator[tuple[RecordingDaemon, str]]:
    """A RecordingDaemon listening at the path given beside it."""
    with tempfile.TemporaryDirectory() as tmp:
        path = str(Path(tmp) / "fake.sock")
        fake = RecordingDaemon(path)
        yield fake, path
        fake.close()
