// What one GPU can move into another over their link, by each means a
// collective could use: the copy engines (cudaMemcpyPeerAsync), SM kernels
// that pull (read the peer, write locally) and SM kernels that push (read
// locally, write the peer); one direction at a time and both at once (an
// all_reduce loads both). It answers which way the CUDA backend's kernels
// should move data between GPUs, and what the best of them reaches.
//
//   nvcc -O3 -arch=sm_90 -I mooncake-pg/cuda/common/include -o nvlink_probe benchmarks/nvlink_probe.cu && ./nvlink_probe [blocks_per_sm ...]
//
// Needs two GPUs with peer access. Prints GB/s per direction (bytes / time).
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <vector>

#include "mooncake/pg/cuda/common/copy_range.cuh"

#define CHECK(x)                                                                    \
  do {                                                                              \
    cudaError_t e_ = (x);                                                           \
    if (e_ != cudaSuccess) {                                                        \
      std::fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #x, cudaGetErrorString(e_)); \
      std::exit(1);                                                                 \
    }                                                                               \
  } while (0)

// Grid-stride copy of 16-byte words with the loop the CUDA backend's copy
// kernels use (copy_range.cuh: four loads in flight per thread).
__global__ void copyKernel(const uint4* src, uint4* dst, size_t words) {
  const size_t stride = static_cast<size_t>(gridDim.x) * blockDim.x;
  mooncake::pg::cuda::copyWords(src, dst, words, static_cast<size_t>(blockIdx.x) * blockDim.x + threadIdx.x, stride);
}

struct Side {
  int device;
  cudaStream_t stream;
  cudaEvent_t start, stop;
  uint4* local_a;  // source or destination on this GPU
  uint4* local_b;
};

enum class Means { kCopyEngine, kPull, kPush };
const char* name(Means m) { return m == Means::kCopyEngine ? "copy engine" : m == Means::kPull ? "SM pull" : "SM push"; }

// Side s moves `bytes` between itself and the other side, by `means`.
void enqueue(Side& s, Side& peer, Means m, size_t bytes, int blocks) {
  CHECK(cudaSetDevice(s.device));
  const size_t words = bytes / 16;
  switch (m) {
    case Means::kCopyEngine:  // from this GPU into the peer's buffer
      CHECK(cudaMemcpyPeerAsync(peer.local_b, peer.device, s.local_a, s.device, bytes, s.stream));
      break;
    case Means::kPull:  // this GPU's SMs read the peer's buffer
      copyKernel<<<blocks, 512, 0, s.stream>>>(peer.local_a, s.local_b, words);
      break;
    case Means::kPush:  // this GPU's SMs write the peer's buffer
      copyKernel<<<blocks, 512, 0, s.stream>>>(s.local_a, peer.local_b, words);
      break;
  }
}

// Median seconds of `reps` runs, each side's time measured on its stream.
double timeIt(Side* sides, int active, Means m, size_t bytes, int blocks, int reps) {
  std::vector<double> t;
  for (int r = 0; r < reps + 1; ++r) {
    for (int i = 0; i < 2; ++i) {
      CHECK(cudaSetDevice(sides[i].device));
      CHECK(cudaDeviceSynchronize());
    }
    for (int i = 0; i < active; ++i) {
      CHECK(cudaSetDevice(sides[i].device));
      CHECK(cudaEventRecord(sides[i].start, sides[i].stream));
      enqueue(sides[i], sides[1 - i], m, bytes, blocks);
      CHECK(cudaSetDevice(sides[i].device));
      CHECK(cudaEventRecord(sides[i].stop, sides[i].stream));
    }
    double worst = 0;
    for (int i = 0; i < active; ++i) {
      CHECK(cudaEventSynchronize(sides[i].stop));
      float ms = 0;
      CHECK(cudaEventElapsedTime(&ms, sides[i].start, sides[i].stop));
      worst = std::max(worst, ms * 1e-3);
    }
    if (r > 0) t.push_back(worst);  // the first run warms up
  }
  std::sort(t.begin(), t.end());
  return t[t.size() / 2];
}

int main(int argc, char** argv) {
  int count = 0;
  CHECK(cudaGetDeviceCount(&count));
  if (count < 2) {
    std::printf("needs two GPUs (found %d)\n", count);
    return 0;
  }
  std::vector<int> blocks_per_sm;
  for (int i = 1; i < argc; ++i) blocks_per_sm.push_back(std::atoi(argv[i]));
  if (blocks_per_sm.empty()) blocks_per_sm = {1, 2, 4};
  const size_t max_bytes = size_t{256} << 20;
  Side sides[2];
  int sms = 0;
  for (int i = 0; i < 2; ++i) {
    Side& s = sides[i];
    s.device = i;
    CHECK(cudaSetDevice(i));
    CHECK(cudaDeviceEnablePeerAccess(1 - i, 0));
    CHECK(cudaStreamCreateWithFlags(&s.stream, cudaStreamNonBlocking));
    CHECK(cudaEventCreate(&s.start));
    CHECK(cudaEventCreate(&s.stop));
    CHECK(cudaMalloc(&s.local_a, max_bytes));
    CHECK(cudaMalloc(&s.local_b, max_bytes));
    CHECK(cudaMemset(s.local_a, i + 1, max_bytes));
    CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, i));
  }
  std::printf("%-12s %10s %8s %12s %12s\n", "means", "bytes", "blocks", "one-way GB/s", "both GB/s");
  for (size_t bytes : {size_t{1} << 20, size_t{4} << 20, size_t{16} << 20, size_t{64} << 20, max_bytes}) {
    for (Means m : {Means::kCopyEngine, Means::kPull, Means::kPush}) {
      for (int per_sm : blocks_per_sm) {
        const int blocks = per_sm * sms;
        const double one = timeIt(sides, 1, m, bytes, blocks, 9);
        const double both = timeIt(sides, 2, m, bytes, blocks, 9);
        std::printf("%-12s %10zu %8d %12.1f %12.1f\n", name(m), bytes, m == Means::kCopyEngine ? 0 : blocks,
                    bytes / one / 1e9, bytes / both / 1e9);
        if (m == Means::kCopyEngine) break;
      }
    }
  }
  return 0;
}
