"""What a rank knows of its world's failure, as a whole and per thread."""

from __future__ import annotations

import threading

from .errors import CommError, detached


class Health:
    """The newest failure on record (why, and the epoch it is about), and per thread the
    epoch of the failure that thread last met (a call's error, or is_healthy() false),
    None once it reconnected or saw a collective work since. attempt_reconnect tells by
    the latter a thread's late vote for a rebuild another thread already made from a
    vote for a new one.

    Guarded by the backend's lock, which also moves the epoch and the connection the
    record is judged against (the backend decides what is stale before recording)."""

    def __init__(self, lock: threading.RLock) -> None:
        self._lock = lock
        self._failure: CommError | None = None
        self._about = 0
        self._per_thread = threading.local()

    def record(self, why: CommError, about: int) -> None:
        """The world of epoch `about` failed: a newer failure replaces an older one (the
        reconnect under way clears only the older)."""
        with self._lock:
            if self._failure is None or about > self._about:
                self._failure, self._about = detached(why), about

    def failure(self) -> tuple[CommError | None, int]:
        """The failure on record and the epoch it is about (None, 0: healthy)."""
        # None, every healthy call's answer, is read without the lock: one recorded meanwhile
        # is as if recorded just after (once one is seen, the lock gives the pair whole)
        if self._failure is None:
            return None, 0
        with self._lock:
            return self._failure, self._about

    def repaired_up_to(self, epoch: int) -> None:
        """A rebuild reached `epoch`: a failure of an older epoch is over (one the new epoch
        met stays). One of a later epoch never was (the world had not reached it: the daemon
        made it up), and kept it would outlast every rebuild."""
        with self._lock:
            if self._about != epoch:
                self._failure, self._about = None, 0

    def met(self, epoch: int) -> None:
        """The calling thread learns that the world of `epoch` failed."""
        self._per_thread.failed_at = epoch

    def behind(self) -> None:
        """The calling thread has no failure to handle any more."""
        self._per_thread.failed_at = None

    def met_at(self) -> int | None:
        """The epoch of the failure the calling thread last met and has not put behind it."""
        failed_at: int | None = getattr(self._per_thread, "failed_at", None)
        return failed_at

    def tell_thread(self) -> tuple[CommError | None, int]:
        """The failure on record, which the calling thread now knows of (met, or behind it
        if there is none)."""
        failure, about = self.failure()
        if failure is None:
            self.behind()
        else:
            self.met(about)
        return failure, about
