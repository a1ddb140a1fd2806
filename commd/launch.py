"""Start and stop a daemon in a child process: used by the demo, the bench and the tests."""

from __future__ import annotations

import contextlib
import os
import select
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import IO

# How long a daemon that a wrapper forked away is given to stop on SIGTERM before SIGKILL
ORPHAN_STOP_S = 10.0


def wait_for_socket(path: str | os.PathLike[str], timeout: float,
                    proc: subprocess.Popen[bytes] | None = None, *, wrapper: bool = False) -> int:
    """Once a daemon answers a status query at `path` (`proc` or a child of it, if given),
    its pid; TimeoutError if none does. RuntimeError if `proc` exits first. A `wrapper`
    `proc` (one that runs the daemon) that exits with code 0 forked the daemon away and
    left (as `setsid -f` does), with no owner to stop it: the daemon it started (one that
    answers at `path` and started after it, within `timeout`) is stopped, and the error
    says so; once no process started after it names `path` in its arguments (the wrapper
    ran none, or it died), the error comes at once."""
    deadline = time.monotonic() + timeout
    # (read before poll() reaps it)
    born = _started_at(proc.pid) if proc is not None and wrapper else None
    other = ""
    while True:
        if proc is not None and proc.poll() is not None:
            if proc.returncode == 0 and born is not None:
                raise _forked_away(path, proc, born, deadline)
            raise RuntimeError(f"the daemon exited with code {proc.returncode} before it was ready{other}")
        pid = _answering(path, deadline)
        # (a daemon already there answers too, while `proc` is refused the path and
        # exits; a wrapper that forks, as timeout does, runs the daemon as its child)
        if pid is not None and (proc is None or _runs_under(pid, proc.pid)):
            return pid
        if pid is not None:
            other = f" (another daemon, pid {pid}, answers at {os.fspath(path)})"
        if time.monotonic() > deadline:
            raise TimeoutError(f"no daemon answered at {path} within {timeout}s{other}")
        time.sleep(0.02)


def _answering(path: str | os.PathLike[str], deadline: float) -> int | None:
    """The pid of the daemon that answers a status query at `path` now, if any."""
    from client.errors import CommError

    from .status import query_status

    if not os.path.exists(path):
        return None
    try:
        # each probe gets at most the time left: a hung daemon must not stretch the timeout
        pid = query_status(os.fspath(path), min(1.0, max(0.01, deadline - time.monotonic()))).get("pid")
    except CommError:
        return None
    return pid if isinstance(pid, int) else None


def _forked_away(path: str | os.PathLike[str], wrapper: subprocess.Popen[bytes], born: int,
                 deadline: float) -> RuntimeError:
    """What to raise for a `wrapper` (started at `born`) that exited 0 before the daemon was
    ready, once the daemon it left behind, if one answers by `deadline`, is stopped."""
    command = os.fsdecode(wrapper.args[0]) if isinstance(wrapper.args, list) else str(wrapper.args)
    what = (f"{command} exited with code 0 before the daemon was ready: it forked the daemon away "
            f"(as setsid -f does), leaving no owner to stop it; run it under a command that execs "
            f"it or waits for it")
    while time.monotonic() <= deadline:
        pid = _answering(path, deadline)
        if pid is not None:
            with contextlib.suppress(ProcessLookupError):  # (gone meanwhile)
                pidfd = os.pidfd_open(pid)  # (held: the pid cannot be another's from here on)
                try:
                    started = _started_at(pid)
                    if started is not None and started >= born:  # (else the one there before)
                        _end(pidfd, ORPHAN_STOP_S)
                        return RuntimeError(f"{what} (its daemon, pid {pid}, answered at "
                                            f"{os.fspath(path)}, and was stopped)")
                finally:
                    os.close(pidfd)
        elif not _naming_since(path, born):
            # none could answer later: the daemon the wrapper forked names the path (it is in
            # its arguments, and in the wrapper's that a child forked, not yet exec'd, shares)
            return RuntimeError(f"{what} (no process started since names {os.fspath(path)} any "
                                f"more: no daemon of it will answer there)")
        time.sleep(0.02)
    return RuntimeError(f"{what} (no daemon it started answered at {os.fspath(path)} by the timeout)")


def _naming_since(path: str | os.PathLike[str], born: int) -> bool:
    """Whether a process started at or after `born` (see _started_at) has `path` among its
    arguments (Linux: /proc; mounted hidepid, another user's process is not seen: a wrapper
    that forks away a daemon of another user is then told at once, the daemon left running)."""
    wanted = os.fsencode(path)
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as cmdline:
                named = wanted in cmdline.read().split(b"\0")
        except OSError:  # gone meanwhile, or not ours to read
            continue
        if named:
            started = _started_at(int(entry))
            if started is not None and started >= born:
                return True
    return False


def _end(pidfd: int, timeout: float) -> None:
    """SIGTERM the process of `pidfd` (no child of ours: not waited for, its pidfd turns
    readable as it exits), then SIGKILL it if it has not exited within `timeout`."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        with contextlib.suppress(ProcessLookupError):
            signal.pidfd_send_signal(pidfd, sig)
        if select.select([pidfd], [], [], timeout)[0]:
            return


def _started_at(pid: int) -> int | None:
    """When process `pid` started, in clock ticks since boot (Linux); None if it is gone."""
    try:
        return int(_stat(pid)[19])
    except (OSError, ValueError, IndexError):
        return None


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
        whose status names the pid it started, or a child of it: a wrapper may fork). Not
        one that forks the daemon away and exits (`setsid -f`): stop could not reach the
        daemon through it; start then stops the daemon and raises RuntimeError, saying so."""
        self.socket_path = Path(socket_path)
        # No --config: read none (not the host's /etc/commd/commd.toml, which is the service's)
        config = () if "--config" in args else ("--config", "")
        self._wrapped = bool(under)
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
            pid = wait_for_socket(self.socket_path, timeout, self.proc, wrapper=self._wrapped)
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
