// Byte copies between device buffers (local, or a peer's through its IPC
// mapping), several pieces per launch: piece blockIdx.y, grid-stride along x.
// A piece is copied in the widest word both ends can share: after peeling a
// head up to that word's alignment, 16-byte words when the source and the
// destination agree modulo 16, four words in flight per thread.
#include <algorithm>

#include "kernel_launch.h"
#include "op_guard.cuh"

namespace mooncake::pg::cuda {
namespace {

constexpr int kThreads = 512;

template <typename Word>
__device__ __forceinline__ void copyWords(const Word* src, Word* dst, size_t words, size_t first, size_t stride) {
  size_t i = first;
  for (; i + 3 * stride < words; i += 4 * stride) {
    const Word a = src[i], b = src[i + stride], c = src[i + 2 * stride], d = src[i + 3 * stride];
    dst[i] = a;
    dst[i + stride] = b;
    dst[i + 2 * stride] = c;
    dst[i + 3 * stride] = d;
  }
  for (; i < words; i += stride) dst[i] = src[i];
}

// Head bytes up to Word alignment, Word body, tail bytes.
template <typename Word>
__device__ __forceinline__ void copyAligned(const char* src, char* dst, size_t bytes, size_t first, size_t stride) {
  constexpr size_t kWord = sizeof(Word);
  const size_t to_boundary = (kWord - (reinterpret_cast<uintptr_t>(src) & (kWord - 1))) & (kWord - 1);
  const size_t head = bytes < to_boundary ? bytes : to_boundary;
  if (first < head) dst[first] = src[first];
  const size_t words = (bytes - head) / kWord;
  copyWords(reinterpret_cast<const Word*>(src + head), reinterpret_cast<Word*>(dst + head), words, first, stride);
  for (size_t i = head + words * kWord + first; i < bytes; i += stride) dst[i] = src[i];
}

__global__ void __launch_bounds__(kThreads) copyKernel(CopyJob job, OpGuard guard) {
  if (!guardAllows(guard)) return;
  const CopyPiece piece = job.piece[blockIdx.y];
  const char* src = static_cast<const char*>(piece.src);
  char* dst = static_cast<char*>(piece.dst);
  const size_t first = static_cast<size_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const size_t stride = static_cast<size_t>(gridDim.x) * blockDim.x;
  const uintptr_t shared_alignment = (reinterpret_cast<uintptr_t>(src) ^ reinterpret_cast<uintptr_t>(dst)) | 16;
  switch (shared_alignment & (~shared_alignment + 1)) {  // lowest set bit
    case 16: return copyAligned<uint4>(src, dst, piece.bytes, first, stride);
    case 8: return copyAligned<uint2>(src, dst, piece.bytes, first, stride);
    case 4: return copyAligned<uint32_t>(src, dst, piece.bytes, first, stride);
    case 2: return copyAligned<uint16_t>(src, dst, piece.bytes, first, stride);
    default: return copyAligned<uint8_t>(src, dst, piece.bytes, first, stride);
  }
}

}  // namespace

cudaError_t launchCopy(const CopyJob& job, const OpGuard& guard, int sm_count, cudaStream_t stream) {
  if (job.count <= 0) return cudaSuccess;
  if (job.count > kMaxCopyPieces) return cudaErrorInvalidValue;
  size_t largest = 0;
  for (int i = 0; i < job.count; ++i) largest = std::max(largest, job.piece[i].bytes);
  if (largest == 0) return cudaSuccess;
  // Enough 16-byte words per thread to cover the largest piece, and no more
  // blocks in all than the device keeps resident (4 of 512 threads per SM).
  const size_t wanted = (largest / 16 + kThreads) / kThreads;
  const size_t room = std::max<size_t>(1, static_cast<size_t>(sm_count) * 4 / job.count);
  const unsigned blocks_per_piece = static_cast<unsigned>(std::max<size_t>(1, std::min(wanted, room)));
  copyKernel<<<dim3(blocks_per_piece, job.count), kThreads, 0, stream>>>(job, guard);
  return cudaGetLastError();
}

}  // namespace mooncake::pg::cuda
