#include "nccl_library.h"

#include <dlfcn.h>

#include "mooncake/ep/nccl/nccl_rules.h"

namespace mooncake::ep::nccl {
namespace {

// The library torch (or LD_PRELOAD) already loaded; else the loader's search.
void* openLibrary() {
  void* handle = dlopen("libnccl.so.2", RTLD_NOW | RTLD_GLOBAL | RTLD_NOLOAD);
  return handle != nullptr ? handle : dlopen("libnccl.so.2", RTLD_NOW | RTLD_GLOBAL);
}

template <typename F>
bool resolve(void* handle, const char* name, F* out, std::string* missing) {
  *out = reinterpret_cast<F>(dlsym(handle, name));
  if (*out == nullptr) *missing += std::string(missing->empty() ? "" : ", ") + name;
  return *out != nullptr;
}

struct Loaded {
  NcclLibrary library;
  std::string error;
};

Loaded load() {
  Loaded l;
  void* handle = openLibrary();
  if (handle == nullptr) {
    l.error = runtimeVersionProblem(0, NCCL_VERSION_CODE) + " (dlopen: " + dlerror() + ")";
    return l;
  }
  NcclLibrary& n = l.library;
  std::string missing;
  // The version first: a library too old to have the rest is named by its version.
  if (resolve(handle, "ncclGetVersion", &n.getVersion, &missing) && n.getVersion(&n.version) != ncclSuccess) {
    n.version = 0;
  }
  if (std::string why = runtimeVersionProblem(n.version, NCCL_VERSION_CODE); !why.empty()) {
    l.error = why;
    return l;
  }
  resolve(handle, "ncclGetErrorString", &n.getErrorString, &missing);
  resolve(handle, "ncclGetLastError", &n.getLastError, &missing);
  resolve(handle, "ncclGetUniqueId", &n.getUniqueId, &missing);
  resolve(handle, "ncclCommInitRankConfig", &n.commInitRankConfig, &missing);
  resolve(handle, "ncclCommGetAsyncError", &n.commGetAsyncError, &missing);
  resolve(handle, "ncclCommFinalize", &n.commFinalize, &missing);
  resolve(handle, "ncclCommDestroy", &n.commDestroy, &missing);
  resolve(handle, "ncclCommAbort", &n.commAbort, &missing);
  resolve(handle, "ncclAllReduce", &n.allReduce, &missing);
  resolve(handle, "ncclMemAlloc", &n.memAlloc, &missing);
  resolve(handle, "ncclMemFree", &n.memFree, &missing);
  resolve(handle, "ncclCommWindowRegister", &n.commWindowRegister, &missing);
  resolve(handle, "ncclCommWindowDeregister", &n.commWindowDeregister, &missing);
  resolve(handle, "ncclTeamLsa", &n.teamLsa, &missing);
  resolve(handle, "ncclTeamRankToWorld", &n.teamRankToWorld, &missing);
  resolve(handle, "ncclGetLsaDevicePointer", &n.getLsaDevicePointer, &missing);
  if (!missing.empty()) {
    l.error = "the NCCL library " + ncclVersionText(n.version) + " in this process lacks " + missing;
  }
  return l;
}

const Loaded& loaded() {
  static const Loaded l = load();
  return l;
}

}  // namespace

const NcclLibrary* ncclLibrary(std::string* error) {
  const Loaded& l = loaded();
  if (l.error.empty()) return &l.library;
  if (error) *error = l.error;
  return nullptr;
}

int ncclRuntimeVersion() { return loaded().library.version; }

}  // namespace mooncake::ep::nccl
