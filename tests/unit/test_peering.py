"""commd/peering.py over real loopback TCP: the handshake, frames both ways, refusals,
self-dials, heartbeat loss and bad frames."""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import asynccontextmanager, suppress
from typing import Any

import msgpack
import pytest
import uvloop

import proto
from commd import frames, peering
from commd.peering import PeerNode, PeerRefusedError, SelfDialError
from commd.peerlink import PeerLink, PeerSettings
from proto import ErrorCode
from proto import peer as p
from proto import peerframe as pf
from proto.codec import decode_peer, encode_peer
from tests.integration.harness import eventually

pytestmark = pytest.mark.timeout(30)

HOST = "127.0.0.1"
SECRET = b"cluster secret"
HEARTBEAT_S, WINDOW_S = 0.05, 0.3  # the fast settings of the heartbeat tests


class Side:
    """One PeerNode and everything its handlers saw."""

    def __init__(self, name: str, secret: bytes = SECRET, fast: bool = False,
                 handshake_s: float = 5.0, window_s: float = WINDOW_S) -> None:
        timing = {"heartbeat_s": HEARTBEAT_S, "window_s": window_s} if fast else {}
        self.settings = PeerSettings(name, secret, handshake_timeout_s=handshake_s, **timing)
        self.node = PeerNode(self.settings, self._on_message, self._on_lost)
        self.messages: asyncio.Queue[tuple[PeerLink, p.PeerMessage, bytes | bytearray]] = asyncio.Queue()
        self.lost: asyncio.Queue[tuple[PeerLink, str, float]] = asyncio.Queue()
        self.accepted: asyncio.Queue[tuple[PeerLink, float]] = asyncio.Queue()
        self.links: list[PeerLink] = []
        self.port = 0

    def _on_message(self, link: PeerLink, msg: p.PeerMessage, payload: bytes | bytearray) -> None:
        self.messages.put_nowait((link, msg, payload))

    def _on_lost(self, link: PeerLink, reason: str) -> None:
        self.lost.put_nowait((link, reason, time.monotonic()))

    def _on_link(self, link: PeerLink) -> None:
        self.links.append(link)
        self.accepted.put_nowait((link, time.monotonic()))

    async def listen(self) -> int:
        self.port = await self.node.listen(HOST, 0, self._on_link)
        return self.port

    async def dial(self, port: int) -> PeerLink:
        link = await self.node.dial(HOST, port)
        self.links.append(link)
        return link

    async def next_link(self) -> tuple[PeerLink, float]:
        return await asyncio.wait_for(self.accepted.get(), 5)

    async def next_message(self) -> tuple[PeerLink, p.PeerMessage, bytes | bytearray]:
        return await asyncio.wait_for(self.messages.get(), 10)

    async def next_lost(self, timeout: float = 5) -> tuple[PeerLink, str, float]:
        return await asyncio.wait_for(self.lost.get(), timeout)

    def close(self) -> None:
        for link in self.links:
            link.close("test over")
        self.node.close()


@asynccontextmanager
async def sides(*made: Side) -> AsyncIterator[None]:
    try:
        yield
    finally:
        for side in made:
            side.close()
        await asyncio.sleep(0.01)  # let cancelled link tasks finish


# ---- a hand-driven peer: raw frames over asyncio streams ---------------------------------


async def send_frame(writer: asyncio.StreamWriter, msg: Any, payload: bytes = b"") -> None:
    writer.writelines(pf.frame(encode_peer(msg), payload))
    await writer.drain()


async def read_frame(reader: asyncio.StreamReader) -> tuple[Any, bytes]:
    header_len, payload_len = pf.frame_lengths(await reader.readexactly(pf.FRAME.size))
    header = await reader.readexactly(header_len)
    payload = await reader.readexactly(payload_len) if payload_len else b""
    return decode_peer(header), payload


async def read_until_eof(reader: asyncio.StreamReader) -> list[Any]:
    """Every frame until the other side closes (heartbeats included)."""
    frames = []
    with suppress(asyncio.IncompleteReadError, ConnectionError):
        while True:
            frames.append((await read_frame(reader))[0])
    return frames


async def hung_up(reader: asyncio.StreamReader) -> bool:
    """The other side closed the connection (an EOF, or a reset when it left bytes unread)."""
    try:
        rest = await asyncio.wait_for(reader.read(), 5)
    except ConnectionResetError:
        return True
    return rest == b""


def incarnation() -> bytes:
    return os.urandom(p.INCARNATION_BYTES)


class RawSession:
    """One end of a link after its handshake, by hand: frames sealed and opened as a
    daemon does (`send_header` seals any bytes as if they were a frame's header)."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                 seal_key: bytes, open_key: bytes) -> None:
        self.reader, self.writer = reader, writer
        self._seal, self._opener = pf.FrameSeal(seal_key), pf.FrameSeal(open_key)

    def sealed(self, msg: Any, payload: bytes | memoryview = b"") -> list[bytes]:
        return self._seal.seal(encode_peer(msg), payload)

    async def send(self, msg: Any, payload: bytes | memoryview = b"") -> None:
        self.writer.writelines(self.sealed(msg, payload))
        await self.writer.drain()

    async def send_header(self, header: bytes) -> None:
        self.writer.writelines(self._seal.seal(header, b""))
        await self.writer.drain()

    async def read(self) -> tuple[Any, bytes]:
        prefix = await self.reader.readexactly(pf.FRAME.size)
        header_len, payload_len = pf.sealed_lengths(*pf.frame_lengths(prefix))
        header = self._opener.open_header(prefix, await self.reader.readexactly(header_len))
        if not payload_len:
            return decode_peer(header), b""
        payload = await self.reader.readexactly(payload_len)
        return decode_peer(header), self._opener.open_payload(prefix, payload)

    async def read_until_eof(self) -> list[Any]:
        """Every frame until the other side closes (heartbeats included)."""
        frames = []
        with suppress(asyncio.IncompleteReadError, ConnectionError):
            while True:
                frames.append((await self.read())[0])
        return frames


async def raw_dial(port: int, secret: bytes = SECRET, name: str = "raw") -> RawSession:
    """Connect and complete the dialer's half of the handshake by hand."""
    reader, writer = await asyncio.open_connection(HOST, port)
    hello = p.PeerHello(p.PEER_VERSION, name, os.urandom(p.NONCE_BYTES), incarnation())
    await send_frame(writer, hello)
    challenge, _ = await read_frame(reader)
    assert isinstance(challenge, p.PeerChallenge)
    transcript = p.transcript(hello, challenge.daemon, challenge.incarnation, challenge.nonce)
    assert challenge.proof == p.proof(secret, "listener", transcript)
    await send_frame(writer, p.PeerProof(p.proof(secret, "dialer", transcript)))
    ready, _ = await read_frame(reader)
    assert isinstance(ready, p.PeerReady)
    return RawSession(reader, writer, *pf.frame_keys(secret, transcript))


