"""Tasks an object starts and holds until they end.

The event loop keeps only weak references to tasks: one that nothing else holds can be
collected while it waits, and its work silently never finishes. Every fire-and-forget task
of the daemon is spawned through a `HeldTasks`.
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine, Iterator
from typing import Any, TypeVar

T = TypeVar("T")


class HeldTasks:
    def __init__(self) -> None:
        self._held: set[asyncio.Task[Any]] = set()

    def spawn(self, work: Coroutine[Any, Any, T]) -> asyncio.Task[T]:
        task = asyncio.get_running_loop().create_task(work)
        self._held.add(task)
        task.add_done_callback(self._held.discard)
        return task

    def __len__(self) -> int:
        return len(self._held)

    def __iter__(self) -> Iterator[asyncio.Task[Any]]:
        return iter(list(self._held))  # (a copy: a task ending while one iterates leaves the set)
