"""Worker functions for the service tests (run in RankPool processes)."""

from __future__ import annotations

import numpy as np

from client import hostmem
from tests.integration.workers import connect


def reduce_then_wait(sock: str, world: str, rank: int, n: int, calls: int, nelem: int,
                     wait: bool) -> tuple[list[int], str]:
    """`calls` i32 all_reduces (rank r gives r + i), each result's first element; then, with
    `wait`, block (rank 0 in a recv nobody sends, the others in recv_command_u32) until
    something ends it, and say how it ended."""
    with connect(sock, world, rank, n) as comm:
        buf = hostmem.alloc(nelem * 4)
        sums = []
        for i in range(calls):
            buf.view(np.int32)[:] = rank + i
            comm.all_reduce(buf.ptr, nelem * 4, dtype="i32")
            sums.append(int(buf.view(np.int32)[-1]))
        if not wait:
            comm.barrier()  # every rank's calls are done before any leaves
            return sums, "done"
        try:
            if rank == 0:
                comm.recv_from(buf.ptr, 4, 1)
            else:
                comm.recv_command_u32(buf.ptr, 0)
            return sums, "returned"
        except Exception as exc:
            return sums, type(exc).__name__
