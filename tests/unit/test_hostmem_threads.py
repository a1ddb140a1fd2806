"""Host buffers allocated and freed by several threads at once: the address table stays
exact (the kernel hands a just-unmapped address straight to the next mapping)."""

from __future__ import annotations

import threading
import time

import pytest

from client.hostmem import HostMemory

pytestmark = pytest.mark.timeout(60)


def test_concurrent_alloc_and_free_keep_the_table_exact() -> None:
    memory = HostMemory()
    stop = time.monotonic() + 3

    def churn() -> None:
        while time.monotonic() < stop:
            memory.alloc(4096).close()

    threads = [threading.Thread(target=churn) for _ in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    assert memory._starts == [] and memory._by_start == {}  # every freed buffer's entry is gone
    kept = memory.alloc(4096)
    assert memory.locate(kept.ptr) is kept and memory.locate(kept.ptr + 4095) is kept
    kept.close()
