"""Who hears of a freed host buffer: every listener registered, also one registered while
a garbage collection frees a buffer on the same thread (a backend registers its listener
as it is made; a collection may start at any allocation)."""

from __future__ import annotations

import gc
import weakref
from typing import Any

import ml_dtypes
import numpy as np
import pytest

import proto
from client.errors import LimitExceeded, MisuseError
from client.hostmem import HostBuffer, HostMemory
from client.memory import MemoryResolver
from client.opcache import OpCache
from tests.conftest import garbage

pytestmark = pytest.mark.timeout(30)


class Listener:
    def __init__(self, name: str, heard: list[tuple[str, int]]) -> None:
        self.name, self.heard = name, heard

    def hear(self, buffer_id: int) -> None:
        self.heard.append((self.name, buffer_id))


def garbage_buffer(memory: HostMemory) -> int:
    """A buffer in a reference cycle, freed only by a collection; its id."""
    buffer = memory.alloc(8)
    garbage(buffer)
    return buffer.id


def test_a_listener_registered_while_a_collection_frees_a_buffer_hears_later_frees(
        monkeypatch: pytest.MonkeyPatch, no_automatic_collection: None) -> None:
    """Before: the collection's finalizer (same thread, reentrant lock) pruned the list into
    a new one while on_release was appending to the old, and the listener was lost: a
    backend made then never sent Forgets, and the daemon's buffer limit filled up."""
    memory, heard = HostMemory(), []
    first, second = Listener("first", heard), Listener("second", heard)
    memory.on_release(first.hear)
    collected = garbage_buffer(memory)
    real = weakref.WeakMethod

    def collecting(*args: object) -> object:
        gc.collect()  # as if this allocation had started a collection
        return real(*args)  # type: ignore[arg-type]

    monkeypatch.setattr(weakref, "WeakMethod", collecting)
    memory.on_release(second.hear)
    monkeypatch.undo()
    assert heard == [("first", collected)]  # the collection did free the buffer meanwhile
    later = memory.alloc(8)
    later.close()
    assert sorted(heard[1:]) == [("first", later.id), ("second", later.id)]


def test_dead_listeners_are_let_go_and_the_live_still_hear() -> None:
    memory, heard = HostMemory(), []
    kept = Listener("kept", heard)
    for name in ("a", "b", "c"):
        memory.on_release(Listener(name, heard).hear)  # dropped at once
    memory.on_release(kept.hear)
    assert len(memory._listeners) == 1  # the dead were pruned as it was added
    buffer: HostBuffer = memory.alloc(8)
    buffer.close()
    assert heard == [("kept", buffer.id)]


def test_a_listener_that_raises_does_not_keep_the_others_from_hearing() -> None:
    memory, heard = HostMemory(), []
    before, after = Listener("before", heard), Listener("after", heard)

    class Raising:
        def hear(self, buffer_id: int) -> None:
            raise RuntimeError(f"cannot take {buffer_id}")

    raising = Raising()
    memory.on_release(before.hear)
    memory.on_release(raising.hear)
    memory.on_release(after.hear)
    buffer = memory.alloc(8)
    with pytest.raises(RuntimeError, match=f"cannot take {buffer.id}"):
        buffer.close()
    assert heard == [("before", buffer.id), ("after", buffer.id)]
    assert buffer.closed and memory.locate(buffer.ptr) is None


def test_an_op_built_while_its_buffer_is_closed_is_not_reused() -> None:
    """A call on another thread locates a buffer that close() has unmapped but not yet
    taken out of the table: the op it builds names that buffer, and must not be served
    again once the address may hold another buffer (before: the count of releases had
    moved for the last time before the entry went, so the op stayed valid for good)."""
    memory = HostMemory()
    cache = OpCache(MemoryResolver(memory, driver=lambda: None))
    buffer = memory.alloc(64)
    key, built = ("ar", buffer.ptr), []

    def build() -> proto.Op:
        ref = memory.find(buffer.ptr, 8)
        built.append(ref[0].id)
        return proto.Barrier()  # (what it names does not matter to the cache's rule)

    real_released = memory._released

    def released_after_a_racing_call(buffer_id: int, ptr: int) -> None:
        cache.get(key, build)  # (as another thread's call, between the unmap and the entry going)
        real_released(buffer_id, ptr)

    memory._released = released_after_a_racing_call  # type: ignore[method-assign]
    buffer.close()
    assert built == [buffer.id]  # the racing call did find the closing buffer
    with pytest.raises(MisuseError):
        cache.get(key, build)  # a later call builds afresh: the address is no buffer now


@pytest.mark.parametrize("dtype", [ml_dtypes.bfloat16, np.float16, np.int64, np.uint8])
def test_a_view_has_the_dtype_asked_for_and_takes_assignment(dtype: Any) -> None:
    """(A view made through the array interface became a void array for ml_dtypes'
    bfloat16: assigning floats to it raised "No cast function available", the demo's
    first step.)"""
    buf = HostMemory().alloc(64)
    view = buf.view(dtype)
    assert view.dtype == np.dtype(dtype) and view.size == 64 // np.dtype(dtype).itemsize
    view[:] = np.arange(view.size) % 100
    assert view.astype(np.float64).tolist() == [float(i % 100) for i in range(view.size)]


@pytest.mark.parametrize("nbytes", [1 << 63, 10**20])
def test_a_size_past_what_a_mapping_can_hold_is_named_too_large(nbytes: int) -> None:
    """Before: 'cannot allocate 100000000000000000000 bytes of host memory here: Python int
    too large to convert to C long' (what `commd bench --sizes 10**20` printed): Python's
    words, naming no limit. The table is left as it was: the next buffer works."""
    memory = HostMemory()
    with pytest.raises(LimitExceeded) as raised:
        memory.alloc(nbytes)
    assert str(raised.value) == (f"cannot allocate {nbytes} bytes of host memory: more than the "
                                 f"{(1 << 63) - 1} bytes a mapping can hold")
    with memory.alloc(8) as buf:
        buf.view(np.int64)[0] = 7
        assert int(buf.view(np.int64)[0]) == 7
