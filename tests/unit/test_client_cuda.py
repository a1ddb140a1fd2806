"""Client-side resolution of CUDA pointers (DESIGN §4), with the driver behind its seam.

`FakeDriver` answers the `CudaDriver` queries from a dict of fake allocations;
its VMM exports are real memfds, so fd ownership is checked for leaks. The
last tests run `DaemonBackend` against the session's real (host-engine) daemon.
"""

from __future__ import annotations

import ctypes
import enum
import fcntl
import os
import sys
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

import proto
from client import DaemonBackend, HostMemory, MisuseError
from client.cuda import BindingsDriver, CudaMemory, PointerInfo, available_driver
from client.memory import MemoryRef, MemoryResolver
from client.rpc import Answer, built
from proto import MemKind
from tests.integration.harness import open_fds, world_name

# (this process's fds are counted: the collector's work of earlier tests is done first)
pytestmark = [pytest.mark.timeout(30), pytest.mark.usefixtures("collected")]

BASE = 1 << 52  # far above any user-space mapping: never inside a host buffer
MIB = 1 << 20


# ---- the fake driver ------------------------------------------------------------------


@dataclass
class FakeAllocation:
    base: int
    size: int
    buffer_id: int
    device: int
    legacy: bool


class FakeDriver:
    """A `CudaDriver` over fake allocations; counts its calls and remembers the fds it exported."""

    def __init__(self) -> None:
        self.allocations: dict[int, FakeAllocation] = {}
        self.calls: Counter[str] = Counter()
        self.exported: list[int] = []
        self.log: list[object] = []  # ("synchronize", stream), in order with what a test records
        self._next_buffer_id = 7000

    def alloc(self, base: int, size: int, *, legacy: bool = True, device: int = 0) -> FakeAllocation:
        self._next_buffer_id += 1
        allocation = FakeAllocation(base, size, self._next_buffer_id, device, legacy)
        self.allocations[base] = allocation
        return allocation

    def free(self, base: int) -> None:
        del self.allocations[base]

    def _at(self, ptr: int) -> FakeAllocation | None:
        return next((a for a in self.allocations.values() if a.base <= ptr < a.base + a.size), None)

    def buffer_id(self, ptr: int) -> int | None:
        self.calls["buffer_id"] += 1
        allocation = self._at(ptr)
        return allocation.buffer_id if allocation else None

    def pointer_info(self, ptr: int) -> PointerInfo | None:
        self.calls["pointer_info"] += 1
        a = self._at(ptr)
        return PointerInfo(a.base, a.size, a.buffer_id, a.device, a.legacy) if a else None

    def device_uuid(self, device: int) -> bytes:
        return bytes([device]) * 16

    def ipc_handle(self, base: int) -> bytes:
        self.calls["ipc_handle"] += 1
        allocation = self.allocations[base]  # only ever asked for an allocation's base
        assert allocation.legacy
        return allocation.buffer_id.to_bytes(8, "little") * 8

    def current_device(self) -> int | None:
        return 0

    def synchronize(self, stream: int) -> None:
        self.log.append(("synchronize", stream))

    def export_fd(self, base: int) -> int:
        self.calls["export_fd"] += 1
        assert not self.allocations[base].legacy
        fd = os.memfd_create("fake-vmm", os.MFD_CLOEXEC)
        self.exported.append(fd)
        return fd


def is_open(fd: int) -> bool:
    try:
        fcntl.fcntl(fd, fcntl.F_GETFD)
    except OSError:
        return False
    return True


def resolver(driver: FakeDriver | None, *, device: int | None = None,
             host: HostMemory | None = None) -> tuple[MemoryResolver, list[int]]:
    forgotten: list[int] = []
    return MemoryResolver(host or HostMemory(), driver=lambda: driver, device=device,
                          on_forget=forgotten.append), forgotten


def resolved(r: MemoryResolver, ptr: int, nbytes: int) -> MemoryRef:
    ref = r.resolve(ptr, nbytes)
    assert ref is not None
    return ref


