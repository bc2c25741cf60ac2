#include "rpc/opening.h"

#include "mooncake/te/auth.h"
#include "mooncake/te/status.h"

namespace mooncake::te::rpc {

int openAs(net::Socket& socket, uint32_t kind, const std::string& secret, net::Deadline deadline) {
  const int fd = socket.fd();
  if (secret.empty()) return net::sendAll(fd, &kind, sizeof(kind), deadline);
  auth::Nonce client{}, server{};
  if (!auth::randomNonce(client)) return kSocketFailed;
  const uint32_t hello[2] = {kAuthMagic, kind};
  if (int rc = net::sendAll(fd, hello, sizeof(hello), deadline); rc != kOk) return rc;
  if (int rc = net::sendAll(fd, client.data(), client.size(), deadline); rc != kOk) return rc;
  auth::Proof server_proof{};
  if (int rc = net::recvAll(fd, server.data(), server.size(), deadline); rc != kOk) {
    // A server without a secret drops the opening: nothing comes back.
    return rc == kPeerUnreachable ? kHandshakeRejected : rc;
  }
  if (int rc = net::recvAll(fd, server_proof.data(), server_proof.size(), deadline); rc != kOk) return rc;
  if (!auth::same(server_proof, auth::prove(secret, auth::Role::kServer, kind, client, server))) {
    return kHandshakeRejected;  // the server knows another secret (or none)
  }
  const auth::Proof mine = auth::prove(secret, auth::Role::kClient, kind, client, server);
  return net::sendAll(fd, mine.data(), mine.size(), deadline);
}

int acceptOpening(net::Socket& socket, const std::string& secret, net::Deadline deadline, uint32_t& kind,
                  std::string& why) {
  const int fd = socket.fd();
  uint32_t first = 0;
  if (int rc = net::recvAll(fd, &first, sizeof(first), deadline); rc != kOk) {
    why = "no opening within the hello timeout";
    return rc;
  }
  if (first != kAuthMagic) {
    if (!secret.empty()) {
      why = "an unauthenticated connection (this engine has a secret: MC_TE_AUTH_SECRET or its process group's)";
      return kHandshakeRejected;
    }
    kind = first;
    return kOk;
  }
  if (secret.empty()) {
    why = "a peer offered authentication, but this engine has no secret (set MC_TE_AUTH_SECRET alike on both)";
    return kHandshakeRejected;
  }
  auth::Nonce client{}, server{};
  if (int rc = net::recvAll(fd, &kind, sizeof(kind), deadline); rc != kOk) return rc;
  if (int rc = net::recvAll(fd, client.data(), client.size(), deadline); rc != kOk) return rc;
  if (!auth::randomNonce(server)) return kSocketFailed;
  const auth::Proof mine = auth::prove(secret, auth::Role::kServer, kind, client, server);
  if (int rc = net::sendAll(fd, server.data(), server.size(), deadline); rc != kOk) return rc;
  if (int rc = net::sendAll(fd, mine.data(), mine.size(), deadline); rc != kOk) return rc;
  auth::Proof theirs{};
  if (int rc = net::recvAll(fd, theirs.data(), theirs.size(), deadline); rc != kOk) {
    why = "the peer did not prove the secret (it knows another one)";
    return rc == kPeerUnreachable ? kHandshakeRejected : rc;
  }
  if (!auth::same(theirs, auth::prove(secret, auth::Role::kClient, kind, client, server))) {
    why = "the peer's proof of the secret is wrong";
    return kHandshakeRejected;
  }
  return kOk;
}

}  // namespace mooncake::te::rpc
