#include "transport/shm/shm_transport.h"

#include <poll.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/uio.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstring>

#include "mooncake/te/host_identity.h"
#include "mooncake/te/shared_memory.h"
#include "mooncake/te/log.h"
#include "transport/peer_stamp.h"

#ifndef SYS_pidfd_open
#define SYS_pidfd_open 434
#endif
#ifndef SYS_pidfd_getfd
#define SYS_pidfd_getfd 438
#endif

namespace mooncake::te {
namespace {

// Buffer attributes describing where a registered buffer lives in the
// owner's shared-memory file.
constexpr const char* kAttrFd = "shm.fd";
constexpr const char* kAttrInode = "shm.inode";
constexpr const char* kAttrFileSize = "shm.file_size";
constexpr const char* kAttrFileOffset = "shm.file_offset";

uint64_t attrNumber(const BufferDescriptor& b, const char* key) {
  auto it = b.attrs.find(key);
  return it == b.attrs.end() ? 0 : std::strtoull(it->second.c_str(), nullptr, 10);
}

int errnoToError(int err) {
  switch (err) {
    case ESRCH: return kPeerUnreachable;   // the process is gone
    case EFAULT: return kAddressNotRegistered;  // remote range not mapped
    case EPERM: return kEndpointError;      // not allowed to attach
    default: return kEndpointError;
  }
}

}  // namespace

ShmTransport::PeerProcess::~PeerProcess() {
  for (auto& [fd, m] : mappings) {
    if (m.base != nullptr) ::munmap(m.base, m.size);
  }
  if (pidfd >= 0) ::close(pidfd);
}

int ShmTransport::install(const TransportContext& context) {
  context_ = context;
  return kOk;
}

int ShmTransport::registerMemory(const MemoryRegion& region, BufferDescriptor& buffer) {
  std::optional<SharedMemoryFile> file = findSharedMemory(region.addr, region.length);
  if (!file) return kOk;  // ordinary memory: peers attach to it
  struct stat st {};
  if (::fstat(file->fd, &st) != 0) return kOk;
  buffer.attrs[kAttrFd] = std::to_string(file->fd);
  buffer.attrs[kAttrInode] = std::to_string(st.st_ino);
  buffer.attrs[kAttrFileSize] = std::to_string(file->size);
  buffer.attrs[kAttrFileOffset] = std::to_string(region.addr - file->base);
  return kOk;
}

std::shared_ptr<ShmTransport::PeerProcess> ShmTransport::attach(PeerSegment& peer) {
  std::shared_ptr<const SegmentDescriptor> snapshot = peer.descriptor();
  const SegmentDescriptor& d = *snapshot;
  std::lock_guard lock(mutex_);
  auto it = peers_.find(peer.handle());
  // A restarted peer at the same name has a new pid: attach again.
  if (it != peers_.end() && it->second->pid == d.pid && it->second->start_ticks == d.process_start_ticks) {
    return it->second;
  }
  auto process = std::make_shared<PeerProcess>();
  process->pid = d.pid;
  process->start_ticks = d.process_start_ticks;
  if (d.host_id == context_.local->host_id && d.servesTransport(name()) && d.pid > 0) {
    process->pidfd = static_cast<int>(::syscall(SYS_pidfd_open, d.pid, 0));
    // Check identity after pinning: if the start time matches now, the pidfd
    // refers to the peer and not to a later process with the same number.
    bool same_process = processStartTicks(d.pid) == d.process_start_ticks;
    SegmentStamp stamp;
    int rc = same_process ? readPeerStamp(d.pid, d.stamp_addr, stamp) : kPeerUnreachable;
    process->usable = same_process && rc == kOk;
    if (same_process && rc != kOk) {
      MC_LOG(Warning) << "same-host peer " << peer.name() << " (pid " << d.pid
                      << ") cannot be attached with process_vm_readv (" << std::strerror(errno)
                      << "); using another transport for it";
    }
  }
  peers_[peer.handle()] = process;  // a replaced PeerProcess closes its pidfd and mappings
  return process;
}

bool ShmTransport::reaches(PeerSegment& peer) { return attach(peer)->usable; }

bool ShmTransport::carries(PeerSegment&, const MemoryRegion& local, const BufferDescriptor& remote) {
  // memcpy and process_vm_* need memory the CPU can address.
  return cudaDeviceOfLocation(local.location) < 0 && cudaDeviceOfLocation(remote.location) < 0;
}

void ShmTransport::forget(SegmentHandle handle) {
  std::lock_guard lock(mutex_);
  peers_.erase(handle);
}

bool ShmTransport::alive(const PeerProcess& process) const {
  if (process.pidfd >= 0) {
    pollfd p{process.pidfd, POLLIN, 0};
    return ::poll(&p, 1, 0) == 0;  // readable once the process has exited
  }
  return processStartTicks(process.pid) == process.start_ticks;
}

char* ShmTransport::mapped(PeerProcess& process, const BufferDescriptor& buffer) const {
  auto fd_attr = buffer.attrs.find(kAttrFd);
  if (fd_attr == buffer.attrs.end() || process.pidfd < 0) return nullptr;
  const int fd = std::atoi(fd_attr->second.c_str());
  const uint64_t inode = attrNumber(buffer, kAttrInode);
  const uint64_t size = attrNumber(buffer, kAttrFileSize);
  const uint64_t offset = attrNumber(buffer, kAttrFileOffset);
  if (offset > size || buffer.length > size - offset) return nullptr;
  std::lock_guard lock(process.mappings_mutex);
  Mapping& m = process.mappings[fd];
  // The peer may have closed that fd and opened another file under the same
  // number since: the inode tells the files apart.
  if (m.inode != inode) {
    if (m.base != nullptr) ::munmap(m.base, m.size);
    m = Mapping{inode, nullptr, 0};
    int local_fd = static_cast<int>(::syscall(SYS_pidfd_getfd, process.pidfd, fd, 0));
    struct stat st {};
    if (local_fd >= 0 && ::fstat(local_fd, &st) == 0 && static_cast<uint64_t>(st.st_ino) == inode &&
        static_cast<uint64_t>(st.st_size) >= size) {
      void* p = ::mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_SHARED, local_fd, 0);
      if (p != MAP_FAILED) m = Mapping{inode, static_cast<char*>(p), size};
    }
    if (m.base == nullptr) {
      MC_LOG(Info) << "cannot map shared buffer of pid " << process.pid << " (fd " << fd
                   << "); copying with process_vm_writev instead";
    }
    if (local_fd >= 0) ::close(local_fd);  // the mapping keeps the file
  }
  return m.base == nullptr ? nullptr : m.base + offset;
}

