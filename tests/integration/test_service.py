"""The daemon as a service: sd_notify, socket activation, configuration layers, status
with several worlds, JSON logs and a metrics scrape, each against real daemon processes."""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from commd.launch import DaemonProcess
from commd.status import query_status
from tests.integration import service_workers, workers
from tests.integration.data import make_input
from tests.integration.harness import RankPool, scrape, short_tmpdir, wait_until, world_name

pytestmark = pytest.mark.timeout(60)
ROOT = str(Path(__file__).resolve().parents[2])


@pytest.fixture
def tmp() -> Iterator[Path]:
    path = Path(short_tmpdir())
    yield path
    shutil.rmtree(path, ignore_errors=True)


def child_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("COMMD_", "NOTIFY_", "LISTEN_"))}
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    return {**env, **extra}


def serve_cmd(sock: Path, *args: str) -> list[str]:
    return [sys.executable, "-m", "commd", "serve", "--config", "", "--socket", str(sock),
            "--log-level", "WARNING", *args]


class Spawned:
    """A daemon started by hand (the test decides what it inherits); killed if still alive."""

    def __init__(self, cmd: list[str], env: dict[str, str], pass_fds: tuple[int, ...] = ()) -> None:
        self.proc = subprocess.Popen(cmd, env=env, pass_fds=pass_fds, stdout=subprocess.DEVNULL,
                                     stderr=subprocess.PIPE)

    def terminate(self, timeout: float = 20) -> tuple[int, str]:
        self.proc.send_signal(signal.SIGTERM)
        return self.finish(timeout)

    def finish(self, timeout: float = 20) -> tuple[int, str]:
        _, err = self.proc.communicate(timeout=timeout)
        return self.proc.returncode, err.decode()

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.communicate(timeout=10)


def receive(rx: socket.socket, until: str, deadline: float) -> list[str]:
    """sd_notify messages as they come, up to and including the first that has line `until`."""
    got = []
    while True:
        rx.settimeout(max(0.01, deadline - time.monotonic()))
        try:
            message = rx.recv(4096).decode()
        except TimeoutError:
            raise AssertionError(f"no {until} within the deadline; got {got}") from None
        got.append(message)
        if until in message.split("\n"):
            return got


# ---- sd_notify ----------------------------------------------------------------------------


def test_ready_after_the_socket_accepts_then_watchdog_status_and_stopping(tmp: Path,
                                                                            pool: RankPool) -> None:
    sock = tmp / "run" / "commd.sock"
    rx = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    rx.bind(str(tmp / "notify"))
    daemon = Spawned(serve_cmd(sock), child_env(NOTIFY_SOCKET=str(tmp / "notify"), WATCHDOG_USEC="100000"))
    try:
        before_ready = receive(rx, "READY=1", time.monotonic() + 20)
        # READY is the first word it says, and when it comes the socket takes connections
        assert len(before_ready) == 1 and before_ready[0].startswith("READY=1\nSTATUS=serving 0 worlds")
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        probe.settimeout(5)
        probe.connect(str(sock))
        probe.close()
        assert query_status(str(sock), 5)["pid"] == daemon.proc.pid

        # WATCHDOG_USEC=0.1 s: a ping every 50 ms from the event loop
        started = time.monotonic()
        pings = [m for m in receive_n(rx, 10, time.monotonic() + 10) if "WATCHDOG=1" in m.split("\n")]
        assert len(pings) == 10 and time.monotonic() - started < 5

        # STATUS follows the worlds
        world = world_name("notify")
        held = pool.start(service_workers.reduce_then_wait,
                          [(str(sock), world, r, 2, 1, 4, True) for r in range(2)])
        status = receive(rx, "STATUS=serving 1 worlds (1 ready), 2 ranks, 2 connections",
                         time.monotonic() + 20)
        assert "WATCHDOG=1" in status[-1]
        # "1 ready" comes before the ranks' all_reduce is done: SIGTERM only once both wait
        # in their last call (rank 0's recv, rank 1's recv_command_u32), which it fails
        wait_until(lambda: any(w["name"] == world and w["pending_calls"] == 2
                               for w in query_status(str(sock), 5)["worlds"]),
                   "both ranks to wait in their last call")

        code, err = daemon.terminate()
        assert code == 0, err
        assert [o.unwrap() for o in pool.collect(held, 20)] == [([1], "DaemonShutdown")] * 2
        stopping = receive(rx, "STOPPING=1", time.monotonic() + 5)
        assert stopping[-1].startswith("STOPPING=1")
    finally:
        daemon.kill()
        rx.close()


def receive_n(rx: socket.socket, n: int, deadline: float) -> list[str]:
    got: list[str] = []
    while len(got) < n:
        rx.settimeout(max(0.01, deadline - time.monotonic()))
        got.append(rx.recv(4096).decode())
    return got


# ---- socket activation ---------------------------------------------------------------------


