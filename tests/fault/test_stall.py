"""SIGSTOP a worker: the rank waiting for it gets CommTimeout within the deadline plus one
second, the unrelated world runs on, and after SIGCONT the world is rebuilt."""

from __future__ import annotations

import os
import signal
import time

import pytest

from commd.launch import DaemonProcess
from commd.status import query_status
from tests.conftest import FaultReport, Steady
from tests.integration import workers
from tests.integration.harness import RankPool, wait_until, world_name, world_status

pytestmark = pytest.mark.timeout(90)
TIMEOUT_S = 1.0


def test_a_frozen_worker_times_the_call_out(pool: RankPool, daemon: DaemonProcess, steady: Steady,
                                           fault_report: FaultReport) -> None:
    sock, world = str(daemon.socket_path), world_name("stall")
    unrelated_before = steady.errors()
    started = pool.start(workers.stop_and_go, [(sock, world, r, 2, TIMEOUT_S) for r in range(2)])
    deadline = time.monotonic() + 20
    while True:
        worlds = [w for w in query_status(sock, 5)["worlds"] if w["name"] == world]
        if worlds and worlds[0]["pending_calls"] == 1:  # rank 0 is inside its all_reduce
            break
        assert time.monotonic() < deadline
        time.sleep(0.02)
    frozen = pool.pids()[1]
    stopped_at = time.time()
    os.kill(frozen, signal.SIGSTOP)
    try:  # (frozen past the deadline: until the daemon's verdict has failed the world)
        wait_until(lambda: (world_status(daemon, world) or {}).get("state") != "ready",
                   "the call's timeout to fail the world", TIMEOUT_S + 10)
    finally:
        os.kill(frozen, signal.SIGCONT)
    rank0, rank1 = [o.unwrap() for o in pool.collect(started, 60)]
    assert rank0["error"] == "CommTimeout"
    assert rank0["seconds"] <= TIMEOUT_S + 1.0 + 0.3
    assert rank0["first_epoch"] == rank1["first_epoch"]
    assert rank0["epoch"] == rank1["epoch"] == rank0["first_epoch"] + 1
    fault_report.add(f"SIGSTOP a worker (call timeout {TIMEOUT_S:g}s), SIGCONT", rank0["at"] - stopped_at,
                     rank0["rebuilt_at"] - rank0["at"], steady.errors() - unrelated_before, "n/a")
