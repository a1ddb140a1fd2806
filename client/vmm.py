"""A CUDA VMM allocation shared as a POSIX fd, mapped into this process: what a worker does
with the daemon's symmetric memory, and the daemon with a worker's VMM buffer.

Over cuda-bindings' driver API (`cu` is `cuda.bindings.driver`); each side passes its own
`check`, which turns a failed call into its own error type."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

Check = Callable[[str, tuple[Any, ...]], Any]  # (call, its result) -> its value; raises on an error


def map_fd(cu: Any, fd: int, check: Check, size_for: Callable[[Any], int],
           devices_for: Callable[[int], Sequence[int]]) -> tuple[int, int, int]:
    """Import `fd` (not consumed), reserve `size_for(properties)` bytes of address space, map
    the allocation there and open it read-write to `devices_for(owner)`. Returns the
    pointer, the size mapped and the owning device; undone if any step fails. The handle
    is released at once: the mapping keeps the memory."""
    kind = cu.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
    handle = check("cuMemImportFromShareableHandle", cu.cuMemImportFromShareableHandle(fd, kind))
    try:
        prop = check("cuMemGetAllocationPropertiesFromHandle",
                     cu.cuMemGetAllocationPropertiesFromHandle(handle))
        owner = int(prop.location.id)
        size = size_for(prop)
        va = check("cuMemAddressReserve", cu.cuMemAddressReserve(size, 0, 0, 0))
        mapped = False
        try:
            check("cuMemMap", cu.cuMemMap(va, size, 0, handle, 0))
            mapped = True
            access = [_read_write(cu, device) for device in devices_for(owner)]
            check("cuMemSetAccess", cu.cuMemSetAccess(va, size, access, len(access)))
        except BaseException:
            if mapped:
                cu.cuMemUnmap(va, size)
            cu.cuMemAddressFree(va, size)
            raise
    finally:
        cu.cuMemRelease(handle)
    return int(va), size, owner


def _read_write(cu: Any, device: int) -> Any:
    desc = cu.CUmemAccessDesc()
    desc.location.type = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
    desc.location.id = device
    desc.flags = cu.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
    return desc
