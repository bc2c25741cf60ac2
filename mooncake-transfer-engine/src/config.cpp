#include "mooncake/te/config.h"

#include <algorithm>
#include <cstdlib>
#include <string>

#include "mooncake/te/log.h"

namespace mooncake::te {
namespace {

// Reads a positive number from the environment; malformed values are reported
// and ignored rather than silently turned into zero.
bool readNumber(const char* name, double& out) {
  const char* text = std::getenv(name);
  if (text == nullptr || *text == '\0') return false;
  char* end = nullptr;
  double value = std::strtod(text, &end);
  if (end == text || *end != '\0' || !(value > 0)) {
    MC_LOG(Warning) << name << "='" << text << "' is not a positive number; using the default";
    return false;
  }
  out = value;
  return true;
}

std::chrono::milliseconds secondsToMs(double seconds) {
  return std::chrono::milliseconds(static_cast<int64_t>(seconds * 1000.0));
}

}  // namespace

EngineConfig EngineConfig::fromEnvironment() {
  EngineConfig c;
  double v = 0;
  if (readNumber("MC_MIN_RPC_PORT", v) && v < 65536) c.min_rpc_port = static_cast<uint16_t>(v);
  if (readNumber("MC_MAX_RPC_PORT", v) && v < 65536) c.max_rpc_port = static_cast<uint16_t>(v);
  if (c.max_rpc_port < c.min_rpc_port) {
    MC_LOG(Warning) << "MC_MAX_RPC_PORT < MC_MIN_RPC_PORT; using " << c.min_rpc_port << " for both";
    c.max_rpc_port = c.min_rpc_port;
  }
  if (readNumber("MC_TRANSFER_TIMEOUT", v)) c.transfer_timeout = secondsToMs(v);
  if (readNumber("MC_HANDSHAKE_CONNECT_TIMEOUT", v)) c.connect_timeout = secondsToMs(v);
  // Handshakes (descriptor fetch, probe, notify) are bounded like transfers
  // unless told otherwise, so a stalled peer costs one timeout, not a longer one.
  if (readNumber("MC_RPC_TIMEOUT", v)) {
    c.rpc_timeout = secondsToMs(v);
  } else {
    c.rpc_timeout = std::min(c.rpc_timeout, c.transfer_timeout);
  }
  if (readNumber("MC_HANDSHAKE_MAX_LENGTH", v)) c.max_rpc_message = static_cast<size_t>(v);
  if (readNumber("MC_TCP_SLICE_SIZE", v)) c.tcp_slice_size = static_cast<size_t>(v);
  if (readNumber("MC_TCP_WORKERS", v)) c.tcp_workers = static_cast<int>(v);
  if (readNumber("MC_RDMA_SLICE_SIZE", v)) c.rdma_slice_size = static_cast<size_t>(v);
  if (readNumber("MC_MAX_WR", v)) c.rdma_max_wr = static_cast<int>(v);
  if (const char* text = std::getenv("MC_GID_INDEX"); text != nullptr && *text != '\0') {
    char* end = nullptr;
    const long index = std::strtol(text, &end, 10);  // 0 is a valid index: not readNumber
    if (*end == '\0' && index >= 0 && index < 256) {
      c.rdma_gid_index = static_cast<int>(index);
    } else {
      MC_LOG(Warning) << "MC_GID_INDEX='" << text << "' is not a GID index (0-255); choosing per port";
    }
  }
  if (readNumber("MC_SHM_CHUNK_SIZE", v)) c.shm_chunk_size = static_cast<size_t>(v);
  auto flag = [](const char* name) {
    const char* text = std::getenv(name);
    return text != nullptr && *text != '\0' && std::string(text) != "0";
  };
  c.force_tcp = flag("MC_FORCE_TCP");
  c.listen_all = flag("MC_LISTEN_ALL");
  if (const char* secret = std::getenv("MC_TE_AUTH_SECRET")) c.auth_secret = secret;
  return c;
}

}  // namespace mooncake::te
