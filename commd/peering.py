"""Authenticated TCP links between daemons: listen, dial, handshake, frames, heartbeats.

A `PeerLink` is one authenticated connection. It reads frames (proto/peer.py),
hands every message but heartbeats to its handler, sends a heartbeat every
`heartbeat_s`, and declares the peer lost when nothing arrived for `window_s`
(a stopped or partitioned daemon). Losing a link is reported once, to
`on_lost`; the owner (the cluster) fails the worlds that used it.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass

import proto
from proto import codec
from proto import peer as p

log = logging.getLogger("commd.peering")


@dataclass(frozen=True, slots=True)
class PeerSettings:
    name: str  # this daemon's name in the cluster
    secret: bytes
    heartbeat_s: float = 0.5
    window_s: float = 3.0
    handshake_s: float = 5.0


class PeerRefusedError(Exception):
    """The other side refused the handshake (or was not a commd daemon with our secret)."""


class SelfDialError(Exception):
    """The address we dialed is our own listener."""


Handler = Callable[["PeerLink", p.PeerMessage, bytes], None]
LostHandler = Callable[["PeerLink", str], None]


async def _read(reader: asyncio.StreamReader) -> tuple[p.PeerMessage, bytes]:
    header_len, payload_len = p.frame_lengths(await reader.readexactly(p.FRAME.size))
    header = await reader.readexactly(header_len)
    payload = await reader.readexactly(payload_len) if payload_len else b""
    return codec.decode_peer(header), payload


def _write(writer: asyncio.StreamWriter, msg: p.PeerMessage, payload: bytes | memoryview = b"") -> None:
    writer.writelines(p.frame(codec.encode_peer(msg), payload))


class PeerLink:
    def __init__(self, name: str, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                 settings: PeerSettings, handler: Handler, on_lost: LostHandler) -> None:
        self.name = name
        self._reader, self._writer = reader, writer
        self._settings = settings
        self._handler = handler
        self._on_lost = on_lost
        self.last_seen = time.monotonic()
        self.closed = False
        self._tasks: list[asyncio.Task[None]] = []

    def start(self) -> None:
        loop = asyncio.get_running_loop()
        self._tasks = [loop.create_task(self._read_loop()), loop.create_task(self._heartbeat_loop())]

    def send(self, msg: p.PeerMessage, payload: bytes | memoryview = b"") -> None:
        """Queue one frame (never blocks; `drain` waits for the socket to take it)."""
        if not self.closed:
            _write(self._writer, msg, payload)

    async def drain(self) -> None:
        if not self.closed:
            try:
                await self._writer.drain()
            except (ConnectionError, RuntimeError) as exc:
                self.close(f"send failed: {exc}")

    async def _read_loop(self) -> None:
        reason = "closed by the peer"
        try:
            while True:
                msg, payload = await _read(self._reader)
                self.last_seen = time.monotonic()
                if not isinstance(msg, p.Heartbeat):
                    self._handler(self, msg, payload)
        except asyncio.IncompleteReadError:
            pass
        except (ConnectionError, OSError) as exc:
            reason = f"connection error: {exc}"
        except proto.ProtoError as exc:
            reason = f"bad frame: {exc}"
            log.warning("peer %s sent a bad frame: %s", self.name, exc)
        self.close(reason)

    async def _heartbeat_loop(self) -> None:
        seq = 0
        while not self.closed:
            silent = time.monotonic() - self.last_seen
            if silent > self._settings.window_s:
                self.close(f"silent for {silent:.1f}s (window {self._settings.window_s:g}s)")
                return
            seq += 1
            self.send(p.Heartbeat(seq))
            await asyncio.sleep(self._settings.heartbeat_s)

    def close(self, reason: str) -> None:
        if self.closed:
            return
        self.closed = True
        current = asyncio.current_task()
        for task in self._tasks:
            if task is not current:
                task.cancel()
        self._writer.close()
        log.warning("link to daemon %s lost: %s", self.name, reason)
        self._on_lost(self, reason)


class PeerNode:
    """This daemon's side of the handshake, for links it dials and links it accepts."""

    def __init__(self, settings: PeerSettings, handler: Handler, on_lost: LostHandler) -> None:
        self.settings = settings
        self._handler = handler
        self._on_lost = on_lost
        self._dialing: set[bytes] = set()  # our own hello nonces: how a self-dial is recognized
        self._server: asyncio.Server | None = None
        self.refused = 0  # handshakes refused (wrong secret, version, garbage)

    async def listen(self, host: str, port: int, on_link: Callable[[PeerLink], None]) -> int:
        async def accept(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            peer = writer.get_extra_info("peername")
            try:
                name = await asyncio.wait_for(self._answer(reader, writer), self.settings.handshake_s)
            except (SelfDialError, PeerRefusedError, proto.ProtoError, OSError,
                    asyncio.IncompleteReadError, TimeoutError) as exc:
                if not isinstance(exc, SelfDialError):
                    self.refused += 1
                    log.warning("refused peer %s: %s", peer, exc or type(exc).__name__)
                writer.close()
                return
            on_link(self._link(name, reader, writer))

        self._server = await asyncio.start_server(accept, host, port)
        bound: int = self._server.sockets[0].getsockname()[1]
        return bound

    async def dial(self, host: str, port: int) -> PeerLink:
        """Connect and authenticate; SelfDialError if the address is our own listener."""
        reader, writer = await asyncio.wait_for(asyncio.open_connection(host, port),
                                                self.settings.handshake_s)
        try:
            name = await asyncio.wait_for(self._ask(reader, writer), self.settings.handshake_s)
        except BaseException:
            writer.close()
            raise
        return self._link(name, reader, writer)

    def _link(self, name: str, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> PeerLink:
        link = PeerLink(name, reader, writer, self.settings, self._handler, self._on_lost)
        link.start()
        return link

    async def _ask(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> str:
        nonce = os.urandom(p.NONCE_BYTES)
        self._dialing.add(nonce)
        try:
            _write(writer, p.PeerHello(p.PEER_VERSION, self.settings.name, nonce))
            challenge, _ = await _read(reader)
            if isinstance(challenge, p.PeerRefused):
                if challenge.reason == "self":
                    raise SelfDialError()
                raise PeerRefusedError(challenge.reason)
            if not isinstance(challenge, p.PeerChallenge):
                raise PeerRefusedError(f"expected a challenge, got {type(challenge).__name__}")
            want = p.proof(self.settings.secret, "listener", nonce, challenge.nonce)
            if not hmac.compare_digest(want, challenge.proof):
                _write(writer, p.PeerRefused("wrong listener proof"))
                raise PeerRefusedError(f"daemon {challenge.daemon} does not hold our secret")
            _write(writer, p.PeerProof(p.proof(self.settings.secret, "dialer", challenge.nonce, nonce)))
            ready, _ = await _read(reader)
            if not isinstance(ready, p.PeerReady):
                reason = ready.reason if isinstance(ready, p.PeerRefused) else type(ready).__name__
                raise PeerRefusedError(reason)
            return challenge.daemon
        finally:
            self._dialing.discard(nonce)

    async def _answer(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> str:
        hello, _ = await _read(reader)
        if not isinstance(hello, p.PeerHello):
            raise PeerRefusedError(f"expected a hello, got {type(hello).__name__}")
        if hello.nonce in self._dialing:
            _write(writer, p.PeerRefused("self"))
            raise SelfDialError()
        if hello.version != p.PEER_VERSION:
            _write(writer, p.PeerRefused(f"peer protocol {hello.version} is not {p.PEER_VERSION}"))
            raise PeerRefusedError(f"version {hello.version}")
        nonce = os.urandom(p.NONCE_BYTES)
        _write(writer, p.PeerChallenge(self.settings.name, nonce,
                                       p.proof(self.settings.secret, "listener", hello.nonce, nonce)))
        answer, _ = await _read(reader)
        want = p.proof(self.settings.secret, "dialer", nonce, hello.nonce)
        if not isinstance(answer, p.PeerProof) or not hmac.compare_digest(want, answer.proof):
            with contextlib.suppress(Exception):
                _write(writer, p.PeerRefused("wrong proof: this daemon does not share our secret"))
            raise PeerRefusedError(f"daemon {hello.daemon!r} failed the challenge")
        _write(writer, p.PeerReady())
        return hello.daemon

    def close(self) -> None:
        if self._server is not None:
            self._server.close()
            self._server = None
