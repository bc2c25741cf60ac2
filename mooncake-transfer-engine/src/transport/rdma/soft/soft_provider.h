// The software verbs provider: the seam of verbs.h carried out over TCP, for
// machines without an RDMA NIC. Test-only (MC_RDMA_PROVIDER=software): it
// moves bytes over unauthenticated TCP.
//
// What a reliable-connected queue pair on a NIC does is enforced, so that the
// transport above it meets real verbs behaviour:
// - Devices: MC_SOFTVERBS_DEVICES of them (default 1), "soft0", "soft1", ...
//   Each opened Device is one NIC of this process: a TCP listener on every
//   IPv4 address (an ephemeral port) with its own completion queue and
//   memory keys. Opening one name twice gives two independent NICs.
// - GIDs: one per IPv4 address of the host's interfaces that are up
//   (::ffff:a.b.c.d), loopback last. A requester reaches the responder's NIC
//   at the IPv4 address of the remote GID, port remote.qp_num >> 8
//   (qp_num = listen port << 8 | index, at most 256 QPs per device).
// - Queue pairs: RESET until connect() (once), then RTS; ERROR after the
//   first error completion, where every outstanding or later WR completes
//   with kFlushed. WRs run at the responder and complete in post order; the
//   send queue holds max_send_wr WRs not yet answered.
// - Keys and ranges checked on both sides (kLocalProtection at the requester,
//   kRemoteAccess at the responder, which also moves the responder's QP to
//   ERROR, as an RC responder does on an access violation); the responder
//   pins a registration while it copies, so that after deregisterMemory()
//   returns no byte of it is touched.
// - The responder QP must be RTS and connected to exactly this requester
//   (its qp_num, GID and first PSN): else kRemoteOperation. A responder QP
//   still in RESET is waited for up to half the requester's retry window, as a NIC
//   retransmits until the peer's QP is ready.
// - Retry exhaustion (kRetryExceeded): connection refused, connection lost
//   (the peer process died, its Device or QP was destroyed) or no answer for
//   4.096 us * 2^timeout * (retry_count + 1) (at least 10 ms; timeout 0:
//   forever, as on InfiniBand).
// - GPU memory (registerDeviceMemory(), CUDA builds only; elsewhere
//   kNotImplemented): [addr, addr + length) must be memory of CUDA device
//   `cuda_device` (its first and last byte are asked of the driver), else
//   kInvalidArgument. Keys, base addresses and deregistration as for host
//   memory. Where a NIC would reach GPU memory directly (GPUDirect RDMA),
//   every copy into or out of such a registration, at the responder (a
//   WRITE landing, a READ's answer) and at the requester (a WRITE's source,
//   a READ's target), is a synchronous CUDA copy (cuda/host_staging.h),
//   256 KiB at a time through the connection's host buffer, under the same
//   pin as a host copy (deregisterMemory() waits for it). A failed
//   CUDA copy fails the WR: at the responder kRemoteOperation
//   (kRemoteCopyFailed), and its QP enters the error state as after an
//   access violation; at the requester kLocalProtection (kLocalCopyFailed).
//   Inline WRITEs take host bytes only, as before.
// - Completion queue overrun (more than cq_entries unpolled completions) makes
//   every later pollCompletions() fail with kEndpointError.
// Destroying a Device stops its listener, its responders and every queue pair
// still open on it (they then post nothing: kEndpointError); destroy the queue
// pairs first.
#pragma once

#include <cstdint>
#include <memory>

#include "transport/rdma/verbs.h"

namespace mooncake::te::rdma::soft {

// WorkCompletion::vendor_error of the software provider: why a WR failed.
enum VendorError : uint32_t {
  kNoVendorError = 0,
  // Responder NAKs: kRemoteAccess.
  kUnknownRkey = 1,       // no live registration of the responder's device has this rkey
  kRemoteOutOfRange = 2,  // [remote, remote + length) is not inside the registration
  kRegionGone = 3,        // the registration was deregistered while the request ran
  // Responder NAKs: kRemoteOperation.
  kRemoteQpNotConnected = 10,  // the responder's QP never reached RTS
  kRemoteQpMismatch = 11,      // the responder's QP is connected to another qp_num
  kRemoteGidMismatch = 12,     // ... to another GID than the one this QP sends from
  kRemotePsnMismatch = 13,     // ... expecting another first PSN than this QP's
  kRemoteQpInError = 14,       // the responder's QP is in the error state
  kRemoteCopyFailed = 15,      // a CUDA copy into or out of the responder's GPU memory failed
  // Requester: kRetryExceeded.
  kConnectFailed = 20,   // the responder's NIC refused or did not answer the connection
  kConnectionLost = 21,  // the connection ended before every answer came
  kAckTimeout = 22,      // the oldest outstanding WR got no answer within the retry window
  // Requester: kLocalProtection.
  kBadLkey = 30,          // the local range is not inside a registration with this lkey
  kLocalCopyFailed = 31,  // a CUDA copy out of or into the local GPU memory failed
  // kOther.
  kProtocolError = 40,  // the responder answered something this requester did not ask
};

// Test-only fault injection, process-global: while set, every responder of
// every soft Device in this process stops reading requests and answering
// them (a hung peer NIC), so that requesters hit their ACK timeout without a
// second process. Requests already read are finished first. Clearing it lets
// the responders go on with whatever their connections still hold.
void setResponderStalled(bool stalled);
bool responderStalled();

// Test-only fault injection, process-global: while set, every copy into or
// out of GPU memory registered on any soft Device of this process fails as a
// failed CUDA copy does (no CUDA call is made). Host memory is unaffected.
void setDeviceCopiesFailing(bool failing);
bool deviceCopiesFailing();

}  // namespace mooncake::te::rdma::soft
