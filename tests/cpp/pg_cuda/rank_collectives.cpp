// Every collective against closed formulas (int32, fp32, fp16, bf16; one
// element, odd sizes, 16 MiB; in place and out of place; operations
// alternating between two streams), and every dtype x reduction against the
// CPU's reduceInto on random data, NaN included.
#include <cmath>
#include <random>
#include <type_traits>

#include "rank_support.h"

namespace mooncake::pg::cuda::testing {
namespace {

// Compares got[offset + i] with expected(i), as the bits of T.
template <typename T, typename F>
int expectAll(CudaIpcGroup& g, const std::string& what, const std::vector<T>& got, size_t offset, size_t count,
              F expected) {
  int failures = 0;
  for (size_t i = 0; i < count; ++i) {
    const T want = Host<T>::make(expected(i));
    if (std::memcmp(&got[offset + i], &want, sizeof(T)) != 0) {
      RANK_CHECK(false, "%s: element %zu is %g, expected %g", what.c_str(), i, Host<T>::read(got[offset + i]),
                 Host<T>::read(want));
      break;
    }
  }
  return failures;
}

template <typename T>
std::vector<T> pattern(size_t count, double (*value)(int, size_t), int rank) {
  std::vector<T> v(count);
  for (size_t i = 0; i < count; ++i) v[i] = Host<T>::make(value(rank, i));
  return v;
}

template <typename T>
int everyCollective(CudaIpcGroup& g, size_t count, Stream& a, Stream& b) {
  int failures = 0;
  const int W = g.size(), R = g.rank();
  const DataType type = Host<T>::kType;
  const size_t bytes = count * sizeof(T);
  auto label = [&](const char* op) {
    return std::string(op) + " " + dataTypeName(type) + " x" + std::to_string(count);
  };
  auto ran = [&](const char* op, const CudaOp& issued) {
    const OpResult r = complete(g, issued);
    RANK_CHECK(r.ok, "%s: %s", label(op).c_str(), r.error.c_str());
    return r.ok;
  };
  auto value = [](int r, size_t i) { return static_cast<double>(r + 1 + i % 7); };
  const double sum_base = W * (W + 1) / 2.0;

  DeviceBuffer input(bytes), output(bytes * W), io(bytes), blocks(bytes * W);
  input.upload(pattern<T>(count, value, R), a);

  if (ran("all_reduce sum", g.allreduce(input.get(), output.get(), count, type, ReduceOp::kSum, a))) {
    failures += expectAll(g, label("all_reduce sum"), output.download<T>(count, a), 0, count,
                          [&](size_t i) { return sum_base + W * (i % 7); });
  }
  // In place, on the other stream: the group orders it after the previous one.
  io.upload(pattern<T>(count, value, R), b);
  if (ran("all_reduce max in place", g.allreduce(io.get(), io.get(), count, type, ReduceOp::kMax, b))) {
    failures += expectAll(g, label("all_reduce max in place"), io.download<T>(count, b), 0, count,
                          [&](size_t i) { return static_cast<double>(W + i % 7); });
  }
  if (ran("all_reduce avg", g.allreduce(input.get(), output.get(), count, type, ReduceOp::kAvg, a))) {
    failures += expectAll(g, label("all_reduce avg"), output.download<T>(count, a), 0, count, [&](size_t i) {
      const double sum = sum_base + W * (i % 7);
      return std::is_integral_v<T> ? static_cast<double>(static_cast<int64_t>(sum) / W) : sum / W;
    });
  }
  io.upload(pattern<T>(count, [](int r, size_t i) { return 1.0 + (r + i) % 2; }, R), a);
  if (ran("all_reduce product", g.allreduce(io.get(), output.get(), count, type, ReduceOp::kProduct, a))) {
    failures += expectAll(g, label("all_reduce product"), output.download<T>(count, a), 0, count, [&](size_t i) {
      double p = 1;
      for (int r = 0; r < W; ++r) p *= 1.0 + (r + i) % 2;
      return p;
    });
  }
  // reduce to the last rank; the others' output stays as it was.
  const int reduce_root = W - 1;
  output.upload(pattern<T>(count, [](int, size_t) { return -3.0; }, R), a);
  if (ran("reduce min", g.reduce(input.get(), output.get(), count, type, ReduceOp::kMin, reduce_root, b))) {
    failures += expectAll(g, label("reduce min"), output.download<T>(count, b), 0, count,
                          [&](size_t i) { return R == reduce_root ? 1.0 + i % 7 : -3.0; });
  }
  const int bcast_root = W / 2;
  auto broadcast_value = [](int is_root, size_t i) { return is_root ? 50.0 + i % 11 : 0.0; };
  io.upload(pattern<T>(count, broadcast_value, R == bcast_root), a);
  if (ran("broadcast", g.broadcast(io.get(), bytes, bcast_root, a))) {
    failures += expectAll(g, label("broadcast"), io.download<T>(count, a), 0, count,
                          [](size_t i) { return 50.0 + i % 11; });
  }
  if (ran("all_gather", g.allgather(input.get(), output.get(), bytes, b))) {
    const std::vector<T> got = output.download<T>(count * W, b);
    for (int s = 0; s < W; ++s) {
      failures += expectAll(g, label("all_gather"), got, s * count, count, [&](size_t i) { return value(s, i); });
    }
  }
  // In place: this rank's block already sits in the output.
  output.upload(pattern<T>(count * W, [](int, size_t) { return -9.0; }, R), a);
  output.upload(pattern<T>(count, value, R), a, R * bytes);
  if (ran("all_gather in place", g.allgather(output.get() + R * bytes, output.get(), bytes, a))) {
    const std::vector<T> got = output.download<T>(count * W, a);
    for (int s = 0; s < W; ++s) {
      failures +=
          expectAll(g, label("all_gather in place"), got, s * count, count, [&](size_t i) { return value(s, i); });
    }
  }
  // reduce_scatter: block d of rank s holds 10 s + d + i % 3.
  std::vector<T> rs(count * W);
  for (int d = 0; d < W; ++d) {
    for (size_t i = 0; i < count; ++i) rs[d * count + i] = Host<T>::make(10.0 * R + d + i % 3);
  }
  blocks.upload(rs, a);
  if (ran("reduce_scatter sum", g.reduceScatter(blocks.get(), io.get(), count, type, ReduceOp::kSum, a))) {
    failures += expectAll(g, label("reduce_scatter sum"), io.download<T>(count, a), 0, count,
                          [&](size_t i) { return 10.0 * W * (W - 1) / 2 + W * (R + static_cast<double>(i % 3)); });
  }
  output.upload(pattern<T>(count * W, [](int, size_t) { return -1.0; }, R), a);
  if (ran("gather", g.gather(input.get(), output.get(), bytes, 0, a))) {
    const std::vector<T> got = output.download<T>(count * W, a);
    for (int s = 0; s < W; ++s) {
      failures += expectAll(g, label("gather"), got, s * count, count,
                            [&](size_t i) { return R == 0 ? value(s, i) : -1.0; });
    }
  }
  const int scatter_root = W - 1;
  std::vector<T> sc(count * W);
  for (int d = 0; d < W; ++d) {
    for (size_t i = 0; i < count; ++i) sc[d * count + i] = Host<T>::make(20.0 + d + i % 5);
  }
  blocks.upload(sc, a);
  io.upload(pattern<T>(count, [](int, size_t) { return -1.0; }, R), a);
  if (ran("scatter", g.scatter(blocks.get(), io.get(), bytes, scatter_root, b))) {
    failures += expectAll(g, label("scatter"), io.download<T>(count, b), 0, count,
                          [&](size_t i) { return 20.0 + R + i % 5; });
  }
  return failures;
}

// Uneven all-to-all: rank s sends (s + d + 1) * unit bytes to d; byte j of
// that block is (31 s + 7 d + j) mod 256. Odd units put blocks at odd offsets.
int unevenAlltoall(CudaIpcGroup& g, size_t unit, Stream& stream) {
  int failures = 0;
  const int W = g.size(), R = g.rank();
  std::vector<size_t> send_offsets(W), send_bytes(W), recv_offsets(W), recv_bytes(W);
  size_t send_total = 0, recv_total = 0;
  for (int p = 0; p < W; ++p) {
    send_bytes[p] = (R + p + 1) * unit;
    send_offsets[p] = send_total;
    send_total += send_bytes[p];
    recv_bytes[p] = (p + R + 1) * unit;
    recv_offsets[p] = recv_total;
    recv_total += recv_bytes[p];
  }
  std::vector<uint8_t> in(send_total);
  for (int d = 0; d < W; ++d) {
    for (size_t j = 0; j < send_bytes[d]; ++j) in[send_offsets[d] + j] = static_cast<uint8_t>(31 * R + 7 * d + j);
  }
  DeviceBuffer input(send_total), output(recv_total);
  input.upload(in, stream);
  output.upload(std::vector<uint8_t>(recv_total, 0xee), stream);
  const OpResult r = complete(g, g.alltoall(input.get(), send_offsets, send_bytes, output.get(), recv_offsets,
                                            recv_bytes, stream));
  RANK_CHECK(r.ok, "all_to_all unit %zu: %s", unit, r.error.c_str());
  if (!r.ok) return failures;
  const std::vector<uint8_t> got = output.download<uint8_t>(recv_total, stream);
  for (int s = 0; s < W; ++s) {
    for (size_t j = 0; j < recv_bytes[s]; ++j) {
      if (got[recv_offsets[s] + j] != static_cast<uint8_t>(31 * s + 7 * R + j)) {
        RANK_CHECK(false, "all_to_all unit %zu: byte %zu from rank %d is %d", unit, j, s, got[recv_offsets[s] + j]);
        break;
      }
    }
  }
  return failures;
}

// Random elements of any type: integers over their whole range, bool 0/1,
// floating values in [-8, 8) with one NaN in 64.
std::vector<char> randomElements(DataType type, size_t count, uint64_t seed) {
  std::mt19937_64 rng(seed);
  const size_t esize = elementSize(type);
  std::vector<char> out(count * esize);
  std::uniform_real_distribution<double> real(-8.0, 8.0);
  for (size_t i = 0; i < count; ++i) {
    char* e = out.data() + i * esize;
    const uint64_t bits = rng();
    const double v = (bits & 63) == 0 ? NAN : real(rng);
    switch (type) {
      case DataType::kBool: *e = static_cast<char>(bits & 1); break;
      case DataType::kFloat32: { float f = static_cast<float>(v); std::memcpy(e, &f, 4); break; }
      case DataType::kFloat64: std::memcpy(e, &v, 8); break;
      case DataType::kFloat16: { __half h = __float2half(static_cast<float>(v)); std::memcpy(e, &h, 2); break; }
      case DataType::kBFloat16: {
        __nv_bfloat16 h = __float2bfloat16(static_cast<float>(v));
        std::memcpy(e, &h, 2);
        break;
      }
      default: std::memcpy(e, &bits, esize); break;
    }
  }
  return out;
}

double asDouble(DataType type, const char* e) {
  switch (type) {
    case DataType::kFloat32: { float f; std::memcpy(&f, e, 4); return f; }
    case DataType::kFloat64: { double d; std::memcpy(&d, e, 8); return d; }
    case DataType::kFloat16: { __half h; std::memcpy(&h, e, 2); return __half2float(h); }
    case DataType::kBFloat16: { __nv_bfloat16 h; std::memcpy(&h, e, 2); return __bfloat162float(h); }
    default: return 0;
  }
}

bool isFloating(DataType t) {
  return t == DataType::kFloat16 || t == DataType::kBFloat16 || t == DataType::kFloat32 || t == DataType::kFloat64;
}

// Same bits, except that any NaN equals any NaN.
size_t firstDifference(DataType type, const std::vector<char>& a, const std::vector<char>& b) {
  const size_t esize = elementSize(type), count = a.size() / esize;
  for (size_t i = 0; i < count; ++i) {
    const char *x = a.data() + i * esize, *y = b.data() + i * esize;
    if (std::memcmp(x, y, esize) == 0) continue;
    if (isFloating(type) && std::isnan(asDouble(type, x)) && std::isnan(asDouble(type, y))) continue;
    return i;
  }
  return count;
}

}  // namespace

int everyCollectiveScenario(CudaIpcGroup& g) {
  int failures = 0;
  Stream a, b;
  for (size_t bytes_or_count : {size_t{1}, size_t{1027}, size_t{300007}, size_t{16} << 20}) {
    const bool is_bytes = bytes_or_count == (size_t{16} << 20);  // 16 MiB of each type
    failures += everyCollective<int32_t>(g, is_bytes ? bytes_or_count / 4 : bytes_or_count, a, b);
    failures += everyCollective<float>(g, is_bytes ? bytes_or_count / 4 : bytes_or_count, a, b);
    failures += everyCollective<__half>(g, is_bytes ? bytes_or_count / 2 : bytes_or_count, a, b);
    failures += everyCollective<__nv_bfloat16>(g, is_bytes ? bytes_or_count / 2 : bytes_or_count, a, b);
  }
  for (size_t unit : {size_t{1}, size_t{1027}, size_t{4} << 20}) failures += unevenAlltoall(g, unit, a);
  // Empty operations and a barrier complete too.
  DeviceBuffer scratch(64);
  for (const CudaOp& op : {g.allreduce(scratch.get(), scratch.get(), 0, DataType::kFloat32, ReduceOp::kSum, a),
                           g.allgather(scratch.get(), scratch.get(), 0, b), g.barrier(a)}) {
    const OpResult r = complete(g, op);
    RANK_CHECK(r.ok, "empty operation or barrier: %s", r.error.c_str());
  }
  failures += unevenAlltoall(g, 0, b);
  return failures;
}

int reductionsMatchCpuScenario(CudaIpcGroup& g) {
  int failures = 0;
  const int W = g.size(), R = g.rank();
  Stream stream;
  for (int t = 0; t <= static_cast<int>(DataType::kBool); ++t) {
    const DataType type = static_cast<DataType>(t);
    const size_t esize = elementSize(type);
    for (int o = 0; o <= static_cast<int>(ReduceOp::kBxor); ++o) {
      const ReduceOp op = static_cast<ReduceOp>(o);
      const std::string name = std::string(dataTypeName(type)) + " " + reduceOpName(op);
      DeviceBuffer scratch(64);
      if (!reductionUnsupportedReason(type, op).empty()) {
        const CudaOp refused = g.allreduce(scratch.get(), scratch.get(), 1, type, op, stream);
        RANK_CHECK(!refused.result.ok && refused.id == 0, "%s should be refused before anything is enqueued",
                   name.c_str());
        continue;
      }
      // One shot, and reduce-scatter + all-gather over several rounds.
      for (size_t count : {size_t{1003}, 3 * (size_t{256} << 10) / esize + 5}) {
        auto seed = [&](int rank, int block) {
          return (uint64_t(t) << 48) ^ (uint64_t(o) << 40) ^ (count << 8) ^ (rank << 4) ^ block;
        };
        // all_reduce
        std::vector<std::vector<char>> inputs;
        std::vector<const void*> srcs;
        for (int r = 0; r < W; ++r) inputs.push_back(randomElements(type, count, seed(r, 0)));
        for (auto& in : inputs) srcs.push_back(in.data());
        std::vector<char> expected(count * esize);
        reduceInto(expected.data(), srcs.data(), W, count, type, op);
        DeviceBuffer input(count * esize * W), output(count * esize);
        input.upload(inputs[R], stream);
        OpResult r = complete(g, g.allreduce(input.get(), output.get(), count, type, op, stream));
        RANK_CHECK(r.ok, "all_reduce %s x%zu: %s", name.c_str(), count, r.error.c_str());
        if (r.ok) {
          const size_t i = firstDifference(type, output.download<char>(count * esize, stream), expected);
          RANK_CHECK(i == count, "all_reduce %s x%zu differs from the CPU at element %zu", name.c_str(), count, i);
        }
        // reduce_scatter: block d of rank r from seed(r, d + 1).
        std::vector<char> blocks;
        for (int d = 0; d < W; ++d) {
          const std::vector<char> block = randomElements(type, count, seed(R, d + 1));
          blocks.insert(blocks.end(), block.begin(), block.end());
        }
        inputs.clear();
        srcs.clear();
        for (int s = 0; s < W; ++s) inputs.push_back(randomElements(type, count, seed(s, R + 1)));
        for (auto& in : inputs) srcs.push_back(in.data());
        reduceInto(expected.data(), srcs.data(), W, count, type, op);
        input.upload(blocks, stream);
        r = complete(g, g.reduceScatter(input.get(), output.get(), count, type, op, stream));
        RANK_CHECK(r.ok, "reduce_scatter %s x%zu: %s", name.c_str(), count, r.error.c_str());
        if (r.ok) {
          const size_t i = firstDifference(type, output.download<char>(count * esize, stream), expected);
          RANK_CHECK(i == count, "reduce_scatter %s x%zu differs from the CPU at element %zu", name.c_str(), count, i);
        }
      }
    }
  }
  return failures;
}

}  // namespace mooncake::pg::cuda::testing
