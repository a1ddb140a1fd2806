"""Log lines to a descriptor (stderr) without blocking the thread that logs.

Under systemd the daemon's stderr is a stream to journald, which can stall (a slow
disk, a flood from other units); a pipe whose reader stopped fills at 64 KiB. A
plain StreamHandler then blocks whichever thread logs, the event loop included,
and every world's calls with it, until the watchdog kills the daemon.

`NonBlockingFdHandler` writes a line at once when the descriptor can take it
without waiting, which is the usual case: the line is out before the log call
returns, as with a StreamHandler. Otherwise the line is kept, in order, for a
thread of its own that waits for the reader (also where another process sharing
the descriptor set it O_NONBLOCK: EAGAIN then is a full pipe, not a gone reader).
What is kept is bounded: past `backlog_bytes`, lines are dropped and counted, and
a line in their place says how many (the journal must not cost the daemon its
memory).
"""

from __future__ import annotations

import logging
import os
import select
import stat
import sys
import threading
from collections import deque

BACKLOG_BYTES = 1 << 20
FLUSH_WAIT_S = 2.0  # at exit: the last lines, unless the reader stays stalled
# The writer's wait for a descriptor set O_NONBLOCK (by anyone sharing its open file, a
# parent or a sibling) to take more: a bound on each wait, not on the whole
_WRITABLE_WAIT_MS = 1000
# A pipe that polls writable has a free page; a socket, half its send buffer: a write
# of up to this many bytes then does not wait.
_UNBLOCKED_WRITE = select.PIPE_BUF
_UNFORMATTED_SHOWN = 200  # characters of a message that could not be formatted


