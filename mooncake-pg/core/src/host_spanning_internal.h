// Pieces shared by the two files of HostSpanningGroup.
#pragma once

#include <cstring>
#include <vector>

#include "p2p_exchange.h"
#include "scratch.h"
#include "shm_group_internal.h"

namespace mooncake::pg {

// The leaders' one exchange of whole buffers goes in segments of at least
// this size (and at most kMaxFoldSegments of them), each folded as soon as
// it is in; the two-host halves go in pieces of the same sizes.
constexpr size_t kFoldSegmentBytes = 512 * 1024;
constexpr size_t kMaxFoldSegments = 16;

// One P2P tag per collective kind: ranks that disagree on the operation do
// not pair their messages.
inline int tagOf(OpCode op) { return 0x4d430000 | static_cast<int>(op); }

// Whether `ranks` (ascending) is r, r+1, ..., so their blocks are adjacent.
inline bool isConsecutive(const std::vector<int>& ranks) {
  return ranks.back() - ranks.front() + 1 == static_cast<int>(ranks.size());
}

// packed holds one block per rank of `ranks`, in that order; block i goes to
// out + ranks[i] * bytes (and gatherBlocks is the reverse).
inline void scatterBlocks(const char* packed, const std::vector<int>& ranks, size_t bytes, char* out) {
  for (size_t i = 0; i < ranks.size(); ++i) std::memcpy(out + ranks[i] * bytes, packed + i * bytes, bytes);
}
inline void gatherBlocks(const char* in, const std::vector<int>& ranks, size_t bytes, char* packed) {
  for (size_t i = 0; i < ranks.size(); ++i) std::memcpy(packed + i * bytes, in + ranks[i] * bytes, bytes);
}

}  // namespace mooncake::pg
