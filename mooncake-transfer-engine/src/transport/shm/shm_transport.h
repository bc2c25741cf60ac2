// Same-host transport for CPU memory: one-sided copies straight between the
// two address spaces with cross-memory attach (process_vm_readv/writev). One
// copy, no socket, no cooperation from the target process; the kernel checks
// that we may access it (same user, no YAMA restriction).
//
// Safety against stale state, since the target never participates:
// - pid reuse: the peer is pinned by a pidfd opened after checking that the
//   pid's start time matches the descriptor; a transfer to an exited peer fails.
// - stale descriptors: the peer publishes the address of its registration
//   stamp (engine nonce + registration counter); before each submission we
//   read it (16 bytes, one syscall) and refetch the descriptor when it moved,
//   so a range the peer unregistered, or a buffer of an engine that was
//   replaced at the same name, is refused instead of written.
#pragma once

#include <map>
#include <memory>
#include <mutex>

#include "mooncake/te/transport.h"

namespace mooncake::te {

class ShmTransport : public Transport {
 public:
  ~ShmTransport() override;
  const char* name() const override { return "shm"; }
  int install(const TransportContext& context) override;
  void shutdown() override {}
  bool reaches(PeerSegment& peer) override;
  void submit(PeerSegment& peer, const std::vector<TransferTask*>& tasks, bool caller_waits) override;
  void forget(SegmentHandle handle) override;

 private:
  struct PeerProcess {
    int pid = 0;
    uint64_t start_ticks = 0;
    int pidfd = -1;         // -1 where pidfd_open is unavailable: start time is checked instead
    bool usable = false;    // cross-memory attach to it works
  };

  std::shared_ptr<PeerProcess> attach(PeerSegment& peer);
  bool alive(const PeerProcess& process) const;
  int readStamp(const PeerProcess& process, uint64_t addr, SegmentStamp& stamp) const;
  // kOk when the cached descriptor matches the peer's stamp, after at most one refresh.
  int checkFresh(PeerSegment& peer, const PeerProcess& process) const;
  int copy(const PeerProcess& process, const TransferRequest& request) const;

  TransportContext context_;
  std::mutex mutex_;
  std::map<SegmentHandle, std::shared_ptr<PeerProcess>> peers_;
};

}  // namespace mooncake::te
