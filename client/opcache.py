"""Built ops, cached by their call's arguments: steady-state loops repeat the same calls."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import proto

from .memory import MemoryResolver

Key = tuple[object, ...]
_SIZE = 1024  # entries per kind; a full cache starts afresh


class OpCache:
    """An op on host memory is reused until any host buffer is released (its address may
    be reused by another): checked against the table's count of releases, which moves
    before the address is free, not only when the backend hears of it after. One naming
    CUDA allocations is reused only once they are checked alive again (one BUFFER_ID
    query each): an address freed and reused must never reach the daemon with the old
    buffer's id. Safe to use from several threads."""

    def __init__(self, resolver: MemoryResolver) -> None:
        self._resolver = resolver
        # Reentrant: a collection may start while this thread holds it, and a finalizer
        # that reaches the cache then must not wait for its own thread
        self._lock = threading.RLock()
        self._host: dict[Key, tuple[proto.Op, int]] = {}  # -> (op, host releases when built)
        self._device: dict[Key, tuple[proto.Op, tuple[int, ...]]] = {}
        self._generation = 0  # a clear since an op was built: it may name a released buffer

    def get(self, key: Key, build: Callable[[], proto.Op]) -> tuple[proto.Op, tuple[int, ...]]:
        """The op for `key`, and the CUDA allocations it names (none: host memory). `build`
        makes it when none is cached or alive; it runs outside the lock (it may import a
        buffer: a round trip)."""
        releases = self._resolver.host_releases()
        # Read without the lock (dict lookups are atomic under the GIL); the generation
        # first, so that an op built after a clear() that comes meanwhile is not kept
        generation = self._generation
        host = self._host.get(key)
        cached = self._device.get(key) if host is None else None
        if host is not None and host[1] == releases:
            return host[0], ()
        if cached is not None and self._resolver.still_valid(cached[1]):
            return cached
        with self._resolver.noting_device() as noted:
            op = build()
        device = tuple(mem.buf for mem in proto.mems_of(op) if mem.buf in noted)
        # (made before the lock: fewer collections under it)
        entry = (op, device) if device else (op, releases)
        with self._lock:
            cache: dict[Key, Any] = self._device if device else self._host
            if len(cache) >= _SIZE:
                cache.clear()
            if generation == self._generation:  # (after anything that may have run a finalizer)
                cache[key] = entry
        return op, device

    def clear(self) -> None:
        with self._lock:
            self._host.clear()
            self._device.clear()
            self._generation += 1
