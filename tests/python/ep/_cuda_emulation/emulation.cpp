// The host side of cuda_runtime_api.h here, and C entry points for the
// layout kernels' calls (their arguments spelled as for mooncake._ep_ipc, by
// python/ep_ipc/layout_call_args.h), for ctypes.
#include <atomic>
#include <barrier>
#include <cstdio>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "cuda_runtime_api.h"
#include "layout_call_args.h"

thread_local dim3 threadIdx, blockIdx;
dim3 blockDim, gridDim;

namespace {

struct Warp {
  std::unique_ptr<std::barrier<>> barrier;
  unsigned values[32] = {};
};

std::unique_ptr<std::barrier<>> block_barrier;
std::vector<Warp> warps;
std::vector<unsigned char> dynamic_shared;

// Every lane of the warp publishes a value, then reads them all: two barriers,
// so that a lane's next exchange cannot overwrite a value another still reads.
template <typename Read>
unsigned exchange(unsigned value, Read read) {
  Warp& warp = warps[threadIdx.x / 32];
  warp.values[threadIdx.x % 32] = value;
  warp.barrier->arrive_and_wait();
  const unsigned out = read(warp.values);
  warp.barrier->arrive_and_wait();
  return out;
}

}  // namespace

void __syncthreads() { block_barrier->arrive_and_wait(); }

int __syncthreads_or(int predicate) {
  static std::atomic<int> any{0};  // the blocks run one at a time
  if (predicate != 0) any.store(1);
  block_barrier->arrive_and_wait();
  const int out = any.load();
  block_barrier->arrive_and_wait();  // every thread has read it
  if (threadIdx.x == 0) any.store(0);
  block_barrier->arrive_and_wait();  // cleared before the next call's stores
  return out;
}

unsigned __ballot_sync(unsigned /*lanes*/, int predicate) {
  return exchange(predicate != 0 ? 1u : 0u, [](const unsigned* v) {
    unsigned bits = 0;
    for (int lane = 0; lane < 32; ++lane) bits |= v[lane] << lane;
    return bits;
  });
}

unsigned __shfl_xor_sync(unsigned /*lanes*/, unsigned value, int lane_mask) {
  const unsigned from = (threadIdx.x % 32) ^ static_cast<unsigned>(lane_mask);
  return exchange(value, [from](const unsigned* v) { return v[from]; });
}

unsigned __shfl_up_sync(unsigned /*lanes*/, unsigned value, unsigned delta) {
  const unsigned lane = threadIdx.x % 32;
  const unsigned from = lane >= delta ? lane - delta : lane;  // lanes below delta keep their own value
  return exchange(value, [from](const unsigned* v) { return v[from]; });
}

void __syncwarp(unsigned /*lanes*/) { warps[threadIdx.x / 32].barrier->arrive_and_wait(); }

int atomicAdd(int* at, int value) { return __atomic_fetch_add(at, value, __ATOMIC_SEQ_CST); }

unsigned atomicAdd(unsigned* at, unsigned value) { return __atomic_fetch_add(at, value, __ATOMIC_SEQ_CST); }

unsigned long long atomicAdd(unsigned long long* at, unsigned long long value) {
  return __atomic_fetch_add(at, value, __ATOMIC_SEQ_CST);
}

void __threadfence() { __atomic_thread_fence(__ATOMIC_SEQ_CST); }

void* emulatedDynamicSharedBytes() { return dynamic_shared.data(); }

void emulatedLaunch(dim3 grid, dim3 block, size_t shared_bytes, const std::function<void()>& kernel) {
  gridDim = grid;
  blockDim = block;
  for (unsigned b = 0; b < grid.x; ++b) {
    block_barrier = std::make_unique<std::barrier<>>(block.x);
    warps = std::vector<Warp>((block.x + 31) / 32);
    for (auto& warp : warps) warp.barrier = std::make_unique<std::barrier<>>(32);
    dynamic_shared.assign(shared_bytes + 16, 0xA5);  // not zeros: shared memory starts with garbage
    std::vector<std::thread> threads;
    threads.reserve(block.x);
    for (unsigned t = 0; t < block.x; ++t) {
      threads.emplace_back([&kernel, t, b] {
        threadIdx = dim3(t);
        blockIdx = dim3(b);
        kernel();
      });
    }
    for (auto& thread : threads) thread.join();
  }
}

