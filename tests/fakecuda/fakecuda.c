/* The C ABI of the CUDA driver and NCCL calls commd makes, over a fake device in Python.
 *
 * Built as libcuda.so.1 and libnccl.so.2 (tests/fakecuda/__init__.py) so that the real
 * cuda-bindings and nccl4py load it in place of the driver and NCCL: commd's
 * BindingsGpu and BindingsDriver then run through the real bindings' argument
 * conversion, output unpacking and enums, which is what can be checked without a GPU.
 * Every function here packs its arguments (pointers as addresses, structs passed by
 * value as the address of the copy) and hands them to one Python dispatcher, which
 * answers from tests/contract/fakegpu.py. The types below are the ABI's, written out
 * rather than taken from cuda.h and nccl.h, which a CI machine need not have; build
 * with -DCOMMD_FAKE_CHECK_HEADERS to have the compiler compare them with the real
 * headers where those exist.
 */
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#ifdef COMMD_FAKE_CHECK_HEADERS
#include <cuda.h>
#else
typedef int CUresult;
typedef int CUdevice;
typedef unsigned long long CUdeviceptr;
typedef unsigned long long CUmemGenericAllocationHandle;
typedef unsigned long long cuuint64_t;
typedef struct CUctx_st *CUcontext;
typedef struct CUstream_st *CUstream;
typedef struct CUevent_st *CUevent;
typedef struct CUmod_st *CUmodule;
typedef struct CUfunc_st *CUfunction;
typedef int CUdevice_attribute;
typedef int CUpointer_attribute;
typedef int CUmemAllocationHandleType;
typedef int CUmemAllocationGranularity_flags;
typedef int CUdriverProcAddressQueryResult;
typedef struct { char reserved[64]; } CUipcMemHandle;
typedef struct { char reserved[64]; } CUipcEventHandle;
typedef struct { char bytes[16]; } CUuuid;
typedef struct CUmemAllocationProp_st CUmemAllocationProp;
typedef struct CUmemAccessDesc_st CUmemAccessDesc;
#endif

typedef struct ncclComm *ncclComm_t;
typedef struct { char internal[128]; } ncclUniqueId;
typedef int ncclResult_t;
typedef int ncclDataType_t;
typedef int ncclRedOp_t;
typedef struct ncclConfig_v_fake ncclConfig_t; /* read by offset in Python */
typedef void *cudaStream_t;

typedef int (*commd_dispatch_t)(const char *name, const uint64_t *args, int nargs);
static commd_dispatch_t dispatch_fn;

void commd_fake_set_dispatch(commd_dispatch_t fn) { dispatch_fn = fn; }

#define U(x) ((uint64_t)(uintptr_t)(x))
#define CALL(name, ...)                                                        \
  do {                                                                         \
    const uint64_t args_[] = {__VA_ARGS__};                                    \
    if (!dispatch_fn) return 3; /* CUDA_ERROR_NOT_INITIALIZED */               \
    return dispatch_fn(name, args_, (int)(sizeof args_ / sizeof args_[0]));    \
  } while (0)
#define CALL0(name)                                                            \
  do {                                                                         \
    if (!dispatch_fn) return 3;                                                \
    return dispatch_fn(name, NULL, 0);                                         \
  } while (0)

/* Messages come back through a per-thread buffer the dispatcher writes into. */
static __thread char text_buf[512];

