// libFuzzer target: a P2P eager ring slot as a peer may have written it. The
// receiver acts only on a slot whose head and trailing token agree (tryLoad)
// and whose head is well formed; then its payload and token must lie inside
// the slot, or the receiver would read past it.
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <vector>

#include "p2p_slots.h"

using namespace mooncake::pg::p2p;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < 1 + sizeof(EagerHeader)) return 0;
  const uint64_t eager_bytes = 8ull << (data[0] % 14);  // 8 B .. 64 KiB rings
  const size_t stride = eagerSlotStride(eager_bytes);
  std::vector<uint8_t> slot(stride, 0);
  std::memcpy(slot.data(), data + 1, std::min(size - 1, stride));
  EagerHeader head;
  uint64_t expected = 0;
  std::memcpy(&expected, data + 1, sizeof(expected));  // whatever token the input claims
  const auto* shared = reinterpret_cast<const EagerHeader*>(slot.data());
  if (!tryLoad(shared, expected, head) || !wellFormed(head, eager_bytes)) return 0;
  if (kEagerPayloadOffset + head.length + sizeof(uint64_t) > stride) __builtin_trap();
  return 0;
}
