// Byte copies between device buffers (local, or a peer's through its IPC
// mapping) by the threads of a kernel, each taking elements first, first +
// stride, ...: after peeling a head up to the word's alignment, 16-byte words
// when the source and the destination agree modulo 16 (narrower ones
// otherwise), four words in flight per thread. Shared by the copy kernel and
// the fused small all_reduce (copy_kernels.cu, fused_kernels.cu).
#pragma once

#include <cstddef>
#include <cstdint>

namespace mooncake::pg::cuda {

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

// The widest word both ends can share.
__device__ __forceinline__ void copyRange(const char* src, char* dst, size_t bytes, size_t first, size_t stride) {
  const uintptr_t shared_alignment = (reinterpret_cast<uintptr_t>(src) ^ reinterpret_cast<uintptr_t>(dst)) | 16;
  switch (shared_alignment & (~shared_alignment + 1)) {  // lowest set bit
    case 16: return copyAligned<uint4>(src, dst, bytes, first, stride);
    case 8: return copyAligned<uint2>(src, dst, bytes, first, stride);
    case 4: return copyAligned<uint32_t>(src, dst, bytes, first, stride);
    case 2: return copyAligned<uint16_t>(src, dst, bytes, first, stride);
    default: return copyAligned<uint8_t>(src, dst, bytes, first, stride);
  }
}

}  // namespace mooncake::pg::cuda
