"""The client pieces that need no daemon: SingleGpuBackend, CommBackend defaults, hostmem, errors."""

from __future__ import annotations

import numpy as np
import pytest

from client import CommBackend, CommError, HostMemory, MisuseError, SingleGpuBackend, hostmem
from client.errors import UNHEALTHY, MismatchError, WorldFailed, from_code
from client.memory import resolve
from proto import ErrorCode, MemKind

pytestmark = pytest.mark.timeout(10)


def test_single_gpu_backend_is_the_seeds_one_rank_backend() -> None:
    b = SingleGpuBackend()
    assert (b.rank(), b.world_size(), b.is_healthy()) == (0, 1, True)
    for call in (lambda: b.all_reduce(1, 8), lambda: b.all_gather(1, 2, 8),
                 lambda: b.reduce_scatter(1, 2, 8), lambda: b.broadcast(1, 8, 0), b.barrier,
                 lambda: b.send_to(1, 8, 0, 0), lambda: b.recv_from(1, 8, 0, 0),
                 lambda: b.all_reduce_async(1, 8, 0), lambda: b.deregister_buffer(5),
                 lambda: b.set_add_kernel(7), b.group_start, b.group_end, b.attempt_reconnect):
        assert call() is None
    assert b.register_buffer(1, 8) == 0
    with pytest.raises(CommError):
        b.symmetric_alloc(64)
    with pytest.raises(CommError):
        b.symmetric_free(64)
    with pytest.raises(MisuseError, match="refuses root"):
        b.recv_command_u32(1, 0)  # the seed's default refuses root...
    assert b.recv_command_u32(1, 1) is None  # ...and otherwise is a 4-byte broadcast


def test_comm_backend_requires_the_seeds_methods() -> None:
    with pytest.raises(TypeError, match="abstract"):
        CommBackend()  # type: ignore[abstract]
    required = {name for name in dir(CommBackend)
                if getattr(getattr(CommBackend, name), "__isabstractmethod__", False)}
    assert required == {"all_reduce", "all_gather", "reduce_scatter", "broadcast", "barrier",
                        "send_to", "recv_from", "rank", "world_size", "deregister_buffer",
                        "set_add_kernel"}


def test_host_buffers_resolve_by_address_and_never_reuse_ids() -> None:
    memory = HostMemory()
    a, b = memory.alloc(4096), memory.alloc(100)
    assert a.id != b.id and a.ptr != b.ptr
    assert memory.find(a.ptr + 10, 100) == (a, 10)
    ref = resolve(memory, b.ptr + 4, 96)
    assert ref is not None and (ref.kind, ref.buffer_id, ref.offset, ref.size) == (MemKind.HOST, b.id, 4, 100)
    assert resolve(memory, 0xDEAD, 0) is None  # an empty span needs no memory
    with pytest.raises(MisuseError, match="past the end"):
        memory.find(b.ptr + 4, 97)
    with pytest.raises(MisuseError, match="not in host memory"):
        memory.find(0x10, 1)
    old_id, old_ptr = a.id, a.ptr
    a.close()
    with pytest.raises(MisuseError):
        memory.find(old_ptr, 1)
    c = memory.alloc(4096)
    assert c.id > old_id  # a reused address can never be mistaken for the freed buffer
    b.close()
    c.close()


def test_host_buffer_views_and_close() -> None:
    buf = hostmem.alloc(10)
    view = buf.view(np.uint32)
    assert view.shape == (2,)  # whole elements only
    view[:] = [1, 2]
    with pytest.raises(MisuseError, match="live views"):
        buf.close()
    del view
    buf.close()
    assert buf.closed
    buf.close()  # idempotent
    with pytest.raises(MisuseError, match="closed"):
        buf.view()


class Listener:
    def __init__(self, memory: HostMemory) -> None:
        self.heard: list[int] = []
        memory.on_release(self.on)

    def on(self, buffer_id: int) -> None:
        self.heard.append(buffer_id)


def test_release_listeners_hear_about_freed_buffers() -> None:
    memory = HostMemory()
    listener = Listener(memory)
    heard = listener.heard
    buf = memory.alloc(8)
    buf.close()
    assert heard == [buf.id]
    del listener  # held weakly: a closed backend stops listening
    memory.alloc(8).close()
    assert heard == [buf.id]


@pytest.mark.parametrize("code", list(ErrorCode))
def test_every_wire_code_has_a_typed_error(code: ErrorCode) -> None:
    err = from_code(code, "why")
    assert isinstance(err, CommError) and err.code is code and str(err) == "why"
    if code is ErrorCode.MISMATCH:
        assert isinstance(err, MismatchError) and isinstance(err, WorldFailed)
    if code in (ErrorCode.WORLD_FAILED, ErrorCode.TIMEOUT, ErrorCode.SHUTDOWN):
        assert isinstance(err, UNHEALTHY)


def test_a_dropped_buffer_gives_back_its_fd_and_table_entry() -> None:
    import gc
    import os

    memory = HostMemory()
    listener = Listener(memory)
    heard = listener.heard
    buf = memory.alloc(4096)
    buffer_id, ptr, fd = buf.id, buf.ptr, buf.fd
    del buf
    gc.collect()
    assert heard == [buffer_id]
    with pytest.raises(OSError):
        os.fstat(fd)  # closed (the number may be reused later, not now)
    with pytest.raises(MisuseError):
        memory.find(ptr, 1)
