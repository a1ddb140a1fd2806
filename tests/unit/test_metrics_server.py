"""The /metrics port's bounds, in-process: serve_metrics on this loop with an answer big
enough (8 MiB) that scrapers which never read it hold their slots while it drains."""

from __future__ import annotations

import asyncio
import socket

import pytest

from commd.metrics import _MAX_SCRAPERS, bound_address, serve_metrics

pytestmark = pytest.mark.timeout(60)

BODY = bytes(range(256)) * (32 << 10)  # 8 MiB: more than loopback buffers take unread
REQUEST = b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n"


async def connect(address: str) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """A scraper with a small receive window, so an answer it does not read stays unsent."""
    host, port = address.rsplit(":", 1)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.setblocking(False)
    await asyncio.get_running_loop().sock_connect(sock, (host, int(port)))
    return await asyncio.open_connection(sock=sock, limit=len(BODY) * 2)


async def scraping(address: str) -> list[tuple[asyncio.StreamReader, asyncio.StreamWriter]]:
    """_MAX_SCRAPERS scrapers whose answers have begun and are stuck behind them."""
    deaf = [await connect(address) for _ in range(_MAX_SCRAPERS)]
    for _, writer in deaf:
        writer.write(REQUEST)
    for reader, _ in deaf:
        assert await asyncio.wait_for(reader.readexactly(17), 10) == b"HTTP/1.1 200 OK\r\n"
    return deaf


async def answer(reader: asyncio.StreamReader) -> bytes:
    return await asyncio.wait_for(reader.read(), 20)


async def closed_unanswered(reader: asyncio.StreamReader) -> bool:
    try:  # (closed with our request unread, the kernel sends a reset rather than a FIN)
        return await asyncio.wait_for(reader.read(), 2) == b""
    except ConnectionResetError:
        return True


async def let_go(server: asyncio.Server, *conns: asyncio.StreamWriter) -> None:
    """Reset every scraper and close the server; its handlers see the resets and end
    (3.11's wait_closed does not wait for them, and one cancelled at loop close logs)."""
    for conn in conns:
        conn.transport.abort()
    server.close()
    await server.wait_closed()
    await asyncio.sleep(0.2)


def is_whole(reply: bytes, expected: bytes = BODY) -> bool:
    head, _, body = reply.partition(b"\r\n\r\n")
    return head.startswith(b"HTTP/1.1 200 OK\r\n") and f"Content-Length: {len(expected)}".encode() in head \
        and body == expected


async def test_a_scrape_while_every_slot_is_being_answered_waits_for_one_then_gets_its_answer() -> None:
    """Before, a scrape arriving while all 16 slots were mid-answer was closed unanswered
    (seen in CI as RemoteDisconnected on a scrape right after 16 others)."""
    pytest.importorskip("prometheus_client")
    server = await serve_metrics("127.0.0.1", 0, lambda: BODY)
    deaf = await scraping(bound_address(server))
    reader, writer = await connect(bound_address(server))
    try:
        writer.write(REQUEST)
        await asyncio.sleep(0.3)  # (the old handler closed it at once)
        deaf[0][1].transport.abort()  # a reset: that slot's drain fails, the slot frees
        assert is_whole(await answer(reader))
    finally:
        await let_go(server, writer, *(conn for _, conn in deaf))


async def test_at_most_as_many_scrapes_wait_as_are_served_the_next_is_closed() -> None:
    """Waiting scrapes hold descriptors too: 16 wait, a 17th is closed at once; each of the
    16 is answered whole once the slots free."""
    pytest.importorskip("prometheus_client")
    server = await serve_metrics("127.0.0.1", 0, lambda: BODY)
    address = bound_address(server)
    deaf = await scraping(address)
    queued = [await connect(address) for _ in range(_MAX_SCRAPERS)]
    reader, writer = await connect(address)
    try:
        for _, conn in queued:
            conn.write(REQUEST)
        await asyncio.sleep(0.3)  # the 16 are waiting for slots
        writer.write(REQUEST)
        assert await closed_unanswered(reader)
        for _, conn in deaf:
            conn.transport.abort()
        replies = await asyncio.gather(*(answer(queued_reader) for queued_reader, _ in queued))
        assert [is_whole(reply) for reply in replies] == [True] * _MAX_SCRAPERS
    finally:
        await let_go(server, writer, *(conn for _, conn in deaf + queued))


