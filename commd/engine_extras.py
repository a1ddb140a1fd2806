"""What a world's ranks ask of its engine besides calls: register_buffer's registrations
and set_add_kernel's add path, and when the communicator may act on them."""

from __future__ import annotations

from .engine.base import Communicator, Region


class EngineExtras:
    """The ranks' registrations and add-kernel handles, kept across epochs (a rebuilt
    world's communicator gets them again). Each changes which NCCL calls a rank makes.
    The communicator gets the registrations only while every rank asked, all on this
    daemon (`local`), where that is known: NCCL leaves an op undefined when some ranks
    pass registered buffers and some do not. It is told which ranks here set the add
    kernel, and takes the 2-rank exchange once both did (across daemons, once the
    daemons agreed: engine/addagree.py)."""

    def __init__(self, world_size: int, local: bool) -> None:
        self._world_size = world_size
        self._local = local
        self.add_kernel: dict[int, int] = {}  # rank -> its handle
        self._registered: dict[int, dict[int, Region]] = {}  # rank -> its regions, by handle
        self._handed = False  # whether the communicator has the registrations

    def hand_to(self, comm: Communicator) -> None:
        """A new epoch's communicator: it knows nothing yet."""
        self._handed = False
        self._hand_registrations(comm)
        self._use_add_kernel(comm)

    def set_add_kernel(self, rank: int, handle: int, comm: Communicator | None) -> None:
        self.add_kernel[rank] = handle
        self._use_add_kernel(comm)

    def register(self, rank: int, key: int, region: Region, comm: Communicator | None) -> None:
        self._registered.setdefault(rank, {})[key] = region
        if comm is not None and self._handed:
            comm.register(rank, key, region)
        self._hand_registrations(comm)

    def deregister(self, rank: int, key: int, comm: Communicator | None) -> None:
        self._registered.get(rank, {}).pop(key, None)
        if comm is not None and self._handed:
            comm.deregister(rank, key)
        self._hand_registrations(comm)

    def forget(self, rank: int) -> None:
        """The rank left (its world fails: the next epoch's communicator is told afresh)."""
        self.add_kernel.pop(rank, None)
        self._registered.pop(rank, None)

    def _use_add_kernel(self, comm: Communicator | None) -> None:
        if comm is not None:
            comm.use_add_kernel(frozenset(self.add_kernel))

    def _hand_registrations(self, comm: Communicator | None) -> None:
        if comm is None:
            return
        wanted = self._local and all(self._registered.get(r) for r in range(self._world_size))
        if wanted == self._handed:
            return
        self._handed = wanted
        for rank, regions in self._registered.items():
            for key, region in regions.items():
                if wanted:
                    comm.register(rank, key, region)
                else:
                    comm.deregister(rank, key)
