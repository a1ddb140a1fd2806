"""Prometheus metrics (`--metrics HOST:PORT`): optional, off by default.

Nothing is counted for Prometheus on the call path. The daemon keeps plain
counters (`commd.stats`) and its own state; a custom collector turns them into
metric families when a scrape arrives. /metrics is served by a small HTTP
handler on the daemon's own event loop, so the collector reads that state on
the thread that writes it: no locks, no torn reads, and no second thread
competing for the GIL with the call path between scrapes.

prometheus-client is imported only here, only when metrics are on: the daemon
runs without it installed (`pip install commd[metrics]`).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

from .errors import ConfigError, cannot_listen
from .world import WorldState

if TYPE_CHECKING:
    from .server import Server

log = logging.getLogger("commd.metrics")
_REQUEST_TIMEOUT_S = 5.0
_MAX_SCRAPERS = 16  # connections served at once (see take_slot for the 17th)
_IDLE_GRACE_S = 1.0  # silent this long after its slot is taken, a connection is idle
_MAX_REQUEST = 8192


class DaemonCollector:
    """Reads the daemon's counters and state at scrape time (on the event loop)."""

    def __init__(self, server: Server) -> None:
        self._server = server

    def describe(self) -> list[Any]:
        return []  # registering must not call collect(); the families are built per scrape

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import (
            CounterMetricFamily,
            GaugeMetricFamily,
            HistogramMetricFamily,
        )

        server = self._server
        stats = server.registry.stats
        calls = CounterMetricFamily("commd_calls", "Calls by op and outcome", labels=["op", "outcome"])
        nbytes = CounterMetricFamily("commd_call_bytes", "Bytes given by completed calls, per rank "
                                     "call (the call's bytes argument)", labels=["op"])
        latency = HistogramMetricFamily("commd_call_latency_seconds", "From a call's arrival at the "
                                        "daemon to its completion (completed calls)", labels=["op"])
        for op, s in sorted(stats.calls.by_op.items()):
            calls.add_metric([op, "done"], s.done)
            calls.add_metric([op, "failed"], s.failed)
            nbytes.add_metric([op], s.bytes)
            latency.add_metric([op], s.cumulative(), s.seconds)
        yield from (calls, nbytes, latency)

        transitions = CounterMetricFamily("commd_world_transitions", "World state changes, by the "
                                          "state entered", labels=["state"])
        for state, count in sorted(stats.transitions.items()):
            transitions.add_metric([state], count)
        failures = CounterMetricFamily("commd_world_failures", "World failures by cause",
                                       labels=["cause"])
        for cause, count in sorted(stats.failures.items()):
            failures.add_metric([cause], count)
        yield transitions
        yield failures
        yield CounterMetricFamily("commd_reconnects", "attempt_reconnect calls of ranks",
                                  value=stats.reconnects)

        worlds = GaugeMetricFamily("commd_worlds", "Worlds by state", labels=["state"])
        by_state = {state.value: 0 for state in WorldState}
        for world in server.registry.worlds.values():
            by_state[world.state.value] += 1
        for state, count in by_state.items():
            worlds.add_metric([state], count)
        yield worlds
        yield GaugeMetricFamily("commd_connections", "Open client connections",
                                value=len(server.sessions))
        yield GaugeMetricFamily("commd_ranks_connected", "Ranks that are members of a world here",
                                value=server.registry.connected_ranks())
        yield GaugeMetricFamily("commd_uptime_seconds", "Seconds since the daemon started",
                                value=server.uptime())
        yield from self._peers()

    def _peers(self) -> Iterator[Any]:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        cluster = self._server.cluster
        if cluster is None:
            return
        yield GaugeMetricFamily("commd_peer_links", "Authenticated links to other daemons",
                                value=len(cluster.open_links()))
        yield GaugeMetricFamily("commd_peer_bytes_held", "Bytes received from other daemons that no "
                                "op has taken yet", value=sum(w.net.inbox.held_bytes for w in
                                                              self._server.registry.worlds.values()
                                                              if w.net is not None))
        refused = CounterMetricFamily("commd_peer_refused", "Peer messages and handshakes refused",
                                      labels=["why"])
        refused.add_metric(["handshake"], cluster.refused)
        refused.add_metric(["stale_epoch"], cluster.stale_refused)
        refused.add_metric(["foreign"], cluster.foreign_refused)
        yield refused


def renderer(server: Server) -> Callable[[], bytes]:
    """The exposition text of the daemon's metrics, built anew on each call."""
    try:
        from prometheus_client import CollectorRegistry, generate_latest
    except ImportError:
        raise ConfigError("metrics_listen: needs prometheus-client (pip install 'commd[metrics]')",
                          key="metrics_listen") from None
    registry = CollectorRegistry()  # ours alone: the library's global one holds process metrics
    registry.register(DaemonCollector(server))
    return lambda: bytes(generate_latest(registry))


