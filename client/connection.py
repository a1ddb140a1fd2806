"""A rank's connection to its daemon, across rejoins (`Connection`)."""

from __future__ import annotations

import functools
import logging
import os
import threading
import time
from collections.abc import Callable, Sequence

import proto

from .errors import (
    UNHEALTHY,
    CommError,
    DaemonShutdown,
    DaemonUnavailable,
    MisuseError,
    ProtocolError,
    from_event,
)
from .groups import Basis
from .health import Health
from .rpc import Answer, Superseded, built, checked
from .transport import Abandon, Transport, Undo

# The least max_message a daemon may announce: every request but a group's Submit fits in
# it. The longest is a Forget of MAX_GROUP_OPS buffer ids: Forgets go ahead of the next
# request (_send_releases), so one refused for its size would fail every request after it
LEAST_MAX_MESSAGE = len(proto.encode(proto.Forget((2**64 - 1,) * proto.MAX_GROUP_OPS)))

log = logging.getLogger(__name__)


def check_past(epoch: int, left: int, what: str) -> None:
    """A rebuilt world starts past the epoch it left (it may have failed there): taken,
    that failure would never count as repaired, so a daemon that says otherwise is wrong."""
    if epoch <= left:
        raise ProtocolError(f"{what} at epoch {epoch}, not past {left}")


def _not_back_yet(error: DaemonUnavailable) -> bool:
    """Whether `error` met no daemon that could take the rank (none listening, a hang-up
    with no word, one stopping): a rejoin tries again. A daemon that is back and refuses
    the rank in a code this client does not know (an Error with id 0) would say it again,
    as a known refusal or an unknown one answering the hello would: raised at once."""
    return error.code is None or isinstance(error, DaemonShutdown)


