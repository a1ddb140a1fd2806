"""Logging set-up: readable lines by default, JSON lines for log shippers.

A JSON line carries ts, level, logger and message, and the world, epoch and rank
when the call passed them with `extra=` (every line about a world does), so a
log pipeline can select one world's story without parsing messages.

`Throttled` bounds the warnings that strangers can cause (refused connections,
bad packets): one line a second per kind, with a count of the ones left out;
`ThrottledBy`, per source as well.
"""

from __future__ import annotations

import datetime
import json
import logging
import sys
import threading
import time
from collections.abc import Callable, Mapping
from types import TracebackType
from typing import TextIO

from .logsink import NonBlockingFdHandler

CONTEXT_FIELDS = ("world", "epoch", "rank")


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        ts = datetime.datetime.fromtimestamp(record.created, datetime.UTC)
        line: dict[str, object] = {
            "ts": ts.isoformat(timespec="milliseconds").replace("+00:00", "Z"),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        for name in CONTEXT_FIELDS:
            value = record.__dict__.get(name)
            if value is not None:
                line[name] = value
        if record.exc_info:
            line["exc"] = self.formatException(record.exc_info)
        return json.dumps(line, default=str)


# A message's control characters, escaped: a line break in text that a peer daemon, a
# client or a file gave (a goodbye's reason, a world's failure message) would start what
# reads as a log line of its own, a forged one from a peer
_ESCAPES = {code: f"\\x{code:02x}" for code in (*range(32), 127) if chr(code) != "\t"} | {
    ord("\n"): "\\n", ord("\r"): "\\r"}


class TextFormatter(logging.Formatter):
    """The text log's lines: a record is one line (its traceback, if any, the lines after)."""

    def __init__(self) -> None:
        super().__init__("%(asctime)s %(levelname)s %(name)s: %(message)s")

    def formatMessage(self, record: logging.LogRecord) -> str:
        # (a line break that ends one is no part of it: a captured warning's text has one)
        record.message = record.message.rstrip("\r\n").translate(_ESCAPES)
        return super().formatMessage(record)


def setup_logging(level: str, fmt: str, stream: TextIO | None = None) -> None:
    """Configure the root logger once, at start (replacing what was there): to `stream`,
    or to stderr without ever blocking on its reader (`logsink`), and then what Python
    itself would write to stderr goes to the log too (`_route_stray_stderr`)."""
    handler = logging.StreamHandler(stream) if stream is not None else _stderr_handler()
    if fmt == "json":
        handler.setFormatter(JsonFormatter())
    else:
        handler.setFormatter(TextFormatter())
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level)
    _route_stray_stderr(stream is None)


def _stderr_handler() -> logging.Handler:
    try:
        return NonBlockingFdHandler(sys.stderr.fileno())
    except (AttributeError, OSError, ValueError):  # no descriptor: a test's capture
        return logging.StreamHandler(sys.stderr)


_uncaught = logging.getLogger("commd.uncaught")


def _log_uncaught(exc_type: type[BaseException], exc: BaseException, tb: TracebackType | None) -> None:
    _uncaught.critical("uncaught exception, the daemon exits", exc_info=(exc_type, exc, tb))


def _log_thread_exception(args: threading.ExceptHookArgs) -> None:
    if issubclass(args.exc_type, SystemExit):  # (a thread's way to end, as the default hook takes it)
        return
    name = args.thread.name if args.thread is not None else "?"
    _uncaught.error("uncaught exception in thread %s", name,
                    exc_info=(args.exc_type, args.exc_value, args.exc_traceback))  # type: ignore[arg-type]


def _log_unraisable(args: sys.UnraisableHookArgs) -> None:
    what = args.err_msg or "Exception ignored in"
    if args.object is not None:
        try:
            what += f": {args.object!r}"
        except Exception:  # (a finalizer's object may be half torn down)
            what += f": <{type(args.object).__name__} object>"
    _uncaught.error("%s", what, exc_info=(args.exc_type, args.exc_value, args.exc_traceback))  # type: ignore[arg-type]


# Each hook, what Python itself has in its place, and ours
_HOOKS = ((sys, "excepthook", sys.__excepthook__, _log_uncaught),
          (threading, "excepthook", threading.__excepthook__, _log_thread_exception),
          (sys, "unraisablehook", sys.__unraisablehook__, _log_unraisable))