# ---- resolution -----------------------------------------------------------------------


def test_legacy_allocation_is_cuda_ipc_with_the_handle_of_its_base() -> None:
    driver = FakeDriver()
    a = driver.alloc(BASE, 4 * MIB)
    r, _ = resolver(driver)
    ref = resolved(r, BASE + 4096, 1024)
    assert (ref.kind, ref.size, ref.offset, ref.fd) == (MemKind.CUDA_IPC, 4 * MIB, 4096, None)
    assert ref.handle == a.buffer_id.to_bytes(8, "little") * 8 and len(ref.handle) == 64
    with r.import_fds(ref) as fds:
        assert fds == []  # a CUDA IPC handle travels in the packet
    assert r.resolve(BASE, 0) is None  # an empty span needs no memory


def test_vmm_allocation_sends_a_fresh_fd_per_import_and_closes_it() -> None:
    driver = FakeDriver()
    driver.alloc(BASE, 2 * MIB, legacy=False)
    r, _ = resolver(driver)
    before = open_fds()
    ref = resolved(r, BASE + 8, 8)
    assert (ref.kind, ref.offset, ref.handle, ref.fd) == (MemKind.CUDA_VMM, 8, b"", None)
    assert driver.calls["export_fd"] == 0  # exported only when the daemon imports it
    for _ in range(2):  # e.g. the first Import, then again for a restarted daemon
        with r.import_fds(ref) as fds:
            assert len(fds) == 1 and is_open(fds[0])
        assert not is_open(fds[0])  # SCM_RIGHTS gave the daemon its copy: ours is closed
    with pytest.raises(RuntimeError), r.import_fds(ref) as fds:
        raise RuntimeError("the send failed")  # closed on failure too
    assert not is_open(fds[0])
    assert driver.calls["export_fd"] == 3 and open_fds() == before


def test_span_past_the_end_names_the_pointer_and_sizes() -> None:
    driver = FakeDriver()
    driver.alloc(BASE, 1000)
    r, _ = resolver(driver)
    assert resolved(r, BASE + 900, 100).offset == 900
    with pytest.raises(MisuseError, match=rf"\[0x{BASE + 900:x}, \+101\) runs past .* \(1000 bytes\)"):
        r.resolve(BASE + 900, 101)


def test_memory_of_another_device_is_refused() -> None:
    driver = FakeDriver()
    driver.alloc(BASE, MIB, device=1)
    r, _ = resolver(driver, device=0)
    with pytest.raises(MisuseError, match="CUDA device 1, but this backend serves device 0"):
        r.resolve(BASE, 8)
    any_device, _ = resolver(driver)  # no device given: any is fine
    assert resolved(any_device, BASE, 8).kind is MemKind.CUDA_IPC


def test_a_known_allocation_costs_one_buffer_id_query() -> None:
    driver = FakeDriver()
    driver.alloc(BASE, MIB)
    r, forgotten = resolver(driver)
    refs = [resolved(r, BASE + i * 64, 64) for i in range(5)]
    assert {ref.buffer_id for ref in refs} == {refs[0].buffer_id}
    assert [ref.offset for ref in refs] == [0, 64, 128, 192, 256]
    assert (driver.calls["pointer_info"], driver.calls["ipc_handle"], driver.calls["buffer_id"]) == (1, 1, 5)
    assert forgotten == []


def test_a_reused_address_gets_a_new_id_and_the_old_one_is_forgotten() -> None:
    driver = FakeDriver()
    driver.alloc(BASE, MIB)
    driver.alloc(BASE + 4 * MIB, MIB)
    r, forgotten = resolver(driver)
    first = resolved(r, BASE + 16, 16)
    neighbour = resolved(r, BASE + 4 * MIB, 16)
    driver.free(BASE)
    reused = driver.alloc(BASE, 2 * MIB)  # same address, new BUFFER_ID
    again = resolved(r, BASE + 16, 16)
    assert again.buffer_id not in (first.buffer_id, neighbour.buffer_id)
    assert again.handle == reused.buffer_id.to_bytes(8, "little") * 8 and again.size == 2 * MIB
    assert forgotten == [first.buffer_id]
    # a new allocation overlapping a cached one's range proves that one freed as well
    driver.free(BASE + 4 * MIB)
    driver.alloc(BASE + 3 * MIB, 2 * MIB)
    resolved(r, BASE + 3 * MIB, 8)
    assert forgotten == [first.buffer_id, neighbour.buffer_id]


