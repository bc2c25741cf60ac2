// What the gtest side of the GPU tests shares: skipping where there is no
// GPU (saying why, so that a skip is not read as a pass), and checking the
// exit status of every rank of a multi-process test.
#pragma once

#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <vector>

namespace mooncake::testing {

inline bool haveGpu() {
  int count = 0;
  return cudaGetDeviceCount(&count) == cudaSuccess && count > 0;
}

#define REQUIRE_GPU()                                                      \
  do {                                                                     \
    if (!::mooncake::testing::haveGpu()) GTEST_SKIP() << "no CUDA device"; \
  } while (0)

// `status` as runRankPrograms (rank_programs.h) returns it.
inline void expectAllPassed(const std::vector<int>& status) {
  for (size_t r = 0; r < status.size(); ++r) EXPECT_EQ(status[r], 0) << "rank " << r;
}

}  // namespace mooncake::testing
