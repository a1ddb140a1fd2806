"""One authenticated link between two daemons, once its handshake ended (`peering`).

A `PeerLink` reads frames (`frames.FrameStream`), hands every message but heartbeats
and goodbyes to its handler, sends a heartbeat every `heartbeat_s`, and declares the
peer lost when nothing arrived for `window_s` (a stopped or partitioned daemon). Losing
a link is reported once, to `on_lost`; the owner (the cluster) fails the worlds that
used it. A daemon that stops says goodbye first (`farewell`): its peer closes the link
as left, not lost.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import proto
from proto import ErrorCode, clip_text
from proto import peer as p

from . import __version__
from .frames import FrameStream, UnreadableFrame
from .logs import ThrottledBy

log = logging.getLogger("commd.peering")  # (one logger for everything between daemons)


@dataclass(frozen=True, slots=True)
class PeerSettings:
    name: str  # this daemon's name in the cluster
    secret: bytes = field(repr=False)  # never printed (as ServerConfig.peer_secret)
    heartbeat_s: float = 0.5
    window_s: float = 3.0
    # A daemon silent this long in a handshake is as lost as one silent on a link (None:
    # the window). Dials made while a network black-holes packets wait no longer.
    handshake_timeout_s: float | None = None
    # this process among the daemons that ever had `name` (a restarted daemon has a new one)
    incarnation: bytes = field(default_factory=lambda: os.urandom(p.INCARNATION_BYTES))

    @property
    def handshake_s(self) -> float:
        return self.window_s if self.handshake_timeout_s is None else self.handshake_timeout_s


Handler = Callable[["PeerLink", p.PeerMessage, bytes | bytearray], None]
LostHandler = Callable[["PeerLink", str], None]


class PeerLink:
    def __init__(self, name: str, incarnation: bytes, stream: FrameStream, settings: PeerSettings,
                 handler: Handler, on_lost: LostHandler, drops: ThrottledBy) -> None:
        self.name = name
        self.incarnation = incarnation  # the other daemon's process
        self._stream = stream
        self._settings = settings
        self._handler = handler
        self._on_lost = on_lost
        # (the node's, shared by its links, by daemon: a daemon that dials again and again, each
        # time with a frame that drops the link, would log a line a dial, some 1000 a second)
        self._drops = drops
        self.last_seen = time.monotonic()
        self._quiet_until = 0.0  # the peer said its loop may stall until then (Heartbeat.quiet_ms)
        self._beats = 0
        self.closed = False
        self.loss = ""  # once closed: what the worlds over the link fail with (`close`)
        self.loss_code = ErrorCode.PEER_LOST  # and their code (`close`)
        self.closed_at = 0.0  # once closed: when (time.monotonic), for those who tell of it later
        self._tasks: list[asyncio.Task[None]] = []

    def start(self) -> None:
        loop = asyncio.get_running_loop()
        self._tasks = [loop.create_task(self._read_loop()), loop.create_task(self._heartbeat_loop())]

    def silence(self) -> float:
        """Seconds since the other side last spoke on the link."""
        return time.monotonic() - max(self.last_seen, self._stream.last_bytes)

    def speaks(self) -> bool:
        """Whether the other side counts as alive: the link open, and heard within the window
        or in a stall it announced (as the heartbeat loop judges, which closes it otherwise)."""
        return not self.closed and (self.silence() <= self._settings.window_s
                                    or time.monotonic() < self._quiet_until)

    def send(self, msg: p.PeerMessage, payload: bytes | bytearray | memoryview = b"") -> None:
        """Queue one frame (never blocks; `drain` waits for the socket to take it)."""
        if not self.closed:
            self._stream.write(msg, payload)

    async def drain(self) -> None:
        if not self.closed:
            try:
                await self._stream.drain()
            except ConnectionError as exc:
                self.close(f"send failed: {exc}")

    async def _read_loop(self) -> None:
        reason = "closed by the peer"
        try:
            # (a handler may close the link: the frames already read behind it must not reach
            # it, and reads of buffered frames never suspend, where the cancel would land)
            while not self.closed:
                msg, payload = await self._stream.read()
                self.last_seen = time.monotonic()
                # (any other frame means the peer's loop runs again)
                quiet_s = msg.quiet_ms / 1000 if isinstance(msg, p.Heartbeat) else 0.0
                self._quiet_until = self.last_seen + quiet_s if quiet_s else 0.0
                if isinstance(msg, p.Goodbye):
                    said = clip_text(msg.reason, 200)
                    self.close(f"it left: {said}", f"daemon {self.name} left: {said}", expected=True)
                    return
                if not isinstance(msg, p.Heartbeat):
                    try:
                        self._handler(self, msg, payload)
                    except Exception as exc:  # a daemon bug: say so, and drop the link at once
                        log.exception("handling %s from daemon %s failed", type(msg).__name__, self.name)
                        me = self._settings.name
                        self._drop(f"internal error handling {type(msg).__name__}: {exc!r}",
                                   f"daemon {me} failed handling {type(msg).__name__} from daemon "
                                   f"{self.name} ({clip_text(repr(exc), 200)}), a bug in daemon {me}",
                                   ErrorCode.WORLD_FAILED)
                        return
        except ConnectionResetError:  # a peer that gives a link up drops what it had unread
            reason = "closed by the peer (reset)"
        except (ConnectionError, OSError) as exc:
            reason = str(exc) if str(exc) == "closed by the peer" else f"connection error: {exc}"
        except UnreadableFrame as exc:
            self._drop(f"bad frame: {exc}", f"daemon {self.name} sent {exc}")
            return
        except proto.ProtoError as exc:
            reason = f"bad frame: {exc}"
            log.warning("peer %s sent a bad frame: %s", self.name, exc)
        self.close(reason)

    def announce_quiet(self, seconds: float) -> None:
        """Our loop is about to stall for up to `seconds`: the peer is not to take that
        silence for a lost daemon (the other worlds on this link would fail with it)."""
        self._beats += 1
        self.send(p.Heartbeat(self._beats, min(p.MAX_QUIET_MS, round(seconds * 1000))))

    async def _heartbeat_loop(self) -> None:
        ticked = time.monotonic()
        excused = False
        while not self.closed:
            now = time.monotonic()
            # Woken late, this daemon's own loop stalled (a long call on it): the peer's frames
            # may wait unread (uvloop runs timers before reads), so the silence is judged at
            # the next tick, not this one (one tick only: a loop late every tick still judges).
            excused = now - ticked > 2 * self._settings.heartbeat_s and not excused
            ticked = now
            silent = self.silence()
            if silent > self._settings.window_s and not excused and now >= self._quiet_until:
                self.close(f"silent for {silent:.1f}s (window {self._settings.window_s:g}s)")
                return
            self._beats += 1
            self.send(p.Heartbeat(self._beats))
            await asyncio.sleep(self._settings.heartbeat_s)

    def _drop(self, reason: str, said: str, code: ErrorCode = ErrorCode.PEER_LOST) -> None:
        """Close the link for `reason`, the other daemon alive (it held the secret): its worlds
        are told `said`, and the builds, what to compare. "Lost" would send an operator looking
        for a dead daemon; so would `code` PEER_LOST (a rank's PeerLost) where this daemon's
        own bug dropped the link (then WORLD_FAILED: a WorldFailed all the same, which a rank
        reconnects after)."""
        self.close(reason, loss=(f"{said}; the link was dropped (peer protocol {p.PEER_VERSION}, "
                                 f"commd {__version__} here)"), loss_code=code)

    def close(self, reason: str, loss: str | None = None, *, drop_queued: bool = True,
              expected: bool = False, loss_code: ErrorCode = ErrorCode.PEER_LOST) -> None:
        """Close the link for `reason`; `loss`: what the worlds over it are told, when not that
        the daemon was lost for `reason` (one that is alive), and `loss_code`, their code.
        `drop_queued=False`: the connection stays for `farewell` to end. `expected`: one side
        said goodbye (it stops), nothing to warn of."""
        if self.closed:
            return
        self.closed = True
        self.closed_at = time.monotonic()
        self.loss = loss or f"daemon {self.name} was lost: {reason}"
        self.loss_code = loss_code
        current = asyncio.current_task()
        for task in self._tasks:
            if task is not current:
                task.cancel()
        if drop_queued:
            self._stream.abort()
        if expected:
            log.info("link to daemon %s closed: %s", self.name, reason)
        elif loss is None:
            log.warning("link to daemon %s lost: %s", self.name, reason)
        else:
            self._drops.warning(self.name, "%s", loss)
        self._on_lost(self, reason)

    async def farewell(self, reason: str, within: float) -> None:
        """Close for `reason` (this daemon stops), the frames queued for the other daemon sent
        first, as far as it takes them within `within` seconds: the world failures queued last,
        behind a collective's data, tell its ranks why (a dropped queue and a reset link left
        them only that the daemon "was lost")."""
        if not self.closed:
            self.send(p.Goodbye(reason))  # (last: the peer reads it after everything queued)
            self.close(reason, drop_queued=False, expected=True)
            await self._stream.finish(within)
