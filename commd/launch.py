"""Start and stop a daemon in a child process: used by the demo, the bench and the tests."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import IO


def wait_for_socket(path: str | os.PathLike[str], timeout: float,
                    proc: subprocess.Popen[bytes] | None = None) -> int:
    """Once a daemon answers a status query at `path` (`proc` or a child of it, if given),
    its pid; TimeoutError if none does."""
    from client.errors import CommError

    from .status import query_status

    deadline = time.monotonic() + timeout
    other = ""
    while True:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"the daemon exited with code {proc.returncode} before it was ready{other}")
        if os.path.exists(path):
            try:
                # each probe gets at most the time left: a hung daemon must not stretch the timeout
                probe = min(1.0, max(0.01, deadline - time.monotonic()))
                pid = query_status(os.fspath(path), probe).get("pid")
                # (a daemon already there answers too, while `proc` is refused the path and
                # exits; a wrapper that forks, as timeout does, runs the daemon as its child)
                if isinstance(pid, int) and (proc is None or _runs_under(pid, proc.pid)):
                    return pid
                other = f" (another daemon, pid {pid}, answers at {os.fspath(path)})"
            except CommError:
                pass
        if time.monotonic() > deadline:
            raise TimeoutError(f"no daemon answered at {path} within {timeout}s{other}")
        time.sleep(0.02)


def _stat(pid: int) -> list[str]:
    """/proc/PID/stat's fields after the name (state, ppid, ...)."""
    with open(f"/proc/{pid}/stat") as stat:
        return stat.read().rsplit(")", 1)[1].split()  # (the name may hold spaces)


def cpu_seconds(pid: int) -> float:
    """A process's user + system CPU seconds so far (Linux): what the benchmark programs
    charge a daemon or a worker, read from outside the process."""
    fields = _stat(pid)
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _runs_under(pid: int, ancestor: int) -> bool:
    """Whether process `pid` is `ancestor` or one of its descendants (Linux)."""
    while pid > 1:
        if pid == ancestor:
            return True
        try:
            pid = int(_stat(pid)[1])
        except (OSError, ValueError, IndexError):  # gone meanwhile
            return False
    return pid == ancestor


class DaemonProcess:
    """`commd serve` as a child process; a context manager that stops it with SIGTERM."""

    def __init__(self, socket_path: str | os.PathLike[str], *, engine: str = "host",
                 args: Sequence[str] = (), log: IO[bytes] | int | None = None,
                 cpus: Sequence[int] | None = None, log_level: str = "WARNING",
                 env: dict[str, str] | None = None, under: Sequence[str] = ()) -> None:
        """`under`: a command that execs the daemon's (given as its last arguments), to run
        it in a namespace of its own, say; not a pid namespace (start waits for the daemon
        whose status names the pid it started, or a child of it: a wrapper may fork)."""
        self.socket_path = Path(socket_path)
        # No --config: read none (not the host's /etc/commd/commd.toml, which is the service's)
        config = () if "--config" in args else ("--config", "")
        self._cmd = [*under, sys.executable, "-m", "commd", "serve", *config, "--socket",
                     str(self.socket_path), "--engine", engine, "--log-level", log_level, *args]
        self._log = log
        self._cpus = cpus
        self._env = env or {}
        self.proc: subprocess.Popen[bytes] | None = None
        # the daemon's own process, where `under` ran it as a child: signals go to it, since
        # a wrapper need not pass them on (unshare --fork ignores SIGTERM and keeps waiting)
        self._child: int | None = None

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def start(self, timeout: float = 20.0) -> DaemonProcess:
        cpus = self._cpus

        def pin() -> None:
            if cpus:
                os.sched_setaffinity(0, cpus)

        env = {**os.environ, **self._env}
        root = str(Path(__file__).resolve().parent.parent)
        env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
        self.proc = subprocess.Popen(self._cmd, stdout=self._log, stderr=self._log, env=env,
                                     preexec_fn=pin if cpus else None)
        try:
            pid = wait_for_socket(self.socket_path, timeout, self.proc)
            if pid != self.proc.pid:  # (a pidfd: a pid may be reused once its process is gone)
                self._child = os.pidfd_open(pid)
        except BaseException:
            self.kill()
            raise
        return self

    def _signal(self, sig: signal.Signals) -> None:
        assert self.proc is not None
        if self._child is None:
            self.proc.send_signal(sig)
            return
        with contextlib.suppress(ProcessLookupError):
            signal.pidfd_send_signal(self._child, sig)
        if sig == signal.SIGKILL:  # (the wrapper too: it may outlive its child)
            self.proc.kill()

    def _reap(self, timeout: float) -> int:
        code = self.proc.wait(timeout) if self.proc is not None else 0
        if self._child is not None:
            os.close(self._child)
            self._child = None
        return code

    def stop(self, timeout: float = 20.0) -> int:
        """SIGTERM, wait; SIGKILL if it does not exit in time. Returns the exit code."""
        if self.proc is None:
            return 0
        if self.proc.poll() is None:
            self._signal(signal.SIGTERM)
            try:
                return self._reap(timeout)
            except subprocess.TimeoutExpired:
                self._signal(signal.SIGKILL)
        return self._reap(timeout)

    def peer_address(self) -> str:
        """host:port of the daemon's peer listener (asked of the daemon: it may have bound port 0)."""
        from .status import query_status

        peers = query_status(str(self.socket_path), 5)["peers"]
        return f"127.0.0.1:{peers['port']}"

    def kill(self) -> None:
        if self.proc is not None:
            if self.proc.poll() is None:
                self._signal(signal.SIGKILL)
            self._reap(10)

    def __enter__(self) -> DaemonProcess:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
