// Checks that need no GPU: the test's own FP8 encoder (the CPU reference the
// kernels are compared with) against CUDA's conversion, and the receive
// region's layout (no two parts overlap, offsets aligned).
#include <cuda_fp8.h>
#include <gtest/gtest.h>

#include "ep_reference.h"
#include "region_layout.h"

namespace mooncake::ep::cuda::testing {
namespace {

TEST(EpReference, E4m3EncoderMatchesCudaConversion) {
  Rng rng(3);
  for (int i = 0; i < 200000; ++i) {
    float v = (rng.unit() * 2.0f - 1.0f) * std::ldexp(1.0f, rng.below(30) - 20);
    v = std::fmin(std::fmax(v, -448.0f), 448.0f);
    const auto cuda = static_cast<uint8_t>(__nv_cvt_float_to_fp8(v, __NV_SATFINITE, __NV_E4M3));
    ASSERT_EQ(e4m3(v), cuda) << std::hexfloat << v;
  }
  for (float v : {0.0f, -0.0f, 448.0f, -448.0f, 0x1p-9f, 0x1p-10f, 0x3p-11f, 0x1p-6f, 0x1.fp-7f, 240.0f, 232.0f}) {
    EXPECT_EQ(e4m3(v), static_cast<uint8_t>(__nv_cvt_float_to_fp8(v, __NV_SATFINITE, __NV_E4M3))) << std::hexfloat << v;
  }
}

TEST(EpReference, QuantizedTokenDequantizesWithinHalfAStep) {
  Sizes s;
  const RankInputs in = makeInputs(s, 7, 0, 0);
  std::vector<uint8_t> data(s.H);
  std::vector<float> scales(s.H / 128);
  quantize(in.x.data(), s.H, data.data(), scales.data());
  for (int c = 0; c < s.H; ++c) {
    const float x = bf16ToFloat(in.x[c]);
    const int exponent = data[c] >> 3 & 15, mantissa = data[c] & 7;
    const float magnitude = exponent == 0 ? std::ldexp(static_cast<float>(mantissa), -9)
                                          : std::ldexp(static_cast<float>(8 + mantissa), exponent - 10);
    const float back = (data[c] & 0x80 ? -magnitude : magnitude) * scales[c / 128];
    EXPECT_LE(std::fabs(back - x), std::fabs(x) * 0x1p-4f + scales[c / 128] * 0x1p-9f) << c;
  }
}

TEST(EpRegionLayout, PartsDoNotOverlapAndStayAligned) {
  for (int ranks : {1, 2, 8, 32}) {
    const RegionLayout l = RegionLayout::make(64, 7168, ranks * 8, ranks);
    EXPECT_GE(l.combine_signals, l.dispatchSignal(1, l.L - 1, ranks - 1) + 8);
    EXPECT_GE(l.counters, l.combineSignal(1, l.E - 1) + 8);
    EXPECT_EQ(l.counters % 16, 0u);
    EXPECT_GE(l.departed_seen, l.counters + kCountersBytes);
    EXPECT_EQ(l.departed_seen % 4, 0u);
    EXPECT_GE(l.send_tallies, l.departed_seen + 4 * static_cast<size_t>(ranks));
    EXPECT_EQ(l.send_tallies % 8, 0u);
    EXPECT_GE(l.carried_rows, l.sendTally(1, l.E - 1) + 8);
    EXPECT_EQ(l.carried_rows % 16, 0u);
    EXPECT_EQ(l.carriedRow(1, 0) - l.carriedRow(0, 0), static_cast<size_t>(ranks) * kCarriedRowBytes);
    EXPECT_GE(l.dispatch_rows, l.carriedRow(1, ranks - 1) + kCarriedRowBytes);
    EXPECT_GE(l.combine_rows, l.dispatchMessage(1, l.L - 1, ranks - 1, l.T - 1) + l.msg_stride);
    EXPECT_GE(l.total, l.combineRow(1, l.E - 1, l.T - 1) + 2 * static_cast<size_t>(l.H));
    EXPECT_EQ(l.msg_stride % 16, 0u);
    EXPECT_EQ(l.dispatch_rows % 16, 0u);
    EXPECT_EQ(l.combine_rows % 16, 0u);
    // The FP8 payload (data, then scales) fits the bf16-sized message.
    EXPECT_LE(kMessageHeaderBytes + l.H + l.H / kChannelsPerScale * 4, l.msg_stride);
  }
}

TEST(EpRegionLayout, OutputSlotsFollowTheCombineRowsAndHoldEveryRowOfTheWidestCall) {
  for (int ranks : {1, 2, 8}) {
    const RegionLayout none = RegionLayout::make(64, 7168, ranks, ranks);
    for (int slots : {1, 3}) {
      const RegionLayout l = RegionLayout::make(64, 7168, ranks, ranks, slots);
      EXPECT_EQ(l.combine_rows, none.combine_rows) << "the slots come after every other part";
      EXPECT_EQ(l.outputSlot(0), none.total);
      EXPECT_GE(l.output_slot_bytes, static_cast<size_t>(ranks) * l.T * 2 * l.H);
      EXPECT_EQ(l.outputSlot(0) % 4096, 0u);
      EXPECT_EQ(l.outputSlot(1) - l.outputSlot(0), l.output_slot_bytes);
      EXPECT_EQ(l.total, l.outputSlot(slots - 1) + l.output_slot_bytes);
    }
  }
}

}  // namespace
}  // namespace mooncake::ep::cuda::testing
