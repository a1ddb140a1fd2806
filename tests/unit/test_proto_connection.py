"""The connection state machine: one table of legal messages, ERROR for good on any misstep."""

from __future__ import annotations

from typing import Any

import pytest

import proto
import proto.ops
import proto.peer
from proto import (
    AllReduce,
    Barrier,
    Connection,
    DecodeError,
    Deregister,
    Error,
    ErrorCode,
    Event,
    EventKind,
    Forget,
    Hello,
    Import,
    InvalidMessage,
    Mem,
    MemKind,
    MessageTooLarge,
    Ok,
    Reconnect,
    Register,
    Role,
    SetAddKernel,
    State,
    StateError,
    StatusQuery,
    StatusReport,
    StreamEvents,
    StreamSubmit,
    Submit,
    SymAlloc,
    SymFree,
    Welcome,
    encode,
    expected_fds,
)

pytestmark = pytest.mark.timeout(60)

HELLO = Hello(1, proto.PROTOCOL_VERSION, 4242, "job", 0, 2, 60_000)
WELCOME = Welcome(1, proto.PROTOCOL_VERSION, "0.1.0", "host", 1, proto.MAX_MESSAGE_BYTES)
REFUSAL = Error(1, ErrorCode.VERSION, "protocol version 2 is not supported")

# One example of every message; the keys are the classes the table below names.
EXAMPLE: dict[type, Any] = {
    Hello: HELLO,
    Import: Import(2, 1, MemKind.HOST, 4096),
    Forget: Forget((1,)),
    Submit: Submit(3, (AllReduce(Mem(1, 0), 4096),)),
    StreamEvents: StreamEvents(11, 5, bytes(64), bytes(64)),
    StreamSubmit: StreamSubmit(12, (Barrier(),), 5, early=True),
    Register: Register(4, Mem(1, 0), 64),
    Deregister: Deregister(5, 1),
    SymAlloc: SymAlloc(6, 2, 4096),
    SymFree: SymFree(7, 2),
    SetAddKernel: SetAddKernel(8, 9),
    Reconnect: Reconnect(9),
    StatusQuery: StatusQuery(10),
    Welcome: WELCOME,
    Ok: Ok(6, value=4096, nfds=1),
    Error: Error(3, ErrorCode.MISUSE, "no"),
    Event: Event(EventKind.WORLD_FAILED, ErrorCode.WORLD_FAILED, "rank 1 died", 1),
    StatusReport: StatusReport(10, {"connections": 1}),
}

READY_REQUESTS = {Import, Forget, Submit, StreamEvents, StreamSubmit, Register, Deregister, SymAlloc,
                  SymFree, SetAddKernel, Reconnect, StatusQuery}
# The table of WIRE.md §5, written out independently of proto/connection.py.
LEGAL: dict[tuple[Role, State], set[type]] = {
    (Role.CLIENT, State.AWAIT_HELLO): {Hello, StatusQuery},
    (Role.CLIENT, State.JOINING): set(),
    (Role.CLIENT, State.READY): READY_REQUESTS,
    (Role.DAEMON, State.AWAIT_HELLO): {Error, StatusReport, Event},
    (Role.DAEMON, State.JOINING): {Welcome, Error, Event},
    (Role.DAEMON, State.READY): {Ok, Error, Event, StatusReport},
}
NEXT: dict[tuple[State, type], State] = {
    (State.AWAIT_HELLO, Hello): State.JOINING,
    (State.JOINING, Welcome): State.READY,
    (State.JOINING, Error): State.CLOSED,
}
OPEN_STATES = (State.AWAIT_HELLO, State.JOINING, State.READY)


# Legal traffic that leads from AWAIT_HELLO to each state.
PATH: dict[State, list[tuple[Role, Any]]] = {
    State.JOINING: [(Role.CLIENT, HELLO)],
    State.READY: [(Role.CLIENT, HELLO), (Role.DAEMON, WELCOME)],
    State.CLOSED: [(Role.CLIENT, HELLO), (Role.DAEMON, REFUSAL)],
}


def state_of(conn: Connection) -> State:
    """The state, read through a call so that mypy does not keep an earlier narrowing."""
    return conn.state


def other(role: Role) -> Role:
    return Role.DAEMON if role is Role.CLIENT else Role.CLIENT


