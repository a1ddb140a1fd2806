"""attempt_reconnect's work: the world rebuilt once for all of a rank's threads that met
its failure, on the same daemon or by joining a restarted one, then told again what it
lacks."""

from __future__ import annotations

import threading
from collections.abc import Callable

import proto

from .addkernel import AddKernel
from .connection import Connection, check_past
from .errors import DaemonShutdown, DaemonUnavailable, LimitExceeded
from .health import Health
from .registrations import Registrations


class Reconnector:
    """Rebuilds the world `world` of `conn` at the next epoch (see
    DaemonBackend.attempt_reconnect). `lock` is the backend's, the one the epoch moves
    under; `due()` the deadline of a call starting now; `join_grace` how long past a
    join's deadline to wait for the daemon's word on it."""

    def __init__(self, world: str, lock: threading.RLock, conn: Connection, health: Health,
                 registrations: Registrations, add_kernel: AddKernel,
                 due: Callable[[], float], join_grace: float) -> None:
        self._world = world
        self._lock = lock
        self._conn = conn
        self._health = health
        self._registrations = registrations
        self._add_kernel = add_kernel
        self._due = due
        self._join_grace = join_grace
        self._reconnect_lock = threading.Lock()  # one attempt_reconnect of this rank at a time
        self._reconnects = 0  # that succeeded

    def attempt(self) -> None:
        """Reconnect, unless another thread's reconnect already replaced the failure the
        calling thread met (see DaemonBackend.attempt_reconnect); raise the LimitExceeded
        of a registration given up on once the world is rebuilt."""
        entered = self._reconnects
        failed_at = self._health.met_at()
        with self._reconnect_lock:
            self._conn.take_news()  # (another rank's vote since the rebuild has failed it again)
            with self._lock:
                # another thread reconnected while this one waited, or since its failure
                repaired = self._reconnects != entered or (
                    failed_at is not None and failed_at < self._conn.epoch)
                if repaired and self._health.failure()[0] is None:
                    self._health.behind()
                    return
            refusal = self._reconnect()
            self._reconnects += 1
            self._health.behind()
        if refusal is not None:  # (a limit: the world is rebuilt and healthy all the same)
            raise refusal

    def _reconnect(self) -> LimitExceeded | None:
        due = self._due()
        gone = self._conn.transport.broken  # why the connection to the daemon ended, if it did
        if gone is None:
            try:
                # like the hello: the daemon enforces the deadline and names missing ranks; give
                # its answer time to arrive rather than give up just before it does
                answer = self._conn.request(proto.Reconnect, due=due, grace=self._join_grace)
                epoch = answer.value()
                check_past(epoch, answer.epoch, f"the daemon rebuilt world {self._world}")
                with self._lock:
                    self._conn.new_epoch(epoch)
            except DaemonUnavailable as exc:  # it went away before we noticed: a restarted one, perhaps
                self._conn.check_open()  # (or close() on another thread broke it)
                gone = exc
        if gone is not None:
            try:
                self._conn.rejoin(due + self._join_grace, gone)
            except DaemonUnavailable as exc:
                if not isinstance(gone, DaemonShutdown) or isinstance(exc, DaemonShutdown):
                    raise
                # (the last try alone, 'cannot connect: No such file', hides that it stopped)
                raise DaemonShutdown(f"the daemon shut down, and none was back in time to rebuild world "
                                     f"{self._world}: {exc}; call attempt_reconnect once it is back",
                                     gone.code) from exc
        # What the daemon should know again: after a rejoin, all of it; after a rebuild on
        # the same daemon, what an earlier restoring left undone. By a deadline of its own:
        # the rebuild waited for the slowest rank, and may have taken all of the call's.
        restore = self._due()
        refusal: LimitExceeded | None = None
        try:
            self._registrations.register_again(restore)
        except LimitExceeded as exc:
            refusal = exc
        self._add_kernel.tell(restore)
        self._health.repaired_up_to(self._conn.epoch)
        return refusal

