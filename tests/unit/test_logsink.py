"""NonBlockingFdHandler on a real pipe, shrunk to one page so that a reader who does not
read stalls it after a few lines."""

from __future__ import annotations

import fcntl
import json
import logging
import os
import re
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from commd import logsink
from commd.logs import JsonFormatter
from commd.logsink import NonBlockingFdHandler

pytestmark = pytest.mark.timeout(30)
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def pipe() -> Iterator[tuple[int, int]]:
    r, w = os.pipe()
    fcntl.fcntl(w, fcntl.F_SETPIPE_SZ, 4096)
    os.set_blocking(r, False)
    try:
        yield r, w
    finally:
        os.close(r)
        os.close(w)


def logger_to(handler: logging.Handler, name: str) -> logging.Logger:
    log = logging.getLogger(f"test.logsink.{name}")
    log.propagate = False
    log.handlers = [handler]
    log.setLevel(logging.INFO)
    return log


def read_all(fd: int) -> bytes:
    out = b""
    while True:
        try:
            chunk = os.read(fd, 65536)
        except BlockingIOError:
            return out
        if not chunk:
            return out
        out += chunk


def test_a_line_is_out_before_the_log_call_returns(pipe: tuple[int, int]) -> None:
    r, w = pipe
    log = logger_to(NonBlockingFdHandler(w), "at_once")
    log.info("first %d", 1)
    assert read_all(r) == b"first 1\n"
    log.info("second")
    assert read_all(r) == b"second\n"


def test_a_long_line_to_a_regular_file_is_out_before_the_log_call_returns(tmp_path: Path) -> None:
    """A file (a daemon's stderr redirected to one) never waits for a reader: a line of
    10 KB and the line after it are in the file when the log call returns (before: the
    first 4 KiB were, the rest went through the writer thread, late; seen in 32 of 50)."""
    long_line = "y" * 10_000
    for i in range(20):
        path = tmp_path / f"log{i}"
        with open(path, "wb") as file:
            log = logger_to(NonBlockingFdHandler(file.fileno()), f"file{i}")
            log.info("%s", long_line)
            log.info("next")
            assert path.read_text().splitlines() == [long_line, "next"]


def drained(handler: NonBlockingFdHandler, r: int) -> bytes:
    """What the handler writes while it flushes, read as it comes."""
    flushing = threading.Thread(target=handler.flush)
    flushing.start()
    out = b""
    while flushing.is_alive():
        out += read_all(r)
        flushing.join(0.01)
    return out + read_all(r)


@pytest.mark.parametrize("nonblocking", [False, True], ids=["blocking", "nonblocking"])
def test_a_stalled_reader_blocks_no_log_call_and_what_is_dropped_is_counted_in_place(
        pipe: tuple[int, int], nonblocking: bool) -> None:
    """200 lines of 100 bytes into a 4 KiB pipe nobody reads, with 8 KiB kept: every call
    returns (before: one waited for the reader for ever); read later, the lines come in
    order, and one line stands where each run of dropped ones was, with their number.
    (Where the runs fall depends on when the writer thread gets the GIL from the burst:
    before it has filled the pipe's page, the 8 KiB fill sooner and a second run can follow
    the lines it makes room for.) The pipe set O_NONBLOCK (as a parent or a sibling
    may set it) changes nothing of it."""
    r, w = pipe
    os.set_blocking(w, not nonblocking)
    handler = NonBlockingFdHandler(w, backlog_bytes=8192)
    log = logger_to(handler, "stalled")
    def burst() -> None:
        for i in range(200):
            log.info("line %03d %s", i, "x" * 90)

    logged = threading.Thread(target=burst)
    logged.start()
    logged.join(10)
    assert not logged.is_alive()
    out = drained(handler, r)
    log.info("line %03d after", 200)
    lines = (out + drained(handler, r)).decode().splitlines()
    assert lines[-1] == "line 200 after"
    told, kept, notes = 0, 0, 0  # lines seen or counted; kept; notes
    for line in lines[:-1]:
        note = re.fullmatch(r"(\d+) log lines were dropped here: the log's reader \(stderr\) was stalled",
                            line)
        if note is not None:
            told, notes = told + int(note[1]), notes + 1
        else:
            assert line.startswith(f"line {told:03d} "), (told, line)
            told, kept = told + 1, kept + 1
    assert told == 200 and notes >= 1
    assert 80 < kept < 200  # (at least the 8 KiB)