/* ---- the driver ------------------------------------------------------------------ */
CUresult cuDriverGetVersion(int *version) { *version = 13000; return 0; }
CUresult cuGetErrorString(CUresult error, const char **text) {
  text_buf[0] = 0;
  if (dispatch_fn) dispatch_fn("cuGetErrorString", (const uint64_t[]){U(error), U(text_buf), sizeof text_buf}, 3);
  *text = text_buf;
  return 0;
}
CUresult cuGetErrorName(CUresult error, const char **text) {
  text_buf[0] = 0;
  if (dispatch_fn) dispatch_fn("cuGetErrorName", (const uint64_t[]){U(error), U(text_buf), sizeof text_buf}, 3);
  *text = text_buf;
  return 0;
}
CUresult cuInit(unsigned int flags) { CALL("cuInit", flags); }
CUresult cuDeviceGetCount(int *count) { CALL("cuDeviceGetCount", U(count)); }
CUresult cuDeviceGet(CUdevice *device, int ordinal) { CALL("cuDeviceGet", U(device), (uint64_t)ordinal); }
CUresult cuDeviceGetAttribute(int *value, CUdevice_attribute attribute, CUdevice device) {
  CALL("cuDeviceGetAttribute", U(value), (uint64_t)attribute, (uint64_t)device);
}
CUresult cuDeviceGetUuid_v2(CUuuid *uuid, CUdevice device) { CALL("cuDeviceGetUuid", U(uuid), (uint64_t)device); }
CUresult cuDeviceCanAccessPeer(int *can, CUdevice device, CUdevice peer) {
  CALL("cuDeviceCanAccessPeer", U(can), (uint64_t)device, (uint64_t)peer);
}
CUresult cuDevicePrimaryCtxRetain(CUcontext *ctx, CUdevice device) {
  CALL("cuDevicePrimaryCtxRetain", U(ctx), (uint64_t)device);
}
CUresult cuCtxSetCurrent(CUcontext ctx) { CALL("cuCtxSetCurrent", U(ctx)); }
CUresult cuCtxSynchronize(void) { CALL0("cuCtxSynchronize"); }
CUresult cuCtxGetDevice(CUdevice *device) { CALL("cuCtxGetDevice", U(device)); }
CUresult cuPointerGetAttribute(void *data, CUpointer_attribute attribute, CUdeviceptr ptr) {
  CALL("cuPointerGetAttribute", U(data), (uint64_t)attribute, ptr);
}
CUresult cuMemGetAddressRange_v2(CUdeviceptr *base, size_t *size, CUdeviceptr ptr) {
  CALL("cuMemGetAddressRange", U(base), U(size), ptr);
}
CUresult cuMemAlloc_v2(CUdeviceptr *ptr, size_t nbytes) { CALL("cuMemAlloc", U(ptr), nbytes); }
CUresult cuMemFree_v2(CUdeviceptr ptr) { CALL("cuMemFree", ptr); }
CUresult cuMemcpyHtoD_v2(CUdeviceptr dst, const void *src, size_t nbytes) {
  CALL("cuMemcpyHtoD", dst, U(src), nbytes);
}
CUresult cuMemcpyDtoH_v2(void *dst, CUdeviceptr src, size_t nbytes) {
  CALL("cuMemcpyDtoH", U(dst), src, nbytes);
}
CUresult cuIpcGetMemHandle(CUipcMemHandle *handle, CUdeviceptr ptr) { CALL("cuIpcGetMemHandle", U(handle), ptr); }
CUresult cuIpcOpenMemHandle_v2(CUdeviceptr *ptr, CUipcMemHandle handle, unsigned int flags) {
  CALL("cuIpcOpenMemHandle", U(ptr), U(&handle), flags);
}
CUresult cuIpcCloseMemHandle(CUdeviceptr ptr) { CALL("cuIpcCloseMemHandle", ptr); }
CUresult cuIpcGetEventHandle(CUipcEventHandle *handle, CUevent event) {
  CALL("cuIpcGetEventHandle", U(handle), U(event));
}
CUresult cuIpcOpenEventHandle(CUevent *event, CUipcEventHandle handle) {
  CALL("cuIpcOpenEventHandle", U(event), U(&handle));
}
CUresult cuMemCreate(CUmemGenericAllocationHandle *handle, size_t size, const CUmemAllocationProp *prop,
                     unsigned long long flags) {
  CALL("cuMemCreate", U(handle), size, U(prop), flags);
}
CUresult cuMemRetainAllocationHandle(CUmemGenericAllocationHandle *handle, void *addr) {
  CALL("cuMemRetainAllocationHandle", U(handle), U(addr));
}
CUresult cuMemExportToShareableHandle(void *shareable, CUmemGenericAllocationHandle handle,
                                      CUmemAllocationHandleType type, unsigned long long flags) {
  CALL("cuMemExportToShareableHandle", U(shareable), handle, (uint64_t)type, flags);
}
CUresult cuMemImportFromShareableHandle(CUmemGenericAllocationHandle *handle, void *os_handle,
                                        CUmemAllocationHandleType type) {
  CALL("cuMemImportFromShareableHandle", U(handle), U(os_handle), (uint64_t)type);
}
CUresult cuMemGetAllocationPropertiesFromHandle(CUmemAllocationProp *prop, CUmemGenericAllocationHandle handle) {
  CALL("cuMemGetAllocationPropertiesFromHandle", U(prop), handle);
}
CUresult cuMemGetAllocationGranularity(size_t *granularity, const CUmemAllocationProp *prop,
                                       CUmemAllocationGranularity_flags option) {
  CALL("cuMemGetAllocationGranularity", U(granularity), U(prop), (uint64_t)option);
}
CUresult cuMemAddressReserve(CUdeviceptr *ptr, size_t size, size_t alignment, CUdeviceptr addr,
                             unsigned long long flags) {
  CALL("cuMemAddressReserve", U(ptr), size, alignment, addr, flags);
}
CUresult cuMemAddressFree(CUdeviceptr ptr, size_t size) { CALL("cuMemAddressFree", ptr, size); }
CUresult cuMemMap(CUdeviceptr ptr, size_t size, size_t offset, CUmemGenericAllocationHandle handle,
                  unsigned long long flags) {
  CALL("cuMemMap", ptr, size, offset, handle, flags);
}
CUresult cuMemUnmap(CUdeviceptr ptr, size_t size) { CALL("cuMemUnmap", ptr, size); }
CUresult cuMemSetAccess(CUdeviceptr ptr, size_t size, const CUmemAccessDesc *desc, size_t count) {
  CALL("cuMemSetAccess", ptr, size, U(desc), count);
}
CUresult cuMemRelease(CUmemGenericAllocationHandle handle) { CALL("cuMemRelease", handle); }
CUresult cuStreamCreate(CUstream *stream, unsigned int flags) { CALL("cuStreamCreate", U(stream), flags); }
CUresult cuStreamDestroy_v2(CUstream stream) { CALL("cuStreamDestroy", U(stream)); }
CUresult cuStreamSynchronize(CUstream stream) { CALL("cuStreamSynchronize", U(stream)); }
CUresult cuStreamWaitEvent(CUstream stream, CUevent event, unsigned int flags) {
  CALL("cuStreamWaitEvent", U(stream), U(event), flags);
}
CUresult cuEventCreate(CUevent *event, unsigned int flags) { CALL("cuEventCreate", U(event), flags); }
CUresult cuEventDestroy_v2(CUevent event) { CALL("cuEventDestroy", U(event)); }
CUresult cuEventRecord(CUevent event, CUstream stream) { CALL("cuEventRecord", U(event), U(stream)); }
CUresult cuEventSynchronize(CUevent event) { CALL("cuEventSynchronize", U(event)); }
CUresult cuModuleLoadData(CUmodule *module, const void *image) { CALL("cuModuleLoadData", U(module), U(image)); }
CUresult cuModuleGetFunction(CUfunction *function, CUmodule module, const char *name) {
  CALL("cuModuleGetFunction", U(function), U(module), U(name));
}
CUresult cuLaunchKernel(CUfunction f, unsigned int gx, unsigned int gy, unsigned int gz, unsigned int bx,
                        unsigned int by, unsigned int bz, unsigned int shared, CUstream stream, void **params,
                        void **extra) {
  CALL("cuLaunchKernel", U(f), gx, gy, gz, bx, by, bz, shared, U(stream), U(params), U(extra));
}

