// EpIpcGroup: opening (receive region, IPC exchange), closing (a handshake
// so that no peer writes into a region being freed) and argument checks. The
// kernels are in dispatch_kernels.cu and combine_kernels.cu; they number the
// calls themselves (call_sequence.cuh).
#include "mooncake/ep/cuda/ep_ipc_group.h"

#include <cstdint>
#include <functional>
#include <vector>

#include "mooncake/pg/cuda/common/cuda_calls.h"  // cudaWhat, DeviceScope, IPC export and mapping
#include "ep_control_block.h"
#include "kernel_args.h"

namespace mooncake::ep::cuda {
namespace {

using mooncake::pg::cuda::chosenDevice;
using mooncake::pg::cuda::cudaWhat;
using mooncake::pg::cuda::DeviceScope;
using mooncake::pg::cuda::exportIpcHandle;
using mooncake::pg::cuda::mapPeerAllocations;

std::string checkSizes(int rank, int num_ranks, const EpIpcGroupOptions& o) {
  if (num_ranks < 1 || num_ranks > kMaxEpRanks || rank < 0 || rank >= num_ranks) {
    return "invalid rank/size (at most " + std::to_string(kMaxEpRanks) + " ranks)";
  }
  if (o.max_tokens_per_rank < 1 || o.hidden < kChannelsPerScale || o.hidden % kChannelsPerScale != 0 ||
      o.hidden > 8192) {
    return "max_tokens_per_rank must be >= 1 and hidden a multiple of 128 up to 8192";
  }
  if (o.num_experts < num_ranks || o.num_experts % num_ranks != 0) {
    return "num_experts must be a positive multiple of the number of ranks";
  }
  return {};
}

bool aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

// The rules of DispatchArgs::bytes (the kernels copy 16-byte vectors).
std::string checkByteRows(const DispatchArgs& args, const RegionLayout& layout) {
  const ByteRows& b = args.bytes;
  if (args.use_fp8) return "bytes rows are moved as given: use_fp8 (quantising in the kernel) does not apply";
  if (b.head_bytes % 16 != 0 || b.tail_bytes % 16 != 0 || b.head_bytes + b.tail_bytes > 2 * size_t(layout.H)) {
    return "bytes.head_bytes and bytes.tail_bytes must be multiples of 16 adding up to at most 2 * hidden";
  }
  if (b.tail_bytes > 0 && (b.recv_tail == nullptr || (args.num_tokens > 0 && b.tail == nullptr))) {
    return "bytes.tail and bytes.recv_tail are required with tail_bytes";
  }
  if (b.zeroed_rows < 0 || b.zeroed_rows > layout.R * layout.T) {
    return "bytes.zeroed_rows must be in [0, num_ranks * max_tokens_per_rank]";
  }
  if (!aligned16(args.x) || !aligned16(b.tail) || !aligned16(args.recv_x) || !aligned16(b.recv_tail)) {
    return "x, bytes.tail, recv_x and bytes.recv_tail must be 16-byte aligned";
  }
  return {};
}

}  // namespace

size_t epReceiveRegionBytes(int max_tokens_per_rank, int hidden, int num_experts, int num_ranks) {
  return RegionLayout::make(max_tokens_per_rank, hidden, num_experts, num_ranks).total;
}

struct EpIpcGroup::State {
  int rank = 0;
  int num_ranks = 0;
  int device = 0;
  EpIpcGroupOptions options;
  RegionLayout layout;
  char* region = nullptr;            // this rank's receive region
  std::vector<char*> peer_regions;   // every rank's, as mapped here
  std::unique_ptr<EpControlBlock> control;
  // Set by a failed launch: this rank's call numbers may be out of step with
  // the peers' (a send enqueued without its receive, or the other way round),
  // so every later call is refused rather than paired with the wrong data.
  std::string broken;
  EpKernelContext context(int64_t timeout_us) const {
    EpKernelContext ctx;
    ctx.layout = layout;
    ctx.rank = rank;
    ctx.counters = reinterpret_cast<GroupCounters*>(region + layout.counters);
    for (int r = 0; r < num_ranks; ++r) ctx.regions[r] = peer_regions[r];
    ctx.escape.departed = control->deviceDeparted();
    ctx.escape.abort = control->deviceAbort();
    ctx.escape.departed_seen = reinterpret_cast<uint32_t*>(region + layout.departed_seen);
    for (int r = 0; r < num_ranks; ++r) {
      if (control->header().departed[r].load(std::memory_order_acquire) != 0) ctx.escape.departed_bits |= 1u << r;
    }
    ctx.timeout_ns = timeout_us < 0 ? -1 : timeout_us * 1000;
    return ctx;
  }

