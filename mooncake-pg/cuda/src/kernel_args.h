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

// What every group kernel checks before it touches a peer's memory.
struct OpGuard {
  const int32_t* broken_by = nullptr;  // host-mapped, group-wide: >= 0 once the group is broken; null: no check
  DeviceReport* report = nullptr;      // host-mapped, this rank's
  uint32_t op_id = 0;
  uint32_t signature = 0;  // this rank's operation signature
  // Block 0 compares signature with every peer's (staged in the peer's
  // staging header) when check_signature is set: once per operation, in the
  // first kernel after its first barrier.
  int check_signature = 0;
  int size = 0;
  const uint32_t* peer_signature[kMaxLocalRanks] = {};  // by rank; null for this rank
};

// Several independent copies in one launch (gridDim.y = count).
constexpr int kMaxCopyPieces = kMaxLocalRanks;
struct CopyPiece {
  const void* src;
  void* dst;
  size_t bytes;
};
struct CopyJob {
  CopyPiece piece[kMaxCopyPieces];
  int count = 0;
};

// dst[d][i] = op over k of srcs[k][i] for every destination d.
constexpr int kMaxReduceDestinations = 2;
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
  const int32_t* broken_by;
  DeviceReport* report;
  uint32_t op_id;
  int size;
  unsigned long long timeout_ns;
};

}  // namespace mooncake::pg::cuda
