#include "settings.h"

#include <c10/util/Exception.h>
#include <c10/util/Logging.h>

#include <arpa/inet.h>
#include <netdb.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>

#include <torch/csrc/distributed/c10d/PrefixStore.hpp>

#include "mooncake/te/auth.h"
#include "mooncake/te/transfer_engine.h"

namespace mooncake::pg {

PgSettings& settings() {
  static PgSettings s;
  return s;
}

namespace {

// The local address the kernel would send from to reach `host` (a UDP
// "connect" sends nothing), "" when it cannot tell.
std::string localAddressToward(const std::string& host) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_DGRAM;
  addrinfo* found = nullptr;
  if (::getaddrinfo(host.c_str(), "9", &hints, &found) != 0 || found == nullptr) return {};
  std::string out;
  for (addrinfo* a = found; a != nullptr && out.empty(); a = a->ai_next) {
    int fd = ::socket(a->ai_family, a->ai_socktype, 0);
    if (fd < 0) continue;
    sockaddr_storage local{};
    socklen_t len = sizeof(local);
    char text[INET6_ADDRSTRLEN] = {};
    if (::connect(fd, a->ai_addr, a->ai_addrlen) == 0 &&
        ::getsockname(fd, reinterpret_cast<sockaddr*>(&local), &len) == 0) {
      const void* raw = local.ss_family == AF_INET6 ? static_cast<const void*>(&reinterpret_cast<sockaddr_in6*>(&local)->sin6_addr)
                                                    : static_cast<const void*>(&reinterpret_cast<sockaddr_in*>(&local)->sin_addr);
      if (::inet_ntop(local.ss_family, raw, text, sizeof(text)) != nullptr) out = text;
    }
    ::close(fd);
  }
  ::freeaddrinfo(found);
  return out;
}

std::string chooseHostIp() {
  const char* bind = std::getenv("MC_TCP_BIND_ADDRESS");
  if (bind != nullptr && *bind != '\0') return bind;
  const char* master = std::getenv("MASTER_ADDR");
  if (master != nullptr && *master != '\0') {
    std::string toward = localAddressToward(master);
    if (!toward.empty()) return toward;
  }
  return "127.0.0.1";
}

}  // namespace

std::string hostIp() {
  PgSettings& s = settings();
  std::lock_guard lock(s.mutex);
  if (s.host_ip.empty()) {
    // An engine given to set_transfer_engine is reached at its own host.
    s.host_ip = s.transfer_engine_ptr != 0 ? reinterpret_cast<te::TransferEngine*>(s.transfer_engine_ptr)->localHost()
                                           : chooseHostIp();
  }
  return s.host_ip;
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

c10::intrusive_ptr<c10d::Store> rootStore(c10::intrusive_ptr<c10d::Store> store) {
  while (auto* prefixed = dynamic_cast<c10d::PrefixStore*>(store.get())) store = prefixed->getUnderlyingStore();
  return store;
}

std::string jobSecret(const c10::intrusive_ptr<c10d::Store>& store) {
  const char* own = std::getenv("MC_TE_AUTH_SECRET");
  if (own != nullptr && *own != '\0') return own;
  if (!te::auth::available() || !store) return "";
  PgSettings& s = settings();
  std::vector<uint8_t> proposal;
  {
    // A process whose engine runs already proposes the secret it has.
    std::lock_guard lock(s.mutex);
    proposal.assign(s.engine_secret.begin(), s.engine_secret.end());
  }
  if (proposal.empty()) {
    te::auth::Nonce draw{};
    if (!te::auth::randomNonce(draw)) return "";
    static const char* kHex = "0123456789abcdef";
    for (uint8_t b : draw) {
      proposal.push_back(static_cast<uint8_t>(kHex[b >> 4]));
      proposal.push_back(static_cast<uint8_t>(kHex[b & 15]));
    }
  }
  try {
    // The first proposal wins; everyone reads the winner.
    std::vector<uint8_t> agreed = rootStore(store)->compareSet("mooncake/job_secret", {}, proposal);
    return std::string(agreed.begin(), agreed.end());
  } catch (const std::exception& e) {
    LOG(WARNING) << "mooncake: the store cannot share a secret (" << e.what()
                 << "); this job's connections are not authenticated (docs/security.md)";
    return "";
  }
}

te::TransferEngine* pgTransferEngine(std::string* error, const std::string& secret) {
  const std::string host = hostIp();
  PgSettings& s = settings();
  std::lock_guard lock(s.mutex);
  if (s.transfer_engine_ptr != 0) return reinterpret_cast<te::TransferEngine*>(s.transfer_engine_ptr);
  // Never destroyed: groups, their progress threads and peers may use it up
  // to the very end of the process.
  static te::TransferEngine* owned = nullptr;
  if (owned == nullptr) {
    auto* engine = new te::TransferEngine();
    te::EngineConfig config = te::EngineConfig::fromEnvironment();
    config.auth_secret = secret;
    // set_device_filter: the RDMA devices the engine may open ("" = all).
    std::string devices;
    for (const std::string& name : s.device_filter) devices += (devices.empty() ? "" : ",") + name;
    if (engine->init("P2PHANDSHAKE", host, "", devices, config) != te::kOk) {
      delete engine;
      if (error) *error = "cannot start the transfer engine on host " + host + " (see MC_LOG_LEVEL=INFO)";
      return nullptr;
    }
    owned = engine;
    s.engine_secret = secret;
  } else if (secret != s.engine_secret) {
    LOG(WARNING) << "mooncake: this process's transfer engine was started for another job (another secret): "
                 << "its connections with this job's processes will be refused";
  }
  return owned;
}

}  // namespace mooncake::pg