def connection_in(role: Role, state: State) -> Connection:
    """A connection of `role` driven to `state` through legal traffic only."""
    conn = Connection(role)
    for sender, msg in PATH.get(state, []):
        if sender is role:
            conn.send(msg)
        else:
            conn.receive(encode(msg), expected_fds(msg))
    if state is State.ERROR:
        with pytest.raises(StateError):
            conn.send(WELCOME if role is Role.CLIENT else HELLO)  # never ours to send
    assert conn.state is state
    return conn


def assert_stuck(conn: Connection, state: State) -> None:
    """Nothing more goes through, in either direction, and the state does not move."""
    for msg in (HELLO, WELCOME, StatusQuery(1), Ok(1), EXAMPLE[Event]):
        with pytest.raises(StateError):
            conn.send(msg)
        assert conn.state is state
        with pytest.raises(StateError):
            conn.receive(encode(msg), expected_fds(msg))
        assert conn.state is state
    with pytest.raises(StateError):
        conn.receive(b"garbage")  # refused before it is even decoded
    assert conn.state is state


def test_table_covers_every_message() -> None:
    unix_messages = {cls for cls in proto.codec.TAGS
                     if cls not in proto.ops.OP_TYPES and cls not in proto.peer.PEER_MESSAGES}
    assert set(EXAMPLE) == unix_messages
    assert READY_REQUESTS | {Hello} == {cls for cls in EXAMPLE if cls not in
                                        {Welcome, Ok, Error, Event, StatusReport}}


def test_roles() -> None:
    client, daemon = Connection(Role.CLIENT), Connection(Role.DAEMON)
    assert (client.our_role, client.their_role) == (Role.CLIENT, Role.DAEMON)
    assert (daemon.our_role, daemon.their_role) == (Role.DAEMON, Role.CLIENT)
    assert client.state is daemon.state is State.AWAIT_HELLO
    assert client.limit == daemon.limit == proto.MAX_MESSAGE_BYTES


# ---- legal sequences ------------------------------------------------------------------

def exchange(sender: Connection, receiver: Connection, msg: Any) -> Any:
    packet = sender.send(msg)
    assert packet == encode(msg)
    got = receiver.receive(packet, expected_fds(msg))
    assert got == msg
    assert sender.state is receiver.state
    return got


def test_hello_welcome_submit_ok() -> None:
    client, daemon = Connection(Role.CLIENT), Connection(Role.DAEMON)
    exchange(client, daemon, HELLO)
    assert client.state is State.JOINING
    exchange(daemon, client, WELCOME)
    assert state_of(client) is State.READY
    submit = Submit(2, (AllReduce(Mem(1, 0), 8), Barrier()))
    exchange(client, daemon, submit)
    exchange(daemon, client, Ok(2))
    assert client.state is daemon.state is State.READY


def test_every_ready_request_and_reply() -> None:
    client, daemon = connection_in(Role.CLIENT, State.READY), connection_in(Role.DAEMON, State.READY)
    for cls in sorted(READY_REQUESTS, key=lambda c: c.__name__):
        exchange(client, daemon, EXAMPLE[cls])
    for cls in (Ok, Error, Event, StatusReport):
        exchange(daemon, client, EXAMPLE[cls])
    assert client.state is daemon.state is State.READY


def test_import_and_sym_alloc_with_fds() -> None:
    client, daemon = connection_in(Role.CLIENT, State.READY), connection_in(Role.DAEMON, State.READY)
    assert daemon.receive(client.send(EXAMPLE[Import]), 1) == EXAMPLE[Import]
    assert client.receive(daemon.send(Ok(6, value=4096, nfds=1)), 1) == Ok(6, value=4096, nfds=1)
    assert client.state is daemon.state is State.READY


