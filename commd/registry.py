"""All worlds of one daemon, by name. Worlds are created by their first hello
and dropped when their last rank leaves."""

from __future__ import annotations

import hmac

import proto
from proto import ErrorCode

from .engine.base import Engine
from .errors import CallError
from .world import Peer, World


class Registry:
    def __init__(self, engine: Engine) -> None:
        self._engine = engine
        self.worlds: dict[str, World] = {}

    def join(self, peer: Peer, hello: proto.Hello) -> World:
        """Admit `hello` into its world (creating it), or raise CallError saying why not."""
        world = self.worlds.get(hello.world)
        if world is None:
            world = World(hello.world, hello.world_size, hello.token, self._engine, self._forget)
            self.worlds[hello.world] = world
        elif world.world_size != hello.world_size:
            raise CallError(ErrorCode.WORLD_CONFLICT,
                            f"world {hello.world} has {world.world_size} ranks, "
                            f"hello says world_size={hello.world_size}")
        if not hmac.compare_digest((world.token or "").encode(), (hello.token or "").encode()):
            raise CallError(ErrorCode.PERMISSION, f"wrong join token for world {hello.world}")
        if world.holds(hello.rank):
            raise CallError(ErrorCode.DUPLICATE_RANK,
                            f"rank {hello.rank} of world {hello.world} is already connected")
        world.join(peer, hello)
        return world

    def _forget(self, world: World) -> None:
        if self.worlds.get(world.name) is world:
            del self.worlds[world.name]

    def shutdown(self, message: str) -> None:
        for world in list(self.worlds.values()):
            world.shutdown(message)

    def status(self) -> list[dict[str, object]]:
        return [w.status() for w in self.worlds.values()]
