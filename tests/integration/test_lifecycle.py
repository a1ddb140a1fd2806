"""The daemon's life: clean SIGTERM, socket file handling, status, threads sharing a backend."""

from __future__ import annotations

import contextlib
import ctypes
import os
import re
import resource
import shutil
import signal
import socket
import stat
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import proto
from client import DaemonBackend, DaemonShutdown, DaemonUnavailable, MisuseError, hostmem
from commd.launch import DaemonProcess, wait_for_socket
from commd.status import query_status
from proto import ErrorCode
from tests.integration import workers
from tests.integration.harness import RankPool, short_tmpdir, world_name
from tests.integration.rawclient import RawClient

pytestmark = pytest.mark.timeout(60)


def wait_pending(sock: str, world: str, calls: int, timeout: float = 15) -> dict[str, Any]:
    """The status once `world` exists and has `calls` calls pending in the daemon."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            info = query_status(sock, 5, world)
            if info["worlds"][0]["pending_calls"] == calls:
                return info
        except MisuseError:
            pass  # not created yet: the ranks are still starting
        assert time.monotonic() < deadline, f"world {world} never had {calls} pending calls"
        time.sleep(0.05)


@pytest.fixture
def own_daemon() -> Iterator[DaemonProcess]:
    tmp = short_tmpdir()
    proc = DaemonProcess(Path(tmp) / "run" / "commd.sock")
    proc.start()
    try:
        yield proc
    finally:
        proc.kill()
        shutil.rmtree(tmp, ignore_errors=True)


def test_sigterm_fails_pending_calls_removes_socket_exits_zero(pool: RankPool,
                                                                own_daemon: DaemonProcess) -> None:
    sock, world = str(own_daemon.socket_path), world_name()
    started = pool.start(workers.wait_for_command, [(sock, world, r, 2) for r in range(2)])
    wait_pending(sock, world, 2)
    assert own_daemon.stop() == 0
    outcomes = [o.unwrap() for o in pool.collect(started, 20)]
    for name, message in outcomes:
        assert name == "DaemonShutdown" and "shutting down" in message
    assert not os.path.exists(sock)


def test_sighup_stops_the_daemon_as_sigterm_does(pool: RankPool, own_daemon: DaemonProcess) -> None:
    """A hang-up (the terminal of a daemon run by hand closing, `kill -HUP` from someone
    expecting a reload, which commd does not do) is a stop like the others (before: the
    default action killed it mid-flight: exit -1, the socket file left behind, the ranks
    told nothing; and systemd's Restart=on-failure counts a SIGHUP death as clean)."""
    sock, world = str(own_daemon.socket_path), world_name()
    started = pool.start(workers.wait_for_command, [(sock, world, r, 2) for r in range(2)])
    wait_pending(sock, world, 2)
    assert own_daemon.proc is not None
    own_daemon.proc.send_signal(signal.SIGHUP)
    assert own_daemon.proc.wait(20) == 0
    outcomes = [o.unwrap() for o in pool.collect(started, 20)]
    for name, message in outcomes:
        assert name == "DaemonShutdown" and "shutting down" in message
    assert not os.path.exists(sock)


def test_a_stale_socket_file_is_replaced_and_a_live_one_refused() -> None:
    tmp = short_tmpdir()
    path = Path(tmp) / "run" / "commd.sock"
    path.parent.mkdir(mode=0o750)
    stale = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    stale.bind(str(path))
    stale.close()  # the file stays, nobody listens: what a killed daemon leaves behind
    try:
        with DaemonProcess(path) as first:
            assert query_status(str(path), 5)["pid"] == first.pid
            second = subprocess.run([sys.executable, "-m", "commd", "serve", "--socket", str(path)],
                                    capture_output=True, text=True, timeout=30)
            assert second.returncode == 2
            assert "another daemon is listening" in second.stderr
            assert query_status(str(path), 5)["pid"] == first.pid
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def test_waiting_for_a_hung_daemon_keeps_to_a_timeout_under_a_second() -> None:
    """A daemon that accepts and never answers: wait_for_socket(path, 0.2) gives up near
    0.2 s (before: each probe waited 1 s whatever the time left, so DaemonProcess.start(
    timeout=0.2) took over a second against it)."""
    tmp = short_tmpdir()
    try:
        path = Path(tmp) / "hung.sock"
        with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as hung:
            hung.bind(str(path))
            hung.listen()
            started = time.monotonic()
            with pytest.raises(TimeoutError, match=f"no daemon answered at {path} within 0.2s"):
                wait_for_socket(path, 0.2)
            took = time.monotonic() - started
        assert 0.2 <= took < 0.6, took
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _sums_alone(path: Path, prefix: str) -> None:
    """A one-rank world at `path` runs an all_reduce (the daemon there serves calls)."""
    with DaemonBackend(str(path), world_name(prefix), 0, 1, timeout=10) as comm:
        buf = hostmem.alloc(16)
        buf.view(np.float32)[:] = [1, 2, 3, 4]
        comm.all_reduce(buf.ptr, 16)
        assert buf.view(np.float32).tolist() == [1, 2, 3, 4]
        buf.close()


def test_a_daemon_process_started_where_another_daemon_answers_fails_to_start() -> None:
    """DaemonProcess.start waits until a daemon answers at its socket: the daemon already
    there answered, so start returned while its own daemon exited 2 ('another daemon is
    listening'), and the caller's worlds ran on the other daemon. It must wait for its own."""
    tmp = short_tmpdir()
    path = Path(tmp) / "run" / "commd.sock"
    try:
        with DaemonProcess(path) as first:
            second = DaemonProcess(path, log=subprocess.DEVNULL)
            try:
                with pytest.raises(RuntimeError, match=f"exited with code 2 before it was ready "
                                                       rf"\(another daemon, pid {first.pid}, answers at "):
                    second.start(timeout=20)
            finally:
                second.kill()  # (had start returned early, it could take the path once the first left)
            assert second.proc is not None and second.proc.returncode == 2
            assert query_status(str(path), 5)["pid"] == first.pid  # the first serves on
            _sums_alone(path, "after")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


@pytest.mark.parametrize("under", [["timeout", "600"], ["unshare", "--fork"]], ids=["timeout", "unshare"])
def test_a_daemon_process_run_under_a_wrapper_that_forks_starts_and_stops(under: list[str]) -> None:
    """`under` a command that runs the daemon as its child rather than exec it: the daemon's
    status names the child's pid, not the wrapper's. start gave up after its timeout ('no
    daemon answered at PATH', while one did) and left the daemon serving at the path; and
    unshare passes no SIGTERM on, so stopping the wrapper alone would leave it too."""
    tmp = short_tmpdir()
    path = Path(tmp) / "run" / "commd.sock"
    daemon = DaemonProcess(path, under=under, log=subprocess.DEVNULL)
    try:
        daemon.start(timeout=10)
        served_by = query_status(str(path), 5)["pid"]
        assert served_by != daemon.pid
        with open(f"/proc/{served_by}/stat") as stat:
            assert int(stat.read().rsplit(")", 1)[1].split()[1]) == daemon.pid  # the wrapper's child
        _sums_alone(path, "wrapped")
        started = time.monotonic()
        assert daemon.stop(10) == 0
        assert time.monotonic() - started < 5  # (the daemon itself had the SIGTERM, not a wrapper deaf to it)
        assert not os.path.exists(f"/proc/{served_by}")
        with pytest.raises(DaemonUnavailable):
            query_status(str(path), 1)
    finally:
        daemon.kill()
        shutil.rmtree(tmp, ignore_errors=True)


def test_a_daemon_process_under_a_wrapper_that_forks_it_away_stops_that_daemon_and_says_so() -> None:
    """`setsid -f` forks the daemon off and exits 0 at once: start raised 'the daemon exited
    with code 0 before it was ready' (0.3 s in) while the daemon went on serving at the
    path, with no owner to stop it. start now waits for that daemon (one that started
    after the wrapper) to answer, stops it, and says why."""
    tmp = short_tmpdir()
    path = Path(tmp) / "run" / "commd.sock"
    daemon = DaemonProcess(path, under=["setsid", "-f"], log=subprocess.DEVNULL)
    stopped = False
    try:
        with pytest.raises(RuntimeError) as raised:
            daemon.start(timeout=10)
        found = re.fullmatch(r"setsid exited with code 0 before the daemon was ready: it forked the daemon "
                             r"away \(as setsid -f does\), leaving no owner to stop it; run it under a "
                             r"command that execs it or waits for it \(its daemon, pid (\d+), answered at "
                             + re.escape(str(path)) + r", and was stopped\)", str(raised.value))
        assert found is not None, raised.value
        assert not _running(int(found[1]))
        with pytest.raises(DaemonUnavailable):
            query_status(str(path), 1)
        assert not path.exists()  # (stopped with SIGTERM: it removed its socket file)
        stopped = True
    finally:
        daemon.kill()
        if not stopped:  # (a daemon left serving, or about to: ended)
            with contextlib.suppress(TimeoutError, ProcessLookupError):
                os.kill(wait_for_socket(path, 10), signal.SIGKILL)
        shutil.rmtree(tmp, ignore_errors=True)


def _running(pid: int) -> bool:
    """Whether process `pid` exists and has not exited (a zombie, not reaped yet, has)."""
    try:
        with open(f"/proc/{pid}/stat") as stat_file:
            return stat_file.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_another_programs_live_stream_socket_at_the_path_is_left_alone() -> None:
    """A SOCK_STREAM listener (another program's) at the socket path: the probe's connect
    fails (EPROTOTYPE), which is neither 'nobody listens' nor a daemon. The daemon must
    not take it for a stale file and remove a live socket: it refuses to start, saying
    why, and the other program's listener still takes connections."""
    tmp = short_tmpdir()
    path = Path(tmp) / "commd.sock"
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as other:
            other.bind(str(path))
            other.listen(1)
            done = subprocess.run([sys.executable, "-m", "commd", "serve", "--config", "", "--socket",
                                   str(path)], capture_output=True, text=True, timeout=30)
            assert done.returncode == 2, done.stderr
            assert done.stderr == (f"commd: configuration error: socket: cannot probe {path}: [Errno 91] "
                                   f"Protocol wrong type for socket (socket = '{path}' from --socket)\n")
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as client:
                client.connect(str(path))
                accepted, _ = other.accept()
                accepted.sendall(b"still here")
                assert client.recv(64) == b"still here"
                accepted.close()
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


@pytest.mark.parametrize("umask", [0o077, 0o007])
def test_every_directory_the_daemon_makes_for_its_socket_is_0750(umask: int) -> None:
    """Only the socket's own directory was made 0750; those above it took the umask: 0700
    under a umask of 077 (the group's workers could not reach the socket), 0770 under the
    unit's 0007 (a worker could move the socket's directory away and put its own there)."""
    tmp = short_tmpdir()
    top = Path(tmp) / "a"
    before = os.umask(umask)  # (the daemon inherits it)
    try:
        daemon = DaemonProcess(top / "b" / "run" / "commd.sock").start()
    finally:
        os.umask(before)
    try:
        modes = {str(d.relative_to(tmp)): stat.S_IMODE(d.stat().st_mode)
                 for d in (top, top / "b", top / "b" / "run")}
        assert modes == {"a": 0o750, "a/b": 0o750, "a/b/run": 0o750}
        assert stat.S_IMODE((top / "b" / "run" / "commd.sock").stat().st_mode) == 0o660
    finally:
        daemon.stop()
        shutil.rmtree(tmp, ignore_errors=True)


@pytest.mark.parametrize("above", [False, True])
@pytest.mark.parametrize("mode", [0o777, 0o1777, 0o770])
def test_a_socket_directory_every_user_may_write_is_warned_of(mode: int, above: bool) -> None:
    """A directory anyone may write (and no sticky bit, as /tmp has) lets any user put a
    socket of their own where workers connect: the daemon serves, but says so (before: not a
    word). With the sticky bit, or shut to others, nothing is said. `above`: the open
    directory is the one above the socket's (0750, made by hand, or by the daemon): anyone
    may move the socket's directory away and put theirs in its place. Before, that was
    warned of only when the daemon made the socket's directory (the check looked at the
    last directory that was there, naming it 'its directory'), never when it was there."""
    tmp = short_tmpdir()
    run = Path(tmp) / "run"
    run.mkdir()
    run.chmod(mode)  # (past the umask)
    sockets = [run / "sub" / "commd.sock", run / "made" / "commd.sock"] if above else [run / "commd.sock"]
    if above:
        sockets[0].parent.mkdir(mode=0o750)
    try:
        for path in sockets:
            logged = Path(tmp) / "daemon.log"
            with open(logged, "wb") as log, DaemonProcess(path, log=log) as daemon:
                assert query_status(str(daemon.socket_path), 5)["pid"] == daemon.pid
            said = logged.read_text()
            named = f"{run}, above its directory {path.parent}," if above else f"its directory {run}"
            warned = [line for line in said.splitlines() if "is writable by every user" in line]
            assert len(warned) == (mode == 0o777), said
            assert all(f"socket: {named} is writable by every user" in line for line in warned), said
            assert "Traceback" not in said
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def test_a_stopping_daemon_leaves_the_socket_file_of_the_daemon_that_replaced_it() -> None:
    """A daemon whose socket file was removed (by hand, by a cleaner of old files) and bound
    again by a second daemon removed the second's file as it stopped: the second, still
    serving, could no longer be reached (status: 'No such file or directory')."""
    tmp = short_tmpdir()
    path = Path(tmp) / "run" / "commd.sock"
    try:
        with DaemonProcess(path) as first:
            path.unlink()
            with DaemonProcess(path) as second:
                assert first.stop() == 0
                assert query_status(str(path), 5)["pid"] == second.pid
            assert not path.exists()  # its own file, the second removes
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _bound_by_file_modes() -> None:
    """(In the child, before exec.) Root keeps no capability that overrides file modes, so a
    directory's mode refuses it as it would the service's user (PR_CAPBSET_DROP: exec leaves
    root only what the bounding set holds)."""
    if os.geteuid() == 0:
        libc = ctypes.CDLL(None, use_errno=True)
        for cap in (1, 2, 3):  # CAP_DAC_OVERRIDE, CAP_DAC_READ_SEARCH, CAP_FOWNER
            if libc.prctl(24, cap, 0, 0, 0) != 0:
                raise OSError(ctypes.get_errno(), "prctl(PR_CAPBSET_DROP)")


def test_a_stale_socket_the_daemon_may_not_remove_is_a_configuration_error() -> None:
    """A stale socket file in a directory the daemon may not write (a daemon run as another
    user left it there) stopped start-up with a PermissionError traceback, exit 1."""
    tmp = short_tmpdir()
    path = Path(tmp) / "run" / "commd.sock"
    path.parent.mkdir(mode=0o750)
    stale = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    stale.bind(str(path))
    stale.close()
    path.parent.chmod(0o550)
    try:
        done = subprocess.run([sys.executable, "-m", "commd", "serve", "--config", "", "--socket", str(path)],
                              capture_output=True, text=True, timeout=30, preexec_fn=_bound_by_file_modes)
    except subprocess.SubprocessError as exc:
        pytest.skip(f"cannot give up the capabilities that override file modes: {exc}")
    finally:
        path.parent.chmod(0o750)
        left = path.exists()
        shutil.rmtree(tmp, ignore_errors=True)
    assert done.returncode == 2, done.stderr
    assert done.stderr == (f"commd: configuration error: socket: cannot remove the stale socket file {path} "
                           "(no daemon listens there): Permission denied "
                           f"(socket = '{path}' from --socket)\n")
    assert left


def test_a_stopped_daemon_whose_backlog_is_full_is_not_taken_for_a_stale_socket() -> None:
    """A second `commd serve` on the socket of a daemon that is stopped, its listen backlog
    full, says another daemon is there and exits (before: its probe's connect waited for
    good, and start-up with it, without a word)."""
    tmp = short_tmpdir()
    path = Path(tmp) / "run" / "commd.sock"
    waiting: list[socket.socket] = []
    try:
        with DaemonProcess(path) as first:
            os.kill(first.pid, signal.SIGSTOP)
            try:
                while True:  # fill its backlog
                    client = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_NONBLOCK)
                    try:
                        client.connect(str(path))
                    except BlockingIOError:
                        client.close()
                        break
                    waiting.append(client)
                second = subprocess.run([sys.executable, "-m", "commd", "serve", "--socket", str(path)],
                                        capture_output=True, text=True, timeout=30)
            finally:
                os.kill(first.pid, signal.SIGCONT)
            assert second.returncode == 2, second.stderr
            assert "another daemon is listening" in second.stderr and "backlog is full" in second.stderr
            for client in waiting:
                client.close()
            assert query_status(str(path), 5)["pid"] == first.pid
    finally:
        for client in waiting:
            client.close()
        shutil.rmtree(tmp, ignore_errors=True)


