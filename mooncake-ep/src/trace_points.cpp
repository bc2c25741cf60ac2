// The host side of mooncake/ep/cuda/trace.h: one buffer of stamps per
// process, which every kernel unit built with MOONCAKE_EP_TRACE points at.
#include <cuda_runtime_api.h>

#include <cstring>
#include <iterator>
#include <mutex>

#include "mooncake/ep/cuda/trace.h"

namespace mooncake::ep::cuda::trace {

namespace {
constexpr const char* kNames[] = {"layout start",  "layout end",  "rows start", "rows sent",
                                  "layout waited", "signalled",   "wait start", "heard",
                                  "laid out",      "handed over", "copied",     "rows end"};
static_assert(std::size(kNames) == kPoints, "a name for each Point, in order");
}  // namespace

#ifdef MOONCAKE_EP_TRACE
Stamps* stampsBuffer() {
  static std::once_flag once;
  static Stamps* buffer = nullptr;
  std::call_once(once, [] {
    void* p = nullptr;
    if (cudaMalloc(&p, sizeof(Stamps)) == cudaSuccess) buffer = static_cast<Stamps*>(p);
  });
  return buffer;
}

bool enabled() { return true; }

bool reset() {
  Stamps* buffer = stampsBuffer();
  if (buffer == nullptr) return false;
  Stamps cleared;
  std::memset(cleared.first, 0xff, sizeof cleared.first);
  std::memset(cleared.last, 0, sizeof cleared.last);
  return cudaMemcpy(buffer, &cleared, sizeof cleared, cudaMemcpyHostToDevice) == cudaSuccess;
}

bool read(Stamps* out) {
  Stamps* buffer = stampsBuffer();
  return buffer != nullptr && cudaMemcpy(out, buffer, sizeof *out, cudaMemcpyDeviceToHost) == cudaSuccess;
}
#else
bool enabled() { return false; }
bool reset() { return false; }
bool read(Stamps*) { return false; }
#endif

std::vector<std::string> pointNames() { return {std::begin(kNames), std::end(kNames)}; }

}  // namespace mooncake::ep::cuda::trace
