// Facts about this process and host that decide which transports reach a peer.
#pragma once

#include <sys/types.h>

#include <cstdint>
#include <string>

namespace mooncake::te {

// Equal for two processes exactly when they are one host to the transports:
// same running kernel (boot id), same pid namespace (one can name the other
// by pid, as cross-memory attach needs) and same network namespace (one set
// of addresses). Same-host transports need it.
std::string hostIdentity();

// The start time of `pid` in clock ticks since boot (field 22 of
// /proc/<pid>/stat), 0 when the process does not exist. A pid with a
// different start time is a different process that reused the number.
uint64_t processStartTicks(pid_t pid);

// Where the memory at `addr` lives: "cuda:<device ordinal>" for GPU memory
// (asked of the CUDA driver, in CUDA builds), else "cpu:<numa node>" of its
// page (node 0 when it cannot be told).
std::string detectMemoryLocation(const void* addr);

// The location a registration records: `requested`, unless it is "*" or
// empty (then detected), or contradicts the memory itself: a GPU pointer
// labeled "cpu:..." or a host pointer labeled "cuda:..." gets the detected
// location, with a warning, since transports choose by it.
std::string resolveMemoryLocation(const void* addr, const std::string& requested);

}  // namespace mooncake::te