/* cuda-bindings finds every driver function through this one (by base name; the version
 * says which ABI it wants, and for the functions above there is one). */
static const struct { const char *name; void *fn; } driver_table[] = {
  {"cuGetErrorString", (void *)cuGetErrorString}, {"cuGetErrorName", (void *)cuGetErrorName},
  {"cuInit", (void *)cuInit}, {"cuDriverGetVersion", (void *)cuDriverGetVersion},
  {"cuDeviceGetCount", (void *)cuDeviceGetCount}, {"cuDeviceGet", (void *)cuDeviceGet},
  {"cuDeviceGetAttribute", (void *)cuDeviceGetAttribute},
  {"cuDevicePrimaryCtxRetain", (void *)cuDevicePrimaryCtxRetain},
  {"cuDeviceCanAccessPeer", (void *)cuDeviceCanAccessPeer},
  {"cuDeviceGetUuid", (void *)cuDeviceGetUuid_v2},
  {"cuCtxSetCurrent", (void *)cuCtxSetCurrent}, {"cuCtxSynchronize", (void *)cuCtxSynchronize},
  {"cuCtxGetDevice", (void *)cuCtxGetDevice},
  {"cuPointerGetAttribute", (void *)cuPointerGetAttribute},
  {"cuMemGetAddressRange", (void *)cuMemGetAddressRange_v2},
  {"cuMemAlloc", (void *)cuMemAlloc_v2}, {"cuMemFree", (void *)cuMemFree_v2},
  {"cuMemcpyHtoD", (void *)cuMemcpyHtoD_v2}, {"cuMemcpyDtoH", (void *)cuMemcpyDtoH_v2},
  {"cuIpcGetMemHandle", (void *)cuIpcGetMemHandle}, {"cuIpcOpenMemHandle", (void *)cuIpcOpenMemHandle_v2},
  {"cuIpcCloseMemHandle", (void *)cuIpcCloseMemHandle}, {"cuIpcGetEventHandle", (void *)cuIpcGetEventHandle},
  {"cuIpcOpenEventHandle", (void *)cuIpcOpenEventHandle}, {"cuMemCreate", (void *)cuMemCreate},
  {"cuMemRetainAllocationHandle", (void *)cuMemRetainAllocationHandle},
  {"cuMemExportToShareableHandle", (void *)cuMemExportToShareableHandle},
  {"cuMemImportFromShareableHandle", (void *)cuMemImportFromShareableHandle},
  {"cuMemGetAllocationPropertiesFromHandle", (void *)cuMemGetAllocationPropertiesFromHandle},
  {"cuMemGetAllocationGranularity", (void *)cuMemGetAllocationGranularity},
  {"cuMemAddressReserve", (void *)cuMemAddressReserve}, {"cuMemAddressFree", (void *)cuMemAddressFree},
  {"cuMemMap", (void *)cuMemMap}, {"cuMemUnmap", (void *)cuMemUnmap},
  {"cuMemSetAccess", (void *)cuMemSetAccess}, {"cuMemRelease", (void *)cuMemRelease},
  {"cuStreamCreate", (void *)cuStreamCreate}, {"cuStreamDestroy", (void *)cuStreamDestroy_v2},
  {"cuStreamSynchronize", (void *)cuStreamSynchronize}, {"cuStreamWaitEvent", (void *)cuStreamWaitEvent},
  {"cuEventCreate", (void *)cuEventCreate}, {"cuEventDestroy", (void *)cuEventDestroy_v2},
  {"cuEventRecord", (void *)cuEventRecord}, {"cuEventSynchronize", (void *)cuEventSynchronize},
  {"cuModuleLoadData", (void *)cuModuleLoadData}, {"cuModuleGetFunction", (void *)cuModuleGetFunction},
  {"cuLaunchKernel", (void *)cuLaunchKernel},
};

