"""register_buffer's handles: the worker's own, so a daemon restart changes none of them."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import NamedTuple

import proto

from .errors import CommError, LimitExceeded, MisuseError
from .rpc import Requester, Superseded


class Registration(NamedTuple):
    ptr: int
    nbytes: int
    # our id of the memory it was made on: once that is freed, another buffer may take its
    # address, and a rejoin must not register that one in its place (a device allocation
    # dropped from our full cache comes back under a new id too: the daemon dropped its
    # registration with the old one)
    buffer: int
    # None while a rejoin registers it again, or if the daemon does not hold it (its memory
    # went before a restarted daemon knew it, an attempt was cut short, it was given up)
    daemon_handle: int | None
    link: int  # the daemon connection that holds daemon_handle (Connection.link)
    # not to be made again with this daemon: it refused this one or one before (a limit),
    # or the memory is gone
    given_up: bool = False


class Registrations:
    """Our handles, each mapped to the daemon's and the connection it holds it on. A
    restarted daemon hands out new ones (and again the old numbers, to others): a rejoin
    forgets the old daemon's (`new_daemon`), then registers each again (`register_again`,
    which a rebuild on the same daemon also calls, for what an earlier one left undone),
    while other threads may register and deregister. `lock` is the backend's: the one
    its connection and `link()` change under."""

    def __init__(self, lock: threading.RLock, request: Requester,
                 mem: Callable[[int, int, float], tuple[proto.Mem | None, tuple[int, ...]]],
                 unpin: Callable[[tuple[int, ...]], None], link: Callable[[], int],
                 gone: Callable[[int], bool], next_handle: Callable[[], int]) -> None:
        self._lock = lock
        self._request = request
        self._mem = mem  # resolves a span, and pins the CUDA allocation it names (if one)
        self._unpin = unpin
        self._link = link
        self._gone = gone  # whether a daemon connection is no more (its registrations went with it)
        self._by_handle: dict[int, Registration] = {}
        # Drawn from the process's one id counter (hostmem's, whatever a backend's table),
        # not numbered per backend: a handle passed to another world's backend must be
        # refused there, not taken for that backend's own registration of the same number
        self._next_handle = next_handle

    def handles(self) -> set[int]:
        with self._lock:
            return set(self._by_handle)

    def register(self, ptr: int, nbytes: int, due: float) -> int:
        while True:
            try:
                daemon_handle, link, buffer = self._register(ptr, nbytes, due)
            except Superseded:  # resolved with a daemon a rejoin replaced before it was asked
                continue
            handle = self._next_handle()
            with self._lock:
                if link == self._link():
                    self._by_handle[handle] = Registration(ptr, nbytes, buffer, daemon_handle, link)
                    return handle
            # made with a daemon a rejoin replaced meanwhile (gone, and the registration with
            # it), after the rejoin registered again what it knew: make it with the new one

    def deregister(self, handle: int, due: float) -> None:
        while True:
            with self._lock:
                registration = self._by_handle.get(handle)
            if registration is None:
                raise MisuseError(f"handle {handle} is not registered")
            if registration.daemon_handle is not None:
                self._deregister_at(registration.daemon_handle, registration.link, due)
            with self._lock:
                if self._by_handle.get(handle) is registration:
                    del self._by_handle[handle]
                    return
            # a rejoin registered it with a restarted daemon meanwhile: let go of that one too

    def new_daemon(self, link: int) -> None:
        """(Under the lock) The daemon connection is now `link`, whose daemon holds none yet: a
        re-registration that fails must not keep the old daemon's handle, which the new one
        hands out again to another."""
        for handle, registration in list(self._by_handle.items()):
            self._by_handle[handle] = registration._replace(daemon_handle=None, link=link, given_up=False)

    def register_again(self, due: float) -> None:
        """Make every registration the daemon lacks (after a rejoin, all) again, by `due`:
        also what an earlier attempt left undone (it timed out, or the daemon went). Once the
        daemon refuses one (a limit), it and the rest are given up on until a new daemon (the
        worker may deregister and register them anew), and the refusal is raised."""
        with self._lock:
            registrations = list(self._by_handle.items())
        refusal: LimitExceeded | None = None
        for handle, registration in registrations:
            if registration.daemon_handle is not None or registration.given_up:
                continue  # the daemon holds it (from before, or a register_buffer meanwhile), or given up
            made = None
            if refusal is None:
                try:
                    made = self._register(registration.ptr, registration.nbytes, due, registration.buffer)
                except Superseded:  # another rejoin, since: it registers again what lacks a handle
                    return
                except LimitExceeded as exc:
                    refusal = exc
                except MisuseError:  # its memory was freed meanwhile: nothing to register any more
                    pass
            if made is None:
                self._give_up(handle, registration)
                continue
            fresh, link, _ = made
            with self._lock:
                if self._by_handle.get(handle) is registration:
                    self._by_handle[handle] = registration._replace(daemon_handle=fresh, link=link)
                    continue
            self._deregister_at(fresh, link, due)  # deregistered meanwhile: the new daemon lets go too
        if refusal is not None:
            raise refusal

    def _give_up(self, handle: int, registration: Registration) -> None:
        with self._lock:
            if self._by_handle.get(handle) is registration:
                self._by_handle[handle] = registration._replace(given_up=True)

    def _register(self, ptr: int, nbytes: int, due: float,
                  buffer: int | None = None) -> tuple[int, int, int]:
        """The daemon's handle, the daemon connection it holds it on, and our id of the memory.
        `buffer`: only on that memory (MisuseError if another buffer holds `ptr` now).
        Superseded if a rejoin replaced the daemon the memory was resolved with."""
        link = self._link()
        # Resolved before the request and pinned until it is sent: evicted from our cache by
        # another thread's call meanwhile, the memory's Forget must not reach the daemon first
        mem, pinned = self._mem(ptr, nbytes, due)
        try:
            if mem is None:
                raise MisuseError("cannot register an empty buffer")
            if buffer is not None and mem.buf != buffer:
                raise MisuseError(f"the memory registered at 0x{ptr:x} was freed")
            answer = self._request(lambda rid: proto.Register(rid, mem, nbytes), due=due,
                                   undo=_deregister_late, link=link)
        finally:
            self._unpin(pinned)
        return answer.value(), answer.link, mem.buf

    def _deregister_at(self, daemon_handle: int, link: int, due: float) -> None:
        """Drop a registration at the daemon that made it, if that one is still ours."""
        try:
            self._request(lambda rid: proto.Deregister(rid, daemon_handle), due=due, link=link)
        except Superseded:
            pass  # that daemon is gone, and its registrations with it
        except CommError as exc:
            unknown = isinstance(exc, MisuseError) and exc.code is proto.ErrorCode.UNKNOWN_HANDLE
            # Unknown: the daemon let go of it with its memory (freed, or dropped from our full
            # cache). Gone as we asked (the daemon died, the connection was dropped): nothing is
            # registered there any more, and the handle kept, a rejoin would register it again.
            if not (unknown or self._gone(link)):
                raise


def _deregister_late(reply: proto.Message, request_id: int) -> proto.Message | None:
    """A registration that timed out but was made: the daemon lets go of it."""
    return proto.Deregister(request_id, reply.value) if isinstance(reply, proto.Ok) else None
