"""kill -9 a daemon of a world spread over two: the other daemon's ranks hear PeerLost within
the heartbeat window, the dead daemon's ranks see it gone; it restarts (as systemd would)
and every rank's attempt_reconnect rebuilds the world."""

from __future__ import annotations

import shutil
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from client import CommError
from commd.launch import DaemonProcess
from commd.status import query_status
from tests.conftest import FaultReport, steady_world
from tests.integration import workers
from tests.integration.data import make_input, reduce_reference
from tests.integration.harness import RankPool, short_tmpdir, wait_until, world_name
from tests.integration.test_multi_daemon import SECRET

pytestmark = pytest.mark.timeout(120)
WINDOW_S = 1.0


def start(path: Path, name: str, port: int = 0) -> DaemonProcess:
    """Port 0: the kernel picks one no one holds (a port probed free and bound later may be
    taken meanwhile, by any connection's local end)."""
    return DaemonProcess(path, env=SECRET, args=[
        "--peer-listen", f"127.0.0.1:{port}", "--peer-name", name,
        "--peer-heartbeat", "0.2", "--peer-window", str(WINDOW_S)]).start()


def restart(path: Path, name: str, port: int) -> DaemonProcess:
    """At the address it had (its peers dial it there). A connection's local end may have
    taken the port in the moment it was free: then wait until it is free again."""
    deadline = time.monotonic() + 20
    while True:
        try:
            return start(path, name, port)
        except RuntimeError:  # (it exited at once: the port was taken)
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)


@pytest.fixture
def tmp() -> Iterator[Path]:
    path = Path(short_tmpdir())
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.mark.parametrize("victim", ["root", "member"])
def test_kill_a_daemon_and_restart_it(pool: RankPool, tmp: Path, fault_report: FaultReport,
                                      victim: str) -> None:
    daemons: dict[str, DaemonProcess] = {}
    dead, alive = ("A", "B") if victim == "root" else ("B", "A")
    try:
        for name in "ABC":
            daemons[name] = start(tmp / name / "commd.sock", name)
        ports = {name: int(daemon.peer_address().rsplit(":", 1)[1]) for name, daemon in daemons.items()}
        # an unrelated world over a third daemon C (its root, rank 0's) and the survivor runs throughout
        steady_root = f"127.0.0.1:{ports['C']}"
        with steady_world([f"{daemons[d].socket_path}@{steady_root}" for d in ("C", alive)]) as steady:
            world, root = world_name("dd"), f"127.0.0.1:{ports['A']}"
            args = [(f"{daemons[d].socket_path}@{root}", world, r, 2, 3) for r, d in enumerate("AB")]
            started = pool.start(workers.through_a_daemon_death, args)
            wait_for_pending(daemons["A"].socket_path, world)  # rank 0 waits in its second barrier
            killed_at = time.time()
            daemons[dead].kill()
            time.sleep(0.5)
            daemons[dead] = restart(tmp / dead / "commd.sock", dead, ports[dead])
            outcomes = [o.unwrap() for o in pool.collect(started, 90)]
            unrelated = steady.errors()
    finally:
        for daemon in daemons.values():
            daemon.stop()
    want = reduce_reference([make_input(3, r, 64, "i32", "sum") for r in range(2)], "i32", "sum")
    survivor = 1 if victim == "root" else 0
    for rank, res in enumerate(outcomes):
        assert res["epoch"] == 2 and res["result"] == want.tobytes()
        if rank == survivor:
            assert res["error"] == "PeerLost"
            assert res["at"] - killed_at <= WINDOW_S + 1.0
            fault_report.add(f"kill -9 the {victim} daemon (window {WINDOW_S:g}s), restart it",
                             res["at"] - killed_at, res["rebuilt_at"] - res["at"], unrelated,
                             "n/a (the daemon was replaced)")
        else:  # the world and what to do next are said (before: "the daemon closed the connection")
            assert res["error"] == "DaemonUnavailable", res
            assert res["message"].startswith(f"world {world} is not healthy: ") and \
                res["message"].endswith("; call attempt_reconnect once it is back"), res


def wait_for_pending(sock: Path, world: str) -> None:
    """Until rank 0's second call (its second barrier, which rank 1 never joins) is under way."""
    def second_call_waits() -> bool:
        try:
            calls = query_status(str(sock), 5, world)["worlds"][0]["recent_calls"].get("0") or [{}]
        except CommError:  # not formed yet
            return False
        return calls[-1].get("seq") == 1 and calls[-1].get("state") in ("pending", "running")

    wait_until(second_call_waits, f"rank 0 of world {world} to wait in its second call", 30)