def test_status_reports_worlds_and_refuses_unknown_ones(pool: RankPool,
                                                        own_daemon: DaemonProcess) -> None:
    sock, world = str(own_daemon.socket_path), world_name()
    started = pool.start(workers.wait_for_command, [(sock, world, r, 2) for r in range(2)])
    info = wait_pending(sock, world, 2)
    (w,) = info["worlds"]
    assert (w["state"], w["epoch"], w["ranks"], w["world_size"]) == ("ready", 1, [0, 1], 2)
    assert info["engine"] == "host" and info["connections"] == 3  # two ranks and this query
    assert info["engine_detail"] == f"host ({min(8, os.cpu_count() or 1)} threads)"
    with pytest.raises(MisuseError, match="no world named"):
        query_status(sock, 5, "no-such-world")
    text = subprocess.run([sys.executable, "-m", "commd", "status", "--socket", sock,
                           "--world", world], capture_output=True, text=True, timeout=30)
    assert text.returncode == 0 and world in text.stdout and "ready" in text.stdout
    assert f"engine={info['engine_detail']}" in text.stdout
    assert own_daemon.stop() == 0  # ends the waiting calls
    assert all(o.unwrap()[0] == "DaemonShutdown" for o in pool.collect(started, 20))


def test_status_of_a_daemon_that_does_not_answer_says_which_and_how_long(own_daemon: DaemonProcess) -> None:
    """A stopped (or wedged) daemon's `commd status` said 'CommTimeout: the call did not
    complete before its deadline': no daemon, no wait named, in a liveness probe's log."""
    sock = str(own_daemon.socket_path)
    os.kill(own_daemon.pid, signal.SIGSTOP)
    try:
        started = time.monotonic()
        done = subprocess.run([sys.executable, "-m", "commd", "status", "--socket", sock, "--timeout", "1"],
                              capture_output=True, text=True, timeout=30)
        waited = time.monotonic() - started
    finally:
        os.kill(own_daemon.pid, signal.SIGCONT)
    assert done.returncode == 1 and waited < 10
    assert done.stderr == f"commd: CommTimeout: the daemon at {sock} did not answer within 1s\n"
    assert query_status(sock, 5)["pid"] == own_daemon.pid


