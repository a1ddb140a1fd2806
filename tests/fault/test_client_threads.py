"""Threads of one rank against a real daemon: DaemonBackend is safe to use from several
threads while one of them reconnects, closes or cleans up. A thread that met a failure
another thread has already repaired must not vote a second rebuild (that fails the fresh
world for every rank); what a reply on the replaced connection said must not be recorded
as the new daemon's; close() on one thread gives the others a CommError. Each ends with a
call whose data is checked."""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest

from client import CommError, DaemonBackend, DaemonShutdown, LimitExceeded, WorldFailed, hostmem
from commd.launch import DaemonProcess
from proto import ErrorCode
from tests.fault.ranks import joined, met_the_failure, on_both, own_daemon, restart_daemon, slowed, summed
from tests.integration.harness import wait_until, world_name, world_status

pytestmark = pytest.mark.timeout(60)
# A held thread goes on once the other threads' step it is held across has run (the test
# sets an event), not after a fixed time; should that step ever wait on the held thread,
# the hold still ends after this long, the longest of the fixed holds these tests had.
HELD_S = 2.0


@pytest.fixture
def daemon(request: pytest.FixtureRequest) -> Iterator[DaemonProcess]:
    yield from own_daemon(getattr(request, "param", ()))


def rebuilt_without(late: ThreadPoolExecutor, comms: list[DaemonBackend],
                    bufs: list[hostmem.HostBuffer]) -> None:
    """Both ranks rebuild the world; then rank 0's `late` thread, which met the failure
    too, calls attempt_reconnect: it returns at once, and the world works."""
    on_both(lambda r: comms[r].attempt_reconnect())
    epoch = comms[0].epoch
    late.submit(comms[0].attempt_reconnect).result(10)
    assert comms[0].epoch == epoch
    assert all(comm.is_healthy() for comm in comms)
    assert summed(comms, bufs) == [[3, 30], [3, 30]]


def test_two_threads_of_a_rank_reconnecting_at_once_after_a_restart(daemon: DaemonProcess) -> None:
    """DaemonBackend is thread-safe: after the daemon restarts, two threads of rank 0 (a
    training loop and a heartbeat, each handling the error) call attempt_reconnect together,
    rank 1 once. Rank 0 is reconnected once (before: both said hello, and one was refused
    as rank 0 already connected; a later one could close the good connection)."""
    with joined(daemon, timeout=3) as comms:
        bufs = [hostmem.alloc(8) for _ in range(2)]
        assert summed(comms, bufs) == [[3, 30], [3, 30]]
        daemon.kill()
        daemon.start()
        together = threading.Barrier(3)

        def reconnect(r: int) -> object:
            met_the_failure(comms[r])
            together.wait()
            try:
                comms[r].attempt_reconnect()
            except CommError as exc:
                return exc
            return "ok"

        with ThreadPoolExecutor(3) as pool:
            outcomes = [f.result(30) for f in [pool.submit(reconnect, r) for r in (0, 0, 1)]]
        assert outcomes == ["ok", "ok", "ok"], outcomes
        assert all(comm.is_healthy() for comm in comms)
        assert summed(comms, bufs) == [[3, 30], [3, 30]]


def test_a_thread_reconnecting_after_another_already_did_leaves_the_world_be(
        daemon: DaemonProcess) -> None:
    """The late thread of the test above, made certain: rank 0's heartbeat thread met the
    failure, but the training thread's attempt_reconnect (with rank 1's) rebuilt the world
    before the heartbeat got to its own. Its attempt_reconnect returns at once (before: it
    voted again, which failed the new world for both ranks, and then timed out waiting for
    rank 1). A thread that saw a call work since reconnects for real when it asks."""
    with joined(daemon, timeout=3) as comms, ThreadPoolExecutor(1) as heartbeat:
        bufs = [hostmem.alloc(8) for _ in range(2)]
        daemon.kill()
        daemon.start()
        heartbeat.submit(met_the_failure, comms[0]).result(10)
        rebuilt_without(heartbeat, comms, bufs)
        epoch = comms[0].epoch

        works = heartbeat.submit(comms[0].barrier)  # (with rank 1's, below)
        comms[1].barrier()
        works.result(10)
        rebuilt = heartbeat.submit(comms[0].attempt_reconnect)
        comms[1].attempt_reconnect()  # a rebuild both ranks ask for, healthy or not
        rebuilt.result(10)
        assert comms[0].epoch == comms[1].epoch == epoch + 1
        assert summed(comms, bufs) == [[3, 30], [3, 30]]


