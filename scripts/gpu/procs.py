"""Child processes for gpu_check: workers and daemons, each in its own process group,
every wait bounded by a deadline, everything killable at once.

A worker talks back on stdout with tagged lines:
    @@EVENT <name> <json>      something happened (joined, in_call, error)
    @@RESULT <json>            the worker's answer, last
Any other line is kept as its log.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
WORKER = Path(__file__).resolve().parent / "worker.py"

_ALL: list[Proc] = []  # every process started, for kill_all at exit
_ALL_LOCK = threading.Lock()


class ProcError(RuntimeError):
    """A child did not answer in time, died, or answered with an error."""


def child_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """This environment, with the repo first on PYTHONPATH and unbuffered output."""
    env = dict(os.environ)
    paths = [str(REPO)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(paths))
    env["PYTHONUNBUFFERED"] = "1"
    # The proof is of PyTorch's default allocator (cudaMalloc segments, shared by CUDA IPC);
    # an image's cudaMallocAsync backend could not be shared at all (step 1 logs the setting).
    env.pop("PYTORCH_CUDA_ALLOC_CONF", None)
    env.update(extra or {})
    return env


class Proc:
    """A child process in its own process group; stdout read by a thread."""

    def __init__(self, name: str, cmd: Sequence[str], *, env: dict[str, str] | None = None,
                 log_dir: Path, cwd: Path = REPO) -> None:
        self.name = name
        self.cmd = list(cmd)
        self.err_path = log_dir / f"{name}.err"
        self.lines: list[str] = []
        self.events: list[tuple[str, Any, float]] = []  # (name, payload, time.time())
        self.result: dict[str, Any] | None = None
        self._cond = threading.Condition()
        self._err = open(self.err_path, "wb")  # noqa: SIM115 - closed in _reap
        self.popen = subprocess.Popen(self.cmd, stdout=subprocess.PIPE, stderr=self._err,
                                      stdin=subprocess.DEVNULL, env=child_env(env), cwd=cwd,
                                      process_group=0)
        self.started = time.monotonic()
        with _ALL_LOCK:
            _ALL.append(self)
        self._reader = threading.Thread(target=self._read, name=f"read-{name}", daemon=True)
        self._reader.start()

    @property
    def pid(self) -> int:
        return self.popen.pid

    def _read(self) -> None:
        assert self.popen.stdout is not None
        for raw in self.popen.stdout:
            line = raw.decode(errors="replace").rstrip("\n")
            with self._cond:
                if line.startswith("@@EVENT "):
                    _, name, *rest = line.split(" ", 2)
                    payload = _loads(rest[0]) if rest else None
                    self.events.append((name, payload, time.time()))
                elif line.startswith("@@RESULT "):
                    self.result = _loads(line[len("@@RESULT "):])
                else:
                    self.lines.append(line)
                self._cond.notify_all()
        with self._cond:
            self._cond.notify_all()

    def alive(self) -> bool:
        return self.popen.poll() is None

    def wait_event(self, name: str, deadline: float) -> tuple[Any, float]:
        """(payload, time.time() it was seen) of the first event `name`."""
        with self._cond:
            while True:
                for ev, payload, at in self.events:
                    if ev == name:
                        return payload, at
                if not self.alive() and not self._reader.is_alive():
                    raise ProcError(f"{self.name} exited (rc={self.popen.returncode}) before "
                                    f"event {name!r}: {self.err_tail()}")
                left = deadline - time.monotonic()
                if left <= 0:
                    raise ProcError(f"{self.name}: no event {name!r} in time")
                self._cond.wait(min(left, 0.2))

    def wait_result(self, deadline: float) -> dict[str, Any]:
        """The worker's @@RESULT; kills the process group if it does not come in time."""
        left = deadline - time.monotonic()
        try:
            self.popen.wait(max(0.0, left))
        except subprocess.TimeoutExpired:
            self.kill()
            raise ProcError(f"{self.name} did not finish in time (killed); "
                            f"last output: {self.out_tail(3)} | {self.err_tail()}") from None
        self._reader.join(5)
        self._reap()
        if self.result is None:
            raise ProcError(f"{self.name} exited rc={self.popen.returncode} without a result: "
                            f"{self.err_tail()}")
        return self.result

    def kill(self, sig: int = signal.SIGKILL) -> None:
        if self.popen.poll() is None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.popen.pid, sig)
        if sig == signal.SIGKILL:
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.popen.wait(10)
            self._reap()

    def stop(self, timeout: float = 10.0) -> int | None:
        """SIGTERM the group, wait, then SIGKILL. Returns the exit code."""
        if self.popen.poll() is None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.popen.pid, signal.SIGTERM)
            try:
                self.popen.wait(timeout)
            except subprocess.TimeoutExpired:
                self.kill()
        self._reap()
        return self.popen.returncode

    def _reap(self) -> None:
        with contextlib.suppress(OSError):
            self._err.close()

    def err_tail(self, n: int = 6, width: int = 400) -> str:
        try:
            text = self.err_path.read_text(errors="replace")
        except OSError:
            return ""
        lines = [ln for ln in text.splitlines() if ln.strip()]
        return " / ".join(lines[-n:])[-width:]

    def out_tail(self, n: int = 6) -> str:
        with self._cond:
            return " / ".join(self.lines[-n:])[-400:]


