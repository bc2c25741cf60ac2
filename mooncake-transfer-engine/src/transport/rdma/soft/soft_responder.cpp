// The responder side of the software NIC: one thread per incoming
// connection, serving its requests one at a time, in order, against this
// device's registrations.
#include <sys/socket.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

#include "mooncake/te/log.h"
#include "mooncake/te/status.h"
#include "transport/rdma/soft/soft_internal.h"

namespace mooncake::te::rdma::soft {
namespace {

using namespace std::chrono_literals;

// How long a connection may take to say which QP it is for.
constexpr auto kHelloWait = 10s;

int sendAnswer(int fd, uint64_t seq, Completion status, uint32_t reason) {
  Answer answer;
  answer.seq = seq;
  answer.status = static_cast<uint8_t>(status);
  answer.reason = static_cast<uint8_t>(reason);
  return net::sendAll(fd, &answer, sizeof(answer), net::never());
}

std::string qpText(uint32_t qp_num) {
  char text[16];
  std::snprintf(text, sizeof(text), "0x%06x", qp_num);
  return text;
}

}  // namespace

bool DeviceCore::waitWhileStalled(const Inbound& in) {
  while (responderStalled()) {
    if (in.closing.load(std::memory_order_acquire)) return false;
    std::this_thread::sleep_for(2ms);
  }
  return !in.closing.load(std::memory_order_acquire);
}

void DeviceCore::drain(Inbound& in, std::vector<char>& scratch) {
  // After an error answer the requester is in the error state and closes;
  // reading on until then (instead of closing now) keeps the error answer
  // from being lost to a reset of a connection with unread bytes.
  for (;;) {
    ssize_t n = ::recv(in.socket.fd(), scratch.data(), scratch.size(), 0);
    if (n > 0) continue;
    if (n < 0 && errno == EINTR) continue;
    return;
  }
}

QpState DeviceCore::waitUntilConnected(const QpCore& qp, net::Deadline deadline, const std::atomic<bool>& closing) {
  std::unique_lock lock(qps_mutex_);
  for (;;) {
    QpState state = qp.state();
    if (state != QpState::kReset || qp.stopped() || closing.load(std::memory_order_acquire) ||
        shut_down_.load(std::memory_order_acquire)) {
      return state;
    }
    const auto now = net::Clock::now();
    if (now >= deadline) return state;
    // In slices: a closing connection is not signalled through this variable.
    qp_state_changed_.wait_until(lock, std::min<net::Deadline>(deadline, now + 20ms));
  }
}

void DeviceCore::serve(Inbound& in) {
  const int fd = in.socket.fd();
  if (net::waitReadable(fd, net::after(kHelloWait)) != kOk || !waitWhileStalled(in)) return;
  Hello hello;
  if (net::recvAll(fd, &hello, sizeof(hello), net::after(kHelloWait)) != kOk) return;
  if (hello.magic != kHelloMagic) {
    MC_LOG(Warning) << name() << ": a connection that is no soft verbs requester (or of another byte order): closed";
    return;
  }
  // A QP that does not exist (destroyed, or never) drops what comes to it,
  // as a NIC does: the requester's retries run out.
  std::shared_ptr<QpCore> target = findQueuePair(hello.destination_qp_num);
  if (!target) return;
  {
    // Known before the checks below, so that destroying the QP ends this
    // connection whenever it happens.
    std::lock_guard lock(inbound_mutex_);
    if (in.closing.load(std::memory_order_acquire)) return;
    in.target = target.get();
  }
  // A requester may send before the responder's side has moved its QP to
  // RTS (each side connects on its own); a NIC drops and retransmits until
  // it has, within the requester's retry window.
  const net::Deadline wait_deadline =
      hello.wait_ms == 0 ? net::never() : net::after(std::chrono::milliseconds(hello.wait_ms));
  const QpState state = waitUntilConnected(*target, wait_deadline, in.closing);
  if (target->stopped() || in.closing.load(std::memory_order_acquire)) return;
  uint32_t verdict = kNoVendorError;
  const PeerBinding peer = target->peer();
  Gid source_gid;
  std::memcpy(source_gid.raw.data(), hello.source_gid, sizeof(hello.source_gid));
  if (state == QpState::kReset) {
    verdict = kRemoteQpNotConnected;
  } else if (peer.qp_num != hello.source_qp_num) {
    verdict = kRemoteQpMismatch;
  } else if (!(peer.gid == source_gid)) {
    verdict = kRemoteGidMismatch;
  } else if (peer.psn != (hello.source_psn & 0xFFFFFF)) {
    verdict = kRemotePsnMismatch;
  }
  if (verdict != kNoVendorError) {
    std::string remote_ip, source_ip;
    ipv4OfGid(peer.gid, remote_ip);
    ipv4OfGid(source_gid, source_ip);
    MC_LOG(Warning) << name() << ": qp " << qpText(hello.destination_qp_num) << " refuses requester qp "
                    << qpText(hello.source_qp_num) << " (gid " << source_ip << ", psn " << hello.source_psn << "): "
                    << (state == QpState::kReset ? std::string("it is not connected")
                                                 : "it is connected to qp " + qpText(peer.qp_num) + " (gid " +
                                                       remote_ip + ", psn " + std::to_string(peer.psn) + ")");
  }
  std::weak_ptr<QpCore> weak_target = target;
  target.reset();  // the QP's owner decides its lifetime, not this connection

  std::vector<char> scratch(kChunk);
  // An access violation, or a copy into or out of GPU memory that failed,
  // NAKs the request and moves this side's QP to the error state too, as an
  // RC responder does.
  auto fail = [&](uint64_t seq, Completion status, uint32_t reason) {
    if (std::shared_ptr<QpCore> qp = weak_target.lock()) qp->failFromResponder();
    if (sendAnswer(fd, seq, status, reason) == kOk) drain(in, scratch);
  };
  // The NAK of a chunk's copy that did not happen.
  auto failCopy = [&](uint64_t seq, RegionTable::Copy outcome) {
    if (outcome == RegionTable::Copy::kFailed) {
      fail(seq, Completion::kRemoteOperation, kRemoteCopyFailed);
    } else {
      fail(seq, Completion::kRemoteAccess, kRegionGone);
    }
  };
  for (;;) {
    // The stall is checked once a request is there to read, so that one
    // coming after setResponderStalled(true) is never served.
    if (net::waitReadable(fd, net::never()) != kOk || !waitWhileStalled(in)) return;
    Request request;
    if (net::recvAll(fd, &request, sizeof(request), net::never()) != kOk) return;  // the requester closed
    const bool write = request.opcode == static_cast<uint8_t>(Opcode::kWrite);
    const bool read = request.opcode == static_cast<uint8_t>(Opcode::kRead);
    if ((!write && !read) || request.length == 0) {
      MC_LOG(Warning) << name() << ": a malformed request (opcode " << int{request.opcode} << ", length "
                      << request.length << ") from qp " << qpText(hello.source_qp_num) << ": connection closed";
      return;
    }
    uint32_t refusal = verdict;
    {
      std::shared_ptr<QpCore> qp = weak_target.lock();
      if (!qp || qp->stopped()) return;  // destroyed meanwhile: dropped, as above
      if (refusal == kNoVendorError && qp->state() == QpState::kError) refusal = kRemoteQpInError;
    }
    if (refusal != kNoVendorError) {
      if (sendAnswer(fd, request.seq, Completion::kRemoteOperation, refusal) == kOk) drain(in, scratch);
      return;
    }
    // The whole range is checked before any byte moves (a NIC checks the
    // RETH of the first packet); each chunk again, under a pin, in case the
    // registration goes meanwhile.
    const RegionTable::Check check = regions_.covers(KeyKind::kRemote, request.rkey, request.remote, request.length);
    if (check != RegionTable::Check::kOk) {
      fail(request.seq, Completion::kRemoteAccess,
           check == RegionTable::Check::kUnknownKey ? kUnknownRkey : kRemoteOutOfRange);
      return;
    }
    if (write) {
      for (uint64_t offset = 0; offset < request.length;) {
        const size_t n = static_cast<size_t>(std::min<uint64_t>(kChunk, request.length - offset));
        // Received before the pin: a slow requester must not hold up a
        // deregistration.
        if (net::recvAll(fd, scratch.data(), n, net::never()) != kOk) return;
        const RegionTable::Copy copied =
            regions_.copyIn(KeyKind::kRemote, request.rkey, request.remote + offset, scratch.data(), n);
        if (copied != RegionTable::Copy::kOk) {
          failCopy(request.seq, copied);
          return;
        }
        offset += n;
      }
      if (sendAnswer(fd, request.seq, Completion::kSuccess, kNoVendorError) != kOk) return;
      continue;
    }
    for (uint64_t offset = 0; offset < request.length;) {
      const size_t n = static_cast<size_t>(std::min<uint64_t>(kChunk, request.length - offset));
      const RegionTable::Copy copied =
          regions_.copyOut(KeyKind::kRemote, request.rkey, request.remote + offset, scratch.data(), n);
      if (copied != RegionTable::Copy::kOk) {
        failCopy(request.seq, copied);
        return;
      }
      Answer answer;
      answer.seq = request.seq;
      answer.length = static_cast<uint32_t>(n);
      answer.last = offset + n == request.length ? 1 : 0;
      if (net::sendPieces(fd, {{&answer, sizeof(answer)}, {scratch.data(), n}}, net::never()) != kOk) return;
      offset += n;
    }
  }
}

}  // namespace mooncake::te::rdma::soft
