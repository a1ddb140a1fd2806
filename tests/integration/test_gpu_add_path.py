"""set_add_kernel's add path in a 2-rank world whose ranks are on two daemons: the daemons
agree on the collective from which both sum bf16 by exchange and add (engine/addagree.py),
so one rank's exchange never faces the other's ncclAllReduce (on a GPU, and on the fake
device, a wait for ever). Real daemons (servers on loop threads, linked over loopback),
real clients, the fake device of tests/contract/fakegpu.py shared by all."""

from __future__ import annotations

import logging
import re
import threading
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from typing import cast

import numpy as np
import pytest

from client import CommError, DaemonBackend
from commd.engine.gpu import Gpu, GpuError
from commd.peerlink import PeerSettings
from tests.contract.fakegpu import FakeGpu
from tests.integration.data import make_input, reduce_reference
from tests.integration.gpu_daemon import GpuDaemon
from tests.integration.harness import wait_until, world_name
from tests.integration.test_gpu_path_fake import WorkerDriver, run_ranks

pytestmark = pytest.mark.timeout(60)
SECRET = b"add path across daemons secret"
AGREED = re.compile(r"world (\S+): bf16 sums from collective #(\d+) on take the add path")
SUMS = 12
Daemons = Callable[[Gpu], tuple[GpuDaemon, GpuDaemon]]  # the two_daemons fixture
SET_LATE = 3  # rank 1 sets the kernel before this sum; rank 0 before the first


class WithoutNvrtc:
    """A daemon's view of the shared device where NVRTC is missing: its add kernel never
    loads (the other daemon's does)."""

    def __init__(self, gpu: FakeGpu) -> None:
        self._gpu = gpu

    def __getattr__(self, name: str) -> object:
        return getattr(self._gpu, name)

    def add_ready(self, device: int) -> bool:
        return False

    def prepare_add(self, device: int, loading: Callable[[], AbstractContextManager[None]]) -> None:
        raise GpuError("libnvrtc.so.12: cannot open shared object file")


@pytest.fixture
def gpu() -> Iterator[FakeGpu]:
    device = FakeGpu(devices=2)
    yield device
    assert device.violations == []


@pytest.fixture
def two_daemons(gpu: FakeGpu) -> Iterator[Daemons]:
    """Makes the root A and the member B on the shared device (B's view of it given),
    linked over loopback; both are closed after the test."""
    made: list[GpuDaemon] = []

    def make(member_gpu: Gpu) -> tuple[GpuDaemon, GpuDaemon]:
        made.append(GpuDaemon(gpu, PeerSettings("A", SECRET)))
        made.append(GpuDaemon(member_gpu, PeerSettings("B", SECRET)))
        return made[-2], made[-1]

    yield make
    for daemon in reversed(made):
        daemon.close()


def summed(inputs: list[list[np.ndarray]]) -> list[bytes]:
    """Each pair of the ranks' bf16 inputs summed, as NCCL's all_reduce would."""
    return [reduce_reference(pair, "bf16", "sum").tobytes() for pair in inputs]


def agreed(caplog: pytest.LogCaptureFixture, world: str) -> list[int]:
    """The collective each daemon logged it agreed on for `world`, in the order logged."""
    return [int(m[2]) for r in caplog.records if (m := AGREED.match(r.getMessage())) and m[1] == world]