def activated(cmd: list[str], fd: int, env: dict[str, str]) -> Spawned:
    """`cmd` with `fd` as its fd 3 and LISTEN_PID equal to its own pid, as systemd starts it:
    a small trampoline moves the fd, sets its own pid and execs the daemon in its place (a
    shell would do, but dash cannot name fds above 9)."""
    trampoline = ("import os, sys; fd = int(sys.argv[1]); os.dup2(fd, 3); os.close(fd); "
                  "os.environ.update(LISTEN_PID=str(os.getpid()), LISTEN_FDS='1'); "
                  "os.execv(sys.argv[2], sys.argv[2:])")
    return Spawned([sys.executable, "-c", trampoline, str(fd), *cmd], env, pass_fds=(fd,))


def listener(path: Path, kind: int = socket.SOCK_SEQPACKET) -> tuple[socket.socket, int]:
    """A listening socket at `path`, and a duplicate of it numbered above 3 to pass on."""
    path.parent.mkdir(mode=0o750, parents=True, exist_ok=True)
    sock = socket.socket(socket.AF_UNIX, kind)
    sock.bind(str(path))
    sock.listen(16)
    fd = fcntl.fcntl(sock.fileno(), fcntl.F_DUPFD, 10)
    os.set_inheritable(fd, True)
    return sock, fd


def test_socket_activation_serves_calls_on_the_inherited_socket(tmp: Path, pool: RankPool) -> None:
    path = tmp / "run" / "commd.sock"
    sock, fd = listener(path)
    daemon = activated(serve_cmd(path), fd, child_env())
    os.close(fd)
    sock.close()  # the daemon holds the only copy now, as it would under systemd
    try:
        world = world_name("activated")
        outcomes = pool.run(service_workers.reduce_then_wait,
                            [(str(path), world, r, 3, 4, 16, False) for r in range(3)], timeout=30)
        # rank r gives r + i: the sum over 3 ranks is 3 + 3i
        assert [o.unwrap() for o in outcomes] == [([3, 6, 9, 12], "done")] * 3
        info = query_status(str(path), 5)
        assert info["socket_activated"] is True and info["pid"] == daemon.proc.pid
        code, err = daemon.terminate()
        assert code == 0, err
        assert path.is_socket(), "the daemon removed a socket file that systemd owns"
    finally:
        daemon.kill()


@pytest.mark.parametrize(("kind", "listen", "words"), [
    (socket.SOCK_STREAM, True, "not SOCK_SEQPACKET"),
    (socket.SOCK_SEQPACKET, False, "not listening"),
])
def test_socket_activation_refuses_a_socket_it_cannot_serve(tmp: Path, kind: int, listen: bool,
                                                            words: str) -> None:
    path = tmp / "run" / "commd.sock"
    path.parent.mkdir(parents=True)
    sock = socket.socket(socket.AF_UNIX, kind)
    sock.bind(str(path))
    if listen:
        sock.listen(4)
    fd = fcntl.fcntl(sock.fileno(), fcntl.F_DUPFD, 10)
    os.set_inheritable(fd, True)
    daemon = activated(serve_cmd(path), fd, child_env())
    os.close(fd)
    try:
        code, err = daemon.finish()
        assert code == 2 and "socket activation" in err and words in err, err
    finally:
        daemon.kill()
        sock.close()


# ---- configuration -------------------------------------------------------------------------


def test_config_layers_and_json_logs_through_a_real_daemon(tmp: Path, pool: RankPool) -> None:
    config = tmp / "commd.toml"
    config.write_text('threads = 2\nmax_buffers = 10\nmax_pending_ops = 100\nlog_format = "json"\n'
                      'log_level = "ERROR"\n')
    log_path = tmp / "daemon.log"
    with open(log_path, "wb") as log, DaemonProcess(
            tmp / "run" / "commd.sock", args=["--config", str(config), "--threads", "4"], log=log,
            log_level="INFO", env={"COMMD_MAX_BUFFERS": "20", "COMMD_THREADS": "3"}) as daemon:
        settings = query_status(str(daemon.socket_path), 5)["config"]
        # file < environment < flags; the file alone sets max_pending_ops and the format
        assert (settings["threads"], settings["max_buffers"], settings["max_pending_ops"]) == (4, 20, 100)
        assert (settings["log_format"], settings["log_level"]) == ("json", "INFO")
        world = world_name("logs")
        outcomes = pool.run(service_workers.reduce_then_wait,
                            [(str(daemon.socket_path), world, r, 2, 1, 4, False) for r in range(2)])
        assert [o.unwrap() for o in outcomes] == [([1], "done")] * 2
        wait_until(lambda: not query_status(str(daemon.socket_path), 5)["worlds"], "the world to end")
    lines = [json.loads(line) for line in log_path.read_text().splitlines() if line.strip()]
    ready = [line for line in lines if line.get("world") == world and "ready" in line["message"]]
    assert len(ready) == 1 and ready[0]["epoch"] == 1 and ready[0]["logger"] == "commd.world"
    assert {"ts", "level", "logger", "message"} <= set(ready[0])
    # every line about the world names it and its epoch; the one of a rank's leaving, the rank
    about = [line for line in lines if f"world {world}" in line["message"]]
    assert all((line.get("world"), line.get("epoch")) == (world, 1) for line in about), about
    left = [line for line in about if "connection was lost" in line["message"]]
    assert left and all(f"rank {line['rank']}'s connection" in line["message"] for line in left), left


