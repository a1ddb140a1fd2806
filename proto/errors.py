"""Errors of the sans-IO protocol layer.

    ProtoError                  anything the protocol layer refuses
    ├── DecodeError             bytes that are not a valid message (garbage, wrong schema)
    │   └── MessageTooLarge     a packet over the size limit
    ├── InvalidMessage          a well-formed message whose values break a rule
    └── StateError              a legal message at an illegal moment (h11-style state table)

`ErrorCode` is what travels on the wire inside an `Error` reply; the client maps
each code to one exception class of its own hierarchy (client/errors.py).
"""

from __future__ import annotations

import enum


class ProtoError(Exception):
    """Base of every error the protocol layer raises."""


class DecodeError(ProtoError):
    """The bytes do not decode to a message of this protocol."""


class MessageTooLarge(DecodeError):
    """A packet is over the negotiated size limit."""


class InvalidMessage(ProtoError, ValueError):
    """A message's fields are of the right types but break a rule."""


class StateError(ProtoError):
    """The message is not legal in the connection's current state."""


class ErrorCode(enum.Enum):
    """Why the daemon refused a request; stable strings on the wire."""

    __hash__ = object.__hash__  # members are singletons; Enum hashes the name in Python

    BAD_MESSAGE = "bad_message"  # malformed, oversized or invalid packet
    VERSION = "version"  # protocol version not supported
    PERMISSION = "permission"  # peer credentials not allowed, or wrong join token
    BAD_RANK = "bad_rank"  # rank/root/peer out of range
    DUPLICATE_RANK = "duplicate_rank"  # rank already held by another connection
    WORLD_CONFLICT = "world_conflict"  # ranks disagree on the world (size, bootstrap, root)
    UNKNOWN_WORLD = "unknown_world"  # a request names a world that does not exist
    BAD_MEMORY = "bad_memory"  # (buffer, offset, bytes) outside the allocation
    UNKNOWN_BUFFER = "unknown_buffer"  # buffer id never imported or already dropped
    UNKNOWN_HANDLE = "unknown_handle"  # register/symmetric handle unknown or freed
    MISUSE = "misuse"  # legal message, wrong use (e.g. unsupported memory kind)
    MISMATCH = "mismatch"  # ranks disagree on call k
    WORLD_FAILED = "world_failed"  # the world failed; reconnect to go on
    STALE_EPOCH = "stale_epoch"  # a call made for an epoch of the world that a reconnect has ended
    TIMEOUT = "timeout"  # a deadline passed (join, completion)
    LIMIT = "limit"  # a daemon limit was reached (connections, buffers, pending calls)
    SHUTDOWN = "shutdown"  # the daemon is stopping
    PEER_LOST = "peer_lost"  # another daemon of the world is unreachable or was lost
    ENGINE = "engine"  # the engine (NCCL) reported an error of the world's communicator
    INTERNAL = "internal"  # a bug in the daemon; the connection is closed
