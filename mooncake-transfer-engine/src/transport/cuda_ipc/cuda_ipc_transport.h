// Same-host transport for GPU memory: CUDA IPC. A registered GPU buffer is
// published with an IPC handle for the cudaMalloc allocation containing it
// (ipc_buffer.h); an initiator on the same host opens that allocation once
// (ipc_imports.h) and copies straight into or out of it with the GPU, on a
// stream of its own (copy_lane.h). The target does nothing.
//
// What it carries (carries()): a request whose remote buffer is GPU memory
// it can open, from or into local GPU or host memory; and, between engines of
// one process, anything with GPU memory on either side (pointers are valid
// as they are). Host memory of another process is not reachable by CUDA:
// local GPU -> remote host goes to tcp, which stages through host memory.
//
// Safety, as for shm: the peer's registration stamp is read before each
// submission (transport/peer_stamp.h), so an unregistered range is refused,
// and a re-registered allocation (a new handle at the same base) is opened
// afresh. Mappings of allocations the peer no longer lists are closed when
// its descriptor changes, when the segment is closed, and at shutdown.
//
// Nothing here touches CUDA before the first GPU registration or the first
// request with GPU memory, so CPU-only users of a CUDA build pay nothing and
// may still fork. Compiled only when MOONCAKE_WITH_CUDA.
#pragma once

#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <utility>

#include "mooncake/te/transport.h"
#include "transport/cuda_ipc/copy_lane.h"

namespace mooncake::te {

class CudaIpcTransport : public Transport {
 public:
  ~CudaIpcTransport() override { shutdown(); }

  const char* name() const override { return "cuda_ipc"; }
  int install(const TransportContext& context) override;
  void shutdown() override;
  int registerMemory(const MemoryRegion& region, BufferDescriptor& buffer) override;
  bool reaches(PeerSegment& peer) override;
  bool carries(PeerSegment& peer, const MemoryRegion& local, const BufferDescriptor& remote) override;
  void submit(PeerSegment& peer, const std::vector<TransferTask*>& tasks, bool caller_waits) override;
  void forget(SegmentHandle handle) override;

 private:
  struct PeerState;
  // Where one request's remote bytes are in our address space.
  struct Target {
    char* ptr = nullptr;
    int device = -1;  // local ordinal of the GPU holding them, -1 for host memory
    std::shared_ptr<void> hold;  // keeps the mapping open while the copy runs
  };

  std::shared_ptr<PeerState> stateFor(PeerSegment& peer);
  int locate(PeerState& state, const BufferDescriptor& buffer, uint64_t addr, Target& out);
  CopyLane* laneFor(int device);
  void enablePeerAccess(int from, int to);

  TransportContext context_;
  std::mutex mutex_;
  bool stopped_ = false;
  std::map<SegmentHandle, std::shared_ptr<PeerState>> peers_;
  std::map<int, std::unique_ptr<CopyLane>> lanes_;  // by local device
  std::set<std::pair<int, int>> peer_access_;       // device pairs already enabled
};

}  // namespace mooncake::te