@pytest.mark.parametrize(("toml", "env", "args", "words"), [
    ("thread_count = 4\n", {}, (), ["thread_count", "commd.toml", "unknown key"]),
    ("", {"COMMD_THREAD_COUNT": "4"}, (), ["$COMMD_THREAD_COUNT", "unknown setting"]),
    ('threads = "4"\n', {}, (), ["threads", "commd.toml", "expected an integer"]),
    ("", {"COMMD_MAX_BUFFERS": "-1"}, (), ["max_buffers", "$COMMD_MAX_BUFFERS", "must be 1.."]),
    ("", {}, ("--peer-window", "0.1"), ["peer_window", "--peer-window", "heartbeat"]),
    ("threads = [\n", {}, (), ["commd.toml", "not valid TOML"]),
    (None, {}, (), ["does-not-exist.toml", "does not exist"]),
    # before: each of these was a traceback and exit 1
    (b"threads = 2\n# caf\xe9\n", {}, (), ["commd.toml", "not UTF-8"]),
    ('allow_groups = ["a\\u0000b"]\n', {}, (), ["allow_groups", "NUL"]),
    ('peer_secret_file = "/tmp/a\\u0000b"\n', {}, (), ["peer_secret_file", "NUL"]),
    ("", {}, ("--socket", "{tmp}/commd.toml/c.sock"), ["socket", "cannot create the directory"]),
    # an empty path: before, the socket was "." ('socket: . exists and is not a socket'), and the
    # variable silently took away the secret file the config names ('peer_listen: needs a secret')
    ("", {}, ("--socket", ""), ["socket (from --socket)", "an empty path"]),
    ('peer_secret_file = "/etc/commd/peer.secret"\n', {"COMMD_PEER_SECRET_FILE": ""},
     ("--peer-listen", "127.0.0.1:0"), ["peer_secret_file (from $COMMD_PEER_SECRET_FILE)", "an empty path"]),
    # found only as the daemon starts (no GPU to be seen: none here, and none where the variable
    # hides them); before, with no word of where 'nccl' came from
    ('engine = "nccl"\n', {"CUDA_VISIBLE_DEVICES": ""}, (),
     ["engine 'nccl' is not available here", "(engine = 'nccl' from"]),
])
def test_config_errors_exit_2_naming_key_and_source(tmp: Path, toml: str | bytes | None, env: dict[str, str],
                                                    args: tuple[str, ...], words: list[str]) -> None:
    config = tmp / ("commd.toml" if toml is not None else "does-not-exist.toml")
    if isinstance(toml, bytes):
        config.write_bytes(toml)
    elif toml is not None:
        config.write_text(toml)
    cmd = [sys.executable, "-m", "commd", "serve", "--config", str(config), "--socket",
           str(tmp / "c.sock"), *(arg.format(tmp=tmp) for arg in args)]
    done = subprocess.run(cmd, env=child_env(**env), capture_output=True, timeout=30)
    err = done.stderr.decode()
    assert done.returncode == 2, err
    assert err.startswith("commd: configuration error:") and all(w in err for w in words), err
    assert not (tmp / "c.sock").exists()


def test_a_short_secret_is_blamed_on_the_variable_that_gave_it(tmp: Path) -> None:
    """$COMMD_PEER_SECRET beats a peer_secret_file the config file names, and a secret too
    short from it was blamed on the file ('(peer_secret_file = ... from commd.toml)'), whose
    secret is fine: the operator was sent to look in the wrong place."""
    secret = tmp / "peer.secret"
    secret.write_text("0123456789abcdef0123\n")
    secret.chmod(0o600)
    config = tmp / "commd.toml"
    config.write_text(f'peer_secret_file = "{secret}"\n')
    cmd = [sys.executable, "-m", "commd", "serve", "--config", str(config), "--socket", str(tmp / "c.sock")]
    done = subprocess.run(cmd, env=child_env(COMMD_PEER_SECRET="short"), capture_output=True, timeout=30)
    assert done.returncode == 2
    assert done.stderr.decode() == ("commd: configuration error: peer secret: must be at least 16 bytes "
                                    "(from $COMMD_PEER_SECRET)\n")
    assert not (tmp / "c.sock").exists()


def test_one_secret_given_as_a_file_or_a_variable_is_one_secret(tmp: Path, pool: RankPool) -> None:
    """A secret file's trailing newline (`openssl rand -hex 32 > file`) is not part of the
    secret; the same text in $COMMD_PEER_SECRET (a Kubernetes Secret made from that file and
    passed with secretKeyRef) kept it: the daemons refused each other, 'daemon A does not
    hold our secret'."""
    secret = tmp / "peer.secret"
    secret.write_text("0123456789abcdef0123\r\n")
    secret.chmod(0o600)
    with DaemonProcess(tmp / "A" / "commd.sock", args=["--peer-secret-file", str(secret), "--peer-name", "A",
                                                       "--peer-listen", "127.0.0.1:0"]) as a, \
            DaemonProcess(tmp / "B" / "commd.sock", args=["--peer-name", "B"],
                          env={"COMMD_PEER_SECRET": "0123456789abcdef0123\n"}) as b:
        root = a.peer_address()
        world = world_name("secret")
        outcomes = pool.run(workers.all_reduce, [(f"{d.socket_path}@{root}", world, r, 2, 5, "i32", "sum", 3)
                                                 for r, d in enumerate((a, b))])
    inputs = [make_input(3, r, 5, "i32", "sum") for r in range(2)]
    assert [o.unwrap() for o in outcomes] == [(inputs[0] + inputs[1]).tobytes()] * 2