def test_the_note_of_dropped_lines_comes_before_the_next_line_though_that_goes_out_at_once(
        pipe: tuple[int, int]) -> None:
    """Lines dropped while the pipe was full, then the reader reads it all: the next line
    goes out at once, and the note of the dropped ones before it (before: the note waited
    for a line that had to be kept, or for the flush at exit, far from its place, and a
    daemon killed meanwhile never told). A handler that keeps nothing: no writer thread."""
    r, w = pipe
    log = logger_to(NonBlockingFdHandler(w, backlog_bytes=0), "in_place")
    for i in range(100):
        log.info("line %03d %s", i, "x" * 90)
    out = read_all(r)
    log.info("after")
    lines = (out + read_all(r)).decode().splitlines()
    kept = sum(line.startswith("line ") for line in lines)
    assert 0 < kept < 100
    assert [int(line.split()[1]) for line in lines[:kept]] == list(range(kept))
    note = f"{100 - kept} log lines were dropped here: the log's reader (stderr) was stalled"
    assert lines[kept:] == [note, "after"]


def test_the_note_of_dropped_lines_is_in_the_handlers_format(pipe: tuple[int, int]) -> None:
    r, w = pipe
    handler = NonBlockingFdHandler(w, backlog_bytes=1024)
    handler.setFormatter(JsonFormatter())
    log = logger_to(handler, "json")
    for i in range(100):
        log.info("line %03d %s", i, "x" * 90)
    lines = [json.loads(line) for line in drained(handler, r).decode().splitlines()]
    told, notes = 0, 0  # lines seen or counted; notes (more than one: see the stalled test)
    for line in lines:
        if line["logger"] == "commd.logs":
            note = re.fullmatch(r"(\d+) log lines were dropped here: the log's reader \(stderr\) was "
                                r"stalled", line["message"])
            assert note is not None and line["level"] == "WARNING", line
            told, notes = told + int(note[1]), notes + 1
        else:
            assert line["message"].split()[1] == f"{told:03d}", (told, line)
            told += 1
    assert told == 100 and notes >= 1


def test_lines_kept_for_a_pipe_set_nonblocking_by_another_wait_for_its_reader(
        pipe: tuple[int, int]) -> None:
    """O_NONBLOCK is a flag of the open file, which a parent or a sibling sharing stderr may
    set: a full pipe then answers a write with EAGAIN. 200 lines of 100 bytes into a 4 KiB
    pipe nobody reads for 0.3 s: read then, every line comes, in order (before: the writer
    thread took EAGAIN for a gone reader and lost every line it was given: the 40 lines
    the pipe held came, of 200)."""
    r, w = pipe
    os.set_blocking(w, False)
    handler = NonBlockingFdHandler(w)
    log = logger_to(handler, "nonblocking")
    for i in range(200):
        log.info("line %03d %s", i, "x" * 90)
    threading.Event().wait(0.3)  # (the writer meets the full pipe meanwhile)
    lines = drained(handler, r).decode().splitlines()
    assert lines == [f"line {i:03d} {'x' * 90}" for i in range(200)]


