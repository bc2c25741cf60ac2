// The control plane's authenticated opening (ControlOptions::secret,
// te/auth_opening.h): Agents that know the secret are served; another
// secret, none, or a raw protocol frame without the opening is refused before
// the Coordinator reads a message, and the Coordinator goes on serving.
#include <gtest/gtest.h>
#include <sys/socket.h>

#include <chrono>
#include <string>
#include <vector>

#include "control/protocol.h"
#include "control/socket_io.h"
#include "mooncake/pg/control_plane.h"
#include "mooncake/te/auth.h"

namespace mooncake::pg {
namespace {

using namespace std::chrono_literals;
using SteadyClock = std::chrono::steady_clock;

ControlOptions withSecret(const std::string& secret) {
  ControlOptions options;
  options.heartbeat_interval = 50ms;
  options.heartbeat_timeout = 1000ms;
  options.request_timeout = 2000ms;
  options.secret = secret;
  return options;
}

std::unique_ptr<Coordinator> coordinatorWith(const std::string& secret) {
  std::string error;
  auto coordinator = Coordinator::start("127.0.0.1", withSecret(secret), &error);
  EXPECT_NE(coordinator, nullptr) << error;
  return coordinator;
}

std::string connectError(const std::string& address, int rank, const std::string& secret) {
  std::string error;
  auto agent = Agent::connect(address, rank, withSecret(secret), &error);
  return agent ? "" : (error.empty() ? "refused" : error);
}

// What a raw connection that sends `bytes` gets back before the close.
std::vector<uint8_t> rawExchange(const std::string& address, const std::vector<uint8_t>& bytes) {
  std::string host, error;
  uint16_t port = 0;
  EXPECT_TRUE(control::splitHostPort(address, &host, &port));
  control::UniqueFd fd = control::connectTo(host, port, SteadyClock::now() + 2s, &error);
  EXPECT_TRUE(fd.valid()) << error;
  EXPECT_TRUE(control::sendAll(fd.get(), bytes.data(), bytes.size(), SteadyClock::now() + 2s, &error)) << error;
  std::vector<uint8_t> got;
  uint8_t buffer[4096];
  for (;;) {
    ssize_t n = control::receiveSome(fd.get(), buffer, sizeof(buffer), SteadyClock::now() + 2s, &error);
    if (n <= 0) break;
    got.insert(got.end(), buffer, buffer + n);
  }
  return got;
}

TEST(ControlAuth, TheSecretAdmitsOthersAreRefusedAndTheCoordinatorGoesOn) {
  if (!te::auth::available()) GTEST_SKIP() << "built without OpenSSL's libcrypto";
  auto coordinator = coordinatorWith("job secret");
  const std::string address = coordinator->address();
  const std::string other = connectError(address, 1, "another secret");
  EXPECT_NE(other.find("does not know this job's secret"), std::string::npos) << other;
  const std::string none = connectError(address, 2, "");
  EXPECT_FALSE(none.empty());
  // The protocol's own greeting, without the opening: nothing comes back.
  EXPECT_TRUE(rawExchange(address, control::encodeFrame(control::Hello{3, 0, "", false, 0})).empty());
  std::string error;
  auto agent = Agent::connect(address, 4, withSecret("job secret"), &error);
  EXPECT_NE(agent, nullptr) << error;
}

TEST(ControlAuth, ASecretAgainstAnOpenCoordinatorFailsClearly) {
  if (!te::auth::available()) GTEST_SKIP() << "built without OpenSSL's libcrypto";
  auto coordinator = coordinatorWith("");
  const std::string error = connectError(coordinator->address(), 1, "job secret");
  EXPECT_NE(error.find("authentication"), std::string::npos) << error;
  EXPECT_EQ(connectError(coordinator->address(), 2, ""), "");  // and open Agents are served as before
}

TEST(ControlAuth, SilentConnectionsDoNotStopTheService) {
  if (!te::auth::available()) GTEST_SKIP() << "built without OpenSSL's libcrypto";
  auto coordinator = coordinatorWith("s");
  std::string host, error;
  uint16_t port = 0;
  ASSERT_TRUE(control::splitHostPort(coordinator->address(), &host, &port));
  std::vector<control::UniqueFd> silent;
  for (int i = 0; i < 200; ++i) silent.push_back(control::connectTo(host, port, SteadyClock::now() + 2s, &error));
  const auto started = SteadyClock::now();
  auto agent = Agent::connect(coordinator->address(), 1, withSecret("s"), &error);
  EXPECT_NE(agent, nullptr) << error;
  EXPECT_LT(SteadyClock::now() - started, 2s);
}

}  // namespace
}  // namespace mooncake::pg