async def serve_metrics(host: str, port: int, render: Callable[[], bytes]) -> asyncio.Server:
    """Serve GET /metrics on (host, port) from this event loop."""
    from prometheus_client import CONTENT_TYPE_LATEST

    loop = asyncio.get_running_loop()
    active: set[asyncio.StreamWriter] = set()  # holding a slot
    # active, no request read yet: since when (loop time), oldest first
    waiting: dict[asyncio.StreamWriter, float] = {}
    # waiting for a slot, oldest first: a freed slot is handed to the first (FIFO)
    queued: dict[asyncio.StreamWriter, asyncio.Future[None]] = {}

    def free_slot(writer: asyncio.StreamWriter) -> None:
        """Close `writer` and hand its slot, if it held one, to the oldest waiting scrape."""
        waiting.pop(writer, None)
        writer.close()
        if writer not in active:
            return
        active.discard(writer)
        while queued:
            turn_of = next(iter(queued))
            turn = queued.pop(turn_of)
            if not turn.done():  # (else it timed out, or its handler was cancelled)
                active.add(turn_of)
                turn.set_result(None)
                return

    recheck: asyncio.TimerHandle | None = None  # when the oldest silent one passes the grace

    def hand_idle_slots() -> None:
        """Slots held by connections silent past the grace go to the scrapes waiting: idle
        connections held open cannot shut scrapers out. Only past the grace: a scraper
        sends its request as it connects, but its handler may not have read it yet (one
        just given a slot, or one of a burst), and closing it would lose a real scrape.
        Called whenever a scrape queues or a connection starts waiting; while scrapes
        wait, it runs again when the oldest silent one passes the grace."""
        nonlocal recheck
        now = loop.time()
        while queued and waiting:
            oldest, since = next(iter(waiting.items()))
            if now - since < _IDLE_GRACE_S:
                if recheck is None:
                    recheck = loop.call_at(since + _IDLE_GRACE_S, recheck_idle)
                return
            free_slot(oldest)

    def recheck_idle() -> None:
        nonlocal recheck
        recheck = None
        hand_idle_slots()

    async def take_slot(writer: asyncio.StreamWriter) -> bool:
        """Whether the newcomer may be served, after waiting (bounded, first come first
        served) for a slot; it then holds one."""
        if len(active) < _MAX_SCRAPERS and not queued:  # the fds are the workers' (SCM_RIGHTS), not scrapers'
            active.add(writer)
            return True
        # every slot is being answered, which ends within the drain's timeout, or held by a
        # connection that says nothing, which makes way past the grace: a scrape in a burst
        # waits for one rather than being reset unanswered
        if len(queued) >= _MAX_SCRAPERS:
            return False
        turn = queued[writer] = loop.create_future()
        hand_idle_slots()
        try:
            await asyncio.wait_for(turn, _REQUEST_TIMEOUT_S)
        except TimeoutError:
            pass
        finally:
            queued.pop(writer, None)
        return writer in active  # (a turn given as the wait timed out still counts)

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            if not await take_slot(writer):
                return
            waiting[writer] = loop.time()
            hand_idle_slots()  # (arms the recheck for it where scrapes wait)
            head = await asyncio.wait_for(_read_head(reader), _REQUEST_TIMEOUT_S)
            request_line = head.split(b"\n", 1)[0].rstrip(b"\r")
            method, target, *_ = [*request_line.split(b" "), b"", b""]
            # the rest of a head too big, or a body (a POST's), may still be coming
            unread = not head or method != b"GET"
            if not unread:  # (one with more to come stays evictable: else a stream of those
                waiting.pop(writer, None)  # shuts scrapers out)
            allow = ""
            if not head:
                status, ctype, body = ("431 Request Header Fields Too Large", "text/plain",
                                       f"a request head is at most {_MAX_REQUEST} bytes\n".encode())
            elif method != b"GET":
                status, ctype, body = "405 Method Not Allowed", "text/plain", b"GET only\n"
                allow = "Allow: GET\r\n"  # (RFC 9110: a 405 must name the methods there are)
            elif target.split(b"?", 1)[0] not in (b"/metrics", b"/"):
                status, ctype, body = "404 Not Found", "text/plain", b"see /metrics\n"
            else:
                status, ctype, body = "200 OK", CONTENT_TYPE_LATEST, render()
            writer.write(f"HTTP/1.1 {status}\r\n{allow}Content-Type: {ctype}\r\nContent-Length: "
                         f"{len(body)}\r\nConnection: close\r\n\r\n".encode() + body)
            await asyncio.wait_for(writer.drain(), _REQUEST_TIMEOUT_S)
            if unread:  # closing on unread bytes would reset the answer away (a client that
                # sends the whole body before reading, as urllib does, saw only EPIPE)
                writer.write_eof()
                await asyncio.wait_for(_discard_until_eof(reader), 1.0)
        except (TimeoutError, asyncio.IncompleteReadError, ConnectionError):
            pass  # a scraper that went away or talks nonsense: nothing to answer
        except Exception:
            if not writer.is_closing():  # (uvloop: a write after the scraper reset is a RuntimeError)
                log.exception("metrics request failed")
        finally:
            free_slot(writer)

    try:
        return await asyncio.start_server(handle, host, port, limit=_MAX_REQUEST)
    except (OSError, UnicodeError) as exc:
        raise cannot_listen("metrics_listen", host, port, exc) from None


async def _read_head(reader: asyncio.StreamReader) -> bytes:
    """The request head up to its empty line, whose lines may end in CRLF or a bare LF (RFC
    9112 lets a server take both); b"" if it runs past _MAX_REQUEST bytes."""
    head = b""
    while True:
        try:
            line = await reader.readuntil(b"\n")
        except asyncio.LimitOverrunError:
            return b""
        head += line
        if len(head) > _MAX_REQUEST:
            return b""
        if line in (b"\r\n", b"\n"):
            return head


async def _discard_until_eof(reader: asyncio.StreamReader) -> None:
    while await reader.read(65536):
        pass


def bound_address(server: asyncio.Server) -> str:
    host, port = server.sockets[0].getsockname()[:2]
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