def _route_stray_stderr(on: bool) -> None:
    """Python writes some things to sys.stderr past logging: an uncaught exception's
    traceback (the main thread's, another thread's, one raised in a finalizer) and a
    warning. Those writes block on a stalled reader as a StreamHandler did (the event loop
    with them, where the thread or the finalizer ran there), so with the log on stderr
    they go to the log, in its format (a traceback in a JSON line's "exc"). The hooks are
    process-wide by nature, and hold nothing: they log to the root logger, whichever
    handler a later call gives it. A call with a stream of its own (a test's capture)
    puts back Python's hooks where ours are, leaving another's alone."""
    logging.captureWarnings(on)
    for module, name, python_s, ours in _HOOKS:
        if on:
            setattr(module, name, ours)
        elif getattr(module, name) is ours:
            setattr(module, name, python_s)


def flush_logs() -> None:
    """Let the lines kept for a stalled stderr out first (bounded: `logsink.FLUSH_WAIT_S`),
    before what is written past logging: a final error's print, an os._exit."""
    for handler in logging.getLogger().handlers:
        handler.flush()


def print_last(text: str) -> None:
    """`text` on a line of its own to stderr, as print would: after the log's lines, and
    waiting for a stalled reader no longer than `flush_logs` (a daemon's final error must
    not hold up its exit for ever), also where the log was not set up yet (an error in
    the settings) or goes elsewhere."""
    write_stderr(text + "\n")


def write_stderr(text: str) -> None:
    """`text` as it is to stderr, the way `print_last` writes a line (argparse's usage and
    errors come this way too)."""
    ours = [handler for handler in logging.getLogger().handlers
            if isinstance(handler, NonBlockingFdHandler)]  # (setup_logging's)
    handler = ours[0] if ours else _stderr_handler()
    if isinstance(handler, NonBlockingFdHandler):
        handler.write_unformatted(text)
        handler.flush()
    elif sys.stderr is not None:  # (stderr has no descriptor: a test's capture)
        sys.stderr.write(text)
        sys.stderr.flush()
    # (else fd 2 was closed at start-up (`2>&-`): nowhere to write, as argparse and print
    # take it; raising instead turned the caller's exit 2 into 1)


class Throttled:
    """Warnings of one kind, at most one every `interval_s`: a client that reconnects
    without end with a bad packet, or a port scan of the peer port, must not flood the
    journal (nor spend the event loop on formatting lines). The lines left out are
    counted, and the next line that is logged says how many there were."""

    def __init__(self, logger: logging.Logger, interval_s: float = 1.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._logger = logger
        self._interval_s = interval_s
        self._clock = clock
        self._last = -float("inf")
        self.left_out = 0  # since the last line logged

    def warning(self, msg: str, *args: object, extra: Mapping[str, object] | None = None) -> None:
        now = self._clock()
        if now - self._last < self._interval_s:
            self.left_out += 1
            return
        if self.left_out:
            msg += f" ({self.left_out} more like it since the last such line were not logged)"
        self._logger.warning(msg, *args, extra=extra)
        self._last, self.left_out = now, 0

    def quiet(self) -> bool:
        """Whether its next line would be logged, with no count of left-out ones to carry."""
        return not self.left_out and self._clock() - self._last >= self._interval_s


class ThrottledBy:
    """A `Throttled` for each source (a daemon, by name): one source's flood is bounded as
    `Throttled` bounds it, and hides no other source's line (one shared by all left out the
    line of a second daemon that went wrong within the first's second). At most `sources`
    are told apart at once; past them, new ones share one `Throttled` (a flood under ever
    new names is bounded still). A quiet source is forgotten as room is needed: its next
    line would be logged anyway."""

    def __init__(self, logger: logging.Logger, interval_s: float = 1.0,
                 clock: Callable[[], float] = time.monotonic, sources: int = 8) -> None:
        self._new: Callable[[], Throttled] = lambda: Throttled(logger, interval_s, clock)
        self._sources = sources
        self._by: dict[str, Throttled] = {}
        self._rest = self._new()

    def warning(self, source: str, msg: str, *args: object,
                extra: Mapping[str, object] | None = None) -> None:
        throttled = self._by.get(source)
        if throttled is None:
            if len(self._by) >= self._sources:
                self._by = {name: t for name, t in self._by.items() if not t.quiet()}
            if len(self._by) < self._sources:
                throttled = self._by[source] = self._new()
            else:
                throttled = self._rest
        throttled.warning(msg, *args, extra=extra)
