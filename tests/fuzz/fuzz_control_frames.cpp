// libFuzzer target: the control plane's frame decoder (what a Coordinator or
// an Agent runs on every byte a peer sends). The first input byte picks the
// chunk size the stream is fed in, so frames split at every boundary; every
// decoded message must encode back to a frame that decodes to the same bytes.
#include <cstddef>
#include <cstdint>
#include <vector>

#include "control/protocol.h"

using namespace mooncake::pg::control;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size == 0) return 0;
  const size_t chunk = 1 + data[0] % 64;
  FrameDecoder decoder;
  for (size_t at = 1; at < size; at += chunk) {
    decoder.append(data + at, std::min(chunk, size - at));
    for (;;) {
      Message message;
      std::string error;
      DecodeResult result = decoder.next(&message, &error);
      if (result == DecodeResult::kNeedMore) break;
      if (result == DecodeResult::kError) return 0;  // a peer is dropped at its first malformed frame
      const std::vector<uint8_t> again = encodeFrame(message);
      FrameDecoder check;
      check.append(again.data(), again.size());
      Message round;
      if (check.next(&round, &error) != DecodeResult::kFrame || encodeFrame(round) != again) __builtin_trap();
    }
  }
  return 0;
}
