#include "mooncake/te/auth_opening.h"

#include <cstring>

namespace mooncake::te::auth {
namespace {

void putU32(std::vector<uint8_t>& out, uint32_t v) {
  for (int shift = 0; shift < 32; shift += 8) out.push_back(static_cast<uint8_t>(v >> shift));
}

uint32_t getU32(const uint8_t* p) {
  return uint32_t(p[0]) | uint32_t(p[1]) << 8 | uint32_t(p[2]) << 16 | uint32_t(p[3]) << 24;
}

}  // namespace

ClientOpening::ClientOpening(std::string secret, uint32_t kind)
    : secret_(std::move(secret)), kind_(kind), ok_(randomNonce(client_)) {}

std::vector<uint8_t> ClientOpening::hello() const {
  std::vector<uint8_t> out;
  putU32(out, kAuthMagic);
  putU32(out, kind_);
  out.insert(out.end(), client_.begin(), client_.end());
  return out;
}

bool ClientOpening::answer(const uint8_t* reply, std::vector<uint8_t>& proof) const {
  Nonce server{};
  Proof theirs{};
  std::memcpy(server.data(), reply, kNonceBytes);
  std::memcpy(theirs.data(), reply + kNonceBytes, kProofBytes);
  Proof mine{};
  if (!verify(theirs, secret_, Role::kServer, kind_, client_, server) ||
      !prove(secret_, Role::kClient, kind_, client_, server, mine)) {
    return false;
  }
  proof.assign(mine.begin(), mine.end());
  return true;
}

ServerOpening::Step ServerOpening::feed(const uint8_t* data, size_t length, std::vector<uint8_t>& out) {
  buffer_.insert(buffer_.end(), data, data + length);
  if (!replied_) {
    if (buffer_.size() >= 4 && getU32(buffer_.data()) != kAuthMagic) {
      why_ = "an unauthenticated connection (this side has a secret)";
      return Step::kRefused;
    }
    if (buffer_.size() < kHelloBytes) return Step::kNeedMore;
    kind_ = getU32(buffer_.data() + 4);
    std::memcpy(client_.data(), buffer_.data() + 8, kNonceBytes);
    if (!randomNonce(server_)) {
      why_ = "no random nonce could be drawn";
      return Step::kRefused;
    }
    buffer_.erase(buffer_.begin(), buffer_.begin() + kHelloBytes);
    Proof mine{};
    if (!prove(secret_, Role::kServer, kind_, client_, server_, mine)) {
      why_ = "the crypto library could not compute a proof";
      return Step::kRefused;
    }
    out.assign(server_.begin(), server_.end());
    out.insert(out.end(), mine.begin(), mine.end());
    replied_ = true;
    return Step::kReply;
  }
  if (buffer_.size() < kProofBytes) return Step::kNeedMore;
  Proof theirs{};
  std::memcpy(theirs.data(), buffer_.data(), kProofBytes);
  if (!verify(theirs, secret_, Role::kClient, kind_, client_, server_)) {
    why_ = "the peer's proof of the secret is wrong";
    return Step::kRefused;
  }
  rest_.assign(buffer_.begin() + kProofBytes, buffer_.end());
  buffer_.clear();
  return Step::kDone;
}

}  // namespace mooncake::te::auth
