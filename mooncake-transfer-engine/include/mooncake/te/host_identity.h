// Facts about this process and host that decide which transports reach a peer.
#pragma once

#include <sys/types.h>

#include <cstdint>
#include <string>

namespace mooncake::te {

// Equal for two processes exactly when one can name the other by pid: same
// running kernel (boot id) and same pid namespace. Same-host transports need it.
std::string hostIdentity();

// The start time of `pid` in clock ticks since boot (field 22 of
// /proc/<pid>/stat), 0 when the process does not exist. A pid with a
// different start time is a different process that reused the number.
uint64_t processStartTicks(pid_t pid);

// "cpu:<numa node>" of the page at `addr` (0 when it cannot be told).
std::string detectMemoryLocation(const void* addr);

}  // namespace mooncake::te
