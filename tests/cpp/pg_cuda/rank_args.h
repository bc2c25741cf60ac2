// The command line of a rank program (pg_cuda_rank, ep_cuda_rank):
//   <program> <scenario> <group name> <rank> <world> [key=value ...]
// The parent side that starts them is rank_spawn.h.
#pragma once

#include <cstdio>
#include <cstdlib>
#include <map>
#include <string>

namespace mooncake::testing {

struct RankArgs {
  std::string scenario, name;
  int rank = 0, world = 0;
  std::map<std::string, std::string> keys;

  bool has(const std::string& key) const { return keys.count(key) != 0; }
  // The value of `key`, or "" when it was not given.
  std::string get(const std::string& key) const { return has(key) ? keys.at(key) : std::string(); }
};

// False (usage printed on stderr) when the command line is too short.
inline bool parseRankArgs(int argc, char** argv, RankArgs* out) {
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