CUresult cuGetProcAddress_v2(const char *symbol, void **pfn, int version, cuuint64_t flags,
                             CUdriverProcAddressQueryResult *status) {
  (void)version; (void)flags;
  for (size_t i = 0; i < sizeof driver_table / sizeof driver_table[0]; i++) {
    if (strcmp(driver_table[i].name, symbol) == 0) {
      *pfn = driver_table[i].fn;
      if (status) *status = 0; /* CU_GET_PROC_ADDRESS_SUCCESS */
      return 0;
    }
  }
  *pfn = NULL;
  if (status) *status = 1; /* CU_GET_PROC_ADDRESS_SYMBOL_NOT_FOUND */
  return 500; /* CUDA_ERROR_NOT_FOUND: not a function commd uses */
}

/* ---- NCCL ------------------------------------------------------------------------ */
ncclResult_t ncclGetVersion(int *version) { CALL("ncclGetVersion", U(version)); }
ncclResult_t ncclGetUniqueId(ncclUniqueId *id) { CALL("ncclGetUniqueId", U(id)); }
ncclResult_t ncclCommInitRankConfig(ncclComm_t *comm, int nranks, ncclUniqueId id, int rank,
                                    ncclConfig_t *config) {
  CALL("ncclCommInitRankConfig", U(comm), (uint64_t)nranks, U(&id), (uint64_t)rank, U(config));
}
ncclResult_t ncclCommGetAsyncError(ncclComm_t comm, ncclResult_t *state) {
  CALL("ncclCommGetAsyncError", U(comm), U(state));
}
ncclResult_t ncclCommAbort(ncclComm_t comm) { CALL("ncclCommAbort", U(comm)); }
const char *ncclGetErrorString(ncclResult_t result) {
  text_buf[0] = 0;
  if (dispatch_fn) dispatch_fn("ncclGetErrorString", (const uint64_t[]){U(result), U(text_buf), sizeof text_buf}, 3);
  return text_buf;
}
const char *ncclGetLastError(ncclComm_t comm) {
  text_buf[0] = 0;
  if (dispatch_fn) dispatch_fn("ncclGetLastError", (const uint64_t[]){U(comm), U(text_buf), sizeof text_buf}, 3);
  return text_buf;
}
ncclResult_t ncclGroupStart(void) { CALL0("ncclGroupStart"); }
ncclResult_t ncclGroupEnd(void) { CALL0("ncclGroupEnd"); }
ncclResult_t ncclCommRegister(const ncclComm_t comm, void *buff, size_t size, void **handle) {
  CALL("ncclCommRegister", U(comm), U(buff), size, U(handle));
}
ncclResult_t ncclCommDeregister(const ncclComm_t comm, void *handle) {
  CALL("ncclCommDeregister", U(comm), U(handle));
}
ncclResult_t ncclMemAlloc(void **ptr, size_t size) { CALL("ncclMemAlloc", U(ptr), size); }
ncclResult_t ncclMemFree(void *ptr) { CALL("ncclMemFree", U(ptr)); }
ncclResult_t ncclAllReduce(const void *send, void *recv, size_t count, ncclDataType_t type, ncclRedOp_t op,
                           ncclComm_t comm, cudaStream_t stream) {
  CALL("ncclAllReduce", U(send), U(recv), count, (uint64_t)type, (uint64_t)op, U(comm), U(stream));
}
ncclResult_t ncclAllGather(const void *send, void *recv, size_t count, ncclDataType_t type, ncclComm_t comm,
                           cudaStream_t stream) {
  CALL("ncclAllGather", U(send), U(recv), count, (uint64_t)type, U(comm), U(stream));
}
ncclResult_t ncclReduceScatter(const void *send, void *recv, size_t count, ncclDataType_t type,
                               ncclRedOp_t op, ncclComm_t comm, cudaStream_t stream) {
  CALL("ncclReduceScatter", U(send), U(recv), count, (uint64_t)type, (uint64_t)op, U(comm), U(stream));
}
ncclResult_t ncclBroadcast(const void *send, void *recv, size_t count, ncclDataType_t type, int root,
                           ncclComm_t comm, cudaStream_t stream) {
  CALL("ncclBroadcast", U(send), U(recv), count, (uint64_t)type, (uint64_t)root, U(comm), U(stream));
}
ncclResult_t ncclSend(const void *buf, size_t count, ncclDataType_t type, int peer, ncclComm_t comm,
                      cudaStream_t stream) {
  CALL("ncclSend", U(buf), count, (uint64_t)type, (uint64_t)peer, U(comm), U(stream));
}
ncclResult_t ncclRecv(void *buf, size_t count, ncclDataType_t type, int peer, ncclComm_t comm,
                      cudaStream_t stream) {
  CALL("ncclRecv", U(buf), count, (uint64_t)type, (uint64_t)peer, U(comm), U(stream));
}

