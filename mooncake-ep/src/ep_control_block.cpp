#include "ep_control_block.h"

#include <unistd.h>

#include <cstring>

namespace mooncake::ep::cuda {
namespace {

constexpr uint64_t kMagic = 0x4d43455049504331ull;  // "MCEPIPC1"
constexpr uint32_t kVersion =
    6;  // 6: given_up_by (5: output slots; 4: send tallies; 3: departed_seen; 2: device escape words)
constexpr auto kWatchPeriod = std::chrono::milliseconds(2);

size_t roundUp(size_t n, size_t to) { return (n + to - 1) / to * to; }

}  // namespace

std::unique_ptr<EpControlBlock> EpControlBlock::open(const std::string& name, int rank, int num_ranks,
                                                     const EpIpcGroupOptions& options, const Identity& mine,
                                                     std::string* error) {
  auto fail = [&](const std::string& why) -> std::unique_ptr<EpControlBlock> {
    if (error) *error = "EP IPC group '" + name + "': " + why;
    return nullptr;
  };
  const uint32_t all = num_ranks >= 32 ? ~0u : (1u << num_ranks) - 1;
  if ((options.absent >> rank & 1u) != 0 || (options.absent & all) == all) {
    return fail("rank " + std::to_string(rank) + " is among the absent ranks it was given");
  }
  // The lowest rank taking part creates the block.
  int creator = 0;
  while ((options.absent >> creator & 1u) != 0) ++creator;
  const auto absent = [&](int r) { return (options.absent >> r & 1u) != 0; };
  const size_t page = static_cast<size_t>(::sysconf(_SC_PAGESIZE));
  const size_t slots_offset = roundUp(sizeof(EpControlHeader), 64);
  const size_t total = roundUp(slots_offset + sizeof(EpRankSlot) * num_ranks, page);
  const auto deadline = std::chrono::steady_clock::now() + options.attach_timeout;
  std::string why;
  std::unique_ptr<mooncake::pg::AttachedRegion> region =
      mooncake::pg::AttachedRegion::map(name, rank == creator, total, deadline, "the EP control block", &why);
  if (region == nullptr) return fail(why);
  std::unique_ptr<EpControlBlock> block(new EpControlBlock);
  block->rank_ = rank;
  block->num_ranks_ = num_ranks;
  block->header_ = region->at<EpControlHeader>(0);
  block->slots_ = region->at<EpRankSlot>(slots_offset);
  EpControlHeader* h = block->header_;
  mooncake::pg::AttachedRegion::Handshake steps;
  steps.rank = rank;
  steps.size = num_ranks;
  steps.creator = creator;
  steps.absent = absent;
  steps.ready = &h->ready;
  steps.presence = [&](int r) -> mooncake::pg::RankPresence& { return block->slot(r).presence; };
  steps.write_header = [&] {
    // A fresh object is zero: only the identity needs writing.
    h->magic = kMagic;
    h->version = kVersion;
    h->num_ranks = static_cast<uint32_t>(num_ranks);
    h->tokens = options.max_tokens_per_rank;
    h->hidden = options.hidden;
    h->experts = options.num_experts;
    h->output_slots = options.output_slots;
    for (int r = 0; r < num_ranks; ++r) {
      if (absent(r)) h->departed[r].store(1, std::memory_order_relaxed);  // gone from the start
    }
  };
  steps.check_header = [&]() -> std::string {
    if (h->magic != kMagic || h->version != kVersion || h->num_ranks != static_cast<uint32_t>(num_ranks) ||
        h->tokens != options.max_tokens_per_rank || h->hidden != options.hidden || h->experts != options.num_experts ||
        h->output_slots != options.output_slots) {
      return "sizes differ across ranks (ranks, max tokens per rank, hidden, experts or output slots)";
    }
    return {};
  };
  steps.never_ready = "the control block never became ready";
  steps.publish_mine = [&] {
    EpRankSlot& me = block->slot(rank);
    me.device = mine.device;
    me.region_bytes = mine.region_bytes;
    std::memcpy(me.region_handle, mine.region_handle, kIpcHandleBytes);
  };
  if (!region->handshake(steps, &why)) return fail(why);
  block->region_ = std::move(region);
  block->watchdog_ = std::thread([b = block.get()] { b->watch(); });
  return block;
}

EpControlBlock::~EpControlBlock() {
  stop_.store(true);
  if (watchdog_.joinable()) watchdog_.join();
}

std::string EpControlBlock::registerWithCuda() {
  if (std::string why = mapping_.map(region_->base(), region_->bytes(), "the control block"); !why.empty()) {
    return why;
  }
  device_departed_ = mapping_.device(reinterpret_cast<const uint32_t*>(&header_->departed[0]));
  device_abort_ = mapping_.device(reinterpret_cast<const uint32_t*>(&slots_[rank_].abort));
  return {};
}

void EpControlBlock::watch() {
  while (!stop_.load(std::memory_order_relaxed)) {
    for (int r = 0; r < num_ranks_; ++r) {
      if (r == rank_ || header_->departed[r].load(std::memory_order_relaxed) != 0) continue;
      if (!peerAlive(r)) header_->departed[r].store(1, std::memory_order_release);
    }
    std::this_thread::sleep_for(kWatchPeriod);
  }
}

void EpControlBlock::closePhase(uint32_t phase, std::chrono::steady_clock::time_point deadline) {
  slot(rank_).closing.store(phase, std::memory_order_release);
  for (int r = 0; r < num_ranks_; ++r) {
    while (r != rank_ && slot(r).closing.load(std::memory_order_acquire) < phase &&
           header_->departed[r].load(std::memory_order_acquire) == 0 && peerAlive(r) &&
           std::chrono::steady_clock::now() < deadline) {
      std::this_thread::sleep_for(std::chrono::microseconds(200));
    }
  }
}

}  // namespace mooncake::ep::cuda
