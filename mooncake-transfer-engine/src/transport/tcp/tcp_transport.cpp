#include "transport/tcp/tcp_transport.h"

#include <poll.h>
#include <sys/eventfd.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <functional>

#include "cuda/host_staging.h"
#include "mooncake/te/log.h"
#include "rpc/connection_server.h"
#include "rpc/opening.h"
#include "rpc/rpc.h"
#include "transport/tcp/tcp_protocol.h"

namespace mooncake::te {
namespace {

// Sends `length` bytes of GPU memory through the thread's staging buffer.
int sendFromDevice(int fd, const char* gpu, uint64_t length, int device, net::Deadline deadline) {
  char* bounce = cuda::stagingBuffer(device);
  if (bounce == nullptr) return kEndpointError;
  for (uint64_t offset = 0; offset < length;) {
    size_t n = static_cast<size_t>(std::min<uint64_t>(length - offset, cuda::kStagingChunk));
    if (int rc = cuda::copyToHost(bounce, gpu + offset, n, device); rc != kOk) return rc;
    if (int rc = net::sendAll(fd, bounce, n, deadline); rc != kOk) return rc;
    offset += n;
  }
  return kOk;
}

// Receives `length` bytes into GPU memory through the thread's staging
// buffer. Returns the socket's result; a failed copy is reported in
// `copy_error` and the rest of the payload is still read, so that the
// connection stays at a message boundary.
int recvIntoDevice(int fd, char* gpu, uint64_t length, int device, net::Deadline deadline, int& copy_error) {
  char* bounce = cuda::stagingBuffer(device);
  copy_error = bounce == nullptr ? kEndpointError : kOk;
  char scratch[64 * 1024];
  for (uint64_t offset = 0; offset < length;) {
    size_t capacity = bounce != nullptr ? cuda::kStagingChunk : sizeof(scratch);
    size_t n = static_cast<size_t>(std::min<uint64_t>(length - offset, capacity));
    char* landing = bounce != nullptr ? bounce : scratch;
    if (int rc = net::recvAll(fd, landing, n, deadline); rc != kOk) return rc;
    if (copy_error == kOk) copy_error = cuda::copyToDevice(gpu + offset, landing, n, device);
    offset += n;
  }
  return kOk;
}

// Answers a READ of GPU memory: status, then the bytes. The first chunk is
// staged before the status goes out, so that a failed copy is reported as
// an error status; a copy failing later can only end the connection.
int serveDeviceRead(int fd, const char* gpu, uint64_t length, int device, net::Deadline deadline) {
  tcp::DataStatus status;
  char* bounce = cuda::stagingBuffer(device);
  size_t first = static_cast<size_t>(std::min<uint64_t>(length, cuda::kStagingChunk));
  status.code = bounce == nullptr ? kEndpointError : cuda::copyToHost(bounce, gpu, first, device);
  if (int rc = net::sendAll(fd, &status, sizeof(status), deadline); rc != kOk || status.code != kOk) return rc;
  if (int rc = net::sendAll(fd, bounce, first, deadline); rc != kOk) return rc;
  return sendFromDevice(fd, gpu + first, length - first, device, deadline);
}

}  // namespace

// Idle data connections to one peer. A connection is checked out for one
// request at a time and returned only after a clean exchange, so a pooled
// connection is never in the middle of a message.
class TcpTransport::ConnectionPool {
 public:
  ConnectionPool(std::string host, uint16_t port, std::chrono::milliseconds connect_timeout, std::string secret)
      : host_(std::move(host)), port_(port), connect_timeout_(connect_timeout), secret_(std::move(secret)) {}

  // A pooled connection (reused = true) or a new one.
  int acquire(net::Deadline deadline, net::Socket& out, bool& reused) {
    {
      std::lock_guard lock(mutex_);
      if (!idle_.empty()) {
        out = std::move(idle_.back());
        idle_.pop_back();
        reused = true;
        return kOk;
      }
    }
    reused = false;
    net::Deadline connect_deadline = std::min(deadline, net::after(connect_timeout_));
    if (int rc = net::connectTo(host_, port_, connect_deadline, out); rc != kOk) return rc;
    // The descriptor's handshake proved the secrets alike, so an opening
    // that fails here almost always means the peer is going away: the
    // request's own failure says so, and the words about secrets would
    // mislead.
    std::string unused_why;
    return rpc::openAs(out, rpc::kTcpDataMagic, secret_, deadline, unused_why);
  }

