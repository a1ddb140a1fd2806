"""Real worker processes for integration tests.

`RankPool` keeps N spawned processes alive across tests (spawning one costs a
numpy import, ~0.3 s) and runs one function per rank in them, each with its own
`DaemonBackend`. Every wait has a timeout; a pool whose worker hangs or dies is
torn down and the test fails with the ranks that did not answer.
"""

from __future__ import annotations

import asyncio
import contextlib
import multiprocessing as mp
import os
import resource
import tempfile
import time
import urllib.request
import uuid
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

from commd.launch import DaemonProcess
from commd.status import query_status

if TYPE_CHECKING:
    from commd.engine.base import Engine
    from commd.server import Server


@dataclass(frozen=True)
class Outcome:
    """What one rank's function returned, or the error it raised (by class name)."""

    value: Any = None
    error: str | None = None  # exception class name
    message: str = ""
    code: str | None = None  # the CommError's wire code, if any
    task: int = 0

    def unwrap(self) -> Any:
        if self.error is not None:
            raise AssertionError(f"rank raised {self.error}: {self.message}")
        return self.value


def _serve(conn: Connection) -> None:
    while True:
        try:
            task = conn.recv()
        except EOFError:
            return
        if task is None:
            return
        task_id, fn, args = task
        try:
            result = Outcome(value=fn(*args), task=task_id)
        except BaseException as exc:  # every failure goes back to the test, typed by name
            code = getattr(exc, "code", None)
            result = Outcome(error=type(exc).__name__, message=str(exc),
                             code=getattr(code, "value", None), task=task_id)
        conn.send(result)


class RankPool:
    def __init__(self, size: int) -> None:
        ctx = mp.get_context("spawn")
        self._conns: list[Connection] = []
        self._procs: list[Any] = []
        self._task = 0
        self.broken = False  # a worker hung or died: the fixture replaces the pool
        for _ in range(size):
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=_serve, args=(child,), daemon=True)
            proc.start()
            child.close()
            self._conns.append(parent)
            self._procs.append(proc)

    @property
    def size(self) -> int:
        return len(self._procs)

    def pids(self) -> list[int]:
        return [p.pid for p in self._procs]

    def start(self, fn: Callable[..., Any], args: Sequence[tuple[Any, ...]]) -> list[int]:
        """Send `fn(*args[i])` to worker i (for i < len(args)); return those worker indexes."""
        self._task += 1
        for conn, rank_args in zip(self._conns, args, strict=False):
            conn.send((self._task, fn, rank_args))
        return list(range(len(args)))

    def collect(self, workers: Sequence[int], timeout: float) -> list[Outcome]:
        import time

        deadline = time.monotonic() + timeout
        results: dict[int, Outcome] = {}
        pending = {self._conns[i]: i for i in workers}
        while pending:
            left = deadline - time.monotonic()
            ready = wait(list(pending), timeout=max(0.0, left)) if left > 0 else []
            if not ready:
                self.close(force=True)
                self.broken = True
                raise TimeoutError(f"workers {sorted(pending.values())} did not answer in {timeout}s")
            for conn in ready:
                index = pending[conn]  # type: ignore[index]
                try:
                    outcome = conn.recv()  # type: ignore[union-attr]
                except EOFError:
                    self.broken = True
                    outcome = Outcome(error="WorkerDied", message=f"worker {index} died", task=self._task)
                if outcome.task == self._task:  # older ones belong to a test that gave up
                    results[index] = outcome
                    del pending[conn]  # type: ignore[arg-type]
        return [results[i] for i in workers]

    def run(self, fn: Callable[..., Any], args: Sequence[tuple[Any, ...]],
            timeout: float = 60.0) -> list[Outcome]:
        return self.collect(self.start(fn, args), timeout)

    def close(self, force: bool = False) -> None:
        for conn, proc in zip(self._conns, self._procs, strict=True):
            if not force:
                with contextlib.suppress(OSError):
                    conn.send(None)
            if force or not _joined(proc, 5):
                proc.kill()
                proc.join(5)
            conn.close()


def _joined(proc: Any, timeout: float) -> bool:
    proc.join(timeout)
    return not proc.is_alive()


