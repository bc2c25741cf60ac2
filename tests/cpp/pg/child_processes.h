// Waiting for the forked ranks of a multi-process test, with a hard limit:
// a child that outlives it is killed, so a hang fails the test instead of
// blocking CI.
#pragma once

#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <thread>
#include <vector>

namespace mooncake::pg {

// Each child's exit status: its exit code, or 200 + the signal that ended it
// (SIGKILL when it passed `limit`).
inline std::vector<int> waitForChildren(const std::vector<pid_t>& pids, std::chrono::seconds limit) {
  std::vector<int> status;
  const auto deadline = std::chrono::steady_clock::now() + limit;
  for (pid_t pid : pids) {
    int st = 0;
    while (waitpid(pid, &st, WNOHANG) == 0) {
      if (std::chrono::steady_clock::now() > deadline) {
        kill(pid, SIGKILL);
        waitpid(pid, &st, 0);
        break;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
    }
    status.push_back(WIFEXITED(st) ? WEXITSTATUS(st) : 200 + (WIFSIGNALED(st) ? WTERMSIG(st) : 0));
  }
  return status;
}

}  // namespace mooncake::pg