def test_still_valid_checks_each_allocation_and_forgets_the_freed() -> None:
    driver = FakeDriver()
    driver.alloc(BASE, MIB)
    driver.alloc(BASE + 4 * MIB, MIB, legacy=False)
    r, forgotten = resolver(driver)
    a, b = resolved(r, BASE, 8), resolved(r, BASE + 4 * MIB, 8)
    assert r.still_valid([a.buffer_id, b.buffer_id])
    driver.free(BASE + 4 * MIB)
    assert not r.still_valid([a.buffer_id, b.buffer_id])
    assert forgotten == [b.buffer_id]
    assert not r.still_valid([b.buffer_id])  # gone from the cache: never valid again
    with pytest.raises(MisuseError, match="not a live VMM allocation"), r.import_fds(b):
        pass
    assert forgotten == [b.buffer_id]



def test_symmetric_memory_mapped_where_a_freed_allocation_was_forgets_that_one() -> None:
    """The worker frees an allocation the daemon imported, and the daemon's symmetric memory
    is then mapped at its address: the stale entry is dropped and the daemon told, as when
    a worker allocation takes the address (before: it stayed, and the daemon kept the freed
    memory mapped for as long as the symmetric allocation lived)."""
    driver = FakeDriver()
    forgotten: list[int] = []
    ids = iter(range(1, 100))
    cuda = CudaMemory(driver, lambda: next(ids), on_forget=forgotten.append)
    driver.alloc(BASE, MIB)
    found = cuda.find(BASE + 64, 8)
    assert found is not None
    freed = found[0]
    driver.free(BASE)
    mapped = driver.alloc(BASE, 2 * MIB, legacy=False)  # (map_shared reserved the same range)
    cuda.adopt(BASE, 99)
    assert forgotten == [freed.id] and not cuda.owns(freed.id)
    again = cuda.find(BASE + 64, 8)
    assert again is not None and (again[0].id, again[0].cuda_id, again[1]) == (99, mapped.buffer_id, 64)

def full_cache_of_two() -> tuple[FakeDriver, CudaMemory, list[int]]:
    """A cache that holds two allocations, three allocations made (none found yet), and
    the ids it drops."""
    driver = FakeDriver()
    forgotten: list[int] = []
    ids = iter(range(1, 100))
    cuda = CudaMemory(driver, lambda: next(ids), on_forget=forgotten.append, max_allocations=2)
    for i in range(3):
        driver.alloc(BASE + i * MIB, MIB)
    return driver, cuda, forgotten


def test_a_full_cache_drops_freed_allocations_then_the_oldest() -> None:
    driver, cuda, forgotten = full_cache_of_two()
    a, b = (cuda.find(BASE + i * MIB, 8) for i in range(2))
    assert a is not None and b is not None
    driver.free(BASE + MIB)
    assert cuda.find(BASE + 2 * MIB, 8) is not None
    assert forgotten == [b[0].id]  # the freed one goes first; the live oldest stays
    driver.alloc(BASE + 3 * MIB, MIB)
    assert cuda.find(BASE + 3 * MIB, 8) is not None
    assert forgotten == [b[0].id, a[0].id]  # nothing freed: the oldest goes (re-imported if used)
    assert not cuda.owns(a[0].id)


def test_a_full_cache_keeps_what_was_found_last() -> None:
    """An all_gather finds its send buffer (cached long ago), then its new receive buffer,
    which fills the cache: the send buffer, found just now, must not be the one dropped
    (the op would name memory the daemon was told to forget)."""
    _, cuda, forgotten = full_cache_of_two()
    send, other = (cuda.find(BASE + i * MIB, 8) for i in range(2))
    assert send is not None and other is not None
    assert cuda.find(BASE, 8) == send  # the op's send buffer, found again
    assert cuda.find(BASE + 2 * MIB, 8) is not None  # its receive buffer: the cache is full
    assert forgotten == [other[0].id] and cuda.owns(send[0].id)


