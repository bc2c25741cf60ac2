// The per-token rules of ElasticBuffer's layout kernels (elastic_layout.h,
// the code the kernels run), on the host, against closed forms and against
// a sort written here; no GPU. The kernels themselves are compared with
// rows_layout.py on a GPU by tests/python/ep/test_elastic_layout_kernels.py.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <random>
#include <vector>

#include "elastic_layout.h"

namespace mooncake::ep::cuda::layout {
namespace {

std::vector<int8_t> destinationsOf(const std::vector<int64_t>& picks, int num_local, int num_ranks) {
  std::vector<int8_t> out;
  for (int64_t p : picks) out.push_back(static_cast<int8_t>(destinationOf(p, num_local, num_ranks)));
  return out;
}

std::vector<int64_t> unique(const std::vector<int64_t>& picks, int num_local, int num_ranks) {
  const std::vector<int8_t> dests = destinationsOf(picks, num_local, num_ranks);
  std::vector<int64_t> out(picks.size());
  uniqueDestinations(dests.data(), static_cast<int>(dests.size()), out.data());
  return out;
}

TEST(EpElasticLayout, DestinationIsTheRankOfAnIdInRange) {
  // L = 3 local experts, R = 4 ranks: ids 0..11.
  EXPECT_EQ(destinationOf(0, 3, 4), 0);
  EXPECT_EQ(destinationOf(2, 3, 4), 0);
  EXPECT_EQ(destinationOf(3, 3, 4), 1);
  EXPECT_EQ(destinationOf(11, 3, 4), 3);
  EXPECT_EQ(destinationOf(-1, 3, 4), -1);
  EXPECT_EQ(destinationOf(-7, 3, 4), -1);
  EXPECT_EQ(destinationOf(12, 3, 4), -1);  // past the experts: counted as no pick
  // More experts than int32 holds: the 64-bit division.
  EXPECT_EQ(destinationOf(int64_t{5} << 30, 1 << 30, 8), 5);
  EXPECT_EQ(destinationOf((int64_t{8} << 30) - 1, 1 << 30, 8), 7);
  EXPECT_EQ(destinationMask(destinationsOf({0, 11, -1, 4, 5}, 3, 4).data(), 5), 0b1011u);
}

TEST(EpElasticLayout, UniqueDestinationsByHand) {
  // L = 2, R = 4: destinations 2, 0, 3, none -> none first, then ascending.
  EXPECT_EQ(unique({5, 1, 6, -1}, 2, 4), (std::vector<int64_t>{-1, 0, 2, 3}));
  // Destinations 0, 0, 1, 1: each rank once, its repeats -1 where they sorted.
  EXPECT_EQ(unique({0, 1, 2, 3}, 2, 4), (std::vector<int64_t>{0, -1, 1, -1}));
  EXPECT_EQ(unique({7, 6, 7, 6}, 2, 4), (std::vector<int64_t>{3, -1, -1, -1}));
  EXPECT_EQ(unique({-1, -1, -1}, 2, 4), (std::vector<int64_t>{-1, -1, -1}));
  EXPECT_EQ(unique({31, 0}, 1, 32), (std::vector<int64_t>{0, 31}));  // the last of 32 ranks
}

TEST(EpElasticLayout, UniqueDestinationsAreTheSortedPicksWithRepeatsCleared) {
  std::mt19937 rng(17);
  for (int trial = 0; trial < 2000; ++trial) {
    const int num_ranks = 1 + static_cast<int>(rng() % 32), num_local = 1 + static_cast<int>(rng() % 5);
    const int k = static_cast<int>(rng() % 10);
    const int64_t experts = static_cast<int64_t>(num_ranks) * num_local;
    std::vector<int64_t> picks(k);
    for (auto& p : picks) p = static_cast<int64_t>(rng() % (experts + 1)) - 1;
    // As rows_layout.unique_destinations: sort the destinations, then -1 where equal to the one before.
    std::vector<int64_t> expect(k);
    for (int j = 0; j < k; ++j) expect[j] = picks[j] < 0 ? -1 : picks[j] / num_local;
    std::sort(expect.begin(), expect.end());
    for (int j = k - 1; j > 0; --j) {
      if (expect[j] == expect[j - 1]) expect[j] = -1;
    }
    ASSERT_EQ(unique(picks, num_local, num_ranks), expect) << "trial " << trial;
  }
}

TEST(EpElasticLayout, TailBytesFollowTheRowFormat) {
  // Two tokens, payload 6 bytes (not whole 16-byte vectors: sent in the tail),
  // scales 4 bytes, k = 2: ids at 12 (aligned to 4), weights at 20, 28 bytes, tail 32.
  const std::vector<uint8_t> payload = {1, 2, 3, 4, 5, 6, 11, 12, 13, 14, 15, 16};
  const std::vector<uint8_t> scales = {21, 22, 23, 24, 31, 32, 33, 34};
  const std::vector<int64_t> ids = {0x0102030405060708, -1, 7, 0};
  const std::vector<float> weights = {1.0f, -2.0f, 0.5f, 0.0f};
  TailSources s;
  s.payload = payload.data();
  s.scales = scales.data();
  s.topk_idx = ids.data();
  s.weights = reinterpret_cast<const uint8_t*>(weights.data());
  s.payload_bytes = 6;
  s.scale_bytes = 4;
  s.head_bytes = 0;
  s.tail_bytes = 32;
  s.ids_at = 12;
  s.num_topk = 2;
  auto row = [&](int64_t token) {
    std::vector<uint8_t> out(32);
    for (int b = 0; b < 32; ++b) out[b] = tailByte(s, token, b);
    return out;
  };
  // tailWord: the same bytes a word at a time, in every configuration below.
  auto words_match = [&](int tail_bytes) {
    for (int64_t token = 0; token < 2; ++token) {
      for (int at = 0; at < tail_bytes; at += 4) {
        uint32_t bytes = 0;
        for (int b = 0; b < 4; ++b) bytes |= static_cast<uint32_t>(tailByte(s, token, at + b)) << (8 * b);
        EXPECT_EQ(tailWord(s, token, at), bytes) << "token " << token << ", byte " << at;
      }
    }
  };
  words_match(32);
  auto bytesOf = [](auto value) {
    std::vector<uint8_t> out(sizeof(value));
    std::memcpy(out.data(), &value, sizeof(value));
    return out;
  };
  std::vector<uint8_t> expect = {11, 12, 13, 14, 15, 16, 31, 32, 33, 34, 0, 0};
  for (const auto& part : {bytesOf(int32_t{7}), bytesOf(int32_t{0}), bytesOf(0.5f), bytesOf(0.0f)}) {
    expect.insert(expect.end(), part.begin(), part.end());
  }
  expect.resize(32, 0);
  EXPECT_EQ(row(1), expect);
  // Token 0: an id past 32 bits keeps its low 32 bits, as torch's .to(torch.int32).
  const std::vector<uint8_t> first = row(0);
  EXPECT_EQ(std::vector<uint8_t>(first.begin() + 12, first.begin() + 16), bytesOf(int32_t{0x05060708}));
  EXPECT_EQ(std::vector<uint8_t>(first.begin() + 16, first.begin() + 20), bytesOf(int32_t{-1}));

  // The payload sent as the head (16 bytes): the tail starts at the scales.
  const std::vector<uint8_t> wide(32, 9);
  s.payload = wide.data();
  s.payload_bytes = 16;
  s.head_bytes = 16;
  s.ids_at = 20;
  s.weights = nullptr;  // no weights: zeros
  s.tail_bytes = 16;
  for (int b = 0; b < 4; ++b) EXPECT_EQ(tailByte(s, 1, b), scales[4 + b]);
  EXPECT_EQ(tailByte(s, 1, 4), 7);                                    // id 7, little-endian
  for (int b = 8; b < 16; ++b) EXPECT_EQ(tailByte(s, 1, b), 0) << b;  // id 0, then no weights
  words_match(16);
  s.topk_idx = nullptr;  // ids not sent (cached dispatch): zeros
  EXPECT_EQ(tailByte(s, 1, 4), 0);
  words_match(16);
  // Ids off a word of the row (never so in RowFormat, which aligns them): byte by byte.
  s.topk_idx = ids.data();
  s.weights = reinterpret_cast<const uint8_t*>(weights.data());
  s.ids_at = 22;
  words_match(16);
}

TEST(EpElasticLayout, LocalPicksAreThisRanksExpertsOfRealRows) {
  // L = 4, rank 2: global ids 8..11 are its experts 0..3.
  EXPECT_EQ(localPick(8, true, 2, 4), 0);
  EXPECT_EQ(localPick(11, true, 2, 4), 3);
  EXPECT_EQ(localPick(7, true, 2, 4), -1);
  EXPECT_EQ(localPick(12, true, 2, 4), -1);
  EXPECT_EQ(localPick(-1, true, 2, 4), -1);
  EXPECT_EQ(localPick(9, false, 2, 4), -1);  // a row past those received
  EXPECT_EQ(localPick(0, true, 0, 4), 0);
}

TEST(EpElasticLayout, SourceOfARowIsTheFirstSourceEndingPastIt) {
  // Counts 2, 0, 3 per source: rows 0-1 from 0, rows 2-4 from 2, past them the last source.
  const int64_t ends[] = {2, 2, 5};
  const int expect[] = {0, 0, 2, 2, 2, 2, 2};
  for (int row = 0; row < 7; ++row) EXPECT_EQ(sourceOfRow(row, ends, 3), expect[row]) << row;
  const int64_t nothing[] = {0, 0};
  EXPECT_EQ(sourceOfRow(0, nothing, 2), 1);
  const int64_t one[] = {4};
  EXPECT_EQ(sourceOfRow(9, one, 1), 0);
}

}  // namespace
}  // namespace mooncake::ep::cuda::layout
