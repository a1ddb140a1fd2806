"""Which of the worker's buffers the daemon has imported, and what it is owed."""

from __future__ import annotations


class ImportedBuffers:
    """The buffers the daemon of the current connection has imported, and the Forgets owed
    to it (they go with the next request on that connection). A daemon a rejoin replaced
    took its imports with it: `new_daemon` starts afresh. Changed under the backend's lock;
    `in` is also read under its import lock alone (a set lookup, atomic under the GIL)."""

    def __init__(self) -> None:
        self._held: set[int] = set()
        self._owed: list[int] = []

    def __contains__(self, buffer_id: int) -> bool:
        return buffer_id in self._held

    def add(self, buffer_id: int) -> None:
        self._held.add(buffer_id)

    def release(self, buffer_id: int, *, forget: bool = True) -> None:
        """The worker let go of the buffer: the daemon is owed a Forget (unless it never
        had the buffer, or lets go of it anyway: `forget` False)."""
        if buffer_id in self._held:
            self._held.discard(buffer_id)
            if forget:
                self._owed.append(buffer_id)

    def owe(self, buffer_id: int) -> None:
        """An import that timed out: the daemon may hold the buffer all the same."""
        self._owed.append(buffer_id)

    def take_owed(self) -> list[int]:
        owed, self._owed = self._owed, []
        return owed

    def new_daemon(self) -> None:
        self._held.clear()
        self._owed.clear()