def test_host_and_cuda_buffer_ids_come_from_one_counter() -> None:
    host = HostMemory()
    driver = FakeDriver()
    r, _ = resolver(driver, host=host)
    ids: list[int] = []
    buffers = []
    for i in range(4):
        buffers.append(host.alloc(64))
        ids.append(resolved(r, buffers[-1].ptr, 64).buffer_id)
        driver.alloc(BASE + i * MIB, MIB, legacy=bool(i % 2))
        ids.append(resolved(r, BASE + i * MIB, 64).buffer_id)
    assert len(set(ids)) == len(ids)
    assert host.next_id() > max(ids)
    assert resolved(r, buffers[0].ptr, 64).kind is MemKind.HOST  # host is looked up first
    for buffer in buffers:
        buffer.close()


def test_without_a_driver_an_unknown_pointer_keeps_the_host_error() -> None:
    asked: list[int] = []

    def no_driver() -> None:
        asked.append(1)

    host = HostMemory()
    r = MemoryResolver(host, driver=no_driver)
    for _ in range(3):
        with pytest.raises(MisuseError, match=r"not in host memory the daemon can open \(allocate it"):
            r.resolve(BASE, 8)
    assert asked == [1]  # asked once, remembered
    assert not r.still_valid([1])
    with host.alloc(16) as buffer:
        with pytest.raises(MisuseError, match="past the end of host buffer"):
            r.resolve(buffer.ptr, 17)
        assert resolved(r, buffer.ptr + 4, 12).offset == 4
    assert asked == [1]


def test_with_a_driver_an_unknown_pointer_names_both_kinds() -> None:
    r, _ = resolver(FakeDriver())
    with pytest.raises(MisuseError, match=r"neither in host memory .* nor in CUDA device memory"):
        r.resolve(BASE, 8)


# ---- the cuda-bindings driver ------------------------------------------------------------


def test_available_driver_is_none_without_cuda_bindings(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "cuda.bindings.driver", None)  # as if not installed: imports fail
    assert available_driver() is None
    with pytest.raises(ImportError):
        BindingsDriver()


class CUresult(enum.IntEnum):
    CUDA_SUCCESS = 0
    CUDA_ERROR_INVALID_VALUE = 1
    CUDA_ERROR_INVALID_CONTEXT = 201
    CUDA_ERROR_NOT_FOUND = 500
    CUDA_ERROR_NOT_SUPPORTED = 801


class Attr(enum.IntEnum):
    CU_POINTER_ATTRIBUTE_MEMORY_TYPE = 2
    CU_POINTER_ATTRIBUTE_BUFFER_ID = 7
    CU_POINTER_ATTRIBUTE_IS_MANAGED = 8
    CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL = 9
    CU_POINTER_ATTRIBUTE_IS_LEGACY_CUDA_IPC_CAPABLE = 10


class FakeHandle:
    """Like `cu.CUipcMemHandle`: no fields, just the address of its 64 bytes."""

    def __init__(self, raw: bytes) -> None:
        self._buf = ctypes.create_string_buffer(raw, 64)

    def getPtr(self) -> int:  # cuda-bindings' name
        return ctypes.addressof(self._buf)