class RawListener:
    """A server that answers the listener's half of the handshake by hand, then does what
    `after` says with the connection."""

    def __init__(self, after: Callable[[RawSession], Any], secret: bytes = SECRET,
                 name: str = "raw-listener", with_ready: Sequence[tuple[Any, bytes]] = ()) -> None:
        self.after, self.secret, self.name = after, secret, name
        self.with_ready = with_ready  # sealed frames sent in the same write as the ready
        self.writers: list[asyncio.StreamWriter] = []
        self.server: asyncio.Server | None = None
        self._tasks: list[asyncio.Task[Any]] = []

    async def start(self) -> int:
        self.server = await asyncio.start_server(self._accept, HOST, 0)
        port: int = self.server.sockets[0].getsockname()[1]
        return port

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.writers.append(writer)
        task = asyncio.current_task()
        if task is not None:
            self._tasks.append(task)
        hello, _ = await read_frame(reader)
        nonce, ours = os.urandom(p.NONCE_BYTES), incarnation()
        transcript = p.transcript(hello, self.name, ours, nonce)
        await send_frame(writer, p.PeerChallenge(
            self.name, nonce, p.proof(self.secret, "listener", transcript), ours))
        answer, _ = await read_frame(reader)
        assert answer == p.PeerProof(p.proof(self.secret, "dialer", transcript))
        dialers, ours = pf.frame_keys(self.secret, transcript)
        session = RawSession(reader, writer, ours, dialers)
        pieces = pf.frame(encode_peer(p.PeerReady()))
        for msg, payload in self.with_ready:
            pieces += session.sealed(msg, payload)
        writer.write(b"".join(bytes(piece) for piece in pieces))
        await writer.drain()
        await self.after(session)

    def close(self) -> None:
        for task in self._tasks:  # (a server's close leaves its handlers running)
            task.cancel()
        for writer in self.writers:
            writer.close()
        if self.server is not None:
            self.server.close()


async def go_silent(session: RawSession) -> None:
    await asyncio.sleep(30)  # neither reads nor writes; cancelled when the test's loop ends


# ---- a link between two nodes --------------------------------------------------------------


async def test_link_carries_messages_both_ways() -> None:
    a, b = Side("daemon-a"), Side("daemon-b")
    async with sides(a, b):
        port = await a.listen()
        assert 0 < port < 65536
        b_to_a = await b.dial(port)
        a_to_b, _ = await a.next_link()
        assert b_to_a.name == "daemon-a" and a_to_b.name == "daemon-b"
        assert not b_to_a.closed and not a_to_b.closed

        failed = p.WorldFailed("job-1", 3, ErrorCode.PEER_LOST, "daemon c went silent")
        b_to_a.send(failed)
        await b_to_a.drain()
        link, msg, payload = await a.next_message()
        assert link is a_to_b and msg == failed and payload == b""

        small = bytes(range(256)) * 16 + b"tail"  # a few KiB
        big = os.urandom(5 << 20)  # ~5 MiB
        for payload_out, chunk in ((small, 0), (big, 1)):
            data = p.Data("job-1", 3, "partial", 7, chunk, 1, "all_reduce(x)", (0, 1))
            b_to_a.send(data, payload_out)
            await b_to_a.drain()
            link, msg, payload = await a.next_message()
            assert link is a_to_b and msg == data
            assert len(payload) == len(payload_out) and payload == payload_out
            assert len(a_to_b._stream._target) < 1024  # the frame's buffers are not kept

        # and the other way, a memoryview payload
        view = memoryview(bytearray(big))[1000:1000 + 65536]
        data = p.Data("job-1", 3, "result", 7, 2, 0, "")
        a_to_b.send(data, view)
        await a_to_b.drain()
        link, msg, payload = await b.next_message()
        assert link is b_to_a and msg == data and payload == bytes(view)
        assert a.lost.empty() and b.lost.empty()


async def test_payloads_read_back_to_back_are_each_their_own() -> None:
    """Sealed payloads are read into one buffer, reused, and opened into bytes of their
    own: payloads that arrived together, taken after the last came, are still intact."""
    a, b = Side("daemon-a"), Side("daemon-b")
    async with sides(a, b):
        b_to_a = await b.dial(await a.listen())
        await a.next_link()
        sent = [os.urandom(n) for n in (3 << 20, 1 << 20, 4 << 20, 17)]
        for i, payload in enumerate(sent):
            b_to_a.send(p.Data("job-1", 3, "partial", 7, i, 1, "all_reduce(x)", (0, 1)), payload)
        await b_to_a.drain()
        received = [await a.next_message() for _ in sent]
        assert [bytes(payload) for _, _, payload in received] == sent
        assert [msg.chunk for _, msg, _ in received] == [0, 1, 2, 3]


async def test_heartbeats_keep_a_quiet_link_alive_and_are_swallowed() -> None:
    a, b = Side("daemon-a", fast=True), Side("daemon-b", fast=True)
    async with sides(a, b):
        b_to_a = await b.dial(await a.listen())
        a_to_b, _ = await a.next_link()
        await asyncio.sleep(3 * WINDOW_S)
        assert a.lost.empty() and b.lost.empty()
        assert a.messages.empty() and b.messages.empty()  # heartbeats never reach the handler
        assert not a_to_b.closed and not b_to_a.closed
        assert time.monotonic() - a_to_b.last_seen < WINDOW_S


async def test_close_reports_once_on_both_sides() -> None:
    a, b = Side("daemon-a"), Side("daemon-b")
    async with sides(a, b):
        b_to_a = await b.dial(await a.listen())
        a_to_b, _ = await a.next_link()
        b_to_a.close("done with it")
        b_to_a.close("again")
        link, reason, _ = await b.next_lost()
        assert link is b_to_a and reason == "done with it" and b_to_a.closed
        link, reason, _ = await a.next_lost()
        assert link is a_to_b and reason.startswith("closed by the peer")
        await asyncio.sleep(0.05)
        assert a.lost.empty() and b.lost.empty()
        b_to_a.send(p.Heartbeat(1))  # a closed link drops what it is given
        await b_to_a.drain()


async def test_a_farewell_says_goodbye_after_what_was_queued(caplog: pytest.LogCaptureFixture) -> None:
    """A daemon that stops tells its peer so, behind the frames queued before: the peer reads
    those, then closes the link as left, not lost, and warns of nothing (before: "daemon
    daemon-b was lost: closed by the peer" and a warning, as for a crash)."""
    a, b = Side("daemon-a"), Side("daemon-b")
    caplog.set_level(logging.INFO, logger="commd.peering")
    async with sides(a, b):
        b_to_a = await b.dial(await a.listen())
        a_to_b, _ = await a.next_link()
        b_to_a.send(p.WorldFailed("job-1", 0, ErrorCode.PEER_LOST, "rank 3's daemon stops"))
        await b_to_a.farewell("daemon shutting down", 5.0)
        _, msg, _ = await a.next_message()
        assert msg == p.WorldFailed("job-1", 0, ErrorCode.PEER_LOST, "rank 3's daemon stops")
        link, reason, _ = await a.next_lost()
        assert link is a_to_b and reason == "it left: daemon shutting down"
        assert a_to_b.loss == "daemon daemon-b left: daemon shutting down"
        link, reason, _ = await b.next_lost()
        assert link is b_to_a and reason == "daemon shutting down"
    warned = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert warned == []
    assert "link to daemon daemon-b closed: it left: daemon shutting down" in caplog.messages


