#include "settings.h"

#include "mooncake/te/transfer_engine.h"

namespace mooncake::pg {

PgSettings& settings() {
  static PgSettings s;
  return s;
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
