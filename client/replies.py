"""Which replies the daemon owes this connection: every reply is checked against the
request it names before anything takes it (see RepliesDue.unasked)."""

from __future__ import annotations

import proto

# How the daemon answers each kind of request (an Error aside): Ok unless named here; and
# the requests whose answer may carry an fd
_ANSWERS: dict[type, type] = {proto.Hello: proto.Welcome, proto.StatusQuery: proto.StatusReport}
_FDS_BACK = frozenset({proto.SymAlloc})


class RepliesDue:
    """Every request sent whose answer has not come, by id: its kind. (Added to as it is
    sent, under the transport's send lock; taken from by the one reader: no lock.)"""

    __slots__ = ("_kinds",)

    def __init__(self) -> None:
        self._kinds: dict[int, type] = {}

    def sent(self, msg: proto.Message) -> None:
        """`msg` goes out: if it is a request (it carries an id), its answer is due."""
        request_id = getattr(msg, "id", None)
        if request_id is not None:
            self._kinds[request_id] = type(msg)

    def unasked(self, msg: proto.Message, nfds: int) -> str | None:
        """(As the reader) Why `msg` answers no request of ours (None: it does, and that
        request is due no more). Taken as another's, or as late, it would be dropped, and
        the call it was meant for would wait out its timeout; taken as an answer of the
        wrong kind, it would pass for the call's success; its fds would stay open."""
        reply_id = getattr(msg, "id", 0)
        if not reply_id:  # an event, or the daemon's last word on the connection
            return None
        request = self._kinds.pop(reply_id, None)
        if request is None:
            return f"the daemon answered request {reply_id}, which was never made or was answered already"
        if isinstance(msg, proto.Error):
            return None
        if not isinstance(msg, _ANSWERS.get(request, proto.Ok)):
            return f"the daemon answered {request.__name__} {reply_id} with {type(msg).__name__}"
        if nfds and request not in _FDS_BACK:
            return f"the daemon's reply to {request.__name__} carried {nfds} fd(s), where none belongs"
        return None
