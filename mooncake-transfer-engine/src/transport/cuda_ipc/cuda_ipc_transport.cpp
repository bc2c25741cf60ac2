#include "transport/cuda_ipc/cuda_ipc_transport.h"

#include <cuda_runtime_api.h>
#include <unistd.h>

#include "cuda/cuda_driver.h"
#include "cuda/devices.h"
#include "mooncake/te/host_identity.h"
#include "mooncake/te/log.h"
#include "transport/cuda_ipc/ipc_buffer.h"
#include "transport/cuda_ipc/ipc_imports.h"
#include "transport/peer_stamp.h"

namespace mooncake::te {

// What we keep per peer process: who it is, and the allocations of its we
// have open, by their base address in its address space.
struct CudaIpcTransport::PeerState {
  int pid = 0;
  uint64_t start_ticks = 0;
  bool same_process = false;   // another engine of this process: its pointers are ours
  bool alive = true;           // the pid still belongs to the process that published the descriptor
  bool stamp_readable = true;  // the kernel lets us read its stamp (same user, no YAMA)
  std::mutex mutex;
  std::shared_ptr<const SegmentDescriptor> pruned_against;  // the descriptor `imports` was checked against
  std::map<uint64_t, std::shared_ptr<IpcImport>> imports;

  // Closes the mappings of allocations `d` no longer lists, or lists with
  // another handle (freed and allocated again at the same address).
  void prune(const std::shared_ptr<const SegmentDescriptor>& d) {
    std::lock_guard lock(mutex);
    if (pruned_against == d) return;
    std::map<uint64_t, std::string> listed;
    for (const BufferDescriptor& b : d->buffers) {
      CudaIpcBuffer ipc;
      if (CudaIpcBuffer::load(b, ipc)) listed[ipc.allocation_base] = ipc.handle;
    }
    for (auto it = imports.begin(); it != imports.end();) {
      auto l = listed.find(it->first);
      if (l == listed.end() || l->second != it->second->handle()) {
        it = imports.erase(it);  // closed once no copy in flight holds it
      } else {
        ++it;
      }
    }
    pruned_against = d;
  }
};

int CudaIpcTransport::install(const TransportContext& context) {
  context_ = context;
  return kOk;
}

void CudaIpcTransport::shutdown() {
  std::map<int, std::unique_ptr<CopyLane>> lanes;
  std::map<SegmentHandle, std::shared_ptr<PeerState>> peers;
  {
    std::lock_guard lock(mutex_);
    if (stopped_) return;
    stopped_ = true;
    lanes.swap(lanes_);
    peers.swap(peers_);
  }
  lanes.clear();  // completes every copy in flight
  peers.clear();  // then closes the mappings nothing holds any more
}

int CudaIpcTransport::registerMemory(const MemoryRegion& region, BufferDescriptor& buffer) {
  const int device = cudaDeviceOfLocation(region.location);
  if (device < 0) return kOk;  // host memory: not ours to publish
  // Failing to export is no reason to refuse the registration: peers then
  // reach the buffer over tcp, which stages through host memory.
  cuda::DeviceScope scope(device);
  const void* ptr = reinterpret_cast<const void*>(region.addr);
  CudaIpcBuffer ipc;
  if (!scope.ok() || !cuda::allocationRange(ptr, ipc.allocation_base, ipc.allocation_size)) {
    MC_LOG(Warning) << "cuda_ipc: no CUDA allocation found at 0x" << std::hex << region.addr << std::dec
                    << "; same-host peers will reach it over tcp";
    return kOk;
  }
  if (region.addr + region.length > ipc.allocation_base + ipc.allocation_size) {
    MC_LOG(Warning) << "cuda_ipc: [0x" << std::hex << region.addr << ", +0x" << region.length << std::dec
                    << ") spans several CUDA allocations, and one IPC handle covers one; same-host peers will "
                       "reach it over tcp";
    return kOk;
  }
  cudaIpcMemHandle_t handle;
  cudaError_t err = cudaIpcGetMemHandle(&handle, reinterpret_cast<void*>(ipc.allocation_base));
  if (err != cudaSuccess) {
    cudaGetLastError();
    // Memory from cudaMallocAsync pools or cuMemCreate (torch's expandable
    // segments) has no legacy IPC handle.
    MC_LOG(Warning) << "cuda_ipc: cannot export the allocation at 0x" << std::hex << ipc.allocation_base << std::dec
                    << " (" << cudaGetErrorString(err) << "); same-host peers will reach it over tcp";
    return kOk;
  }
  ipc.handle.assign(reinterpret_cast<const char*>(&handle), sizeof(handle));
  ipc.device = device;
  ipc.device_uuid = cuda::deviceUuid(device);
  ipc.store(buffer);
  return kOk;
}

bool CudaIpcTransport::reaches(PeerSegment& peer) {
  std::shared_ptr<const SegmentDescriptor> d = peer.descriptor();
  return d->host_id == context_.local->host_id && d->servesTransport(name()) && cuda::deviceCount() > 0;
}

bool CudaIpcTransport::carries(PeerSegment& peer, const MemoryRegion& local, const BufferDescriptor& remote) {
  // Cheap string checks first: host-only requests never start CUDA.
  const bool remote_gpu = cudaDeviceOfLocation(remote.location) >= 0;
  const bool local_gpu = cudaDeviceOfLocation(local.location) >= 0;
  if (!remote_gpu && !local_gpu) return false;
  std::shared_ptr<const SegmentDescriptor> d = peer.descriptor();
  if (d->host_id != context_.local->host_id) return false;
  if (d->pid == ::getpid()) return cuda::deviceCount() > 0;  // one process: plain pointers
  // Another process's host memory cannot be mapped by CUDA.
  CudaIpcBuffer ipc;
  return remote_gpu && CudaIpcBuffer::load(remote, ipc) && cuda::deviceWithUuid(ipc.device_uuid) >= 0;
}

void CudaIpcTransport::forget(SegmentHandle handle) {
  std::lock_guard lock(mutex_);
  peers_.erase(handle);
}

std::shared_ptr<CudaIpcTransport::PeerState> CudaIpcTransport::stateFor(PeerSegment& peer) {
  std::shared_ptr<const SegmentDescriptor> d = peer.descriptor();
  std::lock_guard lock(mutex_);
  std::shared_ptr<PeerState>& slot = peers_[peer.handle()];
  // A restarted peer at the same name is another process: start afresh.
  if (slot && slot->pid == d->pid && slot->start_ticks == d->process_start_ticks) return slot;
  auto state = std::make_shared<PeerState>();
  state->pid = d->pid;
  state->start_ticks = d->process_start_ticks;
  state->same_process = d->pid == ::getpid() && d->host_id == context_.local->host_id;
  state->alive = processStartTicks(d->pid) == d->process_start_ticks;
  SegmentStamp stamp;
  state->stamp_readable = readPeerStamp(d->pid, d->stamp_addr, stamp) != kEndpointError;
  if (!state->stamp_readable) {
    MC_LOG(Info) << "cuda_ipc: the stamp of " << peer.name() << " (pid " << d->pid
                 << ") cannot be read; its registration changes are seen only on address misses";
  }
  slot = state;
  return state;
}

int CudaIpcTransport::locate(PeerState& state, const BufferDescriptor& buffer, uint64_t addr, Target& out) {
  if (state.same_process) {
    out.ptr = reinterpret_cast<char*>(addr);
    out.device = cudaDeviceOfLocation(buffer.location);
    return kOk;
  }
  CudaIpcBuffer ipc;
  int device = CudaIpcBuffer::load(buffer, ipc) ? cuda::deviceWithUuid(ipc.device_uuid) : -1;
  if (device < 0) return kEndpointError;  // the descriptor changed since the engine chose us
  std::shared_ptr<IpcImport> import;
  {
    std::lock_guard lock(state.mutex);
    auto it = state.imports.find(ipc.allocation_base);
    if (it != state.imports.end() && it->second->handle() == ipc.handle) {
      import = it->second;
    } else if ((import = openIpcAllocation(ipc.handle, device))) {
      state.imports[ipc.allocation_base] = import;
    }
  }
  if (!import) return kEndpointError;
  out.ptr = import->base() + (addr - ipc.allocation_base);
  out.device = import->device();
  out.hold = std::move(import);
  return kOk;
}

CopyLane* CudaIpcTransport::laneFor(int device) {
  std::lock_guard lock(mutex_);
  if (stopped_) return nullptr;
  std::unique_ptr<CopyLane>& lane = lanes_[device];
  if (!lane) lane = CopyLane::create(device);
  return lane.get();
}

void CudaIpcTransport::enablePeerAccess(int from, int to) {
  {
    std::lock_guard lock(mutex_);
    if (!peer_access_.insert({from, to}).second) return;
  }
  // Without peer access a copy between two GPUs still works, staged by the
  // driver; with it, the copy goes over NVLink or PCIe directly.
  cuda::DeviceScope scope(from);
  int possible = 0;
  if (scope.ok() && cudaDeviceCanAccessPeer(&possible, from, to) == cudaSuccess && possible) {
    cudaError_t err = cudaDeviceEnablePeerAccess(to, 0);
    if (err != cudaSuccess && err != cudaErrorPeerAccessAlreadyEnabled) {
      MC_LOG(Info) << "cuda_ipc: peer access cuda:" << from << " -> cuda:" << to << " not enabled: "
                   << cudaGetErrorString(err);
    }
  }
  cudaGetLastError();
}

void CudaIpcTransport::submit(PeerSegment& peer, const std::vector<TransferTask*>& tasks, bool caller_waits) {
  std::shared_ptr<PeerState> state = stateFor(peer);
  int verdict = !state->alive            ? kPeerUnreachable
                : state->stamp_readable ? checkDescriptorFresh(peer, state->pid)
                                        : kOk;
  std::shared_ptr<const SegmentDescriptor> d = peer.descriptor();  // checked fresh above
  if (verdict == kOk && !state->same_process) state->prune(d);

  struct Copy {
    TransferTask* task;
    char* dst;
    const char* src;
    uint64_t length;
    std::shared_ptr<void> hold;
  };
  std::map<int, std::vector<Copy>> by_lane;  // by the device whose stream runs the copy
  for (TransferTask* task : tasks) {
    const TransferRequest& r = task->request();
    if (verdict != kOk) {
      task->fail(verdict);
      continue;
    }
    const BufferDescriptor* remote = d->findBuffer(r.target_offset, r.length);
    std::optional<MemoryRegion> local = context_.regions->find(reinterpret_cast<uint64_t>(r.source), r.length);
    if (remote == nullptr || !local) {
      task->fail(kAddressNotRegistered);
      continue;
    }
    Target target;
    if (int rc = locate(*state, *remote, r.target_offset, target); rc != kOk) {
      task->fail(rc);
      continue;
    }
    // The copy runs on the local GPU when there is one: its stream is where
    // the local memory's user expects the work.
    const int local_device = cudaDeviceOfLocation(local->location);
    const int lane = local_device >= 0 ? local_device : target.device;
    if (lane < 0) {
      task->fail(kEndpointError);  // host to host is not ours (carries() refuses it)
      continue;
    }
    if (local_device >= 0 && target.device >= 0 && local_device != target.device) {
      enablePeerAccess(local_device, target.device);
    }
    char* local_ptr = static_cast<char*>(r.source);
    const bool write = r.opcode == Opcode::kWrite;
    by_lane[lane].push_back(
        Copy{task, write ? target.ptr : local_ptr, write ? local_ptr : target.ptr, r.length, std::move(target.hold)});
  }

  for (auto& [device, copies] : by_lane) {
    CopyLane* lane = laneFor(device);
    cuda::DeviceScope scope(device);
    std::vector<CopyLane::Completion> completions;
    std::vector<std::shared_ptr<void>> holds;
    for (Copy& c : copies) {
      if (lane == nullptr || !scope.ok()) {
        c.task->fail(kEndpointError);
        continue;
      }
      c.task->expectSlices(1);
      if (int rc = lane->copy(c.dst, c.src, c.length); rc != kOk) {
        c.task->completeSlice(0, rc);
        continue;
      }
      completions.push_back(CopyLane::Completion{c.task, c.length});
      if (c.hold) holds.push_back(std::move(c.hold));
    }
    if (lane != nullptr) lane->finish(std::move(completions), std::move(holds), caller_waits);
  }
}

}  // namespace mooncake::te