def test_a_request_id_unanswered_is_not_taken_again() -> None:
    """Two unanswered requests of one id would get answers the client could not tell
    apart: the daemon's side refuses the second (StateError, naming the id and the request
    holding it); an answered id (Ok or Error) is free again, and a Forget holds none."""
    client, daemon = connection_in(Role.CLIENT, State.READY), connection_in(Role.DAEMON, State.READY)
    submit = Submit(5, (Barrier(),))
    exchange(client, daemon, submit)
    exchange(client, daemon, Forget((1,)))
    exchange(client, daemon, Register(6, Mem(1, 0), 64))
    exchange(daemon, client, Error(6, ErrorCode.UNKNOWN_BUFFER, "no"))
    exchange(client, daemon, Deregister(6, 1))  # (answered: its id is free)
    exchange(daemon, client, Ok(6))
    with pytest.raises(StateError, match=r"request id 5 is taken: Submit #5 is not answered yet"):
        daemon.receive(encode(StatusQuery(5)))
    assert daemon.state is State.ERROR

    answered = connection_in(Role.DAEMON, State.READY)
    answered.receive(encode(submit))
    answered.send(Ok(5))
    assert answered.receive(encode(StatusQuery(5))) == StatusQuery(5)
    assert answered.state is State.READY


def test_status_query_before_hello() -> None:
    client, daemon = Connection(Role.CLIENT), Connection(Role.DAEMON)
    exchange(client, daemon, StatusQuery(1))
    exchange(daemon, client, StatusReport(1, {"worlds": {}}))
    assert client.state is daemon.state is State.AWAIT_HELLO
    exchange(client, daemon, HELLO)  # an operator's tool may still join afterwards
    assert state_of(client) is State.JOINING


def test_error_before_hello_keeps_waiting() -> None:
    client, daemon = Connection(Role.CLIENT), Connection(Role.DAEMON)
    exchange(daemon, client, Error(0, ErrorCode.BAD_MESSAGE, "bad"))
    assert client.state is State.AWAIT_HELLO


def test_error_reply_to_hello_closes() -> None:
    client, daemon = Connection(Role.CLIENT), Connection(Role.DAEMON)
    exchange(client, daemon, HELLO)
    exchange(daemon, client, REFUSAL)
    assert client.state is daemon.state is State.CLOSED
    assert_stuck(client, State.CLOSED)
    assert_stuck(daemon, State.CLOSED)


def test_events_while_joining() -> None:
    client, daemon = connection_in(Role.CLIENT, State.JOINING), connection_in(Role.DAEMON, State.JOINING)
    exchange(daemon, client, EXAMPLE[Event])
    exchange(daemon, client, Event(EventKind.SHUTDOWN, ErrorCode.SHUTDOWN, "bye"))
    assert client.state is State.JOINING
    exchange(daemon, client, WELCOME)
    assert state_of(client) is State.READY


def test_forget_has_no_reply_and_moves_nothing() -> None:
    client, daemon = connection_in(Role.CLIENT, State.READY), connection_in(Role.DAEMON, State.READY)
    exchange(client, daemon, Forget((1, 2, 3)))
    exchange(client, daemon, StatusQuery(11))
    exchange(daemon, client, StatusReport(11, {}))
    assert client.state is State.READY


# ---- the whole table: every message in every open state, both directions ------------

CASES = [(role, state, cls) for role in Role for state in OPEN_STATES for cls in EXAMPLE]


def _id(case: Any) -> str:
    if isinstance(case, (Role, State)):
        return str(case.value)
    return case.__name__ if isinstance(case, type) else type(case).__name__


@pytest.mark.parametrize(("sender", "state", "cls"), CASES, ids=_id)
def test_table_on_send(sender: Role, state: State, cls: type) -> None:
    conn = connection_in(sender, state)
    msg = EXAMPLE[cls]
    if cls in LEGAL[(sender, state)]:
        assert conn.send(msg) == encode(msg)
        assert conn.state is NEXT.get((state, cls), state)
    else:
        with pytest.raises(StateError) as info:
            conn.send(msg)
        assert type(info.value) is StateError
        assert f"{sender.value} may not send {cls.__name__} in state {state.value}" in str(info.value)
        assert conn.state is State.ERROR
        assert_stuck(conn, State.ERROR)


@pytest.mark.parametrize(("sender", "state", "cls"), CASES, ids=_id)
def test_table_on_receive(sender: Role, state: State, cls: type) -> None:
    conn = connection_in(other(sender), state)
    msg = EXAMPLE[cls]
    packet = encode(msg)
    if cls in LEGAL[(sender, state)]:
        assert conn.receive(packet, expected_fds(msg)) == msg
        assert conn.state is NEXT.get((state, cls), state)
    else:
        with pytest.raises(StateError) as info:
            conn.receive(packet, expected_fds(msg))
        assert type(info.value) is StateError
        assert conn.state is State.ERROR
        assert_stuck(conn, State.ERROR)


