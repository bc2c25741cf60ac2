// The EP tests' inputs and expected results, on the CPU, written from the
// semantics (docs/ep.md), independent of the kernels: every rank regenerates
// every rank's inputs from the seed, so each checks its own outputs alone.
// Build with -ffp-contract=off: the float arithmetic must be exactly the
// multiply-then-add the kernels do.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

namespace mooncake::ep::cuda::testing {

struct Sizes {
  int R = 1, T = 24, H = 384, L = 3, K = 4;
  int E() const { return R * L; }
  int S() const { return R * T; }
};

class Rng {  // splitmix64
 public:
  explicit Rng(uint64_t seed) : s_(seed) {}
  uint64_t next() {
    uint64_t z = (s_ += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
  }
  int below(int n) { return static_cast<int>(next() % static_cast<uint64_t>(n)); }
  float unit() { return static_cast<float>(next() >> 40) / static_cast<float>(1ull << 24); }  // [0, 1)

 private:
  uint64_t s_;
};

inline float bf16ToFloat(uint16_t b) {
  const uint32_t bits = static_cast<uint32_t>(b) << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

// Round to nearest even (finite inputs).
inline uint16_t floatToBf16(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, 4);
  const uint32_t rounding = 0x7fff + ((bits >> 16) & 1);
  return static_cast<uint16_t>((bits + rounding) >> 16);
}

constexpr uint16_t kBf16Nan = 0x7fc0;

// e4m3 (float8_e4m3fn) of a value already clamped to [-448, 448], round to
// nearest even, from the format's definition: 4 exponent bits (bias 7), 3
// mantissa bits, subnormals below 2^-6 in steps of 2^-9.
inline uint8_t e4m3(float v) {
  const uint8_t sign = std::signbit(v) ? 0x80 : 0;
  const float a = std::fabs(v);
  if (a < 0x1p-6f) return sign | static_cast<uint8_t>(std::nearbyint(a * 512.0f));  // 8 encodes 2^-6 itself
  int e = 0;
  std::frexp(a, &e);
  int exponent = e - 1;
  float q = std::nearbyint(std::ldexp(a, 3 - exponent));  // in [8, 16]
  if (q == 16.0f) {
    q = 8.0f;
    ++exponent;
  }
  return sign | static_cast<uint8_t>(((exponent + 7) << 3) | (static_cast<int>(q) - 8));
}

// One token's FP8 wire form: the collective path's arithmetic on CUDA
// (fp8.py under torch): factor = (1 / amax) * 448, scale = amax * (1 / 448).
inline void quantize(const uint16_t* x, int hidden, uint8_t* data, float* scales) {
  for (int g = 0; g < hidden / 128; ++g) {
    float amax = 0.0f;
    for (int c = 0; c < 128; ++c) amax = std::fmax(amax, std::fabs(bf16ToFloat(x[g * 128 + c])));
    amax = std::fmax(amax, 1e-4f);
    const float factor = (1.0f / amax) * 448.0f;
    for (int c = 0; c < 128; ++c) {
      const float scaled = bf16ToFloat(x[g * 128 + c]) * factor;
      data[g * 128 + c] = e4m3(std::fmin(std::fmax(scaled, -448.0f), 448.0f));
    }
    scales[g] = amax * (1.0f / 448.0f);
  }
}

struct RankInputs {
  int num_tokens = 0;
  std::vector<uint16_t> x;     // bf16 [num_tokens, H]
  std::vector<int64_t> idx;    // [num_tokens, K]
  std::vector<float> weights;  // [num_tokens, K]
};

// Rank `rank`'s inputs of call `call`: any token count up to T (0 included),
// values over many binades (so FP8 scales differ per group), distinct
// experts per token, about a fifth of the picks -1.
inline RankInputs makeInputs(const Sizes& s, uint64_t seed, int rank, int call) {
  Rng rng(seed * 1000003u + static_cast<uint64_t>(rank) * 7919u + static_cast<uint64_t>(call) * 104729u);
  RankInputs in;
  const int pick = rng.below(4);
  in.num_tokens = pick == 0 ? s.T : pick == 1 ? 0 : 1 + rng.below(s.T);
  if (call == 0) in.num_tokens = s.T;  // the first call always fills the slots
  in.x.resize(static_cast<size_t>(in.num_tokens) * s.H);
  for (int t = 0; t < in.num_tokens; ++t) {
    for (int g = 0; g < s.H / 128; ++g) {
      const float binade = std::ldexp(1.0f, rng.below(24) - 12);
      for (int c = 0; c < 128; ++c) {
        in.x[static_cast<size_t>(t) * s.H + g * 128 + c] = floatToBf16((rng.unit() * 2.0f - 1.0f) * binade);
      }
    }
  }
  const int k_used = s.K < s.E() ? s.K : s.E();
  in.idx.assign(static_cast<size_t>(in.num_tokens) * s.K, -1);
  in.weights.resize(static_cast<size_t>(in.num_tokens) * s.K);
  for (int t = 0; t < in.num_tokens; ++t) {
    std::vector<int> experts(s.E());
    for (int e = 0; e < s.E(); ++e) experts[e] = e;
    for (int k = 0; k < k_used; ++k) {  // a partial Fisher-Yates: distinct experts
      const int j = k + rng.below(s.E() - k);
      std::swap(experts[k], experts[j]);
      in.idx[static_cast<size_t>(t) * s.K + k] = rng.below(5) == 0 ? -1 : experts[k];
    }
    for (int k = 0; k < s.K; ++k) in.weights[static_cast<size_t>(t) * s.K + k] = rng.unit();
  }
  return in;
}

inline bool picks(const RankInputs& in, const Sizes& s, int t, int expert) {
  for (int k = 0; k < s.K; ++k) {
    if (in.idx[static_cast<size_t>(t) * s.K + k] == expert) return true;
  }
  return false;
}

// The rows local expert `le` of rank `me` receives: (source rank, token), by
// source then token, from the ranks `active` keeps (none when `me` is not).
struct Row {
  int src, token;
};
inline std::vector<Row> expectedRows(const Sizes& s, const std::vector<RankInputs>& all, const std::vector<int>& active,
                                     int me, int le) {
  std::vector<Row> rows;
  if (!active[me]) return rows;
  for (int src = 0; src < s.R; ++src) {
    if (!active[src]) continue;
    for (int t = 0; t < all[src].num_tokens; ++t) {
      if (picks(all[src], s, t, me * s.L + le)) rows.push_back({src, t});
    }
  }
  return rows;
}

// What the test's "expert" returns for token x at global expert e: a bf16
// row that differs per expert and per channel.
inline uint16_t expertOutput(uint16_t x, int expert, int channel) {
  const float scale = 0.5f + static_cast<float>(expert % 7) * 0.25f;
  const float shift = static_cast<float>((channel * 31 + expert) % 17) * 0.0625f - 0.5f;
  return floatToBf16(bf16ToFloat(x) * scale + shift);
}

// Combine at the token's rank: float32 multiply, then add, in k order,
// rounded to bf16 once; -1 picks and masked owners skipped.
inline std::vector<uint16_t> expectedCombine(const Sizes& s, const RankInputs& in, const std::vector<int>& active,
                                             int me) {
  std::vector<uint16_t> out(static_cast<size_t>(in.num_tokens) * s.H);
  for (int t = 0; t < in.num_tokens; ++t) {
    for (int h = 0; h < s.H; ++h) {
      float acc = 0.0f;
      for (int k = 0; active[me] && k < s.K; ++k) {
        const int64_t e = in.idx[static_cast<size_t>(t) * s.K + k];
        if (e < 0 || !active[e / s.L]) continue;
        const float y = bf16ToFloat(expertOutput(in.x[static_cast<size_t>(t) * s.H + h], static_cast<int>(e), h));
        const float product = y * in.weights[static_cast<size_t>(t) * s.K + k];
        acc = acc + product;
      }
      out[static_cast<size_t>(t) * s.H + h] = floatToBf16(acc);
    }
  }
  return out;
}

}  // namespace mooncake::ep::cuda::testing