  ~State() {
    for (int q = 0; q < static_cast<int>(peer_regions.size()); ++q) {
      if (q != rank && peer_regions[q] != nullptr) cudaIpcCloseMemHandle(peer_regions[q]);
    }
    if (region != nullptr) cudaFree(region);
    control.reset();
  }
};

std::unique_ptr<EpIpcGroup> EpIpcGroup::open(const std::string& name, int rank, int num_ranks,
                                             const EpIpcGroupOptions& options, std::string* error) {
  auto state = std::make_unique<State>();
  auto fail = [&](const std::string& why) -> std::unique_ptr<EpIpcGroup> {
    if (error) *error = "EP IPC group '" + name + "' (rank " + std::to_string(rank) + "): " + why;
    return nullptr;
  };
  if (std::string why = checkSizes(rank, num_ranks, options); !why.empty()) return fail(why);
  state->rank = rank;
  state->num_ranks = num_ranks;
  state->options = options;
  if (std::string why = chosenDevice(options.device, &state->device); !why.empty()) return fail(why);
  cudaError_t err = cudaSuccess;
  DeviceScope scope(state->device);
  state->layout = RegionLayout::make(options.max_tokens_per_rank, options.hidden, options.num_experts, num_ranks);
  if ((err = cudaMalloc(reinterpret_cast<void**>(&state->region), state->layout.total)) != cudaSuccess) {
    return fail(cudaWhat("cudaMalloc of the receive region", err));
  }
  // Signals and call counters must read 0 (no sequence) before any peer can write into the
  // region: zero it and wait before publishing the handle. Rows need no
  // clearing: a row is read only after a signal says it was written.
  if ((err = cudaMemset(state->region, 0, state->layout.dispatch_rows)) != cudaSuccess ||
      (err = cudaDeviceSynchronize()) != cudaSuccess) {
    return fail(cudaWhat("cudaMemset", err));
  }
  EpControlBlock::Identity identity;
  identity.device = state->device;
  identity.region_bytes = state->layout.total;
  std::string why;
  if (num_ranks > 1 && !(why = exportIpcHandle(state->region, identity.region_handle)).empty()) return fail(why);
  state->control = EpControlBlock::open(name, rank, num_ranks, options, identity, &why);
  if (!state->control) {
    if (error) *error = why;
    return nullptr;
  }
  if (!(why = state->control->registerWithCuda()).empty()) return fail(why);
  int failed = -1;
  why = mapPeerAllocations(
      num_ranks, rank, state->region,
      [&](int q) -> const unsigned char* {
        return (options.absent >> q & 1u) != 0 ? nullptr : state->control->slot(q).region_handle;
      },
      &state->peer_regions, &failed);
  if (!why.empty()) {
    // The peers that did open wait for this rank in calls: mark it gone.
    state->control->header().departed[rank].store(1, std::memory_order_release);
    return fail("opening the receive region of rank " + std::to_string(failed) + ": " + why);
  }
  return std::unique_ptr<EpIpcGroup>(new EpIpcGroup(std::move(state)));
}

EpIpcGroup::EpIpcGroup(std::unique_ptr<State> state) : state_(std::move(state)) {}

EpIpcGroup::~EpIpcGroup() {
  State& g = *state_;
  DeviceScope scope(g.device);
  // This rank's kernels end before anything is unmapped. A wait with no
  // timeout for a live peer that never calls would not: closing releases
  // every wait still pending (abortWaits).
  abortWaits();
  cudaDeviceSynchronize();
  if (g.num_ranks > 1) {
    const auto deadline = std::chrono::steady_clock::now() + g.options.attach_timeout;
    // Phase 1: every live peer's kernels are done too, so nobody writes into
    // any region any more: close the mappings. Phase 2: nobody maps this
    // rank's region any more: free it.
    g.control->closePhase(1, deadline);
    for (int q = 0; q < g.num_ranks; ++q) {
      if (q != g.rank && g.peer_regions[q] != nullptr) cudaIpcCloseMemHandle(g.peer_regions[q]);
      g.peer_regions[q] = nullptr;
    }
    g.control->closePhase(2, deadline);
  }
  state_.reset();
}

int EpIpcGroup::rank() const { return state_->rank; }
int EpIpcGroup::numRanks() const { return state_->num_ranks; }
int EpIpcGroup::device() const { return state_->device; }
const EpIpcGroupOptions& EpIpcGroup::options() const { return state_->options; }

void EpIpcGroup::abortWaits() { state_->control->slot(state_->rank).abort.store(1, std::memory_order_release); }

std::string EpIpcGroup::enqueueCall(const std::function<cudaError_t()>& launch) {
  State& g = *state_;
  if (!g.broken.empty()) return g.broken;
  DeviceScope scope(g.device);
  cudaGetLastError();  // an earlier, unrelated error must not be taken for this launch's
  const cudaError_t err = launch();
  if (err == cudaSuccess) return {};
  g.broken = "the group is unusable after a failed launch (" + cudaWhat("launch", err) + "); open a new one";
  abortWaits();  // whatever this rank did enqueue ends without waiting for peers
  return g.broken;
}

bool EpIpcGroup::dispatch(const DispatchArgs& args, cudaStream_t stream, std::string* error, EpStages stages) {
  State& g = *state_;
  auto fail = [&](const std::string& why) {
    if (error) *error = "EP dispatch: " + why;
    return false;
  };
  if (args.num_tokens < 0 || args.num_tokens > g.layout.T) {
    return fail("num_tokens must be in [0, max_tokens_per_rank]");
  }
  const ByteRows& bytes = args.bytes;
  const bool needs_x = !bytes.enabled || bytes.head_bytes > 0;
  if (args.num_topk < 0 || (args.num_tokens > 0 && args.num_topk > 0 && args.topk_idx == nullptr) ||
      (args.num_tokens > 0 && needs_x && args.x == nullptr)) {
    return fail("x and topk_idx are required");
  }
  if (bytes.enabled) {
    if (const std::string why = checkByteRows(args, g.layout); !why.empty()) return fail(why);
  }
  if (args.active_ranks == nullptr || (needs_x && args.recv_x == nullptr) || args.recv_count == nullptr ||
      args.src_info == nullptr || args.layout_range == nullptr || (args.use_fp8 && args.recv_scales == nullptr)) {
    return fail("active_ranks and every output are required (recv_scales with use_fp8)");
  }
  if (args.timeout_us < -1) return fail("timeout_us must be -1 or >= 0");
  const std::string why = enqueueCall([&] { return launchDispatch(g.context(args.timeout_us), args, stages, stream); });
  return why.empty() || fail(why);
}

bool EpIpcGroup::combine(const CombineArgs& args, cudaStream_t stream, std::string* error, EpStages stages) {
  State& g = *state_;
  auto fail = [&](const std::string& why) {
    if (error) *error = "EP combine: " + why;
    return false;
  };
  if (args.num_tokens < 0 || args.num_tokens > g.layout.T) {
    return fail("num_tokens must be in [0, max_tokens_per_rank]");
  }
  if (args.num_topk < 0 || (args.num_tokens > 0 && (args.topk_idx == nullptr || args.topk_weights == nullptr ||
                                                    args.out == nullptr))) {
    return fail("topk_idx, topk_weights and out are required");
  }
  if (args.y == nullptr || args.src_info == nullptr || args.layout_range == nullptr || args.active_ranks == nullptr) {
    return fail("y, the dispatch handle (src_info, layout_range) and active_ranks are required");
  }
  if (args.channels < 0 || args.channels % 8 != 0 || args.channels > g.layout.H) {
    return fail("channels must be a multiple of 8 in [0, hidden] (0: hidden)");
  }
  if (args.timeout_us < -1) return fail("timeout_us must be -1 or >= 0");
  const std::string why = enqueueCall([&] { return launchCombine(g.context(args.timeout_us), args, stages, stream); });
  return why.empty() || fail(why);
}

}  // namespace mooncake::ep::cuda