def raise_nofile(stack: contextlib.ExitStack, fds: int) -> None:
    """Let this process open `fds` files until `stack` closes (skip the test where the hard
    limit does not: thousands of ranks take a connection each)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < fds:
        pytest.skip(f"{fds} files need more fds than this machine's hard limit ({hard})")
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, fds), hard))
    stack.callback(resource.setrlimit, resource.RLIMIT_NOFILE, (soft, hard))


@contextlib.contextmanager
def started_together(*daemons: DaemonProcess) -> Iterator[None]:
    """The daemons, started side by side, stopped (the last first) when the block ends, as
    `with a, b:` would: a start mostly waits on its Python's imports (~0.3 s of a core), so
    two daemons one after the other took ~0.8 s, together ~0.6 s. If one fails to start,
    those that did are stopped and its error raised."""
    with contextlib.ExitStack() as stack:
        with ThreadPoolExecutor(len(daemons)) as threads:
            starts = [threads.submit(daemon.start) for daemon in daemons]
        for daemon, start in zip(daemons, starts, strict=True):
            if start.exception() is None:
                stack.callback(daemon.stop)
        for start in starts:
            start.result()
        yield


@contextlib.asynccontextmanager
async def linked_servers(tmp_path: Path, engines: Sequence[Engine],
                         secret: bytes) -> AsyncIterator[tuple[list[Server], int]]:
    """Daemons A, B, ... (one per engine) as servers of this process and of its running loop,
    linked over loopback with a fast heartbeat (0.2 s, window 1 s), listening at
    `tmp_path`/A.sock, B.sock, ...: yields them and A's peer port (A is the root of a world
    made with it as the bootstrap address); stops them and closes their engines after."""
    from commd.cluster import Cluster
    from commd.config import ServerConfig
    from commd.peerlink import PeerSettings
    from commd.server import Server

    names = "ABCDEFGH"[:len(engines)]
    clusters = [Cluster(PeerSettings(name, secret, heartbeat_s=0.2, window_s=1.0)) for name in names]
    servers = [Server(ServerConfig(tmp_path / f"{name}.sock", peer_secret=secret), engine, cluster)
               for name, engine, cluster in zip(names, engines, clusters, strict=True)]
    try:
        port = await clusters[0].listen("127.0.0.1", 0)
        for server in servers:
            server.start()
        yield servers, port
    finally:
        for server in servers:
            server.shutdown()
        for cluster, engine in zip(clusters, engines, strict=True):
            cluster.close()
            engine.close()


def short_tmpdir() -> str:
    """A short directory: Unix socket paths are limited to 107 bytes."""
    return tempfile.mkdtemp(prefix="commd-t-", dir="/tmp")


def world_name(prefix: str = "w") -> str:
    return f"{prefix}-{uuid.uuid4().hex[:10]}"


def world_status(daemon: DaemonProcess, world: str) -> dict[str, object] | None:
    """The world's entry in the daemon's status, or None if the daemon does not know it."""
    worlds = query_status(str(daemon.socket_path), 5)["worlds"]
    return next((w for w in worlds if w["name"] == world), None)


def last_call(daemon: DaemonProcess, world: str, rank: int) -> dict[str, object]:
    """`rank`'s newest call as `daemon` records it ({} before the world forms there)."""
    calls = (world_status(daemon, world) or {}).get("recent_calls", {})
    assert isinstance(calls, dict)
    return dict((calls.get(str(rank)) or [{}])[-1])


def scrape(address: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """A daemon's metrics, by (sample name, sorted labels)."""
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(f"http://{address}/metrics", timeout=5) as reply:
        assert reply.status == 200 and reply.headers["Content-Type"].startswith("text/plain")
        text = reply.read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def wait_until(condition: Callable[[], object], what: str | Callable[[], object] = "the condition",
               timeout: float = 15) -> None:
    """Poll `condition` until it holds; fail naming `what` (or what it returns, read
    then: the state that was wrong) after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what() if callable(what) else what}"
        time.sleep(0.02)


async def eventually(condition: Callable[[], object], what: str = "the condition",
                     timeout: float = 5) -> None:
    """`wait_until` for a test running on an event loop: the loop goes on meanwhile."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.005)


def open_fds(pid: int | None = None) -> int:
    """Open fds of process `pid` (default: this one)."""
    return len(os.listdir(f"/proc/{os.getpid() if pid is None else pid}/fd"))


def memfd_mappings(pid: int) -> int:
    with open(f"/proc/{pid}/maps") as maps:
        return sum(1 for line in maps if "memfd:" in line)


def held(pid: int) -> tuple[int, int]:
    """What a daemon holds that a leak would grow: open fds and memfd mappings."""
    return open_fds(pid), memfd_mappings(pid)


def held_at_rest(pid: int, quiet_s: float = 0.5, timeout: float = 10) -> tuple[int, int]:
    """`held` once it has stopped changing: a connection an earlier scenario closed may
    still be open in the daemon for a moment, and a baseline counting it hides a leak."""
    deadline = time.monotonic() + timeout
    now, since = held(pid), time.monotonic()
    while time.monotonic() - since < quiet_s:
        assert time.monotonic() < deadline, f"daemon {pid} never came to rest: {now}"
        time.sleep(0.05)
        if (latest := held(pid)) != now:
            now, since = latest, time.monotonic()
    return now


def back_to(pid: int, base: tuple[int, int], timeout: float = 10) -> None:
    """Wait until the daemon holds exactly what it held at `base` (fds, memfd mappings)."""
    deadline = time.monotonic() + timeout
    while (now := held(pid)) != base:
        assert time.monotonic() < deadline, f"daemon {pid} holds {now}, at rest it held {base}"
        time.sleep(0.05)
