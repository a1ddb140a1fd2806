"""A worker that forks (a data loader, a subprocess helper) hands its child a copy of the
backend and of its socket. The child's calls would go out on the parent's connection, as
the parent's rank, its close() would shut that connection down, and a child that touches
nothing would keep it open after the parent died. So the child lets go of its copies at
the fork: every call there is a MisuseError, and the parent's world goes on as if nothing
happened."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from client import CommError, DaemonBackend, WorldFailed, hostmem
from client import transport as transport_module
from client.transport import Transport
from commd.launch import DaemonProcess
from tests.conftest import held_elsewhere
from tests.fault.ranks import joined, own_daemon, restart_daemon, summed
from tests.integration.harness import wait_until, world_name, world_status

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def daemon() -> Iterator[DaemonProcess]:
    yield from own_daemon()


def in_child(calls: dict[str, Callable[[], object]]) -> dict[str, list[str]]:
    """Fork; the child runs each call on its only thread, each within 3 s (SIGALRM: a call
    that waits for a lock no thread of the child will release), and reports how it ended."""
    read_end, write_end = os.pipe()
    child = os.fork()
    if child == 0:  # (reports through the pipe and leaves without Python's exit)
        seen: dict[str, list[str]] = {}
        try:
            os.close(read_end)

            def hung(*_: object) -> None:
                raise TimeoutError("still waiting after 3 s")

            signal.signal(signal.SIGALRM, hung)
            for name, call in calls.items():
                signal.setitimer(signal.ITIMER_REAL, 3)
                try:
                    seen[name] = ["returned", repr(call())]
                except BaseException as exc:
                    seen[name] = [type(exc).__name__, str(exc)]
                finally:
                    signal.setitimer(signal.ITIMER_REAL, 0)
        finally:
            os.write(write_end, json.dumps(seen).encode())
            os._exit(0)
    os.close(write_end)
    with os.fdopen(read_end) as pipe:
        seen = json.loads(pipe.read())
    assert os.waitpid(child, 0)[1] == 0
    return seen


def test_a_forked_childs_calls_and_close_leave_the_parents_world_be(daemon: DaemonProcess) -> None:
    bufs = [hostmem.alloc(64), hostmem.alloc(64)]
    with joined(daemon, 5) as comms:
        assert summed(comms, bufs) == [[3, 30], [3, 30]]
        seen = in_child({"all_reduce": lambda: comms[0].all_reduce(bufs[0].ptr, 8, dtype="i32"),
                         "is_healthy": comms[0].is_healthy,
                         "close": lambda: [comm.close() for comm in comms]})
        assert seen["all_reduce"] == [
            "MisuseError", f"this DaemonBackend belongs to process {os.getpid()}; a forked child "
            "must make its own"]
        assert seen["is_healthy"] == ["returned", "False"]
        assert seen["close"] == ["returned", "[None, None]"]
        # the parent's ranks: still connected, still one world, results still right
        assert [comm.is_healthy() for comm in comms] == [True, True]
        assert summed(comms, bufs) == [[3, 30], [3, 30]]
        assert [comm.epoch for comm in comms] == [1, 1]


def test_every_call_in_a_child_is_refused_at_once_whatever_the_parent_held(
        daemon: DaemonProcess) -> None:
    """A thread of the parent held the backend's lock as it forked (a reader in on_event,
    any call's bookkeeping): in the child that lock is held for good, and the world had
    failed as far as the parent knew; each call there is refused before it could wait
    for the lock, or raise the parent's failure, or change the child's copy of the state."""
    bufs = [hostmem.alloc(64), hostmem.alloc(64)]
    with joined(daemon, 5) as comms:
        comm = comms[0]
        handle = comm.register_buffer(bufs[0].ptr, 64)
        sym = comm.symmetric_alloc(64)
        spare = hostmem.alloc(64)  # (closed in the child: the backend hears of the release)
        for r, buf in enumerate(bufs):
            buf.view(np.int32)[:2] = [r + 1, 10 * (r + 1)]
        comm.group_start()
        comm.all_reduce(bufs[0].ptr, 8, dtype="i32")  # (an open group, carried into the child)
        with held_elsewhere(comm._lock):  # (a reader in on_event, any call's bookkeeping)
            comm._health._failure = WorldFailed("as the parent recorded it")  # (under it)
            seen = in_child({
                "all_reduce": lambda: comm.all_reduce(bufs[0].ptr, 8, dtype="i32"),
                "group_end": comm.group_end,
                "register_buffer": lambda: comm.register_buffer(bufs[0].ptr, 8),
                "deregister_buffer": lambda: comm.deregister_buffer(handle),
                "symmetric_alloc": lambda: comm.symmetric_alloc(64),
                "symmetric_free": lambda: comm.symmetric_free(sym),
                "set_add_kernel": lambda: comm.set_add_kernel(0),
                "attempt_reconnect": comm.attempt_reconnect,
                "a host buffer freed": spare.close,
                "symmetric buffer still mapped": lambda: sym in comm._symmetric._host,
                "is_healthy": comm.is_healthy,
                "close": comm.close,
            })
        comm._health._failure = None
        # the parent's rank: its group goes out (rank 1 meets it), and all still works
        with ThreadPoolExecutor(1) as rank1:  # (a group is the thread's that opened it: this one)
            meets = rank1.submit(comms[1].all_reduce, bufs[1].ptr, 8, dtype="i32")
            comm.group_end()
            meets.result(10)
        assert [buf.view(np.int32)[:2].tolist() for buf in bufs] == [[3, 30], [3, 30]]
        refused = {name: kind for name, (kind, _) in seen.items()}
        assert refused == {
            "all_reduce": "MisuseError", "group_end": "MisuseError", "register_buffer": "MisuseError",
            "deregister_buffer": "MisuseError", "symmetric_alloc": "MisuseError",
            "symmetric_free": "MisuseError", "set_add_kernel": "MisuseError",
            "attempt_reconnect": "MisuseError", "a host buffer freed": "returned",
            "symmetric buffer still mapped": "returned", "is_healthy": "returned", "close": "returned"}
        assert seen["symmetric buffer still mapped"][1] == "True"
        assert seen["is_healthy"][1] == "False"
        assert summed(comms, bufs) == [[3, 30], [3, 30]]
        comm.symmetric_free(sym)
        comm.deregister_buffer(handle)


_RANK0 = textwrap.dedent("""
    import os, sys, time
    from client import DaemonBackend
    comm = DaemonBackend(sys.argv[1], sys.argv[2], 0, 2, timeout=4)
    child = os.fork() if sys.argv[3] == "fork" else 0
    if child == 0 and sys.argv[3] == "fork":  # a data loader's worker: never touches the backend
        time.sleep(60)
        os._exit(0)
    print(child, flush=True)
    time.sleep(60)