class Connection:
    """The transport to the daemon, which daemon connection it is (`link`: each rejoin
    moves it on) and the world's epoch and the daemon's engine as last heard. Every request
    goes through `request`, which ties its answer, or its failure, to the link and epoch it
    was made under: what a connection or a world this rank has left behind since says is
    never recorded as the current one's (`Health`).

    `lock` is the backend's (its bookkeeping, never held over I/O): under it the transport,
    the link and the epoch move together with what is judged against them. `hello(epoch)`
    builds the hello at the last epoch seen; `owed(freed_only)` (under the lock) takes the buffer ids
    whose Forget the daemon is owed, and `owes()` (without it) says whether it may find any;
    `on_new_epoch()` (under the lock) and
    `on_new_daemon(link)` tell the backend what a rebuild and a rejoin leave behind."""

    transport: Transport  # (from open(): a failure during its hello is judged by _joining)

    def __init__(self, path: str, timeout: float, lock: threading.RLock, health: Health,
                 hello: Callable[[int], proto.Hello], owed: Callable[[bool], list[int]],
                 on_new_epoch: Callable[[], None], on_new_daemon: Callable[[int], None],
                 owes: Callable[[], bool]) -> None:
        self._path, self._timeout = path, timeout
        self._lock = lock
        self._health = health
        self._hello, self._owed, self._owes = hello, owed, owes
        self._on_new_epoch, self._on_new_daemon = on_new_epoch, on_new_daemon
        self.link = 0
        self.epoch = 0
        self.engine = ""
        self.closed = False
        self.inherited = False  # set in a forked child: the connection is the parent's
        self.pid = os.getpid()  # (for the message a forked child's calls get)
        self._joining: Transport | None = None  # a hello's connection until it is answered
        self._taking = False  # (under the lock) the owed Forgets are being taken

    def open(self, deadline: float) -> None:
        """Join the world (the constructor's hello), by `deadline`."""
        self.transport, self.epoch, self.engine = self._join(deadline)

    def check_open(self) -> None:
        if self.inherited:
            raise MisuseError(f"this DaemonBackend belongs to process {self.pid}; a forked "
                              "child must make its own")
        if self.closed:
            raise MisuseError("the backend is closed")

    def _join(self, deadline: float) -> tuple[Transport, int, str]:
        """Connect and say hello (at the last epoch seen); returns once the world is ready,
        with the new epoch and the daemon's engine (the caller puts all three in place)."""
        hello = self._hello(self.epoch)
        transport = Transport(self._path, self._timeout, self._on_event, deadline)
        with self._lock:
            if not self.closed:
                self._joining = transport
        try:
            self.check_open()  # (close() came while connecting: it never saw this one)
            reply, _ = transport.request(hello, deadline)
            checked(reply)
            assert isinstance(reply, proto.Welcome)
            if reply.version != hello.version:  # (the daemon should have refused the hello)
                raise ProtocolError(f"the daemon welcomed us in protocol version {reply.version}; "
                                    f"this client speaks {hello.version}")
            if reply.max_message < LEAST_MAX_MESSAGE:
                raise ProtocolError(f"the daemon welcomed us with max_message {reply.max_message} "
                                    f"bytes, below the {LEAST_MAX_MESSAGE} its requests need")
            transport.limit_sends(reply.max_message)
            if hello.epoch:  # a rejoin
                check_past(reply.epoch, hello.epoch,
                           f"the daemon welcomed rank {hello.rank} of world {hello.world}")
        except BaseException:
            transport.close()
            raise
        finally:
            with self._lock:
                self._joining = None
        return transport, reply.epoch, reply.engine

    def rejoin(self, deadline: float, gone: CommError) -> None:
        """Leave the daemon, which went for the reason `gone`, and join the world again on a
        new connection, by `deadline`: to a restarted daemon, perhaps, with backoff while it is
        not back yet."""
        # The daemon must see the old connection go, or the rank is taken. The calls of other
        # threads on it, until the new one is in place, hear why it went: one a stopping daemon
        # answered is not broken yet, and "the backend was closed" would say the worker closed it
        self.transport.close(gone)
        with self._lock:
            # after the close, so no request on the old connection can succeed under the new
            # link; a reply that came on it before is recorded nowhere
            self.link += 1
            link = self.link
        self._on_new_daemon(link)
        delay = 0.05
        while True:
            self.check_open()  # closed by another thread meanwhile: never join behind its back
            try:
                transport, epoch, engine = self._join(deadline)
            except DaemonUnavailable as exc:
                if not _not_back_yet(exc) or time.monotonic() + delay >= deadline:
                    raise
                time.sleep(delay)  # not back yet (systemd restarts it): try again
                delay = min(1.0, delay * 2)
                continue
            try:
                with self._lock:  # close() takes `closed` under it, then closes whichever transport is ours
                    installed = not self.closed
                    if installed:
                        self.transport, self.engine = transport, engine
                        self.new_epoch(epoch)
            except BaseException:  # (an interrupt: the welcomed connection must not keep the rank)
                transport.close()
                raise
            if installed:
                return
            transport.close()
            self.check_open()

    def new_epoch(self, epoch: int) -> None:
        """(Under the lock) The world is rebuilt at `epoch`."""
        self.epoch = epoch
        self._on_new_epoch()

    def basis(self) -> Basis:
        with self._lock:
            return Basis(self.link, self.epoch)

    def current_link(self) -> int:
        return self.link

    def gone(self, link: int) -> bool:
        """Whether the daemon connection `link` is no more (a rejoin replaced it, or it broke):
        the daemon let go of all it held for it."""
        return link != self.link or self.transport.broken is not None

    def request(self, make: Callable[[int], proto.Request], *, due: float | None,
                fds: Sequence[int] = (), grace: float = 0.0, undo: Undo | None = None,
                link: int | None = None, abandon: Abandon | None = None) -> Answer:
        """One request/reply, answered by `due` (+ `grace`; None: no deadline); daemon errors
        become CommErrors. `make` builds the request from its id. `undo`: what undoes the
        request if it times out and the daemon did it all the same; `abandon`: nothing
        can (see Transport.request). `link`: only to that
        daemon connection (Superseded if a rejoin replaced it)."""
        self.check_open()
        # One transport for the id and the sending: another thread's rejoin may put a new one
        # in place meanwhile, whose own ids an old one's could collide with
        with self._lock:
            transport, used, epoch, engine = self.transport, self.link, self.epoch, self.engine
        if link is not None and link != used:
            raise Superseded
        deadline = None if due is None else due + grace
        try:
            self._send_releases(transport, deadline)
            msg = built(functools.partial(make, transport.next_id()))  # (no lambda's frame)
            reply, got = transport.request(msg, deadline, fds, undo, abandon)
            checked(reply)
        except CommError as exc:
            if link is not None and link != self.link:
                raise Superseded from exc  # (sent on the connection a rejoin was replacing)
            # (a call refused as made for an older epoch says nothing of the current one; a
            # connection the daemon ended, whatever its last word's code, leaves the world to a
            # rejoin: the daemon let go of this rank)
            if (isinstance(exc, UNHEALTHY) or transport.broken is not None) \
                    and exc.code is not proto.ErrorCode.STALE_EPOCH:
                self._health.met(self.mark_unhealthy(exc, epoch, transport))
            raise
        return Answer(reply, got, used, epoch, engine)

    def mark_unhealthy(self, why: CommError, epoch: int = 0,
                       transport: Transport | None = None) -> int:
        """Record why the world is unhealthy, unless it is about an epoch (`epoch`; 0: the
        current one) or a connection (`transport`) this rank has left behind since: a
        reconnect on another thread must not inherit it. A hello's connection counts as
        ours: the world it joins may fail before its welcome. Returns the epoch it is about."""
        with self._lock:
            about = epoch or self.epoch
            # (_joining first: during the constructor's hello there is no transport yet)
            left = (transport is not None and transport is not self._joining
                    and transport is not self.transport)
            if about >= self.epoch and not left:
                self._health.record(why, about)
        return about

    def went_away(self, epoch: int, when: str) -> DaemonUnavailable:
        """The error of a call made with a daemon a rejoin replaced meanwhile: the calling
        thread met the end of the world of `epoch` (which that rejoin has repaired)."""
        self._health.met(epoch)
        return DaemonUnavailable(f"the daemon went away {when}; call attempt_reconnect")

    def take_news(self) -> None:
        """Read the events already waiting, and whether the connection broke."""
        transport = self.transport
        transport.drain_events()
        broken = transport.broken
        if broken is not None:
            self.mark_unhealthy(broken, transport=transport)

    def interrupted(self, exc: BaseException) -> None:
        """An interrupt cut a call short: drop the connection (see Transport.interrupted)."""
        if self.inherited or self.closed:  # (nothing to drop, or not ours)
            return
        transport = self.transport
        self._health.met(self.mark_unhealthy(transport.interrupted(exc), transport=transport))

    def close(self, first: Callable[[], None]) -> None:
        """Drop the connection, and a rejoin's hello under way (it must not take the rank
        after we left); `first` runs under the lock the first time."""
        with self._lock:
            if not self.closed:
                self.closed = True
                first()
            transport, joining = self.transport, self._joining
        transport.close()
        if joining is not None:
            joining.close()

    def let_go_of_inherited(self) -> None:
        """In a forked child (whose copies of the sockets the transports closed): the
        connection is the parent's; no lock is taken (a thread the child lacks may have
        held one)."""
        self.inherited = self.closed = True

    def _on_event(self, event: proto.Event, transport: Transport) -> None:
        if isinstance(event.kind, str):
            # A newer daemon's notice, which it may send only if a client can do without it
            # (WIRE.md §7): what ends a world or a connection also reaches this client as
            # the next call's error, or as the end of the connection
            log.debug("ignored an event of kind %r (code %r), which this client does not know: %s",
                      event.kind, event.code if isinstance(event.code, str) else event.code.value,
                      event.message)
            return
        # (one from a connection a rejoin has replaced, a SHUTDOWN's say, whose epoch 0 would
        # read as the rebuilt world's, is not about this rank's world any more)
        self.mark_unhealthy(from_event(event.kind, event.code, event.message), event.epoch, transport)

    def forget_now(self, owe_again: Callable[[list[int]], None]) -> None:
        """Send the Forgets owed now if the connection takes them at once; else (another send
        under way, no room) `owe_again` gets them back, and they go with the next request."""
        with self._lock:
            transport = self.transport
            # (_taking: a collection cut into this thread's taking of them, which sends them)
            if self.closed or transport.broken is not None or self._taking:
                return
            released = self._take_owed(freed_only=True)  # (see ImportedBuffers.take_owed)
        # Owed again unless sent, however this ends: an interrupt (Ctrl-C in a buffer's
        # close) lost the ones taken, and nothing drops this connection for it, so the
        # daemon kept the memory mapped while it lived. (Sent and owed again if it lands
        # just after a send: the daemon ignores a Forget of a buffer it no longer holds.)
        sent = 0
        try:
            while sent < len(released) and transport.try_post(
                    proto.Forget(tuple(released[sent:sent + proto.MAX_GROUP_OPS]))):
                sent += proto.MAX_GROUP_OPS
        finally:
            if sent < len(released):
                owe_again(released[sent:])

    def _take_owed(self, freed_only: bool = False) -> list[int]:
        """(Under the lock) The Forgets owed, taken."""
        self._taking = True
        try:
            return self._owed(freed_only)
        finally:
            self._taking = False

    def _send_releases(self, transport: Transport, deadline: float | None = None) -> None:
        """The Forgets go with a request on the current connection (one a rejoin is replacing
        would lose them: the new daemon's, once it has imported some), by its `deadline`.
        Taken and sent in one hold of the send lock: a timed-out import's Forget must reach
        the daemon before that buffer's next Import, which another thread may be about to
        send (the daemon refuses it while it holds the buffer)."""
        # Nothing owed, the common case, is read without either lock: a Forget owed
        # meanwhile goes with a later request, as if owed just after the take. One that
        # must precede an Import is owed before that Import's request is made (the timed-out
        # import records it, under the import lock the next one waits for), so that request
        # sees it here; or another thread took it, and sends it in the send lock's hold
        # this request's own send waits for
        if not self._owes():
            return
        with transport.sending():
            with self._lock:
                if transport is not self.transport or transport.broken is not None:
                    return
                released = self._take_owed()
            for start in range(0, len(released), proto.MAX_GROUP_OPS):
                transport.post(proto.Forget(tuple(released[start:start + proto.MAX_GROUP_OPS])), (), deadline)
