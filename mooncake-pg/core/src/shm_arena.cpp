#include "shm_arena.h"

#include <linux/futex.h>
#include <sched.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <climits>
#include <cstring>
#include <thread>

namespace mooncake::pg {
namespace {

constexpr uint64_t kMagic = 0x4d43504753484d31ull;  // "MCPGSHM1"
constexpr uint32_t kVersion = 3;  // 2: outside_failed_mask; 3: broken_by_mismatch

size_t roundUp(size_t n, size_t to) { return (n + to - 1) / to * to; }

void futexWait(std::atomic<uint32_t>* word, uint32_t observed, std::chrono::microseconds timeout) {
  timespec ts{static_cast<time_t>(timeout.count() / 1000000), static_cast<long>(timeout.count() % 1000000) * 1000};
  ::syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), FUTEX_WAIT, observed, &ts, nullptr, 0);
}

void futexWakeAll(std::atomic<uint32_t>* word) {
  ::syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), FUTEX_WAKE, INT_MAX, nullptr, nullptr, 0);
}

inline bool reached(uint32_t value, uint32_t target) { return static_cast<int32_t>(value - target) >= 0; }

inline void cpuRelax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#endif
}

}  // namespace

std::unique_ptr<ShmArena> ShmArena::open(const std::string& name, int rank, int size, const ShmGroupOptions& options,
                                         std::string* error) {
  auto fail = [&](const std::string& why) -> std::unique_ptr<ShmArena> {
    if (error) *error = "shared-memory group '" + name + "': " + why;
    return nullptr;
  };
  if (size < 1 || rank < 0 || rank >= size) return fail("invalid rank/size");
  const size_t page = static_cast<size_t>(::sysconf(_SC_PAGESIZE));
  const size_t slot_bytes = roundUp(std::max<size_t>(options.slot_bytes, 4096), 4096);
  const size_t blocks_offset = roundUp(sizeof(ArenaHeader), 64);
  const size_t slots_offset = roundUp(blocks_offset + sizeof(RankBlock) * size, page);
  const size_t total = slots_offset + slot_bytes * size;

  auto deadline = std::chrono::steady_clock::now() + options.attach_timeout;
  std::string why;
  std::unique_ptr<AttachedRegion> region =
      AttachedRegion::map(name, rank == 0, total, deadline, "the arena", &why, options.superseded);
  if (region == nullptr) return fail(why);
  std::unique_ptr<ShmArena> arena(new ShmArena);
  arena->rank_ = rank;
  arena->size_ = size;
  arena->options_ = options;
  arena->header_ = region->at<ArenaHeader>(0);
  arena->blocks_ = region->at<RankBlock>(blocks_offset);
  arena->slots_ = region->at<char>(slots_offset);
  arena->oversubscribed_ = size > static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  ArenaHeader* h = arena->header_;
  AttachedRegion::Handshake steps;
  steps.rank = rank;
  steps.size = size;
  steps.rank_name = [&](int r) { return arena->rankName(r); };
  steps.ready = &h->ready;
  steps.presence = [&](int r) -> RankPresence& { return arena->block(r).presence; };
  steps.write_header = [&] {
    h->magic = kMagic;
    h->version = kVersion;
    h->size = static_cast<uint32_t>(size);
    h->slot_bytes = slot_bytes;
    h->slots_offset = slots_offset;
    h->broken_by.store(-1, std::memory_order_relaxed);
  };
  steps.check_header = [&]() -> std::string {
    if (h->magic != kMagic || h->version != kVersion || h->size != static_cast<uint32_t>(size) ||
        h->slot_bytes != slot_bytes) {
      return "arena layout differs (mismatched world size or MOONCAKE_PG_SHM_SLOT_BYTES across ranks)";
    }
    return {};
  };
  steps.never_ready = "arena never became ready";
  // A rank that attached and then left (its configuration superseded) breaks
  // the arena on its way out: the others, who may have seen it attached,
  // then stop waiting too instead of completing a group it has left.
  const auto left_by_one = [h] {
    return h->ready.load(std::memory_order_acquire) != 0 && h->broken_by.load(std::memory_order_acquire) >= 0;
  };
  steps.superseded = [&] { return left_by_one() || (options.superseded && options.superseded()); };
  const bool formed = region->handshake(steps, &why);
  if (!formed && why.rfind(kSupersededError, 0) == 0 && h->ready.load(std::memory_order_acquire) != 0) {
    arena->breakArena(why);  // names no rank as failed: nobody failed, the membership moved on
  }
  if (!formed) return fail(why);
  if (left_by_one()) return fail(std::string(kSupersededError) + ": " + arena->brokenResult().error);
  arena->region_ = std::move(region);
  return arena;
}

