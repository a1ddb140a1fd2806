"""A rank's record of its world's failure: the newest failure wins, a rebuild clears only
older ones, and what each thread has met is its own."""

from __future__ import annotations

import threading

import pytest

from client.errors import DaemonUnavailable, WorldFailed
from client.health import Health
from proto import ErrorCode

pytestmark = pytest.mark.timeout(10)


def on_record(health: Health) -> tuple[type, str, int]:
    failure, about = health.failure()
    assert failure is not None
    return type(failure), str(failure), about


def test_a_failure_is_kept_without_the_frames_it_went_through() -> None:
    health = Health(threading.RLock())
    try:
        raise WorldFailed("epoch 2", ErrorCode.WORLD_FAILED)
    except WorldFailed as exc:
        health.record(exc, 2)
    failure, _ = health.failure()
    assert failure is not None and failure.__traceback__ is None
    assert failure.code is ErrorCode.WORLD_FAILED


def test_a_newer_failure_replaces_an_older_one_and_not_the_other_way() -> None:
    health = Health(threading.RLock())
    assert health.failure() == (None, 0)
    first, newer, older = WorldFailed("epoch 2"), WorldFailed("epoch 3"), DaemonUnavailable("epoch 1")
    health.record(first, 2)
    health.record(older, 1)
    assert on_record(health) == (WorldFailed, "epoch 2", 2)
    health.record(newer, 3)
    assert on_record(health) == (WorldFailed, "epoch 3", 3)


def test_a_rebuild_clears_every_failure_but_one_of_its_own_epoch() -> None:
    health = Health(threading.RLock())
    met_by_the_new_epoch = WorldFailed("epoch 4")
    health.record(met_by_the_new_epoch, 4)
    health.repaired_up_to(4)
    assert on_record(health) == (WorldFailed, "epoch 4", 4)
    health.repaired_up_to(5)
    assert health.failure() == (None, 0)
    health.record(WorldFailed("epoch 9, which the world never reached"), 9)
    health.repaired_up_to(6)
    assert health.failure() == (None, 0)


def test_each_thread_knows_only_the_failures_it_met() -> None:
    health = Health(threading.RLock())
    assert health.met_at() is None
    health.record(WorldFailed("epoch 2"), 2)
    failure, about = health.tell_thread()
    assert failure is not None and about == 2 and health.met_at() == 2
    seen: list[int | None] = []
    other = threading.Thread(target=lambda: seen.append(health.met_at()))
    other.start()
    other.join(5)
    assert seen == [None]  # (the other thread has met nothing)
    health.repaired_up_to(3)
    assert health.tell_thread() == (None, 0) and health.met_at() is None  # healthy: behind it
