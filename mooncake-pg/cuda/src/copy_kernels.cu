// The copy kernel: several independent byte copies per launch, each copied
// grid-stride (copy_range.cuh) by its own range of blocks
// (CopyJob::first_block).
#include <algorithm>

#include "mooncake/pg/cuda/common/copy_range.cuh"
#include "kernel_launch.h"
#include "op_guard.cuh"

namespace mooncake::pg::cuda {
namespace {

constexpr int kThreads = 512;

__global__ void __launch_bounds__(kThreads) copyKernel(CopyJob job, OpGuard guard) {
  if (!guardAllows(guard)) return;
  int p = 0;  // the piece of this block: first_block is increasing, at most kMaxCopyPieces long
  while (p + 1 < job.count && blockIdx.x >= job.first_block[p + 1]) ++p;
  const CopyPiece piece = job.piece[p];
  const char* src = static_cast<const char*>(piece.src);
  char* dst = static_cast<char*>(piece.dst);
  const unsigned blocks = job.first_block[p + 1] - job.first_block[p];
  const size_t first = static_cast<size_t>(blockIdx.x - job.first_block[p]) * blockDim.x + threadIdx.x;
  const size_t stride = static_cast<size_t>(blocks) * blockDim.x;
  copyRange(src, dst, piece.bytes, first, stride);
}

// Blocks of copyKernel one multiprocessor keeps resident (asked once).
int residentBlocksPerSm() {
  static const int blocks = [] {
    int n = 0;
    if (cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, copyKernel, kThreads, 0) != cudaSuccess || n < 1) {
      cudaGetLastError();
      n = 1;
    }
    return n;
  }();
  return blocks;
}

}  // namespace

cudaError_t launchCopy(const CopyJob& job_in, const OpGuard& guard, int sm_count, cudaStream_t stream) {
  if (job_in.count <= 0) return cudaSuccess;
  if (job_in.count > kMaxCopyPieces) return cudaErrorInvalidValue;
  // Empty pieces take no block.
  CopyJob job;
  size_t total = 0;
  for (int i = 0; i < job_in.count; ++i) {
    if (job_in.piece[i].bytes == 0) continue;
    job.piece[job.count++] = job_in.piece[i];
    total += job_in.piece[i].bytes;
  }
  if (total == 0) return cudaSuccess;
  // A piece wants one block per kThreads 16-byte words; all the pieces
  // together get no more blocks than the device keeps resident, shared in
  // proportion to their sizes (at least one each), so that the pieces of one
  // launch finish together.
  auto wanted = [](size_t bytes) { return std::max<size_t>(1, (bytes / 16 + kThreads - 1) / kThreads); };
  size_t wanted_total = 0;
  for (int i = 0; i < job.count; ++i) wanted_total += wanted(job.piece[i].bytes);
  const size_t room = std::max<size_t>(job.count, static_cast<size_t>(sm_count) * residentBlocksPerSm());
  size_t next = 0;
  for (int i = 0; i < job.count; ++i) {
    job.first_block[i] = static_cast<unsigned>(next);
    const size_t bytes = job.piece[i].bytes;
    const size_t share = static_cast<size_t>(static_cast<double>(room) * static_cast<double>(bytes) / total);
    next += wanted_total <= room ? wanted(bytes) : std::max<size_t>(1, std::min(wanted(bytes), share));
  }
  job.first_block[job.count] = static_cast<unsigned>(next);
  copyKernel<<<static_cast<unsigned>(next), kThreads, 0, stream>>>(job, guard);
  return cudaGetLastError();
}

}  // namespace mooncake::pg::cuda