class NonBlockingFdHandler(logging.Handler):
    """A handler writing formatted lines to `fd` (not closed by it); see the module."""

    def __init__(self, fd: int, backlog_bytes: int = BACKLOG_BYTES) -> None:
        super().__init__()
        self._fd = fd
        self._limit = backlog_bytes
        # A regular file has no reader to wait for (and poll says it always takes a line):
        # a line is written whole, or one over PIPE_BUF would end through the thread, late
        self._at_once = None if stat.S_ISREG(os.fstat(fd).st_mode) else _UNBLOCKED_WRITE
        self._poll = select.poll()
        self._poll.register(fd, select.POLLOUT)
        # Guards what follows; notified as the backlog changes. It is logging's lock of the
        # handler, held round emit: with a lock of its own, a thread holding this one that
        # logged (a finalizer run by a collection there, logging by the unraisable hook)
        # waited for logging's, held by a thread in emit waiting for this one: a deadlock.
        assert self.lock is not None  # (Handler.__init__ made it)
        self._changed = threading.Condition(self.lock)
        self._backlog: deque[bytes] = deque()  # the first is being written while the writer holds it
        self._held = 0
        self._dropped = 0  # since the last line kept
        self._bytes_out = 0  # by the writer thread (alone: no lock)
        # _bytes_out when a flush waited its whole FLUSH_WAIT_S and saw none go out
        self._stalled_at: int | None = None
        # Started here, not at the first line kept: that is in emit, under the lock, and
        # start() waits for the new thread, which could log first (a finalizer that raised,
        # run by a collection as it began) and wait for the lock: a deadlock
        threading.Thread(target=self._write_backlog, name="commd-log-writer", daemon=True).start()

    def emit(self, record: logging.LogRecord) -> None:
        try:
            line = (self.format(record) + "\n").encode("utf-8", "backslashreplace")
        except Exception:
            self.handleError(record)
            return
        self._send(line)

    def handleError(self, record: logging.LogRecord) -> None:
        """logging's own prints the formatting error's traceback to sys.stderr, past this
        handler: on a stalled reader it waited as a StreamHandler did (the event loop with
        it). A line through the handler says what could not be logged instead."""
        error = sys.exc_info()[1]
        try:
            said = repr(record.msg)[:_UNFORMATTED_SHOWN]
            why = f"{type(error).__name__}: {error}"
        except Exception:  # (a message or an error whose text raises too)
            said, why = f"<{type(record.msg).__name__} object>", type(error).__name__
        self._send(self._own_line(logging.LogRecord(
            record.name, record.levelno, record.pathname, record.lineno,
            "a log line could not be formatted (%s); its message was %s", (why, said), None)))

    def write_unformatted(self, text: str) -> None:
        """`text` as it is, after the lines before it: a last word past the log (a final
        error's line) waits for a stalled reader no more than a log line does."""
        self._send(text.encode("utf-8", "backslashreplace"))

    def _send(self, line: bytes) -> None:
        with self._changed:
            if not self._backlog and self._poll.poll(0):
                if self._dropped:  # (their note goes out first, where they were left out)
                    line = self._dropped_note() + line
                try:
                    line = line[os.write(self._fd, line[:self._at_once]):]
                except BlockingIOError:  # O_NONBLOCK, and another writer filled it since poll
                    pass
                except OSError:  # the reader is gone (EPIPE): nowhere to tell it
                    return
                if not line:
                    return
            self._keep(line)

    def _keep(self, line: bytes) -> None:
        if self._held + len(line) > self._limit:
            self._dropped += 1
            return
        if self._dropped:
            self._append(self._dropped_note())
        self._append(line)

    def _append(self, line: bytes) -> None:
        self._backlog.append(line)
        self._held += len(line)
        self._changed.notify_all()

    def _dropped_note(self) -> bytes:
        record = logging.LogRecord("commd.logs", logging.WARNING, __file__, 0,
                                   "%d log lines were dropped here: the log's reader (stderr) was stalled",
                                   (self._dropped,), None)
        self._dropped = 0
        return self._own_line(record)

    def _own_line(self, record: logging.LogRecord) -> bytes:
        """A line of the handler's own, in its format (plain if even that fails)."""
        try:
            text = self.format(record)
        except Exception:
            text = record.getMessage()
        return (text + "\n").encode("utf-8", "backslashreplace")

    def _write_backlog(self) -> None:
        writable = select.poll()  # (emit's is used under the lock, this one outside it)
        writable.register(self._fd, select.POLLOUT)
        while True:
            with self._changed:
                while not self._backlog:
                    self._changed.wait()
                line = self._backlog[0]
            unwritten = memoryview(line)
            try:
                while unwritten:  # (this thread is here to wait for the reader)
                    try:
                        # a page at a time: a write(2) to a blocking descriptor returns once
                        # all of it is out, and flush tells a slow reader (bytes going out)
                        # from a stalled one by what has come back
                        written = os.write(self._fd, unwritten[:_UNBLOCKED_WRITE])
                    except BlockingIOError:  # O_NONBLOCK: a full pipe, not a gone reader
                        writable.poll(_WRITABLE_WAIT_MS)
                        continue
                    unwritten = unwritten[written:]
                    self._bytes_out += written
            except OSError:
                pass  # gone: the line is lost, as it would be with the reader
            with self._changed:
                self._held -= len(self._backlog.popleft())
                self._changed.notify_all()

    def flush(self) -> None:
        """Wait, up to FLUSH_WAIT_S, for the kept lines to be written (at exit; a critical
        line before os._exit). Once a flush waited that long and not a byte went out, later
        ones do not wait until some do: an exit flushes more than once (the final error's
        line, logging's shutdown), and each wait for a stalled reader would hold it up
        again; a slow one that reads on (a long line too) gets each flush's wait."""
        with self._changed:
            if self._dropped:  # (no line came after them to carry the note)
                self._append(self._dropped_note())
            out_before = self._bytes_out
            wait_s = 0.0 if self._stalled_at == out_before else FLUSH_WAIT_S
            drained = self._changed.wait_for(lambda: not self._backlog, wait_s)
            if not drained and self._bytes_out == out_before:
                self._stalled_at = out_before
