"""`commd bench` end to end with tiny settings: it runs, prints its table, writes its JSON."""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from client.errors import CommError
from commd.status import query_status

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.timeout(180)
def test_bench_smoke(tmp_path: Path) -> None:
    out = tmp_path / "b.json"
    has_torch = importlib.util.find_spec("torch") is not None
    cmd = [sys.executable, "-m", "commd", "bench", "--ranks", "2", "--sizes", "8,4096",
           "--iters", "20", "--json", str(out)]
    if not has_torch:
        cmd.append("--no-gloo")
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "commd med µs" in proc.stdout and "targets:" in proc.stdout

    report = json.loads(out.read_text())
    rows = {(r["op"], r["bytes"]): r for r in report["results"]}
    assert set(rows) == {("all_reduce", 8), ("all_reduce", 4096), ("barrier", 0)}
    for row in rows.values():
        assert row["ranks"] == 2
        assert row["commd"]["median_us"] > 0 and row["commd"]["iters"] == 20
        if has_torch:
            assert row["gloo"]["median_us"] > 0
            assert row["latency_ratio"] > 0
    assert report["machine"]["cpu_count"] >= 1
    assert report["settings"]["checked"].startswith("each size's first (untimed) all_reduce")
    assert "checked: each size's first" in proc.stdout


@pytest.mark.timeout(180)
def test_bench_smoke_two_daemons(tmp_path: Path) -> None:
    """--daemons 2: 4 ranks in blocks of 2 over 2 daemons joined by their peer listeners."""
    out = tmp_path / "b2.json"
    cmd = [sys.executable, "-m", "commd", "bench", "--daemons", "2", "--ranks", "4",
           "--sizes", "8,4096", "--iters", "10", "--no-gloo", "--json", str(out)]
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=150)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "4 ranks / 2 daemons" in proc.stdout and "over 2 daemons" in proc.stdout

    report = json.loads(out.read_text())
    assert report["settings"]["daemons"] == 2
    rows = {(r["op"], r["bytes"]): r for r in report["results"]}
    assert set(rows) == {("all_reduce", 8), ("all_reduce", 4096), ("barrier", 0)}
    for row in rows.values():
        assert (row["ranks"], row["daemons"], row["placement"]) == (4, 2, [0, 0, 1, 1])
        assert row["world"] == "4 ranks / 2 daemons"
        assert row["commd"]["median_us"] > 0 and row["commd"]["iters"] == 10
        assert row["gloo"] is None
    [target] = report["targets"]
    assert (target["ranks"], target["daemons"], target["goal"]) == (4, 2, 1.5)
    assert target["met"] is None and target["verdict"] == "not measured"  # no 64 MiB row here


@pytest.mark.timeout(60)
def test_the_bench_checks_the_sums_it_times(sock: str) -> None:
    """The bench times a call only after its first result proved to be the sum of every
    rank's input: a 2-rank bf16 all_reduce of the bench's inputs on a real daemon passes
    check_sum; the same bytes summed as u8, or not reduced at all, are refused by name."""
    from concurrent.futures import ThreadPoolExecutor

    import numpy as np

    from client import DaemonBackend, hostmem
    from commd.benchrun import _random_bf16_bits, check_sum
    from tests.integration.harness import world_name

    size, world = 4096, world_name("bench")

    def refusal(check: Callable[[], None]) -> str:
        try:
            check()
        except RuntimeError as exc:
            return str(exc)  # (not the error: its traceback holds the buffer's view)
        return "passed"

    def sums(buf: hostmem.HostBuffer, r: int) -> list[str]:
        data, pristine = buf.view(np.uint16), _random_bf16_bits(size, r)
        with DaemonBackend(sock, world, r, 2, timeout=20) as comm:
            np.copyto(data, pristine)
            comm.all_reduce(buf.ptr, size)
            check_sum("commd", data, size, 2)  # the right sum passes
            refused = []
            for wrong in ("u8", None):  # summed as bytes; left as this rank's input
                np.copyto(data, pristine)
                if wrong is not None:
                    comm.all_reduce(buf.ptr, size, dtype=wrong)
                refused.append(refusal(lambda: check_sum("commd", data, size, 2)))
        return refused

    def rank(r: int) -> list[str]:
        buf = hostmem.alloc(size)
        try:
            return sums(buf, r)
        finally:
            buf.close()  # (sums' view of it is gone)

    with ThreadPoolExecutor(2) as threads:
        results = list(threads.map(rank, range(2)))
    for refused in results:
        assert len(refused) == 2
        assert all(why.startswith("commd: the 4096-byte bf16 all_reduce summed ") for why in refused)