def test_a_thread_whose_call_first_met_a_dead_daemon_through_a_forget_counts_as_failed(
        daemon: DaemonProcess) -> None:
    """Rank 0 freed an imported buffer, so its next request first sends a Forget. The
    heartbeat thread's barrier is the first to meet the dead daemon, in that Forget: it met
    the failure as any call (before: the error came from outside the request's handler, the
    thread was never marked, and its late attempt_reconnect voted a second rebuild)."""
    with joined(daemon, timeout=3) as comms, ThreadPoolExecutor(1) as heartbeat:
        bufs = [hostmem.alloc(8) for _ in range(2)]
        gone = [hostmem.alloc(8) for _ in range(2)]
        on_both(lambda r: comms[r].all_reduce(gone[r].ptr, 8, dtype="i32"))  # imported
        for buf in gone:
            buf.close()  # a Forget waits to go with rank 0's next request
        daemon.kill()
        daemon.start()
        heartbeat.submit(met_the_failure, comms[0]).result(10)
        rebuilt_without(heartbeat, comms, bufs)


def test_a_failure_read_from_the_replaced_connection_does_not_mark_the_rebuilt_world(
        daemon: DaemonProcess, monkeypatch: pytest.MonkeyPatch) -> None:
    """A monitoring thread's is_healthy() reads the old connection's error just before a
    rejoin replaces it, and records it only after the reconnect finished (the recording is
    slowed here to make that certain; unslowed, 1 run in 30 met it). The rebuilt world
    stays healthy (before: it read as failed, and the next all_reduce said "call
    attempt_reconnect" while rank 1's waited and timed out)."""
    with joined(daemon, timeout=3) as comms:
        bufs = [hostmem.alloc(8) for _ in range(2)]
        restart_daemon(daemon, comms)
        mark = comms[0]._conn.mark_unhealthy
        monitor = threading.Thread(target=comms[0].is_healthy)
        rejoined = threading.Event()

        def late_mark(*args: Any, **kwargs: Any) -> int:
            if threading.current_thread() is monitor:
                rejoined.wait(HELD_S)  # the reconnect below runs meanwhile
            return mark(*args, **kwargs)

        monkeypatch.setattr(comms[0]._conn, "mark_unhealthy", late_mark)
        monitor.start()
        on_both(lambda r: comms[r].attempt_reconnect())
        rejoined.set()
        monitor.join(10)
        assert all(comm.is_healthy() for comm in comms)
        assert summed(comms, bufs) == [[3, 30], [3, 30]]


@pytest.mark.parametrize("daemon", [["--max-registrations", "100"]], indirect=True)
def test_buffers_deregistered_while_a_rejoin_registers_them_again_stay_deregistered(
        daemon: DaemonProcess) -> None:
    """After a daemon restart rank 0's attempt_reconnect registers its 100 buffers with the
    new daemon while another thread of rank 0 deregisters them all. None comes back, and
    the new daemon holds none of them (before: 99-100 handles were back in the backend,
    held at the daemon against its limit, and the next register_buffer was refused)."""
    with joined(daemon, timeout=5) as comms:
        buf = hostmem.alloc(4096)
        bufs = [hostmem.alloc(8) for _ in range(2)]
        handles = [comms[0].register_buffer(buf.ptr + i, 8) for i in range(100)]
        restart_daemon(daemon, comms)
        old = comms[0]._conn.transport
        with ThreadPoolExecutor(1) as reconnecting:
            rebuilt = reconnecting.submit(on_both, lambda r: comms[r].attempt_reconnect())
            while comms[0]._conn.transport is old:  # the rejoin has connected: it registers now
                time.sleep(0.0005)
            for handle in reversed(handles):
                comms[0].deregister_buffer(handle)
            rebuilt.result(30)
        assert not set(handles) & comms[0]._registrations.handles()
        fresh = [comms[0].register_buffer(buf.ptr + i, 8) for i in range(100)]  # the limit is free
        with pytest.raises(LimitExceeded):
            comms[0].register_buffer(buf.ptr + 100, 8)
        for handle in fresh:
            comms[0].deregister_buffer(handle)
        assert summed(comms, bufs) == [[3, 30], [3, 30]]


