#include "control_block.h"

#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <thread>

namespace mooncake::pg::cuda {
namespace {

constexpr uint64_t kMagic = 0x4d43504743554431ull;  // "MCPGCUD1"
constexpr uint32_t kVersion = 1;

size_t roundUp(size_t n, size_t to) { return (n + to - 1) / to * to; }

bool reached(uint32_t value, uint32_t target) { return static_cast<int32_t>(value - target) >= 0; }

}  // namespace

std::unique_ptr<ControlBlock> ControlBlock::open(const std::string& name, int rank, int size,
                                                 std::chrono::milliseconds attach_timeout,
                                                 std::vector<int> rank_names, const Identity& mine,
                                                 std::string* error) {
  auto fail = [&](const std::string& why) -> std::unique_ptr<ControlBlock> {
    if (error) *error = "CUDA IPC group '" + name + "': " + why;
    return nullptr;
  };
  if (size < 1 || size > kMaxLocalRanks || rank < 0 || rank >= size) {
    return fail("invalid rank/size (at most " + std::to_string(kMaxLocalRanks) + " ranks per host)");
  }
  const size_t page = static_cast<size_t>(::sysconf(_SC_PAGESIZE));
  const size_t blocks_offset = roundUp(sizeof(ControlHeader), 64);
  const size_t total = roundUp(blocks_offset + sizeof(RankControl) * size, page);
  const auto deadline = std::chrono::steady_clock::now() + attach_timeout;

  std::string why;
  std::unique_ptr<AttachedRegion> region =
      AttachedRegion::map(name, rank == 0, total, deadline, "the control block", &why);
  if (region == nullptr) return fail(why);
  std::unique_ptr<ControlBlock> block(new ControlBlock);
  block->rank_ = rank;
  block->size_ = size;
  block->rank_names_ = std::move(rank_names);
  block->header_ = region->at<ControlHeader>(0);
  block->blocks_ = region->at<RankControl>(blocks_offset);
  ControlHeader* h = block->header_;
  AttachedRegion::Handshake steps;
  steps.rank = rank;
  steps.size = size;
  steps.rank_name = [&](int r) { return block->rankName(r); };
  steps.ready = &h->ready;
  steps.presence = [&](int r) -> RankPresence& { return block->block(r).presence; };
  steps.write_header = [&] {
    h->magic = kMagic;
    h->version = kVersion;
    h->size = static_cast<uint32_t>(size);
    h->staging_bytes = mine.staging_bytes;
    h->one_shot_bytes = mine.one_shot_bytes;
    h->breaker.store(-1, std::memory_order_relaxed);
    h->broken_by.store(-1, std::memory_order_relaxed);
  };
  steps.check_header = [&]() -> std::string {
    if (h->magic != kMagic || h->version != kVersion || h->size != static_cast<uint32_t>(size) ||
        h->staging_bytes != mine.staging_bytes || h->one_shot_bytes != mine.one_shot_bytes) {
      return "layout differs (world size, staging bytes or one-shot bytes differ across ranks)";
    }
    return {};
  };
  steps.never_ready = "the control block never became ready";
  steps.publish_mine = [&] {
    RankControl& me = block->mine();
    me.device = mine.device;
    me.staging_bytes = mine.staging_bytes;
    std::memcpy(me.staging_handle, mine.staging_handle, kIpcHandleBytes);
  };
  if (!region->handshake(steps, &why)) return fail(why);
  block->region_ = std::move(region);
  return block;
}

ControlBlock::~ControlBlock() = default;

std::string ControlBlock::registerWithCuda() {
  return mapping_.map(region_->base(), region_->bytes(), "the control block");
}

std::string ControlBlock::rankName(int r) const {
  return "rank " + std::to_string(r >= 0 && r < static_cast<int>(rank_names_.size()) ? rank_names_[r] : r);
}

void ControlBlock::breakGroup(const std::string& reason, const std::vector<int>& failed_ranks) {
  for (int q : failed_ranks) {
    if (q >= 0 && q < size_) header_->failed_mask.fetch_or(1ull << q, std::memory_order_relaxed);
  }
  int32_t nobody = -1;
  if (header_->breaker.compare_exchange_strong(nobody, rank_, std::memory_order_acq_rel)) {
    std::strncpy(header_->broken_reason, reason.c_str(), sizeof(header_->broken_reason) - 1);
    // release: the reason and the named ranks are visible to whoever sees broken_by.
    header_->broken_by.store(rank_, std::memory_order_release);
  }
}

OpResult ControlBlock::failure() const {
  OpResult r;
  const int32_t by = header_->broken_by.load(std::memory_order_acquire);
  if (by < 0) return r;
  r.ok = false;
  const uint64_t mask = header_->failed_mask.load(std::memory_order_relaxed);
  for (int q = 0; q < size_; ++q) {
    if ((mask >> q & 1) && q != rank_) r.failed_ranks.push_back(q);
  }
  r.error = "the CUDA IPC group is broken (declared by " + rankName(by) + "): " + std::string(header_->broken_reason);
  return r;
}

OpResult ControlBlock::exchangeSendTable(uint32_t round, const std::vector<size_t>& send_bytes,
                                         std::vector<std::vector<uint64_t>>& table, std::chrono::milliseconds timeout) {
  // Double-buffered by round parity: a rank can publish round+1 while others
  // still read round, but not round+2, which needs everyone's round+1.
  const int buffer = static_cast<int>(round % 2);
  RankControl& me = mine();
  for (int d = 0; d < size_; ++d) me.send_table[buffer][d] = send_bytes[d];
  me.table_round.store(round, std::memory_order_release);  // release: the row before the round number
  OpResult result;
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  auto pause = std::chrono::microseconds(5);
  for (int s = 0; s < size_; ++s) {
    while (!reached(block(s).table_round.load(std::memory_order_acquire), round)) {
      if (broken()) return failure();
      if (!peerAlive(s)) {
        result.ok = false;
        result.failed_ranks = {s};
        result.error = rankName(s) + " (pid " + std::to_string(block(s).presence.pid) + ") exited";
      } else if (std::chrono::steady_clock::now() > deadline) {
        result.ok = false;
        result.failed_ranks = {s};
        result.error = "all_to_all: timed out after " + std::to_string(timeout.count()) + " ms waiting for " +
                       rankName(s) + " to call it";
      }
      if (!result.ok) {
        breakGroup(result.error, result.failed_ranks);
        return result;
      }
      std::this_thread::sleep_for(pause);
      pause = std::min(pause * 2, std::chrono::microseconds(1000));
    }
  }
  table.assign(size_, std::vector<uint64_t>(size_));
  for (int s = 0; s < size_; ++s) {
    for (int d = 0; d < size_; ++d) table[s][d] = block(s).send_table[buffer][d];
  }
  return result;
}

}  // namespace mooncake::pg::cuda