@pytest.mark.parametrize("case", ["both", "rank 0 only", "B without NVRTC"])
def test_the_add_path_across_two_daemons(gpu: FakeGpu, two_daemons: Daemons, caplog: pytest.LogCaptureFixture,
                                         case: str) -> None:
    """Rank 0 on the root A sets the kernel at once, rank 1 on B before its fourth sum;
    each sum is followed by an f32 all_reduce (a collective NCCL sums either way). Both
    daemons log the same collective, and every bf16 sum from there on is an exchange and
    an add on each daemon (two adds a sum), every result NCCL's. With rank 1 never
    setting it, or B unable to load the kernel, NCCL sums them all, and nothing is agreed.
    Before: across daemons NCCL summed every one, the kernel set or not."""
    caplog.set_level(logging.INFO, logger="commd.engine.nccl")
    member_gpu = cast(Gpu, WithoutNvrtc(gpu)) if case == "B without NVRTC" else gpu
    root, member = two_daemons(member_gpu)
    world, driver = world_name("gpu"), WorkerDriver(gpu)
    inputs = [[make_input(40 + i, r, 2048, "bf16", "sum") for r in range(2)] for i in range(SUMS)]
    floats = [make_input(90, r, 64, "f32", "sum") for r in range(2)]

    def rank(r: int) -> list[bytes]:
        driver.set_device(r)
        out = []
        with DaemonBackend(str((root if r == 0 else member).socket_path), world, r, 2, device=r, timeout=20,
                           cuda_driver=lambda: driver, bootstrap=root.peer_address) as comm:
            for i in range(SUMS):
                if i == (0 if r == 0 else SET_LATE) and (r == 0 or case != "rank 0 only"):
                    comm.set_add_kernel(0xADD)
                if i == SUMS - 3 and case == "both":  # (the agreement is under way: wait for it)
                    wait_until(lambda: len(agreed(caplog, world)) == 2, "both daemons to agree")
                ptr = driver.alloc(inputs[i][r].tobytes(), device=r)
                comm.all_reduce(ptr, inputs[i][r].nbytes)
                out.append(gpu.read(ptr, inputs[i][r].nbytes))
                other = driver.alloc(floats[r].tobytes(), device=r)
                comm.all_reduce(other, floats[r].nbytes, dtype="f32")
                assert gpu.read(other, floats[r].nbytes) == reduce_reference(floats, "f32", "sum").tobytes()
        return out

    adds = gpu.adds
    out = run_ranks(2, rank)
    expected = summed(inputs)
    assert out == [expected, expected]
    taken = gpu.adds - adds
    if case != "both":
        assert taken == 0 and agreed(caplog, world) == []
        if case == "B without NVRTC":
            assert any("the add kernel is not available, NCCL sums: libnvrtc" in r.getMessage()
                       for r in caplog.records), "B did not say why it sums with NCCL"
        return
    first = agreed(caplog, world)
    assert first[0] == first[1], first  # the same collective on both daemons
    # Collectives are numbered from 0 in the order called: sum i is collective 2 i.
    assert 2 * SET_LATE <= first[0] <= 2 * (SUMS - 3), first
    assert taken == 2 * sum(1 for i in range(SUMS) if 2 * i >= first[0]), (taken, first)


def test_the_daemons_agree_in_the_middle_of_async_sums(gpu: FakeGpu, two_daemons: Daemons,
                                                       caplog: pytest.LogCaptureFixture) -> None:
    """Each rank makes 40 all_reduce_async calls in a row on its stream (answered once
    ordered, so the daemons launch them as fast as they come, the root's held back while
    it waits for the member's answer), rank 1 setting the kernel after its tenth; then a
    synchronous f32 all_reduce on the same stream, after which every sum is in place.
    Every result is NCCL's, and the sums from the agreed collective on took the path on
    both daemons."""
    caplog.set_level(logging.INFO, logger="commd.engine.nccl")
    root, member = two_daemons(gpu)
    world, driver = world_name("gpu"), WorkerDriver(gpu)
    count = 40
    inputs = [[make_input(200 + i, r, 1024, "bf16", "sum") for r in range(2)] for i in range(count)]
    floats = [make_input(91, r, 64, "f32", "sum") for r in range(2)]
    streams = [gpu.worker_stream(0), gpu.worker_stream(1)]

    def rank(r: int) -> list[bytes]:
        driver.set_device(r)
        daemon = root if r == 0 else member
        with DaemonBackend(str(daemon.socket_path), world, r, 2, device=r, timeout=20,
                           cuda_driver=lambda: driver, bootstrap=root.peer_address,
                           stream=streams[r]) as comm:
            if r == 0:
                comm.set_add_kernel(0xADD)
            ptrs = [driver.alloc(inputs[i][r].tobytes(), device=r) for i in range(count)]
            for i, ptr in enumerate(ptrs):
                if r == 1 and i == 10:
                    comm.set_add_kernel(0xADD)
                comm.all_reduce_async(ptr, inputs[i][r].nbytes, streams[r])
            other = driver.alloc(floats[r].tobytes(), device=r)
            comm.all_reduce(other, floats[r].nbytes, dtype="f32")
            assert gpu.read(other, floats[r].nbytes) == reduce_reference(floats, "f32", "sum").tobytes()
            return [gpu.read(ptr, inputs[i][r].nbytes) for i, ptr in enumerate(ptrs)]

    adds = gpu.adds
    out = run_ranks(2, rank)
    expected = summed(inputs)
    assert out == [expected, expected]
    first = agreed(caplog, world)
    assert len(first) == 2 and first[0] == first[1], first
    assert 10 <= first[0] <= count, first  # (sum i is collective i)
    assert gpu.adds - adds == 2 * (count - first[0]), (gpu.adds - adds, first)