""")


def a_killed_rank0_is_seen_gone(daemon: DaemonProcess, script: str, *args: str,
                                 when_waiting: bool = False) -> int:
    """Rank 0 runs `script` (socket, world, *args) in a process of its own, which prints its
    forked child's pid (0: none); rank 1 joins (`when_waiting`: once rank 0 waits in its
    hello). Then kill -9 rank 0: the daemon must see its connection go at once (a child
    that held a copy would keep it open), so rank 1's next call fails at once, not after its
    4 s timeout. Returns the child's pid (killed too)."""
    world = world_name()
    rank0 = subprocess.Popen([sys.executable, "-c", script, str(daemon.socket_path), world, *args],
                             stdout=subprocess.PIPE, text=True)
    child = 0
    try:
        if when_waiting:
            wait_until(lambda: (world_status(daemon, world) or {}).get("waiting") == [0],
                       "rank 0 waiting in its hello", timeout=10)
            time.sleep(0.5)  # (rank 0 forks meanwhile)
        with DaemonBackend(str(daemon.socket_path), world, 1, 2, timeout=4) as comm:
            assert rank0.stdout is not None
            child = int(rank0.stdout.readline())
            rank0.send_signal(signal.SIGKILL)
            rank0.wait(10)
            started = time.monotonic()
            with pytest.raises(WorldFailed, match="rank 0's connection was lost"):
                comm.barrier()
            assert time.monotonic() - started < 3
        return child
    finally:
        rank0.kill()
        rank0.wait(10)
        if child:
            os.kill(child, signal.SIGKILL)