def test_a_clean_up_call_after_the_failure_does_not_make_a_late_reconnect_vote_again(
        daemon: DaemonProcess) -> None:
    """A worker thread meets the failure, then cleans up (deregister_buffer, which the daemon
    answers on a failed world too); the main thread rebuilds with rank 1. The worker's
    attempt_reconnect returns at once: only a collective that worked shows the world works
    (before: any answer did, and it voted a second rebuild)."""
    with joined(daemon, timeout=2) as comms, ThreadPoolExecutor(1) as worker:
        bufs = [hostmem.alloc(8) for _ in range(2)]
        handle = worker.submit(comms[0].register_buffer, bufs[0].ptr, 8).result(10)
        with pytest.raises(CommError):
            comms[0].barrier()  # rank 1 never calls it: the world fails

        def meet_the_failure_and_clean_up() -> None:
            met_the_failure(comms[0])
            comms[0].deregister_buffer(handle)

        worker.submit(meet_the_failure_and_clean_up).result(10)
        rebuilt_without(worker, comms, bufs)


def test_close_on_one_thread_gives_a_call_on_another_a_comm_error(daemon: DaemonProcess) -> None:
    """One thread loops all_reduce while another closes the backend at a random moment:
    the loop ends with a CommError every time (before: 31 of 300 ended in a ValueError
    from select() on the closed socket, which handlers of CommError miss)."""
    buf = hostmem.alloc(64)
    rng = random.Random(5)
    for _ in range(60):
        comm = DaemonBackend(str(daemon.socket_path), world_name(), 0, 1, timeout=5)
        ended: list[BaseException] = []
        looping = threading.Event()

        def loop(comm: DaemonBackend = comm, ended: list[BaseException] = ended,
                 looping: threading.Event = looping) -> None:
            looping.set()
            try:
                while True:
                    comm.all_reduce(buf.ptr, 64, dtype="u8")
            except BaseException as exc:  # (what it was is the test)
                ended.append(exc)

        caller = threading.Thread(target=loop)
        caller.start()
        looping.wait(10)
        time.sleep(rng.uniform(0, 0.01))
        comm.close()
        caller.join(10)
        assert len(ended) == 1 and isinstance(ended[0], CommError), ended


@pytest.mark.parametrize("looked", [False, True], ids=["unseen", "seen-healthy"])
def test_a_thread_whose_failure_was_repaired_still_joins_a_later_rebuild(
        daemon: DaemonProcess, looked: bool) -> None:
    """Rank 0's heartbeat met the failure of epoch E; the other threads rebuilt E+1 (and
    the heartbeat may have seen it healthy). Later rank 1 asks for another rebuild (its
    vote fails E+1, which rank 0 is told), then the heartbeat asks too: it takes part,
    and both reach E+2 (before: it returned at once on its old failure, and rank 1 timed
    out waiting for rank 0)."""
    with joined(daemon, timeout=2) as comms, ThreadPoolExecutor(1) as heartbeat:
        bufs = [hostmem.alloc(8) for _ in range(2)]
        with pytest.raises(CommError):
            comms[0].barrier()  # rank 1 never calls it: epoch E fails
        heartbeat.submit(met_the_failure, comms[0]).result(10)
        rebuilt_without(heartbeat, comms, bufs)
        epoch = comms[0].epoch
        if looked:
            assert heartbeat.submit(comms[0].is_healthy).result(10)
        with ThreadPoolExecutor(1) as rank1:
            voted = rank1.submit(comms[1].attempt_reconnect)
            wait_until(lambda: (world_status(daemon, comms[0]._world) or {}).get("state") == "forming",
                       "rank 1's vote at the daemon", timeout=5)
            heartbeat.submit(comms[0].attempt_reconnect).result(10)
            voted.result(10)
        assert comms[0].epoch == comms[1].epoch == epoch + 1
        assert summed(comms, bufs) == [[3, 30], [3, 30]]