@pytest.mark.parametrize("member_order", ["send, sum, recv", "sum, recv, send"])
def test_a_group_of_sends_and_an_add_path_sum(gpu: FakeGpu, two_daemons: Daemons,
                                              caplog: pytest.LogCaptureFixture, member_order: str) -> None:
    """Once agreed, each rank calls one group (group_start ... group_end) of a send to the
    other, a bf16 sum and a receive from the other; rank 1 in the order `member_order`. The
    sum's exchange launches alone on each daemon; the group's send and receive launch in one
    NCCL group before it, whatever their places in the group. Before: each daemon launched
    what came before the sum, the sum, then what came after: rank 0's send alone waited for
    rank 1's receive, queued behind rank 1's own send or exchange, which waited for rank 0's
    (a call deadline, CommTimeout)."""
    caplog.set_level(logging.INFO, logger="commd.engine.nccl")
    root, member = two_daemons(gpu)
    world, driver = world_name("gpu"), WorkerDriver(gpu)
    sums = [[make_input(300 + i, r, 1024, "bf16", "sum") for r in range(2)] for i in range(2)]
    payload = [bytes([r + 1]) * 4096 for r in range(2)]

    def rank(r: int) -> tuple[bytes, bytes, bytes]:
        driver.set_device(r)
        with DaemonBackend(str((root if r == 0 else member).socket_path), world, r, 2, device=r, timeout=10,
                           cuda_driver=lambda: driver, bootstrap=root.peer_address) as comm:
            comm.set_add_kernel(0xADD)
            wait_until(lambda: len(agreed(caplog, world)) == 2, "both daemons to agree")
            first = driver.alloc(sums[0][r].tobytes(), device=r)
            comm.all_reduce(first, sums[0][r].nbytes)
            out, into = driver.alloc(payload[r], device=r), driver.alloc(b"\0" * 4096, device=r)
            summed = driver.alloc(sums[1][r].tobytes(), device=r)
            calls = {"send": lambda: comm.send_to(out, 4096, 1 - r),
                     "sum": lambda: comm.all_reduce(summed, sums[1][r].nbytes),
                     "recv": lambda: comm.recv_from(into, 4096, 1 - r)}
            comm.group_start()
            for name in (member_order if r == 1 else "send, sum, recv").split(", "):
                calls[name]()
            comm.group_end()
            comm.barrier()  # (the group's sends and receives are answered once ordered)
            return (gpu.read(first, sums[0][r].nbytes), gpu.read(summed, sums[1][r].nbytes),
                    gpu.read(into, 4096))

    adds = gpu.adds
    out = run_ranks(2, rank)
    expected = summed(sums)
    assert out == [(expected[0], expected[1], payload[1]), (expected[0], expected[1], payload[0])]
    assert gpu.adds - adds == 4  # both sums took the path on both daemons
    assert agreed(caplog, world) == [0, 0]


