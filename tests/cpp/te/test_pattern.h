// Deterministic byte patterns and digests shared by the tests and the peer
// program, so that both sides agree on expected contents without sending them.
#pragma once

#include <cstddef>
#include <cstdint>

namespace mooncake::te::testing {

// Fills `n` bytes with a pattern determined by (seed, position): equal seeds
// give equal bytes, and any shift or corruption changes them.
inline void fillPattern(void* dst, size_t n, uint64_t seed) {
  auto* p = static_cast<uint8_t*>(dst);
  uint64_t x = seed * 0x9E3779B97F4A7C15ull + 1;
  for (size_t i = 0; i < n; ++i) {
    x ^= x << 13;
    x ^= x >> 7;
    x ^= x << 17;
    p[i] = static_cast<uint8_t>(x >> 24);
  }
}

// FNV-1a over the bytes.
inline uint64_t digest(const void* src, size_t n) {
  auto* p = static_cast<const uint8_t*>(src);
  uint64_t h = 1469598103934665603ull;
  for (size_t i = 0; i < n; ++i) h = (h ^ p[i]) * 1099511628211ull;
  return h;
}

}  // namespace mooncake::te::testing