def test_once_a_flush_waited_in_vain_for_the_reader_later_ones_do_not_wait(
        pipe: tuple[int, int], monkeypatch: pytest.MonkeyPatch) -> None:
    """A daemon that cannot start flushes at its final error's line and again at logging's
    shutdown: with stderr stalled each waited FLUSH_WAIT_S (seen: a failed start with a full
    pipe took 4.75 s to exit). The first waits its whole time; the next returns at once;
    nothing kept is lost for it, and read later, every line comes in order."""
    monkeypatch.setattr(logsink, "FLUSH_WAIT_S", 1.0)
    r, w = pipe
    handler = NonBlockingFdHandler(w)
    log = logger_to(handler, "given_up")
    for i in range(100):
        log.info("line %03d %s", i, "x" * 90)
    threading.Event().wait(0.3)  # (the writer fills the pipe meanwhile: lines out in a wait are a reader)
    took = []
    for _ in range(2):
        started = time.monotonic()
        handler.flush()
        took.append(time.monotonic() - started)
    assert took[0] >= 1.0 and took[1] < 0.5, took
    out, deadline = b"", time.monotonic() + 10
    while out.count(b"\n") < 100:  # (the writer thread goes on as the reader reads)
        assert time.monotonic() < deadline, out
        out += read_all(r)
        time.sleep(0.01)
    assert out.decode().splitlines() == [f"line {i:03d} {'x' * 90}" for i in range(100)]


def read_slowly(cmd: list[str]) -> bytes:
    """What `cmd` writes to its stderr, a one-page pipe read 2 KB every 0.1 s (journald
    catching up), until it exits (0)."""
    r, w = os.pipe()
    fcntl.fcntl(w, fcntl.F_SETPIPE_SZ, 4096)
    try:
        child = subprocess.Popen(cmd, cwd=REPO, stderr=w, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL)
    finally:
        os.close(w)
    out = b""
    with open(r, "rb", buffering=0) as err:
        try:
            while chunk := err.read(2048):
                out += chunk
                time.sleep(0.1)
            assert child.wait(10) == 0
        finally:
            child.kill()
            child.wait()
    return out


# Logs 250 lines of 200 bytes to stderr, flushes as `commd serve` does on its way out, then
# exits (logging's own flush at exit)
SLOW_READER_CHILD = """
import sys
from commd.logs import flush_logs, setup_logging

setup_logging("INFO", "text")
import logging
for i in range(250):
    logging.getLogger("commd.test").info("line %03d %s", i, "x" * 160)
flush_logs()
"""


def test_a_slow_reader_gets_every_line_of_an_exit_that_it_keeps_reading(tmp_path: Path) -> None:
    """The reader takes 2 KB every 0.1 s (journald catching up): 50 KB take it 2.5 s, more
    than the first flush's FLUSH_WAIT_S. Each line went out meanwhile, so logging's flush
    at exit waits again, and every line comes (before: a flush that waited in vain, with
    lines going out all the time, gave the reader up; the next returned at once, and the
    process ended with the last ~10 KB unwritten: 200 of 250 lines seen)."""
    lines = read_slowly([sys.executable, "-c", SLOW_READER_CHILD]).decode().splitlines()
    assert [line.split()[5] for line in lines] == [f"{i:03d}" for i in range(250)], lines[-3:]


# One line of 60 KB, then 20 of 200 bytes, then the way out of a `commd serve` that ends in
# an error: its flush, the final error's line (flushed), logging's flush at exit
LONG_LINE_CHILD = """
import logging
from commd.logs import flush_logs, print_last, setup_logging

setup_logging("INFO", "text")
logging.getLogger("commd.test").info("long %s", "y" * 60000)
for i in range(20):
    logging.getLogger("commd.test").info("line %03d %s", i, "x" * 160)
flush_logs()
print_last("commd: the final error")
"""


def test_a_slow_reader_gets_a_long_line_and_the_lines_after_it() -> None:
    """The same reader, a line it takes 3 s to read, then more: its bytes went out all the
    flush's wait, so that is no stalled reader either (before: the flush saw no whole line
    go out, gave the reader up, and the exit left the last lines unwritten)."""
    lines = read_slowly([sys.executable, "-c", LONG_LINE_CHILD]).decode().splitlines()
    assert lines[0].endswith(" INFO commd.test: long " + "y" * 60000), lines[0][:100]
    assert [line.split()[5] for line in lines[1:-1]] == [f"{i:03d}" for i in range(20)], lines[-3:]
    assert lines[-1] == "commd: the final error"
