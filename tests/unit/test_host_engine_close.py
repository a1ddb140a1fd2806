"""The host engine closed while worlds still hand it ops (the daemon stopping under load):
each such op fails with SHUTDOWN, as the daemon's other calls do, not with the thread pool's
RuntimeError, which the daemon logged as an engine failure (a traceback per op)."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from commd.engine.base import AllReduceOp
from commd.engine.host import HostEngine
from commd.engine.hostmemory import HostRegion
from commd.engine.hostnet import off_loop
from commd.errors import CallError
from proto import DType, ErrorCode, ReduceOp

pytestmark = pytest.mark.timeout(30)


async def test_an_op_after_the_engine_closed_fails_with_shutdown() -> None:
    engine = HostEngine(threads=2, inline_bytes=1024)
    comm = engine.communicator("job-1", 1, 2, [0, 1])
    bufs = {rank: HostRegion(np.full(1 << 20, rank + 1, np.uint8)) for rank in range(2)}
    await comm.run(AllReduceOp(bufs, DType.U8, ReduceOp.SUM))  # (on the engine's threads)
    assert all((region.array == 3).all() for region in bufs.values())
    engine.close()
    with pytest.raises(CallError) as info:
        await comm.run(AllReduceOp(bufs, DType.U8, ReduceOp.SUM))
    assert info.value.code is ErrorCode.SHUTDOWN
    assert all((region.array == 3).all() for region in bufs.values())  # (nothing ran)


async def test_work_off_the_loop_after_its_pool_closed_fails_with_shutdown() -> None:
    """The cross-daemon runner's own steps (a chunk's sum, a fold) go the same way."""
    pool = ThreadPoolExecutor(1)
    assert await off_loop(pool, lambda: 6 * 7) == 42
    pool.shutdown()
    with pytest.raises(CallError) as info:
        await off_loop(pool, lambda: 6 * 7)
    assert info.value.code is ErrorCode.SHUTDOWN
