"""The frames of one TCP connection between daemons (proto/peerframe.py), read
straight into their own buffers, sealed or opened once the handshake has given keys.
`peering` builds links and the handshake on it."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import time
import typing

import proto
from proto import clip_text, codec
from proto import peer as p
from proto import peerframe as pf

# The messages of a handshake: once a side's handshake ended, it may send none of them
HANDSHAKE = (p.PeerHello, p.PeerChallenge, p.PeerProof, p.PeerReady, p.PeerRefused, p.PeerBusy)


class UnreadableFrame(proto.DecodeError):
    """A sealed frame that opened (a daemon with the secret sent it) and the link cannot take:
    it did not decode (of another build at this peer protocol, a message type or field this one
    lacks, or a bug), or it is a handshake's, after the handshake. Its sender is alive, and a
    lost link says so (peerlink.PeerLink); the text is what it sent."""


class FrameStream(asyncio.BufferedProtocol):
    """One TCP connection's frames, read straight into their own buffers.

    A StreamReader copies every byte twice (into its buffer, then out) and runs
    Python per 64 KiB; here the kernel writes a payload into the bytearray the
    frame will keep, in as few reads as the socket allows.
    """

    def __init__(self, drop: bool = False, sealed_after: type[p.PeerMessage] | None = None) -> None:
        self._drop = drop  # close as soon as connected (see peering.MAX_HANDSHAKES)
        self._transport: asyncio.Transport | None = None
        self._prefix = bytearray(pf.FRAME.size)
        self._target: bytearray | memoryview = self._prefix
        # what sealed payloads are read into: each is opened into bytes of its own, so one
        # buffer serves them all (a fresh one would cost its zeroing, per 4 MiB chunk)
        self._ciphertext = bytearray()
        self._stage = "prefix"  # of the frame being read: prefix, header, payload
        self._filled = 0
        self._lengths = b""
        self._header = b""
        self._pending_payload = 0
        # The last frame the other side sends in the clear (the end of its handshake): the
        # frames after it are sealed. Each part is opened as soon as it is in, with the key
        # `trust` gave once the other side proved the secret, before that last clear frame
        # could come (sealed ones may follow it in the same segment). Until then frames carry
        # no payload, and after it a header is opened before its payload is allocated:
        # nothing big is allocated for someone who does not hold the keys.
        self.sealed_after = sealed_after
        self._sealed_in = False
        self._seal: pf.FrameSeal | None = None
        self._opener: pf.FrameSeal | None = None
        self._frames: collections.deque[tuple[p.PeerMessage, bytes | bytearray]] = collections.deque()
        self._waiter: asyncio.Future[None] | None = None
        self._error: BaseException | None = None
        self._writable: asyncio.Future[None] | None = None
        self._made: asyncio.Future[None] | None = None  # (see peer_host)
        self._ended: asyncio.Future[None] | None = None  # (see finish)
        # When payload bytes last came: a big frame on a slow link takes a while, and its
        # bytes say the peer lives as well as a heartbeat would (which waits behind it). Only
        # a payload's: its header opened, so the peer sent it (a relay trickling junk into a
        # header would otherwise keep a dead link alive).
        self.last_bytes = time.monotonic()

    # ---- protocol callbacks ------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = typing.cast(asyncio.Transport, transport)  # uvloop's is no subclass
        if self._made is not None and not self._made.done():
            self._made.set_result(None)
        if self._drop:
            self._transport.abort()
            return
        # Paused whenever anything is queued, `drain` waits until the socket took all of it: the
        # engine's flow control (a chunk after the last has gone) and, for a frame in the clear,
        # its payload (queued by reference) being free to change.
        self._transport.set_write_buffer_limits(high=0)

    def get_buffer(self, sizehint: int) -> memoryview:
        return memoryview(self._target)[self._filled:]

    def buffer_updated(self, nbytes: int) -> None:
        if self._stage == "payload":
            self.last_bytes = time.monotonic()
        self._filled += nbytes
        if self._filled < len(self._target):
            return
        try:
            self._advance()
        except proto.ProtoError as exc:
            self._fail(exc)
            if self._transport is not None:
                self._transport.close()

    def _advance(self) -> None:
        """A piece of the frame is in: read the next one, or take the whole frame."""
        if self._stage == "prefix":
            self._lengths = bytes(self._prefix)
            sealed = self._opening() is not None
            header_len, payload_len = pf.frame_lengths(self._lengths, sealed)
            if payload_len and self._opener is None:
                raise proto.DecodeError("a payload before the handshake ended")  # no big buffers
            if sealed:
                header_len, payload_len = pf.sealed_lengths(header_len, payload_len)
            self._pending_payload = payload_len
            self._expect("header", bytearray(header_len))
            return
        payload: bytes | bytearray = bytearray()
        if self._stage == "header":
            self._header = bytes(self._target)
            if (opener := self._opening()) is not None:
                self._header = opener.open_header(self._lengths, self._header)
            if self._pending_payload:
                self._expect("payload", self._payload_buffer(self._pending_payload, opener is not None))
                return
        elif (opener := self._opening()) is not None:
            payload = opener.open_payload(self._lengths, self._target)
        else:
            payload = typing.cast(bytearray, self._target)  # (a clear frame keeps its buffer)
        try:
            msg = codec.decode_peer(self._header)
        except proto.ProtoError as exc:
            if not self._sealed_in:  # (in the clear: anyone's, as a handshake's)
                raise
            raise UnreadableFrame(f"a frame this build cannot read ({clip_text(str(exc), 200)})") from None
        if self._sealed_in and isinstance(msg, HANDSHAKE):
            raise UnreadableFrame(f"a handshake message ({type(msg).__name__}) on an established link")
        self._frames.append((msg, payload))
        if not self._sealed_in and self.sealed_after is not None and isinstance(msg, self.sealed_after):
            self._sealed_in = True
        self._expect("prefix", self._prefix)
        self._wake()

    def _opening(self) -> pf.FrameSeal | None:
        """What opens the frame being read; None while frames come in the clear."""
        if not self._sealed_in:
            return None
        if self._opener is None:  # (the other side ended its handshake before ours let it)
            raise proto.DecodeError("a sealed frame before this side could open it")
        return self._opener

    def _payload_buffer(self, nbytes: int, sealed: bool) -> bytearray | memoryview:
        if not sealed:
            return bytearray(nbytes)
        if len(self._ciphertext) < nbytes:
            self._ciphertext = bytearray(nbytes)
        return memoryview(self._ciphertext)[:nbytes]

    def _expect(self, stage: str, target: bytearray | memoryview) -> None:
        self._stage, self._target, self._filled = stage, target, 0

    def eof_received(self) -> bool | None:
        self._fail(ConnectionError("closed by the peer"))
        self._peer_ended()
        return None

    def connection_lost(self, exc: Exception | None) -> None:
        self._fail(exc or ConnectionError("closed by the peer"))
        self._peer_ended()
        if self._writable is not None and not self._writable.done():
            self._writable.set_result(None)

    def pause_writing(self) -> None:
        if self._writable is None or self._writable.done():
            self._writable = asyncio.get_running_loop().create_future()

    def resume_writing(self) -> None:
        if self._writable is not None and not self._writable.done():
            self._writable.set_result(None)

    # ---- what the link uses -------------------------------------------------------------

    async def peer_host(self) -> str:
        """The other side's host ("" if not known), once connected: uvloop runs a task made in
        the protocol's factory before it hands the protocol its connection."""
        if self._transport is None:
            self._made = asyncio.get_running_loop().create_future()
            await self._made
        name = self._transport.get_extra_info("peername") if self._transport is not None else None
        return str(name[0]) if isinstance(name, tuple) and name else ""

    def trust(self, open_key: bytes) -> None:
        """The other side proved the secret: open what it sends after its last clear frame
        (`sealed_after`) with `open_key`. Called before that frame can come."""
        self._opener = pf.FrameSeal(open_key)

    def seal_with(self, key: bytes) -> None:
        """Seal what we write from now on (the handshake ended)."""
        self._seal = pf.FrameSeal(key)

    async def read(self) -> tuple[p.PeerMessage, bytes | bytearray]:
        while not self._frames:
            if self._error is not None:
                raise self._error
            self._waiter = asyncio.get_running_loop().create_future()
            await self._waiter
        return self._frames.popleft()

    def write(self, msg: p.PeerMessage, payload: bytes | bytearray | memoryview = b"") -> None:
        """Queue a frame. `payload` is not copied unless sealed: in the clear, it must not
        change until `drain` returns."""
        if self._transport is not None and not self._transport.is_closing():
            header = codec.encode_peer(msg)
            pieces = self._seal.seal(header, payload) if self._seal is not None else pf.frame(header, payload)
            self._transport.writelines(pieces)

    async def drain(self) -> None:
        """Wait until the socket has taken every frame written so far (their payloads may
        change then), or the connection failed."""
        if self._writable is not None:
            # shielded: drainers share the future, and one cancelled must not cancel the rest
            await asyncio.shield(self._writable)
        if self._error is not None:
            raise ConnectionError(str(self._error))

    async def finish(self, within: float) -> None:
        """Close once the peer took what was written and ended its side, or `within` seconds
        passed. Our side ends first (the queue, then a FIN) and reading goes on meanwhile:
        `abort` drops what is queued here, and a socket closed with the peer's bytes unread
        resets the connection, which costs the peer what it had not read yet."""
        transport = self._transport
        if transport is None or transport.is_closing():
            return
        self._ended = asyncio.get_running_loop().create_future()
        transport.write_eof()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._ended, within)
        transport.abort()

    def close(self) -> None:
        """Close once what was written is sent (a refusal, say, reaches the peer)."""
        if self._transport is not None:
            self._transport.close()

    def abort(self) -> None:
        """Close now, dropping what is queued: frames of worlds the loss fails must not reach
        the peer later (and a frame in the clear may name memory reused once it is given up)."""
        if self._transport is not None:
            self._transport.abort()

    def _peer_ended(self) -> None:
        if self._ended is not None and not self._ended.done():
            self._ended.set_result(None)

    def _fail(self, error: BaseException) -> None:
        if self._error is None:
            self._error = error
        self._wake()

    def _wake(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)
