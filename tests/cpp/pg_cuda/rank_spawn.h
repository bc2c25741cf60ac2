// Multi-process GPU tests: each rank is a separate program started with
// posix_spawn, so that every rank starts CUDA in a process of its own,
// whatever the test process did. Shared by the CudaIpcGroup tests and the
// EP kernel tests (tests/cpp/ep_cuda). Without a GPU the tests skip.
#pragma once

#include <gtest/gtest.h>
#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include <cuda_runtime_api.h>

extern char** environ;

namespace mooncake::testing {

inline bool haveGpu() {
  int count = 0;
  return cudaGetDeviceCount(&count) == cudaSuccess && count > 0;
}

#define REQUIRE_GPU()                                                \
  do {                                                               \
    if (!::mooncake::testing::haveGpu()) GTEST_SKIP() << "no CUDA device"; \
  } while (0)

// `name` beside this program (so that the pair can be moved together), else
// `fallback` (where the build put it).
inline std::string programBesideSelf(const std::string& name, const std::string& fallback) {
  char self[4096];
  const ssize_t n = ::readlink("/proc/self/exe", self, sizeof(self) - 1);
  if (n > 0) {
    std::string beside(self, static_cast<size_t>(n));
    beside = beside.substr(0, beside.rfind('/') + 1) + name;
    if (::access(beside.c_str(), X_OK) == 0) return beside;
  }
  return fallback;
}

// Seconds a multi-process test may run before its ranks are killed
// (PG_CUDA_TEST_LIMIT_S caps it).
inline std::chrono::seconds testLimit(std::chrono::seconds fallback) {
  const char* env = std::getenv("PG_CUDA_TEST_LIMIT_S");
  return env != nullptr ? std::min(fallback, std::chrono::seconds(std::atoi(env))) : fallback;
}

// A fresh POSIX shm name for one test's group.
inline std::string uniqueName(const std::string& prefix) {
  static int counter = 0;
  return "/" + prefix + "-" + std::to_string(::getpid()) + "-" + std::to_string(counter++) + "-" +
         std::to_string(std::random_device{}());
}

// Starts `world` ranks: `program scenario name rank world options...`;
// returns each one's exit status (0: passed; 200 + n: killed by signal n).
// Ranks still running after `limit` are killed (a hang fails the test
// instead of stalling it).
inline std::vector<int> runRankPrograms(const std::string& program, const std::string& name,
                                        const std::string& scenario, int world,
                                        const std::vector<std::string>& options, std::chrono::seconds limit) {
  limit = testLimit(limit);
  std::vector<pid_t> pids;
  for (int r = 0; r < world; ++r) {
    std::vector<std::string> args = {program, scenario, name, std::to_string(r), std::to_string(world)};
    args.insert(args.end(), options.begin(), options.end());
    std::vector<char*> argv;
    for (auto& a : args) argv.push_back(a.data());
    argv.push_back(nullptr);
    pid_t pid = -1;
    if (posix_spawn(&pid, program.c_str(), nullptr, nullptr, argv.data(), environ) != 0) pid = -1;
    pids.push_back(pid);
  }
  std::vector<int> status(world, -1);
  const auto deadline = std::chrono::steady_clock::now() + limit;
  for (int r = 0; r < world; ++r) {
    if (pids[r] < 0) continue;
    int st = 0;
    while (waitpid(pids[r], &st, WNOHANG) == 0) {
      if (std::chrono::steady_clock::now() > deadline) {
        kill(pids[r], SIGKILL);
        waitpid(pids[r], &st, 0);
        break;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
    status[r] = WIFEXITED(st) ? WEXITSTATUS(st) : 200 + (WIFSIGNALED(st) ? WTERMSIG(st) : 0);
  }
  return status;
}

inline void expectAllPassed(const std::vector<int>& status) {
  for (size_t r = 0; r < status.size(); ++r) EXPECT_EQ(status[r], 0) << "rank " << r;
}

}  // namespace mooncake::testing