async def test_a_goodbye_mid_world_ends_the_link_and_nothing_behind_it_is_heard() -> None:
    """A peer that proved the secret says goodbye while a world runs over the link, and
    sends more in the same write: what came before is handled, the link closes as left, and
    the frames behind the goodbye reach no handler (the peer is gone as far as we know)."""
    a = Side("daemon-a")
    async with sides(a):
        session = await raw_dial(await a.listen())
        try:
            link, _ = await a.next_link()
            before = p.WorldFailed("w", 1, ErrorCode.TIMEOUT, "before the goodbye")
            behind = p.WorldFailed("w", 2, ErrorCode.TIMEOUT, "behind the goodbye")
            session.writer.writelines([*session.sealed(before), *session.sealed(p.Goodbye("stopping")),
                                       *session.sealed(behind), *session.sealed(p.Data(
                                           "w", 2, "p2p", 0, 0, 0, "fp"), b"x" * 100)])
            await session.writer.drain()
            _, msg, _ = await a.next_message()
            assert msg == before
            lost, reason, _ = await a.next_lost()
            assert lost is link and link.closed and reason == "it left: stopping"
            assert link.loss == "daemon raw left: stopping"
            await asyncio.wait_for(session.read_until_eof(), 5)  # and hung up
            await asyncio.sleep(0.05)
            assert a.messages.empty() and a.lost.empty()
        finally:
            session.writer.close()


async def _challenged_stranger(port: int) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """A connection to the listener at `port` whose hello it answered with its challenge
    (the stranger holds no secret: it can go no further in the handshake)."""
    reader, writer = await asyncio.open_connection(HOST, port)
    hello = p.PeerHello(p.PEER_VERSION, "stranger", os.urandom(p.NONCE_BYTES), incarnation())
    await send_frame(writer, hello)
    challenge, _ = await read_frame(reader)
    assert isinstance(challenge, p.PeerChallenge)
    return reader, writer


async def test_a_goodbye_in_the_handshake_is_refused() -> None:
    """A goodbye in the clear (from anyone, in place of the dialer's proof) ends the
    handshake as any message out of turn does: no link, nothing lost."""
    a = Side("daemon-a")
    async with sides(a):
        reader, writer = await _challenged_stranger(await a.listen())
        try:
            await send_frame(writer, p.Goodbye("bye"))
            frames = await asyncio.wait_for(read_until_eof(reader), 5)
            assert len(frames) == 1 and isinstance(frames[0], p.PeerRefused)
        finally:
            writer.close()
        await eventually(lambda: a.node.refused == 1)
        assert a.accepted.empty() and a.lost.empty()


@pytest.mark.parametrize("header_len", [proto.MAX_MESSAGE_BYTES + 1, pf.MAX_SEALED_HEADER_BYTES])
async def test_a_big_header_in_the_clear_mid_handshake_is_refused_from_its_length(header_len: int) -> None:
    """A sealed frame's header may take 1 MiB; one in the clear (a handshake's: anyone's)
    still 64 KiB. A stranger past the hello who announces a bigger header is hung up on at
    once, from the lengths alone (the handshake timeout is 5 s), not read into a buffer."""
    a = Side("daemon-a")
    async with sides(a):
        reader, writer = await _challenged_stranger(await a.listen())
        try:
            started = time.monotonic()
            writer.write(pf.FRAME.pack(header_len, 0) + b"\x81")  # (its header's first byte only)
            await writer.drain()
            assert await hung_up(reader)
            assert time.monotonic() - started < 2.0
        finally:
            writer.close()
        await eventually(lambda: a.node.refused == 1)
        assert a.accepted.empty()


async def test_a_sealed_header_of_1_mib_that_is_no_world_ready_is_a_bad_frame() -> None:
    """A peer that proved the secret may send a header of up to 1 MiB; one that decodes to
    nothing this build takes (a heartbeat with a field of 1 MiB) drops that link as a bad
    frame and leaves the daemon serving its other links."""
    a, b = Side("daemon-a"), Side("daemon-b")
    async with sides(a, b):
        port = await a.listen()
        b_to_a = await b.dial(port)
        a_to_b, _ = await a.next_link()
        session = await raw_dial(port)
        try:
            raw_link, _ = await a.next_link()
            head = msgpack.packb({"t": "heartbeat", "seq": 1, "pad": ""})
            pad = pf.MAX_SEALED_HEADER_BYTES - len(head) - 4  # (a str32's length takes 4 more)
            header = msgpack.packb({"t": "heartbeat", "seq": 1, "pad": "x" * pad})
            assert len(header) == pf.MAX_SEALED_HEADER_BYTES
            await session.send_header(header)
            lost, reason, _ = await a.next_lost()
            assert lost is raw_link and reason.startswith("bad frame"), reason
            assert "unknown field 'pad'" in reason
            await asyncio.wait_for(session.read_until_eof(), 5)
            b_to_a.send(p.WorldFailed("w", 3, ErrorCode.TIMEOUT, "still here"))
            link, msg, _ = await a.next_message()
            assert link is a_to_b and msg == p.WorldFailed("w", 3, ErrorCode.TIMEOUT, "still here")
            assert not a_to_b.closed and a.lost.empty()
        finally:
            session.writer.close()


def test_a_handler_that_closes_its_link_hears_nothing_more_from_it() -> None:
    """A handler may close the link it is handed (a daemon refusing what a peer said): the
    frames the peer sent right behind are not handed on. Before, the read loop went on
    through what was already buffered (those reads return without suspending, so the
    cancel never landed) and the handler heard from a link it had closed."""
    heard: list[p.PeerMessage] = []

    class Refusing(Side):
        def _on_message(self, link: PeerLink, msg: p.PeerMessage, payload: bytes | bytearray) -> None:
            heard.append(msg)
            link.close("refused")

    async def test() -> None:
        a, b = Refusing("daemon-a"), Side("daemon-b")
        async with sides(a, b):
            b_to_a = await b.dial(await a.listen())
            await a.next_link()
            for epoch in range(1, 21):
                b_to_a.send(p.WorldFailed("job-1", epoch, ErrorCode.PEER_LOST, "refused"))
            await b_to_a.drain()
            _, reason, _ = await a.next_lost()
            assert reason == "refused"
            await b.next_lost()  # (by then a has read all it will)

    on_uvloop(test)
    assert [msg.epoch for msg in heard if isinstance(msg, p.WorldFailed)] == [1]


async def test_several_dialers_each_get_their_own_link() -> None:
    a, b, c = Side("daemon-a"), Side("daemon-b"), Side("daemon-c")
    async with sides(a, b, c):
        port = await a.listen()
        await b.dial(port)
        await c.dial(port)
        names = {(await a.next_link())[0].name for _ in range(2)}
        assert names == {"daemon-b", "daemon-c"}


# ---- refusals ---------------------------------------------------------------------------


async def test_dialer_with_another_secret_is_refused() -> None:
    a, b = Side("daemon-a"), Side("intruder", secret=b"another secret")
    async with sides(a, b):
        port = await a.listen()
        # the dialer checks the listener's proof first: the listener does not share its secret
        with pytest.raises(PeerRefusedError, match="secret"):
            await b.dial(port)
        await eventually(lambda: a.node.refused == 1)
        assert a.accepted.empty() and a.lost.empty() and b.lost.empty()
        # the listener still serves daemons that hold the secret
        good = Side("daemon-c")
        async with sides(good):
            link = await good.dial(port)
            assert link.name == "daemon-a"
            assert (await a.next_link())[0].name == "daemon-c"
        assert a.node.refused == 1