def test_a_buffer_handed_to_the_daemon_that_went_counts_as_a_failure_of_its_thread(
        daemon: DaemonProcess, monkeypatch: pytest.MonkeyPatch) -> None:
    """A thread's all_reduce hands a new buffer to the daemon, which answers and is killed;
    the ranks rebuild with a restarted one before the thread goes on. Its call fails (the
    new daemon never got the buffer), as a failure the rebuild already repaired: the
    thread's attempt_reconnect returns at once (before: it voted a second rebuild)."""
    with joined(daemon, timeout=2) as comms, ThreadPoolExecutor(1, thread_name_prefix="worker") as worker:
        bufs = [hostmem.alloc(8) for _ in range(2)]
        fresh = hostmem.alloc(8)
        answered = slowed(monkeypatch, comms[0]._conn, "request", "worker", 2.0, after=True,
                          when=lambda *args, **kwargs: bool(kwargs.get("fds")))  # (the Import)
        call = worker.submit(comms[0].all_reduce, fresh.ptr, 8, dtype="i32")
        assert answered.wait(5)
        restart_daemon(daemon, comms)
        rebuilt_without(worker, comms, bufs)  # (its attempt_reconnect queued behind the call)
        with pytest.raises(CommError, match="went away"):
            call.result(10)


def test_a_call_made_before_a_reconnect_on_other_threads_is_not_sent_into_the_rebuilt_world(
        daemon: DaemonProcess, monkeypatch: pytest.MonkeyPatch) -> None:
    """A thread's barrier, made in epoch E on the connection that stays, goes out only
    after both ranks rebuilt E+1 on other threads. The daemon refuses it as made for E
    and the world goes on: that thread's attempt_reconnect returns at once, and both
    ranks' next calls match (before: it went into E+1 as rank 0's first call there,
    paired with nothing of rank 1's; E+1 failed and needed another rebuild)."""
    with joined(daemon, timeout=2) as comms, ThreadPoolExecutor(1, thread_name_prefix="late") as late:
        bufs = [hostmem.alloc(8) for _ in range(2)]
        sending = slowed(monkeypatch, comms[0]._conn, "_send_releases", "late", 1.0)
        call = late.submit(comms[0].barrier)
        assert sending.wait(5)
        epoch = comms[0].epoch
        on_both(lambda r: comms[r].attempt_reconnect())
        with pytest.raises(WorldFailed, match=f"made for epoch {epoch} ") as refused:
            call.result(20)
        assert refused.value.code is ErrorCode.STALE_EPOCH
        late.submit(comms[0].attempt_reconnect).result(10)
        monkeypatch.undo()
        assert comms[0].epoch == comms[1].epoch == epoch + 1
        assert all(comm.is_healthy() for comm in comms)
        assert summed(comms, bufs) == [[3, 30], [3, 30]]