def fake_bindings(allocations: Sequence[FakeAllocation], *, init: Callable[[int], Any] | None = None,
                  managed: bool = False, export_error: int = 0) -> SimpleNamespace:
    """A stand-in for `cuda.bindings.driver`: tuples of (CUresult, values...), as 13.x returns."""
    released: list[int] = []
    ok = CUresult.CUDA_SUCCESS

    def at(ptr: int) -> FakeAllocation | None:
        return next((a for a in allocations if a.base <= ptr < a.base + a.size), None)

    def get_attribute(attr: Attr, ptr: int) -> tuple[Any, Any]:
        a = at(ptr)
        if a is None:
            return CUresult.CUDA_ERROR_INVALID_VALUE, None
        values = {Attr.CU_POINTER_ATTRIBUTE_MEMORY_TYPE: 2, Attr.CU_POINTER_ATTRIBUTE_BUFFER_ID: a.buffer_id,
                  Attr.CU_POINTER_ATTRIBUTE_IS_MANAGED: managed,
                  Attr.CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL: a.device,
                  Attr.CU_POINTER_ATTRIBUTE_IS_LEGACY_CUDA_IPC_CAPABLE: a.legacy}
        return ok, values[attr]

    def address_range(ptr: int) -> tuple[Any, ...]:
        a = at(ptr)
        return (ok, a.base, a.size) if a else (CUresult.CUDA_ERROR_NOT_FOUND, None, None)

    def ipc_handle(base: int) -> tuple[Any, Any]:
        a = at(base)
        if a is None or not a.legacy:
            return CUresult.CUDA_ERROR_INVALID_VALUE, None
        return ok, FakeHandle(bytes(range(64)))

    def retain(ptr: int) -> tuple[Any, Any]:
        a = at(ptr)
        return (ok, 900 + a.buffer_id) if a and not a.legacy else (CUresult.CUDA_ERROR_INVALID_VALUE, None)

    def export(handle: int, kind: int, flags: int) -> tuple[Any, Any]:
        if export_error:
            return CUresult(export_error), None
        return ok, os.memfd_create("fake-export", os.MFD_CLOEXEC)

    def release(handle: int) -> tuple[Any]:
        released.append(handle)
        return (ok,)

    names = {e: (ok, e.name.encode()) for e in CUresult}
    return SimpleNamespace(
        CUresult=CUresult, CUpointer_attribute=Attr,
        CUmemorytype=SimpleNamespace(CU_MEMORYTYPE_DEVICE=2),
        CUmemAllocationHandleType=SimpleNamespace(CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR=1),
        cuInit=init or (lambda flags: (ok,)), cuDeviceGetCount=lambda: (ok, 1),
        cuPointerGetAttribute=get_attribute, cuMemGetAddressRange=address_range,
        cuIpcGetMemHandle=ipc_handle, cuMemRetainAllocationHandle=retain,
        cuMemExportToShareableHandle=export, cuMemRelease=release,
        cuGetErrorName=lambda e: names[e], cuGetErrorString=lambda e: (ok, b"some words"),
        released=released)


def test_bindings_driver_reads_the_driver_tuples() -> None:
    legacy = FakeAllocation(BASE, MIB, 41, 0, True)
    vmm = FakeAllocation(BASE + 2 * MIB, MIB, 42, 1, False)
    cu = fake_bindings([legacy, vmm])
    driver = BindingsDriver(cu)
    assert driver.buffer_id(BASE + 5) == 41 and driver.buffer_id(7) is None
    assert driver.pointer_info(7) is None
    assert driver.pointer_info(BASE + 5) == PointerInfo(BASE, MIB, 41, 0, True)
    assert driver.pointer_info(BASE + 2 * MIB + 1) == PointerInfo(BASE + 2 * MIB, MIB, 42, 1, False)
    assert driver.ipc_handle(BASE) == bytes(range(64))
    fd = driver.export_fd(BASE + 2 * MIB)
    assert is_open(fd) and cu.released == [942]  # the retained handle is released; the fd is ours
    os.close(fd)
    with pytest.raises(MisuseError, match="cuIpcGetMemHandle failed: CUDA_ERROR_INVALID_VALUE: some words"):
        driver.ipc_handle(BASE + 2 * MIB)


