#include "ep_control_block.h"

#include <cuda_runtime_api.h>
#include <poll.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "mooncake/pg/shared_region.h"

#ifndef SYS_pidfd_open
#define SYS_pidfd_open 434
#endif

namespace mooncake::ep::cuda {
namespace {

constexpr uint64_t kMagic = 0x4d43455049504331ull;  // "MCEPIPC1"
constexpr uint32_t kVersion = 3;  // 3: departed_seen in the region (2: a build with device escape words)
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
  void* base = mooncake::pg::mapSharedRegion(name, rank == creator, total, deadline, "the EP control block", &why);
  if (base == nullptr) return fail(why);
  std::unique_ptr<EpControlBlock> block(new EpControlBlock);
  block->rank_ = rank;
  block->num_ranks_ = num_ranks;
  block->base_ = base;
  block->mapped_bytes_ = total;
  block->header_ = static_cast<EpControlHeader*>(base);
  block->slots_ = reinterpret_cast<EpRankSlot*>(static_cast<char*>(base) + slots_offset);
  EpControlHeader* h = block->header_;
  if (rank == creator) {
    // A fresh object is zero: only the identity needs writing.
    h->magic = kMagic;
    h->version = kVersion;
    h->num_ranks = static_cast<uint32_t>(num_ranks);
    h->tokens = options.max_tokens_per_rank;
    h->hidden = options.hidden;
    h->experts = options.num_experts;
    for (int r = 0; r < num_ranks; ++r) {
      if (absent(r)) h->departed[r].store(1, std::memory_order_relaxed);  // gone from the start
    }
    h->ready.store(1, std::memory_order_release);  // release: the identity before `ready`
  } else {
    while (h->ready.load(std::memory_order_acquire) == 0) {
      if (std::chrono::steady_clock::now() > deadline) return fail("the control block never became ready");
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
    if (h->magic != kMagic || h->version != kVersion || h->num_ranks != static_cast<uint32_t>(num_ranks) ||
        h->tokens != options.max_tokens_per_rank || h->hidden != options.hidden ||
        h->experts != options.num_experts) {
      return fail("sizes differ across ranks (ranks, max tokens per rank, hidden or experts)");
    }
  }
  EpRankSlot& me = block->slot(rank);
  me.pid = static_cast<int32_t>(::getpid());
  me.device = mine.device;
  me.region_bytes = mine.region_bytes;
  std::memcpy(me.region_handle, mine.region_handle, kIpcHandleBytes);
  me.attached.store(1, std::memory_order_release);  // release: publishes pid and handle
  for (int r = 0; r < num_ranks; ++r) {
    while (!absent(r) && block->slot(r).attached.load(std::memory_order_acquire) == 0) {
      if (std::chrono::steady_clock::now() > deadline) {
        if (rank == creator) ::shm_unlink(name.c_str());
        return fail("rank " + std::to_string(r) + " did not attach in time");
      }
      std::this_thread::sleep_for(std::chrono::microseconds(200));
    }
  }
  if (rank == creator) ::shm_unlink(name.c_str());  // everyone has it mapped: no name left behind
  block->pidfds_.assign(num_ranks, -1);
  for (int r = 0; r < num_ranks; ++r) {
    if (r != rank && !absent(r)) block->pidfds_[r] = static_cast<int>(::syscall(SYS_pidfd_open, block->slot(r).pid, 0));
  }
  block->watchdog_ = std::thread([b = block.get()] { b->watch(); });
  return block;
}

EpControlBlock::~EpControlBlock() {
  stop_.store(true);
  if (watchdog_.joinable()) watchdog_.join();
  for (int fd : pidfds_) {
    if (fd >= 0) ::close(fd);
  }
  if (registered_) cudaHostUnregister(base_);
  if (base_ != nullptr) ::munmap(base_, mapped_bytes_);
}

std::string EpControlBlock::registerWithCuda() {
  cudaError_t err = cudaHostRegister(base_, mapped_bytes_, cudaHostRegisterMapped | cudaHostRegisterPortable);
  if (err != cudaSuccess) return std::string("cudaHostRegister of the control block: ") + cudaGetErrorString(err);
  registered_ = true;
  void* device_base = nullptr;
  if ((err = cudaHostGetDevicePointer(&device_base, base_, 0)) != cudaSuccess) {
    return std::string("cudaHostGetDevicePointer: ") + cudaGetErrorString(err);
  }
  auto to_device = [&](const void* host) {
    return reinterpret_cast<const uint32_t*>(static_cast<char*>(device_base) +
                                             (static_cast<const char*>(host) - static_cast<char*>(base_)));
  };
  device_departed_ = to_device(&header_->departed[0]);
  device_abort_ = to_device(&slots_[rank_].abort);
  return {};
}

bool EpControlBlock::peerAlive(int r) const {
  const int fd = pidfds_[r];
  if (fd >= 0) {
    pollfd p{fd, POLLIN, 0};
    return ::poll(&p, 1, 0) == 0;  // readable once the process has exited
  }
  return ::kill(slot(r).pid, 0) == 0 || errno == EPERM;
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