@pytest.mark.parametrize("daemon", [["--max-buffers", "2"]], indirect=True)
def test_forgets_for_the_new_daemon_do_not_go_on_the_replaced_connection(
        daemon: DaemonProcess, monkeypatch: pytest.MonkeyPatch) -> None:
    """A thread's request took the connection just before the daemon was killed and goes
    out only after the rejoin, when rank 0 has freed a buffer the new daemon imported.
    That Forget goes to the new daemon with a later request (before: it was posted on the
    old, closed connection and lost; the new daemon held the buffer against its limit of
    2, and the next import was refused)."""
    # (a timeout past the hold: the held call tells the new daemon within its one deadline)
    with joined(daemon, timeout=10) as comms, ThreadPoolExecutor(1, thread_name_prefix="stale") as stale:
        bufs = [hostmem.alloc(8) for _ in range(2)]
        old = comms[0]._conn.transport
        taken = slowed(monkeypatch, comms[0]._conn, "_send_releases", "stale", 3.0,
                       when=lambda transport, *deadline: transport is old)
        request = stale.submit(comms[0].set_add_kernel, 0)
        assert taken.wait(5)
        restart_daemon(daemon, comms)
        on_both(lambda r: comms[r].attempt_reconnect())
        gone = [hostmem.alloc(8) for _ in range(2)]
        on_both(lambda r: comms[r].all_reduce(gone[r].ptr, 8, dtype="i32"))  # the new daemon's
        for buf in gone:
            buf.close()  # a Forget waits for rank 0's next request
        request.result(10)  # (failed on the old connection, then told the new daemon)
        assert summed(comms, bufs) == [[3, 30], [3, 30]]  # a second buffer: fits (the Forget went)
        more = [hostmem.alloc(8) for _ in range(2)]
        on_both(lambda r: comms[r].all_reduce(more[r].ptr, 8, dtype="i32"))  # a third: only if it went


@pytest.mark.parametrize("daemon", [["--max-registrations", "100"]], indirect=True)
def test_news_of_the_new_epoch_failing_read_while_rejoining_is_kept(daemon: DaemonProcess) -> None:
    """After a daemon restart rank 0 (one thread) rejoins and registers its 10 buffers
    again; rank 1, back first, at once asks for another rebuild, which fails the new epoch.
    Rank 0 reads that news during its re-registration, while the old failure is still on
    record: it keeps the newer one, so it learns its world failed and joins the rebuild
    (before: the reconnect's end cleared both; is_healthy() said true for good, and rank
    1's rebuild timed out waiting for rank 0)."""
    with joined(daemon, timeout=3) as comms:
        bufs = [hostmem.alloc(8) for _ in range(2)]
        registered = hostmem.alloc(4096)
        for i in range(10):
            comms[0].register_buffer(registered.ptr + i, 8)
        restart_daemon(daemon, comms)

        def rank1() -> None:
            comms[1].attempt_reconnect()
            comms[1].attempt_reconnect()  # at once: a rebuild rank 0 must join

        with ThreadPoolExecutor(1) as other:
            both = other.submit(rank1)
            comms[0].attempt_reconnect()
            epoch = comms[0].epoch
            wait_until(lambda: not comms[0].is_healthy(), "rank 0 to learn of rank 1's vote", timeout=5)
            comms[0].attempt_reconnect()
            both.result(10)
        assert comms[0].epoch == comms[1].epoch == epoch + 1
        assert summed(comms, bufs) == [[3, 30], [3, 30]]


def test_is_healthy_reading_the_old_connection_during_a_rejoin_returns(
        daemon: DaemonProcess, monkeypatch: pytest.MonkeyPatch) -> None:
    """After a daemon restart rank 0's monitor thread calls is_healthy(): its drain of the
    old connection has seen it readable (the daemon's end of the stream) and is about to
    read (held here) when the ranks rejoin on other threads, which closes the old socket;
    the new connection's socket takes its fd number. is_healthy() returns (before: it
    waited in poll() on that fd number, now the new, idle connection's, for as long as no
    other thread made a call)."""
    with joined(daemon, timeout=3) as comms:
        bufs = [hostmem.alloc(8) for _ in range(2)]
        old = comms[0]._conn.transport
        daemon.kill()
        daemon.start()
        met_the_failure(comms[1])
        read_one = old._read_one
        reading, rejoined = threading.Event(), threading.Event()

        def held_read_one(deadline: float | None) -> Any:
            if threading.current_thread().name == "monitor":
                reading.set()
                rejoined.wait(HELD_S)  # the rejoin runs here
            return read_one(deadline)

        monkeypatch.setattr(old, "_read_one", held_read_one)
        result: list[bool] = []
        monitor = threading.Thread(target=lambda: result.append(comms[0].is_healthy()),
                                   name="monitor", daemon=True)
        monitor.start()
        assert reading.wait(5)
        on_both(lambda r: comms[r].attempt_reconnect())
        rejoined.set()
        monitor.join(5)
        assert not monitor.is_alive() and len(result) == 1
        assert summed(comms, bufs) == [[3, 30], [3, 30]]


