"""The one exception hierarchy a worker sees.

    CommError                     every failure of a CommBackend call (the seed's Result error)
    ├── MisuseError               the call was wrong: bad pointer, size, rank, handle, state
    ├── AccessDenied              the daemon refused this process (credentials, join token)
    ├── LimitExceeded             a limit: the daemon's (connections, buffers, registrations, pending
    │                             calls, a world's placement) or this process's (open files, memory)
    ├── ProtocolError             client and daemon disagree on the wire (version, malformed)
    ├── DaemonUnavailable         no daemon at the socket, or the connection to it broke
    │   └── DaemonShutdown        the daemon is stopping
    ├── CommTimeout               a deadline passed (join, call completion)
    ├── WorldFailed               the world failed (a rank lost, ...); call attempt_reconnect
    │   ├── MismatchError         ranks called different collectives as call k
    │   ├── PeerLost              another daemon of the world is unreachable or was lost
    │   └── EngineError           the engine (NCCL) failed the world's communicator
    └── DaemonInternalError       a bug in the daemon

Every error from the daemon keeps its wire code in `.code`: an ErrorCode, or the code's
string when this client does not know it (a newer daemon's; then the error is a CommError,
or what the daemon said happened: WorldFailed or DaemonShutdown for an event of that kind,
DaemonUnavailable for its last word before it closed the connection).
"""

from __future__ import annotations

from proto import ErrorCode, EventKind


class CommError(Exception):
    """Base of every error a CommBackend raises."""

    def __init__(self, message: str, code: ErrorCode | str | None = None) -> None:
        super().__init__(message)
        self.code = code


class MisuseError(CommError):
    """The call's arguments or the backend's state make the call invalid."""


class AccessDenied(CommError):
    """The daemon refused this process or this world's join token."""


class LimitExceeded(CommError):
    """A limit was reached: the daemon's, or this process's own (a reply's fd it had no room
    for, memory it could not map)."""


class ProtocolError(CommError):
    """The daemon and the client do not understand each other."""


class DaemonUnavailable(CommError):
    """The daemon cannot be reached, or the connection to it was lost."""


class DaemonShutdown(DaemonUnavailable):
    """The daemon is shutting down."""


class CommTimeout(CommError):
    """A call or a join did not complete before its deadline."""


class WorldFailed(CommError):
    """The world is failed until every rank calls attempt_reconnect."""


class MismatchError(WorldFailed):
    """Ranks disagreed on a call (op, bytes, dtype, root or peer)."""


class PeerLost(WorldFailed):
    """A daemon hosting other ranks of the world cannot be reached."""


class EngineError(WorldFailed):
    """The engine failed the world's communicator on its own (NCCL's async error)."""


class DaemonInternalError(CommError):
    """The daemon hit a bug handling this request."""


_BY_CODE: dict[ErrorCode, type[CommError]] = {
    ErrorCode.BAD_MESSAGE: ProtocolError,
    ErrorCode.VERSION: ProtocolError,
    ErrorCode.PERMISSION: AccessDenied,
    ErrorCode.BAD_RANK: MisuseError,
    ErrorCode.DUPLICATE_RANK: MisuseError,
    ErrorCode.WORLD_CONFLICT: MisuseError,
    ErrorCode.UNKNOWN_WORLD: MisuseError,
    ErrorCode.BAD_MEMORY: MisuseError,
    ErrorCode.UNKNOWN_BUFFER: MisuseError,
    ErrorCode.UNKNOWN_HANDLE: MisuseError,
    ErrorCode.MISUSE: MisuseError,
    ErrorCode.MISMATCH: MismatchError,
    ErrorCode.WORLD_FAILED: WorldFailed,
    ErrorCode.STALE_EPOCH: WorldFailed,
    ErrorCode.TIMEOUT: CommTimeout,
    ErrorCode.LIMIT: LimitExceeded,
    ErrorCode.SHUTDOWN: DaemonShutdown,
    ErrorCode.INTERNAL: DaemonInternalError,
    ErrorCode.PEER_LOST: PeerLost,
    ErrorCode.ENGINE: EngineError,
}


# What an event says happened, whatever its code: the class of one whose code this client
# does not know, and the words that say so
_BY_KIND: dict[EventKind, tuple[type[CommError], str]] = {
    EventKind.WORLD_FAILED: (WorldFailed, "the world failed"),
    EventKind.SHUTDOWN: (DaemonShutdown, "the daemon is shutting down"),
}


def _unknown(error: type[CommError], what: str, code: str, message: str) -> CommError:
    return error(f"{what} with error code {code!r}, which this client does not know: {message}", code)


def from_code(code: ErrorCode | str, message: str) -> CommError:
    """The exception for an error the daemon sent."""
    if isinstance(code, str):  # none of this client's classes can claim to know what it means
        return _unknown(CommError, "the daemon refused the request", code, message)
    return _BY_CODE[code](message, code)


def from_closing(code: ErrorCode | str, message: str) -> CommError:
    """The exception for the daemon's last word before it closes the connection (an Error
    with id 0, which answers no request): it says the connection went. A code this client
    does not know is that connection lost (DaemonUnavailable); a known one keeps its class."""
    if isinstance(code, str):
        return _unknown(DaemonUnavailable, "the daemon closed the connection", code, message)
    return _BY_CODE[code](f"{message} (the daemon closed the connection)", code)


def from_event(kind: EventKind, code: ErrorCode | str, message: str) -> CommError:
    """What an event the daemon pushed tells: a code this client does not know (a newer
    daemon's) takes the class its kind implies (the world failed all the same)."""
    if isinstance(code, str):
        error, what = _BY_KIND[kind]
        return _unknown(error, what, code, message)
    return _BY_CODE[code](message, code)


def detached(error: CommError) -> CommError:
    """`error` without the frames it went through (a copy: no traceback, cause or context),
    to keep on record: a raised one would keep the caller's locals alive (buffers, tensors),
    and every raise of it would add more."""
    return type(error)(str(error), error.code)


# Errors after which the backend is not healthy until attempt_reconnect succeeds.
UNHEALTHY = (WorldFailed, CommTimeout, DaemonUnavailable, ProtocolError, DaemonInternalError)
