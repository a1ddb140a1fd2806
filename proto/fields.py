"""What a field of a message may hold: the wire's limits, and one check for each kind of
field, shared by the Unix protocol's messages (messages.py) and the daemons' (peer.py), so
that each rule has one definition for both protocols. A failed check raises `InvalidMessage`.
"""

from __future__ import annotations

import enum
import typing
from typing import Any

from .errors import ErrorCode, InvalidMessage

MAX_MESSAGE_BYTES = 64 * 1024
MAX_RANKS = 65536
MAX_WORLD_NAME = 128
MAX_ERROR_TEXT = 4096  # characters of an error's message, in either protocol
MAX_ERROR_CODE = 64  # characters of an error code the receiver does not know (a newer peer's)
U64_MAX = (1 << 64) - 1
# A world formed from a hello goes on at its epoch + 1, and each rebuild adds one: an epoch
# from a hello must leave room for those in the u64 the replies carry it in.
MAX_HELLO_EPOCH = 1 << 62


def check_u64(name: str, value: int) -> None:
    # (a float or numpy integer would pass the range check, then fail to pack, or reach
    # the other side as a float: type first)
    if type(value) is not int or not 0 <= value <= U64_MAX:
        raise InvalidMessage(f"{name}={value} is not an unsigned 64-bit integer")


def check_positive(name: str, value: int) -> None:
    if type(value) is not int or not 0 < value <= U64_MAX:
        raise InvalidMessage(f"{name}={value} must be a positive 64-bit integer")


def check_rank(name: str, value: int, what: str = "a rank") -> None:
    if type(value) is not int or not 0 <= value < MAX_RANKS:
        raise InvalidMessage(f"{name}={value} is not {what} (0..{MAX_RANKS - 1})")


def check_short_text(name: str, value: str, limit: int = 256) -> None:
    if len(value) > limit:
        raise InvalidMessage(f"{name} is longer than {limit} characters")


def clip_text(text: str, limit: int = MAX_ERROR_TEXT) -> str:
    """`text` in at most `limit` characters: whole, or its start and a marker."""
    return text if len(text) <= limit else text[:limit - 20] + " ... (cut)"


def error_code(code: ErrorCode | str) -> ErrorCode | str:
    """An error's code as carried: the ErrorCode it names, or the string of one this side does
    not know (a newer peer's)."""
    return typing.cast("ErrorCode | str", member_or_name(code, ErrorCode, "an error code"))


def member_or_name(value: Any, members: type[enum.Enum], what: str) -> Any:
    """The member a string names (as decoded: a message equals itself after a round trip), or
    the string itself when it names none (a newer peer's), if 1..MAX_ERROR_CODE characters."""
    if type(value) is str:
        known = members._value2member_map_.get(value)
        if known is not None:
            return known
        if not 0 < len(value) <= MAX_ERROR_CODE:
            raise InvalidMessage(f"{what} is 1..{MAX_ERROR_CODE} characters")
    return value