ShmArena::~ShmArena() = default;

OpResult ShmArena::brokenResult() const {
  OpResult r;
  r.ok = false;
  for (int q = 0; q < size_ && q < 64 * kMaxFailedMaskWords; ++q) {
    bool named = header_->failed_mask[q / 64].load(std::memory_order_acquire) & (1ull << (q % 64));
    if (named && q != rank_) r.failed_ranks.push_back(q);
  }
  int by = header_->broken_by.load(std::memory_order_acquire);
  r.error = "the group's shared-memory arena is broken (declared by " + rankName(by) +
            "): " + std::string(header_->broken_reason);
  r.mismatch = header_->broken_by_mismatch.load(std::memory_order_acquire) != 0;
  return r;
}

std::vector<int> ShmArena::outsideFailedRanks() const {
  std::vector<int> ranks;
  for (int q = 0; q < 64 * kMaxFailedMaskWords; ++q) {
    if (header_->outside_failed_mask[q / 64].load(std::memory_order_acquire) & (1ull << (q % 64))) ranks.push_back(q);
  }
  return ranks;
}

std::string ShmArena::rankName(int r) const {
  const std::vector<int>& names = options_.rank_names;
  return "rank " + std::to_string(r >= 0 && r < static_cast<int>(names.size()) ? names[r] : r);
}

void ShmArena::breakArena(const std::string& reason, const std::vector<int>& failed_ranks,
                          const std::vector<int>& outside_failed_ranks, bool mismatch) {
  auto name = [](std::atomic<uint64_t>* mask, const std::vector<int>& ranks) {
    for (int q : ranks) {
      if (q >= 0 && q < 64 * kMaxFailedMaskWords) mask[q / 64].fetch_or(1ull << (q % 64));
    }
  };
  name(header_->failed_mask, failed_ranks);
  name(header_->outside_failed_mask, outside_failed_ranks);
  int32_t expected = -1;
  if (header_->broken_by.compare_exchange_strong(expected, rank_, std::memory_order_acq_rel)) {
    std::strncpy(header_->broken_reason, reason.c_str(), sizeof(header_->broken_reason) - 1);
    header_->broken_by_mismatch.store(mismatch ? 1 : 0, std::memory_order_release);
  }
  for (int r = 0; r < size_; ++r) futexWakeAll(&block(r).step);
}

void ShmArena::signal() {
  RankBlock& me = mine();
  me.step.store(++steps_, std::memory_order_seq_cst);
  if (me.waiters.load(std::memory_order_seq_cst) > 0) futexWakeAll(&me.step);
}

