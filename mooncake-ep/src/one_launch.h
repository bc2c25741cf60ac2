// When a dispatch enqueued whole runs its three phases in one launch
// (dispatch_kernels.cu, wholeCall), as a rule of the call's sizes and the
// device's capacity, so that the host tests check it without a GPU.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <string_view>

#include "mooncake/ep/cuda/ep_ipc_group.h"
#include "region_layout.h"

namespace mooncake::ep::cuda {

constexpr int kOneLaunchMaxBlocks = 64;
constexpr int64_t kOneLaunchMaxBytes = int64_t{4} << 20;
constexpr int kOneLaunchWarpsPerBlock = 16;  // the dispatch kernel's 512 threads

// Rows the copy phase may move for a call: the rows this rank sends to
// every rank (calls are alike across ranks, so they stand for what it
// receives), or those it zeroes, if more.
inline int64_t dispatchCopyRows(const RegionLayout& lay, const DispatchArgs& args) {
  const int64_t sent = static_cast<int64_t>(lay.R) * args.num_tokens;
  const int64_t zeroed = args.bytes.enabled ? std::min<int64_t>(args.bytes.zeroed_rows, int64_t{lay.R} * lay.T) : 0;
  return lay.L * std::max(sent, zeroed);
}

// The same in bytes, counting whole rows.
inline int64_t dispatchCopyBytes(const RegionLayout& lay, const DispatchArgs& args) {
  const ByteRows& b = args.bytes;
  const int64_t row_bytes = b.enabled      ? static_cast<int64_t>(b.head_bytes + b.tail_bytes)
                            : args.use_fp8 ? lay.H + int64_t{4} * (lay.H / kChannelsPerScale)
                                           : int64_t{2} * lay.H;
  return dispatchCopyRows(lay, args) * row_bytes;
}

// The blocks a client may hold under MPS: `CUDA_MPS_ACTIVE_THREAD_PERCENTAGE`
// (`percentage`, null when unset) caps its share of the SMs, which the
// device's attributes do not show. Rounded down; the whole device when the
// value is not a percentage below 100.
inline int mpsShareOfBlocks(int device_blocks, const char* percentage) {
  if (percentage == nullptr || *percentage == '\0') return device_blocks;
  char* end = nullptr;
  const double share = std::strtod(percentage, &end);
  if (end == percentage || *end != '\0' || !(share > 0) || share >= 100) return device_blocks;
  return static_cast<int>(device_blocks * share / 100);
}

// The environment variable that turns the one-launch path off ("0"), for
// A/B runs and for tests of the three launches at small sizes.
constexpr const char* kOneLaunchEnv = "MOONCAKE_EP_ONE_LAUNCH";

// Whether the value of kOneLaunchEnv (null when unset) lets oneLaunch apply.
inline bool oneLaunchAllowed(const char* value) { return value == nullptr || std::string_view(value) != "0"; }

// One launch when:
// - the grid is small, and the grids of all ranks fit on the device at once
//   (`resident_blocks`: the dispatch kernel's blocks the device holds, 0 when
//   unknown; the ranks may all share this GPU): a rank's blocks that spin
//   then keep neither its own blocks nor a peer's from an SM;
// - there is little to copy: a larger copy keeps the copy phase's wider grid
//   (a Buffer call of 512 tokens to 8 experts, 58 MB at H = 7168, would have
//   32 blocks to copy with instead of 256).
inline bool oneLaunch(const RegionLayout& lay, const DispatchArgs& args, int send_blocks, int resident_blocks) {
  if (send_blocks > kOneLaunchMaxBlocks || int64_t{send_blocks} * lay.R > resident_blocks) return false;
  return dispatchCopyBytes(lay, args) <= kOneLaunchMaxBytes;
}

// Whether a call's send blocks place their rows without a long count of the
// tokens before their own: the caller gives the slots (pick_slots), or the
// blocks count them in the caller's picks (OwnSendInputs) over at most one
// layout tile of tokens, one pass of a send block's threads. Such calls
// take send blocks of fewer rows, and one-launch grids add blocks for the copy.
inline bool slotsCheap(const DispatchArgs& args) {
  if (args.own_send.picks != nullptr) return args.num_tokens <= kLayoutSendTileTokens;
  return args.pick_slots != nullptr;
}

// Blocks per expert of a one-launch call's grid: the send's `send_chunks`,
// or more, up to about one row to copy (or zero) per warp. The copy has only
// the send's blocks, and a warp's row is several memory round trips (an
// ElasticBuffer call of 128 tokens at world 1 had 4 blocks for 128 rows of
// 8 KB). Within the one-launch bounds: at most kOneLaunchMaxBlocks blocks,
// and the grids of all ranks resident at once. Only for calls whose slots
// are cheap (slotsCheap): a send block that counts many tokens before its
// own pays for every block added.
inline int wholeCallChunks(const RegionLayout& lay, const DispatchArgs& args, int experts, int send_chunks,
                           int resident_blocks) {
  if (experts < 1 || !slotsCheap(args)) return send_chunks;
  const int64_t most_blocks = std::min<int64_t>(kOneLaunchMaxBlocks, resident_blocks / std::max(lay.R, 1));
  const int64_t for_rows = (dispatchCopyRows(lay, args) + kOneLaunchWarpsPerBlock - 1) / kOneLaunchWarpsPerBlock;
  const int64_t chunks = std::min((for_rows + experts - 1) / experts, most_blocks / experts);
  return static_cast<int>(std::max<int64_t>(chunks, send_chunks));
}

}  // namespace mooncake::ep::cuda