namespace {

int report(bool ok, const std::string& error) {
  if (!ok) std::fprintf(stderr, "%s\n", error.c_str());
  return ok ? 1 : 0;
}

}  // namespace

using namespace mooncake::ep;

extern "C" int emulated_layout_send(uintptr_t topk_idx, int num_tokens, int num_topk, int num_local, int num_ranks,
                                    uintptr_t dest, uintptr_t dest_slots, uintptr_t token_index, uintptr_t counts,
                                    int count_words, uintptr_t shape, int shape_words, uintptr_t tile_counts,
                                    int64_t tile_count_words, int offer_word, uintptr_t active_ranks, uintptr_t payload,
                                    int64_t payload_bytes, uintptr_t scales, int64_t scale_bytes, uintptr_t weights,
                                    int64_t head_bytes, int64_t ids_at, uintptr_t tail, int64_t tail_bytes,
                                    uintptr_t zeroed, int64_t zeroed_words, uintptr_t topk_copy) {
  std::string error;
  cuda::SendLayoutArgs a = python::sendLayoutArgs(topk_idx, num_tokens, num_topk, num_local, num_ranks, dest,
                                                  dest_slots, token_index, counts, count_words, shape, shape_words,
                                                  tile_counts, tile_count_words, offer_word, active_ranks);
  python::addSendExtras(a, payload, payload_bytes, scales, scale_bytes, weights, head_bytes, ids_at, tail, tail_bytes,
                        zeroed, zeroed_words, topk_copy);
  return report(cuda::layoutSend(a, nullptr, &error), error);
}

extern "C" int emulated_send_tail(uintptr_t payload, int64_t payload_bytes, uintptr_t scales, int64_t scale_bytes,
                                  uintptr_t topk_idx, uintptr_t weights, int num_tokens, int num_topk,
                                  int64_t head_bytes, int64_t ids_at, uintptr_t tail, int64_t tail_bytes) {
  std::string error;
  return report(cuda::sendTail(python::sendTailArgs(payload, payload_bytes, scales, scale_bytes, topk_idx, weights,
                                                    num_tokens, num_topk, head_bytes, ids_at, tail, tail_bytes),
                               nullptr, &error),
                error);
}

extern "C" int emulated_layout_receive(uintptr_t topk_idx, uintptr_t token_index, uintptr_t gathered,
                                       int64_t gathered_stride, uintptr_t gathered_ranges, int num_tokens,
                                       uintptr_t ranges, uintptr_t src_token, uintptr_t recv_tail, int64_t tail_bytes,
                                       int64_t ids_at, int64_t weights_at, int64_t capacity, int num_topk,
                                       int num_local, int num_ranks, int rank, int tokens_per_rank, uintptr_t slots,
                                       uintptr_t real, uintptr_t local, uintptr_t weights, uintptr_t metadata,
                                       uintptr_t per_expert, uintptr_t expert_psum, uintptr_t scaleup_psum,
                                       uintptr_t finished_blocks) {
  std::string error;
  return report(cuda::layoutReceive(python::receiveLayoutArgs(
                                        topk_idx, token_index, gathered, gathered_stride, gathered_ranges, num_tokens,
                                        ranges, src_token, recv_tail, tail_bytes, ids_at, weights_at, capacity,
                                        num_topk, num_local, num_ranks, rank, tokens_per_rank, slots, real, local,
                                        weights, metadata, per_expert, expert_psum, scaleup_psum, finished_blocks),
                                    nullptr, &error),
                error);
}
