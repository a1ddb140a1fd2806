"""The add kernel's handle (set_add_kernel), and telling it to each daemon."""

from __future__ import annotations

import contextlib
import threading

import proto

from .connection import Connection
from .errors import UNHEALTHY
from .rpc import Superseded, built


class AddKernel:
    """The handle the worker set last, told to the daemon of `conn`: at once, and to each
    daemon a rejoin reaches. `lock` is the backend's."""

    def __init__(self, lock: threading.RLock, conn: Connection) -> None:
        self._lock = lock
        self._conn = conn
        self.handle: int | None = None

    def set(self, handle: int, due: float) -> None:
        # The seed's call cannot fail, and the handle holds from here on even if telling the
        # daemon fails (it went away, the world failed): a rejoin tells the new one, as it
        # does after a restart (undone, it could not be sure not to have told a rejoin's
        # daemon already). The failure shows as is_healthy() false and the next call's error.
        built(lambda: proto.SetAddKernel(1, handle))  # (a bad one is never kept)
        with self._lock:
            self.handle = handle
        with contextlib.suppress(*UNHEALTHY):
            self.tell(due)

    def tell(self, due: float) -> None:
        """Tell the daemon the newest handle, again if a rejoin replaced it meanwhile (it may
        have told the new one an older handle, or none)."""
        while True:
            with self._lock:
                handle, link = self.handle, self._conn.link
            if handle is None:
                return
            self.tell_at(handle, link, due)
            with self._lock:
                if (self.handle, self._conn.link) == (handle, link):
                    return

    def tell_at(self, handle: int, link: int, due: float) -> None:
        with contextlib.suppress(Superseded):  # (that daemon is gone: the caller tells the new one)
            self._conn.request(lambda rid: proto.SetAddKernel(rid, handle), due=due, link=link)
