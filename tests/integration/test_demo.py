"""`commd demo`, the README's main job, end to end: a daemon, worker processes, every
result checked against numpy by the demo itself."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from client import CommError
from commd.status import query_status

REPO = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.timeout(120)


def test_the_demo_runs_and_every_result_matches_numpy(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("COMMD_")}
    env["PYTHONPATH"] = str(REPO)
    done = subprocess.run([sys.executable, "-m", "commd", "demo", "--ranks", "3", "--steps", "5",
                           "--layers", "2", "--hidden", "1000", "--timeout", "30"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=100)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "every result matched numpy; daemon exited with code 0" in done.stdout, done.stdout
    assert "Traceback" not in done.stderr, done.stderr


def _descendants(pid: int) -> set[int]:
    """The processes under `pid`, as /proc lists its threads' children."""
    found: set[int] = set()
    for task in Path(f"/proc/{pid}/task").iterdir():
        for child in (task / "children").read_text().split():
            found |= {int(child)} | _descendants(int(child))
    return found


def _running(pid: int) -> bool:
    """Whether `pid` is a process that has not ended (a zombie has, awaiting its reaper)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0]
    except FileNotFoundError:
        return False
    return state != "Z"


def _calling(sock: str) -> bool:
    """Whether both ranks of the demo's world at `sock` have made calls."""
    try:
        report = query_status(sock, 5, "demo")
    except CommError:  # (the daemon starting, or the world not formed yet)
        return False
    return all(report["worlds"][0]["recent_calls"].get(str(rank)) for rank in (0, 1))


@pytest.mark.parametrize(("how", "code", "said"), [
    ("SIGTERM", 128 + signal.SIGTERM, ""),
    ("Ctrl-C", 130, "commd: interrupted\n"),
])
def test_a_demo_stopped_stops_its_daemon_and_workers(tmp_path: Path, how: str, code: int,
                                                     said: str) -> None:
    """`kill` or `timeout` ends a demo with SIGTERM, Ctrl-C with SIGINT to all its processes:
    it must take its daemon and its workers with it, saying only that it was interrupted
    (before: on SIGTERM the demo alone ended, and the daemon and the 2 workers of a long demo
    ran on, orphaned; on Ctrl-C each worker printed its KeyboardInterrupt's traceback)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("COMMD_")}
    env["PYTHONPATH"] = str(REPO)
    demo = subprocess.Popen([sys.executable, "-m", "commd", "demo", "--ranks", "2", "--steps", "1000000",
                             "--layers", "1", "--hidden", "64"], cwd=tmp_path, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True,  # (its own group, as a terminal's job)
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    under: set[int] = set()
    try:
        assert demo.stdout is not None
        sock = demo.stdout.readline().removeprefix("starting commd (host engine) at ").strip()
        deadline = time.monotonic() + 30
        while not _calling(sock):  # (both workers at their calls, past their imports)
            assert time.monotonic() < deadline and demo.poll() is None, demo.stdout.readline()
            time.sleep(0.05)
        under = _descendants(demo.pid)  # the daemon, the workers, multiprocessing's tracker
        if how == "SIGTERM":
            demo.send_signal(signal.SIGTERM)
        else:
            os.killpg(demo.pid, signal.SIGINT)
        assert demo.wait(30) == code
        assert demo.stderr is not None
        told = demo.stderr.read()  # (and the daemon's warnings: the world failed as it ended)
        assert "Traceback" not in told and told.endswith(said), told
        deadline = time.monotonic() + 10
        while left := {pid for pid in under if _running(pid)}:
            assert time.monotonic() < deadline, f"still running after the demo ended: {left}"
            time.sleep(0.05)
    finally:
        demo.kill()
        demo.wait()
        for pid in under:  # (what a failed check left: this test's own, by their command line)
            with contextlib.suppress(OSError):
                command = Path(f"/proc/{pid}/cmdline").read_bytes()
                if _running(pid) and (b"commd" in command or b"spawn_main" in command):
                    os.kill(pid, signal.SIGKILL)
