#include "rpc/opening.h"

#include "mooncake/te/auth_opening.h"
#include "mooncake/te/status.h"

namespace mooncake::te::rpc {

int openAs(net::Socket& socket, uint32_t kind, const std::string& secret, net::Deadline deadline, std::string& why) {
  const int fd = socket.fd();
  if (secret.empty()) return net::sendAll(fd, &kind, sizeof(kind), deadline);
  auth::ClientOpening opening(secret, kind);
  if (!opening.ok()) {
    why = "cannot draw a nonce for the authenticated opening (this build has no crypto library)";
    return kSocketFailed;
  }
  const std::vector<uint8_t> hello = opening.hello();
  if (int rc = net::sendAll(fd, hello.data(), hello.size(), deadline); rc != kOk) return rc;
  uint8_t reply[auth::kReplyBytes];
  if (int rc = net::recvAll(fd, reply, sizeof(reply), deadline); rc != kOk) {
    // A server without the secret drops the opening: nothing comes back. So
    // does one that is shutting down, which this side cannot tell apart.
    if (rc != kPeerUnreachable) return rc;
    why = std::string(
              "the peer closed the connection instead of answering the authentication challenge: it has no "
              "secret (or a build without authentication), or it is going away; if it has no secret, ") +
          kSetTheSameSecret;
    return kHandshakeRejected;
  }
  std::vector<uint8_t> proof;
  if (!opening.answer(reply, proof)) {
    why = std::string("the peer requires authentication, but with another secret than this engine's: ") +
          kSetTheSameSecret;
    return kHandshakeRejected;
  }
  return net::sendAll(fd, proof.data(), proof.size(), deadline);
}

int acceptOpening(net::Socket& socket, const std::string& secret, net::Deadline deadline, uint32_t& kind,
                  std::string& why) {
  const int fd = socket.fd();
  uint32_t first = 0;
  if (int rc = net::recvAll(fd, &first, sizeof(first), deadline); rc != kOk) {
    why = "no opening within the hello timeout";
    return rc;
  }
  if (secret.empty()) {
    if (first == auth::kAuthMagic) {
      why = "a peer offered authentication, but this engine has no secret (set MC_TE_AUTH_SECRET alike on both)";
      return kHandshakeRejected;
    }
    kind = first;
    return kOk;
  }
  auth::ServerOpening opening(secret);
  std::vector<uint8_t> out;
  auth::ServerOpening::Step step = opening.feed(reinterpret_cast<const uint8_t*>(&first), sizeof(first), out);
  // The client sends the rest of its hello, then its proof after our reply: read exactly what each step needs.
  size_t need = auth::kHelloBytes - sizeof(first);
  for (;;) {
    if (step == auth::ServerOpening::Step::kRefused) {
      why = opening.why() + (opening.why().find("unauthenticated") != std::string::npos
                                 ? ": MC_TE_AUTH_SECRET or its process group's"
                                 : "");
      return kHandshakeRejected;
    }
    if (step == auth::ServerOpening::Step::kDone) {
      kind = opening.kind();
      return kOk;
    }
    if (step == auth::ServerOpening::Step::kReply) {
      if (int rc = net::sendAll(fd, out.data(), out.size(), deadline); rc != kOk) return rc;
      need = auth::kProofBytes;
    }
    std::vector<uint8_t> chunk(need);
    if (int rc = net::recvAll(fd, chunk.data(), chunk.size(), deadline); rc != kOk) {
      why = step == auth::ServerOpening::Step::kReply ? "the peer did not prove the secret (it knows another one)"
                                                      : "an incomplete opening";
      return rc == kPeerUnreachable ? kHandshakeRejected : rc;
    }
    step = opening.feed(chunk.data(), chunk.size(), out);
  }
}

}  // namespace mooncake::te::rpc