@pytest.mark.timeout(180)
def test_bench_neighbours_smoke(tmp_path: Path) -> None:
    """scripts/bench_neighbours.py with tiny settings: every scenario ran and was counted."""
    out = tmp_path / "n.json"
    cmd = [sys.executable, str(ROOT / "scripts" / "bench_neighbours.py"), "--calls", "20",
           "--idle-worlds", "2", "--large-bytes", str(1 << 20), "--idle-seconds", "0.2", "--json", str(out)]
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=150)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    report = json.loads(out.read_text())
    assert list(report["idle_cpu"]) == ["no world", "2 idle worlds"]
    assert all(0 <= share < 4 for share in report["idle_cpu"].values())  # (CPU seconds per second)
    rows = report["rows"]
    assert list(rows) == ["alone", "2 idle worlds", "2 idle + status --world poller",
                          "2 idle + 1 MiB all_reduces"]
    for name, row in rows.items():
        assert 0 < row["p50_us"] <= row["p90_us"] <= row["p99_us"], (name, row)
        assert (row["p90_vs_alone"] is None) == (name == "alone")
        assert name in proc.stdout


class _SummedAsBytes:
    """The bench's backend, its all_reduce summing the bf16 buffers as u8: a daemon that
    sums wrong, as fast as one that sums right."""

    def __init__(self, comm: Any) -> None:
        self._comm = comm

    def all_reduce(self, ptr: int, size: int) -> None:
        self._comm.all_reduce(ptr, size, dtype="u8")

    def barrier(self) -> None:
        self._comm.barrier()


@pytest.mark.timeout(60)
def test_the_bench_times_a_size_only_once_its_first_sum_was_right(sock: str) -> None:
    """Through the bench's own timing of a size (warm-up, check, timed loop) on a real
    2-rank daemon: the right sums are timed; the same calls summing as u8 fail the size
    by name before any is timed (the test above only asks check_sum, which the timing
    could leave uncalled)."""
    from concurrent.futures import ThreadPoolExecutor

    from client import DaemonBackend
    from commd.benchrun import Plan, _commd_size, _Job
    from tests.integration.harness import world_name

    size, iters, world = 4096, 5, world_name("bench")

    def rank(r: int) -> tuple[int, str]:
        job = _Job("commd", r, 2, sock, None, Plan((size,), (iters,), 1), None)
        with DaemonBackend(sock, world, r, 2, timeout=20) as comm:
            timed = len(_commd_size(comm, job, size, iters))
            try:
                _commd_size(_SummedAsBytes(comm), job, size, iters)
                return timed, "timed"
            except RuntimeError as exc:
                return timed, str(exc)

    with ThreadPoolExecutor(2) as threads:
        results = list(threads.map(rank, range(2)))
    for timed, wrong in results:
        assert timed == iters
        assert wrong.startswith(f"commd: the {size}-byte bf16 all_reduce summed "), wrong


@pytest.mark.timeout(120)
def test_bench_percall_smoke(tmp_path: Path) -> None:
    """scripts/bench_percall.py with tiny settings: every rank measured, its numbers sane."""
    out = tmp_path / "p.json"
    cmd = [sys.executable, str(ROOT / "scripts" / "bench_percall.py"), "--ranks", "2", "--iters", "50",
           "--json", str(out)]
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=100)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    result = json.loads(out.read_text())
    assert [row["rank"] for row in result["per_rank"]] == [0, 1]
    assert result["median_us"] > 0 and result["daemon_cpu_us"] >= 0 and result["worker_cpu_us"] > 0
    assert "CPU per call: daemon" in proc.stdout


def _children(pid: int) -> dict[int, str]:
    """A process's children: pid -> command line."""
    out: dict[int, str] = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        for child in (task / "children").read_text().split():
            with contextlib.suppress(OSError):
                cmdline = (Path("/proc") / child / "cmdline").read_bytes()
                out[int(child)] = cmdline.replace(b"\0", b" ").decode()
    return out


# `python -m commd`, but with the bench's bounds on each daemon's stop and on its wait for
# the workers to end set first: a test that waits a SIGSTOPped process out need not wait
# what a real run allows (20 s, 10 s)
_BENCH_ENDING_WITHIN = """
import sys
import commd.bench, commd.benchrun
commd.bench._STOP_TIMEOUT_S = float(sys.argv.pop(1))
commd.benchrun._REAP_TIMEOUT_S = float(sys.argv.pop(1))
from commd.cli import main
sys.exit(main())
"""


def _endless_bench(out: Path, daemons: int = 1, stop_timeout_s: float = 20,
                   reap_timeout_s: float = 10) -> subprocess.Popen[str]:
    """A bench of far more all_reduces than a test waits for, in a session of its own,
    each of its daemons' stops bounded by `stop_timeout_s` and its wait for its workers to
    end by `reap_timeout_s`."""
    commd = ["-c", _BENCH_ENDING_WITHIN, str(stop_timeout_s), str(reap_timeout_s)]
    cmd = [sys.executable, *commd, "bench", "--no-gloo", "--ranks", "2", "--sizes", "8",
           "--iters", "100000000", "--daemons", str(daemons), "--json", str(out)]
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)


