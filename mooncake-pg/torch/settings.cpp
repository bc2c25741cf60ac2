#include "settings.h"

#include <c10/util/Exception.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>

#include "mooncake/te/transfer_engine.h"

namespace mooncake::pg {

PgSettings& settings() {
  static PgSettings s;
  return s;
}

size_t envBytes(const char* name, size_t fallback, size_t minimum) {
  const char* text = std::getenv(name);
  if (text == nullptr || *text == '\0') return fallback;
  char* end = nullptr;
  errno = 0;
  const unsigned long long v = std::strtoull(text, &end, 10);
  // strtoull takes a sign (and wraps a negative value) after any blanks: digits only.
  const bool digits = end != text && *end == '\0' && std::strchr(text, '-') == nullptr && errno != ERANGE;
  TORCH_CHECK_VALUE(digits && v >= minimum, name, " must be a number of bytes >= ", minimum, ", got '", text, "'");
  return static_cast<size_t>(v);
}

te::TransferEngine* pgTransferEngine(std::string* error) {
  PgSettings& s = settings();
  std::lock_guard lock(s.mutex);
  if (s.transfer_engine_ptr != 0) return reinterpret_cast<te::TransferEngine*>(s.transfer_engine_ptr);
  // Never destroyed: groups, their progress threads and peers may use it up
  // to the very end of the process.
  static te::TransferEngine* owned = nullptr;
  if (owned == nullptr) {
    auto* engine = new te::TransferEngine();
    if (engine->init("P2PHANDSHAKE", s.host_ip) != te::kOk) {
      delete engine;
      if (error) *error = "cannot start the transfer engine on host " + s.host_ip + " (see MC_LOG_LEVEL=INFO)";
      return nullptr;
    }
    owned = engine;
  }
  return owned;
}

}  // namespace mooncake::pg
