#include "cuda/cuda_driver.h"

#include <cuda.h>
#include <cuda_runtime_api.h>
#include <dlfcn.h>
#include <unistd.h>

namespace mooncake::te::cuda {
namespace {

struct Driver {
  CUresult (*init)(unsigned int) = nullptr;
  CUresult (*pointerGetAttributes)(unsigned int, CUpointer_attribute*, void**, CUdeviceptr) = nullptr;
  CUresult (*memGetAddressRange)(CUdeviceptr*, size_t*, CUdeviceptr) = nullptr;
  CUresult (*ctxGetCurrent)(CUcontext*) = nullptr;
  CUresult (*ctxSetCurrent)(CUcontext) = nullptr;
  // Optional (CUDA 11.7+): exporting GPU memory as a dma-buf.
  CUresult (*memGetHandleForAddressRange)(void*, CUdeviceptr, size_t, CUmemRangeHandleType,
                                          unsigned long long) = nullptr;
};

template <typename Fn>
bool load(void* library, const char* symbol, Fn& out) {
  out = reinterpret_cast<Fn>(::dlsym(library, symbol));
  return out != nullptr;
}

// Null when there is no usable driver. Loaded once; never unloaded.
const Driver* driver() {
  static const Driver* loaded = []() -> const Driver* {
    void* library = ::dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
    if (library == nullptr) return nullptr;
    static Driver d;
    bool complete = load(library, "cuInit", d.init) &&
                    load(library, "cuPointerGetAttributes", d.pointerGetAttributes) &&
                    load(library, "cuMemGetAddressRange_v2", d.memGetAddressRange) &&
                    load(library, "cuCtxGetCurrent", d.ctxGetCurrent) &&
                    load(library, "cuCtxSetCurrent", d.ctxSetCurrent);
    if (!complete || d.init(0) != CUDA_SUCCESS) return nullptr;
    load(library, "cuMemGetHandleForAddressRange", d.memGetHandleForAddressRange);
    return &d;
  }();
  return loaded;
}

}  // namespace

int deviceOfPointer(const void* ptr) {
  const Driver* d = driver();
  if (d == nullptr || ptr == nullptr) return -1;
  // The plural query reports unknown (host) pointers as type 0 instead of
  // failing, and needs no current context.
  unsigned int type = 0;
  int ordinal = -1;
  CUpointer_attribute attributes[] = {CU_POINTER_ATTRIBUTE_MEMORY_TYPE, CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL};
  void* values[] = {&type, &ordinal};
  if (d->pointerGetAttributes(2, attributes, values, reinterpret_cast<CUdeviceptr>(ptr)) != CUDA_SUCCESS) return -1;
  return type == CU_MEMORYTYPE_DEVICE ? ordinal : -1;
}

bool allocationRange(const void* ptr, uint64_t& base, uint64_t& size) {
  const Driver* d = driver();
  if (d == nullptr) return false;
  CUdeviceptr b = 0;
  size_t s = 0;
  if (d->memGetAddressRange(&b, &s, reinterpret_cast<CUdeviceptr>(ptr)) != CUDA_SUCCESS) return false;
  base = static_cast<uint64_t>(b);
  size = static_cast<uint64_t>(s);
  return true;
}

bool exportDmabuf(const void* ptr, size_t length, int& fd, uint64_t& offset) {
  const Driver* d = driver();
  if (d == nullptr || d->memGetHandleForAddressRange == nullptr || length == 0) return false;
  // The exported range must start and end on host page boundaries.
  const uint64_t page = static_cast<uint64_t>(::sysconf(_SC_PAGESIZE));
  const uint64_t begin = reinterpret_cast<uint64_t>(ptr) & ~(page - 1);
  const uint64_t end = (reinterpret_cast<uint64_t>(ptr) + length + page - 1) & ~(page - 1);
  int handle = -1;
  if (d->memGetHandleForAddressRange(&handle, static_cast<CUdeviceptr>(begin), static_cast<size_t>(end - begin),
                                     CU_MEM_RANGE_HANDLE_TYPE_DMA_BUF_FD, 0) != CUDA_SUCCESS) {
    return false;
  }
  fd = handle;
  offset = reinterpret_cast<uint64_t>(ptr) - begin;
  return true;
}

DeviceScope::DeviceScope(int device) {
  const Driver* d = driver();
  if (d == nullptr) return;
  CUcontext current = nullptr;
  d->ctxGetCurrent(&current);
  saved_ = current;
  ok_ = cudaSetDevice(device) == cudaSuccess;
}

DeviceScope::~DeviceScope() {
  const Driver* d = driver();
  if (d == nullptr) return;
  CUcontext current = nullptr;
  d->ctxGetCurrent(&current);
  if (current != static_cast<CUcontext>(saved_)) d->ctxSetCurrent(static_cast<CUcontext>(saved_));
}

}  // namespace mooncake::te::cuda