def test_a_peer_port_in_use_is_a_configuration_error(tmp: Path) -> None:
    """(before: a traceback, exit 1)"""
    secret = tmp / "secret"
    secret.write_text("0123456789abcdef0123")
    secret.chmod(0o600)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        cmd = [sys.executable, "-m", "commd", "serve", "--config", "", "--socket", str(tmp / "c.sock"),
               "--peer-secret-file", str(secret), "--peer-listen", f"127.0.0.1:{taken.getsockname()[1]}"]
        done = subprocess.run(cmd, env=child_env(), capture_output=True, timeout=30)
    err = done.stderr.decode()
    assert done.returncode == 2 and err.startswith("commd: configuration error: peer_listen"), err
    assert not (tmp / "c.sock").exists()


@pytest.mark.parametrize("found", ["starting", "reading its settings"])
def test_a_final_error_waits_for_no_stalled_log_reader(tmp: Path, found: str) -> None:
    """The daemon's stderr is a full one-page pipe that nobody reads, and its peer port is
    in use (found as it starts, its log set up) or its config file missing (found before
    there is a log): it exits 2 within 15 s, each wait for the reader bounded (before: its
    final error's print waited in write(2) for ever). The line itself, read, is as above."""
    secret = tmp / "secret"
    secret.write_text("0123456789abcdef0123")
    secret.chmod(0o600)
    r, w = os.pipe()
    fcntl.fcntl(w, fcntl.F_SETPIPE_SZ, 4096)
    assert os.write(w, b"f" * 4096) == 4096
    with socket.socket() as taken, open(r, "rb"):
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        config = "" if found == "starting" else str(tmp / "missing.toml")
        cmd = [sys.executable, "-m", "commd", "serve", "--config", config, "--socket", str(tmp / "c.sock"),
               "--peer-secret-file", str(secret), "--peer-listen", f"127.0.0.1:{taken.getsockname()[1]}"]
        try:
            daemon = subprocess.Popen(cmd, env=child_env(), stdin=subprocess.DEVNULL,
                                      stdout=subprocess.DEVNULL, stderr=w)
        finally:
            os.close(w)
        try:
            assert daemon.wait(15) == 2
        finally:
            daemon.kill()
            daemon.wait()


