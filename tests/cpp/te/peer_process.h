// Starts te_test_peer as a child process and talks to it over pipes.
#pragma once

#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

extern char** environ;

namespace mooncake::te::testing {

class PeerProcess {
 public:
  // `extra` arguments follow <bytes> <seed> (see te_test_peer.cpp).
  PeerProcess(size_t bytes, uint64_t seed, std::vector<std::string> extra = {}) {
    int to_child[2], from_child[2];
    if (pipe(to_child) != 0 || pipe(from_child) != 0) throw std::runtime_error("pipe");
    posix_spawn_file_actions_t actions;
    posix_spawn_file_actions_init(&actions);
    posix_spawn_file_actions_adddup2(&actions, to_child[0], 0);
    posix_spawn_file_actions_adddup2(&actions, from_child[1], 1);
    posix_spawn_file_actions_addclose(&actions, to_child[1]);
    posix_spawn_file_actions_addclose(&actions, from_child[0]);
    std::string size_arg = std::to_string(bytes), seed_arg = std::to_string(seed);
    std::vector<char*> argv = {const_cast<char*>(TE_TEST_PEER_PATH), size_arg.data(), seed_arg.data()};
    for (auto& arg : extra) argv.push_back(arg.data());
    argv.push_back(nullptr);
    if (posix_spawn(&pid_, TE_TEST_PEER_PATH, &actions, nullptr, argv.data(), environ) != 0) {
      throw std::runtime_error("cannot start " TE_TEST_PEER_PATH);
    }
    posix_spawn_file_actions_destroy(&actions);
    close(to_child[0]);
    close(from_child[1]);
    in_ = fdopen(to_child[1], "w");
    out_ = fdopen(from_child[0], "r");
    std::istringstream ready(readLine());
    std::string word;
    ready >> word >> segment >> buffer_addr;
    if (word != "READY") throw std::runtime_error("peer did not start: '" + word + "'");
  }

  ~PeerProcess() {
    if (in_) fclose(in_);
    if (out_) fclose(out_);
    if (pid_ > 0) {
      kill(pid_, SIGCONT);
      kill(pid_, SIGKILL);
      waitpid(pid_, nullptr, 0);
    }
  }

  uint64_t digestOf(size_t offset, size_t length) {
    fprintf(in_, "DIGEST %zu %zu\n", offset, length);
    fflush(in_);
    return std::stoull(readLine());
  }

  // Has the peer replace its buffer by a new allocation; returns its address.
  uint64_t reallocate(uint64_t seed) {
    fprintf(in_, "REALLOC %llu\n", static_cast<unsigned long long>(seed));
    fflush(in_);
    std::istringstream reply(readLine());
    std::string word;
    reply >> word >> buffer_addr;
    if (word != "OK") throw std::runtime_error("peer failed to reallocate: '" + word + "'");
    return buffer_addr;
  }

  // Starts a write of the first `length` bytes of its buffer into the
  // receive window at `remote` of `segment`; writeResult() waits for its status code.
  void startWrite(const std::string& segment, uint64_t remote, size_t length) {
    fprintf(in_, "WRITE %s %llu %zu\n", segment.c_str(), static_cast<unsigned long long>(remote), length);
    fflush(in_);
  }
  int writeResult() {
    std::istringstream reply(readLine());
    std::string word;
    int rc = 0;
    reply >> word >> rc;
    if (word != "DONE") throw std::runtime_error("peer did not write: '" + word + "'");
    return rc;
  }

  void signal(int sig) { kill(pid_, sig); }
  // SIGSTOP, returning once the peer has stopped (a signal is delivered
  // asynchronously: the peer could still answer a request sent right after).
  void stopNow() {
    kill(pid_, SIGSTOP);
    int status = 0;
    waitpid(pid_, &status, WUNTRACED);
  }
  void killNow() {
    kill(pid_, SIGKILL);
    waitpid(pid_, nullptr, 0);
    pid_ = -1;
  }

  std::string segment;
  uint64_t buffer_addr = 0;

 private:
  std::string readLine() {
    char line[512];
    if (fgets(line, sizeof(line), out_) == nullptr) throw std::runtime_error("peer closed its output");
    return line;
  }

  pid_t pid_ = -1;
  FILE* in_ = nullptr;
  FILE* out_ = nullptr;
};

}  // namespace mooncake::te::testing
