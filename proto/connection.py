"""The per-connection state machine, driven by both the daemon and the client.

Like h11's `Connection`: it turns messages into packets and packets into
messages, and one table says which message is legal in which state. Any error
moves the connection to ERROR for good; the owner then closes the socket.

    AWAIT_HELLO --client sends Hello--> JOINING --daemon sends Welcome--> READY
         |                                 |
         +-- StatusQuery / StatusReport    +-- daemon sends Error --> CLOSED

The side that answers requests (the daemon) also holds the ids of those it has not
answered yet: a request that reuses one of them is illegal, as its answer could not be
told from the other's (WIRE.md §7).
"""

from __future__ import annotations

import enum
from typing import NoReturn

from . import messages as m
from .codec import OpsCache, PackedOps, decode, encode
from .errors import ProtoError, StateError
from .fields import MAX_MESSAGE_BYTES


class Role(enum.Enum):
    __hash__ = object.__hash__  # members are singletons; Enum hashes the name in Python

    CLIENT = "client"
    DAEMON = "daemon"


class State(enum.Enum):
    __hash__ = object.__hash__  # members are singletons; Enum hashes the name in Python

    AWAIT_HELLO = "await_hello"
    JOINING = "joining"
    READY = "ready"
    CLOSED = "closed"
    ERROR = "error"


_READY_REQUESTS: frozenset[type] = frozenset(
    {m.Import, m.Forget, m.Submit, m.StreamEvents, m.StreamSubmit, m.Register, m.Deregister,
     m.SymAlloc, m.SymFree, m.SetAddKernel, m.Reconnect, m.StatusQuery}
)
_LEGAL: dict[tuple[Role, State], frozenset[type]] = {
    (Role.CLIENT, State.AWAIT_HELLO): frozenset({m.Hello, m.StatusQuery}),
    (Role.CLIENT, State.READY): _READY_REQUESTS,
    (Role.DAEMON, State.AWAIT_HELLO): frozenset({m.Error, m.StatusReport, m.Event}),
    (Role.DAEMON, State.JOINING): frozenset({m.Welcome, m.Error, m.Event}),
    (Role.DAEMON, State.READY): frozenset({m.Ok, m.Error, m.Event, m.StatusReport}),
}
_TRANSITIONS: dict[tuple[State, type], State] = {
    (State.AWAIT_HELLO, m.Hello): State.JOINING,
    (State.JOINING, m.Welcome): State.READY,
    (State.JOINING, m.Error): State.CLOSED,
}


# What answers a request by its id (an Error with id 0 answers none)
_ANSWERS: frozenset[type] = frozenset({m.Welcome, m.Ok, m.Error, m.StatusReport})

_FINAL = frozenset({State.CLOSED, State.ERROR})
_NOTHING: frozenset[type] = frozenset()


class Connection:
    """One side's view of one connection. `our_role` says which side we are."""

    def __init__(self, our_role: Role, limit: int = MAX_MESSAGE_BYTES) -> None:
        self.our_role = our_role
        self.their_role = Role.DAEMON if our_role is Role.CLIENT else Role.CLIENT
        self.limit = limit
        self.state = State.AWAIT_HELLO
        self._ops_cache: OpsCache = {}
        self._packed_ops: PackedOps = {}
        # Ids of the requests received and not answered yet -> their kind. None on the
        # client's side, which receives no requests: there the check costs one test a message
        self._unanswered: dict[int, type] | None = {} if our_role is Role.DAEMON else None

    @property
    def state(self) -> State:
        return self._state

    @state.setter
    def state(self, state: State) -> None:
        # The legal sets are looked up once per state change, not once per message.
        self._state = state
        self._we_may_send = _LEGAL.get((self.our_role, state), _NOTHING)
        self._they_may_send = _LEGAL.get((self.their_role, state), _NOTHING)

    def send(self, msg: m.Message) -> bytes:
        """Check that we may send `msg` now, advance the state, return the packet."""
        self._advance(self.our_role, self._we_may_send, msg)
        try:
            packet = encode(msg, self.limit, self._packed_ops)
        except ProtoError:
            self.state = State.ERROR
            raise
        if self._unanswered is not None and type(msg) in _ANSWERS:
            self._unanswered.pop(msg.id, None)  # type: ignore[union-attr]
        return packet

    def receive(self, packet: bytes, nfds: int = 0) -> m.Message:
        """Parse a packet from the other side, check it is legal now, advance the state."""
        if self._state in _FINAL:
            raise StateError(f"connection is {self._state.value}")
        try:
            msg = decode(packet, nfds, self.limit, self._ops_cache)
        except ProtoError:
            self.state = State.ERROR
            raise
        self._advance(self.their_role, self._they_may_send, msg)
        unanswered = self._unanswered
        if unanswered is not None and type(msg) is not m.Forget:  # (a Forget has no id, nor answer)
            request_id: int = msg.id  # type: ignore[union-attr]
            if request_id in unanswered:
                self._refuse_taken(request_id, unanswered[request_id])
            unanswered[request_id] = type(msg)
        return msg

    def _refuse_taken(self, request_id: int, holder: type) -> NoReturn:
        self.state = State.ERROR
        raise StateError(f"request id {request_id} is taken: {holder.__name__} #{request_id} "
                         "is not answered yet (ids must be unique among unanswered requests)")

    def _advance(self, sender: Role, legal: frozenset[type], msg: m.Message) -> None:
        kind = type(msg)
        if kind not in legal:
            was = self._state
            if was in _FINAL:
                raise StateError(f"connection is {was.value}")
            self.state = State.ERROR
            raise StateError(f"{sender.value} may not send {kind.__name__} in state {was.value}")
        following = _TRANSITIONS.get((self._state, kind))
        if following is not None:
            self.state = following