def test_threads_share_one_backend(pool: RankPool, sock: str) -> None:
    world = world_name()
    _, rank1 = [o.unwrap() for o in pool.run(workers.threads_share_a_backend,
                                                 [(sock, world, r, 2, 25) for r in range(2)])]
    assert rank1["errors"] == []
    assert rank1["command"] == 0xC0FFEE
    assert len(rank1["handles"]) == 100 and len(set(rank1["handles"])) == 100


def test_no_daemon_is_a_typed_error() -> None:
    from client import DaemonBackend

    with pytest.raises(DaemonUnavailable, match="cannot connect"):
        DaemonBackend("/tmp/commd-nowhere/none.sock", "w", 0, 1, timeout=1)


def test_workers_survive_a_daemon_restart(pool: RankPool, own_daemon: DaemonProcess) -> None:
    """kill -9 the daemon; a new one takes the socket; every rank's attempt_reconnect
    finds it, rejoins past the old epoch, and the same buffers work again."""
    from tests.integration.data import make_input, reduce_reference

    sock, world = str(own_daemon.socket_path), world_name()
    started = pool.start(workers.survive_restart, [(sock, world, r, 2, 4) for r in range(2)])
    wait_pending(sock, world, 0)  # both joined; calls done
    time.sleep(0.5)
    own_daemon.proc.kill()  # type: ignore[union-attr]
    own_daemon.proc.wait(10)  # type: ignore[union-attr]
    time.sleep(0.5)  # the ranks see it gone and start retrying
    own_daemon.start()
    outcomes = [o.unwrap() for o in pool.collect(started, 60)]
    want = reduce_reference([make_input(4, r, 256, "f32", "sum") for r in range(2)], "f32", "sum")
    for res in outcomes:
        assert res["before"] == 1 and res["after"] == 2
        assert res["result"] == want.tobytes()
        assert res["symmetric"] == bytes([2]) * 4


def cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as stat:
        fields = stat.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def test_worlds_with_a_tiny_call_timeout_do_not_keep_the_daemon_busy(own_daemon: DaemonProcess) -> None:
    """Each world's watchdog checks its calls' deadlines: at timeout/4 it would wake 4000
    times a second for a hello's timeout_ms=1 (before: 40 such idle worlds kept the daemon
    at ~1 CPU-second per second, slowing every other world on its one loop)."""
    sock = str(own_daemon.socket_path)
    idle: list[RawClient] = []
    try:
        for _ in range(40):
            raw = RawClient(sock)
            idle.append(raw)
            assert isinstance(raw.join(world_name(), timeout_ms=1), proto.Welcome)
        before = cpu_seconds(own_daemon.pid)
        time.sleep(1.0)
        busy = cpu_seconds(own_daemon.pid) - before
    finally:
        for raw in idle:
            raw.close()
    assert busy < 0.4, f"the daemon spent {busy:.2f} CPU-seconds in one second with nothing to do"


def test_sigterm_does_not_reset_a_client_whose_requests_are_unread(own_daemon: DaemonProcess) -> None:
    """A client with requests the daemon has not read when it stops (threads sharing a
    backend, posted Forgets) still reads the shutdown error of its pending call and the
    shutdown event (before: closing with its packets unread reset the client's socket,
    which lost both: ECONNRESET, DaemonUnavailable instead of DaemonShutdown)."""
    sock, world = str(own_daemon.socket_path), world_name()
    with RawClient(sock) as a, RawClient(sock) as b:
        a.send(proto.Hello(1, proto.PROTOCOL_VERSION, os.getpid(), world, 0, 2, 60_000))
        b.send(proto.Hello(1, proto.PROTOCOL_VERSION, os.getpid(), world, 1, 2, 60_000))
        assert isinstance(a.recv(), proto.Welcome) and isinstance(b.recv(), proto.Welcome)
        a.send(proto.Submit(2, (proto.Barrier(),)))  # rank 1 never calls it: pending
        wait_pending(sock, world, 1)
        os.kill(own_daemon.pid, signal.SIGSTOP)
        for i in range(50):
            a.send(proto.StatusQuery(100 + i))  # unread when the daemon stops
        os.kill(own_daemon.pid, signal.SIGTERM)
        os.kill(own_daemon.pid, signal.SIGCONT)
        assert own_daemon.proc is not None and own_daemon.proc.wait(20) == 0
        seen = []
        while (msg := a.recv()) is not None:
            seen.append(msg)
    assert any(isinstance(m, proto.Error) and m.id == 2 and m.code is ErrorCode.SHUTDOWN for m in seen), seen
    assert any(isinstance(m, proto.Event) and m.code is ErrorCode.SHUTDOWN for m in seen), seen