def _calling(bench: subprocess.Popen[str]) -> tuple[dict[int, str], list[tuple[int, str]]]:
    """Once the bench's world is calling (its daemon's status shows calls done): its
    children, and its daemons' (pid, socket)."""
    deadline = time.monotonic() + 60
    while True:
        assert bench.poll() is None and time.monotonic() < deadline, "the bench never got going"
        children = _children(bench.pid)
        daemons = [(pid, line.split(" --socket ")[1].split()[0])
                   for pid, line in children.items() if " serve " in line]
        if daemons:
            with contextlib.suppress(CommError):
                info = query_status(daemons[0][1], 5)
                if info.get("counters", {}).get("calls", {}).get("all_reduce", {}).get("done"):
                    return children, daemons
        time.sleep(0.2)


@pytest.mark.timeout(120)
def test_a_daemon_killed_mid_bench_is_named_with_its_exit_code_and_no_traceback(tmp_path: Path) -> None:
    """The bench's daemon SIGKILLed under the timed loop: the bench printed 'failed: rank 1
    failed:' and some 40 lines of the worker's traceback ending in DaemonUnavailable, and
    nothing of the daemon, which was the cause. Now: the failed rank's error in one line,
    the daemon's exit code and log, exit 1, no JSON, no worker left."""
    out = tmp_path / "b.json"
    bench = _endless_bench(out)
    try:
        children, daemons = _calling(bench)
        workers = [pid for pid, line in children.items() if "spawn_main" in line]
        os.kill(daemons[0][0], signal.SIGKILL)
        stdout, stderr = bench.communicate(timeout=60)
    finally:
        if bench.poll() is None:
            bench.kill()
            bench.wait(10)
    assert bench.returncode == 1, stdout + stderr
    assert "Traceback" not in stderr, stderr
    assert "commd bench: failed: rank " in stderr and "DaemonUnavailable: " in stderr, stderr
    assert "commd bench: daemon 0 exited with code -9" in stderr, stderr
    assert not out.exists()
    assert workers and not [pid for pid in workers if Path(f"/proc/{pid}").exists()]


@pytest.mark.timeout(120)
def test_ctrl_c_mid_bench_says_interrupted_in_one_line(tmp_path: Path) -> None:
    """Ctrl-C (SIGINT to the whole process group, as a terminal sends it) under the timed
    loop: exit 130 and 'commd: interrupted' after the progress line (before: 'commd bench:
    daemon 0 exited with code 0; its log:' and its log, as if the daemon were to blame, and
    no word that the run was interrupted); no JSON, no worker or daemon left."""
    out = tmp_path / "b.json"
    bench = _endless_bench(out)
    try:
        children, _ = _calling(bench)
        os.killpg(bench.pid, signal.SIGINT)
        stdout, stderr = bench.communicate(timeout=60)
    finally:
        if bench.poll() is None:
            os.killpg(bench.pid, signal.SIGKILL)
            bench.wait(10)
    assert bench.returncode == 130, stdout + stderr
    assert stderr.splitlines()[1:] == ["commd: interrupted"], stderr
    assert not out.exists()
    # (multiprocessing's resource tracker ends once its pipe closes: after the bench, by design)
    ours = [pid for pid, line in children.items() if "spawn_main" in line or " serve " in line]
    assert len(ours) == 3 and not [pid for pid in ours if Path(f"/proc/{pid}").exists()]


def _pending(pid: int, sig: signal.Signals) -> bool:
    """Whether `sig` waits, sent to the process `pid` (which is stopped, say)."""
    status = Path(f"/proc/{pid}/status").read_text()
    shdpnd = next(line for line in status.splitlines() if line.startswith("ShdPnd:"))
    return bool(int(shdpnd.split()[1], 16) >> (sig - 1) & 1)