@pytest.mark.parametrize("where", ["file", "env"])
def test_a_port_in_use_names_where_its_setting_came_from(tmp: Path, where: str) -> None:
    """A port in use is found only as the daemon starts, after the settings were read: the
    error named the key but not where its value came from (by hand on a host whose
    /etc/commd/commd.toml sets metrics_listen, nothing on the command line said so)."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        address = f"127.0.0.1:{taken.getsockname()[1]}"
        config = tmp / "commd.toml"
        config.write_text(f'metrics_listen = "{address}"\n' if where == "file" else "")
        env = {"COMMD_METRICS_LISTEN": address} if where == "env" else {}
        done = subprocess.run([sys.executable, "-m", "commd", "serve", "--config", str(config),
                               "--socket", str(tmp / "c.sock")], env=child_env(**env), capture_output=True,
                              timeout=30)
    err = done.stderr.decode()
    source = str(config) if where == "file" else "$COMMD_METRICS_LISTEN"
    assert done.returncode == 2, err
    assert err.startswith(f"commd: configuration error: metrics_listen: cannot listen on {address}: "), err
    assert err.endswith(f" (metrics_listen = '{address}' from {source})\n"), err
    assert not (tmp / "c.sock").exists()


# ---- status and metrics ------------------------------------------------------------------


def test_status_shows_two_worlds(tmp: Path, pool: RankPool) -> None:
    with DaemonProcess(tmp / "run" / "commd.sock") as daemon:
        sock = str(daemon.socket_path)
        a, b = world_name("alpha"), world_name("beta")
        held = pool.start(service_workers.reduce_then_wait,
                          [(sock, a, 0, 2, 3, 4, True), (sock, a, 1, 2, 3, 4, True),
                           (sock, b, 0, 2, 1, 4, True), (sock, b, 1, 2, 1, 4, True)])

        def both_waiting() -> bool:
            worlds = {w["name"]: w for w in query_status(sock, 5)["worlds"]}
            return all(name in worlds and worlds[name]["pending_calls"] == 2 for name in (a, b))

        wait_until(both_waiting, "both worlds to hold two pending calls")
        info = query_status(sock, 5)
        assert info["engine"] == "host" and info["version"] and info["uptime_s"] > 0
        assert info["connections"] == 4 + 1 and info["ranks_connected"] == 4  # + this query
        worlds = {w["name"]: w for w in info["worlds"]}
        for name, calls in ((a, 3), (b, 1)):
            w = worlds[name]
            assert (w["state"], w["epoch"], w["ranks"], w["local_ranks"]) == ("ready", 1, [0, 1], [0, 1])
            assert w["last_failure"] is None
            states = [c["state"] for c in w["recent_calls"]["1"]]
            assert states == ["done"] * calls + ["pending"]
        assert info["counters"]["calls"]["all_reduce"]["done"] == 2 * 3 + 2 * 1

        table = run_cli("status", "--socket", sock)
        assert a in table and b in table and "ready" in table and "2/2" in table
        one = run_cli("status", "--socket", sock, "--world", a)
        assert a in one and b not in one and "recv_command_u32" in one and "all_reduce" in one
        as_json = json.loads(run_cli("status", "--socket", sock, "--json"))
        assert {w["name"] for w in as_json["worlds"]} == {a, b}
        assert daemon.stop() == 0
        assert [o.unwrap()[1] for o in pool.collect(held, 20)] == ["DaemonShutdown"] * 4


def run_cli(*args: str, **env: str) -> str:
    done = subprocess.run([sys.executable, "-m", "commd", *args], env=child_env(**env), capture_output=True,
                          timeout=30)
    assert done.returncode == 0, done.stderr.decode()
    return done.stdout.decode()


@pytest.mark.parametrize("args", [["--json"], []])
def test_status_into_a_pipe_whose_reader_went_away_says_nothing_more(tmp: Path, args: list[str]) -> None:
    """`commd status --json | head -c 10` printed a BrokenPipeError traceback (exit 1), and
    the text report 'Exception ignored ... BrokenPipeError' (exit 120), once the report was
    more than head read; here the reader is gone before the report is written."""
    with DaemonProcess(tmp / "commd.sock") as daemon:
        sock = str(daemon.socket_path)
        read, write = os.pipe()
        os.close(read)
        try:
            done = subprocess.run([sys.executable, "-m", "commd", "status", "--socket", sock, *args],
                                  env=child_env(), stdout=write, stderr=subprocess.PIPE, timeout=30)
        finally:
            os.close(write)
        assert json.loads(run_cli("status", "--json", "--socket", sock))["pid"] == daemon.pid
    assert (done.returncode, done.stderr) == (141, b"")


def test_status_onto_a_full_disk_says_why_it_could_not_write(tmp: Path) -> None:
    """`commd status > /dev/full` printed 'Exception ignored ... OSError: [Errno 28]' and
    exited 120: the report was lost with no line an operator reads as the reason."""
    with DaemonProcess(tmp / "commd.sock") as daemon, open("/dev/full", "wb") as full:
        done = subprocess.run([sys.executable, "-m", "commd", "status", "--socket", str(daemon.socket_path)],
                              env=child_env(), stdout=full, stderr=subprocess.PIPE, timeout=30)
    assert done.returncode == 1, done.stderr
    assert done.stderr == b"commd: cannot write the status report: No space left on device\n"


def test_status_asks_the_socket_the_daemons_settings_name(tmp: Path) -> None:
    """`commd status` asked /run/commd/commd.sock whatever the config file or $COMMD_SOCKET
    (which a unit's Environment= sets) told the daemon."""
    sock = tmp / "configured.sock"
    config = tmp / "commd.toml"
    config.write_text(f'socket = "{sock}"\n')
    with DaemonProcess(sock, args=["--config", str(config)]):
        for args, env in ((["--config", str(config)], {}), ([], {"COMMD_SOCKET": str(sock)}),
                          (["--config", str(config), "--socket", str(sock)], {"COMMD_SOCKET": "/nowhere"})):
            as_json = json.loads(run_cli("status", "--json", *args, **env))
            assert as_json["socket"] == str(sock), (args, env)
    done = subprocess.run([sys.executable, "-m", "commd", "status", "--config", str(tmp / "none.toml")],
                          env=child_env(), capture_output=True, timeout=30)
    assert done.returncode == 2 and b"none.toml" in done.stderr and b"Traceback" not in done.stderr


def test_status_reads_no_setting_but_the_socket(tmp: Path) -> None:
    """`commd status` read every setting to find the socket: --socket given, it still
    failed (exit 2) on a variable the daemon would refuse ($COMMD_SERVICE_HOST, which a
    Kubernetes Service named commd injects; a script's own $COMMD_GPU_CHECK_DRY) and on a
    config file it could not take (unreadable to the user, root-only; a key of another
    commd version)."""
    sock = tmp / "configured.sock"
    unreadable = tmp / "other.toml"
    unreadable.write_text("thread_count = 4\n")
    stray = {"COMMD_SERVICE_HOST": "10.0.0.1", "COMMD_GPU_CHECK_DRY": "1"}
    with DaemonProcess(sock):
        for args, env in ((["--socket", str(sock)], stray),
                          (["--socket", str(sock), "--config", str(unreadable)], {}),
                          ([], {**stray, "COMMD_SOCKET": str(sock)})):
            assert json.loads(run_cli("status", "--json", *args, **env))["socket"] == str(sock), (args, env)


def test_a_daemon_on_a_socket_path_that_is_not_utf8_reports_and_joins_worlds(tmp: Path,
                                                                              pool: RankPool) -> None:
    """The settings take a socket path of any bytes, but the report carried it raw and the
    default peer name (host:SOCKET without a fixed peer port) was made of it: every `commd
    status` failed as a daemon bug (the report could not be encoded), and every world across
    daemons failed in the handshake (peer_hello cannot be encoded)."""
    secret = {"COMMD_PEER_SECRET": "test-secret-0123456789"}
    path = tmp / os.fsdecode(b"caf\xe9") / "commd.sock"
    member = Spawned(serve_cmd(path), child_env(**secret))
    try:
        with DaemonProcess(tmp / "root" / "commd.sock", env=secret,
                           args=["--peer-listen", "127.0.0.1:0"]) as root:
            wait_until(lambda: path.exists() or member.proc.poll() is not None, "the member's socket")
            info = query_status(str(path), 5)
            assert info["socket"] == info["config"]["socket"] == f"{tmp}/caf\\xe9/commd.sock"
            assert info["peers"]["name"] == f"{socket.gethostname()}:{tmp}/caf\\xe9/commd.sock"
            assert run_cli("status", "--socket", str(path)).startswith("commd ")

            world = world_name("utf8")
            specs = [f"{root.socket_path}@{root.peer_address()}", f"{path}@{root.peer_address()}"]
            outcomes = pool.run(service_workers.reduce_then_wait,
                                [(specs[r], world, r, 2, 2, 4, False) for r in range(2)], timeout=30)
            assert [o.unwrap() for o in outcomes] == [([1, 3], "done")] * 2
        code, err = member.terminate()
        assert code == 0 and "Traceback" not in err, err
    finally:
        member.kill()


def test_a_default_peer_name_the_handshake_cannot_carry_is_refused_at_start(tmp: Path) -> None:
    """Without peer_name, a daemon is named host:SOCKET, and each byte of the path that is
    not UTF-8 takes four characters (backslash-escaped): past 256, the handshake could not
    carry the name and every world across daemons failed. The daemon refuses to start."""
    path = tmp / os.fsdecode(b"\xff" * 60) / "commd.sock"
    done = subprocess.run(serve_cmd(path), env=child_env(COMMD_PEER_SECRET="test-secret-0123456789"),
                          capture_output=True, text=True, timeout=30)
    assert done.returncode == 2, done.stderr
    assert "peer_name: the default" in done.stderr and "set peer_name" in done.stderr, done.stderr
    assert "Traceback" not in done.stderr


def test_a_job_that_ends_is_logged_as_ended_not_failed(tmp: Path, pool: RankPool) -> None:
    """Ranks that end with a barrier and leave end their world, which is no failure: the
    daemon's log says so (before, every job's end read "failed: rank N's connection was
    lost", and a search of the logs for failures found every job)."""
    with open(tmp / "daemon.log", "wb") as log:
        daemon = DaemonProcess(tmp / "run" / "commd.sock", log=log, log_level="INFO").start()
        try:
            sock, world = str(daemon.socket_path), world_name("ends")
            outcomes = pool.run(service_workers.reduce_then_wait,
                                [(sock, world, r, 2, 1, 4, False) for r in range(2)], timeout=30)
            assert [o.unwrap() for o in outcomes] == [([1], "done")] * 2
            wait_until(lambda: not query_status(sock, 5)["worlds"], "the world to end")
        finally:
            assert daemon.stop() == 0
    err = (tmp / "daemon.log").read_text()
    ended = [line for line in err.splitlines()
             if f"world {world} epoch 1: " in line and "connection was lost" in line]
    assert len(ended) == 1 and "ended, no call pending" in ended[0] and "INFO" in ended[0], err
    assert "failed" not in ended[0] and "WARNING" not in err, err


def test_a_log_reader_that_stalls_holds_up_no_call(tmp: Path, pool: RankPool) -> None:
    """The daemon's stderr is a one-page pipe that nobody reads while 20 worlds of two
    ranks form, all_reduce and end, logging at INFO: each world's sums are right (before:
    once the page was full the daemon's event loop waited in write(2), and every call with
    it); read afterwards, every world's lines are there, in order."""
    r, w = os.pipe()
    fcntl.fcntl(w, fcntl.F_SETPIPE_SZ, 4096)
    with open(r, "rb") as out:
        try:
            daemon = DaemonProcess(tmp / "run" / "commd.sock", log=w, log_level="INFO").start()
        finally:
            os.close(w)
        read: list[bytes] = []
        reader = threading.Thread(target=lambda: read.append(out.read()))
        try:
            sock, worlds = str(daemon.socket_path), [world_name(f"stall{i}") for i in range(20)]
            for world in worlds:
                outcomes = pool.run(service_workers.reduce_then_wait,
                                    [(sock, world, r, 2, 2, 8, False) for r in range(2)], timeout=30)
                assert [o.unwrap() for o in outcomes] == [([1, 3], "done")] * 2
            wait_until(lambda: not query_status(sock, 5)["worlds"], "the worlds to end")
        finally:
            reader.start()
            assert daemon.stop() == 0
            reader.join(10)
    lines = read[0].decode().splitlines()
    assert [line.split(" world ")[1].split()[0] for line in lines if "epoch 1: ready" in line] == worlds
    assert "dropped" not in read[0].decode() and "Traceback" not in read[0].decode()


def test_metrics_scrape_counts_the_calls(tmp: Path, pool: RankPool) -> None:
    pytest.importorskip("prometheus_client")
    with DaemonProcess(tmp / "run" / "commd.sock", args=["--metrics", "127.0.0.1:0"]) as daemon:
        sock = str(daemon.socket_path)
        address = query_status(sock, 5)["metrics"]
        before = scrape(address)
        assert before[("commd_connections", ())] == 0
        assert ("commd_calls_total", (("op", "all_reduce"), ("outcome", "done"))) not in before

        world, calls, nelem = world_name("metrics"), 5, 256
        outcomes = pool.run(service_workers.reduce_then_wait,
                            [(sock, world, r, 2, calls, nelem, False) for r in range(2)])
        assert [o.unwrap() for o in outcomes] == [([1, 3, 5, 7, 9], "done")] * 2
        wait_until(lambda: not query_status(sock, 5)["worlds"], "the world to end")

        after = scrape(address)
        op = (("op", "all_reduce"),)
        assert after[("commd_calls_total", (*op, ("outcome", "done")))] == 2 * calls
        assert after[("commd_calls_total", (*op, ("outcome", "failed")))] == 0
        assert after[("commd_call_bytes_total", op)] == 2 * calls * nelem * 4
        assert after[("commd_call_latency_seconds_count", op)] == 2 * calls
        assert after[("commd_call_latency_seconds_bucket", (("le", "+Inf"), *op))] == 2 * calls
        assert after[("commd_calls_total", (("op", "barrier"), ("outcome", "done")))] == 2
        assert after[("commd_world_transitions_total", (("state", "ready"),))] == 1
        # the job ended (ranks left an idle world): a state change, not a failure
        assert after[("commd_world_transitions_total", (("state", "failed"),))] == 1
        assert not any(name == "commd_world_failures_total" for name, _ in after)
        assert after[("commd_ranks_connected", ())] == 0
        with pytest.raises(urllib.error.HTTPError) as missing:
            urllib.request.urlopen(f"http://{address}/other", timeout=5)
        assert missing.value.code == 404
        with pytest.raises(urllib.error.HTTPError) as huge:
            urllib.request.urlopen(urllib.request.Request(f"http://{address}/metrics",
                                                          headers={"X-Big": "x" * 9000}), timeout=5)
        assert huge.value.code == 431


def test_idle_connections_to_the_metrics_port_cannot_shut_scrapers_out(tmp: Path) -> None:
    """More connections that say nothing than the port serves at once: each scrape still
    gets its answer (an idle one makes way; before, the 17th was closed unanswered)."""
    pytest.importorskip("prometheus_client")
    with DaemonProcess(tmp / "run" / "commd.sock", args=["--metrics", "127.0.0.1:0"]) as daemon:
        host, port = query_status(str(daemon.socket_path), 5)["metrics"].rsplit(":", 1)
        for opening in (b"", b"GET / HTTP/1.1\r\nX-Big: " + b"x" * 9000):  # silent; an endless head
            idle = [socket.create_connection((host, int(port)), timeout=5) for _ in range(20)]
            try:
                for conn in idle:
                    conn.sendall(opening)
                for _ in range(3):
                    assert scrape(f"{host}:{port}")[("commd_connections", ())] == 0
            finally:
                for conn in idle:
                    conn.close()


def test_a_metrics_request_whose_lines_end_in_a_bare_lf_is_answered(tmp: Path) -> None:
    """RFC 9112 lets a server take a bare LF as a line end (netcat, hand-written scrapers):
    answered at once (before: the daemon waited for CRLF CRLF, then closed after 5 s)."""
    pytest.importorskip("prometheus_client")
    with DaemonProcess(tmp / "run" / "commd.sock", args=["--metrics", "127.0.0.1:0"]) as daemon:
        host, port = query_status(str(daemon.socket_path), 5)["metrics"].rsplit(":", 1)
        with socket.create_connection((host, int(port)), timeout=5) as conn:
            conn.settimeout(3)  # (under the daemon's 5 s wait for a head)
            conn.sendall(b"GET /metrics HTTP/1.0\nHost: x\n\n")
            answer = b""
            while chunk := conn.recv(65536):
                answer += chunk
        assert answer.startswith(b"HTTP/1.1 200 OK\r\n")
        assert b"\ncommd_connections 0.0\n" in answer


def metrics_answer(conn: socket.socket) -> bytes:
    """All a metrics connection sends back until the daemon closes it."""
    answer = b""
    while chunk := conn.recv(65536):
        answer += chunk
    return answer


def reduce_is_right(pool: RankPool, sock: str, tag: str) -> None:
    """Two ranks' all_reduces through the daemon give the right sums."""
    world = world_name(tag)
    outcomes = pool.run(service_workers.reduce_then_wait,
                        [(sock, world, r, 2, 3, 64, False) for r in range(2)], timeout=30)
    assert [o.unwrap() for o in outcomes] == [([1, 3, 5], "done")] * 2


def test_a_post_with_a_body_to_the_metrics_port_gets_its_405(tmp: Path, pool: RankPool) -> None:
    """A client that sends a whole body before it reads (urllib, requests) is told 405, not
    cut off: before, the daemon closed on the unread body and the client saw only EPIPE or
    a reset. The daemon serves its ranks and the next scraper the while."""
    pytest.importorskip("prometheus_client")
    with DaemonProcess(tmp / "run" / "commd.sock", args=["--metrics", "127.0.0.1:0"]) as daemon:
        sock = str(daemon.socket_path)
        address = query_status(sock, 5)["metrics"]
        for size in (10, 4 << 20):
            with pytest.raises(urllib.error.HTTPError) as refused:
                urllib.request.urlopen(urllib.request.Request(f"http://{address}/metrics",
                                                              data=b"x" * size), timeout=5)
            assert refused.value.code == 405 and refused.value.read() == b"GET only\n"
            assert refused.value.headers["Allow"] == "GET"
        reduce_is_right(pool, sock, "post")
        assert scrape(address)[("commd_calls_total", (("op", "all_reduce"), ("outcome", "done")))] == 6


def test_hostile_scrapers_hold_no_slot_for_ever_and_the_ranks_go_on(tmp: Path, pool: RankPool) -> None:
    """A head of many short lines over 8192 bytes is told 431; 16 scrapers that never read
    their answers do not keep a 17th out; one that says nothing is closed after the 5 s
    wait for a head. The ranks' all_reduces are right and the next scrape is answered."""
    pytest.importorskip("prometheus_client")
    with DaemonProcess(tmp / "run" / "commd.sock", args=["--metrics", "127.0.0.1:0"]) as daemon:
        sock = str(daemon.socket_path)
        address = query_status(sock, 5)["metrics"]
        host, port = address.rsplit(":", 1)
        with socket.create_connection((host, int(port)), timeout=10) as lines:
            lines.sendall(b"GET /metrics HTTP/1.1\r\n" + b"X: y\r\n" * 2000 + b"\r\n")
            assert metrics_answer(lines).startswith(b"HTTP/1.1 431 Request Header Fields Too Large\r\n")
        silent = socket.create_connection((host, int(port)), timeout=10)
        deaf = [socket.create_connection((host, int(port)), timeout=10) for _ in range(16)]
        try:
            for conn in deaf:
                conn.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n")
            assert scrape(address)[("commd_connections", ())] == 0
            reduce_is_right(pool, sock, "hostile")
            started = time.monotonic()
            assert metrics_answer(silent) == b""  # closed, unanswered
            assert time.monotonic() - started < 6
        finally:
            silent.close()
            for conn in deaf:
                conn.close()
        assert scrape(address)[("commd_calls_total", (("op", "all_reduce"), ("outcome", "done")))] == 6


def test_metrics_need_the_flag(tmp: Path) -> None:
    with DaemonProcess(tmp / "run" / "commd.sock") as daemon:
        assert query_status(str(daemon.socket_path), 5)["metrics"] is None


def test_metrics_without_prometheus_client_is_a_configuration_error_naming_the_extra(tmp: Path) -> None:
    """prometheus-client is optional (imported only with metrics on): asked for metrics
    where it is not installed, the daemon says which extra to install and exits 2, before
    it takes the socket."""
    shadow = tmp / "without" / "prometheus_client"
    shadow.mkdir(parents=True)
    (shadow / "__init__.py").write_text('raise ImportError("No module named \'prometheus_client\'")\n')
    cmd = [sys.executable, "-m", "commd", "serve", "--config", "", "--socket", str(tmp / "c.sock"),
           "--metrics", "127.0.0.1:0"]
    env = child_env()
    env["PYTHONPATH"] = f"{shadow.parent}{os.pathsep}{env['PYTHONPATH']}"
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=30)
    assert done.returncode == 2, done.stderr
    assert done.stderr == ("commd: configuration error: metrics_listen: needs prometheus-client (pip install "
                           "'commd[metrics]') (metrics_listen = '127.0.0.1:0' from --metrics)\n")
    assert not (tmp / "c.sock").exists()


def test_the_first_client_finds_the_daemon_whole(tmp: Path) -> None:
    """A client connecting the moment the socket appears (as systemd's After= units do)
    finds everything set up: the status names where metrics are served."""
    pytest.importorskip("prometheus_client")
    path = tmp / "run" / "commd.sock"
    proc = subprocess.Popen([sys.executable, "-m", "commd", "serve", "--config", "", "--socket", str(path),
                             "--metrics", "127.0.0.1:0"], env=child_env(), stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 20
        while not path.exists():  # no sleep: the first moment counts
            assert proc.poll() is None and time.monotonic() < deadline
        assert query_status(str(path), 5)["metrics"] is not None
    finally:
        proc.terminate()
        assert proc.wait(20) == 0
