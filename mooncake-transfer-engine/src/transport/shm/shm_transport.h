// Same-host transport for CPU memory: one-sided copies straight between the
// two address spaces, one copy, no socket, no cooperation from the target.
// GPU memory on either side is left to cuda_ipc or tcp (see carries()).
// Two ways, chosen per remote buffer:
// - mapped: the buffer lies in shared memory (te/shared_memory.h); we take a
//   duplicate of the peer's memfd (pidfd_getfd), map it once and memcpy.
// - attached: any other memory, with cross-memory attach
//   (process_vm_readv/writev), which pins the pages on every call.
// Both need the kernel's permission to attach to the peer (same user, no YAMA
// restriction); without it the peer is left to another transport.
//
// Safety against stale state, since the target never participates:
// - pid reuse: the peer is pinned by a pidfd opened after checking that the
//   pid's start time matches the descriptor; a transfer to an exited peer fails.
// - stale descriptors: before each submission we read the peer's stamp
//   (transport/peer_stamp.h, 16 bytes, one syscall) and refetch the
//   descriptor when it moved, so a range the peer unregistered, or a buffer
//   of an engine that was replaced at the same name, is refused instead of
//   written.
#pragma once

#include <atomic>
#include <map>
#include <memory>
#include <mutex>

#include "mooncake/te/transport.h"

namespace mooncake::te {

class ShmTransport : public Transport {
 public:
  const char* name() const override { return "shm"; }
  int install(const TransportContext& context) override;
  void shutdown() override {}
  int registerMemory(const MemoryRegion& region, BufferDescriptor& buffer) override;
  bool reaches(PeerSegment& peer) override;
  bool carries(PeerSegment& peer, const MemoryRegion& local, const BufferDescriptor& remote) override;
  void submit(PeerSegment& peer, const std::vector<TransferTask*>& tasks, bool caller_waits) override;
  void forget(SegmentHandle handle) override;
  bool ordersTrailers() const override { return true; }  // copies run in order on one thread

  // How many copies went through a mapping and through cross-memory attach.
  uint64_t mappedCopies() const { return mapped_copies_.load(std::memory_order_relaxed); }
  uint64_t attachedCopies() const { return attached_copies_.load(std::memory_order_relaxed); }

 private:
  // A mapping of one of the peer's shared-memory files.
  struct Mapping {
    uint64_t inode = 0;
    char* base = nullptr;  // null: mapping failed, use cross-memory attach
    size_t size = 0;
  };
  struct PeerProcess {
    ~PeerProcess();
    int pid = 0;
    uint64_t start_ticks = 0;
    int pidfd = -1;         // -1 where pidfd_open is unavailable: start time is checked instead
    bool usable = false;    // cross-memory attach to it works
    std::mutex mappings_mutex;
    std::map<int, Mapping> mappings;  // by the peer's fd number
  };

  std::shared_ptr<PeerProcess> attach(PeerSegment& peer);
  bool alive(const PeerProcess& process) const;
  int copy(PeerProcess& process, const BufferDescriptor& buffer, const TransferRequest& request) const;
  int copyAttached(const PeerProcess& process, const TransferRequest& request) const;
  // The request's trailer, after its payload (TransferRequest::trailer).
  int writeTrailer(PeerProcess& process, const SegmentDescriptor& d, const TransferRequest& r) const;
  // Our view of the peer's shared buffer, or null to fall back to attaching.
  char* mapped(PeerProcess& process, const BufferDescriptor& buffer) const;

  TransportContext context_;
  std::mutex mutex_;
  std::map<SegmentHandle, std::shared_ptr<PeerProcess>> peers_;
  mutable std::atomic<uint64_t> mapped_copies_{0};
  mutable std::atomic<uint64_t> attached_copies_{0};
};

}  // namespace mooncake::te