@pytest.mark.parametrize("fork", ["no fork", "fork"])
def test_a_killed_rank_whose_forked_child_lives_on_is_seen_gone(daemon: DaemonProcess, fork: str) -> None:
    child = a_killed_rank0_is_seen_gone(daemon, _RANK0, fork.replace(" ", ""))
    assert (child != 0) == (fork == "fork")


def test_a_backend_made_in_the_child_works(daemon: DaemonProcess) -> None:
    """What the child should do instead: its own backend, its own rank of its own world."""
    bufs = [hostmem.alloc(64), hostmem.alloc(64)]
    with joined(daemon, 5) as comms:
        sock = str(daemon.socket_path)
        world = world_name()

        def own_world() -> str:
            with DaemonBackend(sock, world, 0, 1, timeout=5) as own:
                buf = hostmem.alloc(8)
                buf.view("i4")[:2] = [7, 8]
                own.all_reduce(buf.ptr, 8, dtype="i32")
                return str(buf.view("i4")[:2].tolist())

        assert in_child({"own world": own_world}) == {"own world": ["returned", "'[7, 8]'"]}
        assert summed(comms, bufs) == [[3, 30], [3, 30]]


def test_calls_after_close_are_refused_before_they_touch_anything(daemon: DaemonProcess) -> None:
    """The same first check serves a closed backend: the calls that keep local state
    (registrations, symmetric memory, the add kernel, groups) refuse before changing it."""
    with joined(daemon, 5) as comms:
        comm = comms[0]
        comm.group_start()
        comm.close()
        for call in (lambda: comm.deregister_buffer(1), lambda: comm.symmetric_free(4096),
                     lambda: comm.symmetric_alloc(64), lambda: comm.set_add_kernel(0), comm.group_end):
            with pytest.raises(CommError, match="the backend is closed"):
                call()
        assert comm._add_kernel.handle is None


# Rank 0's backend is made on a thread (as a trainer may, while its main thread starts a
# data loader's workers): the main thread forks while that constructor waits for rank 1.
_FORK_IN_THE_HELLO = textwrap.dedent("""
    import os, sys, threading, time
    from client import DaemonBackend
    made = {}
    maker = threading.Thread(target=lambda: made.update(
        comm=DaemonBackend(sys.argv[1], sys.argv[2], 0, 2, timeout=4)))
    maker.start()
    time.sleep(0.5)  # the hello is out: the constructor waits for rank 1
    child = os.fork()
    if child == 0:
        time.sleep(60)
        os._exit(0)
    maker.join()
    print(child, flush=True)
    time.sleep(60)
""")


def test_a_fork_while_a_backend_says_hello_leaves_the_child_no_copy(daemon: DaemonProcess) -> None:
    assert a_killed_rank0_is_seen_gone(daemon, _FORK_IN_THE_HELLO, when_waiting=True) != 0


def test_a_fork_between_a_rejoins_hello_and_its_use_leaves_the_child_no_copy(
        daemon: DaemonProcess, monkeypatch: pytest.MonkeyPatch) -> None:
    """A rejoin's new connection is the backend's `_joining` during its hello and its
    `_transport` after; a fork in between (held open here) must find it closed too."""
    with joined(daemon, 5) as comms:
        restart_daemon(daemon, comms)
        join = comms[0]._conn._join
        made: list[Any] = []
        between = threading.Event()

        def join_then_hold(deadline: float) -> Any:
            joined_now = join(deadline)
            made.append(joined_now[0])
            between.set()
            time.sleep(1.0)
            return joined_now

        monkeypatch.setattr(comms[0]._conn, "_join", join_then_hold)
        with ThreadPoolExecutor(2) as ranks:
            rebuilt = [ranks.submit(comm.attempt_reconnect) for comm in comms]
            assert between.wait(10)
            seen = in_child({"the new connection's fd": lambda: made[0]._sock.fileno()})
            for done in rebuilt:
                done.result(20)
        assert seen == {"the new connection's fd": ["returned", "-1"]}
        assert summed(comms, [hostmem.alloc(8), hostmem.alloc(8)]) == [[3, 30], [3, 30]]


