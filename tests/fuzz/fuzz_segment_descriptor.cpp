// libFuzzer target: the transfer engine's segment descriptor codec (what an
// engine decodes from a peer's handshake reply). A decoded descriptor must
// encode and decode back to itself.
#include <cstddef>
#include <cstdint>
#include <string>

#include "mooncake/te/segment_descriptor.h"
#include "mooncake/te/status.h"

using namespace mooncake::te;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string bytes(reinterpret_cast<const char*>(data), size);
  SegmentDescriptor d;
  if (SegmentDescriptor::decode(bytes, d) != kOk) return 0;
  const std::string again = d.encode();
  SegmentDescriptor round;
  if (SegmentDescriptor::decode(again, round) != kOk || round.encode() != again) __builtin_trap();
  return 0;
}