def _loads(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return text


def kill_all() -> None:
    """SIGKILL every process group still running (at exit, on a signal, after a step's timeout)."""
    with _ALL_LOCK:
        procs = list(_ALL)
    for proc in procs:
        if proc.alive():
            proc.kill()


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def worker(name: str, role: str, args: dict[str, Any], *, log_dir: Path,
           env: dict[str, str] | None = None) -> Proc:
    """`worker.py role '<json args>'` in its own process group."""
    return Proc(name, [sys.executable, str(WORKER), role, json.dumps(args)], env=env, log_dir=log_dir)


class Daemon:
    """`python -m commd serve` on a socket in `tmp`, with its log kept for the report."""

    def __init__(self, name: str, tmp: Path, engine: str, *, env: dict[str, str] | None = None,
                 peer_port: int | None = None, log_dir: Path) -> None:
        self.name = name
        self.socket = tmp / f"{name}.sock"
        self.peer_port = peer_port
        args = [sys.executable, "-m", "commd", "serve", "--config", "", "--socket", str(self.socket),
                "--engine", engine, "--log-level", "INFO"]
        if peer_port is not None:
            args += ["--peer-listen", f"127.0.0.1:{peer_port}", "--peer-name", name]
        self.proc = Proc(f"daemon-{name}", args, env=env, log_dir=log_dir)
        self.env = env or {}

    @property
    def bootstrap(self) -> str | None:
        return None if self.peer_port is None else f"127.0.0.1:{self.peer_port}"

    def wait_ready(self, deadline: float) -> dict[str, Any]:
        """Poll until the daemon answers a status query; returns the status (engine, ...)."""
        last = "no socket yet"
        while True:
            if not self.proc.alive():
                raise ProcError(f"daemon {self.name} exited rc={self.proc.popen.returncode}: "
                                f"{self.proc.err_tail()}")
            if self.socket.exists():
                try:
                    return status(self.socket, 1.0)
                except Exception as exc:  # not listening yet, or an old daemon's API
                    last = f"{type(exc).__name__}: {exc}"
            if time.monotonic() > deadline:
                self.proc.kill()
                raise ProcError(f"daemon {self.name} not ready in time ({last}): {self.proc.err_tail()}")
            time.sleep(0.05)

    def stop(self) -> int | None:
        return self.proc.stop()

    def log_tail(self, n: int = 150) -> str:
        try:
            lines = self.proc.err_path.read_text(errors="replace").splitlines()
        except OSError:
            return ""
        return "\n".join(lines[-n:])


def status(sock: Path, timeout: float) -> dict[str, Any]:
    """The daemon's status report (commd.status.query_status), or {} where the call is gone."""
    try:
        from commd.status import query_status
    except ImportError:  # older/newer repo without it: a bare connect says it listens
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.settimeout(timeout)
            s.connect(str(sock))
        return {}
    return query_status(str(sock), timeout)
