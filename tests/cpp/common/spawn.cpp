#include "common/spawn.h"

#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <cstdio>
#include <random>
#include <thread>

extern char** environ;

namespace mooncake::testing {
namespace {

using Clock = std::chrono::steady_clock;

std::vector<int> waitUntil(const std::vector<pid_t>& pids, Clock::time_point deadline) {
  std::vector<int> status;
  for (pid_t pid : pids) {
    if (pid < 0) {
      status.push_back(-1);
      continue;
    }
    int st = 0;
    // Polled rather than blocking, so that one deadline covers every child.
    while (::waitpid(pid, &st, WNOHANG) == 0) {
      if (Clock::now() > deadline) {
        ::kill(pid, SIGKILL);
        ::waitpid(pid, &st, 0);
        break;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
    }
    status.push_back(exitStatusOf(st));
  }
  return status;
}

}  // namespace

int exitStatusOf(int wait_status) {
  if (WIFEXITED(wait_status)) return WEXITSTATUS(wait_status);
  return 200 + (WIFSIGNALED(wait_status) ? WTERMSIG(wait_status) : 0);
}

std::vector<int> waitAll(const std::vector<pid_t>& pids, std::chrono::milliseconds limit) {
  return waitUntil(pids, Clock::now() + limit);
}

std::vector<int> waitAll(const std::vector<pid_t>& pids) { return waitUntil(pids, Clock::time_point::max()); }

std::vector<int> runForkedRanks(int world, const std::function<int(int rank)>& body, std::chrono::milliseconds limit) {
  std::vector<pid_t> pids;
  for (int rank = 0; rank < world; ++rank) {
    const pid_t pid = ::fork();
    if (pid == 0) {
      const int status = body(rank);
      std::fflush(stderr);
      ::_exit(status);  // no exit handlers or destructors of the parent's objects
    }
    pids.push_back(pid);
  }
  return waitAll(pids, limit);
}

pid_t spawnProgram(const std::string& path, const std::vector<std::string>& argv,
                   const posix_spawn_file_actions_t* actions) {
  std::vector<std::string> args = argv;
  std::vector<char*> pointers;
  for (auto& arg : args) pointers.push_back(arg.data());
  pointers.push_back(nullptr);
  pid_t pid = -1;
  if (::posix_spawn(&pid, path.c_str(), actions, nullptr, pointers.data(), environ) != 0) return -1;
  return pid;
}

std::string uniqueName(const std::string& prefix) {
  static std::atomic<int> counter{0};
  return prefix + "-" + std::to_string(::getpid()) + "-" + std::to_string(counter++) + "-" +
         std::to_string(std::random_device{}());
}

std::string uniqueShmName(const std::string& prefix) { return "/" + uniqueName(prefix); }

}  // namespace mooncake::testing
