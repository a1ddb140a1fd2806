"""Every message of the protocol: frozen, slotted dataclasses that validate themselves.

A message that exists is a valid message: constructors raise `InvalidMessage`,
so the decoder and the sender share one set of rules (fields.py). Ops (ops.py: what
a rank asks the world to do) travel inside a `Submit`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from .errors import ErrorCode, InvalidMessage
from .fields import (
    MAX_HELLO_EPOCH,
    MAX_RANKS,
    MAX_WORLD_NAME,
    check_positive,
    check_rank,
    check_short_text,
    check_u64,
    clip_text,
    error_code,
    member_or_name,
)
from .ops import OP_TYPES, Mem, Op
from .types import EventKind, MemKind

PROTOCOL_VERSION = 2
MAX_GROUP_OPS = 512
DEVICE_UUID_BYTES = 16  # sizeof(CUuuid)
# A daemon answers a join (a hello, a reconnect) by the timeout it carries; the daemon of a
# rank in a world across nodes waits this much longer for the world's root to say which
# ranks never came (a client waiting for the answer must wait longer still).
JOIN_BACKSTOP_S = 2.0
_WORLD_NAME = re.compile(r"[A-Za-z0-9._:@/-]+")


# ---- client → daemon --------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Hello:
    id: int
    version: int
    pid: int
    world: str
    rank: int
    world_size: int
    timeout_ms: int
    device: int | None = None
    bootstrap: str | None = None
    token: str | None = None
    epoch: int = 0  # the last epoch this rank saw (after a daemon restart): the world goes on past it
    # The GPU's UUID (cuDeviceGetUuid), when the worker knows it: `device` is the worker's
    # ordinal, which CUDA_VISIBLE_DEVICES (or a container's share of GPUs) renumbers, so
    # the daemon finds its own ordinal for the GPU by this.
    device_uuid: bytes = b""

    def __post_init__(self) -> None:
        check_positive("id", self.id)
        check_u64("version", self.version)
        check_u64("epoch", self.epoch)
        if self.epoch >= MAX_HELLO_EPOCH:
            raise InvalidMessage(f"epoch={self.epoch} is past any world's (at most {MAX_HELLO_EPOCH - 1})")
        check_u64("pid", self.pid)
        if not 0 < len(self.world) <= MAX_WORLD_NAME or not _WORLD_NAME.fullmatch(self.world):
            raise InvalidMessage(
                f"world name {self.world[:40]!r} must be 1..{MAX_WORLD_NAME} of [A-Za-z0-9._:@/-]"
            )
        if not 0 < self.world_size <= MAX_RANKS:
            raise InvalidMessage(f"world_size={self.world_size} must be 1..{MAX_RANKS}")
        if not 0 <= self.rank < self.world_size:
            raise InvalidMessage(f"rank={self.rank} is not in 0..{self.world_size - 1}")
        check_positive("timeout_ms", self.timeout_ms)
        if self.device is not None:
            check_rank("device", self.device, "a GPU ordinal")
        for name in ("bootstrap", "token"):
            value = getattr(self, name)
            if value is not None:
                check_short_text(name, value)
        if len(self.device_uuid) not in (0, DEVICE_UUID_BYTES):
            raise InvalidMessage(
                f"device_uuid is {DEVICE_UUID_BYTES} bytes or none, not {len(self.device_uuid)}")
        if self.device_uuid and self.device is None:
            raise InvalidMessage("device_uuid names the GPU of a `device`: give both")


@dataclass(frozen=True, slots=True)
class Import:
    """Hand the daemon one allocation; a host or VMM buffer's fd rides beside the packet."""

    id: int
    buf: int
    kind: MemKind
    size: int
    handle: bytes = b""

    def __post_init__(self) -> None:
        check_positive("id", self.id)
        check_positive("buf", self.buf)
        check_positive("size", self.size)
        if len(self.handle) > 256:
            raise InvalidMessage("a memory handle is at most 256 bytes")


@dataclass(frozen=True, slots=True)
class Forget:
    """Buffers the worker freed; no reply (ids the daemon does not know are ignored)."""

    bufs: tuple[int, ...]

    def __post_init__(self) -> None:
        if not 0 < len(self.bufs) <= MAX_GROUP_OPS:
            raise InvalidMessage(f"forget lists 1..{MAX_GROUP_OPS} buffers")
        for buf in self.bufs:
            check_positive("buf", buf)


@dataclass(frozen=True, slots=True)
class Submit:
    """One call, or a group of calls submitted together; one reply when all are done.
    `epoch`: the world's epoch the calls were made for (0: whichever is current); the
    daemon refuses them once a reconnect has moved the world past it."""

    id: int
    ops: tuple[Op, ...]
    epoch: int = 0

    def __post_init__(self) -> None:
        _check_submit(self.id, self.ops, self.epoch)


def _check_submit(request_id: int, ops: tuple[Op, ...], epoch: int) -> None:
    check_positive("id", request_id)
    check_u64("epoch", epoch)
    if not 0 < len(ops) <= MAX_GROUP_OPS:
        raise InvalidMessage(f"a submit carries 1..{MAX_GROUP_OPS} ops")
    for op in ops:
        if not isinstance(op, OP_TYPES):
            raise InvalidMessage(f"{type(op).__name__} is not an op")


IPC_EVENT_BYTES = 64  # a cudaIpcEventHandle_t
IPC_MEM_HANDLE_BYTES = 64  # a cudaIpcMemHandle_t (an Import's handle for cuda-ipc memory)