def test_idle_ranks_hear_the_shutdown_not_each_others_departure(own_daemon: DaemonProcess) -> None:
    """The daemon stops with a world idle: every rank hears SHUTDOWN, and its next call is
    DaemonShutdown. Before, the first connection the daemon closed failed the world under
    the others, who heard "rank 0's connection was lost" (a WorldFailed) instead of why."""
    sock, world = str(own_daemon.socket_path), world_name()
    size = 3
    raws = [RawClient(sock) for _ in range(size)]
    try:
        for rank, raw in enumerate(raws):
            raw.send(proto.Hello(1, proto.PROTOCOL_VERSION, os.getpid(), world, rank, size, 60_000))
        assert all(isinstance(raw.recv(), proto.Welcome) for raw in raws)
        assert own_daemon.stop() == 0
        for rank, raw in enumerate(raws):
            events = []
            while (msg := raw.recv()) is not None:
                events.append(msg)
            assert events and all(isinstance(m, proto.Event) and m.code is ErrorCode.SHUTDOWN
                                  for m in events), (rank, events)
    finally:
        for raw in raws:
            raw.close()


def test_sigterm_again_and_again_still_exits_zero(pool: RankPool, own_daemon: DaemonProcess) -> None:
    """A service manager or an impatient user signalling again while the daemon stops:
    the stop under way goes on, to its end (before: a signal after the handlers were
    removed, in the last teardown, killed it: exit -15)."""
    sock, world = str(own_daemon.socket_path), world_name()
    started = pool.start(workers.wait_for_command, [(sock, world, r, 2) for r in range(2)])
    wait_pending(sock, world, 2)
    assert own_daemon.proc is not None
    while own_daemon.proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):  # (exited between poll and kill)
            os.kill(own_daemon.pid, signal.SIGTERM)
        time.sleep(0.0005)
    assert own_daemon.proc.returncode == 0
    outcomes = [o.unwrap() for o in pool.collect(started, 20)]
    assert [name for name, _ in outcomes] == ["DaemonShutdown"] * 2
    assert not os.path.exists(sock)


