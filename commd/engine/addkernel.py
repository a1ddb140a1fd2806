"""The daemon's own bf16 add kernel (the 2-rank add path of set_add_kernel): its CUDA
source, and NVRTC compiling it to a cubin for one GPU architecture."""

from __future__ import annotations

from typing import Any

from .gpu import GpuError

# dst[i] += src[i] in bf16, from the bits: widen both to f32 (exact), add in f32, round
# the sum to nearest even. That is __hadd's arithmetic and, for two operands, the host
# engine's and NCCL's sum exactly; written without cuda_bf16.h so that NVRTC needs no
# CUDA headers on the machine. tests/unit/test_add_kernel.py runs this same source on
# the CPU against the host engine's reference.
ADD_BF16_SOURCE = b"""
__device__ static unsigned short commd_bf16_add(unsigned short a, unsigned short b) {
  float sum = __uint_as_float((unsigned)a << 16) + __uint_as_float((unsigned)b << 16);
  unsigned bits = __float_as_uint(sum);
  if ((bits & 0x7fffffffu) > 0x7f800000u) return (unsigned short)((bits >> 16) | 0x40u); /* NaN */
  return (unsigned short)((bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16);
}

extern "C" __global__ void commd_add_bf16(unsigned short* dst, const unsigned short* src,
                                          unsigned long long n) {
  unsigned long long stride = (unsigned long long)gridDim.x * blockDim.x;
  for (unsigned long long i = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x; i < n;
       i += stride)
    dst[i] = commd_bf16_add(dst[i], src[i]);
}
"""


def compile_add_bf16(major: int, minor: int) -> bytes:
    """The add kernel as a cubin for compute capability major.minor (NVRTC, no GPU needed)."""
    from cuda.bindings import nvrtc

    options = [f"--gpu-architecture=sm_{major}{minor}".encode()]

    def ok(result: tuple[Any, ...], call: str) -> Any:
        if result[0] != nvrtc.nvrtcResult.NVRTC_SUCCESS:
            raise GpuError(f"{call}: {result[0]}")
        return result[1] if len(result) == 2 else None

    program = ok(nvrtc.nvrtcCreateProgram(ADD_BF16_SOURCE, b"commd_add_bf16.cu", 0, [], []),
                 "nvrtcCreateProgram")
    try:
        compiled = nvrtc.nvrtcCompileProgram(program, len(options), options)[0]
        if compiled != nvrtc.nvrtcResult.NVRTC_SUCCESS:
            size = ok(nvrtc.nvrtcGetProgramLogSize(program), "nvrtcGetProgramLogSize")
            # Writable buffers: filling `b" " * size` in place, as NVRTC's samples do,
            # overwrites CPython's shared one-byte b" " when the log is empty (size 1).
            text = bytearray(size)
            nvrtc.nvrtcGetProgramLog(program, text)
            log = text.rstrip(b"\0").decode(errors="replace")
            raise GpuError(f"NVRTC could not compile the add kernel: {log or compiled}")
        size = ok(nvrtc.nvrtcGetCUBINSize(program), "nvrtcGetCUBINSize")
        cubin = bytearray(size)
        ok(nvrtc.nvrtcGetCUBIN(program, cubin), "nvrtcGetCUBIN")
    finally:
        nvrtc.nvrtcDestroyProgram(program)
    return bytes(cubin)
