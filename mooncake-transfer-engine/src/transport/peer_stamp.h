// Freshness of a same-host peer's descriptor, checked without asking the
// peer: it publishes the address of its SegmentStamp (segment_descriptor.h),
// and a 16-byte cross-memory read of it tells whether the descriptor we
// cached is still current. Used by the transports that move bytes without
// the target's participation (shm, cuda_ipc).
#pragma once

#include <cstdint>

#include "mooncake/te/transport.h"

namespace mooncake::te {

// Reads the stamp at `addr` in process `pid`. kOk; kPeerUnreachable when the
// process is gone; kEndpointError when the kernel does not let us read it
// (another user, YAMA); kAddressNotRegistered when nothing is mapped there.
int readPeerStamp(int pid, uint64_t addr, SegmentStamp& stamp);

// kOk when the cached descriptor of `peer` (process `pid`) matches its
// stamp, after at most one refresh; otherwise the error that prevents it
// (a descriptor still inconsistent right after a refresh is refused: the
// peer's registrations are changing under us, or its engine went away).
int checkDescriptorFresh(PeerSegment& peer, int pid);

}  // namespace mooncake::te
