"""The fake device's NCCL groups are per thread, as NCCL's are: two daemons on loop threads
of one process (tests/integration's GpuDaemon pairs) share one FakeGpu, and one's group
must neither hold nor launch the other's calls."""

from __future__ import annotations

import threading

import pytest

from commd.engine.gpu import CommState
from proto import DType, ReduceOp
from tests.contract.fakegpu import FakeGpu

pytestmark = pytest.mark.timeout(10)


def ready(gpu: FakeGpu, comm: int) -> None:
    for _ in range(10):
        if gpu.comm_state(comm)[0] is CommState.READY:
            return
    raise AssertionError("the communicator never settled")


def test_a_group_ended_on_one_thread_launches_while_another_thread_has_one_open() -> None:
    """Thread A opens a group with its rank's all_reduce in it; meanwhile this thread (daemon B)
    launches its rank's all_reduce in a group of its own: its group end launches it (the
    communicator is in progress until polled, then the sum is there once A launched too).
    Before: the group depth was shared, so B's group end only closed A's nesting level, and B's
    call waited in A's group, while its communicator read ready (an engine then queues work on
    the stream before the launch that should precede it; seen as 'work queued on stream N while
    an NCCL launch on it is in progress' in test_gpu_add_path, about 1 run in 4)."""
    gpu = FakeGpu(devices=2)
    uid = gpu.unique_id()
    comms = [gpu.comm_init(2, uid, rank, rank) for rank in range(2)]
    streams = [gpu.stream_create(rank) for rank in range(2)]
    bufs = [gpu.alloc(8, rank).ptr for rank in range(2)]
    for rank in range(2):
        gpu.copy_in(bufs[rank], bytes([rank + 1]) * 8)
        ready(gpu, comms[rank])
    a_opened, b_ended = threading.Event(), threading.Event()
    failures: list[BaseException] = []

    def daemon_a() -> None:
        try:
            gpu.use_device(0)
            gpu.group_start()
            gpu.all_reduce(bufs[0], bufs[0], 8, DType.U8, ReduceOp.SUM, comms[0], streams[0])
            a_opened.set()
            assert b_ended.wait(5)
            gpu.group_end()
        except BaseException as exc:
            failures.append(exc)
            a_opened.set()

    a = threading.Thread(target=daemon_a)
    a.start()
    assert a_opened.wait(5)
    gpu.use_device(1)
    gpu.group_start()
    gpu.all_reduce(bufs[1], bufs[1], 8, DType.U8, ReduceOp.SUM, comms[1], streams[1])
    gpu.group_end()
    launched = gpu.comm_state(comms[1])[0]
    b_ended.set()
    a.join(5)
    assert failures == []
    assert launched is CommState.IN_PROGRESS  # its own launch, not yet polled past
    for rank in range(2):
        ready(gpu, comms[rank])
    assert [gpu.read(buf, 8) for buf in bufs] == [bytes([3]) * 8] * 2
    assert gpu.violations == []