int ShmTransport::copy(PeerProcess& process, const BufferDescriptor& buffer, const TransferRequest& request) const {
  if (char* view = mapped(process, buffer)) {
    char* remote = view + (request.target_offset - buffer.addr);
    if (request.opcode == Opcode::kWrite) {
      std::memcpy(remote, request.source, request.length);
    } else {
      std::memcpy(request.source, remote, request.length);
    }
    mapped_copies_.fetch_add(1, std::memory_order_relaxed);
    return kOk;
  }
  attached_copies_.fetch_add(1, std::memory_order_relaxed);
  return copyAttached(process, request);
}

int ShmTransport::copyAttached(const PeerProcess& process, const TransferRequest& request) const {
  auto* local = static_cast<char*>(request.source);
  uint64_t remote = request.target_offset;
  uint64_t left = request.length;
  while (left > 0) {
    // Chunks bound the time between liveness checks on large copies.
    size_t n = static_cast<size_t>(std::min<uint64_t>(left, context_.config->shm_chunk_size));
    iovec l{local, n};
    iovec r{reinterpret_cast<void*>(remote), n};
    ssize_t done = request.opcode == Opcode::kWrite ? ::process_vm_writev(process.pid, &l, 1, &r, 1, 0)
                                                    : ::process_vm_readv(process.pid, &l, 1, &r, 1, 0);
    if (done < 0) {
      if (errno == EINTR) continue;
      return errnoToError(errno);
    }
    if (done == 0) return kAddressNotRegistered;
    local += done;
    remote += static_cast<uint64_t>(done);
    left -= static_cast<uint64_t>(done);
    if (left > 0 && !alive(process)) return kPeerUnreachable;
  }
  return kOk;
}

int ShmTransport::writeTrailer(PeerProcess& process, const SegmentDescriptor& d, const TransferRequest& r) const {
  const BufferDescriptor* buffer = d.findBuffer(r.trailer_target, r.trailer_length);
  if (buffer == nullptr) return kAddressNotRegistered;
  // The payload's stores come first: a reader that sees the trailer sees them.
  std::atomic_thread_fence(std::memory_order_release);
  TransferRequest trailer = r;
  trailer.source = const_cast<void*>(r.trailer);
  trailer.target_offset = r.trailer_target;
  trailer.length = r.trailer_length;
  trailer.trailer_length = 0;
  return copy(process, *buffer, trailer);
}

void ShmTransport::submit(PeerSegment& peer, const std::vector<TransferTask*>& tasks, bool /*caller_waits*/) {
  // Copies run on the calling thread: a CPU copy is the work itself, and
  // handing it to another thread would only add a wake-up to every transfer.
  std::shared_ptr<PeerProcess> process = attach(peer);
  int verdict = !process->usable       ? kEndpointError
                : !alive(*process)       ? kPeerUnreachable
                                         : checkDescriptorFresh(peer, process->pid);
  std::shared_ptr<const SegmentDescriptor> d = peer.descriptor();  // checked fresh above
  for (TransferTask* task : tasks) {
    const TransferRequest& r = task->request();
    const BufferDescriptor* buffer = verdict == kOk ? d->findBuffer(r.target_offset, r.length) : nullptr;
    if (verdict != kOk) {
      task->fail(verdict);
    } else if (buffer == nullptr) {
      MC_LOG(Warning) << "remote range [0x" << std::hex << r.target_offset << ", +0x" << r.length << std::dec
                      << ") is not registered by " << peer.name();
      task->fail(kAddressNotRegistered);
    } else {
      task->expectSlices(1);
      int rc = copy(*process, *buffer, r);
      if (rc == kOk && r.trailer_length > 0) rc = writeTrailer(*process, *d, r);
      task->completeSlice(rc == kOk ? r.length : 0, rc);
    }
  }
}

}  // namespace mooncake::te