@dataclass(frozen=True, slots=True)
class StreamEvents:
    """A worker's two interprocess CUDA events for its calls that follow `stream` (DESIGN
    §5): it records `ready` on the stream before each such call, the daemon's stream waits
    for it before the op and records `done` after it, for the worker's stream to wait on."""

    id: int
    stream: int  # the worker's stream handle: only a name for the pair here
    ready: bytes
    done: bytes

    def __post_init__(self) -> None:
        check_positive("id", self.id)
        check_u64("stream", self.stream)
        for name in ("ready", "done"):
            if len(getattr(self, name)) != IPC_EVENT_BYTES:
                raise InvalidMessage(f"{name} must be a {IPC_EVENT_BYTES}-byte CUDA IPC event handle")


@dataclass(frozen=True, slots=True)
class StreamSubmit:
    """A Submit ordered on the worker's `stream` through its StreamEvents. `early`: reply
    once the ops are ordered on the device (all_reduce_async, send_to, recv_from), not
    once they are done; a later failure then fails the world."""

    id: int
    ops: tuple[Op, ...]
    stream: int
    early: bool = False
    epoch: int = 0  # as Submit's

    def __post_init__(self) -> None:
        _check_submit(self.id, self.ops, self.epoch)
        check_u64("stream", self.stream)


@dataclass(frozen=True, slots=True)
class Register:
    id: int
    buf: Mem
    nbytes: int

    def __post_init__(self) -> None:
        check_positive("id", self.id)
        check_u64("nbytes", self.nbytes)


@dataclass(frozen=True, slots=True)
class Deregister:
    id: int
    handle: int

    def __post_init__(self) -> None:
        check_positive("id", self.id)
        check_u64("handle", self.handle)


@dataclass(frozen=True, slots=True)
class SymAlloc:
    """The daemon allocates `nbytes`, imports it as buffer `buf` and replies with its fd."""

    id: int
    buf: int
    nbytes: int

    def __post_init__(self) -> None:
        check_positive("id", self.id)
        check_positive("buf", self.buf)
        check_positive("nbytes", self.nbytes)


@dataclass(frozen=True, slots=True)
class SymFree:
    id: int
    buf: int

    def __post_init__(self) -> None:
        check_positive("id", self.id)
        check_positive("buf", self.buf)


@dataclass(frozen=True, slots=True)
class SetAddKernel:
    id: int
    handle: int

    def __post_init__(self) -> None:
        check_positive("id", self.id)
        check_u64("handle", self.handle)


@dataclass(frozen=True, slots=True)
class Reconnect:
    id: int

    def __post_init__(self) -> None:
        check_positive("id", self.id)


@dataclass(frozen=True, slots=True)
class StatusQuery:
    """Ask the daemon for its state, or one world's; legal before `hello` (operators'
    tools never join)."""

    id: int
    world: str | None = None

    def __post_init__(self) -> None:
        check_positive("id", self.id)
        if self.world is not None:
            check_short_text("world", self.world, MAX_WORLD_NAME)


# ---- daemon → client --------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Welcome:
    id: int
    version: int
    daemon_version: str
    engine: str
    epoch: int
    max_message: int

    def __post_init__(self) -> None:
        check_positive("id", self.id)
        check_u64("version", self.version)
        check_u64("epoch", self.epoch)
        check_positive("max_message", self.max_message)


@dataclass(frozen=True, slots=True)
class Ok:
    """Success. `value` is the call's result (handle, epoch, size); `nfds` fds ride beside."""

    id: int
    value: int = 0
    nfds: int = 0

    def __post_init__(self) -> None:
        check_positive("id", self.id)
        check_u64("value", self.value)
        if not 0 <= self.nfds <= 1:
            raise InvalidMessage("a reply carries at most one fd")


@dataclass(frozen=True, slots=True)
class Error:
    """A refused request; `id` 0 when the packet that caused it could not be read.

    A code that names no ErrorCode (a newer peer's) stays its string, and a message over
    MAX_ERROR_TEXT characters is clipped: refused as a bad packet, either would cost the
    connection, where the peer refused one request (WIRE.md §7)."""

    id: int
    code: ErrorCode | str
    message: str

    def __post_init__(self) -> None:
        check_u64("id", self.id)
        object.__setattr__(self, "code", error_code(self.code))
        object.__setattr__(self, "message", clip_text(self.message))


@dataclass(frozen=True, slots=True)
class Event:
    """A notice the daemon pushes. Its kind and its code, like an Error's code, may be a
    string that names no member (a newer daemon's), and a longer message is clipped:
    refused as a bad packet, any of them would cost the connection, and with it the world
    (WIRE.md §7)."""

    kind: EventKind | str
    code: ErrorCode | str
    message: str
    epoch: int = 0

    def __post_init__(self) -> None:
        object.__setattr__(self, "kind", member_or_name(self.kind, EventKind, "an event kind"))
        object.__setattr__(self, "code", error_code(self.code))
        object.__setattr__(self, "message", clip_text(self.message))
        check_u64("epoch", self.epoch)


@dataclass(frozen=True, slots=True)
class StatusReport:
    id: int
    info: dict[str, Any]

    def __post_init__(self) -> None:
        check_positive("id", self.id)


Request = (
    Hello | Import | Forget | Submit | StreamEvents | StreamSubmit | Register | Deregister | SymAlloc
    | SymFree | SetAddKernel | Reconnect | StatusQuery
)
Reply = Welcome | Ok | Error | Event | StatusReport
Message = Request | Reply
