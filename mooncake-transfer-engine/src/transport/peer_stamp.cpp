#include "transport/peer_stamp.h"

#include <sys/uio.h>

#include <cerrno>

namespace mooncake::te {

int readPeerStamp(int pid, uint64_t addr, SegmentStamp& stamp) {
  iovec local{&stamp, sizeof(stamp)};
  iovec remote{reinterpret_cast<void*>(addr), sizeof(stamp)};
  ssize_t n = ::process_vm_readv(pid, &local, 1, &remote, 1, 0);
  if (n == static_cast<ssize_t>(sizeof(stamp))) return kOk;
  switch (n < 0 ? errno : EFAULT) {
    case ESRCH: return kPeerUnreachable;
    case EFAULT: return kAddressNotRegistered;
    default: return kEndpointError;
  }
}

int checkDescriptorFresh(PeerSegment& peer, int pid) {
  for (int attempt = 0; attempt < 2; ++attempt) {
    std::shared_ptr<const SegmentDescriptor> d = peer.descriptor();
    if (d->pid != pid) return kPeerUnreachable;  // the name now belongs to another process
    SegmentStamp stamp;
    if (int rc = readPeerStamp(pid, d->stamp_addr, stamp); rc != kOk) return rc;
    if (stamp.nonce == d->engine_nonce && stamp.registration_version == d->registration_version) return kOk;
    if (attempt == 0) {
      if (int rc = peer.refresh(); rc != kOk) return rc;
    }
  }
  return kPeerUnreachable;
}

}  // namespace mooncake::te
