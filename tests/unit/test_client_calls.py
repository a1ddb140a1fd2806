"""The client's op cache and per-thread groups, on their own."""

from __future__ import annotations

import _thread
import threading
import time

import pytest

import proto
from client import MisuseError
from client.groups import Basis, Groups, OpenGroup
from client.hostmem import HostMemory
from client.memory import MemoryResolver
from client.opcache import OpCache

pytestmark = pytest.mark.timeout(30)
BASIS = Basis(link=0, epoch=1)


def no_driver() -> None:
    return None


def cache() -> OpCache:
    return OpCache(MemoryResolver(HostMemory(), driver=no_driver))


def test_a_built_op_is_reused_until_cleared() -> None:
    ops, built = cache(), []

    def build() -> proto.Op:
        built.append(1)
        return proto.AllReduce(proto.Mem(7, 0), 8)

    first = ops.get(("ar", 1), build)
    assert ops.get(("ar", 1), build) == first == (proto.AllReduce(proto.Mem(7, 0), 8), ())
    assert len(built) == 1
    ops.clear()
    ops.get(("ar", 1), build)
    assert len(built) == 2


def test_a_host_op_is_not_reused_once_a_host_buffer_begins_to_go() -> None:
    """A buffer's address is free for reuse as soon as it is unmapped, before the backend
    hears of it: a cached op on host memory is stale from the moment a release begins."""
    memory = HostMemory()
    ops, built = OpCache(MemoryResolver(memory, driver=no_driver)), []

    def build() -> proto.Op:
        built.append(1)
        return proto.AllReduce(proto.Mem(7, 0), 8)

    ops.get(("ar", 1), build)
    memory.alloc(8).close()  # unmapped; nobody has cleared the cache
    ops.get(("ar", 1), build)
    assert len(built) == 2
    ops.get(("ar", 1), build)
    assert len(built) == 2  # (and kept again)


def test_an_op_built_across_a_clear_is_used_once_not_kept() -> None:
    """A buffer released while another thread built an op naming it: that op may name the
    released buffer, so the cache must not keep it (its address may be reused)."""
    ops, built = cache(), []

    def build() -> proto.Op:
        built.append(1)
        if len(built) == 1:
            ops.clear()  # what a release on another thread does meanwhile
        return proto.Broadcast(proto.Mem(len(built), 0), 4, 0)

    assert ops.get(("bc",), build)[0] == proto.Broadcast(proto.Mem(1, 0), 4, 0)
    assert ops.get(("bc",), build)[0] == proto.Broadcast(proto.Mem(2, 0), 4, 0)  # built afresh
    assert ops.get(("bc",), build)[0] == proto.Broadcast(proto.Mem(2, 0), 4, 0)  # and kept
    assert len(built) == 2


def test_a_finalizer_that_clears_the_cache_while_this_thread_holds_it_does_not_deadlock() -> None:
    """A HostBuffer freed by a garbage collection that starts while this thread holds the
    cache's lock (any allocation there can start one) reaches clear() through the backend,
    on this thread. Here the finalizer runs when a full cache drops its entries: a key whose
    last reference goes with them clears the cache, as that buffer's release would (before:
    a plain Lock, which waited for itself for ever; found with a collection starting in
    the full cache's clear under a profiler, after 1024 distinct calls)."""
    ops = cache()

    class Released:
        def __del__(self) -> None:
            ops.clear()

    def build() -> proto.Op:
        return proto.AllReduce(proto.Mem(7, 0), 8)

    ops.get(("ar", Released()), build)  # the cache holds the only reference to its key
    for k in range(1, 1024):
        ops.get(("ar", k), build)
    outcome: list[object] = []
    caller = threading.Thread(target=lambda: outcome.append(ops.get(("ar", "one more"), build)), daemon=True)
    caller.start()  # the cache is full: this call drops every entry, and with them the key
    caller.join(10)
    assert not caller.is_alive(), "the call waits for the lock its own thread holds"
    assert outcome == [(build(), ())]
    assert ops.get(("ar", 1), lambda: proto.Barrier()) == (proto.Barrier(), ())  # cleared: built anew


def test_groups_nest_and_belong_to_their_thread() -> None:
    groups = Groups(on_dropped=lambda group: None)
    groups.start(BASIS)
    groups.start(BASIS)
    groups.current().add(proto.Barrier(), None, early=False)  # type: ignore[union-attr]
    seen: list[object] = []
    other = threading.Thread(target=lambda: seen.append(groups.current()))
    other.start()
    other.join(5)
    assert seen == [None]  # another thread has no open group
    assert groups.end() is None  # still open: the outer group_start
    done = groups.end()
    assert done is not None and done.ops == [proto.Barrier()] and done.streams == {} and done.early
    assert groups.current() is None
    with pytest.raises(MisuseError):
        groups.end()