bool ShmArena::waitFor(int peer, uint32_t target, std::chrono::steady_clock::time_point deadline, OpResult& result) {
  RankBlock& p = block(peer);
  // Spin briefly (a peer on another core is usually microseconds away), yield
  // a little, then sleep on the futex in short slices between liveness checks.
  const int spins = oversubscribed_ ? 0 : 2000;
  for (int i = 0; i < spins; ++i) {
    if (reached(p.step.load(std::memory_order_acquire), target)) return true;
    cpuRelax();
  }
  for (int i = 0; i < 8; ++i) {
    if (reached(p.step.load(std::memory_order_acquire), target)) return true;
    sched_yield();
  }
  for (;;) {
    p.waiters.fetch_add(1, std::memory_order_seq_cst);
    uint32_t observed = p.step.load(std::memory_order_seq_cst);
    if (!reached(observed, target) && !broken()) futexWait(&p.step, observed, std::chrono::milliseconds(20));
    p.waiters.fetch_sub(1, std::memory_order_seq_cst);
    if (reached(p.step.load(std::memory_order_acquire), target)) return true;
    if (broken()) {
      result = brokenResult();
      return false;
    }
    // Any rank still missing may have died, not only the one waited on.
    if (int dead = deadLaggard(target); dead >= 0) {
      result.ok = false;
      result.failed_ranks.push_back(dead);
      result.error = rankName(dead) + " (pid " + std::to_string(block(dead).presence.pid) + ") exited";
      return false;
    }
    if (options_.cut_off) {
      if (std::string why = options_.cut_off(); !why.empty()) {
        result.ok = false;
        result.failed_ranks.push_back(rank_);  // this rank is the one at fault, not whom it waits for
        result.error = why;
        return false;
      }
    }
    if (options_.deactivated) {
      const int name = peer < static_cast<int>(options_.rank_names.size()) ? options_.rank_names[peer] : peer;
      if (options_.deactivated(name)) {
        result.ok = false;
        result.failed_ranks.push_back(peer);
        result.error = rankName(peer) + " was deactivated by the membership while this rank waited for it";
        return false;
      }
    }
    if (std::chrono::steady_clock::now() > deadline) {
      result.ok = false;
      result.failed_ranks.push_back(peer);
      result.error = "timed out after " + std::to_string(options_.timeout.count()) + " ms waiting for " + rankName(peer);
      return false;
    }
  }
}

int ShmArena::deadLaggard(uint32_t target) const {
  for (int q = 0; q < size_; ++q) {
    if (q != rank_ && !reached(block(q).step.load(std::memory_order_acquire), target) && !peerAlive(q)) return q;
  }
  return -1;
}

OpResult ShmArena::waitAll(uint32_t target) {
  OpResult result;
  if (broken()) return brokenResult();
  auto deadline = std::chrono::steady_clock::now() + options_.timeout;
  for (int r = 0; r < size_; ++r) {
    if (r == rank_) continue;
    if (!waitFor(r, target, deadline, result)) {
      if (broken() && result.failed_ranks.empty()) return result;
      // Name every rank at fault, not only the first one found: after a
      // death, every rank that is gone too; after a timeout, every rank that
      // is still missing. A rank merely on its way is not named for a death.
      const bool timed_out = result.error.rfind("timed out", 0) == 0;
      for (int q = 0; q < size_; ++q) {
        bool missing = q != rank_ && !reached(block(q).step.load(std::memory_order_acquire), target);
        if (missing && (timed_out || !peerAlive(q)) &&
            std::find(result.failed_ranks.begin(), result.failed_ranks.end(), q) == result.failed_ranks.end()) {
          result.failed_ranks.push_back(q);
        }
      }
      breakArena(result.error, result.failed_ranks);
      return result;
    }
  }
  return result;
}

OpResult ShmArena::begin(uint64_t signature) {
  signature_ = signature;
  mine().signature[op_index_ % 4].store(signature, std::memory_order_relaxed);
  checked_signature_ = false;
  ++op_index_;
  return waitAll(steps_);
}

OpResult ShmArena::step() {
  signal();
  OpResult result = waitAll(steps_);
  if (result.ok && !checked_signature_) {
    checked_signature_ = true;
    uint64_t slot = (op_index_ - 1) % 4;
    for (int r = 0; r < size_; ++r) {
      if (block(r).signature[slot].load(std::memory_order_relaxed) != signature_) {
        result.ok = false;
        result.failed_ranks.push_back(r);
        result.mismatch = true;
        result.error = rankName(r) +
                       " called a different collective (operation, dtype, size or root differ): every rank must "
                       "issue the same collectives in the same order";
      }
    }
    if (!result.ok) breakArena(result.error, result.failed_ranks, {}, result.mismatch);
  }
  return result;
}

}  // namespace mooncake::pg