def test_close_ends_a_recv_command_whose_reader_was_between_two_reads(
        daemon: DaemonProcess, monkeypatch: pytest.MonkeyPatch) -> None:
    """Rank 0's waiting thread is in recv_command_u32 (no deadline), reading the socket for
    every thread: it has just routed another thread's reply and goes round to read again
    (held there) when the worker closes the backend and opens a new one, whose socket
    takes the old fd number. close() ends the waiting call with a CommError (before: the
    waiting thread polled the new, idle socket for good)."""
    with joined(daemon, timeout=3) as comms:
        buf = hostmem.alloc(8)
        transport = comms[0]._conn.transport
        read_one = transport._read_one
        armed, held, reopened = threading.Event(), threading.Event(), threading.Event()

        def held_read_one(deadline: float | None) -> Any:
            if threading.current_thread().name == "waiting" and armed.is_set() and not held.is_set():
                held.set()
                reopened.wait(HELD_S)  # close() and the new backend run here
            return read_one(deadline)

        monkeypatch.setattr(transport, "_read_one", held_read_one)
        outcome: list[BaseException] = []

        def wait_for_command() -> None:
            try:
                comms[0].recv_command_u32(buf.ptr, 1)
            except BaseException as exc:
                outcome.append(exc)

        waiting = threading.Thread(target=wait_for_command, name="waiting", daemon=True)
        waiting.start()
        wait_until(lambda: transport._reader is not None, "the waiting thread reading for everyone",
                   timeout=5)
        armed.set()
        comms[0].set_add_kernel(0)  # its reply read by the waiting thread, which goes round
        assert held.wait(5)
        comms[0].close()
        with DaemonBackend(str(daemon.socket_path), world_name(), 0, 1, timeout=3):
            reopened.set()
            waiting.join(5)
            assert not waiting.is_alive()
            assert len(outcome) == 1 and isinstance(outcome[0], CommError), outcome


def test_a_shutdown_event_read_before_a_rejoin_does_not_mark_the_rebuilt_world(
        daemon: DaemonProcess, monkeypatch: pytest.MonkeyPatch) -> None:
    """The daemon is restarted gracefully (SIGTERM, as systemd does): it sends every client a
    SHUTDOWN event, which carries no epoch. Rank 0's monitor thread reads it in is_healthy()
    and records it only after both ranks rejoined (held here). The rebuilt world stays
    healthy (before: the event, read as about the current epoch, marked it failed, and
    every call of rank 0 said to call attempt_reconnect)."""
    with joined(daemon, timeout=3) as comms:
        bufs = [hostmem.alloc(8) for _ in range(2)]
        assert summed(comms, bufs) == [[3, 30], [3, 30]]
        daemon.stop()
        daemon.start()
        mark = comms[0]._conn.mark_unhealthy
        holding, rejoined = threading.Event(), threading.Event()

        def late_mark(why: CommError, *args: Any, **kwargs: Any) -> int:
            if threading.current_thread().name == "monitor" and isinstance(why, DaemonShutdown):
                holding.set()
                rejoined.wait(HELD_S)  # both ranks rejoin meanwhile
            return mark(why, *args, **kwargs)

        monkeypatch.setattr(comms[0]._conn, "mark_unhealthy", late_mark)
        monitor = threading.Thread(target=comms[0].is_healthy, name="monitor")
        monitor.start()
        assert holding.wait(5)
        met_the_failure(comms[1])
        on_both(lambda r: comms[r].attempt_reconnect())
        rejoined.set()
        monitor.join(10)
        healthy = [comm.is_healthy() for comm in comms]
        assert healthy == [True, True]
        assert summed(comms, bufs) == [[3, 30], [3, 30]]