def open_group_pinning(groups: Groups, buffer_id: int) -> OpenGroup:
    """This thread's group, opened with one call that pins `buffer_id`."""
    groups.start(BASIS)
    group = groups.current()
    assert group is not None
    group.add(proto.Barrier(), None, early=False, pinned=(buffer_id,))
    return group


def test_the_group_of_a_thread_that_ended_inside_it_is_abandoned_once() -> None:
    groups = Groups(on_dropped=lambda group: None)
    groups.start(BASIS)  # (this thread's, alive: never abandoned)
    opened: list[OpenGroup] = []
    go = threading.Event()

    def leaves_its_group_open() -> None:
        opened.append(open_group_pinning(groups, 7))
        assert go.wait(5)

    other = threading.Thread(target=leaves_its_group_open)
    other.start()
    try:
        while not opened:
            assert other.is_alive()
            time.sleep(0.001)
        assert groups.abandoned() == []  # open, and its thread still running
    finally:
        go.set()
        other.join(5)
    assert groups.abandoned() == opened and opened[0].pinned == [7]  # (what the backend unpins)
    assert groups.abandoned() == []
    assert groups.current() is not None and groups.end() is not None  # ours stayed open


def test_a_group_on_device_memory_follows_every_stream_once() -> None:
    groups = Groups(on_dropped=lambda group: None)
    groups.start(BASIS)
    group = groups.current()
    assert group is not None
    group.add(proto.Barrier(), 5, early=True)
    group.add(proto.Barrier(), 9, early=False)
    group.add(proto.Barrier(), 5, early=True)
    assert list(group.streams) == [5, 9] and not group.early
    assert group.timed
    group.add(proto.Barrier(), None, early=False, timed=False)  # a recv_command_u32
    assert not group.timed


def test_drop_all_ends_every_open_group_and_a_full_group_refuses() -> None:
    dropped: list[OpenGroup] = []
    groups = Groups(on_dropped=dropped.append)
    groups.start(BASIS)
    group = groups.current()
    assert group is not None
    for _ in range(proto.MAX_GROUP_OPS):
        group.add(proto.Barrier(), None, early=False, pinned=(3,))
    with pytest.raises(MisuseError):
        group.add(proto.Barrier(), None, early=False)
    groups.drop_all()
    with pytest.raises(MisuseError, match="reconnect ended"):
        groups.current()  # told once: its calls would not be the group they were meant for
    assert dropped == [group]  # (the thread met the end of that epoch's world)
    assert group.pinned == [3] * proto.MAX_GROUP_OPS  # (what the backend unpins then)
    assert groups.current() is None
    with pytest.raises(MisuseError, match="without group_start"):
        groups.end()
    for meets_it in (groups.end, lambda: groups.start(BASIS)):  # group_end, or a nested start
        groups.start(BASIS)
        groups.drop_all()
        with pytest.raises(MisuseError, match="reconnect ended"):
            meets_it()
    assert groups.current() is None
    groups.start(BASIS)  # after the reconnect: a new group
    assert groups.current() is not None


def test_a_thread_python_did_not_start_has_its_own_group_and_abandons_it() -> None:
    """A thread started outside `threading` (native code calling in, `_thread`) is a
    `_DummyThread` to Python: never "not alive", and handed to the next such thread that
    reuses its id. Its group must end with it, as a `threading.Thread`'s does."""
    groups = Groups(on_dropped=lambda group: None)
    opened: list[OpenGroup] = []
    seen: list[OpenGroup | None] = []
    first_done, second_done = threading.Event(), threading.Event()

    def leaves_its_group_open() -> None:
        opened.append(open_group_pinning(groups, 7))
        first_done.set()

    def calls_alone() -> None:
        seen.append(groups.current())
        second_done.set()

    _thread.start_new_thread(leaves_its_group_open, ())
    assert first_done.wait(5)
    deadline = time.monotonic() + 5
    abandoned: list[OpenGroup] = []
    while not abandoned and time.monotonic() < deadline:  # (its locals go once it has ended)
        abandoned = groups.abandoned()
        time.sleep(0.01)
    assert abandoned == opened and opened[0].pinned == [7]  # (before: never, its pins held for good)
    _thread.start_new_thread(calls_alone, ())  # (likely under the same thread id)
    assert second_done.wait(5)
    assert seen == [None]  # its calls are its own, not the ended thread's group's
