// EpIpcGroup: opening (receive region, IPC exchange), closing (a handshake
// so that no peer writes into a region being freed) and argument checks. The
// kernels are in dispatch_kernels.cu and combine_kernels.cu; they number the
// calls themselves (call_sequence.cuh).
#include "mooncake/ep/cuda/ep_ipc_group.h"

#include <cstdint>
#include <functional>
#include <vector>

#include "mooncake/pg/cuda/common/cuda_calls.h"  // cudaWhat, DeviceScope, IPC export and mapping
#include "call_checks.h"
#include "ep_control_block.h"
#include "kernel_args.h"

namespace mooncake::ep::cuda {
namespace {

using mooncake::pg::cuda::chosenDevice;
using mooncake::pg::cuda::cudaWhat;
using mooncake::pg::cuda::DeviceScope;
using mooncake::pg::cuda::exportIpcHandle;
using mooncake::pg::cuda::mapPeerAllocations;

}  // namespace

size_t epReceiveRegionBytes(int max_tokens_per_rank, int hidden, int num_experts, int num_ranks, int output_slots) {
  return RegionLayout::make(max_tokens_per_rank, hidden, num_experts, num_ranks, output_slots).total;
}

struct EpIpcGroup::State {
  int rank = 0;
  int num_ranks = 0;
  int device = 0;
  EpIpcGroupOptions options;
  RegionLayout layout;
  // This rank's receive region; the memory is freed when the last lease()
  // goes (the group's own is dropped when it closes).
  std::shared_ptr<char> region_memory;
  char* region = nullptr;
  std::vector<char*> peer_regions;  // every rank's, as mapped here
  std::unique_ptr<EpControlBlock> control;
  LaunchGate gate;  // refuses every call after a failed launch (call_checks.h says why)
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
    region_memory.reset();
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
  if (std::string why = checkGroupSizes(rank, num_ranks, options); !why.empty()) return fail(why);
  state->rank = rank;
  state->num_ranks = num_ranks;
  state->options = options;
  if (std::string why = chosenDevice(options.device, &state->device); !why.empty()) return fail(why);
  cudaError_t err = cudaSuccess;
  DeviceScope scope(state->device);
  state->layout = RegionLayout::make(options.max_tokens_per_rank, options.hidden, options.num_experts, num_ranks,
                                     options.output_slots);
  if ((err = cudaMalloc(reinterpret_cast<void**>(&state->region), state->layout.total)) != cudaSuccess) {
    return fail(cudaWhat("cudaMalloc of the receive region", err));
  }
  state->region_memory = std::shared_ptr<char>(state->region, [device = state->device](char* memory) {
    DeviceScope scope(device);
    cudaFree(memory);  // an implicit device synchronisation: outputs in it may still be read
  });
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

int EpIpcGroup::outputSlots() const { return state_->layout.O; }
size_t EpIpcGroup::outputSlotBytes() const { return state_->layout.output_slot_bytes; }
void* EpIpcGroup::outputSlot(int slot) const {
  return slot >= 0 && slot < state_->layout.O ? state_->region + state_->layout.outputSlot(slot) : nullptr;
}
std::shared_ptr<void> EpIpcGroup::lease() const { return state_->region_memory; }

std::string EpIpcGroup::enqueueCall(const std::function<cudaError_t()>& launch) {
  // Whatever this rank did enqueue ends without waiting for peers.
  return state_->gate.run(state_->device, launch, [this] { abortWaits(); });
}

bool EpIpcGroup::dispatch(const DispatchArgs& args, cudaStream_t stream, std::string* error, EpStages stages) {
  State& g = *state_;
  std::string why = checkDispatchCall(args, g.layout);
  DispatchArgs call = args;
  if (call.direct.gathered != nullptr && call.direct.own_slot >= 0) call.recv_x = outputSlot(call.direct.own_slot);
  if (why.empty()) why = enqueueCall([&] { return launchDispatch(g.context(args.timeout_us), call, stages, stream); });
  if (!why.empty() && error) *error = "EP dispatch: " + why;
  return why.empty();
}

bool EpIpcGroup::combine(const CombineArgs& args, cudaStream_t stream, std::string* error, EpStages stages) {
  State& g = *state_;
  std::string why = checkCombineCall(args, g.layout);
  if (why.empty()) why = enqueueCall([&] { return launchCombine(g.context(args.timeout_us), args, stages, stream); });
  if (!why.empty() && error) *error = "EP combine: " + why;
  return why.empty();
}

}  // namespace mooncake::ep::cuda
