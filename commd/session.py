"""One client connection: its protocol state, its imported memory, its rank.

Each request type has one handler (a table, not an if chain). A handler that
raises CallError answers that request with the error and the session goes on;
a packet that does not parse gets a BAD_MESSAGE error and the connection is
closed (DESIGN §3); anything else is a daemon bug, answered INTERNAL and closed.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import logging
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import proto
from proto import ErrorCode
from proto.codec import OPS_CACHE_SIZE

from . import ops
from .channel import FdCloser, PacketChannel, close_fds
from .config import ServerConfig
from .engine.base import Engine, EventPair, MemoryMapping, Region
from .errors import CallError, clip
from .logs import Throttled
from .registry import Registry
from .world import World

log = logging.getLogger("commd.session")
_MAX_STREAMS = 64  # per connection: a worker has a handful of streams it calls on
_MAX_CHECKED_OPS = 4096  # per connection, in the groups whose checks it remembers (~300 B each)


class MemoryBudget:
    """What the whole daemon maps: a cap on mappings (the kernel's vm.max_map_count is
    ~65k) and on bytes of address space, so no client can exhaust them for the others."""

    def __init__(self, max_mappings: int, max_bytes: int) -> None:
        self.max_mappings, self.max_bytes = max_mappings, max_bytes
        self.mappings = self.bytes = 0

    def take(self, size: int) -> None:
        if self.mappings >= self.max_mappings or self.bytes + size > self.max_bytes:
            raise CallError(ErrorCode.LIMIT,
                            f"the daemon maps {self.mappings} buffers / {self.bytes} bytes; "
                            f"its limits are {self.max_mappings} / {self.max_bytes}")
        self.mappings += 1
        self.bytes += size

    def give(self, size: int) -> None:
        self.mappings -= 1
        self.bytes -= size


@dataclass(frozen=True, slots=True)
class DaemonContext:
    """What every session shares: built once by the server, no globals."""

    config: ServerConfig
    engine: Engine
    registry: Registry
    status: Callable[[str | None], dict[str, Any]]  # every world's, or one's
    budget: MemoryBudget
    bad_packets: Throttled  # their warnings: a client may send one a connection, without end
    closer: FdCloser  # of the fds clients send (their close may wait: never on the loop)


def _fitting_report(request_id: int, info: dict[str, Any]) -> proto.StatusReport:
    """The report, cut until the packet fits (see _cuts)."""
    total = len(info.get("worlds", []))
    for cut, worlds in _cuts(info):
        report = _report(request_id, cut, worlds, total)
        if report is not None:
            return report
    raise proto.InvalidMessage("the daemon's status does not fit a report even without its worlds")


def _cuts(info: dict[str, Any]) -> Iterator[tuple[dict[str, Any], list[Any]]]:
    """The report's info and worlds, cut more at each step: first each rank's recent calls
    (to the newest one, then none), then the names of the linked daemons (`links_total`
    keeps the count), then the world list (`worlds_total` keeps the count). So a world
    asked for by name is there, whatever its size: its state matters more than its history,
    or than which daemons are linked (a root linked to a few hundred daemons of long names,
    or a few thousand of short ones, fills a packet with their names alone)."""
    worlds = list(info.get("worlds", []))
    for calls in (None, 1, 0):  # of the flight recorder's, per rank (None: all it sent)
        shown = worlds if calls is None else [_newest_calls(w, calls) for w in worlds]
        yield info, shown
    peers: dict[str, Any] = info.get("peers") or {}
    links = every = list(peers.get("links", []))
    while links:
        links = links[:len(links) // 2]
        info = {**info, "peers": {**peers, "links": links, "links_total": len(every)}}
        yield info, shown
    while shown:
        shown = shown[:len(shown) // 2]
        yield info, shown


def _report(request_id: int, info: dict[str, Any], worlds: list[Any],
            total: int) -> proto.StatusReport | None:
    report = proto.StatusReport(request_id, {**info, "worlds": worlds, "worlds_total": total})
    try:
        proto.encode(report)
    except proto.ProtoError:
        return None
    return report


def _newest_calls(world: dict[str, Any], calls: int) -> dict[str, Any]:
    recent = world.get("recent_calls") or {}
    # (none: no rank either, each with its empty list, 6 bytes a rank, 36 KB of 6000 ranks)
    return {**world, "recent_calls": {rank: made[len(made) - calls:] for rank, made in recent.items()
                                      if calls}}


class Session:
    def __init__(self, ctx: DaemonContext, pid: int, make_channel: Callable[[Session], PacketChannel],
                 hello_refused: str | None = None) -> None:
        """`hello_refused`: why this connection may not join (it came past the connection
        limit), though it may ask for the status."""
        self._ctx = ctx
        self.peer_pid = pid
        self._hello_refused = hello_refused
        self._conn = proto.Connection(proto.Role.DAEMON)
        self._buffers: dict[int, MemoryMapping] = {}
        # what this connection really maps: self._buffers and the forgotten ones a call
        # still holds (see _drop_buffer)
        self._mappings = 0
        self._mapped = 0  # their bytes
        self._symmetric: set[int] = set()
        self._registrations: dict[int, int] = {}  # handle -> the buffer it is in
        self._next_handle = 1
        self.world: World | None = None
        self.rank = -1
        self._timeout_s = 60.0
        self._device: int | None = None  # the GPU its hello named
        self._events: dict[int, EventPair] = {}  # the worker's stream -> its ready/done events
        # id(ops) -> (those ops, kept alive; world size; their spans): see _checked_spans
        self._checked: dict[int, tuple[tuple[proto.Op, ...], int, tuple[tuple[ops.Span, ...], ...]]] = {}
        self._checked_ops = 0  # in self._checked
        self._handlers: dict[type, Callable[[Any, list[int]], None]] = {
            proto.Hello: self._hello,
            proto.StatusQuery: self._status,
            proto.Import: self._import,
            proto.Forget: self._forget,
            proto.Submit: self._submit,
            proto.StreamEvents: self._stream_events,
            proto.StreamSubmit: self._stream_submit,
            proto.Register: self._register,
            proto.Deregister: self._deregister,
            proto.SymAlloc: self._sym_alloc,
            proto.SymFree: self._sym_free,
            proto.SetAddKernel: self._set_add_kernel,
            proto.Reconnect: self._reconnect,
        }
        self.channel = make_channel(self)
        self._silent: asyncio.TimerHandle | None = None
        self._watch_silence("connecting")

    # ---- I/O ------------------------------------------------------------------

    def send(self, msg: proto.Reply, fds: Sequence[int] = ()) -> None:
        if self.channel.closed:
            return
        try:
            packet = self._conn.send(msg)
        except proto.ProtoError as exc:
            log.error("cannot send %s to pid %d: %s", type(msg).__name__, self.peer_pid, exc)
            self.channel.close(f"protocol error on send: {exc}")
            return
        self.channel.send(packet, fds)
        if self._conn.state is proto.State.CLOSED:
            self.channel.close("join refused", linger=True)

    def on_packet(self, data: bytes, fds: list[int], truncated: bool) -> None:
        if self._silent is not None:  # (a rank's calls come with none)
            self._stop_silence_watch()
        try:
            if truncated:
                raise proto.MessageTooLarge("packet (or its fds) was truncated: over the limit")
            msg = self._conn.receive(data, len(fds))
        except proto.ProtoError as exc:
            self._ctx.closer.close(fds)
            self._refuse(exc)
            return
        request_id = getattr(msg, "id", 0)
        try:
            self._handlers[type(msg)](msg, fds)
        except CallError as exc:
            if request_id:
                self.send(proto.Error(request_id, exc.code, exc.message))
        except Exception as exc:
            log.exception("bug while handling %s from pid %d", type(msg).__name__, self.peer_pid)
            self.send(proto.Error(request_id, ErrorCode.INTERNAL, clip(f"daemon bug: {exc!r}")))
            self.channel.close("internal error")
        if self._conn.state is proto.State.AWAIT_HELLO and not self.channel.closed:
            if self._hello_refused is not None:
                # one answer each past the limit: a client asking on would hold that room for good
                self.channel.close("answered past the connection limit", linger=True)
            else:
                # answered a status query and still no rank: one that stays idle would hold
                # one of max_connections for good, and workers be refused for it
                self._watch_silence("the answer to its last status query")

    def _watch_silence(self, since: str) -> None:
        self._silent = asyncio.get_running_loop().call_later(
            self._ctx.config.hello_timeout_s, self._said_nothing, since)

    def _stop_silence_watch(self) -> None:
        if self._silent is not None:
            self._silent.cancel()
            self._silent = None

    def _said_nothing(self, since: str) -> None:
        self._silent = None
        if not self.channel.closed:
            why = f"nothing said within {self._ctx.config.hello_timeout_s:g}s of {since}"
            self._drop(ErrorCode.TIMEOUT, why, why)

    def _refuse(self, exc: proto.ProtoError) -> None:
        self._ctx.bad_packets.warning("bad packet from pid %d: %s", self.peer_pid, exc)
        self._drop(ErrorCode.BAD_MESSAGE, clip(str(exc)), f"bad packet: {exc}")

    def _drop(self, code: ErrorCode, message: str, reason: str) -> None:
        """Close the connection with an error that answers no request (id 0); it bypasses
        the state machine, which may be in ERROR or not have seen a hello."""
        self.channel.send(proto.encode(proto.Error(0, code, message)))
        self.channel.close(reason, linger=True)

    def close_if_hung_up(self) -> bool:
        if not self.channel.closed and self.channel.hung_up():
            self.channel.close("peer closed the connection (its last packets unread)")
        return self.channel.closed

    def on_close(self, reason: str) -> None:
        self._stop_silence_watch()
        log.debug("connection of pid %d closed: %s", self.peer_pid, reason)
        if self.world is not None:
            self.world.leave(self.rank, self)
            self.world = None
        for buf in list(self._buffers):
            self._drop_buffer(buf)
        self._registrations.clear()
        events, self._events = self._events, {}
        for pair in events.values():
            pair.close()

    # ---- handlers ---------------------------------------------------------------

    def _hello(self, msg: proto.Hello, fds: list[int]) -> None:
        if self._hello_refused is not None:
            raise CallError(ErrorCode.LIMIT, self._hello_refused)
        if msg.version != proto.PROTOCOL_VERSION:
            raise CallError(ErrorCode.VERSION,
                            f"protocol version {msg.version} is not supported; "
                            f"this daemon speaks {proto.PROTOCOL_VERSION}")
        self._timeout_s = msg.timeout_ms / 1000
        if msg.device_uuid:  # the worker's ordinal is its own numbering: the daemon's is found by UUID
            ours = self._ctx.engine.device_of(msg.device_uuid)
            if ours is not None:
                msg = dataclasses.replace(msg, device=ours)
        elif msg.device is not None:
            self._ctx.engine.check_device(msg.device)
        self._device = msg.device
        try:
            world = self._ctx.registry.join(self, msg)
        except CallError:
            raise
        except Exception:  # a bug half-way through: this connection must be no rank of it
            half_joined = self._ctx.registry.worlds.get(msg.world)
            if half_joined is not None:
                half_joined.leave(msg.rank, self)
            raise
        self.world, self.rank = world, msg.rank
        if self.channel.closed:  # it went away while joining: on_close ran before we knew the world
            world.leave(msg.rank, self)
            self.world = None

    def _status(self, msg: proto.StatusQuery, fds: list[int]) -> None:
        info = self._ctx.status(msg.world)
        if msg.world is not None and not info["worlds"]:
            raise CallError(ErrorCode.UNKNOWN_WORLD, f"no world named {msg.world[:40]!r} on this daemon")
        self.send(_fitting_report(msg.id, info))

    def _import(self, msg: proto.Import, fds: list[int]) -> None:
        fd = fds[0] if fds else None

        def open_mapping() -> MemoryMapping:
            mapping = self._ctx.engine.import_memory(msg.kind, msg.size, msg.handle, fd, self._device)
            # (a hello without a device puts the rank on GPU 0, as the world and engine do)
            device = self._device or 0
            if mapping.device is not None and mapping.device != device:
                mapping.close()  # NCCL would run this rank's op on another GPU's memory
                raise CallError(ErrorCode.MISUSE, f"buffer {msg.buf} lives on GPU {mapping.device}; "
                                                  f"this rank's device is {device}")
            return mapping

        try:
            self._add_buffer(msg.buf, msg.size, open_mapping)
        finally:
            self._ctx.closer.close(fds)  # (mapped, it needs no fd)
        self.send(proto.Ok(msg.id))

    def _add_buffer(self, buf: int, size: int, open_mapping: Callable[[], MemoryMapping]) -> None:
        """Map a buffer within this connection's and the daemon's limits."""
        config = self._ctx.config
        if buf in self._buffers:
            raise CallError(ErrorCode.MISUSE, f"buffer id {buf} is already in use")
        if self._mappings >= config.max_buffers:
            forgotten = self._mappings - len(self._buffers)
            raise CallError(ErrorCode.LIMIT, f"a connection may hold at most {config.max_buffers} buffers "
                                             f"({forgotten} forgotten ones still held by calls "
                                             "waiting for their match)")
        if self._mapped + size > config.max_mapped_bytes:
            raise CallError(ErrorCode.LIMIT, f"a connection may map at most {config.max_mapped_bytes} bytes")
        self._ctx.budget.take(size)
        try:
            mapping = open_mapping()
        except BaseException:
            self._ctx.budget.give(size)
            raise
        self._buffers[buf] = mapping
        self._mappings += 1
        self._mapped += size

    def _drop_buffer(self, buf: int) -> None:
        for handle in [h for h, registered in self._registrations.items() if registered == buf]:
            self._drop_registration(handle)  # the engine must not keep freed memory registered
        mapping = self._buffers.pop(buf)
        # counted against the connection's limits until no op holds it: a call waiting for
        # its match keeps forgotten memory mapped, and it must not let a client map past
        # them. Not until it is unmapped: a worker's Forget comes right before the Import
        # that replaces it, before a large mapping's unmap (on a thread) is back. The
        # daemon's budget counts it until then.
        mapping.close(functools.partial(self._ctx.budget.give, mapping.size),
                      functools.partial(self._let_go, mapping.size))

    def _let_go(self, size: int) -> None:
        self._mappings -= 1
        self._mapped -= size

    def _forget(self, msg: proto.Forget, fds: list[int]) -> None:
        for buf in msg.bufs:
            if buf not in self._symmetric and buf in self._buffers:
                self._drop_buffer(buf)

    def _submit(self, msg: proto.Submit | proto.StreamSubmit, fds: list[int],
                events: EventPair | None = None) -> None:
        world = self._member_world()
        if msg.epoch and msg.epoch != world.epoch:
            # made before another thread of the rank reconnected: matched in the rebuilt
            # world, they would pair with other calls of the other ranks
            raise CallError(ErrorCode.STALE_EPOCH, f"these calls were made for epoch {msg.epoch} of "
                                                   f"world {world.name}, which is at epoch {world.epoch}")
        known = self._checked_spans(msg.ops, world.world_size)
        calls = []
        for index, op in enumerate(msg.ops):
            try:
                if known is None:
                    ops.check_ranks(op, self.rank, world.world_size)
                    regions = self._regions(ops.spans(op, world.world_size))
                    ops.check_overlap(op, self.rank, world.world_size)  # (of spans inside their buffers)
                else:
                    regions = self._regions(known[index])
            except CallError as exc:
                if len(msg.ops) == 1:
                    raise
                # (the whole group is refused: say which of its calls was at fault)
                raise CallError(exc.code, f"group_end: call #{index} of the group, "
                                          f"{ops.describe(op)}: {exc.message}") from None
            calls.append((op, regions))
        if known is None:
            ops.check_group_overlap(msg.ops, self.rank, world.world_size)
            if type(msg) is proto.Submit:  # (only its ops come again as the same object: the codec's cache)
                self._remember_checked(msg.ops, world.world_size)
        early = isinstance(msg, proto.StreamSubmit) and msg.early
        world.submit(self.rank, self, msg.id, calls, events, early)

    def _checked_spans(self, group: tuple[proto.Op, ...],
                       world_size: int) -> tuple[tuple[ops.Span, ...], ...] | None:
        """Each op's spans, for a group of calls that passed the checks of the calls alone
        (ranks, overlaps) before, in this world (its size, and this connection's rank, are
        what those depend on; the rank is set once); None for one that did not. A worker
        repeating a call sends the same bytes, which decode to the same ops object (the
        codec's cache). Their buffers are looked up at every call all the same: they may
        have been freed or moved since."""
        checked = self._checked.get(id(group))
        if checked is None or checked[0] is not group or checked[1] != world_size:
            return None
        return checked[2]

    def _remember_checked(self, group: tuple[proto.Op, ...], world_size: int) -> None:
        # (bounded in ops too: what it keeps alive the codec's cache may have let go of)
        if len(self._checked) >= OPS_CACHE_SIZE or self._checked_ops + len(group) > _MAX_CHECKED_OPS:
            self._checked.clear()
            self._checked_ops = 0
        self._checked[id(group)] = (group, world_size, tuple(ops.spans(op, world_size) for op in group))
        self._checked_ops += len(group)

    def _stream_events(self, msg: proto.StreamEvents, fds: list[int]) -> None:
        self._member_world()
        if msg.stream not in self._events and len(self._events) >= _MAX_STREAMS:
            raise CallError(ErrorCode.LIMIT, f"a connection may name at most {_MAX_STREAMS} streams")
        pair = self._ctx.engine.import_events(msg.ready, msg.done, self._device)
        old = self._events.pop(msg.stream, None)
        if old is not None:
            old.close()
        self._events[msg.stream] = pair
        self.send(proto.Ok(msg.id))

    def _stream_submit(self, msg: proto.StreamSubmit, fds: list[int]) -> None:
        events = self._events.get(msg.stream)
        if events is None:
            raise CallError(ErrorCode.MISUSE, f"stream {msg.stream} has no events: send stream_events first")
        self._submit(msg, fds, events)

    def _regions(self, spans: tuple[ops.Span, ...]) -> tuple[Region | None, ...]:
        return tuple([self._region(mem, n) for mem, n in spans])

    def _region(self, mem: proto.Mem | None, nbytes: int) -> Region | None:
        if nbytes == 0 or mem is None:
            return None
        mapping = self._buffers.get(mem.buf)
        if mapping is None:
            raise _unknown_buffer(mem.buf)
        return mapping.region(mem.offset, nbytes)

    def _register(self, msg: proto.Register, fds: list[int]) -> None:
        world = self._member_world()
        if len(self._registrations) >= self._ctx.config.max_registrations:
            raise CallError(ErrorCode.LIMIT, f"a connection may hold at most "
                                             f"{self._ctx.config.max_registrations} registrations")
        if msg.buf.buf not in self._buffers:  # (an empty span's too: the handle names that buffer)
            raise _unknown_buffer(msg.buf.buf)
        region = self._region(msg.buf, msg.nbytes)  # bounds-checked now
        handle = self._next_handle
        if region is not None:
            world.register(self.rank, self, handle, region)
        self._next_handle += 1
        self._registrations[handle] = msg.buf.buf
        self.send(proto.Ok(msg.id, value=handle))

    def _deregister(self, msg: proto.Deregister, fds: list[int]) -> None:
        if msg.handle not in self._registrations:
            raise CallError(ErrorCode.UNKNOWN_HANDLE, f"handle {msg.handle} is not registered")
        self._drop_registration(msg.handle)
        self.send(proto.Ok(msg.id))

    def _drop_registration(self, handle: int) -> None:
        del self._registrations[handle]
        if self.world is not None:
            self.world.deregister(self.rank, self, handle)

    def _sym_alloc(self, msg: proto.SymAlloc, fds: list[int]) -> None:
        self._member_world()
        exported: list[int] = []

        def allocate() -> MemoryMapping:
            mapping, fd = self._ctx.engine.allocate(msg.nbytes, self._device)
            exported.append(fd)
            return mapping

        try:
            self._add_buffer(msg.buf, msg.nbytes, allocate)
            self._symmetric.add(msg.buf)
            self.send(proto.Ok(msg.id, value=msg.nbytes, nfds=1), exported)
        finally:
            close_fds(exported)

    def _sym_free(self, msg: proto.SymFree, fds: list[int]) -> None:
        if msg.buf not in self._symmetric:
            raise CallError(ErrorCode.UNKNOWN_HANDLE, f"buffer {msg.buf} is not a symmetric allocation")
        self._symmetric.discard(msg.buf)
        self._drop_buffer(msg.buf)
        self.send(proto.Ok(msg.id))

    def _set_add_kernel(self, msg: proto.SetAddKernel, fds: list[int]) -> None:
        self._member_world().set_add_kernel(self.rank, self, msg.handle)
        self.send(proto.Ok(msg.id))

    def _reconnect(self, msg: proto.Reconnect, fds: list[int]) -> None:
        world = self._member_world()
        world.reconnect(self.rank, self, msg.id, self._timeout_s)
        if self.channel.closed:  # gone meanwhile (the failure's event found it closed): on_close
            world.leave(self.rank, self)  # ran before its vote, which must not hold the rank

    def _member_world(self) -> World:
        if self.world is None:
            raise CallError(ErrorCode.MISUSE, "this connection is not a rank of any world")
        return self.world


def _unknown_buffer(buf: int) -> CallError:
    return CallError(ErrorCode.UNKNOWN_BUFFER,
                     f"the memory it names (buffer {buf}) was freed, or was never handed to this daemon")