def test_a_call_after_the_daemon_stopped_says_it_stopped(own_daemon: DaemonProcess) -> None:
    """The daemon's shutdown event waits unread when the next call meets the closed
    socket: that call is DaemonShutdown, not a bare broken pipe."""
    comm = DaemonBackend(str(own_daemon.socket_path), world_name(), 0, 1, timeout=10)
    try:
        comm.barrier()
        assert own_daemon.stop() == 0
        with pytest.raises(DaemonShutdown, match="shutting down"):
            comm.barrier()
    finally:
        comm.close()


def test_a_daemon_started_under_a_low_soft_fd_limit_takes_the_hard_one() -> None:
    """Each buffer the daemon maps holds an fd: started from a shell whose soft limit is low
    (64 here; 1024 is common), the daemon raises it to the hard limit, and a worker's 100
    buffers map (before: the imports past the limit were refused, LimitExceeded "cannot map host
    memory: [Errno 24] Too many open files")."""
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < 1024:
        pytest.skip(f"the hard limit here is {hard}")
    tmp = short_tmpdir()
    # Only the daemon's process gets the low limit (a wrapper sets it, then execs the daemon):
    # set here, in the test's process, it refused the test's own next pipe wherever the
    # tests before it in this worker left more than 64 fds open (seen with --dist worksteal).
    low_limit = [sys.executable, "-c", "import os, resource, sys; resource.setrlimit(resource.RLIMIT_NOFILE, "
                 f"(64, {hard})); os.execv(sys.argv[1], sys.argv[1:])"]
    daemon = DaemonProcess(Path(tmp) / "commd.sock", under=low_limit).start()
    try:
        with open(f"/proc/{daemon.pid}/limits") as limits:
            line = next(line for line in limits if line.startswith("Max open files"))
        assert line.split()[3:5] == [str(hard)] * 2, line
        with DaemonBackend(str(daemon.socket_path), world_name(), 0, 1, timeout=10) as comm:
            bufs = [hostmem.alloc(8) for _ in range(100)]
            for i, buf in enumerate(bufs):
                buf.view(np.int32)[:] = [i, -i]
                comm.all_reduce(buf.ptr, 8, dtype="i32")
            assert [buf.view(np.int32).tolist() for buf in bufs] == [[i, -i] for i in range(100)]
    finally:
        daemon.stop()
        shutil.rmtree(tmp, ignore_errors=True)


@pytest.mark.parametrize(("under", "args"), [(["true"], ()), (["setsid", "-f"], ("--no-such-option",))],
                         ids=["runs_none", "its_daemon_exits"])
def test_a_daemon_process_under_a_wrapper_that_leaves_no_daemon_says_so_at_once(
        under: list[str], args: tuple[str, ...]) -> None:
    """A wrapper that exits 0 having run no daemon (`true`), or whose forked-away daemon
    exits (refusing its arguments): start waited its whole timeout (10 s) for a daemon to
    answer at the path; no process started since names the path any more, so none will:
    it now raises at once."""
    tmp = short_tmpdir()
    path = Path(tmp) / "run" / "commd.sock"
    daemon = DaemonProcess(path, under=under, args=args, log=subprocess.DEVNULL)
    try:
        started = time.monotonic()
        with pytest.raises(RuntimeError, match=rf"{under[0]} exited with code 0 before the daemon was "
                           rf"ready: .* \(no process started since names {re.escape(str(path))} any "
                           r"more: no daemon of it will answer there\)"):
            daemon.start(timeout=10)
        assert time.monotonic() - started < 5
        assert not path.exists()
    finally:
        daemon.kill()
        shutil.rmtree(tmp, ignore_errors=True)
