// The requester side of a software queue pair: post() queues work requests;
// a sender thread streams them to the responder's NIC over one connection
// (many in flight: no round trip per request) and a receiver thread reads the
// answers, which come in post order, and completes the requests in that order.
#include <sys/socket.h>

#include <algorithm>
#include <cstring>

#include "mooncake/te/log.h"
#include "mooncake/te/status.h"
#include "transport/rdma/soft/soft_internal.h"

namespace mooncake::te::rdma::soft {
namespace {

bool validMtu(uint32_t mtu) { return mtu == 256 || mtu == 512 || mtu == 1024 || mtu == 2048 || mtu == 4096; }

// The longest a connection attempt may take: a NIC's connection is instant,
// but an address that drops SYNs would otherwise hold stop() for the whole
// retry window.
constexpr std::chrono::seconds kMaxConnectWait{10};

}  // namespace

QpCore::QpCore(std::shared_ptr<DeviceCore> device, uint8_t index, uint32_t qp_num, uint32_t max_send_wr,
               uint32_t max_inline)
    : device_(std::move(device)), index_(index), qp_num_(qp_num), max_send_wr_(max_send_wr), max_inline_(max_inline) {}

QpCore::~QpCore() { stop(); }

PeerBinding QpCore::peer() const {
  std::lock_guard lock(mutex_);
  return peer_;
}

int QpCore::connect(const QpAddress& remote, uint32_t psn, const ConnectOptions& options) {
  std::unique_lock lock(mutex_);
  if (stopping_ || connected_once_ || state_ != QpState::kReset) return kInvalidArgument;
  std::string host;
  const uint32_t remote_port = remote.qp_num >> 8;
  const auto& gids = device_->port().gids;
  // What ibv_modify_qp refuses: a QP number or GID that cannot be a peer's,
  // a source GID the port does not have, an MTU that is not one, fields wider
  // than the packet headers carry.
  if (remote.qp_num == 0 || remote.qp_num > 0xFFFFFF || remote_port == 0 || !ipv4OfGid(remote.gid, host) ||
      options.gid_index < 0 || static_cast<size_t>(options.gid_index) >= gids.size() || !validMtu(remote.mtu) ||
      options.timeout > 31 || options.retry_count > 7) {
    return kInvalidArgument;
  }
  peer_.qp_num = remote.qp_num;
  peer_.gid = remote.gid;
  peer_.psn = remote.psn & 0xFFFFFF;
  local_gid_ = gids[static_cast<size_t>(options.gid_index)].gid;
  local_psn_ = psn & 0xFFFFFF;
  remote_host_ = host;
  remote_port_ = static_cast<uint16_t>(remote_port);
  // The local ACK timeout: 4.096 us * 2^timeout per try, retry_count
  // retransmissions; 0 is "wait forever" as on InfiniBand. At least 10 ms:
  // a thread wake-up on a loaded host is not a lost packet.
  retry_window_bounded_ = options.timeout != 0;
  const auto per_try = std::chrono::nanoseconds(uint64_t{4096} << options.timeout);
  retry_window_ =
      std::max<std::chrono::nanoseconds>(per_try * (options.retry_count + 1), std::chrono::milliseconds(10));
  connected_once_ = true;
  state_.store(QpState::kReadyToSend, std::memory_order_release);
  lock.unlock();
  changed_.notify_all();
  device_->queuePairStateChanged();
  return kOk;
}

int QpCore::post(const WorkRequest* requests, size_t count, size_t& posted) {
  posted = 0;
  std::unique_lock lock(mutex_);
  if (stopping_) return kEndpointError;  // its device is gone
  if (state_ == QpState::kReset) return kInvalidArgument;
  if (count > 0 && requests == nullptr) return kInvalidArgument;
  // The threads start with the first post, not at connect(): a QP that only
  // serves as a responder (the transport's accepting side) never needs them.
  if (count > 0 && state_ == QpState::kReadyToSend && !startThreadsLocked()) return kEndpointError;
  int rc = kOk;
  bool queued = false;
  for (size_t i = 0; i < count; ++i) {
    const WorkRequest& wr = requests[i];
    // Refused at post, as ibv_post_send refuses them: nothing to do, an
    // inline READ, more inline bytes than the QP was created for.
    if (wr.length == 0 || (wr.inline_data && (wr.read || wr.length > max_inline_ || wr.local == nullptr))) {
      rc = kInvalidArgument;
      break;
    }
    if (state_ == QpState::kError) {
      // Accepted and flushed at once: the QP is in the error state.
      device_->completions().push(WorkCompletion{wr.wr_id, Completion::kFlushed, qp_num_, 0});
      ++posted;
      continue;
    }
    if (queue_.size() + 1 > max_send_wr_) {
      rc = kTooManyRequests;
      break;
    }
    Slot slot;
    slot.seq = next_post_seq_++;
    slot.wr = wr;
    if (wr.inline_data) {
      // The caller may reuse its bytes as soon as post() returns.
      const auto* bytes = static_cast<const char*>(wr.local);
      slot.inline_bytes.assign(bytes, bytes + wr.length);
    } else {
      slot.prefailed = device_->regions().covers(KeyKind::kLocal, wr.lkey, reinterpret_cast<uintptr_t>(wr.local),
                                                 wr.length) != RegionTable::Check::kOk;
    }
    queue_.push_back(std::move(slot));
    queued = true;
    ++posted;
  }
  lock.unlock();
  if (queued) changed_.notify_all();
  return rc;
}

bool QpCore::startThreadsLocked() {
  try {
    if (!sender_.joinable()) sender_ = std::thread([this] { runGuarded("sender", [this] { senderLoop(); }); });
    if (!receiver_.joinable()) receiver_ = std::thread([this] { runGuarded("receiver", [this] { receiverLoop(); }); });
    return true;
  } catch (const std::exception& e) {
    MC_LOG(Error) << device_->name() << ": cannot start the threads of qp 0x" << std::hex << qp_num_ << std::dec << ": "
                  << e.what();
    return false;
  }
}

template <typename Body>
void QpCore::runGuarded(const char* what, Body&& body) {
  try {
    body();
  } catch (const std::exception& e) {
    // Logged, and the QP fails as a NIC's would on an internal error,
    // instead of the process going down or its WRs waiting forever.
    MC_LOG(Error) << device_->name() << ": qp 0x" << std::hex << qp_num_ << std::dec << ": the " << what
                  << " failed: " << e.what();
    failUnlessStopped(Completion::kOther, kNoVendorError);
  }
}

QpCore::Slot* QpCore::slotLocked(uint64_t seq) {
  if (queue_.empty() || seq < queue_.front().seq || seq > queue_.back().seq) return nullptr;
  return &queue_[seq - queue_.front().seq];
}

void QpCore::failLocked(Completion status, uint32_t reason) {
  if (stopping_ || state_ != QpState::kReadyToSend) return;
  state_.store(QpState::kError, std::memory_order_release);
  MC_LOG(Info) << device_->name() << ": qp 0x" << std::hex << qp_num_ << std::dec
               << " enters the error state: " << completionName(status) << " (vendor error " << reason << "), "
               << queue_.size() << " WRs outstanding";
  bool first = true;
  for (const Slot& slot : queue_) {
    // Errors always complete, signaled or not.
    device_->completions().push(
        WorkCompletion{slot.wr.wr_id, first ? status : Completion::kFlushed, qp_num_, first ? reason : 0u});
    first = false;
  }
  queue_.clear();
  socket_.shutdownBoth();  // the sender and the receiver return; the responder sees the end
  changed_.notify_all();
}

void QpCore::failUnlessStopped(Completion status, uint32_t reason) {
  std::lock_guard lock(mutex_);
  failLocked(status, reason);
}

void QpCore::failFromResponder() {
  std::lock_guard lock(mutex_);
  failLocked(Completion::kFlushed, kNoVendorError);
}

void QpCore::localCopyFailedLocked(uint64_t seq, RegionTable::Copy outcome) {
  Slot* slot = slotLocked(seq);
  if (slot == nullptr || slot->local_error != kNoVendorError) return;  // flushed, or the first reason stays
  slot->local_error = outcome == RegionTable::Copy::kFailed ? kLocalCopyFailed : kBadLkey;
}

net::Deadline QpCore::answerDeadlineLocked(const Slot& oldest) const {
  if (!retry_window_bounded_) return net::never();
  // The timer runs from the later of the oldest request going out and the
  // last answer: a long queue ahead of it is progress, not a lost peer.
  return std::max(oldest.sent_at, last_progress_) + retry_window_;
}

net::Deadline QpCore::progressDeadline() const {
  return retry_window_bounded_ ? net::after(retry_window_) : net::never();
}

int QpCore::openConnection(net::Socket& out) {
  const net::Deadline deadline =
      net::after(retry_window_bounded_ ? std::min<std::chrono::nanoseconds>(retry_window_, kMaxConnectWait)
                                       : std::chrono::nanoseconds(kMaxConnectWait));
  net::Socket s;
  if (int rc = net::connectTo(remote_host_, remote_port_, deadline, s); rc != kOk) return rc;
  Hello hello;
  hello.destination_qp_num = peer_.qp_num;
  hello.source_qp_num = qp_num_;
  hello.source_psn = local_psn_;
  std::memcpy(hello.source_gid, local_gid_.raw.data(), sizeof(hello.source_gid));
  if (retry_window_bounded_) {
    // Half the window: the responder's verdict must come before this
    // requester's own timer gives up on it.
    auto ms = std::chrono::duration_cast<std::chrono::milliseconds>(retry_window_ / 2).count();
    hello.wait_ms = static_cast<uint32_t>(std::clamp<int64_t>(ms, 1, UINT32_MAX));
  }
  if (int rc = net::sendAll(s.fd(), &hello, sizeof(hello), deadline); rc != kOk) return rc;
  out = std::move(s);
  return kOk;
}

void QpCore::senderLoop() {
  std::vector<char> scratch(kChunk);
  for (;;) {
    Slot copy;
    int fd = -1;
    {
      std::unique_lock lock(mutex_);
      changed_.wait(lock,
                    [&] { return stopping_ || state_ != QpState::kReadyToSend || next_send_seq_ < next_post_seq_; });
      if (stopping_ || state_ != QpState::kReadyToSend) return;
      Slot* slot = slotLocked(next_send_seq_);
      if (slot == nullptr) return;  // cannot be: the queue holds every seq not yet answered
      if (slot->prefailed) {
        // Nothing at or after it goes out; the receiver fails it once it is
        // the oldest.
        changed_.wait(lock, [&] { return stopping_ || state_ != QpState::kReadyToSend; });
        return;
      }
      if (socket_.valid()) {
        // The lkey checked again: the region may have gone since post().
        if (!slot->wr.inline_data &&
            device_->regions().covers(KeyKind::kLocal, slot->wr.lkey, reinterpret_cast<uintptr_t>(slot->wr.local),
                                      slot->wr.length) != RegionTable::Check::kOk) {
          slot->prefailed = true;
          changed_.notify_all();
          continue;
        }
        // On the wire before the first byte goes: its answer may come before
        // the send returns.
        slot->phase = Phase::kOnWire;
        slot->sent_at = net::Clock::now();
        ++next_send_seq_;
        copy = *slot;  // the slot may be flushed away while this sends
        fd = socket_.fd();
        changed_.notify_all();
      }
    }
    if (fd < 0) {
      // The first request: the connection is made lazily, as a NIC sends its
      // first packet.
      net::Socket s;
      int rc = openConnection(s);
      std::lock_guard lock(mutex_);
      if (stopping_ || state_ != QpState::kReadyToSend) return;
      if (rc != kOk) {
        failLocked(Completion::kRetryExceeded, kConnectFailed);
        return;
      }
      socket_ = std::move(s);
      continue;
    }
    Request header;
    header.seq = copy.seq;
    header.remote = copy.wr.remote;
    header.rkey = copy.wr.rkey;
    header.length = copy.wr.length;
    header.opcode = static_cast<uint8_t>(copy.wr.read ? Opcode::kRead : Opcode::kWrite);
    const bool sent = copy.wr.read ? net::sendAll(fd, &header, sizeof(header), net::never()) == kOk
                                   : sendWrite(fd, header, copy, scratch);
    if (!sent) {
      // The peer is gone or this QP failed: the receiver tells which after
      // reading whatever answers are still there.
      ::shutdown(fd, SHUT_WR);
      return;
    }
  }
}

bool QpCore::sendWrite(int fd, const Request& header, const Slot& copy, std::vector<char>& scratch) {
  if (copy.wr.inline_data) {
    return net::sendPieces(fd, {{&header, sizeof(header)}, {copy.inline_bytes.data(), copy.inline_bytes.size()}},
                           net::never()) == kOk;
  }
  // Staged through `scratch` chunk by chunk with the local registration
  // pinned (GPU memory: a CUDA copy), so that a deregistration waits for the
  // copy and no byte is read once it returned; the send itself then holds
  // nothing.
  const auto local = reinterpret_cast<uintptr_t>(copy.wr.local);
  for (uint64_t offset = 0; offset < copy.wr.length;) {
    const size_t n = static_cast<size_t>(std::min<uint64_t>(kChunk, copy.wr.length - offset));
    const RegionTable::Copy copied =
        device_->regions().copyOut(KeyKind::kLocal, copy.wr.lkey, local + offset, scratch.data(), n);
    if (copied != RegionTable::Copy::kOk) {
      // Deregistered mid-request, or the CUDA copy failed: the chunk goes
      // out as zeros (the stream stays whole) and the request completes
      // with kLocalProtection.
      std::memset(scratch.data(), 0, n);
      std::lock_guard lock(mutex_);
      localCopyFailedLocked(copy.seq, copied);
    }
    int rc = offset == 0 ? net::sendPieces(fd, {{&header, sizeof(header)}, {scratch.data(), n}}, net::never())
                         : net::sendAll(fd, scratch.data(), n, net::never());
    if (rc != kOk) return false;
    offset += n;
  }
  return true;
}

void QpCore::receiverLoop() {
  std::vector<char> scratch(kChunk);
  for (;;) {
    uint64_t seq = 0;
    WorkRequest wr;
    int fd = -1;
    net::Deadline deadline;
    {
      std::unique_lock lock(mutex_);
      changed_.wait(lock, [&] {
        return stopping_ || state_ != QpState::kReadyToSend ||
               (!queue_.empty() && (queue_.front().prefailed || queue_.front().phase == Phase::kOnWire));
      });
      if (stopping_ || state_ != QpState::kReadyToSend) return;
      const Slot& oldest = queue_.front();
      if (oldest.prefailed) {
        failLocked(Completion::kLocalProtection, kBadLkey);
        return;
      }
      seq = oldest.seq;
      wr = oldest.wr;
      fd = socket_.fd();
      deadline = answerDeadlineLocked(oldest);
    }
    if (int rc = net::waitReadable(fd, deadline); rc != kOk) {
      failUnlessStopped(Completion::kRetryExceeded, rc == kTimeout ? kAckTimeout : kConnectionLost);
      return;
    }
    if (!receiveAnswers(fd, seq, wr, scratch)) return;
  }
}

bool QpCore::receiveAnswers(int fd, uint64_t seq, const WorkRequest& wr, std::vector<char>& scratch) {
  uint64_t received = 0;
  for (;;) {
    Answer answer;
    if (int rc = net::recvAll(fd, &answer, sizeof(answer), progressDeadline()); rc != kOk) {
      failUnlessStopped(Completion::kRetryExceeded, rc == kTimeout ? kAckTimeout : kConnectionLost);
      return false;
    }
    last_progress_ = net::Clock::now();
    const bool fits = answer.seq == seq && answer.length <= kChunk && (wr.read || answer.length == 0) &&
                      received + answer.length <= wr.length &&
                      answer.status <= static_cast<uint8_t>(Completion::kOther);
    if (!fits) {
      MC_LOG(Warning) << device_->name() << ": qp 0x" << std::hex << qp_num_ << std::dec
                      << ": an answer that fits no request (seq " << answer.seq << ", expected " << seq << ")";
      failUnlessStopped(Completion::kOther, kProtocolError);
      return false;
    }
    if (answer.status != static_cast<uint8_t>(Completion::kSuccess)) {
      failUnlessStopped(static_cast<Completion>(answer.status), answer.reason);
      return false;
    }
    if (answer.length > 0) {
      if (int rc = net::recvAll(fd, scratch.data(), answer.length, progressDeadline()); rc != kOk) {
        failUnlessStopped(Completion::kRetryExceeded, rc == kTimeout ? kAckTimeout : kConnectionLost);
        return false;
      }
      last_progress_ = net::Clock::now();
      std::lock_guard lock(mutex_);
      // Flushed meanwhile (its buffer is the caller's again) or stopped.
      if (stopping_ || state_ != QpState::kReadyToSend) return false;
      const auto local = reinterpret_cast<uintptr_t>(wr.local) + received;
      const RegionTable::Copy copied =
          device_->regions().copyIn(KeyKind::kLocal, wr.lkey, local, scratch.data(), answer.length);
      if (copied != RegionTable::Copy::kOk) localCopyFailedLocked(seq, copied);
      received += answer.length;
    }
    if (answer.last != 0) break;
  }
  if (wr.read && received != wr.length) {
    failUnlessStopped(Completion::kOther, kProtocolError);
    return false;
  }
  std::lock_guard lock(mutex_);
  if (stopping_ || state_ != QpState::kReadyToSend || queue_.empty() || queue_.front().seq != seq) return false;
  if (queue_.front().local_error != kNoVendorError) {
    failLocked(Completion::kLocalProtection, queue_.front().local_error);
    return false;
  }
  if (queue_.front().wr.signaled) {
    device_->completions().push(WorkCompletion{wr.wr_id, Completion::kSuccess, qp_num_, 0});
  }
  queue_.pop_front();
  return true;
}

void QpCore::stop() {
  std::lock_guard stop_guard(stop_mutex_);
  {
    std::lock_guard lock(mutex_);
    if (stopping_) return;
    stopping_ = true;
    socket_.shutdownBoth();
    changed_.notify_all();
  }
  if (sender_.joinable()) sender_.join();
  if (receiver_.joinable()) receiver_.join();
  {
    std::lock_guard lock(mutex_);
    socket_.close();
    queue_.clear();
  }
  device_->shutdownInboundTo(this);
  device_->queuePairStateChanged();
}

}  // namespace mooncake::te::rdma::soft