/* ---- NVRTC (for the daemon's add kernel) ----------------------------------------- */
typedef int nvrtcResult;
typedef struct _nvrtcProgram *nvrtcProgram;
nvrtcResult nvrtcVersion(int *major, int *minor) { *major = 13; *minor = 0; return 0; }
const char *nvrtcGetErrorString(nvrtcResult result) {
  text_buf[0] = 0;
  if (dispatch_fn) dispatch_fn("nvrtcGetErrorString", (const uint64_t[]){U(result), U(text_buf), sizeof text_buf}, 3);
  return text_buf;
}
nvrtcResult nvrtcCreateProgram(nvrtcProgram *prog, const char *src, const char *name, int num_headers,
                               const char *const *headers, const char *const *include_names) {
  CALL("nvrtcCreateProgram", U(prog), U(src), U(name), (uint64_t)num_headers, U(headers), U(include_names));
}
nvrtcResult nvrtcCompileProgram(nvrtcProgram prog, int num_options, const char *const *options) {
  CALL("nvrtcCompileProgram", U(prog), (uint64_t)num_options, U(options));
}
nvrtcResult nvrtcGetProgramLogSize(nvrtcProgram prog, size_t *size) { CALL("nvrtcGetProgramLogSize", U(prog), U(size)); }
nvrtcResult nvrtcGetProgramLog(nvrtcProgram prog, char *log) { CALL("nvrtcGetProgramLog", U(prog), U(log)); }
nvrtcResult nvrtcGetCUBINSize(nvrtcProgram prog, size_t *size) { CALL("nvrtcGetCUBINSize", U(prog), U(size)); }
nvrtcResult nvrtcGetCUBIN(nvrtcProgram prog, char *cubin) { CALL("nvrtcGetCUBIN", U(prog), U(cubin)); }
nvrtcResult nvrtcDestroyProgram(nvrtcProgram *prog) { CALL("nvrtcDestroyProgram", U(prog)); }
