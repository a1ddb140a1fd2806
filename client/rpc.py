"""What the parts of `DaemonBackend` share to talk to the daemon: one request and its
answer, and the connection it came on."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import NamedTuple, Protocol

import proto

from .errors import ProtocolError
from .transport import Undo


class Answer(NamedTuple):
    msg: proto.Message
    fds: list[int]
    link: int  # the daemon connection it came on (DaemonBackend._link)
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
    """DaemonBackend._request: one request/reply, answered by `due` (+ `grace`; None: no
    deadline); `make` builds it from its id. `undo`: what undoes it if it times out and the
    daemon did it all the same. `link`: only to that daemon connection (Superseded if a
    rejoin replaced it)."""

    def __call__(self, make: Callable[[int], proto.Request], *, due: float | None,
                 fds: Sequence[int] = (), grace: float = 0.0, undo: Undo | None = None,
                 link: int | None = None) -> Answer: ...
