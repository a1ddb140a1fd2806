"""The fds a client sent whose close waits on their filesystem's server (FUSE, NFS): what
the daemon tells of them, without asking that filesystem anything (its server may never
answer). A daemon holding any cannot exit, not even on SIGKILL, until the server answers."""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Sequence


@dataclasses.dataclass(frozen=True, eq=False)  # (one per hand-over: an fd's number is reused)
class Handed:
    """An fd a client sent, on its way to a closing thread: what its file was (told before
    the close, which takes the fd out of /proc/self/fd) and since when."""

    fd: int
    path: str
    mount_id: int | None
    since: float

    @classmethod
    def of(cls, fd: int) -> Handed:
        # (procfs answers both: neither asks the file's own filesystem anything)
        try:
            path = os.readlink(f"/proc/self/fd/{fd}")
        except OSError as exc:
            path = f"fd {fd} ({exc.strerror})"
        return cls(fd, path, _mount_id(fd), time.monotonic())


def held_closes(held: Sequence[Handed], now: float, named: int = 3) -> str:
    """What an operator reads of the closes still held: how many, of which files, for how
    long, and how to let them go."""
    paths = ", ".join(handed.path for handed in held[:named]) + (", ..." if len(held) > named else "")
    aborts = sorted({path for handed in held if (path := _fuse_abort(handed.mount_id)) is not None})
    abort = (f"abort the FUSE connection (write 1 to {', '.join(aborts)})" if aborts
             else "abort its connection (FUSE: write 1 to /sys/fs/fuse/connections/N/abort)")
    return (f"{len(held)} fd(s) a client sent not closed yet: their filesystem's server has not "
            f"answered the close for {now - held[0].since:.1f}s ({paths}); the process cannot "
            f"exit, not even on SIGKILL, until it answers: end that server, or {abort}")


def _mount_id(fd: int) -> int | None:
    try:
        with open(f"/proc/self/fdinfo/{fd}") as info:
            for line in info:
                if line.startswith("mnt_id:"):
                    return int(line.split()[1])
    except (OSError, ValueError):
        pass
    return None


def _fuse_abort(mount_id: int | None) -> str | None:
    """The file that aborts the FUSE connection of mount `mount_id`: its name is the
    mount's device number (the kernel's encoding, major << 20 | minor)."""
    if mount_id is None:
        return None
    try:
        with open("/proc/self/mountinfo") as mounts:
            for line in mounts:
                fields = line.split()
                if fields[0] != str(mount_id):
                    continue
                fstype = fields[fields.index("-") + 1]
                if fstype != "fuse" and not fstype.startswith(("fuse.", "fuseblk")):
                    return None
                major, minor = (int(part) for part in fields[2].split(":"))
                return f"/sys/fs/fuse/connections/{major << 20 | minor}/abort"
    except (OSError, ValueError, IndexError):
        pass
    return None
