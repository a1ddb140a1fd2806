"""Errors inside the daemon.

    CallError            a request fails; carries the wire ErrorCode sent back to the rank
    └── NotListening     nothing listens at a daemon's address (yet): a join dials it again
    ConfigError          bad configuration at start (the CLI prints it and exits 2)

Anything else escaping a handler is a daemon bug: the connection gets an
INTERNAL error and is closed; other connections and worlds go on.
"""

from __future__ import annotations

from proto import MAX_ERROR_TEXT, ErrorCode, clip_text

from . import __version__

MAX_TEXT = MAX_ERROR_TEXT - 96  # what the wire allows an error, less room for prefixes
# A world's cause, less room for what a call it ended says around it (World.call_failed and
# _not_ready: a world name of 128, an epoch of 20 digits and two rank counts of 5 take 219):
# clipped there instead, the cause would lose its end, and from_peer's note with it
MAX_CAUSE = MAX_TEXT - 256


def clip(text: str, limit: int = MAX_TEXT) -> str:
    """A message that fits in an Error or Event, however long what it names."""
    return clip_text(text, limit)


def framed(head: str, text: str, tail: str, limit: int = MAX_TEXT) -> str:
    """`head + text + tail` in `limit` characters: `text` is clipped, never what frames it (what
    to do next, who said it), which a clip of the whole would cut first."""
    return head + clip_text(text, limit - len(head) - len(tail)) + tail


def from_peer(daemon: str, code: ErrorCode | str, message: str) -> tuple[ErrorCode, str]:
    """A failure daemon `daemon` reported, as this one passes it on to its ranks: a code it does
    not know (a newer daemon's) is told to them as a world failure, and the text keeps that
    code and who sent it (a rank's Event and the statistics take ErrorCodes only)."""
    if isinstance(code, ErrorCode):
        return code, message
    note = f" (code {code!r} from daemon {daemon}, unknown to commd {__version__})"
    # the sender's text is clipped, not the note: clipped after it, a long text (a newer build
    # may word a failure at the wire's length) would cut the one word of which code it was. To
    # a world's cause's length: that is what the text becomes, and the cause is not clipped again
    return ErrorCode.WORLD_FAILED, framed("", message, note, MAX_CAUSE)


def rank_list(ranks: list[int], shown: int = 16) -> str:
    """A rank list for a message: whole when short, else its start and a count."""
    if len(ranks) <= shown:
        return "[" + ", ".join(map(str, ranks)) + "]"
    return "[" + ", ".join(map(str, ranks[:shown])) + f", ... ({len(ranks) - shown} more)]"


def named_ranks(ranks: list[int], whole: bool = False) -> str:
    """"rank 3", or "ranks [0, 1, ...]", for a message; `whole` (for the log, where nothing
    bounds a line and what was cut is lost for good), every rank, ascending runs as "0-6"."""
    if len(ranks) == 1:
        return f"rank {ranks[0]}"
    if not whole:
        return f"ranks {rank_list(ranks)}"
    runs: list[list[int]] = []
    for rank in ranks:
        if runs and rank == runs[-1][-1] + 1:
            runs[-1][1:] = [rank]
        else:
            runs.append([rank])
    return "ranks [" + ", ".join("-".join(map(str, run)) for run in runs) + "]"


def quoted(name: str, limit: int = 300) -> str:
    """A name for a message, quoted (its characters escaped), clipped past `limit`: escaped, a
    name's every character may take up to 10 (a 256-character peer_name, 2562), more than
    the message around it may hold."""
    return clip_text(repr(name), limit)


def escaped(text: str, limit: int) -> str:
    """Words someone else chose, for a message or a log line: the characters that do not print
    (a line break, a terminal's escape) escaped as `quoted` escapes them, so they can neither
    start a line of their own in a log nor drive a terminal; the rest as they are (quoted
    whole, a text that quotes a name already would show its escapes doubled)."""
    return clip_text("".join(c if c.isprintable() else repr(c)[1:-1] for c in text), limit)


def seconds(duration_s: float) -> str:
    """A duration for a message, to a tenth of a second: the rest of a timeout reads "8s",
    not "7.978s"."""
    return f"{round(duration_s, 1):g}s"


class CallError(Exception):
    """A request that fails with `code`; the message goes to the client verbatim."""

    def __init__(self, code: ErrorCode, message: str) -> None:
        message = clip(message)
        super().__init__(message)
        self.code = code
        self.message = message


class NotListening(CallError):
    """The daemon at an address refused the connection: none listens there, as when a world's
    root daemon starts after its members' (or restarts). A join dials it again until its
    timeout; the code on the wire, when it gives up, is that of any unreachable daemon."""


class ConfigError(Exception):
    """A configuration value is missing or invalid; `key` names the setting when one is to
    blame, so the loader can add where its value came from."""

    def __init__(self, message: str, key: str | None = None) -> None:
        super().__init__(message)
        self.key = key


def cannot_listen(key: str, host: str, port: int, exc: OSError | UnicodeError) -> ConfigError:
    """A listener that could not start: the address in use, or a host name that does not
    resolve (IDNA refuses some names with a UnicodeError, not an OSError)."""
    why = (exc.strerror or str(exc)) if isinstance(exc, OSError) else f"bad host name ({exc})"
    return ConfigError(f"{key}: cannot listen on {host}:{port}: {why}", key=key)
