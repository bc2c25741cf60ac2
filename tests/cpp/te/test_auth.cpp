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
#include "mooncake/te/auth_opening.h"
#include "mooncake/te/status.h"
#include "net/listen_address.h"
#include "net/socket.h"
#include "rpc/opening.h"
#include "rpc/rpc.h"

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
  auth::Proof base{};
  ASSERT_TRUE(auth::prove("secret", Role::kClient, 7, c, s, base));
  EXPECT_TRUE(auth::verify(base, "secret", Role::kClient, 7, c, s));
  EXPECT_FALSE(auth::verify(base, "secreT", Role::kClient, 7, c, s));
  EXPECT_FALSE(auth::verify(base, "secret", Role::kServer, 7, c, s));  // no reflection
  EXPECT_FALSE(auth::verify(base, "secret", Role::kClient, 8, c, s));
  EXPECT_FALSE(auth::verify(base, "secret", Role::kClient, 7, s, c));
  EXPECT_FALSE(auth::verify(auth::Proof{}, "secret", Role::kClient, 7, c, s));  // an unset proof is no proof
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
  auth::Proof p{};
  ASSERT_TRUE(auth::prove("key", Role::kClient, 7, filled(1), filled(2), p));
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

// The two state machines against each other, the server fed one byte at a
// time, with the client's first protocol bytes arriving with its proof.
TEST(AuthOpening, ByteByByteWithTrailingBytes) {
  if (!auth::available()) GTEST_SKIP() << "built without OpenSSL's libcrypto";
  auth::ClientOpening client("s", 42);
  ASSERT_TRUE(client.ok());
  auth::ServerOpening server("s");
  std::vector<uint8_t> out;
  const std::vector<uint8_t> hello = client.hello();
  ASSERT_EQ(hello.size(), auth::kHelloBytes);
  auto step = auth::ServerOpening::Step::kNeedMore;
  for (size_t i = 0; i < hello.size(); ++i) {
    EXPECT_EQ(step, auth::ServerOpening::Step::kNeedMore) << i;
    step = server.feed(&hello[i], 1, out);
  }
  ASSERT_EQ(step, auth::ServerOpening::Step::kReply);
  ASSERT_EQ(out.size(), auth::kReplyBytes);
  std::vector<uint8_t> proof;
  ASSERT_TRUE(client.answer(out.data(), proof));
  proof.push_back(0xAB);  // the protocol's first byte, in the same packet
  proof.push_back(0xCD);
  EXPECT_EQ(server.feed(proof.data(), proof.size(), out), auth::ServerOpening::Step::kDone);
  EXPECT_EQ(server.kind(), 42u);
  EXPECT_EQ(server.takeRest(), (std::vector<uint8_t>{0xAB, 0xCD}));
}

TEST(AuthOpening, WrongSecretsAndPlainStartsAreRefused) {
  if (!auth::available()) GTEST_SKIP() << "built without OpenSSL's libcrypto";
  std::vector<uint8_t> out, proof;
  {  // the client tells a server with another secret
    auth::ClientOpening client("a", 1);
    auth::ServerOpening server("b");
    const auto hello = client.hello();
    ASSERT_EQ(server.feed(hello.data(), hello.size(), out), auth::ServerOpening::Step::kReply);
    EXPECT_FALSE(client.answer(out.data(), proof));
  }
  {  // a proof that does not match (altered on the way, or made with another secret)
    auth::ClientOpening honest("b", 1);
    auth::ServerOpening server("b");
    const auto hello = honest.hello();
    ASSERT_EQ(server.feed(hello.data(), hello.size(), out), auth::ServerOpening::Step::kReply);
    ASSERT_TRUE(honest.answer(out.data(), proof));
    proof[0] ^= 1;
    EXPECT_EQ(server.feed(proof.data(), proof.size(), out), auth::ServerOpening::Step::kRefused);
    EXPECT_NE(server.why().find("proof"), std::string::npos);
  }
  {  // a plain start
    auth::ServerOpening server("b");
    const uint8_t plain[4] = {0x4d, 0x43, 0x52, 0x50};
    EXPECT_EQ(server.feed(plain, 4, out), auth::ServerOpening::Step::kRefused);
    EXPECT_NE(server.why().find("unauthenticated"), std::string::npos);
  }
}

