"""kill -9 a worker while the other rank waits in a call: the survivor gets a typed error
within a second, the daemon and an unrelated world go on, resources return to baseline,
and a new process in the lost rank's slot rebuilds the world."""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import time

import pytest

from commd.launch import DaemonProcess
from commd.status import query_status
from tests.conftest import FaultReport, Steady
from tests.integration import workers
from tests.integration.data import make_input, reduce_reference
from tests.integration.harness import RankPool, back_to, held_at_rest, world_name

pytestmark = pytest.mark.timeout(90)
DETECTION_S = 1.0  # connection loss: every survivor hears within a second


def pending(sock: str, world: str) -> int:
    worlds = query_status(sock, 5)["worlds"]
    return next((int(w["pending_calls"]) for w in worlds if w["name"] == world), -1)


@pytest.mark.parametrize("what", ["all_reduce", "barrier", "recv_command"])
def test_kill_a_worker_mid_call(pool: RankPool, daemon: DaemonProcess, steady: Steady,
                                fault_report: FaultReport, what: str) -> None:
    sock, world = str(daemon.socket_path), world_name("kill")
    base = held_at_rest(daemon.pid)
    unrelated_before = steady.errors()
    # recv_command waits on the root: the victim is rank 0 then, else rank 1
    victim_rank = 0 if what == "recv_command" else 1
    survivor_rank = 1 - victim_rank
    ctx = mp.get_context("spawn")
    victim = ctx.Process(target=workers.join_and_wait,
                         args=(sock, world, victim_rank, 2), daemon=True)
    victim.start()
    started = pool.start(workers.survive_a_kill, [(sock, world, survivor_rank, 2, what, 9)])
    deadline = time.monotonic() + 20
    while pending(sock, world) != 1:  # the survivor is inside its call
        assert time.monotonic() < deadline
        time.sleep(0.02)
    killed_at = time.time()
    assert victim.pid is not None
    os.kill(victim.pid, signal.SIGKILL)
    victim.join(10)
    time.sleep(0.3)
    replacement = ctx.Process(target=workers.replacement, args=(sock, world, victim_rank, 2, 9), daemon=True)
    replacement.start()
    (outcome,) = pool.collect(started, 60)
    replacement.join(30)
    res = outcome.unwrap()
    assert res["error"] == "WorldFailed"
    assert res["at"] - killed_at <= DETECTION_S
    assert res["epoch"] == 2
    want = reduce_reference([make_input(9, r, 128, "i64", "sum") for r in range(2)], "i64", "sum")
    assert res["result"] == want.tobytes()
    assert replacement.exitcode == 0
    back_to(daemon.pid, base)  # the daemon let go of everything the world held
    fault_report.add(f"kill -9 a worker in {what}", res["at"] - killed_at,
                     res["rebuilt_at"] - res["at"], steady.errors() - unrelated_before,
                     "none (fds, memfd mappings at baseline)")
