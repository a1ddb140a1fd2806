"""What Python writes to stderr past logging (uncaught exceptions, warnings), in a process
that set up logging the daemon's way, with stderr a one-page pipe that nobody reads."""

from __future__ import annotations

import fcntl
import json
import os
import select
import subprocess
import sys
import threading
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(30)
REPO = Path(__file__).resolve().parents[2]

# Each of Python's own writes to stderr (and logging's, of a line it cannot format), then
# "done" on stdout, then an uncaught exception in the main thread, whose line the exit's
# flush lets out (the parent reads by then)
CHILD = """
import logging, sys, threading, warnings
from commd.logs import setup_logging

setup_logging("INFO", sys.argv[1])

def fail():
    raise ValueError("raised in a thread")

thread = threading.Thread(target=fail, name="failing-thread")
thread.start()
thread.join()
warnings.warn("a warning of the daemon's", UserWarning)
logging.getLogger("commd.test").info("%d apples", "no number")

class Finalized:
    def __del__(self):
        raise RuntimeError("raised in a finalizer")

Finalized()
print("done", flush=True)
raise KeyError("raised in the main thread")
"""
FILLER = b"f" * 4096


def run_into_a_full_pipe(fmt: str) -> tuple[int, list[str]]:
    """The child's exit code and its stderr past the filler, read once it said "done"
    (within 10 s: no write of its waited for the reader)."""
    r, w = os.pipe()
    fcntl.fcntl(w, fcntl.F_SETPIPE_SZ, len(FILLER))
    assert os.write(w, FILLER) == len(FILLER)  # (full: the next write(2) to it waits)
    with open(r, "rb") as err:
        try:
            child = subprocess.Popen([sys.executable, "-c", CHILD, fmt], cwd=REPO, stdout=subprocess.PIPE,
                                     stderr=w, stdin=subprocess.DEVNULL)
        finally:
            os.close(w)
        assert child.stdout is not None
        try:
            said = select.select([child.stdout], [], [], 10)[0] and child.stdout.readline()
            assert said == b"done\n", "the child waited for its stderr's reader"
            out = err.read()
            code = child.wait(10)
        finally:
            child.kill()
            child.wait()
            child.stdout.close()
    assert out.startswith(FILLER), out[:100]
    return code, out[len(FILLER):].decode().splitlines()


def test_uncaught_exceptions_and_warnings_go_through_the_log_without_waiting_for_its_reader() -> None:
    """Before: the thread's traceback went to stderr by print, and the child waited in
    write(2) for ever (no "done" in 10 s). Now each is a log line, its traceback after it
    as a logged exception's is, and the main thread's exception ends the child (code 1)."""
    code, lines = run_into_a_full_pipe("text")
    assert code == 1, lines
    text = "\n".join(lines)
    heads = [line.split(" ", 2)[2] for line in lines
             if any(f" {logger}: " in line for logger in ("commd.uncaught", "py.warnings", "commd.test"))]
    assert [head.split(": ", 1)[0] for head in heads] == [
        "ERROR commd.uncaught", "WARNING py.warnings", "INFO commd.test", "ERROR commd.uncaught",
        "CRITICAL commd.uncaught"], text
    assert heads[0] == "ERROR commd.uncaught: uncaught exception in thread failing-thread", text
    assert heads[1].endswith("UserWarning: a warning of the daemon's"), text
    assert heads[2] == ("INFO commd.test: a log line could not be formatted (TypeError: %d format: a real "
                        "number is required, not str); its message was '%d apples'"), text
    assert "--- Logging error ---" not in text, text
    assert heads[3].startswith(
        "ERROR commd.uncaught: Exception ignored in: <function Finalized.__del__"), text
    assert heads[4] == "CRITICAL commd.uncaught: uncaught exception, the daemon exits", text
    for raised in ("ValueError: raised in a thread", "RuntimeError: raised in a finalizer",
                   "KeyError: 'raised in the main thread'"):
        assert text.count(raised) == 1, text
    # each traceback follows its own line
    assert text.index("ValueError") < text.index("py.warnings") < text.index("RuntimeError") < text.index(
        "CRITICAL") < text.index("KeyError")