def test_an_add_kernel_set_while_another_thread_rejoins_reaches_the_new_daemon(
        daemon: DaemonProcess, monkeypatch: pytest.MonkeyPatch) -> None:
    """Rank 0's set_add_kernel is answered by the daemon, which is then killed and
    restarted; the ranks rejoin on other threads before set_add_kernel returns (held here).
    The call returned: the restarted daemon knows the handle (before: the rejoin read none
    to tell it, and the 2-rank add path was off without a word)."""
    with joined(daemon, timeout=3) as comms:
        bufs = [hostmem.alloc(8) for _ in range(2)]
        request = comms[0]._conn.request
        answered, rejoined = threading.Event(), threading.Event()

        def held_request(*args: Any, **kwargs: Any) -> Any:
            answer = request(*args, **kwargs)
            if threading.current_thread().name.startswith("setting"):
                answered.set()
                rejoined.wait(HELD_S)  # the restart and the rejoin run here
            return answer

        monkeypatch.setattr(comms[0]._conn, "request", held_request)
        with ThreadPoolExecutor(1, thread_name_prefix="setting") as setting:
            done = setting.submit(comms[0].set_add_kernel, 7)
            assert answered.wait(5)
            restart_daemon(daemon, comms)
            on_both(lambda r: comms[r].attempt_reconnect())
            rejoined.set()
            done.result(10)  # returned without error
        status = world_status(daemon, comms[0]._world) or {}
        assert status.get("add_kernel") == {"0": 7}
        assert summed(comms, bufs) == [[3, 30], [3, 30]]


def test_a_failed_set_add_kernel_agrees_with_the_daemon(daemon: DaemonProcess,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """Telling the daemon fails in set_add_kernel (the daemon was killed), held there while
    both ranks rejoin on other threads, which tell the restarted daemon its handle. The
    handle holds for the backend as for the daemon (before: the call undid it after the
    rejoin had told the daemon, and the next restart dropped it without a word), and the
    call, which the seed says cannot fail, returns."""
    with joined(daemon, timeout=3) as comms:
        bufs = [hostmem.alloc(8) for _ in range(2)]
        restart_daemon(daemon, comms)
        tell = comms[0]._add_kernel.tell_at
        failed, rejoined = threading.Event(), threading.Event()

        def held(handle: int, link: int, due: float) -> None:
            try:
                tell(handle, link, due)
            except CommError:
                if threading.current_thread().name == "setting":
                    failed.set()
                    rejoined.wait(HELD_S)  # the rejoin runs here
                raise

        monkeypatch.setattr(comms[0]._add_kernel, "tell_at", held)
        outcome: list[Any] = []

        def setting() -> None:
            try:
                comms[0].set_add_kernel(7)
                outcome.append("ok")
            except CommError as exc:
                outcome.append(exc)

        t = threading.Thread(target=setting, name="setting")
        t.start()
        assert failed.wait(5)
        on_both(lambda r: comms[r].attempt_reconnect())
        rejoined.set()
        t.join(10)
        daemon_has = (world_status(daemon, comms[0]._world) or {}).get("add_kernel")
        assert outcome == ["ok"]
        assert summed(comms, bufs) == [[3, 30], [3, 30]]
        assert (comms[0]._add_kernel.handle, daemon_has) == (7, {"0": 7})
        restart_daemon(daemon, comms)
        on_both(lambda r: comms[r].attempt_reconnect())
        assert (world_status(daemon, comms[0]._world) or {}).get("add_kernel") == {"0": 7}
