"""The NCCL gate through the whole stack: a real Server and DaemonBackend clients over the
fake device, whose ncclCommAbort takes its time (gpu.abort_takes_s). While one world's
abort runs, another world's calls wait (NCCL takes no call meanwhile) and stay correct,
the daemon answers everyone else at once, and memory goes back to its baseline."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator

import pytest

from client import CommError, DaemonBackend
from commd.status import query_status
from tests.contract.fakegpu import FakeGpu
from tests.integration.gpu_daemon import GpuDaemon
from tests.integration.harness import wait_until, world_name
from tests.integration.test_gpu_path_fake import WorkerDriver

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def gpu() -> Iterator[FakeGpu]:
    device = FakeGpu(devices=2, multi_rank_gpu=True)
    yield device
    assert device.violations == []


@pytest.fixture
def daemon(gpu: FakeGpu) -> Iterator[GpuDaemon]:
    d = GpuDaemon(gpu)
    yield d
    if d.thread.is_alive():
        d.close()


class Steady:
    """World B: two ranks all_reduce u8 in a loop and check every result."""

    def __init__(self, daemon: GpuDaemon, driver: WorkerDriver, nbytes: int = 64) -> None:
        self.world = world_name("steady")
        self.stop = threading.Event()
        self.errors: list[str] = []
        self.calls = [0, 0]
        self.longest = [0.0, 0.0]  # each rank's slowest call
        self.started = threading.Barrier(3)
        self.threads = [threading.Thread(target=self._rank, args=(daemon, driver, r, nbytes))
                        for r in range(2)]
        for t in self.threads:
            t.start()
        self.started.wait(20)

    def _rank(self, daemon: GpuDaemon, driver: WorkerDriver, r: int, nbytes: int) -> None:
        try:
            with DaemonBackend(str(daemon.socket_path), self.world, r, 2, device=r, timeout=30,
                               cuda_driver=lambda: driver) as comm:
                driver.set_device(r)
                ptr = driver.alloc(bytes(nbytes), device=r)
                self.started.wait(20)
                i = 0
                while not self.stop.is_set():
                    i += 1
                    driver.gpu.copy_in(ptr, bytes([(i + r) % 100]) * nbytes)
                    t0 = time.monotonic()
                    comm.all_reduce(ptr, nbytes, dtype="u8")
                    self.longest[r] = max(self.longest[r], time.monotonic() - t0)
                    got = driver.gpu.read(ptr, nbytes)
                    want = bytes([((i % 100) + ((i + 1) % 100)) % 256]) * nbytes
                    if got != want:
                        self.errors.append(f"rank {r} call {i}: {got[:4]!r} != {want[:4]!r}")
                        return
                    self.calls[r] = i
        except Exception as exc:  # any failure is the test's finding
            late = self.stop.is_set()
            self.errors.append(f"{'late ' if late else ''}rank {r} after {self.calls[r]} calls: "
                               f"{type(exc).__name__}: {exc}")
            self.stop.set()

    def finish(self) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(30)
        # one rank may have stopped a call earlier and left the other waiting: that one then
        # sees its peer's connection go (WorldFailed) -- only count errors before stop
        real = [e for e in self.errors if not e.startswith("late ")]
        assert real == [], self.errors


def one_rank_worlds(daemon: GpuDaemon, driver: WorkerDriver, count: int) -> list[DaemonBackend]:
    """`count` 1-rank worlds, each with a communicator (it ran a call): each aborts as it closes."""
    comms = []
    for i in range(count):
        comm = DaemonBackend(str(daemon.socket_path), world_name(f"s{i}"), 0, 1, timeout=20,
                             cuda_driver=lambda: driver)
        comm.all_reduce(driver.alloc(b"\x01" * 8), 8, dtype="u8")
        comms.append(comm)
    return comms


def settle_allocations(gpu: FakeGpu, want: int, limit: float = 10.0) -> None:
    deadline = time.monotonic() + limit
    while gpu.allocations != want:
        assert time.monotonic() < deadline, (gpu.allocations, want)
        time.sleep(0.05)


def test_a_mismatched_world_aborts_while_another_keeps_running(daemon: GpuDaemon, gpu: FakeGpu) -> None:
    """World A fails by a mismatch (abort 2 x 0.5 s); B's steady all_reduces go on correct;
    A's ranks reconnect and work again; memory back to baseline after all close."""
    driver = WorkerDriver(gpu)
    baseline = gpu.allocations
    gpu.abort_takes_s = 0.5
    steady = Steady(daemon, driver)
    world = world_name("a")
    outcome: dict[int, object] = {}
    go = threading.Barrier(2)

    def rank(r: int) -> None:
        driver.set_device(r)
        with DaemonBackend(str(daemon.socket_path), world, r, 2, device=r, timeout=20,
                           cuda_driver=lambda: driver) as comm:
            ptr = driver.alloc(bytes([r + 1]) * 32, device=r)
            comm.all_reduce(ptr, 32, dtype="u8")
            go.wait(10)
            try:
                comm.all_reduce(ptr, 16 if r else 32, dtype="u8")  # mismatch
                outcome[r] = "no error"
            except CommError as exc:
                outcome[r] = type(exc).__name__
            go.wait(10)
            comm.attempt_reconnect()
            gpu.copy_in(ptr, bytes([r + 5]) * 32)
            comm.all_reduce(ptr, 32, dtype="u8")
            outcome[10 + r] = gpu.read(ptr, 32)

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(40)
    assert not any(t.is_alive() for t in threads)
    time.sleep(1.0)
    steady.finish()
    assert {outcome[0], outcome[1]} <= {"MismatchError", "WorldFailed"}, outcome
    assert outcome[10] == outcome[11] == bytes([11]) * 32
    assert len(gpu.abort_threads) >= 2
    settle_allocations(gpu, baseline + 2 * 2)  # only the workers' own buffers remain


