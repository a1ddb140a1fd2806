"""A FUSE filesystem of one file whose server stops answering one process: what a
client can hand the daemon in place of memory (an fd whose fstat, read or close waits
on that server, for as long as it likes).

It speaks the /dev/fuse protocol itself (mount(2) with fd=...), so it needs no libfuse,
only /dev/fuse and the right to mount (root, or a user namespace that allows it):
`StallFs.mount` raises `Unmountable` saying why where that is missing.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import os
import select
import stat
import struct
import tempfile
import threading

_IN_HEADER = struct.Struct("<IIQQIIIHH")  # len, opcode, unique, nodeid, uid, gid, pid, extlen, pad
_OUT_HEADER = struct.Struct("<IiQ")  # len, error, unique
_ATTR = struct.Struct("<QQQQQQIIIIIIIIII")
_LOOKUP, _FORGET, _GETATTR, _OPEN, _RELEASE, _FLUSH, _INIT, _INTERRUPT, _BATCH_FORGET = (
    1, 2, 3, 14, 18, 25, 26, 36, 42)
_NO_REPLY = {_FORGET, _INTERRUPT, _BATCH_FORGET}
_ROOT, _FILE = 1, 2
FILE_NAME = "stuck"
_MNT_DETACH = 2


class Unmountable(Exception):
    """This machine does not let the test mount a FUSE filesystem."""


class StallFs:
    """Mounted at `path`, with one file (`file`) of `size` bytes. Requests from the
    threads of process `stall_pid` about the file are held unanswered (set the pid any
    time); `close()` answers them and unmounts."""

    def __init__(self, size: int = 4096) -> None:
        self.size = size
        self.stall_pid: int | None = None
        self.held = 0  # requests held so far
        self._dev = -1
        self._held: list[tuple[int, int, int]] = []  # (opcode, unique, nodeid)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.path = tempfile.mkdtemp(prefix="commd-fuse-")

    @property
    def file(self) -> str:
        return os.path.join(self.path, FILE_NAME)

    def mount(self) -> StallFs:
        try:
            self._dev = os.open("/dev/fuse", os.O_RDWR | os.O_CLOEXEC)
        except OSError as exc:
            os.rmdir(self.path)
            raise Unmountable(f"cannot open /dev/fuse: {exc}") from None
        libc = ctypes.CDLL(None, use_errno=True)
        options = f"fd={self._dev},rootmode={stat.S_IFDIR:o},user_id={os.getuid()},group_id={os.getgid()}"
        if libc.mount(b"commd-stallfs", self.path.encode(), b"fuse.commd-stallfs", 0, options.encode()) != 0:
            code = ctypes.get_errno()
            os.close(self._dev)
            os.rmdir(self.path)
            raise Unmountable(f"mount -t fuse: {os.strerror(code)} (errno {errno.errorcode.get(code, code)})")
        self._thread = threading.Thread(target=self._serve, name="stallfs", daemon=True)
        self._thread.start()
        return self

    def close(self) -> None:
        """Answer what is held, unmount, and end the server (held requests fail ENOTCONN
        if the server cannot answer them in time). Idempotent."""
        if self._dev < 0:
            return
        self.stall_pid = None
        self._stop.set()
        if self._thread is not None:
            self._thread.join(10)
        for opcode, unique, nodeid in self._held:
            self._answer(opcode, unique, nodeid)
        self._held.clear()
        libc = ctypes.CDLL(None, use_errno=True)
        libc.umount2(self.path.encode(), _MNT_DETACH)
        os.close(self._dev)  # (aborts the connection: anything still waiting on us fails)
        self._dev = -1
        with contextlib.suppress(OSError):
            os.rmdir(self.path)

    def __enter__(self) -> StallFs:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _serve(self) -> None:
        poller = select.poll()
        poller.register(self._dev, select.POLLIN)
        while not self._stop.is_set():
            if not poller.poll(50):
                continue
            try:
                request = os.read(self._dev, 1 << 20 | 4096)
            except OSError as exc:
                if exc.errno in (errno.EINTR, errno.EAGAIN, errno.ENOENT):  # (ENOENT: interrupted)
                    continue
                return  # unmounted
            _, opcode, unique, nodeid, _, _, pid, _, _ = _IN_HEADER.unpack_from(request)
            if opcode in _NO_REPLY:
                continue
            if nodeid == _FILE and self.stall_pid is not None and _tgid(pid) == self.stall_pid:
                self._held.append((opcode, unique, nodeid))
                self.held += 1
                continue
            self._answer(opcode, unique, nodeid, request[_IN_HEADER.size:])

    def _answer(self, opcode: int, unique: int, nodeid: int, body: bytes = b"") -> None:
        error, reply = 0, b""
        if opcode == _INIT:
            reply = struct.pack("<IIIIHHIIHHII", 7, 31, 0, 0, 16, 12, 1 << 20, 1, 0, 0, 0, 0) + bytes(24)
        elif opcode == _LOOKUP:
            if body.rstrip(b"\0") == FILE_NAME.encode():
                reply = struct.pack("<QQQQII", _FILE, 0, 60, 0, 0, 0) + self._attr(_FILE)
            else:
                error = -errno.ENOENT
        elif opcode == _GETATTR:
            reply = struct.pack("<QII", 0, 0, 0) + self._attr(nodeid)  # (valid for 0 s: always asked)
        elif opcode == _OPEN:
            reply = struct.pack("<QIi", 1, 0, 0)
        elif opcode not in (_FLUSH, _RELEASE):
            error = -errno.ENOSYS
        with contextlib.suppress(OSError):  # (a request interrupted meanwhile: ENOENT)
            os.write(self._dev, _OUT_HEADER.pack(_OUT_HEADER.size + len(reply), error, unique) + reply)

    def _attr(self, nodeid: int) -> bytes:
        if nodeid == _ROOT:
            return _ATTR.pack(_ROOT, 0, 0, 0, 0, 0, 0, 0, 0, stat.S_IFDIR | 0o755, 2, 0, 0, 0, 4096, 0)
        return _ATTR.pack(_FILE, self.size, 8, 0, 0, 0, 0, 0, 0, stat.S_IFREG | 0o666, 1, 0, 0, 0, 4096, 0)


def _tgid(tid: int) -> int | None:
    """The process of thread `tid` (FUSE names the calling thread)."""
    try:
        with open(f"/proc/{tid}/status") as status:
            for line in status:
                if line.startswith("Tgid:"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None