def test_in_json_each_is_one_line_with_its_traceback_in_exc() -> None:
    code, lines = run_into_a_full_pipe("json")
    assert code == 1, lines
    logged = [json.loads(line) for line in lines]
    assert [(line["level"], line["logger"]) for line in logged] == [
        ("ERROR", "commd.uncaught"), ("WARNING", "py.warnings"), ("INFO", "commd.test"),
        ("ERROR", "commd.uncaught"), ("CRITICAL", "commd.uncaught")], lines
    assert logged[0]["message"] == "uncaught exception in thread failing-thread"
    assert logged[0]["exc"].endswith("ValueError: raised in a thread")
    assert "UserWarning: a warning of the daemon's" in logged[1]["message"] and "exc" not in logged[1]
    assert logged[2]["message"].startswith("a log line could not be formatted (TypeError: "), logged[2]
    assert logged[3]["exc"].endswith("RuntimeError: raised in a finalizer")
    assert logged[4]["exc"].endswith("KeyError: 'raised in the main thread'")


def test_logging_to_a_stream_of_its_own_puts_pythons_hooks_back() -> None:
    """The hooks come with the log on stderr; a later set-up to another stream (a test's
    capture) leaves stderr to Python again, and a hook someone else set stays theirs."""
    check = """
import io, logging, sys, threading, warnings
from commd.logs import setup_logging

setup_logging("INFO", "text")
routed = (sys.excepthook is not sys.__excepthook__,
          threading.excepthook is not threading.__excepthook__,
          sys.unraisablehook is not sys.__unraisablehook__,
          warnings.showwarning is not warnings._showwarning_orig)
theirs = lambda *args: None
sys.unraisablehook = theirs
setup_logging("INFO", "text", io.StringIO())
back = (sys.excepthook is sys.__excepthook__, threading.excepthook is threading.__excepthook__,
        sys.unraisablehook is theirs, warnings.showwarning is warnings._showwarning_orig)
print(routed, back)
"""
    done = subprocess.run([sys.executable, "-c", check], cwd=REPO, capture_output=True, text=True, timeout=20)
    assert done.stdout == "(True, True, True, True) (True, True, True, True)\n", done.stderr


# A finalizer that raises, run by a collection in whichever thread allocates (after every
# allocation here), the log's writer thread among them, while the main thread logs
LITTER_CHILD = """
import gc, logging, sys, threading, time
from commd.logs import setup_logging

setup_logging("INFO", "text")
gc.set_threshold(1)
sys.setswitchinterval(1e-6)

class Cyclic:
    def __del__(self):
        raise RuntimeError("raised in a finalizer")

def litter():
    while True:
        garbage = Cyclic()
        garbage.itself = garbage
        del garbage
        time.sleep(0)

threading.Thread(target=litter, daemon=True).start()
for i in range(20000):
    logging.getLogger("commd.test").info("line %d %s", i, "x" * 100)
print("done", flush=True)
"""


def test_a_finalizer_logging_in_the_log_writer_thread_deadlocks_nothing() -> None:
    """The unraisable hook logs from whichever thread a collection ran a finalizer in. In
    the log's writer thread, that held the handler's condition and waited for logging's
    lock of the handler, which the main thread held in emit, waiting for the condition:
    the child never said done in 20 s (3 runs of 3). One lock now: done in ~1.5 s."""
    r, w = os.pipe()
    fcntl.fcntl(w, fcntl.F_SETPIPE_SZ, len(FILLER))  # (the writer thread at work all along)
    try:
        child = subprocess.Popen([sys.executable, "-c", LITTER_CHILD], cwd=REPO, stdout=subprocess.PIPE,
                                 stderr=w, stdin=subprocess.DEVNULL)
    finally:
        os.close(w)
    read: list[bytes] = []
    with open(r, "rb", buffering=0) as err:
        reader = threading.Thread(target=lambda: read.extend(iter(lambda: err.read(1024), b"")), daemon=True)
        reader.start()
        assert child.stdout is not None
        try:
            said = select.select([child.stdout], [], [], 20)[0] and child.stdout.readline()
            assert said == b"done\n", f"no done in 20 s, {sum(map(len, read))} bytes of log read"
            assert child.wait(10) == 0
        finally:
            child.kill()
            child.wait()
            child.stdout.close()
        reader.join(10)
    lines = b"".join(read).decode().splitlines()
    logged = [int(line.split()[5]) for line in lines if " INFO commd.test: line " in line]
    # (in order, each once; those the exit's flush did not wait for, and any past 1 MiB
    # kept, left out)
    assert logged == sorted(set(logged)) and len(logged) > 1000, logged[-3:]
    finalized = " ERROR commd.uncaught: Exception ignored in: <function Cyclic.__del__"
    assert any(finalized in line for line in lines), lines[:5]
