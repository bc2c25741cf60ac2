// Rank programs: one rank of a multi-process test as a program of its own
// (pg_cuda_rank, ep_cuda_rank), so that every rank starts CUDA afresh in a
// process of its own, whatever the test process did. Both sides of their
// command line are here:
//   <program> <scenario> <group name> <rank> <world> [key=value ...]
// the test starts them with runRankPrograms, a rank reads it with parseRankArgs.
#pragma once

#include <chrono>
#include <map>
#include <string>
#include <vector>

namespace mooncake::testing {

// ---- the test's side ----

// `name` beside this program (so that the pair can be moved together), else
// `fallback` (where the build put it).
std::string programBesideSelf(const std::string& name, const std::string& fallback);

// Seconds a multi-process test may run before its ranks are killed:
// `fallback`, or less where PG_CUDA_TEST_LIMIT_S caps it.
std::chrono::seconds testLimit(std::chrono::seconds fallback);

// Starts `world` ranks: `program scenario name rank world options...`;
// returns each one's exit status (0: passed; 200 + n: killed by signal n;
// -1: did not start). Ranks still running after testLimit(limit) are killed
// (a hang fails the test instead of stalling it).
std::vector<int> runRankPrograms(const std::string& program, const std::string& name, const std::string& scenario,
                                 int world, const std::vector<std::string>& options, std::chrono::seconds limit);

// ---- the rank's side ----

struct RankArgs {
  std::string scenario, name;
  int rank = 0, world = 0;
  std::map<std::string, std::string> keys;

  bool has(const std::string& key) const { return keys.count(key) != 0; }
  // The value of `key`, or "" when it was not given.
  std::string get(const std::string& key) const { return has(key) ? keys.at(key) : std::string(); }
};

// False (usage printed on stderr) when the command line is too short.
bool parseRankArgs(int argc, char** argv, RankArgs* out);

}  // namespace mooncake::testing
