"""Authenticated TCP links between daemons: listen, dial, the handshake (proto.peer).

A `PeerNode` listens for other daemons and dials them; each handshake that ends well
becomes a `peerlink.PeerLink`, handed to its owner (the cluster).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import hmac
import logging
import os
import random
import socket
from collections.abc import Callable

import proto
from proto import peer as p
from proto import peerframe as pf

from . import __version__
from .errors import escaped, quoted
from .frames import FrameStream
from .logs import Throttled, ThrottledBy
from .peerlink import Handler, LostHandler, PeerLink, PeerSettings
from .tasks import HeldTasks

log = logging.getLogger("commd.peering")
# Handshakes under way at once: each holds an fd until it ends (at most the handshake
# timeout), and anyone who reaches the port can open them. Past this, connections are
# dropped at once, so a flood cannot take the fds the daemon's workers need.
MAX_HANDSHAKES = 128
# ... and from any one host, once half of those are taken: one that holds no secret would
# otherwise keep every slot, and no daemon (nor this one's dial to itself, how it finds it is
# a world's root) could link. Below that the limit does not bind: many daemons behind one
# address (a NAT) dial at once as a job starts, and a host's 17th would be refused for nothing.
MAX_HANDSHAKES_PER_HOST = 16
# A dial the listener had no room for (PeerBusyError) is made again after a Backoff of these
# pauses. (Each dialer holds no connection while it waits, so none adds to what the listener holds.)
DIAL_RETRY_S = (0.02, 0.5)


class Backoff:
    """Pauses between tries that start at `first` and double up to `most`, each drawn between
    its half and itself: daemons that dialed at once, and were turned away at once, come back
    spread out, not together."""

    def __init__(self, first: float, most: float) -> None:
        self._pause = first
        self._most = most
        self.tries = 1  # made so far, counting the one before the first pause

    def pause(self) -> float:
        """The pause before the next try (counted in `tries`)."""
        wait = random.uniform(self._pause / 2, self._pause)
        self._pause = min(2 * self._pause, self._most)
        self.tries += 1
        return wait


async def _addresses(host: str, port: int) -> list[str]:
    """`host`'s addresses, each once, in the resolver's order."""
    infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
    return list(dict.fromkeys(str(info[4][0]) for info in infos))


async def _connect(addresses: list[str], port: int) -> FrameStream:
    """A connection to the first of `addresses` that takes one. When none does and one of
    them refused (nothing listens there yet), ConnectionRefusedError names every address's
    error: the loop, trying them itself, raises a plain OSError unless all its errors read
    alike, and one refused beside one unreachable (a name with an IPv6 address on a host
    without IPv6) is then not told from a daemon that can never be reached."""
    loop = asyncio.get_running_loop()
    errors: dict[str, OSError] = {}
    for address in addresses:
        try:
            _, stream = await loop.create_connection(lambda: FrameStream(sealed_after=p.PeerReady),
                                                     address, port)
            return stream
        except OSError as exc:
            errors[address] = exc
    if len(errors) == 1:
        raise next(iter(errors.values()))
    refused = any(isinstance(exc, ConnectionRefusedError) for exc in errors.values())
    raise (ConnectionRefusedError if refused else OSError)(
        "; ".join(f"{address}: {exc}" for address, exc in errors.items()))


class PeerRefusedError(Exception):
    """The other side refused the handshake (or was not a commd daemon with our secret)."""


class PeerBusyError(PeerRefusedError):
    """The listener had no room for one more handshake: it said so (PeerBusy), or it closed
    the connection before it said a word, as it does past MAX_HANDSHAKES. That passes."""


class SelfDialError(Exception):
    """The address we dialed is our own listener."""


# Why a daemon (its name, its process's incarnation) may not link now; None: it may
NameCheck = Callable[[str, bytes], "str | None"]


class PeerNode:
    """This daemon's side of the handshake, for links it dials and links it accepts."""

    def __init__(self, settings: PeerSettings, handler: Handler, on_lost: LostHandler,
                 name_taken: NameCheck = lambda name, incarnation: None) -> None:
        self.settings = settings
        self._handler = handler
        self._on_lost = on_lost
        self._name_taken = name_taken  # asked of the other side, once it proved the secret
        self._dialing: set[bytes] = set()  # our own hello nonces: how a self-dial is recognized
        self._server: asyncio.Server | None = None
        self._handshakes = HeldTasks()
        self._handshakes_from: collections.Counter[str] = collections.Counter()  # by the dialer's host
        self.refused = 0  # handshakes refused (wrong secret, version, garbage, too many at once)
        self._floods = Throttled(log)
        self._refusals = Throttled(log)
        self._drops = ThrottledBy(log)  # links dropped over a frame (PeerLink._drop), by daemon
        # Once closed (the daemon stops), why no link is made any more: a dial that ended during
        # the farewell would add a link that nothing closes before the process exits
        self._stopping: str | None = None

    async def listen(self, host: str, port: int, on_link: Callable[[PeerLink], None]) -> int:
        loop = asyncio.get_running_loop()

        def connected() -> FrameStream:
            if len(self._handshakes) >= MAX_HANDSHAKES:
                self._refuse_flood()
                return FrameStream(drop=True)
            stream = FrameStream(sealed_after=p.PeerProof)
            self._handshakes.spawn(self._accept(stream, on_link))
            return stream

        self._server = await loop.create_server(connected, host, port)
        bound: int = self._server.sockets[0].getsockname()[1]
        return bound

    def _refuse_flood(self) -> None:
        self.refused += 1
        self._floods.warning("refusing peer connections: %d handshakes under way already (%d refused "
                             "in all)", len(self._handshakes), self.refused)

    def _admit(self, stream: FrameStream, host: str) -> str:
        """Count a handshake from `host` among those under way, if it may have one more."""
        if self._handshakes_from[host] >= MAX_HANDSHAKES_PER_HOST and \
                len(self._handshakes) > MAX_HANDSHAKES // 2:
            # (said, for a daemon among many behind one address: it dials again)
            reason = f"{MAX_HANDSHAKES_PER_HOST} handshakes from {host} are under way already"
            stream.write(p.PeerBusy(reason))
            raise PeerRefusedError(reason)
        self._handshakes_from[host] += 1
        return host

    async def _accept(self, stream: FrameStream, on_link: Callable[[PeerLink], None]) -> None:
        host = None  # once counted among its host's handshakes
        peer = "?"
        try:
            # (a timeout scope, not wait_for: on 3.11 wait_for can swallow the node's close
            # when it lands as the handshake ends, and the closed node would adopt the link)
            async with asyncio.timeout(self.settings.handshake_s):
                peer = await stream.peer_host()
                host = self._admit(stream, peer)
                name, incarnation, transcript = await self._answer(stream)
        except asyncio.CancelledError:  # the node closed
            stream.abort()
            raise
        except (SelfDialError, PeerRefusedError, proto.ProtoError, OSError, TimeoutError) as exc:
            if not isinstance(exc, SelfDialError):
                self.refused += 1
                why = (f"no handshake within {self.settings.handshake_s:g}s" if isinstance(exc, TimeoutError)
                       else str(exc) or type(exc).__name__)
                self._refusals.warning("refused a peer from %s: %s", peer or "?", why)
            stream.close()
            return
        finally:
            if host is not None:
                self._handshakes_from[host] -= 1
                if not self._handshakes_from[host]:
                    del self._handshakes_from[host]
        on_link(self._link(name, incarnation, stream, transcript, dialed=False))

    async def dial(self, host: str, port: int) -> PeerLink:
        """Connect and authenticate; SelfDialError if the address is our own listener. A
        listener with no room for the handshake now (many daemons dial it at once) is dialed
        again until the handshake timeout; any other refusal ends the dial at once."""
        loop = asyncio.get_running_loop()
        window = self.settings.handshake_s  # connecting, the handshake and the tries again, together
        deadline = loop.time() + window
        backoff = Backoff(*DIAL_RETRY_S)
        busy: str | None = None  # why the listener turned the last try away
        # Resolved once, in the first try: each try after is a connection, no more (one cut
        # off by the window in a lookup made nothing the listener could count)
        addresses: list[str] | None = None
        while True:
            if self._stopping is not None:
                raise PeerRefusedError(self._stopping)
            try:
                async with asyncio.timeout_at(deadline):
                    if addresses is None:
                        addresses = await _addresses(host, port)
                    return await self._dial_once(addresses, port)
            except PeerBusyError as exc:
                busy = str(exc)
            except TimeoutError:
                if busy is None:
                    raise
                raise PeerBusyError(f"{busy} (dialed {backoff.tries} times, no handshake in {window:g}s)") \
                    from None
            tries = backoff.tries
            wait = backoff.pause()
            if loop.time() + wait >= deadline:
                raise PeerBusyError(f"{busy} (dialed {tries} times in {window:g}s)")
            await asyncio.sleep(wait)

    async def _dial_once(self, addresses: list[str], port: int) -> PeerLink:
        stream = await _connect(addresses, port)
        try:
            name, incarnation, transcript = await self._ask(stream)
        except BaseException:
            stream.close()
            raise
        return self._link(name, incarnation, stream, transcript, dialed=True)

    def _frame_keys(self, transcript: bytes, dialed: bool) -> tuple[bytes, bytes]:
        """This side's keys on the link: to seal what it writes, to open what it reads."""
        dialers, listeners = pf.frame_keys(self.settings.secret, transcript)
        return (dialers, listeners) if dialed else (listeners, dialers)

    def _link(self, name: str, incarnation: bytes, stream: FrameStream, transcript: bytes,
              dialed: bool) -> PeerLink:
        """The handshake ended: what we write is sealed from now on."""
        stream.seal_with(self._frame_keys(transcript, dialed)[0])
        link = PeerLink(name, incarnation, stream, self.settings, self._handler, self._on_lost, self._drops)
        link.start()
        return link

    async def _ask(self, stream: FrameStream) -> tuple[str, bytes, bytes]:
        nonce = os.urandom(p.NONCE_BYTES)
        self._dialing.add(nonce)
        try:
            return await self._ask_checked(stream, nonce)
        except proto.ProtoError as exc:  # garbage from the listener: not a daemon of ours
            raise PeerRefusedError(f"the listener does not speak the peer protocol: {exc}") from None
        finally:
            self._dialing.discard(nonce)

    async def _ask_checked(self, stream: FrameStream, nonce: bytes) -> tuple[str, bytes, bytes]:
        """The listener's name and incarnation, and the handshake's transcript."""
        hello = p.PeerHello(p.PEER_VERSION, self.settings.name, nonce, self.settings.incarnation)
        stream.write(hello)
        # A listener says why it refuses a hello: one that closes before any word dropped the
        # connection at MAX_HANDSHAKES (or its node closed, and a try again's connect is refused)
        try:
            challenge, _ = await stream.read()
        except ConnectionError as exc:
            raise PeerBusyError(f"the listener closed the connection before the handshake ({exc}): "
                                "too many handshakes under way?") from None
        # (a listener says why with no secret proved: anyone who answers the dial wrote it,
        # and it goes into the rank's error)
        if isinstance(challenge, p.PeerBusy):
            raise PeerBusyError(escaped(challenge.reason, p.MAX_REASON))
        if isinstance(challenge, p.PeerRefused):
            if challenge.reason == "self":
                raise SelfDialError()
            raise PeerRefusedError(escaped(challenge.reason, p.MAX_REASON))
        if not isinstance(challenge, p.PeerChallenge):
            raise PeerRefusedError(f"expected a challenge, got {type(challenge).__name__}")
        transcript = p.transcript(hello, challenge.daemon, challenge.incarnation, challenge.nonce)
        if not hmac.compare_digest(p.proof(self.settings.secret, "listener", transcript), challenge.proof):
            stream.write(p.PeerRefused("wrong listener proof"))
            raise PeerRefusedError(f"daemon {quoted(challenge.daemon)} does not hold our secret")
        self._refuse_if_taken(stream, challenge.daemon, challenge.incarnation)
        if self._stopping is not None:  # (told: the listener says why it adopts no link)
            stream.write(p.PeerRefused(self._stopping))
            raise PeerRefusedError(self._stopping)
        stream.trust(self._frame_keys(transcript, dialed=True)[1])  # before its ready
        stream.write(p.PeerProof(p.proof(self.settings.secret, "dialer", transcript)))
        try:
            ready, _ = await stream.read()
        except ConnectionError as exc:
            # A listener with something to refuse says it; one that closes without a word now
            # stopped (its node ends the handshakes under way) or died: a try again finds it
            # back, or nothing listening, which a joining rank rides out as a restart
            raise PeerBusyError(f"daemon {quoted(challenge.daemon)} closed the connection during "
                                f"the handshake ({exc}): is it stopping?") from None
        if not isinstance(ready, p.PeerReady):
            reason = escaped(ready.reason, p.MAX_REASON) if isinstance(ready, p.PeerRefused) \
                else type(ready).__name__
            raise PeerRefusedError(reason)
        if self._stopping is not None:  # (since the proof: the listener took the link, which ends now)
            raise PeerRefusedError(self._stopping)
        return challenge.daemon, challenge.incarnation, transcript

    async def _answer(self, stream: FrameStream) -> tuple[str, bytes, bytes]:
        hello, _ = await stream.read()
        if not isinstance(hello, p.PeerHello):
            raise PeerRefusedError(f"expected a hello, got {type(hello).__name__}")
        if hello.nonce in self._dialing:
            stream.write(p.PeerRefused("self"))
            raise SelfDialError()
        if hello.daemon == self.settings.name:  # (names place ranks: its would be taken for ours)
            stream.write(p.PeerRefused(f"daemon name {quoted(hello.daemon)} is this daemon's own: each "
                                       "daemon needs a peer_name of its own"))
            raise PeerRefusedError(f"a daemon named {quoted(hello.daemon)}, as this one is")
        if hello.version != p.PEER_VERSION:
            reason = (f"peer protocol {hello.version} (daemon {quoted(hello.daemon)}) is not "
                      f"{p.PEER_VERSION} (daemon {quoted(self.settings.name)}, commd {__version__}): "
                      "daemons link at one peer protocol only")
            stream.write(p.PeerRefused(reason))
            raise PeerRefusedError(reason)
        if not hello.incarnation:  # (optional only so that an older version's hello decodes)
            stream.write(p.PeerRefused("a hello names its incarnation"))
            raise PeerRefusedError("a hello without an incarnation")
        nonce = os.urandom(p.NONCE_BYTES)
        ours = self.settings.incarnation
        transcript = p.transcript(hello, self.settings.name, ours, nonce)
        stream.write(p.PeerChallenge(self.settings.name, nonce,
                                     p.proof(self.settings.secret, "listener", transcript), ours))
        answer, _ = await stream.read()
        if isinstance(answer, p.PeerRefused):  # the dialer gave up (it stops, say): its words
            raise PeerRefusedError(f"daemon {quoted(hello.daemon)} ended the handshake: "
                                   f"{escaped(answer.reason, p.MAX_REASON)}")
        want = p.proof(self.settings.secret, "dialer", transcript)
        if not isinstance(answer, p.PeerProof) or not hmac.compare_digest(want, answer.proof):
            with contextlib.suppress(Exception):
                stream.write(p.PeerRefused("wrong proof: this daemon does not share our secret"))
            raise PeerRefusedError(f"daemon {quoted(hello.daemon)} failed the challenge")
        self._refuse_if_taken(stream, hello.daemon, hello.incarnation)
        stream.trust(self._frame_keys(transcript, dialed=False)[1])  # before our ready
        stream.write(p.PeerReady())
        return hello.daemon, hello.incarnation, transcript

    def _refuse_if_taken(self, stream: FrameStream, name: str, incarnation: bytes) -> None:
        reason = self._name_taken(name, incarnation)
        if reason is not None:
            stream.write(p.PeerRefused(reason))
            raise PeerRefusedError(reason)

    def close(self) -> None:
        self._stopping = f"daemon {quoted(self.settings.name)} is shutting down"
        if self._server is not None:
            self._server.close()
            self._server = None
        for handshake in self._handshakes:  # one ending now must not adopt a link
            handshake.cancel()