def test_bindings_driver_errors_name_the_call() -> None:
    vmm = FakeAllocation(BASE, MIB, 42, 0, False)
    cu = fake_bindings([vmm], export_error=CUresult.CUDA_ERROR_NOT_SUPPORTED)
    with pytest.raises(MisuseError, match=r"cuMemExportToShareableHandle\(POSIX_FILE_DESCRIPTOR\) failed: "
                                          "CUDA_ERROR_NOT_SUPPORTED.*requestedHandleTypes"):
        BindingsDriver(cu).export_fd(BASE)
    assert cu.released == [942]  # released on failure too
    with pytest.raises(MisuseError, match="CUDA managed memory"):
        BindingsDriver(fake_bindings([vmm], managed=True)).pointer_info(BASE)
    cu = fake_bindings([vmm])
    cu.cuMemGetAddressRange = lambda ptr: (CUresult.CUDA_ERROR_INVALID_CONTEXT, None, None)
    with pytest.raises(MisuseError, match=r"cuMemGetAddressRange failed: .*current in this thread"):
        BindingsDriver(cu).pointer_info(BASE)


def test_available_driver_is_none_when_cuinit_cannot_find_a_driver(monkeypatch: pytest.MonkeyPatch) -> None:
    def no_library(flags: int) -> Any:
        raise RuntimeError('"cuda" is an NVIDIA driver library and can only be found via system search')

    monkeypatch.setitem(sys.modules, "cuda.bindings.driver", fake_bindings([], init=no_library))
    assert available_driver() is None
    monkeypatch.setitem(sys.modules, "cuda.bindings.driver",
                        fake_bindings([], init=lambda flags: (CUresult.CUDA_ERROR_NOT_FOUND,)))
    assert available_driver() is None
    monkeypatch.setitem(sys.modules, "cuda.bindings.driver", fake_bindings([]))
    assert isinstance(available_driver(), BindingsDriver)


# ---- DaemonBackend against the real daemon ---------------------------------------------------


def test_host_daemon_refuses_cuda_memory_and_keeps_serving_host_calls(sock: str) -> None:
    driver = FakeDriver()
    driver.alloc(BASE, MIB)
    driver.alloc(BASE + 2 * MIB, MIB, legacy=False)
    before = open_fds()
    with DaemonBackend(sock, world_name("cuda"), 0, 1, timeout=10, cuda_driver=lambda: driver) as comm:
        for ptr, kind in ((BASE, "cuda-ipc"), (BASE + 2 * MIB, "cuda-vmm")):
            for _ in range(2):  # not imported, so tried (and refused) again
                with pytest.raises(MisuseError, match=f"the host engine cannot open {kind} memory"):
                    comm.all_reduce(ptr + 64, 8)
        assert driver.exported and not any(is_open(fd) for fd in driver.exported)
        assert comm.is_healthy()
        with comm._memory.alloc(16) as buffer:  # the same connection still serves host memory
            buffer.view(np.uint16)[:] = 0x3F80  # bf16 1.0
            comm.all_reduce(buffer.ptr, 16)
            assert (buffer.view(np.uint16) == 0x3F80).all()
    assert open_fds() <= before  # no leak (other tests' leftovers may close meanwhile)