async def test_listener_with_another_secret_is_detected_by_the_dialer() -> None:
    a, b = Side("impostor", secret=b"not ours"), Side("daemon-b")
    async with sides(a, b):
        port = await a.listen()
        with pytest.raises(PeerRefusedError, match="'impostor' does not hold our secret"):
            await b.dial(port)
        await eventually(lambda: a.node.refused == 1)  # it read our refusal, not a proof
        assert a.accepted.empty()


async def test_listener_checks_the_dialers_proof() -> None:
    """A dialer that answers the challenge with a wrong proof is refused by the listener."""
    a = Side("daemon-a")
    async with sides(a):
        reader, writer = await asyncio.open_connection(HOST, await a.listen())
        try:
            await send_frame(writer, p.PeerHello(p.PEER_VERSION, "guesser", os.urandom(p.NONCE_BYTES),
                                                 incarnation()))
            challenge, _ = await read_frame(reader)
            assert isinstance(challenge, p.PeerChallenge) and challenge.daemon == "daemon-a"
            await send_frame(writer, p.PeerProof(b"\x00" * 32))
            frames = await asyncio.wait_for(read_until_eof(reader), 5)
            assert len(frames) == 1 and isinstance(frames[0], p.PeerRefused)
            assert "secret" in frames[0].reason
        finally:
            writer.close()
        await eventually(lambda: a.node.refused == 1)
        assert a.accepted.empty()


OTHER = f"(daemon 'future') is not {p.PEER_VERSION} (daemon 'daemon-a'"  # (what a refusal by version says)


@pytest.mark.parametrize("version,with_incarnation,reason", [
    (p.PEER_VERSION + 1, True, f"{p.PEER_VERSION + 1} {OTHER}"),  # another protocol
    (2, True, f"2 {OTHER}"),  # unsigned frames: it would link, then fail every frame
    (3, True, f"3 {OTHER}"),  # no credits: a long stream to it would wait for ever
    (4, True, f"4 {OTHER}"),  # HMAC'd frames: it would link, then fail every frame
    (5, True, f"5 {OTHER}"),  # heartbeats without quiet_ms: it would fail ours
    (p.PEER_VERSION, False, "incarnation"),  # this protocol's hello names its process
], ids=["newer", "unsigned", "no-credits", "hmac", "no-quiet", "no-incarnation"])
async def test_listener_refuses_a_hello_it_cannot_take(version: int, with_incarnation: bool,
                                                       reason: str) -> None:
    a = Side("daemon-a")
    async with sides(a):
        reader, writer = await asyncio.open_connection(HOST, await a.listen())
        try:
            await send_frame(writer, p.PeerHello(version, "future", os.urandom(p.NONCE_BYTES),
                                                 incarnation() if with_incarnation else b""))
            frames = await asyncio.wait_for(read_until_eof(reader), 5)
            assert len(frames) == 1 and isinstance(frames[0], p.PeerRefused)
            assert reason in frames[0].reason
        finally:
            writer.close()
        await eventually(lambda: a.node.refused == 1)


@pytest.mark.parametrize("case", ["own name", "version"])
async def test_a_refusal_of_a_hello_fits_at_the_longest_names(case: str) -> None:
    """The listener's refusals of a hello that name daemons, at the longest names (each
    character one that a quoted name escapes in 10) and version: each is sent, within a
    refusal's 1024 characters (before: the refusal of this daemon's own name quoted it whole,
    2562 characters; it raised, and the listener closed without a word)."""
    name = "\U000e0001" * p.MAX_DAEMON_NAME
    a = Side(name)
    async with sides(a):
        reader, writer = await asyncio.open_connection(HOST, await a.listen())
        try:
            hello = p.PeerHello(p.PEER_VERSION if case == "own name" else 2**64 - 1,
                                name if case == "own name" else name[:-1] + "x",
                                os.urandom(p.NONCE_BYTES), incarnation())
            await send_frame(writer, hello)
            frames = await asyncio.wait_for(read_until_eof(reader), 5)
            assert len(frames) == 1 and isinstance(frames[0], p.PeerRefused), frames
            assert {"own name": "is this daemon's own: each daemon needs a peer_name of its own",
                    "version": f"is not {p.PEER_VERSION}"}[case] in frames[0].reason
        finally:
            writer.close()
        await eventually(lambda: a.node.refused == 1)


@pytest.mark.parametrize("opening", [
    b"GET / HTTP/1.1\r\n\r\n",
    pf.FRAME.pack(0, 0),
    b"".join(pf.frame(proto.encode(proto.Ok(1)))),  # a Unix-socket message on the TCP port
    b"".join(pf.frame(encode_peer(p.Heartbeat(1)))),  # a peer message, but not a hello
    b"".join(pf.frame(encode_peer(p.PeerReady()))),
], ids=["http", "empty-header", "unix-message", "heartbeat", "ready"])
async def test_listener_refuses_a_bad_opening(opening: bytes) -> None:
    a = Side("daemon-a")
    async with sides(a):
        reader, writer = await asyncio.open_connection(HOST, await a.listen())
        try:
            writer.write(opening)
            await writer.drain()
            assert await hung_up(reader)  # closed without a word
        finally:
            writer.close()
        await eventually(lambda: a.node.refused == 1)
        assert a.accepted.empty()


async def test_listener_refuses_a_handshake_that_stalls(caplog: pytest.LogCaptureFixture) -> None:
    """A dialer that says nothing is cut at the handshake timeout, and the log says why
    (before: 'refused a peer: ', the timeout's empty text)."""
    a = Side("daemon-a", handshake_s=0.2)
    async with sides(a):
        reader, writer = await asyncio.open_connection(HOST, await a.listen())
        try:
            started = time.monotonic()
            assert await hung_up(reader)
            assert time.monotonic() - started >= 0.15
        finally:
            writer.close()
        await eventually(lambda: a.node.refused == 1)
        assert "refused a peer from 127.0.0.1: no handshake within 0.2s" in caplog.text, caplog.text


