#include "common/rank_programs.h"

#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>

#include "common/spawn.h"

namespace mooncake::testing {

std::string programBesideSelf(const std::string& name, const std::string& fallback) {
  char self[4096];
  const ssize_t n = ::readlink("/proc/self/exe", self, sizeof(self) - 1);
  if (n > 0) {
    std::string beside(self, static_cast<size_t>(n));
    beside = beside.substr(0, beside.rfind('/') + 1) + name;
    if (::access(beside.c_str(), X_OK) == 0) return beside;
  }
  return fallback;
}

std::chrono::seconds testLimit(std::chrono::seconds fallback) {
  const char* env = std::getenv("PG_CUDA_TEST_LIMIT_S");
  return env != nullptr ? std::min(fallback, std::chrono::seconds(std::atoi(env))) : fallback;
}

std::vector<int> runRankPrograms(const std::string& program, const std::string& name, const std::string& scenario,
                                 int world, const std::vector<std::string>& options, std::chrono::seconds limit) {
  std::vector<pid_t> pids;
  for (int r = 0; r < world; ++r) {
    std::vector<std::string> argv = {program, scenario, name, std::to_string(r), std::to_string(world)};
    argv.insert(argv.end(), options.begin(), options.end());
    pids.push_back(spawnProgram(program, argv));
  }
  return waitAll(pids, testLimit(limit));
}

bool parseRankArgs(int argc, char** argv, RankArgs* out) {
  if (argc < 5) {
    std::fprintf(stderr, "usage: %s <scenario> <name> <rank> <world> [key=value ...]\n", argv[0]);
    return false;
  }
  out->scenario = argv[1];
  out->name = argv[2];
  out->rank = std::atoi(argv[3]);
  out->world = std::atoi(argv[4]);
  for (int i = 5; i < argc; ++i) {
    const std::string arg = argv[i];
    const size_t eq = arg.find('=');
    if (eq != std::string::npos) out->keys[arg.substr(0, eq)] = arg.substr(eq + 1);
  }
  return true;
}

}  // namespace mooncake::testing