def test_a_fork_while_a_socket_is_made_waits_until_the_child_can_close_it(
        daemon: DaemonProcess, monkeypatch: pytest.MonkeyPatch) -> None:
    """A thread makes a transport's socket, slowly (held here); a fork meanwhile waits until
    the socket is one the child knows of, and the child closes its copy (without the wait,
    the child held an unknown copy of what became the parent's connection)."""
    made: list[socket.socket] = []
    made_one = threading.Event()
    real_socket = socket.socket

    def slow_socket(*args: Any) -> socket.socket:
        sock = real_socket(*args)
        made.append(sock)
        made_one.set()
        time.sleep(0.5)  # (the fork comes now)
        return sock

    monkeypatch.setattr(transport_module.socket, "socket", slow_socket)
    with ThreadPoolExecutor(1) as maker:
        making = maker.submit(Transport, str(daemon.socket_path), 5, lambda event, transport: None)
        assert made_one.wait(5)
        monkeypatch.undo()  # (the child's own sockets are plain)
        seen = in_child({"the socket's fd": lambda: made[0].fileno()})
        making.result(10).close()
    assert seen == {"the socket's fd": ["returned", "-1"]}


def test_a_fork_while_a_thread_holds_the_host_table_leaves_the_child_a_usable_table() -> None:
    """A thread held the host table's lock as the process forked (every call locates its
    pointers there): the fork waits for it, so the child can allocate, close and drop
    host buffers (before: each of them hung on a lock no thread of the child held)."""
    memory = hostmem.HostMemory()
    inherited = [memory.alloc(64), memory.alloc(64)]
    held, release = threading.Event(), threading.Event()

    def hold_the_table() -> None:
        with memory._lock:
            held.set()
            time.sleep(0.3)  # (the fork comes now, and waits)
        release.wait(10)

    def drop_an_inherited_buffer() -> None:
        inherited.pop()  # (its last reference: the finalizer runs here)

    holder = threading.Thread(target=hold_the_table)
    holder.start()
    try:
        assert held.wait(5)
        seen = in_child({"alloc": lambda: memory.alloc(8).nbytes,
                         "close an inherited buffer": inherited[0].close,
                         "drop an inherited buffer": drop_an_inherited_buffer})
    finally:
        release.set()
        holder.join(10)
    assert seen == {"alloc": ["returned", "8"], "close an inherited buffer": ["returned", "None"],
                    "drop an inherited buffer": ["returned", "None"]}


def in_a_process(script: str, timeout: float = 15) -> str:
    """What `script` printed, run by a fresh interpreter (its own default table, its own
    threads), or HUNG if it did not finish."""
    try:
        done = subprocess.run([sys.executable, "-c", textwrap.dedent(script)], capture_output=True,
                              text=True, timeout=timeout, cwd=Path(__file__).parents[2])
    except subprocess.TimeoutExpired:
        return "HUNG"
    return done.stdout + done.stderr


def test_a_fork_never_waits_for_a_table_whose_holder_waits_for_another() -> None:
    """Two tables. A thread holds the second's lock, and a collection there frees a buffer
    of the first, whose finalizer waits for the first's lock. Before: the fork took the
    tables' locks in turn and held the first while it waited for the second; the process
    hung inside os.fork()."""
    out = in_a_process("""
        import gc, os, threading, time
        from client import hostmem
        second = hostmem.HostMemory()
        first = hostmem.default_memory()
        gc.disable()
        buf = first.alloc(64)
        cycle = [buf]; cycle.append(cycle); del buf, cycle  # freed by the next collection
        holding = threading.Event()
        def collect_under_the_second():
            with second._lock:
                holding.set()
                time.sleep(0.3)  # (the fork comes now)
                gc.collect()
        threading.Thread(target=collect_under_the_second, daemon=True).start()
        holding.wait(5)
        child = os.fork()
        if child == 0:
            os._exit(0)
        os.waitpid(child, 0)
        print("FORKED")
    """)
    assert out.strip() == "FORKED"


