"""What the parts of `DaemonBackend` share to talk to the daemon: one request and its
answer, and the connection it came on."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import NamedTuple, Protocol, TypeVar

import proto

from .errors import MisuseError, ProtocolError, from_code
from .transport import Undo

T = TypeVar("T")


class Answer(NamedTuple):
    msg: proto.Message
    fds: list[int]
    link: int  # the daemon connection it came on (Connection.link)
    epoch: int  # the rank's epoch when it was sent
    engine: str  # the engine of the daemon it came from

    def value(self) -> int:
        """The result an `ok` carries (a handle, an epoch); ProtocolError for another reply."""
        if not isinstance(self.msg, proto.Ok):
            raise ProtocolError(f"expected ok, the daemon answered {type(self.msg).__name__}")
        return self.msg.value


class Superseded(Exception):
    """A request about a daemon connection that a rejoin has replaced: that daemon is gone."""


class Requester(Protocol):
    """Connection.request: one request/reply, answered by `due` (+ `grace`; None: no
    deadline); `make` builds it from its id. `undo`: what undoes it if it times out and the
    daemon did it all the same. `link`: only to that daemon connection (Superseded if a
    rejoin replaced it)."""

    def __call__(self, make: Callable[[int], proto.Request], *, due: float | None,
                 fds: Sequence[int] = (), grace: float = 0.0, undo: Undo | None = None,
                 link: int | None = None) -> Answer: ...


def built(factory: Callable[[], T]) -> T:
    """A message built from the caller's arguments: one the protocol refuses is the
    caller's mistake (MisuseError)."""
    try:
        return factory()
    except proto.InvalidMessage as exc:
        raise MisuseError(str(exc)) from None


def checked(reply: proto.Message) -> proto.Message:
    """`reply`, unless it is the daemon's error: then that error, raised as a CommError."""
    if isinstance(reply, proto.Error):
        raise from_code(reply.code, reply.message)
    return reply