struct Outcome {
  int client_rc, server_rc;
  uint32_t kind;
  std::string why;         // the server's
  std::string client_why;  // the client's
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
  out.client_rc = rpc::openAs(client, 0x12345678, client_secret, net::after(std::chrono::seconds(5)), out.client_why);
  if (out.client_rc != kOk) client.close();  // as every caller does: the server sees the end at once
  out.server_rc = served.get();
  return out;
}

// What a user reads about a secret the two sides do not share names both
// ways of setting one.
void expectNamesHowToSetTheSecret(const std::string& why) {
  EXPECT_NE(why.find("MC_TE_AUTH_SECRET"), std::string::npos) << why;
  EXPECT_NE(why.find("initialize_ext(..., auth_secret=...)"), std::string::npos) << why;
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
  EXPECT_NE(different.client_why.find("the peer requires authentication, but with another secret"), std::string::npos)
      << different.client_why;
  expectNamesHowToSetTheSecret(different.client_why);
  Outcome only_client = openPair("a", "");
  EXPECT_EQ(only_client.client_rc, kHandshakeRejected);
  EXPECT_EQ(only_client.server_rc, kHandshakeRejected);
  EXPECT_NE(only_client.why.find("has no secret"), std::string::npos);
  EXPECT_NE(only_client.client_why.find("closed the connection instead of answering the authentication challenge"),
            std::string::npos)
      << only_client.client_why;
  expectNamesHowToSetTheSecret(only_client.client_why);
  Outcome only_server = openPair("", "b");
  EXPECT_EQ(only_server.server_rc, kHandshakeRejected);
  EXPECT_NE(only_server.why.find("unauthenticated"), std::string::npos);
}

// One handshake RPC served as the engine's connection server serves it
// (rpc/connection_server.cpp): the opening with `server_secret`, a reply of
// kOk to the request, a close without a word when the opening fails.
struct OneRpcServer {
  explicit OneRpcServer(std::string server_secret) : secret(std::move(server_secret)) {
    EXPECT_EQ(listener.open(0, 0, "127.0.0.1"), kOk);
    served = std::async(std::launch::async, [this] {
      net::Socket connection;
      if (listener.accept(connection) != kOk) return;
      uint32_t kind = 0;
      std::string why;
      if (rpc::acceptOpening(connection, secret, net::after(std::chrono::seconds(5)), kind, why) != kOk) return;
      rpc::serveRpc(
          connection, [](uint32_t, const std::string&, std::string&) { return static_cast<int>(kOk); }, 1024,
          std::chrono::seconds(5));
    });
  }
  ~OneRpcServer() {
    listener.stop();
    served.wait();
  }

  std::string secret;
  net::Listener listener;
  std::future<void> served;
};

int callOnce(const std::string& client_secret, const std::string& server_secret, std::string& why) {
  OneRpcServer server(server_secret);
  std::string reply;
  rpc::CallOptions options;
  options.secret = client_secret;
  return rpc::call("127.0.0.1", server.listener.port(), rpc::kProbe, {}, reply, options, &why);
}

TEST(Opening, ACallWithoutTheSecretSaysHowToSetIt) {
  if (!auth::available()) GTEST_SKIP() << "built without OpenSSL's libcrypto";
  std::string why;
  EXPECT_EQ(callOnce("s", "s", why), kOk);
  EXPECT_EQ(why, "");
  // The server closes an open connection without a word. The code stays
  // kPeerUnreachable, which callers (the process group) read as the peer
  // being gone; the words say what is the likely cause.
  EXPECT_EQ(callOnce("", "s", why), kPeerUnreachable);
  EXPECT_NE(why.find("as an engine that requires authentication does with one that has no secret"), std::string::npos)
      << why;
  expectNamesHowToSetTheSecret(why);
  EXPECT_EQ(callOnce("other", "s", why), kHandshakeRejected);
  EXPECT_NE(why.find("the peer requires authentication, but with another secret"), std::string::npos) << why;
  expectNamesHowToSetTheSecret(why);
  EXPECT_EQ(callOnce("s", "", why), kHandshakeRejected);
  expectNamesHowToSetTheSecret(why);
}

TEST(Opening, ACallBetweenOpenEnginesHasNothingToExplain) {
  std::string why = "stale";
  EXPECT_EQ(callOnce("", "", why), kOk);
  EXPECT_EQ(why, "");
}

}  // namespace
}  // namespace mooncake::te
