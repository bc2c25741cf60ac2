#include "mooncake/te/auth.h"

#include <atomic>
#include <chrono>
#include <cstdlib>
#include <string>
#include <thread>

#if MOONCAKE_WITH_OPENSSL
#include <openssl/crypto.h>
#include <openssl/evp.h>
#include <openssl/hmac.h>
#include <openssl/rand.h>
#endif

namespace mooncake::te::auth {

#if MOONCAKE_WITH_OPENSSL
namespace {

// OpenSSL frees its global state in an atexit handler, while threads of
// ours (an Agent failing over as the job ends, a connection's opening) may
// still be computing: that crashed processes at exit. Our own handler,
// registered after OpenSSL's and so run before it, stops new computations
// and waits (briefly) for those in flight; later ones fail, and the peer is
// refused, which at exit is harmless.
std::atomic<bool> exiting{false};
std::atomic<int> in_flight{0};

void stopAtExit() {
  exiting.store(true);
  for (int i = 0; i < 200 && in_flight.load() > 0; ++i) std::this_thread::sleep_for(std::chrono::milliseconds(1));
}

class CryptoUse {
 public:
  CryptoUse() {
    static const bool registered = [] {
      OPENSSL_init_crypto(0, nullptr);  // OpenSSL's atexit first, so that ours runs before it
      return std::atexit(stopAtExit) == 0;
    }();
    (void)registered;
    in_flight.fetch_add(1);
    ok_ = !exiting.load();
  }
  ~CryptoUse() { in_flight.fetch_sub(1); }
  bool ok() const { return ok_; }

 private:
  bool ok_ = false;
};

}  // namespace

bool available() { return true; }

bool randomNonce(Nonce& out) {
  CryptoUse use;
  return use.ok() && RAND_bytes(out.data(), static_cast<int>(out.size())) == 1;
}

bool prove(std::string_view secret, Role role, uint32_t kind, const Nonce& client, const Nonce& server, Proof& out) {
  CryptoUse use;
  if (!use.ok()) return false;
  static constexpr std::string_view kLabel = "mooncake-auth-v1";
  std::string message(kLabel);
  message.push_back(static_cast<char>(role));
  for (int shift = 0; shift < 32; shift += 8) message.push_back(static_cast<char>((kind >> shift) & 0xff));
  message.append(reinterpret_cast<const char*>(client.data()), client.size());
  message.append(reinterpret_cast<const char*>(server.data()), server.size());
  unsigned int length = 0;
  const unsigned char* done = HMAC(EVP_sha256(), secret.data(), static_cast<int>(secret.size()),
                                   reinterpret_cast<const unsigned char*>(message.data()), message.size(), out.data(),
                                   &length);
  return done != nullptr && length == out.size();
}

bool same(const Proof& a, const Proof& b) { return CRYPTO_memcmp(a.data(), b.data(), a.size()) == 0; }
#else
// No crypto library in this build: no proof can be made, so none verifies.
bool available() { return false; }
bool randomNonce(Nonce&) { return false; }
bool prove(std::string_view, Role, uint32_t, const Nonce&, const Nonce&, Proof&) { return false; }
bool same(const Proof&, const Proof&) { return false; }
#endif

bool verify(const Proof& theirs, std::string_view secret, Role role, uint32_t kind, const Nonce& client,
            const Nonce& server) {
  Proof ours{};
  return prove(secret, role, kind, client, server, ours) && same(theirs, ours);
}

}  // namespace mooncake::te::auth