def test_disconnect_mid_call_while_the_op_waits_on_the_device(daemon: GpuDaemon, gpu: FakeGpu) -> None:
    """A's op is in the engine, waiting for rank 0's kernel; rank 1 disconnects; the op is
    aborted (after the grace) with the kernel still pending; its memory must stay until
    the device is past it; B goes on; A re-forms with a new rank 1."""
    driver = WorkerDriver(gpu)
    baseline = gpu.allocations
    gpu.abort_takes_s = 0.5
    steady = Steady(daemon, driver)
    world = world_name("a")
    stream0 = gpu.worker_stream()
    ptrs = [driver.alloc(b"\x01" * 16), driver.alloc(b"\x02" * 16)]
    kernel = gpu.worker_kernel(stream0, ptrs[0], b"\x07" * 16)
    issued = threading.Barrier(3)
    errors: list[str] = []
    results: dict[str, bytes] = {}

    def rank0() -> None:
        with DaemonBackend(str(daemon.socket_path), world, 0, 2, timeout=20,
                           cuda_driver=lambda: driver) as comm:
            comm.all_reduce_async(ptrs[0], 16, stream0, dtype="u8")
            issued.wait(10)
            # wait for the failure event
            deadline = time.monotonic() + 15
            while comm.is_healthy():
                assert time.monotonic() < deadline
                time.sleep(0.05)
            gpu.finish_kernel(kernel)  # the worker's kernel ends after the abort
            comm.attempt_reconnect()
            gpu.copy_in(ptrs[0], b"\x03" * 16)
            comm.all_reduce(ptrs[0], 16, dtype="u8")
            results["0"] = gpu.read(ptrs[0], 16)

    def rank1() -> None:
        comm = DaemonBackend(str(daemon.socket_path), world, 1, 2, timeout=20, cuda_driver=lambda: driver)
        s1 = gpu.worker_stream()
        comm.all_reduce_async(ptrs[1], 16, s1, dtype="u8")
        issued.wait(10)
        time.sleep(0.2)
        comm.close()  # gone mid-call
        time.sleep(0.5)
        with DaemonBackend(str(daemon.socket_path), world, 1, 2, timeout=20,
                           cuda_driver=lambda: driver) as again:
            gpu.copy_in(ptrs[1], b"\x04" * 16)
            again.all_reduce(ptrs[1], 16, dtype="u8")
            results["1"] = gpu.read(ptrs[1], 16)

    def guard(rank: Callable[[], None]) -> Callable[[], None]:
        def run() -> None:
            try:
                rank()
            except BaseException as exc:  # any failure is the test's finding
                errors.append(f"{rank.__name__}: {type(exc).__name__}: {exc}")
        return run

    threads = [threading.Thread(target=guard(rank0)), threading.Thread(target=guard(rank1))]
    for t in threads:
        t.start()
    issued.wait(10)
    for t in threads:
        t.join(40)
    steady.finish()
    assert errors == []
    assert results == {"0": b"\x07" * 16, "1": b"\x07" * 16}
    settle_allocations(gpu, baseline + 4)