def test_a_fork_interrupted_while_a_thread_holds_a_table_leaves_every_table_usable() -> None:
    """Ctrl-C while a thread holds a table's lock and the main thread forks. Before: the fork
    waited for it, the interrupt was only printed, and the hook released a lock it had not
    taken (RuntimeError) before those it had: another thread's alloc then hung."""
    out = in_a_process("""
        import os, signal, threading
        from client import hostmem
        second = hostmem.HostMemory()
        first = hostmem.default_memory()
        holding, release = threading.Event(), threading.Event()
        def hold():
            with second._lock:
                holding.set(); release.wait(10)
        threading.Thread(target=hold, daemon=True).start(); holding.wait(5)
        threading.Timer(0.3, signal.pthread_kill, (threading.main_thread().ident, signal.SIGINT)).start()
        try:
            child = os.fork()
        except KeyboardInterrupt:
            child = -1
        if child == 0:
            os._exit(0)
        if child > 0:
            os.waitpid(child, 0)
        try:
            threading.Event().wait(1)  # (the interrupt, should it come after the fork)
        except KeyboardInterrupt:
            pass
        release.set()
        got = []
        worker = threading.Thread(target=lambda: got.append(first.alloc(8)), daemon=True)
        worker.start(); worker.join(3)
        print("ALLOCATED" if got else "ALLOC HUNG")
        os._exit(0)
    """)
    assert "ALLOCATED" in out


# (the scripts' end: how their fork's child ended, or CHILD HUNG after 10 s)
_CHILD_OUTCOME = textwrap.dedent("""
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and not os.waitpid(child, os.WNOHANG)[0]:
        time.sleep(0.05)
    else:
        if time.monotonic() >= deadline:
            os.kill(child, 9); os.waitpid(child, 0); print("CHILD HUNG")
    os._exit(0)
""")


def test_a_collection_in_the_childs_fork_hooks_never_waits_for_a_parent_threads_table() -> None:
    """A thread holds the table's lock at the fork, and a collection is due within a few
    allocations: in the child it would come in the at-fork hooks that run before the
    tables get fresh locks, and a dropped buffer's finalizer would wait for the old one
    (before: the child hung). No collection runs until the locks are fresh."""
    out = in_a_process(textwrap.dedent("""
        import gc, os, threading, time
        from client import hostmem
        table = hostmem.default_memory()
        buf = table.alloc(64)
        cycle = [buf]; cycle.append(cycle); del buf, cycle  # garbage for the next collection
        holding = threading.Event()
        def hold():
            with table._lock:
                holding.set(); time.sleep(30)
        threading.Thread(target=hold, daemon=True).start(); holding.wait(5)
        keep = []
        while gc.get_count()[0] < gc.get_threshold()[0] - 5:
            keep.append([])
        child = os.fork()
        if child == 0:
            os.write(1, b"CHILD OK\\n"); os._exit(0)
    """) + _CHILD_OUTCOME)
    assert out.strip() == "CHILD OK"


def test_the_child_can_close_a_buffer_a_parent_thread_was_closing_at_the_fork() -> None:
    out = in_a_process(textwrap.dedent("""
        import os, threading, time
        from client import hostmem
        buf = hostmem.default_memory().alloc(64)
        holding = threading.Event()
        def closing():  # (a close() under way: it holds the buffer's own lock)
            with buf._closing:
                holding.set(); time.sleep(30)
        threading.Thread(target=closing, daemon=True).start(); holding.wait(5)
        child = os.fork()
        if child == 0:
            buf.close(); os.write(1, b"CHILD OK\\n"); os._exit(0)
    """) + _CHILD_OUTCOME)
    assert out.strip() == "CHILD OK"