def test_client_never_sends_replies_daemon_never_sends_requests() -> None:
    replies = {Welcome, Ok, Error, Event, StatusReport}
    for state in OPEN_STATES:
        assert not LEGAL[(Role.CLIENT, state)] & replies
        assert not LEGAL[(Role.DAEMON, state)] - replies
        assert Event in LEGAL[(Role.DAEMON, state)]  # events may come at any open moment


@pytest.mark.parametrize("role", list(Role), ids=_id)
def test_error_state_is_final(role: Role) -> None:
    conn = connection_in(role, State.ERROR)
    assert_stuck(conn, State.ERROR)


@pytest.mark.parametrize("thing", [Barrier(), AllReduce(None, 0), Mem(1, 0)], ids=_id)
def test_what_is_not_a_message_is_illegal_everywhere(thing: Any) -> None:
    for role in Role:
        for state in OPEN_STATES:
            conn = connection_in(role, state)
            with pytest.raises(StateError):
                conn.send(thing)
            assert conn.state is State.ERROR


# ---- bad packets and oversized messages move to ERROR ---------------------------------

@pytest.mark.parametrize("state", OPEN_STATES, ids=_id)
@pytest.mark.parametrize(("packet", "nfds", "error"), [
    (b"\xc1", 0, DecodeError),
    (b"", 0, DecodeError),
    (encode(StatusQuery(1)), 1, DecodeError),  # a stray fd
    (encode(Import(2, 1, MemKind.HOST, 8)), 0, DecodeError),  # a missing fd
    (b"\x81\xa1t\xa6status", 0, DecodeError),  # missing id
    (b"\x82\xa1t\xa6status\xa2id\x00", 0, InvalidMessage),  # id 0
    (b"\x00" * (proto.MAX_MESSAGE_BYTES + 1), 0, MessageTooLarge),
], ids=["reserved", "empty", "stray-fd", "missing-fd", "missing-id", "id-0", "too-large"])
def test_daemon_receiving_a_bad_packet(state: State, packet: bytes, nfds: int, error: type) -> None:
    conn = connection_in(Role.DAEMON, state)
    with pytest.raises(error) as info:
        conn.receive(packet, nfds)
    assert type(info.value) is error
    assert conn.state is State.ERROR
    assert_stuck(conn, State.ERROR)


def test_client_receiving_garbage() -> None:
    conn = connection_in(Role.CLIENT, State.READY)
    with pytest.raises(DecodeError):
        conn.receive(encode(Ok(1, nfds=1)), 0)
    assert conn.state is State.ERROR


def test_sending_an_oversized_message() -> None:
    conn = connection_in(Role.DAEMON, State.READY)
    with pytest.raises(MessageTooLarge):
        conn.send(StatusReport(1, {"blob": b"x" * proto.MAX_MESSAGE_BYTES}))
    assert conn.state is State.ERROR
    assert_stuck(conn, State.ERROR)


def test_sending_an_unencodable_message() -> None:
    conn = connection_in(Role.DAEMON, State.READY)
    with pytest.raises(InvalidMessage):
        conn.send(StatusReport(1, {"set": {1}}))
    assert conn.state is State.ERROR


def test_a_lower_limit_applies_both_ways() -> None:
    packet = encode(HELLO)
    daemon = Connection(Role.DAEMON, limit=len(packet))
    assert daemon.receive(packet) == HELLO
    assert daemon.state is State.JOINING
    tight = Connection(Role.DAEMON, limit=len(packet) - 1)
    with pytest.raises(MessageTooLarge):
        tight.receive(packet)
    assert tight.state is State.ERROR
    client = Connection(Role.CLIENT, limit=len(packet) - 1)
    with pytest.raises(MessageTooLarge):
        client.send(HELLO)
    assert client.state is State.ERROR


def test_a_second_hello_is_illegal() -> None:
    client = connection_in(Role.CLIENT, State.READY)
    with pytest.raises(StateError):
        client.send(Hello(2, 1, 1, "other", 0, 1, 1))
    assert client.state is State.ERROR
    daemon = connection_in(Role.DAEMON, State.JOINING)
    with pytest.raises(StateError):
        daemon.receive(encode(HELLO))
    assert daemon.state is State.ERROR