def test_several_worlds_abort_at_once_while_a_new_one_forms(daemon: GpuDaemon, gpu: FakeGpu) -> None:
    """Four 1-rank worlds close at once (4 aborts queued, 0.8 s each) while a 2-rank world
    forms and runs; B runs throughout; status answers."""
    driver = WorkerDriver(gpu)
    baseline = gpu.allocations
    steady = Steady(daemon, driver)
    singles = one_rank_worlds(daemon, driver, 4)
    gpu.abort_takes_s = 0.8
    for c in singles:
        c.close()
    time.sleep(0.05)
    world = world_name("new")
    out: dict[int, bytes] = {}
    errors: list[str] = []

    def rank(r: int) -> None:
        try:
            with DaemonBackend(str(daemon.socket_path), world, r, 2, timeout=20,
                               cuda_driver=lambda: driver) as comm:
                ptr = driver.alloc(bytes([r + 1]) * 8)
                comm.all_reduce(ptr, 8, dtype="u8")
                out[r] = gpu.read(ptr, 8)
        except Exception as exc:  # any failure is the test's finding
            errors.append(repr(exc))

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    lat = []
    for _ in range(5):
        s = time.monotonic()
        query_status(str(daemon.socket_path), 10)
        lat.append(time.monotonic() - s)
        time.sleep(0.1)
    for t in threads:
        t.join(30)
    steady.finish()
    assert errors == [] and out == {0: b"\x03" * 8, 1: b"\x03" * 8}
    settle_allocations(gpu, baseline + 4 + 2 + 2)
    deadline = time.monotonic() + 10
    while len(gpu.abort_threads) < 4:  # the four (and the new world's, as its ranks left)
        assert time.monotonic() < deadline, gpu.abort_threads
        time.sleep(0.05)
    assert max(lat) < 0.8 / 2, lat  # the daemon itself answers at once, not after an abort
    # world B's calls wait for the aborts (NCCL takes no call meanwhile), and no longer
    assert max(steady.longest) < 4 * 0.8 + 2.0, steady.longest


def test_status_answers_during_a_long_abort(daemon: GpuDaemon, gpu: FakeGpu) -> None:
    """While a world's abort runs (1.5 s) and nothing forms, a status query answers fast."""
    driver = WorkerDriver(gpu)
    c = DaemonBackend(str(daemon.socket_path), world_name("x"), 0, 1, timeout=20, cuda_driver=lambda: driver)
    p = driver.alloc(b"\x01" * 8)
    c.all_reduce(p, 8, dtype="u8")
    gpu.abort_takes_s = 1.5
    aborts = len(gpu.abort_threads)
    c.close()
    abort_running(gpu, aborts)
    s = time.monotonic()
    query_status(str(daemon.socket_path), 10)
    took = time.monotonic() - s
    assert took < 0.75, took  # (a loop held by the abort would answer after most of its 1.5 s)


def abort_running(gpu: FakeGpu, before: int) -> None:
    """Wait until an abort started after `before` of them had."""
    wait_until(lambda: len(gpu.abort_threads) > before, "an abort to start", 10)