def test_the_child_can_close_a_buffer_whose_address_another_buffer_took_over() -> None:
    """A parent thread's close() had unmapped the buffer (its own lock held, the mapping
    not yet marked gone) and another buffer took its address before the fork: the child
    finds it in no table, and still gives it a fresh lock (before: its close() hung)."""
    out = in_a_process("""
        import os, threading
        from client.hostmem import HostMemory
        table = HostMemory(); buf = table.alloc(1 << 16); parent = os.getpid()
        reached, go = threading.Event(), threading.Event()
        class Held:
            def __init__(self, real): self.real = real
            def close(self):
                self.real.close(); reached.set()  # unmapped, not yet marked gone
                if os.getpid() == parent: go.wait()
        buf._mmap = Held(buf._mmap)
        closing = threading.Thread(target=buf.close); closing.start(); reached.wait(5)
        other = table.alloc(1 << 16)
        assert other.ptr == buf.ptr, "the address was not reused"
        child = os.fork()
        if child == 0:
            c = threading.Thread(target=buf.close, daemon=True); c.start(); c.join(3)
            os.write(1, b"CHILD HUNG\\n" if c.is_alive() else b"CHILD OK\\n"); os._exit(0)
        go.set(); closing.join(); os.waitpid(child, 0)
    """)
    assert out.strip() == "CHILD OK"


def test_a_gc_disable_made_while_a_fork_waits_in_its_hooks_stays() -> None:
    """Another thread turns collection off while the fork waits in an earlier hook
    (logging's lock, held here): the fork leaves it off (before: hostmem's hooks switched
    collection off and back on around the fork, undoing it)."""
    out = in_a_process("""
        import logging, gc, os, threading, time
        import client
        held, release = threading.Event(), threading.Event()
        def hold():
            with logging._lock:
                held.set(); release.wait(10)
        threading.Thread(target=hold, daemon=True).start(); held.wait(5)
        def user():
            time.sleep(0.5); gc.disable(); release.set()
        turning = threading.Thread(target=user); turning.start()
        child = os.fork()
        if child == 0:
            os._exit(0)
        os.waitpid(child, 0); turning.join()
        print("enabled after:", gc.isenabled())
    """)
    assert out.strip() == "enabled after: False"


@pytest.mark.parametrize("where", ["_map_over", "pwrite"])
def test_a_fork_while_a_thread_moves_a_host_buffer_leaves_the_child_one_memory(
        monkeypatch: pytest.MonkeyPatch, where: str) -> None:
    """A thread moves a host buffer (a call on it was lost: HostBuffer.detach) and the
    process forks midway: the fresh memory mapped at the buffer's address, its fd not yet
    put on the buffer's number (or the copy onto it under way, long for a big buffer, and
    without the GIL). The child's copy must still be one memory, the one its `.ptr`
    reaches (an import there sends `.fd`), and hold no other (before: the child wrote the
    fresh memory and its fd named the old; and it kept the fresh memory's fd open for good)."""
    memory = hostmem.HostMemory()
    buffer = memory.alloc(64)
    reached, forked = threading.Event(), threading.Event()
    target = hostmem if where == "_map_over" else hostmem.os
    real, parent = getattr(target, where), os.getpid()

    def then_wait(*args: Any) -> Any:
        done = real(*args)
        if os.getpid() == parent:
            reached.set()
            forked.wait(10)
        return done

    monkeypatch.setattr(target, where, then_wait)
    def through_the_fd() -> list[int]:
        buffer.view(np.int32)[:2] = [4, 5]
        return list(np.frombuffer(os.pread(buffer.fd, 8, 0), np.int32).tolist())

    def memfds_open() -> int:
        return sum(os.readlink(f"/proc/self/fd/{fd}").startswith("/memfd:commd-host")
                   for fd in os.listdir("/proc/self/fd") if os.path.exists(f"/proc/self/fd/{fd}"))

    before = memfds_open()  # (the buffer's, and those of buffers alive elsewhere)
    with ThreadPoolExecutor(1) as mover:
        moving = mover.submit(memory.moves.detach, {buffer.id})
        try:
            assert reached.wait(5)
            seen = in_child({"written, read through the fd": through_the_fd,
                             "memfds open": memfds_open})
        finally:
            forked.set()
        assert moving.result(10) == ({}, set())
    assert seen == {"written, read through the fd": ["returned", "[4, 5]"],
                    "memfds open": ["returned", str(before)]}
    buffer.close()
