// Both halves of an authenticated opening (te/auth.h) as byte-stream state
// machines, so that a blocking socket (the engine's connections, a process
// group's Agent) and a non-blocking poll loop (a process group's
// Coordinator) run the same exchange:
//
//   client -> u32 kAuthMagic, u32 kind, client nonce[32]      (kHelloBytes)
//   server -> server nonce[32], server proof[32]              (kReplyBytes)
//   client -> client proof[32]                                (kProofBytes)
//
// then the connection carries its protocol. Integers are little-endian.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "mooncake/te/auth.h"

namespace mooncake::te::auth {

constexpr uint32_t kAuthMagic = 0x5541434d;  // "MCAU" on the wire
constexpr size_t kHelloBytes = 8 + kNonceBytes;
constexpr size_t kReplyBytes = kNonceBytes + kProofBytes;

class ClientOpening {
 public:
  // False from ok() when no nonce could be drawn (no crypto library).
  ClientOpening(std::string secret, uint32_t kind);
  bool ok() const { return ok_; }
  std::vector<uint8_t> hello() const;
  // The server's kReplyBytes: the proof to send back, or false when the
  // server does not know the secret.
  bool answer(const uint8_t* reply, std::vector<uint8_t>& proof) const;

 private:
  std::string secret_;
  uint32_t kind_;
  Nonce client_{};
  bool ok_ = false;
};

class ServerOpening {
 public:
  enum class Step {
    kNeedMore,  // feed more bytes
    kReply,     // send `out`, then feed more
    kDone,      // authenticated: kind() names the connection; rest() holds bytes that followed
    kRefused,   // close the connection; why() says why
  };
  explicit ServerOpening(std::string secret) : secret_(std::move(secret)) {}
  Step feed(const uint8_t* data, size_t length, std::vector<uint8_t>& out);
  uint32_t kind() const { return kind_; }
  const std::string& why() const { return why_; }
  std::vector<uint8_t> takeRest() { return std::move(rest_); }

 private:
  std::string secret_;
  std::vector<uint8_t> buffer_;
  bool replied_ = false;
  uint32_t kind_ = 0;
  Nonce client_{}, server_{};
  std::string why_;
  std::vector<uint8_t> rest_;
};

}  // namespace mooncake::te::auth
