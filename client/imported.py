"""Which of the worker's buffers the daemon has imported, and what it is owed."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable


class ImportedBuffers:
    """The buffers the daemon of the current connection has imported, and the Forgets owed
    to it (they go with the next request on that connection). A daemon a rejoin replaced
    took its imports with it: `new_daemon` starts afresh. Changed under the backend's lock;
    `in` is also read under its import lock alone (a set lookup, atomic under the GIL).

    A buffer named by an op not yet sent is pinned: its Forget (another thread's call may
    evict it from the CUDA cache meanwhile) waits until the op is sent, or the daemon would
    get it first and refuse the op as naming a buffer it never imported."""

    def __init__(self) -> None:
        self._held: set[int] = set()
        self._owed: list[int] = []
        # Forgets of imports that timed out: unlike a freed buffer's, the buffer may be
        # imported again, and its Forget must go before that Import (see take_owed)
        self._unsure: list[int] = []
        self._pinned: Counter[int] = Counter()

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
        self._unsure.append(buffer_id)

    def owe_freed(self, buffer_ids: Iterable[int]) -> None:
        """Freed buffers' Forgets taken and not sent: owed again."""
        self._owed.extend(buffer_ids)

    def pin(self, buffer_ids: Iterable[int]) -> None:
        self._pinned.update(buffer_ids)

    def unpin(self, buffer_ids: Iterable[int]) -> None:
        for buffer_id in buffer_ids:
            left = self._pinned[buffer_id] - 1
            if left:
                self._pinned[buffer_id] = left
            else:
                del self._pinned[buffer_id]

    def owes(self) -> bool:
        """Whether any Forget may be owed (reads atomic under the GIL: asked without the
        backend's lock, see Connection._send_releases). While a buffer is pinned, always:
        take_owed empties the owed list before it puts the pinned ones back, and a timed-out
        import's Forget read as not owed in that gap would let its next Import go first."""
        return bool(self._owed or self._unsure or self._pinned)

    def take_owed(self, freed_only: bool = False) -> list[int]:
        """The Forgets to send now; a pinned buffer's wait. A timed-out import's must reach
        the daemon before that buffer's next Import (which the daemon refuses while it holds
        the buffer): it is taken only with the send lock held until it is sent, as a request
        does (Connection._send_releases). `freed_only`: not those, for a free's Forget sent at
        once, which takes the lock only as it sends (a freed buffer is never imported again)."""
        if not freed_only:
            self._owed, self._unsure = self._unsure + self._owed, []
        # Swapped out before it is looked through: a collection meanwhile (a finalizer on
        # this thread) may add a release, which must land in the list left owed, not in
        # one being split (where neither part would hold it)
        taken, self._owed = self._owed, []
        if not self._pinned:
            return taken
        waiting = [b for b in taken if b in self._pinned]
        self._owed.extend(waiting)
        return [b for b in taken if b not in self._pinned]

    def new_daemon(self) -> None:
        self._held.clear()
        self._owed.clear()
        self._unsure.clear()
