// Starts te_test_peer as a child process and talks to it over pipes.
#pragma once

#include <signal.h>

#include <cstdint>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

#include "common/piped_child.h"

namespace mooncake::te::testing {

class PeerProcess {
 public:
  // `extra` arguments follow <bytes> <seed> (see te_test_peer.cpp).
  PeerProcess(size_t bytes, uint64_t seed, std::vector<std::string> extra = {}) {
    std::vector<std::string> argv = {TE_TEST_PEER_PATH, std::to_string(bytes), std::to_string(seed)};
    argv.insert(argv.end(), extra.begin(), extra.end());
    child_ = ::mooncake::testing::PipedChild::spawn(TE_TEST_PEER_PATH, argv);
    if (!child_.started()) throw std::runtime_error("cannot start " TE_TEST_PEER_PATH);
    std::istringstream ready(readLine());
    std::string word;
    ready >> word >> segment >> buffer_addr;
    if (word != "READY") throw std::runtime_error("peer did not start: '" + word + "'");
  }

  uint64_t digestOf(size_t offset, size_t length) {
    send("DIGEST " + std::to_string(offset) + " " + std::to_string(length));
    return std::stoull(readLine());
  }

  // Has the peer replace its buffer by a new allocation; returns its address.
  uint64_t reallocate(uint64_t seed) {
    send("REALLOC " + std::to_string(seed));
    std::istringstream reply(readLine());
    std::string word;
    reply >> word >> buffer_addr;
    if (word != "OK") throw std::runtime_error("peer failed to reallocate: '" + word + "'");
    return buffer_addr;
  }

  // Starts a write of the first `length` bytes of its buffer into the
  // receive window at `remote` of `segment`; writeResult() waits for its status code.
  void startWrite(const std::string& segment, uint64_t remote, size_t length) {
    send("WRITE " + segment + " " + std::to_string(remote) + " " + std::to_string(length));
  }
  int writeResult() {
    std::istringstream reply(readLine());
    std::string word;
    int rc = 0;
    reply >> word >> rc;
    if (word != "DONE") throw std::runtime_error("peer did not write: '" + word + "'");
    return rc;
  }

  void signal(int sig) { child_.signal(sig); }
  // SIGSTOP, returning once the peer has stopped (a signal is delivered
  // asynchronously: the peer could still answer a request sent right after).
  void stopNow() { child_.stop(); }
  void killNow() { child_.kill(); }

  std::string segment;
  uint64_t buffer_addr = 0;

 private:
  void send(const std::string& command) {
    const std::string line = command + "\n";
    child_.writeAll(line.data(), line.size());
  }
  // Waits as long as the peer takes: ctest's timeout ends a peer that hangs.
  std::string readLine() {
    auto line = child_.readLine();
    if (!line) throw std::runtime_error("peer closed its output");
    return *line;
  }

  ::mooncake::testing::PipedChild child_;  // killed and reaped when this goes
};

}  // namespace mooncake::te::testing
