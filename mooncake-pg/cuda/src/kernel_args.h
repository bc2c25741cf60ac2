// Arguments of the group's kernels, passed by value. Plain structs shared by
// the host code (g++) and the kernels (nvcc): no CUDA types in here.
#pragma once

#include <cstddef>
#include <cstdint>

#include "mooncake/pg/types.h"

namespace mooncake::pg::cuda {

constexpr int kMaxLocalRanks = 32;  // ranks of one group on one host: flag tables and kernel arguments are sized by it

// What a kernel reports to the host watchdog, in the rank's control block
// (host memory). Written once per failure: error last, with release order.
enum DeviceError : uint32_t {
  kDeviceOk = 0,
  kDeviceAborted = 1,            // the group was broken when the kernel started: it skipped its work
  kDeviceSignatureMismatch = 2,  // `rank` runs a different operation
  kDeviceBarrierTimeout = 3,     // a spinning barrier (SyncMode::kKernels) passed its deadline
};
struct DeviceReport {
  uint32_t error;
  uint32_t op_id;  // the eager operation's id, 0 inside a graph
  int32_t rank;    // the rank at fault, or -1
  uint32_t pad;
};

// What every group kernel checks before it touches a peer's memory. The
// check costs each block one read of device memory: the host-mapped words
// (the group's broken_by, the report) are touched only once the group has
// failed, because a host-memory read per block serialized the blocks (about
// 1 us each on an H200).
struct OpGuard {
  // This rank's abort word, in its own staging header (device memory): not 0
  // once the group is broken. Set on the stream by the gate that ends every
  // barrier followed by a kernel (StreamSync::barrier), which reads broken_by
  // once, and by a barrier kernel that passes its deadline. Null: no check.
  const uint32_t* abort_word = nullptr;
  DeviceReport* report = nullptr;      // host-mapped, this rank's: written by block 0 only, on failure
  uint32_t op_id = 0;
  uint32_t signature = 0;  // this rank's operation signature
  // Block 0 compares signature with every peer's (staged in the peer's
  // staging header) when check_signature is set: once per operation, in the
  // first kernel after its first barrier.
  int check_signature = 0;
  int size = 0;
  const uint32_t* peer_signature[kMaxLocalRanks] = {};  // by rank; null for this rank
};

// Several independent copies in one launch: up to two per rank (all_reduce
// launches a round's local all-gather, W - 1 pieces, with the next round's
// pushes into the peers, W - 1 more), plus two spare.
constexpr int kMaxCopyPieces = 2 * kMaxLocalRanks + 2;
struct CopyPiece {
  const void* src;
  void* dst;
  size_t bytes;
};
struct CopyJob {
  CopyPiece piece[kMaxCopyPieces];
  int count = 0;
  // Set by launchCopy: piece i is copied by blocks [first_block[i],
  // first_block[i + 1]) of a one-dimensional grid, in proportion to its size.
  unsigned first_block[kMaxCopyPieces + 1] = {};
};

// dst[d][i] = op over k of srcs[k][i] for every destination d: the own
// output and, when the result is pushed, every peer's staging.
constexpr int kMaxReduceDestinations = kMaxLocalRanks + 1;
struct ReduceJob {
  const void* srcs[kMaxLocalRanks];
  int nsrc = 0;
  void* dsts[kMaxReduceDestinations];
  int ndst = 0;
  size_t count = 0;
  DataType type = DataType::kFloat32;
  ReduceOp op = ReduceOp::kSum;
};

// One barrier done by a spinning warp (SyncMode::kKernels); lane q serves peer q.
struct BarrierKernelArgs {
  uint32_t* signal[kMaxLocalRanks];   // peer q's flag for this rank, this set (null for this rank)
  uint32_t* arrival[kMaxLocalRanks];  // this rank's flag for peer q, this set (null for this rank)
  uint32_t* started_word;             // progress word written first (null: none)
  uint32_t started_value;
  uint32_t* signature_word;           // this rank's staging header (null: none)
  uint32_t signature;
  const int32_t* broken_by;           // host-mapped: this waiting warp polls it
  uint32_t* abort_word;               // this rank's (device): set by the gate or on timeout; later kernels skip
  DeviceReport* report;
  uint32_t op_id;
  int size;
  unsigned long long timeout_ns;
};

// The direct schedule's one round as one kernel of one block, for small
// all_reduce / reduce (fused_kernels.cu): push the input into the receivers'
// inboxes, the first barrier (set 0), fold, the closing barrier (set 1), the
// finished mark. The same pushes, flags and signature word as the unfused
// steps, so ranks may mix the two forms.
constexpr int kFusedThreads = 512;
struct FusedDirectArgs {
  const void* push_src = nullptr;
  void* push_dst[kMaxLocalRanks] = {};
  int npush = 0;
  size_t push_bytes = 0;
  OpGuard start_guard;         // before the push: the abort word only
  BarrierKernelArgs first{};   // set 0, with the started mark and the signature
  OpGuard fold_guard;          // after the first barrier: the abort word and the signature check
  ReduceJob fold;              // ndst 0: this rank wants no result
  bool vectorized = false;      // set by launchFusedDirect
  BarrierKernelArgs closing{};  // set 1
  uint32_t* finished_word = nullptr;  // eager: this rank's progress word (host-mapped), set last
  uint32_t finished_value = 0;
};
static_assert(sizeof(FusedDirectArgs) <= 4096, "kernel parameters beyond 4 KiB need CUDA 12.1's large-parameter path");

}  // namespace mooncake::pg::cuda
