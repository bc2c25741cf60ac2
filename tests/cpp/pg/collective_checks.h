// Checks shared by the collective tests: every operation of a Collectives
// on one rank, results by closed formula (run on every rank of a group).
#pragma once

#include <algorithm>
#include <cstdio>
#include <vector>

#include "mooncake/pg/collectives.h"

namespace mooncake::pg {

#define CHECK_OR_FAIL(cond)                                                             \
  do {                                                                                  \
    if (!(cond)) {                                                                      \
      std::fprintf(stderr, "rank %d: check failed at line %d: %s\n", g.rank(), __LINE__, #cond); \
      return 1;                                                                         \
    }                                                                                   \
  } while (0)

// Every collective on `count` int32 / float elements, results by formula.
// Roots move with `shift` (0: reduce at the last rank, broadcast from the
// middle one, gather/scatter at rank 0).
inline int everyCollective(Collectives& g, size_t count, int shift = 0) {
  const int W = g.size(), R = g.rank();
  const int reduce_root = (W - 1 + shift) % W, bcast_root = (W / 2 + shift) % W, root = shift % W;
  std::vector<int32_t> in(count), out(count);
  for (size_t i = 0; i < count; ++i) in[i] = static_cast<int32_t>(R + 1 + i % 97);
  CHECK_OR_FAIL(g.allreduce(in.data(), out.data(), count, DataType::kInt32, ReduceOp::kSum).ok);
  for (size_t i = 0; i < count; ++i) CHECK_OR_FAIL(out[i] == static_cast<int32_t>(W * (W + 1) / 2 + W * (i % 97)));
  // in place, MAX
  std::vector<int32_t> io = in;
  CHECK_OR_FAIL(g.allreduce(io.data(), io.data(), count, DataType::kInt32, ReduceOp::kMax).ok);
  for (size_t i = 0; i < count; ++i) CHECK_OR_FAIL(io[i] == static_cast<int32_t>(W + i % 97));
  // float AVG
  std::vector<float> f(count, static_cast<float>(R)), favg(count);
  CHECK_OR_FAIL(g.allreduce(f.data(), favg.data(), count, DataType::kFloat32, ReduceOp::kAvg).ok);
  for (size_t i = 0; i < count; ++i) CHECK_OR_FAIL(favg[i] == (W - 1) / 2.0f);
  // reduce
  std::vector<int32_t> red(count, -7);
  CHECK_OR_FAIL(g.reduce(in.data(), red.data(), count, DataType::kInt32, ReduceOp::kMin, reduce_root).ok);
  for (size_t i = 0; i < count; ++i) CHECK_OR_FAIL(red[i] == (R == reduce_root ? static_cast<int32_t>(1 + i % 97) : -7));
  // broadcast
  std::vector<int32_t> b(count, R == bcast_root ? 111 : 0);
  CHECK_OR_FAIL(g.broadcast(b.data(), count * 4, bcast_root).ok);
  for (size_t i = 0; i < count; ++i) CHECK_OR_FAIL(b[i] == 111);
  // allgather
  std::vector<int32_t> gathered(count * W);
  CHECK_OR_FAIL(g.allgather(in.data(), gathered.data(), count * 4).ok);
  for (int s = 0; s < W; ++s)
    for (size_t i = 0; i < count; ++i) CHECK_OR_FAIL(gathered[s * count + i] == static_cast<int32_t>(s + 1 + i % 97));
  // reduce_scatter: block d of rank s holds s*1000 + d
  std::vector<int32_t> rs_in(count * W), rs_out(count);
  for (int d = 0; d < W; ++d)
    for (size_t i = 0; i < count; ++i) rs_in[d * count + i] = R * 1000 + d;
  CHECK_OR_FAIL(g.reduceScatter(rs_in.data(), rs_out.data(), count, DataType::kInt32, ReduceOp::kSum).ok);
  for (size_t i = 0; i < count; ++i) CHECK_OR_FAIL(rs_out[i] == 1000 * W * (W - 1) / 2 + W * R);
  // gather / scatter
  std::vector<int32_t> ga(count * W, -1);
  CHECK_OR_FAIL(g.gather(in.data(), ga.data(), count * 4, root).ok);
  if (R == root)
    for (int s = 0; s < W; ++s)
      for (size_t i = 0; i < count; ++i) CHECK_OR_FAIL(ga[s * count + i] == static_cast<int32_t>(s + 1 + i % 97));
  std::vector<int32_t> sc_in(count * W), sc_out(count, -1);
  for (int d = 0; d < W; ++d)
    for (size_t i = 0; i < count; ++i) sc_in[d * count + i] = d * 10 + static_cast<int32_t>(i % 5);
  CHECK_OR_FAIL(g.scatter(sc_in.data(), sc_out.data(), count * 4, root).ok);
  for (size_t i = 0; i < count; ++i) CHECK_OR_FAIL(sc_out[i] == R * 10 + static_cast<int32_t>(i % 5));
  // uneven all-to-all: rank s sends (s + d + 1) * count bytes to d, filled with s*16+d
  std::vector<size_t> so(W), sb(W), ro(W), rb(W);
  size_t stotal = 0, rtotal = 0;
  for (int p = 0; p < W; ++p) {
    sb[p] = (R + p + 1) * count;
    so[p] = stotal;
    stotal += sb[p];
    rb[p] = (p + R + 1) * count;
    ro[p] = rtotal;
    rtotal += rb[p];
  }
  std::vector<uint8_t> a_in(stotal), a_out(rtotal, 0xee);
  for (int d = 0; d < W; ++d) std::fill(a_in.begin() + so[d], a_in.begin() + so[d] + sb[d], R * 16 + d);
  CHECK_OR_FAIL(g.alltoall(a_in.data(), so, sb, a_out.data(), ro, rb).ok);
  for (int s = 0; s < W; ++s)
    for (size_t i = 0; i < rb[s]; ++i) CHECK_OR_FAIL(a_out[ro[s] + i] == s * 16 + R);
  CHECK_OR_FAIL(g.barrier().ok);
  return 0;
}

}  // namespace mooncake::pg
