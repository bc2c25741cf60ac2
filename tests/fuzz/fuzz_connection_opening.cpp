// libFuzzer target: what an engine or a Coordinator with a secret runs on the
// first bytes of every connection (te/auth_opening.h), and the engine's
// notify request decoder. Arbitrary bytes must never be accepted as a proof:
// the fuzzer does not know the secret.
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "mooncake/te/auth_opening.h"
#include "wire.h"

using namespace mooncake::te;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size == 0) return 0;
  const size_t chunk = 1 + data[0] % 48;
  auth::ServerOpening opening("a secret the input cannot know");
  std::vector<uint8_t> out;
  for (size_t at = 1; at < size; at += chunk) {
    auto step = opening.feed(data + at, std::min(chunk, size - at), out);
    if (step == auth::ServerOpening::Step::kRefused) break;
    if (step == auth::ServerOpening::Step::kDone) __builtin_trap();  // a proof without the secret
    if (step == auth::ServerOpening::Step::kReply && out.size() != auth::kReplyBytes) __builtin_trap();
  }
  // The notify request: two length-prefixed strings, nothing after.
  const std::string request(reinterpret_cast<const char*>(data), size);
  wire::Reader reader(request);
  std::string name, message;
  if (reader.str(name) && reader.str(message) && reader.done() && name.size() + message.size() + 8 != size) {
    __builtin_trap();
  }
  return 0;
}
