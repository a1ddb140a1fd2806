"""commd wire protocol, sans-IO: messages, codec and the connection state machine.

No sockets, asyncio or threads here (a test enforces it); the daemon (async) and
the client (blocking) both drive `Connection`. The wire format is in WIRE.md.
"""

from .codec import decode, encode, expected_fds
from .connection import Connection, Role, State
from .errors import DecodeError, ErrorCode, InvalidMessage, MessageTooLarge, ProtoError, StateError
from .fields import MAX_ERROR_CODE, MAX_ERROR_TEXT, MAX_MESSAGE_BYTES, clip_text
from .messages import (
    IPC_EVENT_BYTES,
    IPC_MEM_HANDLE_BYTES,
    JOIN_BACKSTOP_S,
    MAX_GROUP_OPS,
    PROTOCOL_VERSION,
    Deregister,
    Error,
    Event,
    Forget,
    Hello,
    Import,
    Message,
    Ok,
    Reconnect,
    Register,
    Reply,
    Request,
    SetAddKernel,
    StatusQuery,
    StatusReport,
    StreamEvents,
    StreamSubmit,
    Submit,
    SymAlloc,
    SymFree,
    Welcome,
)
from .ops import (
    AllGather,
    AllReduce,
    Barrier,
    Broadcast,
    Mem,
    Op,
    Recv,
    ReduceScatter,
    Send,
    mems_of,
    with_mems,
)
from .types import DType, EventKind, MemKind, ReduceOp

__all__ = [
    "IPC_EVENT_BYTES", "IPC_MEM_HANDLE_BYTES", "JOIN_BACKSTOP_S", "MAX_ERROR_CODE", "MAX_ERROR_TEXT",
    "MAX_GROUP_OPS", "MAX_MESSAGE_BYTES", "PROTOCOL_VERSION",
    "AllGather", "AllReduce",
    "Barrier", "Broadcast", "Connection", "DType", "DecodeError", "Deregister", "Error",
    "ErrorCode", "Event", "EventKind", "Forget", "Hello", "Import", "InvalidMessage", "Mem",
    "MemKind", "Message", "MessageTooLarge", "Ok", "Op", "ProtoError", "Recv", "Reconnect",
    "ReduceOp", "ReduceScatter", "Register", "Reply", "Request", "Role", "Send",
    "SetAddKernel", "State", "StateError", "StatusQuery", "StatusReport", "StreamEvents",
    "StreamSubmit", "Submit", "SymAlloc", "SymFree", "Welcome", "clip_text", "decode", "encode",
    "expected_fds", "mems_of", "with_mems",
]