class AcceptingCuda(DaemonBackend):
    """Plays the daemon's part for CUDA memory (the host engine refuses it): accepts CUDA
    Imports and records the ops naming them instead of submitting; host traffic goes through."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.sent: list[object] = []
        self.cuda_ids: set[int] = set()
        super().__init__(*args, **kwargs)
        conn = self._conn
        post, request = conn.transport.post, conn.request

        def spy(msg: proto.Message, fds: Sequence[int] = (), deadline: float | None = None) -> None:
            if isinstance(msg, proto.Forget):
                self.sent.append(msg)
            post(msg, fds, deadline)

        def accepting(make: Callable[[int], proto.Request], *, fds: Sequence[int] = (),
                      **kwargs: Any) -> Answer:
            msg = built(lambda: make(conn.transport.next_id()))
            if isinstance(msg, proto.Import) and msg.kind is not MemKind.HOST:
                conn._send_releases(conn.transport)
                assert len(fds) == (1 if msg.kind is MemKind.CUDA_VMM else 0)
                self.sent.append(msg)
                self.cuda_ids.add(msg.buf)
                return Answer(proto.Ok(msg.id), [], conn.link, conn.epoch, conn.engine)
            if isinstance(msg, proto.Submit) and any(
                    isinstance(op, proto.AllReduce) and op.buf and op.buf.buf in self.cuda_ids
                    for op in msg.ops):
                conn._send_releases(conn.transport)
                self.sent.extend(msg.ops)
                return Answer(proto.Ok(msg.id), [], conn.link, conn.epoch, conn.engine)
            return request(lambda _id: msg, fds=fds, **kwargs)

        conn.transport.post = spy  # type: ignore[method-assign]
        # (the backend's own calls ask the connection each time; registrations hold the original)
        conn.request = accepting  # type: ignore[method-assign]


def test_a_cached_op_on_cuda_memory_is_rechecked_every_call(sock: str) -> None:
    driver = FakeDriver()
    first = driver.alloc(BASE, MIB, legacy=False)
    comm = AcceptingCuda(sock, world_name("cuda"), 0, 1, timeout=10, cuda_driver=lambda: driver)
    with comm:
        comm.all_reduce(BASE + 64, 8)
        comm.all_reduce(BASE + 64, 8)
        imports = [m for m in comm.sent if isinstance(m, proto.Import)]
        ops = [m for m in comm.sent if isinstance(m, proto.AllReduce)]
        assert len(imports) == 1 and imports[0].kind is MemKind.CUDA_VMM and imports[0].size == MIB
        assert ops[0] is ops[1] and ops[0].buf == proto.Mem(imports[0].buf, 64)  # the cached op
        assert driver.calls["pointer_info"] == 1 and driver.calls["export_fd"] == 1
        checks = driver.calls["buffer_id"]
        comm.all_reduce(BASE + 64, 8)
        assert driver.calls["buffer_id"] == checks + 1  # one BUFFER_ID query per cached call

        driver.free(BASE)  # the worker frees and the allocator hands out the same address
        driver.alloc(BASE, MIB, legacy=True)
        comm.sent.clear()
        comm.all_reduce(BASE + 64, 8)
        forget, imported, op = comm.sent
        assert forget == proto.Forget((imports[0].buf,))  # before the new Import: the daemon unmaps
        assert isinstance(imported, proto.Import) and imported.kind is MemKind.CUDA_IPC
        assert imported.buf != imports[0].buf and imported.handle != b""
        assert isinstance(op, proto.AllReduce) and op.buf == proto.Mem(imported.buf, 64)
        assert first.buffer_id not in {a.buffer_id for a in driver.allocations.values()}
        with comm._memory.alloc(16) as buffer:  # host calls keep their own cache and path
            comm.all_reduce(buffer.ptr, 16)
            comm.all_reduce(buffer.ptr, 16)
        assert not any(is_open(fd) for fd in driver.exported)


def test_calls_on_device_memory_wait_for_the_workers_stream_first(sock: str) -> None:
    """With an engine without streams (host), the client waits for the stream a call on
    device memory follows: the backend's, an async call's compute stream, each stream of
    a group at group_end."""
    driver = FakeDriver()
    driver.alloc(BASE, MIB)
    comm = AcceptingCuda(sock, world_name("cuda"), 0, 1, timeout=10, cuda_driver=lambda: driver, stream=77)
    with comm:
        driver.log = comm.sent
        comm.all_reduce(BASE, 8)
        comm.all_reduce_async(BASE, 8, 99)
        comm.group_start()
        comm.all_reduce(BASE, 8)
        comm.all_reduce_async(BASE, 8, 5)
        comm.group_end()
        with comm._memory.alloc(16) as buffer:  # host memory has nothing to wait for
            comm.all_reduce(buffer.ptr, 16)
    seen = [m if isinstance(m, tuple) else type(m).__name__ for m in comm.sent
            if isinstance(m, tuple | proto.AllReduce)]
    assert seen == [("synchronize", 77), "AllReduce", ("synchronize", 99), "AllReduce",
                    ("synchronize", 77), ("synchronize", 5), "AllReduce", "AllReduce"]