def test_status_answers_while_a_failed_world_reconnects_during_its_abort(daemon: GpuDaemon,
                                                                        gpu: FakeGpu) -> None:
    """The common case: a world fails and its ranks reconnect at once, while its abort
    runs. The re-formed world's init waits for the abort, not the loop: a bystander's
    status request answers meanwhile, and the world works again."""
    driver = WorkerDriver(gpu)
    world = world_name("re")
    comms = []
    barrier = threading.Barrier(2)

    def join(r: int) -> None:
        comms.append(DaemonBackend(str(daemon.socket_path), world, r, 2, timeout=20,
                                   cuda_driver=lambda: driver))

    ts = [threading.Thread(target=join, args=(r,)) for r in range(2)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(20)
    ptrs = {c.rank(): driver.alloc(b"\x01" * 8) for c in comms}

    outcome: dict[int, str] = {}

    def mism(c: DaemonBackend) -> None:
        try:
            c.all_reduce(ptrs[c.rank()], 8 if c.rank() else 4, dtype="u8")
            outcome[c.rank()] = "no error"
        except CommError as exc:
            outcome[c.rank()] = type(exc).__name__
        barrier.wait(10)
        c.attempt_reconnect()
        gpu.copy_in(ptrs[c.rank()], bytes([c.rank() + 2]) * 8)
        c.all_reduce(ptrs[c.rank()], 8, dtype="u8")
        outcome[10 + c.rank()] = gpu.read(ptrs[c.rank()], 8).hex()

    gpu.abort_takes_s = 1.0  # 2 communicators: 2 s
    aborts = len(gpu.abort_threads)
    ts = [threading.Thread(target=mism, args=(c,)) for c in comms]
    for t in ts:
        t.start()
    abort_running(gpu, aborts)
    s = time.monotonic()
    query_status(str(daemon.socket_path), 10)
    took = time.monotonic() - s
    for t in ts:
        t.join(20)
    for c in comms:
        c.close()
    assert took < 1.0, f"status took {took:.2f} s: the loop was blocked behind the abort"
    assert {outcome[0], outcome[1]} <= {"MismatchError", "WorldFailed"}, outcome
    assert outcome[10] == outcome[11] == "05" * 8, outcome  # 2 + 3, after the reconnect


def test_symmetric_memory_freed_and_allocated_during_an_abort(daemon: GpuDaemon, gpu: FakeGpu) -> None:
    driver = WorkerDriver(gpu)
    baseline = gpu.allocations
    steady = Steady(daemon, driver)
    world = world_name("sym")
    out: dict[object, object] = {}
    gate = threading.Barrier(2)

    def rank(r: int) -> None:
        with DaemonBackend(str(daemon.socket_path), world, r, 2, timeout=20,
                           cuda_driver=lambda: driver) as comm:
            ptr = comm.symmetric_alloc(32)
            other = comm.symmetric_alloc(32)
            gpu.copy_in(ptr, bytes([r + 1]) * 32)
            comm.all_reduce(ptr, 32, dtype="u8")
            reg = driver.alloc(bytes([r + 1]) * 64)
            handle = comm.register_buffer(reg, 64)
            comm.all_reduce(reg, 64, dtype="u8")
            gate.wait(10)
            if r == 0:
                gpu.abort_takes_s = 0.8
            gate.wait(10)
            with pytest.raises(CommError):
                comm.all_reduce(ptr, 32 if r else 16, dtype="u8")  # mismatch: abort starts
            comm.symmetric_free(other)  # ncclMemFree during the abort
            comm.deregister_buffer(handle)  # deregistration during the abort
            third = comm.symmetric_alloc(32)  # ncclMemAlloc during the abort: blocks the loop
            gate.wait(10)
            comm.attempt_reconnect()
            gpu.copy_in(third, bytes([r + 3]) * 32)
            comm.all_reduce(third, 32, dtype="u8")
            out[r] = gpu.read(third, 32)
            comm.symmetric_free(third)
            comm.symmetric_free(ptr)

    ts = [threading.Thread(target=rank, args=(r,)) for r in range(2)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(40)
    steady.finish()
    assert out == {0: b"\x07" * 32, 1: b"\x07" * 32}
    settle_allocations(gpu, baseline + 4)  # steady 2 buffers, 2 reg buffers


def test_daemon_shutdown_while_aborts_run_and_queue(daemon: GpuDaemon, gpu: FakeGpu,
                                                   caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG)
    driver = WorkerDriver(gpu)
    singles = one_rank_worlds(daemon, driver, 3)
    live = DaemonBackend(str(daemon.socket_path), world_name("live"), 0, 1, timeout=20,
                         cuda_driver=lambda: driver)
    sym = live.symmetric_alloc(64)
    live.all_reduce(sym, 64, dtype="u8")
    gpu.abort_takes_s = 0.5
    for c in singles:
        c.close()
    time.sleep(0.1)  # first abort running, 2 queued
    s = time.monotonic()
    daemon.close()
    took = time.monotonic() - s
    live.close()
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR or r.exc_info]
    assert took < 5
    assert errors == [], [r.getMessage() for r in errors]
    assert len(gpu.abort_threads) >= 4
    # everything the daemon opened, allocated (scratch, streams' memory) let go
    time.sleep(0.5)
    assert gpu.allocations == 3 + 0, gpu.allocations  # only the three workers' buffers
