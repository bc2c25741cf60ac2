// EpNcclGroup: the window (allocation, registration, peers' addresses), the
// close sequence, and the calls, which run mooncake-ep's kernels unchanged
// (kernel_args.h: EpKernelContext holds one address per rank, whoever mapped
// it). Every collective step goes through NcclCommunicator, bounded.
#include "mooncake/ep/nccl/ep_nccl_group.h"

#include <atomic>
#include <cstring>
#include <vector>

#include "call_checks.h"
#include "kernel_args.h"
#include "mooncake/ep/nccl/nccl_rules.h"
#include "mooncake/pg/cuda/common/cuda_calls.h"  // cudaWhat, DeviceScope
#include "mooncake/te/log.h"
#include "nccl_comm.h"

namespace mooncake::ep::nccl {
namespace {

using cuda::EpKernelContext;
using cuda::RegionLayout;
using mooncake::pg::cuda::cudaWhat;
using mooncake::pg::cuda::DeviceScope;

// The word the kernels read to give up their waits, where a plain CPU store
// reaches them while they spin (host memory, mapped; ep_control_block.h says
// why not device memory). There are no "departed" words: NCCL has no
// liveness of its own to feed them, so a dead peer costs the call's timeout.
struct EscapeWords {
  std::atomic<uint32_t> abort;
};
static_assert(sizeof(std::atomic<uint32_t>) == sizeof(uint32_t), "the kernels read the word as uint32_t");

}  // namespace

int ncclHeaderVersion() { return NCCL_VERSION_CODE; }
int ncclLoadedVersion() { return ncclRuntimeVersion(); }
std::string ncclRuntimeProblem() {
  std::string error;
  return ncclLibrary(&error) != nullptr ? std::string() : error;
}

struct EpNcclGroup::State {
  int rank = 0;
  int num_ranks = 0;
  int device = 0;
  EpIpcGroupOptions options;
  RegionLayout layout;
  std::unique_ptr<NcclCommunicator> comm;
  char* region = nullptr;  // this rank's part of the window (ncclMemAlloc)
  size_t window_bytes = 0;
  ncclWindow_t window = nullptr;
  std::vector<char*> peer_regions;  // every rank's part, as this GPU addresses it (LSA)
  EscapeWords* escape_host = nullptr;
  EscapeWords* escape_device = nullptr;
  cuda::LaunchGate gate;

  Deadline deadline() const { return std::chrono::steady_clock::now() + options.attach_timeout; }

  EpKernelContext context(int64_t timeout_us) {
    EpKernelContext ctx;
    ctx.layout = layout;
    ctx.rank = rank;
    ctx.counters = reinterpret_cast<cuda::GroupCounters*>(region + layout.counters);
    for (int r = 0; r < num_ranks; ++r) ctx.regions[r] = peer_regions[r];
    ctx.escape.abort = reinterpret_cast<const uint32_t*>(&escape_device->abort);
    ctx.escape.departed_seen = reinterpret_cast<uint32_t*>(region + layout.departed_seen);
    ctx.timeout_ns = timeout_us < 0 ? -1 : timeout_us * 1000;
    return ctx;
  }

  // Every rank's step `what` succeeded (ok) or the group is not opened: the
  // ranks learn together whether all of them got there.
  std::string agree(bool ok, const std::string& mine, const char* what) {
    int all = 0;
    if (std::string why = comm->allMin(ok ? 1 : 0, &all, deadline()); !why.empty()) return why;
    if (all == 1) return {};
    return !mine.empty() ? mine : std::string("another rank failed at ") + what;
  }

