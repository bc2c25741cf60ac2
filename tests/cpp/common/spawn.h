// Starting the processes of a multi-process test and waiting for them with a
// hard deadline: a process that outlives it is killed, so that a hang fails
// the test instead of blocking CI. Also the unique names such tests meet
// under, so that runs side by side (ctest -j, two checkouts) never share one.
#pragma once

#include <spawn.h>
#include <sys/types.h>

#include <chrono>
#include <functional>
#include <string>
#include <vector>

namespace mooncake::testing {

// The status every waiter here reports for a process: its exit code, 200 +
// the signal that ended it (SIGKILL when it passed its deadline), or -1 when
// it never started.
int exitStatusOf(int wait_status);

// Waits for every process of `pids` (-1: one that never started) until
// `limit` from now, then kills and reaps those still running. Returns each
// one's status, in the order of `pids`.
std::vector<int> waitAll(const std::vector<pid_t>& pids, std::chrono::milliseconds limit);
// The same without a deadline, for programs (benchmarks) that may run long.
std::vector<int> waitAll(const std::vector<pid_t>& pids);

// Runs body(rank) for rank 0..world-1, each in a forked child that exits
// with what body returned; returns their statuses (0: every check passed),
// killing children that outlive `limit`. Fork before this process starts
// threads of its own: a child gets a copy of any lock another thread holds.
std::vector<int> runForkedRanks(int world, const std::function<int(int rank)>& body, std::chrono::milliseconds limit);

// Starts `path` with `argv` (argv[0] included) and this process's
// environment through posix_spawn: a fresh program, so that it starts CUDA
// or anything else afresh whatever this process did. `actions` (dup2s,
// closes) apply in the child before the program starts. -1 if it did not start.
pid_t spawnProgram(const std::string& path, const std::vector<std::string>& argv,
                   const posix_spawn_file_actions_t* actions = nullptr);

// "<prefix>-<pid>-<counter>-<random>": unique to this call among the
// processes of this host.
std::string uniqueName(const std::string& prefix);
// uniqueName as a POSIX shared-memory name (which begins with '/').
std::string uniqueShmName(const std::string& prefix);

}  // namespace mooncake::testing