def _ctrl_c_twice(bench: subprocess.Popen[str], stopped: list[int],
                  others: list[int]) -> tuple[str, list[int]]:
    """SIGSTOP `stopped` (they take no signal), Ctrl-C, and Ctrl-C again once the bench
    waits on one of them to end (SIGTERMed, so one pends); then that one runs again. The
    bench's stderr, and those of `stopped` and `others` still there after it exited."""
    try:
        for pid in stopped:
            os.kill(pid, signal.SIGSTOP)
        os.killpg(bench.pid, signal.SIGINT)
        deadline = time.monotonic() + 30
        while not (ending := [pid for pid in stopped if _pending(pid, signal.SIGTERM)]):
            assert bench.poll() is None and time.monotonic() < deadline, "nothing SIGTERMed"
            time.sleep(0.05)
        os.killpg(bench.pid, signal.SIGINT)
        time.sleep(0.5)
        os.kill(ending[0], signal.SIGCONT)
        stdout, stderr = bench.communicate(timeout=60)
        assert bench.returncode == 130, stdout + stderr
        return stderr, [pid for pid in stopped + others if Path(f"/proc/{pid}").exists()]
    finally:
        if bench.poll() is None:
            os.killpg(bench.pid, signal.SIGKILL)
            bench.wait(10)
        for pid in stopped:  # (what the bench left: not to outlive the test)
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


@pytest.mark.timeout(120)
def test_a_second_ctrl_c_while_the_bench_stops_its_daemons_stops_them_all(tmp_path: Path) -> None:
    """Ctrl-C, both daemons slow to stop (SIGSTOPped: they take no signal), and Ctrl-C again
    while the bench waits on daemon 0's stop: the second broke off the stop loop, the bench
    exited 130 at once and daemon 1 was never stopped (left behind, with daemon 0 if it
    hung). Now the bench finishes the stops (daemon 0 exits once it runs again, daemon 1 is
    SIGKILLed after the bounded wait), says so, and exits 130; no daemon or worker left."""
    out = tmp_path / "b.json"
    # (daemon 0 runs again 0.5 s into its stop and stops within 1 s more, its peer silent:
    # 5 s leaves it room on a loaded machine, and daemon 1 is still waited out and SIGKILLed)
    bench = _endless_bench(out, daemons=2, stop_timeout_s=5)
    children, daemons = _calling(bench)
    workers = [pid for pid, line in children.items() if "spawn_main" in line]
    daemons.sort(key=lambda d: d[1])  # (d0.sock, d1.sock: the order the bench stops them)
    assert len(workers) == 2 and len(daemons) == 2, children
    stderr, left = _ctrl_c_twice(bench, [pid for pid, _ in daemons], workers)
    assert not left, (left, stderr)
    lines = stderr.splitlines()
    assert "commd bench: stopping the daemons first (each within 10s)" in lines, stderr
    assert "commd bench: daemon 1 exited with code -9; its log:" in lines, stderr
    assert lines[-1] == "commd: interrupted" and "Traceback" not in stderr, stderr
    assert not out.exists()


@pytest.mark.timeout(120)
def test_a_second_ctrl_c_while_the_bench_ends_its_workers_ends_them_all(tmp_path: Path) -> None:
    """Ctrl-C with both worker ranks SIGSTOPped, and Ctrl-C again while the bench waits on
    the first one's end: the second broke off that wait, and at the bench's exit
    multiprocessing waited for ever on the other (SIGTERMed, but stopped). Now the bench
    ends them all (the first once it runs again, the other SIGKILLed after the bounded
    wait), says so, and exits 130; no worker or daemon left."""
    out = tmp_path / "b.json"
    bench = _endless_bench(out, reap_timeout_s=0.5)
    children, daemons = _calling(bench)
    workers = [pid for pid, line in children.items() if "spawn_main" in line]
    assert len(workers) == 2 and len(daemons) == 1, children
    stderr, left = _ctrl_c_twice(bench, workers, [daemons[0][0]])
    assert not left, (left, stderr)
    lines = stderr.splitlines()
    assert "commd bench: ending the worker ranks first" in lines, stderr
    assert lines[-1] == "commd: interrupted" and "Traceback" not in stderr, stderr
    assert not out.exists()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("daemons", [1, 2])
def test_a_worker_that_fails_with_its_daemon_fine_does_not_name_the_daemon(tmp_path: Path,
                                                                           daemons: int) -> None:
    """A size no worker can allocate: the run fails on the workers, its daemon stops
    cleanly with nothing logged. The bench printed 'commd bench: daemon 0 exited with code
    0; its log:' and an empty log before the workers' error, pointing at a daemon that had
    no part in it (s23/J). Now only the workers' error, exit 1, no JSON. So with two daemons,
    whose clean stop logs their link closing (before: both were named, with those lines)."""
    out = tmp_path / "b.json"
    cmd = [sys.executable, "-m", "commd", "bench", "--no-gloo", "--ranks", "2", "--daemons", str(daemons),
           "--sizes", "100000000000000000000", "--iters", "1", "--json", str(out)]
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=90)
    assert done.returncode == 1, done.stdout + done.stderr
    assert "more than the 9223372036854775807 bytes a mapping can hold" in done.stderr, done.stderr
    assert "Traceback" not in done.stderr and "commd bench: daemon" not in done.stderr, done.stderr
    assert not out.exists()