async def test_dialer_reports_a_refusal_in_words() -> None:
    async def refuse(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_frame(reader)
        await send_frame(writer, p.PeerRefused("draining: not taking new peers"))
        writer.close()

    server = await asyncio.start_server(refuse, HOST, 0)
    port = server.sockets[0].getsockname()[1]
    b = Side("daemon-b")
    async with sides(b):
        try:
            with pytest.raises(PeerRefusedError, match="draining"):
                await b.dial(port)
        finally:
            server.close()


async def test_dialer_refuses_a_listener_that_speaks_garbage() -> None:
    async def garbage(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.read(100)
        writer.write(pf.FRAME.pack(3, 0) + b"\xc1\xc1\xc1")
        await writer.drain()
        writer.close()

    server = await asyncio.start_server(garbage, HOST, 0)
    port = server.sockets[0].getsockname()[1]
    b = Side("daemon-b")
    async with sides(b):
        try:
            with pytest.raises(PeerRefusedError):
                await b.dial(port)
        finally:
            server.close()


async def test_dialing_your_own_listener_is_a_self_dial() -> None:
    a = Side("daemon-a")
    async with sides(a):
        port = await a.listen()
        with pytest.raises(SelfDialError):
            await a.dial(port)
        await asyncio.sleep(0.05)
        assert a.node.refused == 0  # a self-dial is not a refused peer
        assert a.accepted.empty() and a.lost.empty()
        # and it does not stop others from dialing in
        b = Side("daemon-b")
        async with sides(b):
            assert (await b.dial(port)).name == "daemon-a"


# ---- loss -------------------------------------------------------------------------------


async def test_a_silent_dialer_is_lost_by_the_listener() -> None:
    a = Side("daemon-a", fast=True)
    async with sides(a):
        session = await raw_dial(await a.listen())
        try:
            link, accepted_at = await a.next_link()
            assert link.name == "raw"
            lost, reason, lost_at = await a.next_lost()
            assert lost is link and link.closed
            assert "silent" in reason
            elapsed = lost_at - accepted_at
            assert WINDOW_S <= elapsed <= 3 * WINDOW_S, elapsed  # (lost at the window, give or take a beat)
            frames = await asyncio.wait_for(session.read_until_eof(), 5)  # the listener hung up
            assert frames and all(isinstance(f, p.Heartbeat) for f in frames)
            assert [f.seq for f in frames] == list(range(1, len(frames) + 1))
        finally:
            session.writer.close()


async def test_a_silent_listener_is_lost_by_the_dialer() -> None:
    raw = RawListener(go_silent)
    b = Side("daemon-b", fast=True)
    async with sides(b):
        try:
            port = await raw.start()
            started = time.monotonic()
            link = await b.dial(port)
            assert link.name == "raw-listener"
            lost, reason, lost_at = await b.next_lost()
            assert lost is link and "silent" in reason
            elapsed = lost_at - started
            assert WINDOW_S <= elapsed <= 3 * WINDOW_S, elapsed  # (lost at the window, give or take a beat)
        finally:
            raw.close()


async def test_a_peer_that_stops_is_lost() -> None:
    """The listening node goes away without a word (server closed, link tasks cancelled,
    socket left open): the dialer notices the silence."""
    a, b = Side("daemon-a", fast=True), Side("daemon-b", fast=True)
    async with sides(a, b):
        b_to_a = await b.dial(await a.listen())
        a_to_b, _ = await a.next_link()
        a.node.close()
        for task in a_to_b._tasks:  # what a SIGSTOPped daemon looks like from outside
            task.cancel()
        started = time.monotonic()
        lost, reason, lost_at = await b.next_lost()
        assert lost is b_to_a and "silent" in reason
        assert lost_at - started <= WINDOW_S + HEARTBEAT_S + 0.3


FAILED_HEADER = encode_peer(p.WorldFailed("w", 0, ErrorCode.TIMEOUT, "forged"))
FAILED_FRAME = b"".join(pf.frame(FAILED_HEADER))
BAD_LENGTHS = {  # refused from the lengths alone, before anything is read or opened
    "empty header": pf.FRAME.pack(0, 0),
    # (an established link's frames are sealed: their headers may take 1 MiB)
    "header over the limit": pf.FRAME.pack(pf.MAX_SEALED_HEADER_BYTES + 1, 0),
    "payload over the limit": pf.FRAME.pack(10, pf.MAX_PAYLOAD_BYTES + 1),
}
BAD_HEADERS = {  # sealed as the link seals a frame's header
    "not msgpack": b"\xc1\xc1\xc1",
    "unix message": proto.encode(proto.Ok(1)),
    "invalid value": msgpack.packb({"t": "heartbeat", "seq": -1}),
}
FORGED_FRAMES = {  # whole frames that someone without the link's keys could send
    "in the clear": FAILED_FRAME + bytes(pf.TAG_BYTES),
    "sealed under another key": b"".join(pf.FrameSeal(bytes(32)).seal(FAILED_HEADER, b"")),
    # a big payload announced, and not sent: refused on its header, nothing allocated for it
    # (and at once: not once the link falls silent)
    "a forged header before a big payload": pf.FRAME.pack(len(FAILED_HEADER), pf.MAX_PAYLOAD_BYTES)
    + FAILED_HEADER + bytes(pf.TAG_BYTES),
}


@pytest.mark.parametrize("garbage,sealed", [*((g, False) for g in BAD_LENGTHS.values()),
                                           *((h, True) for h in BAD_HEADERS.values()),
                                           *((f, False) for f in FORGED_FRAMES.values())],
                         ids=[*BAD_LENGTHS, *BAD_HEADERS, *FORGED_FRAMES])
async def test_a_garbage_frame_closes_the_link(garbage: bytes, sealed: bool) -> None:
    a = Side("daemon-a")
    async with sides(a):
        session = await raw_dial(await a.listen())
        try:
            link, _ = await a.next_link()
            await session.send(p.WorldFailed("w", 0, ErrorCode.TIMEOUT, "fine so far"))
            _, msg, _ = await a.next_message()
            assert isinstance(msg, p.WorldFailed)
            if sealed:
                await session.send_header(garbage)
            else:
                session.writer.write(garbage)
            lost, reason, _ = await a.next_lost()
            assert lost is link and link.closed
            assert reason.startswith("bad frame"), reason
            await asyncio.wait_for(session.read_until_eof(), 5)  # and hung up
            assert a.messages.empty()
        finally:
            session.writer.close()


async def test_a_replayed_frame_closes_the_link() -> None:
    """A frame sent again word for word (by someone relaying the link, say) fails to open:
    its place in the sequence is in its nonce."""
    a = Side("daemon-a")
    async with sides(a):
        session = await raw_dial(await a.listen())
        try:
            link, _ = await a.next_link()
            sealed = b"".join(session.sealed(p.WorldFailed("w", 0, ErrorCode.TIMEOUT, "once")))
            session.writer.write(sealed)
            _, msg, _ = await a.next_message()
            assert msg == p.WorldFailed("w", 0, ErrorCode.TIMEOUT, "once")
            session.writer.write(sealed)
            lost, reason, _ = await a.next_lost()
            assert lost is link and "replayed" in reason and a.messages.empty()
        finally:
            session.writer.close()


async def test_a_garbage_frame_from_the_listener_closes_the_dialers_link() -> None:
    async def garbage(session: RawSession) -> None:
        await session.send_header(b"\xc1\xc1\xc1")
        await asyncio.sleep(30)

    raw = RawListener(garbage)
    b = Side("daemon-b")
    async with sides(b):
        try:
            link = await b.dial(await raw.start())
            lost, reason, _ = await b.next_lost()
            assert lost is link and reason.startswith("bad frame"), reason
        finally:
            raw.close()


def test_a_stall_of_our_own_loop_is_not_the_peers_silence() -> None:
    """The daemon's loop can stall (an ncclCommAbort runs on it) while the peer goes on
    sending heartbeats. Under uvloop, as the daemon runs, timers run before reads: after the
    stall the watch must not count the time the frames waited unread as the peer's silence."""
    port: list[int] = []
    listening, stop = threading.Event(), threading.Event()

    async def peer() -> None:  # on its own loop and thread: it goes on while ours stalls
        b = Side("daemon-b", fast=True, window_s=10)  # (it does not hear us meanwhile: patient)
        async with sides(b):
            port.append(await b.listen())
            listening.set()
            while not stop.is_set():
                await asyncio.sleep(0.01)

    thread = threading.Thread(target=asyncio.run, args=(peer(),))
    thread.start()

    async def ours() -> None:
        a = Side("daemon-a", fast=True)
        async with sides(a):
            link = await a.dial(port[0])
            await asyncio.sleep(HEARTBEAT_S * 4)
            time.sleep(WINDOW_S * 3)  # the loop is stuck in a call that does not return soon
            await asyncio.sleep(HEARTBEAT_S * 4)
            assert not link.closed and a.lost.empty()

    try:
        assert listening.wait(10)
        loop = uvloop.new_event_loop()
        try:
            loop.run_until_complete(ours())
        finally:
            loop.close()
    finally:
        stop.set()
        thread.join(10)


async def test_a_big_frame_on_a_slow_link_is_not_silence() -> None:
    """A frame whose payload takes longer than the window to cross (a slow link; the
    heartbeats wait behind it) keeps the link: its bytes say the peer lives."""
    a = Side("daemon-a", fast=True)
    async with sides(a):
        session = await raw_dial(await a.listen())
        try:
            link, _ = await a.next_link()
            payload = os.urandom(1 << 20)
            lengths, header, sealed = session.sealed(p.Data("w", 1, "p2p", 0, 0, 1, "x"), payload)
            session.writer.write(lengths + header)
            pieces = 20  # over 1 s: more than three windows
            for i in range(pieces):
                await asyncio.sleep(WINDOW_S * 4 / pieces)
                session.writer.write(sealed[i * len(sealed) // pieces:(i + 1) * len(sealed) // pieces])
            assert a.lost.empty(), a.lost.get_nowait()  # kept through the whole trickle
            _, msg, received = await a.next_message()
            assert isinstance(msg, p.Data) and received == payload and not link.closed
        finally:
            session.writer.close()


def losses_seen_by_a_peer(stalling: Callable[[PeerLink], Awaitable[None]]) -> list[tuple[str, float]]:
    """`stalling(link)` runs on daemon A's loop (uvloop, as a daemon) with a link to daemon
    B, which runs on its own loop and thread and goes on while A's stalls; what B declared
    lost, and when."""
    port: list[int] = []
    lost: list[tuple[str, float]] = []
    listening, stop = threading.Event(), threading.Event()

    async def peer() -> None:
        b = Side("daemon-b", fast=True)
        async with sides(b):
            port.append(await b.listen())
            listening.set()
            while not stop.is_set():
                await asyncio.sleep(0.01)
            while not b.lost.empty():
                _, reason, at = b.lost.get_nowait()
                lost.append((reason, at))

    async def ours() -> None:
        a = Side("daemon-a", fast=True, window_s=60)  # (it does not hear the peer meanwhile: patient)
        async with sides(a):
            link = await a.dial(port[0])
            await asyncio.sleep(HEARTBEAT_S * 4)
            await stalling(link)

    thread = threading.Thread(target=asyncio.run, args=(peer(),))
    thread.start()
    try:
        assert listening.wait(10)
        on_uvloop(ours)
    finally:
        stop.set()
        thread.join(10)
    return lost


def test_a_stall_announced_to_the_peer_is_not_silence() -> None:
    """Before ncclCommAbort may stall its loop, a daemon tells its peers for how long
    (Heartbeat.quiet_ms): they keep the link through that silence (and every world on it),
    and judge silence again once the time announced is over."""
    stalls: list[float] = []

    async def stalling(link: PeerLink) -> None:
        link.announce_quiet(3.0)
        stalls.append(time.monotonic())
        time.sleep(WINDOW_S * 4)  # shorter than announced: the peer keeps the link
        await asyncio.sleep(HEARTBEAT_S * 6)
        link.announce_quiet(WINDOW_S * 2)
        stalls.append(time.monotonic())
        # longer than announced: lost once the announced time is over (the 1.5 s past it
        # that 3 s after an announced 1.2 s gave)
        time.sleep(WINDOW_S * 2 + 1.5)
        await asyncio.sleep(HEARTBEAT_S * 4)

    lost = losses_seen_by_a_peer(stalling)
    assert len(lost) == 1, lost
    reason, at = lost[0]
    assert "silent" in reason and stalls[1] + WINDOW_S * 2 <= at < stalls[1] + WINDOW_S * 2 + 1.5, \
        (reason, at - stalls[1])


def test_the_next_frame_ends_an_announced_quiet() -> None:
    """A stall shorter than announced: the heartbeats after it end the quiet time, and a
    later silence (a dead daemon) is judged by the window again, not excused until the
    first announcement's time runs out."""
    silent_from: list[float] = []

    async def stalling(link: PeerLink) -> None:
        link.announce_quiet(3.0)
        time.sleep(0.05)  # the abort returned at once
        await asyncio.sleep(HEARTBEAT_S * 4)
        silent_from.append(time.monotonic())
        # unannounced; as long as the assert below gives the loss (and more), so that a
        # quiet still excused (the first announcement's 3 s) ends in no loss at all
        time.sleep(WINDOW_S * 5)
        await asyncio.sleep(HEARTBEAT_S * 4)

    lost = losses_seen_by_a_peer(stalling)
    assert len(lost) == 1, lost
    reason, at = lost[0]
    assert "silent" in reason and at - silent_from[0] < WINDOW_S * 4, (reason, at - silent_from[0])


# ---- payloads are not copied: what `drain` and `close` promise about them -------------------


def on_uvloop(test: Callable[[], Any]) -> Any:
    """As the daemon runs: uvloop queues what the socket does not take by reference."""
    loop = uvloop.new_event_loop()
    try:
        return loop.run_until_complete(test())
    finally:
        loop.close()


def test_a_payload_may_change_once_drain_returned() -> None:
    """The engine reuses a chunk's buffer as soon as `drain` returns: every byte of it must
    be in the socket by then. Before, a tail under the high-water mark (64 KiB) stayed
    queued by reference, and went out with the next chunk's bytes in it."""
    frames, size = 64, 32 << 10  # more than the socket holds while the peer does not read
    received: list[bytes] = []

    async def read_later(session: RawSession) -> None:
        await asyncio.sleep(0.3)  # the socket fills up meanwhile
        while len(received) < frames:
            msg, payload = await session.read()
            if not isinstance(msg, p.Heartbeat):
                received.append(payload)

    async def test() -> None:
        listener, b = RawListener(read_later), Side("daemon-b")
        try:
            link = await b.dial(await listener.start())
            link._stream._transport.get_extra_info("socket").setsockopt(
                socket.SOL_SOCKET, socket.SO_SNDBUF, 16384)  # full after a few frames
            buffer = bytearray(size)
            for i in range(frames):
                buffer[:] = bytes([i + 1]) * size
                link.send(p.Data("w", 1, "partial", i, 0, 0, ""), memoryview(buffer))
                await link.drain()
                # (sealing copies the payload, so the buffer is free at once anyway: what drain
                # promises, and the engine's flow control counts on, is that the socket took all)
                assert link._stream._transport.get_write_buffer_size() == 0
            await eventually(lambda: len(received) == frames, 10)
        finally:
            b.close()
            listener.close()

    on_uvloop(test)
    assert [set(payload) for payload in received] == [{i + 1} for i in range(frames)]


def test_a_lost_link_sends_nothing_more() -> None:
    """A link declared lost drops what is still queued: the peer must not get, after the
    loss, frames of the worlds the loss failed (a frame in the clear would even name memory
    the engine and the workers reuse once their world failed)."""
    size = pf.MAX_PAYLOAD_BYTES - 1024
    received = bytearray()

    async def read_later(session: RawSession) -> None:
        await reading.wait()
        with suppress(ConnectionError):
            while chunk := await session.reader.read(1 << 20):
                received.extend(chunk)
        done.set()

    async def test() -> None:
        listener, b = RawListener(read_later), Side("daemon-b")
        try:
            link = await b.dial(await listener.start())
            buffer = bytearray(b"\x01") * size
            link.send(p.Data("w", 1, "partial", 0, 0, 0, ""), memoryview(buffer))  # > the socket takes
            link.close("silent for 3.0s")
            buffer[:] = bytes(size)  # the failed call's memory, reused
            reading.set()
            await asyncio.wait_for(done.wait(), 10)
        finally:
            b.close()
            listener.close()

    reading, done = asyncio.Event(), asyncio.Event()
    on_uvloop(test)
    header_len, payload_len = pf.sealed_lengths(*pf.frame_lengths(bytes(received[:pf.FRAME.size])))
    payload = received[pf.FRAME.size + header_len:]
    assert payload_len == size + pf.TAG_BYTES and 0 < len(payload) < size  # what the socket held, no more


async def test_closing_the_node_ends_handshakes_under_way() -> None:
    """A connection still in its handshake when the node closes is closed with it (it was
    left open, its handshake cancelled)."""
    a = Side("daemon-a")
    async with sides(a):
        reader, writer = await asyncio.open_connection(HOST, await a.listen())
        try:
            await eventually(lambda: len(a.node._handshakes) == 1)
            a.node.close()
            assert await hung_up(reader)
        finally:
            writer.close()


async def test_a_flood_of_silent_connections_is_cut_at_the_handshake_limit(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Past MAX_HANDSHAKES under way, a connection is dropped at once (each would hold an fd
    for the handshake timeout); once they end, daemons link as before."""
    monkeypatch.setattr(peering, "MAX_HANDSHAKES", 3)
    a, b = Side("daemon-a", handshake_s=30), Side("daemon-b")
    async with sides(a, b):
        port = await a.listen()
        silent = [await asyncio.open_connection(HOST, port) for _ in range(3)]
        await eventually(lambda: len(a.node._handshakes) == 3)
        reader, writer = await asyncio.open_connection(HOST, port)
        assert await hung_up(reader)
        writer.close()
        assert a.node.refused == 1 and len(a.node._handshakes) == 3
        for _, silent_writer in silent:
            silent_writer.close()
        await eventually(lambda: not a.node._handshakes)
        link = await b.dial(port)
        assert not link.closed and a.node.refused == 4  # (the three cut handshakes count too)


# ---- a listener too busy for one more handshake ---------------------------------------------


async def hold_handshakes(port: int, per_source: dict[str, int]) -> list[asyncio.StreamWriter]:
    """Connections that say nothing (each holds a handshake slot until it is closed), opened
    from loopback addresses of their own: `per_source` says how many from which."""
    writers = []
    for source, count in per_source.items():
        for _ in range(count):
            writers.append((await asyncio.open_connection(HOST, port, local_addr=(source, 0)))[1])
    return writers


# what fills the listener's MAX_HANDSHAKES (128): 64 from one host, then 16 (its cap past 64)
# from each of four more
FULL = {"127.0.0.2": 64, "127.0.0.3": 16, "127.0.0.4": 16, "127.0.0.5": 16, "127.0.0.6": 16}


async def test_a_dial_a_host_has_too_many_handshakes_for_is_made_again() -> None:
    """64 handshakes under way from 127.0.0.2 and 16 from 127.0.0.1: the listener turns a 17th
    from 127.0.0.1 away, saying it is busy; the dial comes again and links once there is room
    (before: it failed at once, PeerRefusedError '16 handshakes from 127.0.0.1 are under way
    already', and the daemon's ranks heard PeerLost)."""
    a, b = Side("daemon-a", handshake_s=30), Side("daemon-b", handshake_s=5)
    async with sides(a, b):
        port = await a.listen()
        held = await hold_handshakes(port, {"127.0.0.2": 64, HOST: 16})
        try:
            await eventually(lambda: len(a.node._handshakes) == 80)
            dial = asyncio.create_task(b.dial(port))
            await eventually(lambda: a.node.refused >= 2 or dial.done())  # turned away twice
            assert not dial.done(), dial.exception()
            # what it hears, first thing
            reader, writer = await asyncio.open_connection(HOST, port)
            frames = await asyncio.wait_for(read_until_eof(reader), 5)
            writer.close()
            assert frames == [p.PeerBusy("16 handshakes from 127.0.0.1 are under way already")]
        finally:
            for silent in held:
                silent.close()
        link = await asyncio.wait_for(dial, 5)
        assert link.name == "daemon-a" and (await a.next_link())[0].name == "daemon-b"
        link.send(p.JoinWithdrawn("w", 3))
        assert (await a.next_message())[1] == p.JoinWithdrawn("w", 3)


async def test_a_dial_dropped_at_the_handshake_limit_is_made_again() -> None:
    """MAX_HANDSHAKES (128) are under way: the listener drops a dial's connection without a
    word; the dial comes again and links once there is room (before: it failed at once,
    'closed by the peer')."""
    a, b = Side("daemon-a", handshake_s=30), Side("daemon-b", handshake_s=5)
    async with sides(a, b):
        port = await a.listen()
        held = await hold_handshakes(port, FULL)
        try:
            await eventually(lambda: len(a.node._handshakes) == peering.MAX_HANDSHAKES)
            dial = asyncio.create_task(b.dial(port))
            await eventually(lambda: a.node.refused >= 3 or dial.done())  # dropped three times
            assert not dial.done(), dial.exception()
            assert len(a.node._handshakes) == peering.MAX_HANDSHAKES
        finally:
            for silent in held:
                silent.close()
        link = await asyncio.wait_for(dial, 5)
        assert link.name == "daemon-a" and (await a.next_link())[0].name == "daemon-b"


async def test_daemons_kept_out_by_a_flood_dial_again_spaced_out_and_give_up_in_their_window() -> None:
    """Silent connections hold every handshake slot for longer than the dialers wait: each of
    20 daemons dials again a few times, spaced out, never holding more than its one
    connection, and fails at its handshake timeout (1 s) saying why, so honest daemons do not
    make the flood bigger; once the flood is gone, one links."""
    a = Side("daemon-a", handshake_s=30)
    dialers = [Side(f"daemon-{i}", handshake_s=1) for i in range(20)]
    async with sides(a, *dialers):
        port = await a.listen()
        held = await hold_handshakes(port, FULL)
        try:
            await eventually(lambda: len(a.node._handshakes) == peering.MAX_HANDSHAKES)
            started = time.monotonic()
            dials = await asyncio.gather(*(side.dial(port) for side in dialers), return_exceptions=True)
            took = time.monotonic() - started
        finally:
            for silent in held:
                silent.close()
        assert all(isinstance(error, PeerRefusedError) for error in dials), dials
        assert all("closed the connection before the handshake" in str(error) for error in dials), dials
        assert 0.5 < took < 1.5, took
        tries = [int(str(error).split("(dialed ")[1].split(" ")[0]) for error in dials]
        # pauses of at least 10, 20, 40, 80, 160, then 250 ms: no more than 8 tries in 1 s
        assert all(3 <= n <= 8 for n in tries), tries
        # each try one connection, dropped at once (a try whose window ended as its connection
        # waited in the listener's backlog is counted once the listener's loop accepts it)
        await eventually(lambda: a.node.refused == sum(tries), f"{sum(tries)} refusals counted")
        await eventually(lambda: not a.node._handshakes)
        assert (await dialers[0].dial(port)).name == "daemon-a"


@pytest.mark.parametrize("case", ["secret", "own name", "name taken", "version"])
async def test_a_refusal_that_will_not_pass_ends_the_dial_at_once(case: str) -> None:
    """A dial refused for a reason that a try again would meet as well fails at once, with
    the reason, after one connection, as before (only 'busy' is worth a try again)."""
    connections = 0

    async def refuse_by_version(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal connections
        connections += 1
        await read_frame(reader)
        await send_frame(writer, p.PeerRefused(f"peer protocol {p.PEER_VERSION} is not 99"))
        writer.close()

    b = Side("daemon-b", secret=b"another secret" if case == "secret" else SECRET, handshake_s=5)
    a = Side("daemon-b" if case == "own name" else "daemon-a", handshake_s=5)
    if case == "name taken":
        a.node = PeerNode(a.settings, a._on_message, a._on_lost,
                          lambda name, incarnation: f"daemon name {name!r} is taken")
    async with sides(a, b):
        if case == "version":
            server = await asyncio.start_server(refuse_by_version, HOST, 0)
            port = server.sockets[0].getsockname()[1]
        else:
            port = await a.listen()
        try:
            started = time.monotonic()
            with pytest.raises(PeerRefusedError) as refused:
                await b.dial(port)
            assert time.monotonic() - started < 0.5
        finally:
            if case == "version":
                server.close()
        assert type(refused.value) is PeerRefusedError  # (not PeerBusyError)
        assert {"secret": "does not hold our secret", "own name": "this daemon's own",
                "name taken": "'daemon-b' is taken", "version": "is not 99"}[case] in str(refused.value)
        await asyncio.sleep(0.1)  # (a try again would have come by now)
        assert (connections if case == "version" else a.node.refused) == 1

async def test_a_listener_that_stops_after_the_dialers_proof_is_dialed_again() -> None:
    """The listener's daemon stops after the dialer sent its proof (its node closes the
    handshakes under way, without a word): the dial comes again, and ends as a dial to a
    daemon not listening (ConnectionRefusedError, which a joining rank rides out until the
    daemon is back). Before: it failed at once, 'closed by the peer', and the member refused
    its joining rank with PeerLost."""
    connections = 0

    async def stop_after_the_proof(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal connections
        connections += 1
        hello, _ = await read_frame(reader)
        nonce, ours = os.urandom(p.NONCE_BYTES), incarnation()
        transcript = p.transcript(hello, "daemon-a", ours, nonce)
        await send_frame(writer, p.PeerChallenge("daemon-a", nonce,
                                                 p.proof(SECRET, "listener", transcript), ours))
        assert isinstance((await read_frame(reader))[0], p.PeerProof)
        server.close()  # (the daemon stops: nothing listens there any more)
        writer.close()

    b = Side("daemon-b", handshake_s=5)
    async with sides(b):
        server = await asyncio.start_server(stop_after_the_proof, HOST, 0)
        port = server.sockets[0].getsockname()[1]
        try:
            with pytest.raises(ConnectionRefusedError):
                await b.dial(port)
        finally:
            server.close()
        assert connections == 1


async def test_someone_relaying_a_handshake_cannot_speak_on_the_link() -> None:
    """A worker can make its daemon (C) dial any address: there, a relay passes C's handshake
    with daemon A through, byte for byte, so A and C link up through it. The relay holds no
    key: a frame it adds is refused by A (the link closes), and never reaches A's worlds."""
    a, c = Side("daemon-a"), Side("daemon-c")
    to_a: list[asyncio.StreamWriter] = []

    async def pump(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with suppress(ConnectionError):
            while data := await reader.read(65536):
                writer.write(data)
                await writer.drain()

    async def relay(from_c: asyncio.StreamReader, to_c: asyncio.StreamWriter) -> None:
        from_a, a_writer = await asyncio.open_connection(HOST, a.port)
        to_a.append(a_writer)
        await asyncio.gather(pump(from_c, a_writer), pump(from_a, to_c))

    async with sides(a, c):
        await a.listen()
        relay_server = await asyncio.start_server(relay, HOST, 0)
        try:
            c_link = await c.dial(relay_server.sockets[0].getsockname()[1])
            a_link, _ = await a.next_link()
            assert c_link.name == "daemon-a" and a_link.name == "daemon-c"  # linked, through it
            c_link.send(p.WorldFailed("w", 1, ErrorCode.TIMEOUT, "from c itself"))
            _, msg, _ = await a.next_message()
            assert msg.message == "from c itself"  # what C says passes
            forged = pf.frame(encode_peer(p.WorldFailed("w", 1, ErrorCode.PEER_LOST, "forged")))
            to_a[0].writelines([*forged, bytes(pf.TAG_BYTES)])
            lost, reason, _ = await a.next_lost()
            assert lost is a_link and "forged" in reason and a.messages.empty()
        finally:
            relay_server.close()
            for writer in to_a:
                writer.close()


def test_frames_right_behind_the_listeners_ready_are_read_sealed() -> None:
    """The listener's ready and its first sealed frames, one with a payload, in one
    segment: the dialer reads the ready in the clear and the rest sealed, payload included
    (it had checked the listener's proof before: a payload may come at once)."""
    async def test() -> None:
        listener = RawListener(go_silent, with_ready=[(p.Heartbeat(1), b""),
                                                      (p.Data("w", 1, "partial", 0, 0, 0, ""), b"x" * 1000)])
        b = Side("daemon-b")
        async with sides(b):
            try:
                link = await b.dial(await listener.start())
                _, msg, payload = await b.next_message()
                assert isinstance(msg, p.Data) and payload == b"x" * 1000 and not link.closed
            finally:
                listener.close()

    on_uvloop(test)


class HeldTransport:
    """A transport that only records what the stream does to it."""

    def __init__(self) -> None:
        self.closed = False

    def set_write_buffer_limits(self, high: int) -> None:
        pass

    def close(self) -> None:
        self.closed = True

    abort = close


async def test_a_payload_before_the_handshake_is_refused_before_anything_is_allocated() -> None:
    """Anyone who reaches the port could otherwise make the daemon allocate up to
    MAX_PAYLOAD_BYTES per half-open connection: the frame is refused from its lengths."""
    stream = frames.FrameStream()
    transport = HeldTransport()
    stream.connection_made(transport)  # type: ignore[arg-type]
    header = encode_peer(p.Heartbeat(1))
    prefix = pf.FRAME.pack(len(header), pf.MAX_PAYLOAD_BYTES)
    target = stream.get_buffer(-1)
    target[:len(prefix)] = prefix
    stream.buffer_updated(len(prefix))
    assert transport.closed
    with pytest.raises(proto.DecodeError, match="a payload before the handshake ended"):
        await stream.read()
    assert len(stream.get_buffer(-1)) < 1 << 10  # no buffer was made for it


async def test_a_cancelled_drainer_leaves_the_others_waiting_for_the_socket() -> None:
    """Drainers share one future while the socket is full; before, cancelling one (its op
    cancelled) cancelled that future, and every other drainer got CancelledError."""
    stream = frames.FrameStream()
    stream.pause_writing()
    first = asyncio.create_task(stream.drain())
    second = asyncio.create_task(stream.drain())
    await asyncio.sleep(0)
    first.cancel()
    await asyncio.sleep(0)
    assert first.cancelled() and not second.done()
    stream.resume_writing()
    await asyncio.wait_for(second, 5)
    assert second.exception() is None
