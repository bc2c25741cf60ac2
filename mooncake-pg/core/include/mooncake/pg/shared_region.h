// A POSIX shared-memory object that one process of a host creates and the
// others attach to by name: the rendezvous under every per-host arena
// (ShmArena, the CUDA control block).
#pragma once

#include <chrono>
#include <cstddef>
#include <string>

namespace mooncake::pg {

// The creator makes `name` (exclusively) of `bytes` zeroed bytes; the others
// retry until it exists with exactly that size, or `deadline` passes (then
// *error says the creator did not make `what` in time). Returns the shared
// mapping, or nullptr with *error set; a creator that fails unlinks the name.
void* mapSharedRegion(const std::string& name, bool create, size_t bytes,
                      std::chrono::steady_clock::time_point deadline, const std::string& what, std::string* error);

}  // namespace mooncake::pg
