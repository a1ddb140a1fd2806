"""The command line's answers to bad arguments (a clear error and exit 2, before any work),
to --version and to Ctrl-C."""

from __future__ import annotations

import fcntl
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

import proto
from commd import __version__ as commd_version
from proto.peer import PEER_VERSION

REPO = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.timeout(60)


def commd(*argv: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "commd", *argv], cwd=cwd, capture_output=True, text=True,
                          env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"}, timeout=40)


@pytest.mark.parametrize("argv, words", [
    (("status", "--socket", "/nonexistent/x.sock", "--timeout", "nan"), "--timeout: must be seconds"),
    (("status", "--socket", "/nonexistent/x.sock", "--timeout", "1e30"), "--timeout: must be seconds"),
    (("status", "--socket", "/nonexistent/x.sock", "--timeout", "soon"), "--timeout: must be seconds"),
    (("status", "--socket", "/nonexistent/x.sock", "--world", "w" * 200), "--world: world is longer"),
    (("status", "--socket", "/nonexistent/x.sock", "--world", "w\udcff"), "--world: not UTF-8 text"),
    (("demo", "--timeout", "inf"), "--timeout: must be seconds"),
    (("demo", "--steps", "-1"), "--steps: must be at least 1"),
    (("demo", "--hidden", "0"), "--hidden: must be at least 1"),
    (("bench", "--no-gloo", "--ranks", "1", "--sizes", "8", "--json", "."), "--json: . is a directory"),
    (("bench", "--no-gloo", "--ranks", "1", "--sizes", "8", "--json", "no/such/dir/b.json"),
     "--json: cannot write"),
    (("bench", "--no-gloo", "--ranks", "65", "--sizes", "8"), "--ranks: at most 64"),
    (("serve", "--config", "", "--socket", "/tmp/commd-cli-test.sock", "--metrics", "a..b:0"),
     "metrics_listen: cannot listen on a..b:0: bad host name"),
])
def test_bad_arguments_are_a_clear_error_and_exit_2(tmp_path: Path, argv: tuple[str, ...],
                                                     words: str) -> None:
    done = commd(*argv, cwd=tmp_path)
    assert done.returncode == 2, done.stderr
    assert words in done.stderr and "Traceback" not in done.stderr, done.stderr
    assert not list(tmp_path.iterdir())  # nothing was run, nothing written


def test_a_bad_argument_with_stderr_a_full_pipe_nobody_reads_still_exits_2(tmp_path: Path) -> None:
    """Before: argparse wrote its usage with a plain write(2), which waited for the reader
    for ever (a journal that stalled); now the usage goes out as the daemon's last words
    do, and the process exits once that write gave the reader up."""
    filler = b"f" * 4096
    r, w = os.pipe()
    fcntl.fcntl(w, fcntl.F_SETPIPE_SZ, len(filler))
    assert os.write(w, filler) == len(filler)  # (full: the next write(2) to it waits)
    with open(r, "rb") as err:
        try:
            child = subprocess.Popen([sys.executable, "-m", "commd", "serve", "--bogus"], cwd=tmp_path,
                                     env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"},
                                     stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=w)
        finally:
            os.close(w)
        try:
            code = child.wait(20)
        finally:
            child.kill()
            child.wait()
        left = err.read()  # what the child left in the pipe, now that it is gone
    assert code == 2
    assert left.startswith(filler), left[:100]
    assert not list(tmp_path.iterdir())


@pytest.mark.parametrize("argv", [("serve", "--bogus"), ("status", "--timeout", "soon"),
                                  ("serve", "--config", "/nonexistent/commd.toml")])
def test_a_bad_argument_with_stderr_closed_still_exits_2(tmp_path: Path, argv: tuple[str, ...]) -> None:
    """Started with stderr closed (`2>&-`), Python has no sys.stderr (None): argparse's own
    error and print_last's print took that as nowhere to write and exited 2; the one
    write that took their place raised AttributeError on it, and the process exited 1."""
    done = subprocess.run(["/bin/sh", "-c", 'exec "$@" 2>&-', "sh", sys.executable, "-m", "commd", *argv],
                          cwd=tmp_path, capture_output=True, text=True, timeout=40,
                          env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"})
    assert done.returncode == 2, done
    assert done.stdout == ""  # (not moved to stdout, which may be a pipe of data)
    assert not list(tmp_path.iterdir())


def test_version_names_the_build_and_both_protocols(tmp_path: Path) -> None:
    # (there was no --version: which protocols a build speaks was in the source only)
    done = commd("--version", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert done.stdout == (f"commd {commd_version} (worker protocol {proto.PROTOCOL_VERSION}, "
                           f"peer protocol {PEER_VERSION})\n")


def test_ctrl_c_on_a_status_that_waits_for_a_mute_daemon_says_so_in_one_line(tmp_path: Path) -> None:
    """Ctrl-C (SIGINT to the process group) while `commd status` waits for an answer that
    does not come: exit 130 and 'commd: interrupted' (before: exit 130 and not a word, as if
    the status had been empty)."""
    path = tmp_path / "mute.sock"
    with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as mute:
        mute.bind(str(path))
        mute.listen()  # accepts (the kernel does) and never answers
        proc = subprocess.Popen([sys.executable, "-m", "commd", "status", "--socket", str(path),
                                 "--timeout", "30"], cwd=tmp_path, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True, start_new_session=True,
                                env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"})
        try:
            mute.settimeout(20)
            conn, _ = mute.accept()  # it has connected: it is waiting for the answer now
            time.sleep(0.3)
            os.killpg(proc.pid, signal.SIGINT)
            out, err = proc.communicate(timeout=20)
            conn.close()
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait(10)
    assert (proc.returncode, out, err) == (130, "", "commd: interrupted\n")


def test_a_status_probe_has_one_deadline_for_connecting_and_the_answer(tmp_path: Path) -> None:
    """A daemon whose listen backlog is full (its loop stalled) takes the probe's connect
    late, then never answers: `commd status --timeout 1` gave up after 1.8 s (the connect
    took 0.8 s of it, the answer had a whole second after), past what a probe's supervisor
    allows for it (the DaemonSet's liveness probe: --timeout 5 in timeoutSeconds 10)."""
    from client.errors import CommTimeout
    from commd.status import query_status

    path = tmp_path / "stalled.sock"
    with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as stalled, \
            socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as ahead:
        stalled.bind(str(path))
        stalled.settimeout(5)  # (its accept, below)
        stalled.listen(0)  # one connection waits to be accepted: the next connect waits for room
        ahead.connect(str(path))
        accepted: list[socket.socket] = []
        # (the room comes after the probe has waited for it a while; it never answers)
        room = threading.Timer(0.9, lambda: accepted.append(stalled.accept()[0]))
        room.start()
        started = time.monotonic()
        try:
            with pytest.raises(CommTimeout, match="did not answer within 1s"):
                query_status(str(path), 1.0)
            took = time.monotonic() - started
        finally:
            room.join(5)
            for conn in accepted:
                conn.close()
    # (one deadline: 1 s and scheduling; two: the 0.9 s connect, then a whole second more)
    assert 0.9 < took < 1.75, f"gave up after {took:.2f}s"
