// The connection challenge (te/auth.h, rpc/opening.h) without an engine: the
// proof's properties, the listen-address rule, and both ends of an opening
// over a socket pair, with the same secret, different ones, and one side
// without.
#include <gtest/gtest.h>
#include <sys/socket.h>

#include <cstdio>
#include <future>
#include <string>

#include "mooncake/te/auth.h"
#include "mooncake/te/status.h"
#include "net/listen_address.h"
#include "rpc/opening.h"

namespace mooncake::te {
namespace {

using auth::Nonce;
using auth::Role;

Nonce filled(uint8_t v) {
  Nonce n;
  n.fill(v);
  return n;
}

TEST(Auth, ProofDependsOnEverythingItCovers) {
  if (!auth::available()) GTEST_SKIP() << "built without OpenSSL's libcrypto";
  const Nonce c = filled(1), s = filled(2);
  const auto base = auth::prove("secret", Role::kClient, 7, c, s);
  EXPECT_TRUE(auth::same(base, auth::prove("secret", Role::kClient, 7, c, s)));
  EXPECT_FALSE(auth::same(base, auth::prove("secreT", Role::kClient, 7, c, s)));
  EXPECT_FALSE(auth::same(base, auth::prove("secret", Role::kServer, 7, c, s)));  // no reflection
  EXPECT_FALSE(auth::same(base, auth::prove("secret", Role::kClient, 8, c, s)));
  EXPECT_FALSE(auth::same(base, auth::prove("secret", Role::kClient, 7, s, c)));
  Nonce a, b;
  ASSERT_TRUE(auth::randomNonce(a));
  ASSERT_TRUE(auth::randomNonce(b));
  EXPECT_NE(a, b);
}

// A known answer, computed independently with Python's hmac module:
// HMAC-SHA256(b"key", b"mooncake-auth-v1" + b"\x01" + (7).to_bytes(4, "little")
//             + b"\x01" * 32 + b"\x02" * 32).
TEST(Auth, ProofIsHmacSha256OfTheDocumentedMessage) {
  if (!auth::available()) GTEST_SKIP() << "built without OpenSSL's libcrypto";
  const auto p = auth::prove("key", Role::kClient, 7, filled(1), filled(2));
  std::string hex;
  for (uint8_t b : p) {
    char two[3];
    std::snprintf(two, sizeof(two), "%02x", b);
    hex += two;
  }
  EXPECT_EQ(hex, "9c1cd52831f4dfd778c6a0a347cc39b3836233a953569a11cf2b82cc2f65f950");
}

TEST(ListenAddress, BindsWhatWasAsked) {
  using net::listenAddressFor;
  EXPECT_EQ(listenAddressFor("127.0.0.1", false).address, "127.0.0.1");
  EXPECT_FALSE(listenAddressFor("127.0.0.1", false).every_interface);
  EXPECT_EQ(listenAddressFor("10.1.2.3", false).address, "10.1.2.3");
  EXPECT_EQ(listenAddressFor("fe80::1", false).address, "fe80::1");
  EXPECT_EQ(listenAddressFor("LocalHost", false).address, "127.0.0.1");
  EXPECT_EQ(listenAddressFor("127.0.0.1", true).address, "0.0.0.0");
  EXPECT_EQ(listenAddressFor("::1", true).address, "::");
  EXPECT_TRUE(listenAddressFor("0.0.0.0", false).every_interface);
  const auto name = listenAddressFor("node-7.cluster", false);
  EXPECT_TRUE(name.every_interface);
  EXPECT_NE(name.reason.find("is a name"), std::string::npos);
}

struct Outcome {
  int client_rc, server_rc;
  uint32_t kind;
  std::string why;
};

Outcome openPair(const std::string& client_secret, const std::string& server_secret) {
  int fds[2];
  EXPECT_EQ(::socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, fds), 0);
  net::Socket client(fds[0]), server(fds[1]);
  Outcome out{};
  auto served = std::async(std::launch::async, [&] {
    int rc = rpc::acceptOpening(server, server_secret, net::after(std::chrono::seconds(5)), out.kind, out.why);
    if (rc != kOk) server.close();  // as the connection server does
    return rc;
  });
  out.client_rc = rpc::openAs(client, 0x12345678, client_secret, net::after(std::chrono::seconds(5)));
  if (out.client_rc != kOk) client.close();  // as every caller does: the server sees the end at once
  out.server_rc = served.get();
  return out;
}

TEST(Opening, OpenAndAuthenticatedConnectionsNameTheirKind) {
  Outcome open = openPair("", "");
  EXPECT_EQ(open.client_rc, kOk);
  EXPECT_EQ(open.server_rc, kOk);
  EXPECT_EQ(open.kind, 0x12345678u);
  if (!auth::available()) GTEST_SKIP() << "built without OpenSSL's libcrypto";
  Outcome same = openPair("s", "s");
  EXPECT_EQ(same.client_rc, kOk);
  EXPECT_EQ(same.server_rc, kOk);
  EXPECT_EQ(same.kind, 0x12345678u);
}

TEST(Opening, MismatchesFailOnBothSides) {
  if (!auth::available()) GTEST_SKIP() << "built without OpenSSL's libcrypto";
  Outcome different = openPair("a", "b");
  EXPECT_EQ(different.client_rc, kHandshakeRejected);  // the server's proof is wrong
  EXPECT_NE(different.server_rc, kOk);
  Outcome only_client = openPair("a", "");
  EXPECT_EQ(only_client.client_rc, kHandshakeRejected);
  EXPECT_EQ(only_client.server_rc, kHandshakeRejected);
  EXPECT_NE(only_client.why.find("has no secret"), std::string::npos);
  Outcome only_server = openPair("", "b");
  EXPECT_EQ(only_server.server_rc, kHandshakeRejected);
  EXPECT_NE(only_server.why.find("unauthenticated"), std::string::npos);
}

}  // namespace
}  // namespace mooncake::te
