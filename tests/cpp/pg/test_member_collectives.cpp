// MemberCollectives: collectives addressed by seat over the active seats
// only, with holes. Real processes (fork), one per active seat, meeting in a
// ShmGroup over the active seats; results by closed formula, and the blocks
// of holes must stay untouched.
#include <gtest/gtest.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <functional>
#include <thread>

#include "common/spawn.h"
#include "mooncake/pg/member_collectives.h"
#include "mooncake/pg/shm_group.h"

namespace mooncake::pg {
namespace {

using namespace std::chrono_literals;

// Runs body(group) in one process per active seat; returns exit statuses.
std::vector<int> runSeats(const std::vector<int>& active, const std::function<int(MemberCollectives&)>& body) {
  const std::string name = testing::uniqueShmName("mc-member");
  const int world = static_cast<int>(active.size());
  return testing::runForkedRanks(
      world,
      [&](int i) {
        ShmGroupOptions options;
        options.slot_bytes = 64 * 1024;
        options.timeout = 10s;
        options.rank_names = active;
        std::string error;
        auto inner = ShmGroup::open(name, i, world, options, &error);
        if (!inner) return 100;
        MemberCollectives group(active, active[i], std::move(inner));
        ::_exit(body(group));  // the group left open: no destructor runs in a rank
      },
      60s);
}

#define EXPECT_OR_EXIT(cond)                                                                      \
  do {                                                                                            \
    if (!(cond)) {                                                                                \
      std::fprintf(stderr, "seat %d: line %d: %s\n", g.rank(), __LINE__, #cond);                  \
      return 1;                                                                                   \
    }                                                                                             \
  } while (0)

// Seats {0, 2, 3} of 4 (seat 1 is a hole), and {1, 3} (holes at 0 and 2:
// neither dense nor starting at 0).
class Holes : public ::testing::TestWithParam<std::vector<int>> {};

TEST_P(Holes, EveryCollectiveBySeatWithHolesUntouched) {
  const std::vector<int> active = GetParam();
  auto status = runSeats(active, [&](MemberCollectives& g) {
    const int S = g.rank(), extent = g.size();
    EXPECT_OR_EXIT(extent == active.back() + 1);
    const int32_t kUntouched = -77;
    const size_t n = 301;
    auto is_active = [&](int s) { return std::find(active.begin(), active.end(), s) != active.end(); };
    int32_t seat_sum = 0;
    for (int s : active) seat_sum += s + 1;
    // all_reduce: only active seats contribute
    std::vector<int32_t> v(n, S + 1);
    EXPECT_OR_EXIT(g.allreduce(v.data(), v.data(), n, DataType::kInt32, ReduceOp::kSum).ok);
    for (int32_t x : v) EXPECT_OR_EXIT(x == seat_sum);
    // broadcast from the last active seat; a hole as root is refused
    std::vector<int32_t> b(n, S == active.back() ? 555 : 0);
    EXPECT_OR_EXIT(g.broadcast(b.data(), n * 4, active.back()).ok);
    for (int32_t x : b) EXPECT_OR_EXIT(x == 555);
    int hole = -1;
    for (int s = 0; s < extent && hole < 0; ++s) if (!is_active(s)) hole = s;
    OpResult refused = g.broadcast(b.data(), n * 4, hole);
    EXPECT_OR_EXIT(!refused.ok && refused.error.find("not active") != std::string::npos);
    // all_gather: block s from seat s, holes untouched
    std::vector<int32_t> gathered(n * extent, kUntouched);
    std::vector<int32_t> mine(n, S * 10);
    EXPECT_OR_EXIT(g.allgather(mine.data(), gathered.data(), n * 4).ok);
    for (int s = 0; s < extent; ++s)
      for (size_t i = 0; i < n; ++i) EXPECT_OR_EXIT(gathered[s * n + i] == (is_active(s) ? s * 10 : kUntouched));
    // reduce_scatter: seat s gets the sum over active seats of their block s
    std::vector<int32_t> rs_in(n * extent), rs_out(n, kUntouched);
    for (int d = 0; d < extent; ++d)
      for (size_t i = 0; i < n; ++i) rs_in[d * n + i] = S * 100 + d;
    EXPECT_OR_EXIT(g.reduceScatter(rs_in.data(), rs_out.data(), n, DataType::kInt32, ReduceOp::kSum).ok);
    int32_t seats_100 = 0;
    for (int s : active) seats_100 += s * 100;
    for (int32_t x : rs_out) EXPECT_OR_EXIT(x == seats_100 + static_cast<int32_t>(active.size()) * S);
    // reduce to the first active seat
    std::vector<int32_t> red(n, kUntouched);
    EXPECT_OR_EXIT(g.reduce(v.data(), red.data(), n, DataType::kInt32, ReduceOp::kMax, active.front()).ok);
    for (int32_t x : red) EXPECT_OR_EXIT(x == (S == active.front() ? seat_sum : kUntouched));
    // gather / scatter at the last active seat
    std::vector<int32_t> ga(n * extent, kUntouched);
    EXPECT_OR_EXIT(g.gather(mine.data(), ga.data(), n * 4, active.back()).ok);
    if (S == active.back())
      for (int s = 0; s < extent; ++s) EXPECT_OR_EXIT(ga[s * n] == (is_active(s) ? s * 10 : kUntouched));
    std::vector<int32_t> sc_in(n * extent), sc_out(n, kUntouched);
    for (int d = 0; d < extent; ++d)
      for (size_t i = 0; i < n; ++i) sc_in[d * n + i] = d * 1000 + static_cast<int32_t>(i);
    EXPECT_OR_EXIT(g.scatter(sc_in.data(), sc_out.data(), n * 4, active.back()).ok);
    for (size_t i = 0; i < n; ++i) EXPECT_OR_EXIT(sc_out[i] == S * 1000 + static_cast<int32_t>(i));
    // all_to_all by seat: S sends (S + d + 1) bytes of value S*16+d to d
    std::vector<size_t> so(extent), sb(extent), ro(extent), rb(extent);
    size_t st = 0, rt = 0;
    for (int p = 0; p < extent; ++p) {
      sb[p] = S + p + 1, so[p] = st, st += sb[p];
      rb[p] = p + S + 1, ro[p] = rt, rt += rb[p];
    }
    std::vector<uint8_t> a_in(st), a_out(rt, 0xee);
    for (int d = 0; d < extent; ++d) std::fill(a_in.begin() + so[d], a_in.begin() + so[d] + sb[d], S * 16 + d);
    EXPECT_OR_EXIT(g.alltoall(a_in.data(), so, sb, a_out.data(), ro, rb).ok);
    for (int s = 0; s < extent; ++s)
      for (size_t i = 0; i < rb[s]; ++i) EXPECT_OR_EXIT(a_out[ro[s] + i] == (is_active(s) ? s * 16 + S : 0xee));
    EXPECT_OR_EXIT(g.barrier().ok);
    return 0;
  });
  for (size_t i = 0; i < active.size(); ++i) EXPECT_EQ(status[i], 0) << "seat " << active[i];
}

INSTANTIATE_TEST_SUITE_P(Seats, Holes,
                         ::testing::Values(std::vector<int>{0, 2, 3}, std::vector<int>{1, 3}, std::vector<int>{0, 1}));

TEST(MemberCollectives, FailuresNameSeatsNotInnerRanks) {
  // Seats {1, 3}: seat 3 (inner rank 1) dies; seat 1 must be told "3".
  auto status = runSeats({1, 3}, [](MemberCollectives& g) {
    if (g.rank() == 3) _exit(0);
    std::vector<float> v(10, 1.0f);
    OpResult r = g.allreduce(v.data(), v.data(), v.size(), DataType::kFloat32, ReduceOp::kSum);
    if (r.ok || r.failed_ranks != std::vector<int>{3}) return 1;
    return r.error.find("rank 3") != std::string::npos ? 0 : 2;
  });
  EXPECT_EQ(status[0], 0);
}

TEST(MemberCollectives, RefusesAnInnerGroupThatDoesNotMatch) {
  std::string error;
  auto inner = ShmGroup::open(testing::uniqueShmName("mc-member-mismatch"), 0, 1, ShmGroupOptions{}, &error);
  ASSERT_NE(inner, nullptr) << error;
  EXPECT_THROW(MemberCollectives({0, 2}, 0, std::move(inner)), std::invalid_argument);
}

}  // namespace
}  // namespace mooncake::pg