def test_a_world_rebuilt_after_a_rank_left_agrees_again(gpu: FakeGpu, two_daemons: Daemons,
                                                        caplog: pytest.LogCaptureFixture) -> None:
    """Both daemons agree and sum three bf16 sums by exchange; then rank 1 (on B) closes and
    connects again as a new worker, setting the kernel again, while rank 0 hears the world
    failed and calls attempt_reconnect (A keeps its rank's kernel across epochs). The new
    epoch's communicators agree again (two more log lines), and its three sums take the
    path on both daemons, every result NCCL's. (Coverage: it passed at 2c392f4.)"""
    caplog.set_level(logging.INFO, logger="commd.engine.nccl")
    root, member = two_daemons(gpu)
    world, driver = world_name("gpu"), WorkerDriver(gpu)
    inputs = [[make_input(500 + i, r, 1024, "bf16", "sum") for r in range(2)] for i in range(6)]
    left = threading.Event()

    def sums(comm: DaemonBackend, r: int, which: range) -> list[bytes]:
        out = []
        for i in which:
            ptr = driver.alloc(inputs[i][r].tobytes(), device=r)
            comm.all_reduce(ptr, inputs[i][r].nbytes)
            out.append(gpu.read(ptr, inputs[i][r].nbytes))
        return out

    def rank(r: int) -> list[bytes]:
        driver.set_device(r)
        path = str((root if r == 0 else member).socket_path)
        def connect() -> DaemonBackend:
            return DaemonBackend(path, world, r, 2, device=r, timeout=20, cuda_driver=lambda: driver,
                                 bootstrap=root.peer_address)

        comm = connect()
        comm.set_add_kernel(0xADD)
        wait_until(lambda: len(agreed(caplog, world)) == 2, "first agreement")
        out = sums(comm, r, range(3))
        if r == 1:
            comm.close()
            left.set()
            comm = connect()
            comm.set_add_kernel(0xADD)
        else:
            assert left.wait(10)
            with pytest.raises(CommError):
                comm.barrier()
            comm.attempt_reconnect()
        try:
            wait_until(lambda: len(agreed(caplog, world)) == 4, "second agreement")
            out += sums(comm, r, range(3, 6))
        finally:
            comm.close()
        return out

    adds = gpu.adds
    out = run_ranks(2, rank)
    expected = summed(inputs)
    assert out == [expected, expected]
    assert gpu.adds - adds == 12


def test_a_mismatched_sum_after_the_agreement_is_a_mismatch_on_both_ranks(
        gpu: FakeGpu, two_daemons: Daemons, caplog: pytest.LogCaptureFixture) -> None:
    """Once agreed, rank 0 sums bf16 (an exchange on A) while rank 1 sums f32 of the same
    bytes (B's ncclAllReduce): the two sides' kernels never meet, on a GPU as on the fake.
    The root's fingerprint check finds the mismatch and aborts the communicators: both
    calls fail with MismatchError naming both calls, well before their deadline, and
    neither buffer holds a wrong result."""
    from client import MismatchError

    caplog.set_level(logging.INFO, logger="commd.engine.nccl")
    root, member = two_daemons(gpu)
    world, driver = world_name("gpu"), WorkerDriver(gpu)
    data = [make_input(700, r, 1024, "bf16", "sum").tobytes() for r in range(2)]

    def rank(r: int) -> tuple[BaseException | None, bytes]:
        driver.set_device(r)
        with DaemonBackend(str((root if r == 0 else member).socket_path), world, r, 2, device=r, timeout=20,
                           cuda_driver=lambda: driver, bootstrap=root.peer_address) as comm:
            comm.set_add_kernel(0xADD)
            wait_until(lambda: len(agreed(caplog, world)) == 2, "both daemons to agree")
            ptr = driver.alloc(data[r], device=r)
            try:
                comm.all_reduce(ptr, len(data[r]), dtype="bf16" if r == 0 else "f32")
            except MismatchError as exc:
                return exc, gpu.read(ptr, len(data[r]))
            return None, gpu.read(ptr, len(data[r]))

    out = cast(list[tuple[BaseException | None, bytes]], run_ranks(2, rank))
    for r, (error, left) in enumerate(out):
        assert isinstance(error, MismatchError), (r, error)
        words = str(error)
        assert "rank 0 called all_reduce" in words and "rank 1 called all_reduce" in words, words
        assert "bf16" in words and "f32" in words, words
        assert left == data[r]  # no sum of the wrong kind landed