async def test_a_burst_of_more_scrapes_than_slots_is_answered_whole() -> None:
    """16 scrapers connect and send their requests a moment after a 17th: none is closed
    as idle. Before, the 17th closed the first at once, unanswered, as it had said nothing
    yet (a burst of scrapes whose requests the server had not read yet lost as many)."""
    pytest.importorskip("prometheus_client")
    small = b"commd_up 1\n"
    server = await serve_metrics("127.0.0.1", 0, lambda: small)
    address = bound_address(server)
    early = [await connect(address) for _ in range(_MAX_SCRAPERS)]
    late = await connect(address)
    conns = [writer for _, writer in [*early, late]]
    try:
        late[1].write(REQUEST)
        await asyncio.sleep(0.3)  # the 17th waits for a slot
        for _, writer in early:
            writer.write(REQUEST)
        replies = await asyncio.gather(*(answer(reader) for reader, _ in [*early, late]))
        assert [is_whole(reply, small) for reply in replies] == [True] * (_MAX_SCRAPERS + 1)
    finally:
        await let_go(server, *conns)


async def test_connections_silent_past_the_grace_make_way_oldest_first() -> None:
    """20 connections say nothing, then a scrape comes: the four beyond the 16 slots and the
    scrape wait, and the oldest silent five make way for them once past the grace (the
    four then wait their turn silent in the slots they got); the scrape is answered."""
    pytest.importorskip("prometheus_client")
    small = b"commd_up 1\n"
    server = await serve_metrics("127.0.0.1", 0, lambda: small)
    address = bound_address(server)
    silent = [await connect(address) for _ in range(_MAX_SCRAPERS + 4)]
    scrape = await connect(address)
    conns = [writer for _, writer in [*silent, scrape]]
    try:
        scrape[1].write(REQUEST)
        assert is_whole(await answer(scrape[0]), small)
        closed = await asyncio.gather(*(asyncio.wait_for(reader.read(), 0.1)
                                        for reader, _ in silent), return_exceptions=True)
        assert [got == b"" for got in closed] == [True] * 5 + [False] * (_MAX_SCRAPERS - 1)
    finally:
        await let_go(server, *conns)


def set_reading(conn: asyncio.StreamWriter, reading: bool) -> None:
    """Paused, a scraper leaves what comes in the kernel's buffers: its answer stays unsent."""
    transport = conn.transport
    assert isinstance(transport, asyncio.ReadTransport)
    if reading:
        transport.resume_reading()
    else:
        transport.pause_reading()


async def test_a_freed_slot_goes_to_the_scrape_that_waited_longest() -> None:
    """A and B wait for a slot, in that order; one frees just as C connects: A is answered,
    C waits while B has A's slot, and C's turn comes when B's answer is done. Before, all
    woke for the one slot: A took it, B closed A as idle (its request not read yet) and
    took it, C did so to B; A and B were closed unanswered."""
    pytest.importorskip("prometheus_client")
    server = await serve_metrics("127.0.0.1", 0, lambda: BODY)
    address = bound_address(server)
    host, port = address.rsplit(":", 1)
    deaf = await scraping(address)
    conns = [conn for _, conn in deaf]
    for conn in conns:  # (deaf now: their slots are held until the drain's timeout)
        set_reading(conn, False)

    async def waiting_scrape() -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        scrape = await asyncio.open_connection(host, int(port), limit=len(BODY) * 2)
        conns.append(scrape[1])
        scrape[1].write(REQUEST)
        return scrape

    try:
        a = await waiting_scrape()
        await asyncio.sleep(0.2)  # A waits
        b = await waiting_scrape()
        set_reading(b[1], False)  # (B's answer, when it comes, is held)
        await asyncio.sleep(0.2)  # B waits behind it
        conns[0].transport.abort()  # a slot frees as C connects: the server's next poll sees both
        c = await asyncio.open_connection(sock=socket.create_connection((host, int(port)), 2),
                                          limit=len(BODY) * 2)
        conns.append(c[1])
        c[1].write(REQUEST)
        assert is_whole(await answer(a[0]))
        with pytest.raises(TimeoutError):  # A's slot went to B, whose answer is held
            await asyncio.wait_for(c[0].read(1), 0.5)
        set_reading(b[1], True)
        assert is_whole(await answer(b[0]))
        assert is_whole(await answer(c[0]))
    finally:
        await let_go(server, *conns)