  ~State() {
    DeviceScope scope(device);
    if (window != nullptr && comm != nullptr) comm->deregisterWindow(window, deadline());
    if (comm != nullptr) comm->close(deadline());
    if (region != nullptr) comm->library().memFree(region);
    if (escape_host != nullptr) cudaFreeHost(escape_host);
  }
};

std::string EpNcclGroup::makeUniqueId(std::string* error) { return NcclCommunicator::makeUniqueId(error); }

std::unique_ptr<EpNcclGroup> EpNcclGroup::open(const std::string& unique_id, int rank, int num_ranks,
                                               const EpIpcGroupOptions& options, std::string* error) {
  auto fail = [&](const std::string& why) -> std::unique_ptr<EpNcclGroup> {
    if (error)
      *error = "EP NCCL group (rank " + std::to_string(rank) + " of " + std::to_string(num_ranks) + "): " + why;
    return nullptr;
  };
  if (std::string why = cuda::checkGroupSizes(rank, num_ranks, options); !why.empty()) return fail(why);
  if (options.absent != 0) return fail("every rank takes part in an NCCL communicator (absent must be 0)");
  auto state = std::make_unique<State>();
  State& g = *state;
  g.rank = rank;
  g.num_ranks = num_ranks;
  g.options = options;
  cudaError_t err = cudaSuccess;
  if (options.device >= 0) {
    g.device = options.device;
  } else if ((err = cudaGetDevice(&g.device)) != cudaSuccess) {
    return fail(cudaWhat("cudaGetDevice", err));
  }
  DeviceScope scope(g.device);
  std::string why;
  g.comm = NcclCommunicator::create(unique_id, rank, num_ranks, g.device, g.deadline(), &why);
  if (!g.comm) return fail(why);
  const NcclLibrary& nccl = g.comm->library();

  // Who this GPU reaches: the rule holds on every rank, or on none.
  const ncclTeam_t lsa = nccl.teamLsa(g.comm->comm());
  const std::string topology = lsaTeamProblem(num_ranks, lsa.nRanks);
  if (!(why = g.agree(topology.empty(), topology, "the LSA team check")).empty()) return fail(why);

  // This rank's part of the window: signals and call counters must read 0
  // before any peer can write, so it is zeroed before it is registered.
  g.layout = RegionLayout::make(options.max_tokens_per_rank, options.hidden, options.num_experts, num_ranks);
  g.window_bytes = windowBytes(options.max_tokens_per_rank, options.hidden, options.num_experts, num_ranks);
  std::string local;
  if (const ncclResult_t r = nccl.memAlloc(reinterpret_cast<void**>(&g.region), g.window_bytes); r != ncclSuccess) {
    g.region = nullptr;
    local = std::string("ncclMemAlloc of ") + std::to_string(g.window_bytes) + " bytes: " + nccl.getErrorString(r);
  } else if ((err = cudaMemset(g.region, 0, g.layout.dispatch_rows)) != cudaSuccess ||
             (err = cudaDeviceSynchronize()) != cudaSuccess) {
    local = cudaWhat("cudaMemset of the window", err);
  } else if ((err = cudaHostAlloc(reinterpret_cast<void**>(&g.escape_host), sizeof(EscapeWords),
                                  cudaHostAllocMapped | cudaHostAllocPortable)) != cudaSuccess ||
             (err = cudaHostGetDevicePointer(reinterpret_cast<void**>(&g.escape_device), g.escape_host, 0)) !=
                 cudaSuccess) {
    local = cudaWhat("the mapped escape words", err);
  } else {
    std::memset(static_cast<void*>(g.escape_host), 0, sizeof(EscapeWords));
  }
  if (!(why = g.agree(local.empty(), local, "allocating the window")).empty()) return fail(why);
  if (!(why = g.comm->registerWindow(g.region, g.window_bytes, &g.window, g.deadline())).empty()) {
    g.window = nullptr;
    return fail(why);
  }

  // Every peer's part, as this GPU addresses it; this rank's own is its allocation.
  g.peer_regions.assign(num_ranks, nullptr);
  for (int i = 0; i < lsa.nRanks && local.empty(); ++i) {
    const int world = nccl.teamRankToWorld(g.comm->comm(), lsa, i);
    void* peer = nullptr;
    if (world < 0 || world >= num_ranks) {
      local = "NCCL numbers LSA rank " + std::to_string(i) + " as world rank " + std::to_string(world);
    } else if (world == rank) {
      g.peer_regions[world] = g.region;
    } else if (const ncclResult_t r = nccl.getLsaDevicePointer(g.window, 0, i, &peer);
               r != ncclSuccess || peer == nullptr) {
      local = "ncclGetLsaDevicePointer of LSA rank " + std::to_string(i) + ": " + nccl.getErrorString(r);
    } else {
      g.peer_regions[world] = static_cast<char*>(peer);
    }
  }
  for (int r = 0; r < num_ranks && local.empty(); ++r) {
    if (g.peer_regions[r] == nullptr) local = "no address for rank " + std::to_string(r) + " in the LSA team";
  }
  if (!(why = g.agree(local.empty(), local, "learning the peers' addresses")).empty()) return fail(why);
  MC_LOG(Info) << "EP NCCL group up: rank " << rank << " of " << num_ranks << ", window of " << g.window_bytes
               << " bytes";
  return std::unique_ptr<EpNcclGroup>(new EpNcclGroup(std::move(state)));
}

EpNcclGroup::EpNcclGroup(std::unique_ptr<State> state) : state_(std::move(state)) {}

EpNcclGroup::~EpNcclGroup() {
  State& g = *state_;
  DeviceScope scope(g.device);
  // This rank's kernels end first (a wait for a live peer that never calls
  // would not end by itself), then every rank meets: past that, nobody
  // writes into any window, and State's destructor frees them.
  abortWaits();
  cudaDeviceSynchronize();
  int all = 0;
  if (std::string why = g.comm->allMin(1, &all, g.deadline()); !why.empty()) {
    MC_LOG(Warning) << "EP NCCL group close (rank " << g.rank << "): " << why;
  }
  state_.reset();
}

int EpNcclGroup::rank() const { return state_->rank; }
int EpNcclGroup::numRanks() const { return state_->num_ranks; }
int EpNcclGroup::device() const { return state_->device; }

void EpNcclGroup::abortWaits() { state_->escape_host->abort.store(1, std::memory_order_release); }

void EpNcclGroup::abandon() {
  abortWaits();
  state_->comm->abort();
}

bool EpNcclGroup::dispatch(const DispatchArgs& args, cudaStream_t stream, std::string* error, EpStages stages) {
  State& g = *state_;
  std::string why = cuda::checkDispatchCall(args, g.layout);
  if (why.empty()) {
    why = g.gate.run(
        g.device, [&] { return cuda::launchDispatch(g.context(args.timeout_us), args, stages, stream); },
        [this] { abortWaits(); });
  }
  if (!why.empty() && error) *error = "EP dispatch: " + why;
  return why.empty();
}

bool EpNcclGroup::combine(const CombineArgs& args, cudaStream_t stream, std::string* error, EpStages stages) {
  State& g = *state_;
  std::string why = cuda::checkCombineCall(args, g.layout);
  if (why.empty()) {
    why = g.gate.run(
        g.device, [&] { return cuda::launchCombine(g.context(args.timeout_us), args, stages, stream); },
        [this] { abortWaits(); });
  }
  if (!why.empty() && error) *error = "EP combine: " + why;
  return why.empty();
}

}  // namespace mooncake::ep::nccl