  // An idle connection, if there is one (never connects).
  bool takeIdle(net::Socket& out) {
    std::lock_guard lock(mutex_);
    if (idle_.empty()) return false;
    out = std::move(idle_.back());
    idle_.pop_back();
    return true;
  }

  void release(net::Socket socket) {
    std::lock_guard lock(mutex_);
    if (!closed_) idle_.push_back(std::move(socket));
  }

  void close() {
    std::lock_guard lock(mutex_);
    closed_ = true;
    idle_.clear();
  }

 private:
  const std::string host_;
  const uint16_t port_;
  const std::chrono::milliseconds connect_timeout_;
  const std::string secret_;
  std::mutex mutex_;
  std::vector<net::Socket> idle_;
  bool closed_ = false;
};

int TcpTransport::install(const TransportContext& context) {
  context_ = context;
  server_.addHandler(rpc::kTcpDataMagic, [this](net::Socket& socket) { serveConnection(socket); });
  int workers = std::max(1, context_.config->tcp_workers);
  for (int i = 0; i < workers; ++i) workers_.emplace_back([this] { workerLoop(); });
  control_wake_ = ::eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
  if (control_wake_ < 0) return kEndpointError;
  control_worker_ = std::thread([this] { controlLoop(); });
  return kOk;
}

void TcpTransport::shutdown() {
  std::deque<Slice> abandoned;
  {
    std::lock_guard lock(queue_mutex_);
    if (stopping_) return;
    stopping_ = true;
    abandoned.swap(queue_);
    abandoned.insert(abandoned.end(), control_queue_.begin(), control_queue_.end());
    control_queue_.clear();
  }
  queue_cv_.notify_all();
  wakeControl();
  for (auto& w : workers_) w.join();
  workers_.clear();
  if (control_worker_.joinable()) control_worker_.join();
  if (control_wake_ >= 0) ::close(control_wake_);
  control_wake_ = -1;
  for (const Slice& s : abandoned) s.task->completeSlice(0, kEndpointError);
  std::lock_guard lock(pools_mutex_);
  for (auto& [handle, pool] : pools_) pool->close();
  pools_.clear();
}

bool TcpTransport::reaches(PeerSegment& peer) { return peer.descriptor()->servesTransport(name()); }

std::shared_ptr<TcpTransport::ConnectionPool> TcpTransport::poolFor(PeerSegment& peer) {
  std::lock_guard lock(pools_mutex_);
  auto& pool = pools_[peer.handle()];
  if (!pool) {
    pool = std::make_shared<ConnectionPool>(peer.host(), peer.port(), context_.config->connect_timeout,
                                            context_.config->auth_secret);
  }
  return pool;
}

void TcpTransport::forget(SegmentHandle handle) {
  std::lock_guard lock(pools_mutex_);
  auto it = pools_.find(handle);
  if (it == pools_.end()) return;
  it->second->close();
  pools_.erase(it);
}

void TcpTransport::submit(PeerSegment& peer, const std::vector<TransferTask*>& tasks, bool caller_waits) {
  std::shared_ptr<ConnectionPool> pool = poolFor(peer);
  const uint64_t slice_size = std::max<uint64_t>(context_.config->tcp_slice_size, 4096);
  std::vector<Slice> slices;
  for (TransferTask* task : tasks) {
    const TransferRequest& r = task->request();
    // The engine checked that a registered region holds the source.
    std::optional<MemoryRegion> region = context_.regions->find(reinterpret_cast<uint64_t>(r.source), r.length);
    const int device = region ? cudaDeviceOfLocation(region->location) : -1;
    // A trailer must follow the whole payload on one connection: no split.
    const uint64_t split = r.trailer_length > 0 ? std::max<uint64_t>(r.length, 1) : slice_size;
    uint64_t count = (r.length + split - 1) / split;
    task->expectSlices(static_cast<uint32_t>(count));
    // One deadline for the whole request, however its slices are scheduled.
    const net::Deadline deadline = net::after(context_.config->budgetFor(r.length));
    for (uint64_t offset = 0; offset < r.length; offset += split) {
      uint64_t n = std::min(split, r.length - offset);
      slices.push_back(Slice{task, pool, r.opcode, static_cast<char*>(r.source) + offset, device,
                             r.target_offset + offset, n, deadline, {}});
    }
  }
  // A single slice for a waiting caller runs here: a hand-off to a worker
  // would only add two thread wake-ups to a small synchronous transfer.
  if (caller_waits && slices.size() == 1) {
    run(slices.front());
    return;
  }
  const bool control = !caller_waits && slices.size() == 1 && isControl(slices.front());
  if (control) sendInline(slices.front());
  size_t queued = 0;
  {
    std::lock_guard lock(queue_mutex_);
    if (!stopping_) {
      for (auto& s : slices) (control ? control_queue_ : queue_).push_back(std::move(s));
      queued = control ? 0 : slices.size();
      slices.clear();
    }
  }
  if (control) wakeControl();
  // One worker per slice: waking them all for one slice (a P2P chunk) sends
  // the others back to sleep at the cost of a context switch each.
  for (size_t i = 0; i < std::min<size_t>(queued, workers_.size()); ++i) queue_cv_.notify_one();
  for (const Slice& s : slices) s.task->completeSlice(0, kEndpointError);  // engine shutting down
}

void TcpTransport::dropCanceled() {
  // Slices in the worker queue were never sent (a control write that was
  // sent inline waits in the control lane instead): nothing to close.
  std::deque<Slice> dropped;
  {
    std::lock_guard lock(queue_mutex_);
    auto canceled = [](const Slice& s) { return !s.sent_on && s.task->canceled(); };
    for (auto it = queue_.begin(); it != queue_.end();) {
      if (canceled(*it)) {
        dropped.push_back(std::move(*it));
        it = queue_.erase(it);
      } else {
        ++it;
      }
    }
  }
  for (const Slice& s : dropped) s.task->completeSlice(0, kCanceled);
}

void TcpTransport::workerLoop() {
  for (;;) {
    Slice slice;
    {
      std::unique_lock lock(queue_mutex_);
      queue_cv_.wait(lock, [this] { return stopping_ || !queue_.empty(); });
      if (stopping_) return;
      slice = std::move(queue_.front());
      queue_.pop_front();
    }
    run(slice);
  }
}

// One thread for the answers of every control write: each is sent inline
// (by its submitter, or here once a connection is idle) and then waits in a
// poll set, so a peer that does not answer holds up only its own writes.
void TcpTransport::wakeControl() {
  const uint64_t one = 1;
  if (control_wake_ >= 0 && ::write(control_wake_, &one, sizeof(one)) < 0) {
    // The counter is full: a wake-up is pending anyway.
  }
}

void TcpTransport::controlLoop() {
  std::vector<Slice> waiting;  // sent, their answers not read yet
  std::vector<pollfd> fds;
  for (;;) {
    std::deque<Slice> fresh;
    {
      std::lock_guard lock(queue_mutex_);
      if (stopping_) break;
      fresh.swap(control_queue_);
    }
    for (Slice& slice : fresh) {
      // Found no idle connection when submitted: one may be idle now. Else
      // a worker connects (this thread never waits on a connection's
      // opening: the peer may be the one that does not answer).
      if (!slice.sent_on && !sendInline(slice)) {
        if (slice.task->canceled()) {  // canceled before it left: no worker needed to end it
          slice.task->completeSlice(0, kCanceled);
          continue;
        }
        {
          std::lock_guard lock(queue_mutex_);
          if (!stopping_) {
            queue_.push_back(std::move(slice));
            queue_cv_.notify_one();
            continue;
          }
        }
        slice.task->completeSlice(0, kEndpointError);  // engine shutting down
        continue;
      }
      waiting.push_back(std::move(slice));
    }
    // The wake-up fd ends the wait when more control writes come (or at
    // shutdown); the earliest deadline bounds it.
    fds.assign(1, pollfd{control_wake_, POLLIN, 0});
    net::Deadline first = net::never();
    for (const Slice& slice : waiting) {
      fds.push_back(pollfd{slice.sent_on->fd(), POLLIN, 0});
      first = std::min(first, slice.deadline);
    }
    int timeout_ms = -1;  // nothing in flight: until woken
    if (!waiting.empty()) {
      const auto wait = std::chrono::duration_cast<std::chrono::milliseconds>(first - net::Clock::now()).count();
      timeout_ms = static_cast<int>(std::clamp<int64_t>(wait + 1, 0, 1000));
    }
    ::poll(fds.data(), fds.size(), timeout_ms);
    if (fds[0].revents != 0) {
      uint64_t count;
      if (::read(control_wake_, &count, sizeof(count)) < 0) {
        // Nothing to drain: another wake-up read it.
      }
    }
    const net::Deadline now = net::Clock::now();
    std::vector<Slice> still;
    for (size_t i = 0; i < waiting.size(); ++i) {
      if (fds[i + 1].revents == 0 && now < waiting[i].deadline) {
        still.push_back(std::move(waiting[i]));
        continue;
      }
      run(waiting[i]);  // its answer is in (or its deadline passed): read it, or report the loss
    }
    waiting.swap(still);
  }
  for (const Slice& slice : waiting) slice.task->completeSlice(0, kEndpointError);
}

bool TcpTransport::isControl(const Slice& slice) {
  // Small enough for the empty send buffer of an idle connection (its peer
  // answered everything sent before: at least 16 KiB are free), so an inline
  // send does not hold up the caller (a progress thread).
  constexpr uint64_t kControlBytes = 8 * 1024;
  return slice.opcode == Opcode::kWrite && slice.local_device < 0 && slice.length <= kControlBytes;
}

bool TcpTransport::sendInline(Slice& slice) const {
  constexpr auto kInlineSendLimit = std::chrono::milliseconds(2);  // bounded anyway
  auto socket = std::make_shared<net::Socket>();
  if (!slice.pool->takeIdle(*socket)) return false;
  if (!slice.task->onConnection(socket->fd())) {  // canceled: a worker ends it
    slice.pool->release(std::move(*socket));
    return false;
  }
  Slice bounded = slice;
  bounded.deadline = std::min(slice.deadline, net::after(kInlineSendLimit));
  // On failure the connection closes (it may hold part of the request) and
  // a worker sends the whole request again on another.
  if (sendRequest(socket->fd(), bounded) != kOk) {
    slice.task->offConnection(socket->fd());
    return false;
  }
  slice.sent_on = std::move(socket);  // announced until its answer is read (run)
  slice.task->sliceSent();            // on the wire: only the answer is due
  return true;
}

void TcpTransport::run(const Slice& slice) const {
  if (slice.sent_on) {
    const int answer = awaitAnswer(slice.sent_on->fd(), slice);
    slice.task->offConnection(slice.sent_on->fd());
    if (answer == kOk) {
      slice.pool->release(std::move(*slice.sent_on));
      slice.task->completeSlice(slice.length, kOk);
      return;
    }
    if (answer == kTimeout) {  // never sent again after its deadline: a late copy could land on reused memory
      slice.sent_on->close();
      MC_LOG(Warning) << "tcp write of " << slice.length << " bytes at 0x" << std::hex << slice.remote << std::dec
                      << " failed: " << errorName(answer);
      slice.task->completeSlice(0, answer);
      return;
    }
    // The pooled connection failed under the request (its peer restarted,
    // say): sent again below on another, as any request that fails on a
    // reused connection. Writes are idempotent.
    slice.sent_on->close();
  }
  int rc = kOk;
  bool sent = slice.sent_on != nullptr;  // counted on the wire already (sendInline)
  // A pooled connection may have been closed by the peer since its last use
  // (peer restarted); such a failure gets one more try on a new connection.
  // Requests are idempotent (same bytes to the same place), so this is safe.
  for (int attempt = 0; attempt < 2; ++attempt) {
    net::Socket socket;
    bool reused = false;
    rc = slice.task->canceled() ? kCanceled : slice.pool->acquire(slice.deadline, socket, reused);
    if (rc == kOk && !slice.task->onConnection(socket.fd())) {
      rc = kCanceled;
      slice.pool->release(std::move(socket));  // unused: still between messages
      break;
    }
    if (rc == kOk) {
      rc = exchange(socket, slice, sent);
      slice.task->offConnection(socket.fd());
      if (rc != kOk && slice.task->canceled()) rc = kCanceled;  // its connection was shut down under it
    }
    if (rc == kOk) {
      slice.pool->release(std::move(socket));
      break;
    }
    if (!reused || rc == kTimeout || rc == kCanceled) break;
  }
  if (rc == kCanceled) {
    slice.task->completeSlice(0, rc);  // asked for: no warning
    return;
  }
  if (rc != kOk) {
    MC_LOG(Warning) << "tcp " << (slice.opcode == Opcode::kWrite ? "write" : "read") << " of " << slice.length
                    << " bytes at 0x" << std::hex << slice.remote << std::dec << " failed: " << errorName(rc);
  }
  slice.task->completeSlice(rc == kOk ? slice.length : 0, rc);
}

int TcpTransport::exchange(net::Socket& socket, const Slice& slice, bool& sent) const {
  const int fd = socket.fd();
  if (int rc = sendRequest(fd, slice); rc != kOk) return rc;
  // A write's bytes are in the kernel's hands now; a read's request is not
  // its bytes, so a read counts as sent only when it completes.
  if (!sent && slice.opcode == Opcode::kWrite) {
    sent = true;
    slice.task->sliceSent();
  }
  return awaitAnswer(fd, slice);
}

int TcpTransport::sendRequest(int fd, const Slice& slice) const {
  const TransferRequest& request = slice.task->request();
  const bool trailer = request.trailer_length > 0;  // then this slice is the whole request
  tcp::DataHeader header;
  header.opcode = trailer ? tcp::kWireWriteWithTrailer : static_cast<uint8_t>(slice.opcode);
  header.addr = slice.remote;
  header.length = slice.length;
  struct {
    tcp::TrailerHeader header;
    unsigned char bytes[kMaxTrailerBytes];
  } message;
  size_t message_length = 0;
  if (trailer) {
    message.header.addr = request.trailer_target;
    message.header.length = request.trailer_length;
    std::memcpy(message.bytes, request.trailer, request.trailer_length);
    message_length = sizeof(message.header) + request.trailer_length;
  }
  if (slice.opcode != Opcode::kWrite) return net::sendAll(fd, &header, sizeof(header), slice.deadline);
  if (slice.local_device < 0) {
    // Host memory: header, payload and trailer in one stream of segments.
    return net::sendPieces(fd, {{&header, sizeof(header)}, {slice.local, slice.length}, {&message, message_length}},
                           slice.deadline);
  }
  if (int rc = net::sendAll(fd, &header, sizeof(header), slice.deadline); rc != kOk) return rc;
  if (int rc = sendFromDevice(fd, slice.local, slice.length, slice.local_device, slice.deadline); rc != kOk) return rc;
  return trailer ? net::sendAll(fd, &message, message_length, slice.deadline) : kOk;
}

int TcpTransport::awaitAnswer(int fd, const Slice& slice) const {
  tcp::DataStatus status;
  if (int rc = net::recvAll(fd, &status, sizeof(status), slice.deadline); rc != kOk) return rc;
  if (status.magic != tcp::kStatusMagic) return kMalformedMessage;
  if (status.code != kOk) return status.code;  // e.g. kAddressNotRegistered
  if (slice.opcode == Opcode::kRead) {
    if (slice.local_device < 0) return net::recvAll(fd, slice.local, slice.length, slice.deadline);
    int copy_error = kOk;
    int rc = recvIntoDevice(fd, slice.local, slice.length, slice.local_device, slice.deadline, copy_error);
    return rc != kOk ? rc : copy_error;
  }
  return kOk;
}

int TcpTransport::finishWithTrailer(int fd, net::Deadline deadline, tcp::DataStatus status) const {
  tcp::TrailerHeader header;
  unsigned char bytes[kMaxTrailerBytes];
  if (int rc = net::recvAll(fd, &header, sizeof(header), deadline); rc != kOk) return rc;
  if (header.length == 0 || header.length > kMaxTrailerBytes) return kMalformedMessage;
  if (int rc = net::recvAll(fd, bytes, header.length, deadline); rc != kOk) return rc;
  int io = kOk;
  const bool registered = context_.regions->withRegion(header.addr, header.length, [&](const MemoryRegion& region) {
    if (status.code == kOk && cudaDeviceOfLocation(region.location) >= 0) status.code = kInvalidArgument;  // flags live in host memory
    // The answer goes out before the trailer is written: a reader that sees
    // the trailer (and may finish and exit at once) can no longer keep the
    // writer from learning that its write landed. Only a trailer whose
    // answer left is written, so a writer told of a failure never has its
    // trailer seen either.
    io = net::sendAll(fd, &status, sizeof(status), deadline);
    if (io != kOk || status.code != kOk) return;
    // The payload's stores (this thread's recv) come first: a reader that
    // sees the trailer sees them.
    std::atomic_thread_fence(std::memory_order_release);
    std::memcpy(reinterpret_cast<void*>(header.addr), bytes, header.length);
  });
  if (!registered) {
    if (status.code == kOk) status.code = kAddressNotRegistered;
    io = net::sendAll(fd, &status, sizeof(status), deadline);
  }
  return io;
}

void TcpTransport::serveConnection(net::Socket& socket) const {
  const int fd = socket.fd();
  // How a closing receive window cuts short a payload landing in it (the
  // writer sees its connection fail).
  const std::function<void()> cut = [&socket] { socket.shutdownBoth(); };
  for (;;) {
    tcp::DataHeader header;
    // Idle between requests: no deadline. Engine shutdown wakes this read.
    if (net::recvAll(fd, &header, sizeof(header), net::never()) != kOk) return;
    const bool with_trailer = header.opcode == tcp::kWireWriteWithTrailer;
    if (with_trailer) header.opcode = static_cast<uint8_t>(Opcode::kWrite);
    if (header.magic != tcp::kRequestMagic || header.opcode > static_cast<uint8_t>(Opcode::kWrite)) {
      MC_LOG(Warning) << "tcp: malformed request header; closing the connection";
      return;
    }
    const net::Deadline deadline = net::after(context_.config->budgetFor(header.length));
    char* target = reinterpret_cast<char*>(header.addr);
    tcp::DataStatus status;
    int io = kOk;
    bool registered = false;
    if (header.opcode == static_cast<uint8_t>(Opcode::kWrite)) {
      // Held registered while the payload lands, so unregistration waits
      // (closing a receive window cuts it short instead).
      registered = context_.regions->withRegion(
          header.addr, header.length,
          [&](const MemoryRegion& region) {
            int device = cudaDeviceOfLocation(region.location);
            if (device < 0) {
              io = net::recvAll(fd, target, header.length, deadline);
            } else {
              io = recvIntoDevice(fd, target, header.length, device, deadline, status.code);
            }
          },
          &cut);
      if (!registered) {
        char scratch[64 * 1024];
        for (uint64_t left = header.length; left > 0 && io == kOk;) {
          size_t n = static_cast<size_t>(std::min<uint64_t>(left, sizeof(scratch)));
          io = net::recvAll(fd, scratch, n, deadline);
          left -= n;
        }
        status.code = kAddressNotRegistered;
      }
      if (io != kOk) return;
      if (with_trailer) {
        if (finishWithTrailer(fd, deadline, status) != kOk) return;
      } else if (net::sendAll(fd, &status, sizeof(status), deadline) != kOk) {
        return;
      }
    } else {
      registered = context_.regions->withRegion(header.addr, header.length, [&](const MemoryRegion& region) {
        int device = cudaDeviceOfLocation(region.location);
        if (device < 0) {
          io = net::sendAll(fd, &status, sizeof(status), deadline);
          if (io == kOk) io = net::sendAll(fd, target, header.length, deadline);
        } else {
          io = serveDeviceRead(fd, target, header.length, device, deadline);
        }
      });
      if (!registered) {
        status.code = kAddressNotRegistered;
        io = net::sendAll(fd, &status, sizeof(status), deadline);
      }
      if (io != kOk) return;
    }
    if (!registered) {
      MC_LOG(Warning) << "tcp: refused a request for unregistered range [0x" << std::hex << header.addr << ", +0x"
                      << header.length << ")";
    }
  }
}

}  // namespace mooncake::te
