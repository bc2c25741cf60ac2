// reduceInto against closed formulas, for every dtype and operator.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <vector>

#include "mooncake/pg/types.h"

namespace mooncake::pg {
namespace {

template <typename T>
std::vector<T> reduce(const std::vector<std::vector<T>>& inputs, DataType type, ReduceOp op) {
  std::vector<const void*> srcs;
  for (const auto& v : inputs) srcs.push_back(v.data());
  std::vector<T> out(inputs[0].size());
  reduceInto(out.data(), srcs.data(), static_cast<int>(srcs.size()), out.size(), type, op);
  return out;
}

TEST(Reduce, IntegersEveryOperator) {
  // rank r holds r + 1 + i at position i, for 4 ranks
  std::vector<std::vector<int32_t>> in(4, std::vector<int32_t>(1000));
  for (int r = 0; r < 4; ++r)
    for (int i = 0; i < 1000; ++i) in[r][i] = r + 1 + i;
  auto sum = reduce(in, DataType::kInt32, ReduceOp::kSum);
  auto avg = reduce(in, DataType::kInt32, ReduceOp::kAvg);
  auto prod = reduce(in, DataType::kInt32, ReduceOp::kProduct);
  auto mn = reduce(in, DataType::kInt32, ReduceOp::kMin);
  auto mx = reduce(in, DataType::kInt32, ReduceOp::kMax);
  auto band = reduce(in, DataType::kInt32, ReduceOp::kBand);
  auto bor = reduce(in, DataType::kInt32, ReduceOp::kBor);
  auto bxor = reduce(in, DataType::kInt32, ReduceOp::kBxor);
  for (int i = 0; i < 1000; ++i) {
    ASSERT_EQ(sum[i], 4 * i + 10);
    ASSERT_EQ(avg[i], (4 * i + 10) / 4);
    ASSERT_EQ(prod[i], static_cast<int32_t>(static_cast<uint32_t>(i + 1) * (i + 2) * (i + 3) * (i + 4)));
    ASSERT_EQ(mn[i], i + 1);
    ASSERT_EQ(mx[i], i + 4);
    ASSERT_EQ(band[i], (i + 1) & (i + 2) & (i + 3) & (i + 4));
    ASSERT_EQ(bor[i], (i + 1) | (i + 2) | (i + 3) | (i + 4));
    ASSERT_EQ(bxor[i], (i + 1) ^ (i + 2) ^ (i + 3) ^ (i + 4));
  }
}

TEST(Reduce, UnsignedWrapAndSmallTypes) {
  std::vector<std::vector<uint8_t>> in = {{200, 3}, {100, 5}};
  auto sum = reduce(in, DataType::kUInt8, ReduceOp::kSum);
  EXPECT_EQ(sum[0], 44);  // 300 mod 256
  EXPECT_EQ(sum[1], 8);
  std::vector<std::vector<int64_t>> big = {{1ll << 40}, {-(1ll << 41)}};
  EXPECT_EQ(reduce(big, DataType::kInt64, ReduceOp::kSum)[0], -(1ll << 40));
  std::vector<std::vector<uint8_t>> flags = {{1, 0, 1}, {1, 1, 0}};  // bool as bytes
  auto any = reduce(flags, DataType::kBool, ReduceOp::kSum);
  auto all = reduce(flags, DataType::kBool, ReduceOp::kProduct);
  EXPECT_EQ(any, (std::vector<uint8_t>{1, 1, 1}));
  EXPECT_EQ(all, (std::vector<uint8_t>{1, 0, 0}));
}

TEST(Reduce, FloatingMinMaxPropagateNaNAndAvgDivides) {
  std::vector<std::vector<double>> in = {{1.5, NAN, -2}, {0.5, 1, -4}};
  auto mn = reduce(in, DataType::kFloat64, ReduceOp::kMin);
  auto avg = reduce(in, DataType::kFloat64, ReduceOp::kAvg);
  EXPECT_EQ(mn[0], 0.5);
  EXPECT_TRUE(std::isnan(mn[1]));
  EXPECT_EQ(avg[0], 1.0);
  EXPECT_EQ(avg[2], -3.0);
}

TEST(Reduce, HalfTypesAccumulateInFp32) {
  // 2048 + 1 + 1 + 1 in fp16: adding 1 at a time would stay at 2048 (the
  // spacing there is 2); summed in fp32 it is 2051, which rounds to 2052.
  const uint16_t h2048 = 0x6800, h1 = 0x3c00, h2052 = 0x6802;
  std::vector<std::vector<uint16_t>> in = {{h2048}, {h1}, {h1}, {h1}};
  EXPECT_EQ(reduce(in, DataType::kFloat16, ReduceOp::kSum)[0], h2052);
  // bf16: 256 + 1 + 1 (spacing 2 at 256): fp32 sum 258 is exact in bf16.
  const uint16_t b256 = 0x4380, b1 = 0x3f80, b258 = 0x4381;
  std::vector<std::vector<uint16_t>> bin = {{b256}, {b1}, {b1}};
  EXPECT_EQ(reduce(bin, DataType::kBFloat16, ReduceOp::kSum)[0], b258);
}

TEST(Reduce, HalfConversionRoundTripsEveryFiniteValue) {
  // A one-source reduction converts to fp32 and back: it must be the identity.
  std::vector<uint16_t> all(65536);
  for (uint32_t i = 0; i < 65536; ++i) all[i] = static_cast<uint16_t>(i);
  for (DataType type : {DataType::kFloat16, DataType::kBFloat16}) {
    std::vector<uint16_t> out(65536);
    const void* src = all.data();
    reduceInto(out.data(), &src, 1, all.size(), type, ReduceOp::kSum);
    for (uint32_t i = 0; i < 65536; ++i) {
      bool nan = type == DataType::kFloat16 ? ((i & 0x7c00) == 0x7c00 && (i & 0x3ff)) : ((i & 0x7f80) == 0x7f80 && (i & 0x7f));
      if (nan) continue;
      ASSERT_EQ(out[i], all[i]) << dataTypeName(type) << " bits 0x" << std::hex << i;
    }
  }
}

TEST(Reduce, UnsupportedCombinationsAreNamed) {
  EXPECT_NE(reductionUnsupportedReason(DataType::kFloat32, ReduceOp::kBxor).find("integer"), std::string::npos);
  EXPECT_FALSE(reductionUnsupportedReason(DataType::kFloat8E4M3, ReduceOp::kSum).empty());
  EXPECT_TRUE(reductionUnsupportedReason(DataType::kBFloat16, ReduceOp::kAvg).empty());
  EXPECT_TRUE(reductionUnsupportedReason(DataType::kUInt64, ReduceOp::kBand).empty());
}

}  // namespace
}  // namespace mooncake::pg
