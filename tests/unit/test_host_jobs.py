"""How the host engine cuts a large op into jobs on the threads every world shares: jobs
of at most a few MiB, fed a few at a time, so another world's op waits behind a few of
them, not behind all of a 256 MiB op (s20/D measured its calls' p90 at 51 ms before, 5 ms
after; `scripts/bench_neighbours.py` measures it)."""

from __future__ import annotations

import asyncio
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from commd.engine.base import AllGatherOp, AllReduceOp, BroadcastOp, ReduceScatterOp
from commd.engine.host import _JOB_BYTES, _in_turns, _plan
from commd.engine.hostmemory import HostRegion
from commd.engine.hostnet import off_loop
from proto import DType, ReduceOp

pytestmark = pytest.mark.timeout(30)
MIB = 1 << 20


def regions(arrays: list[np.ndarray]) -> dict[int, HostRegion]:
    """The arrays' bytes, as the daemon maps a worker's memory."""
    return {rank: HostRegion(array.view(np.uint8)) for rank, array in enumerate(arrays)}


def test_a_large_all_reduce_is_cut_into_jobs_of_at_most_the_job_size_that_sum_it_whole() -> None:
    n, elems = 3, (24 * MIB + 12) // 4  # f32, not a multiple of the job size
    arrays = [np.full(elems, rank + 1, np.float32) for rank in range(n)]
    jobs = _plan(AllReduceOp(regions(arrays), DType.F32, ReduceOp.SUM), 2, _JOB_BYTES)
    assert len(jobs) == -(-arrays[0].nbytes // _JOB_BYTES) == 7
    for job in reversed(jobs):  # (disjoint: any order gives the whole sum)
        job()
    assert all((array == 6).all() for array in arrays)


@pytest.mark.parametrize("kind", ["reduce_scatter", "all_gather", "broadcast"])
def test_other_large_ops_are_cut_to_the_job_size_too(kind: str) -> None:
    n, share = 2, 10 * MIB
    sends = [np.full(share * n if kind == "reduce_scatter" else share, rank + 1, np.uint8)
             for rank in range(n)]
    recvs = [np.zeros(share * n if kind == "all_gather" else share, np.uint8) for _ in range(n)]
    if kind == "reduce_scatter":
        op: object = ReduceScatterOp(regions(sends), regions(recvs), DType.U8, ReduceOp.SUM)
        want = [np.full(share, 3, np.uint8)] * n
    elif kind == "all_gather":
        op = AllGatherOp(regions(sends), regions(recvs))
        want = [np.repeat(np.arange(1, n + 1, dtype=np.uint8), share)] * n
    else:
        op = BroadcastOp(regions(sends), 1)
        want = [np.full(share, 2, np.uint8)] * n
    jobs = _plan(op, 2, _JOB_BYTES)  # type: ignore[arg-type]
    pieces = -(-share // _JOB_BYTES)
    # each output share (all_gather: each rank's block in each output) in pieces
    made = {"reduce_scatter": n * pieces, "all_gather": n * n * pieces, "broadcast": pieces}
    assert len(jobs) == made[kind]
    for job in jobs:
        job()
    outs = sends if kind == "broadcast" else recvs
    assert all((out == w).all() for out, w in zip(outs, want, strict=True))


async def test_an_ops_jobs_go_to_the_pool_a_few_at_a_time_so_another_worlds_job_runs_soon() -> None:
    """Two threads, an op of 20 jobs fed 2 at a time, and another world's job handed over
    once the op's first has started: it starts before the op's 5th (before: after its 20th,
    the whole op being queued at once)."""
    pool = ThreadPoolExecutor(2)
    starts: list[str] = []
    running, most = [0], [0]
    lock = threading.Lock()
    first = threading.Event()

    def job(name: str) -> None:
        with lock:
            starts.append(name)
            running[0] += 1
            most[0] = max(most[0], running[0])
        first.set()
        time.sleep(0.01)
        with lock:
            running[0] -= 1

    try:
        op = asyncio.ensure_future(_in_turns(pool, [lambda i=i: job(f"op{i}") for i in range(20)], 2))
        while not first.is_set():
            await asyncio.sleep(0.001)
        await off_loop(pool, lambda: job("other"))
        await op
    finally:
        pool.shutdown()
    assert sorted(starts) == sorted(["other"] + [f"op{i}" for i in range(20)])
    assert [s for s in starts if s != "other"] == [f"op{i}" for i in range(20)]  # in order
    assert starts.index("other") <= 4, starts
    assert most[0] <= 2
