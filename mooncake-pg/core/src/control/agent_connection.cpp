// The Agent's connection to its Coordinator: the authenticated opening, the
// greeting (Hello and rejoins), request/reply calls with deadlines, and the
// two threads: the reader that delivers views and completes calls, the
// heartbeat that also watches for a Coordinator gone silent.
#include "control/agent_impl.h"

namespace mooncake::pg::control {

bool AgentImpl::start(std::string* error) {
  // A replacement may wait up to heartbeat_timeout for its predecessor to be
  // declared gone.
  if (!greet(address_, hello(/*resume=*/false, 0), {}, Clock::now() + options_.request_timeout,
             answerDeadline(options_.heartbeat_timeout), &fd_, &decoder_, error)) {
    return false;
  }
  last_heard_ = Clock::now();
  reader_ = std::thread([this] { readLoop(); });
  heartbeat_ = std::thread([this] { heartbeatLoop(); });
  return true;
}

// The opening of te/auth_opening.h, before any message: the Coordinator
// proves it knows the job's secret, then this Agent does.
bool AgentImpl::authenticate(int fd, const std::string& address, TimePoint connect_deadline,
                             TimePoint answer_deadline, std::string* error) {
  te::auth::ClientOpening opening(options_.secret, kControlPlaneKind);
  std::string why;
  const std::vector<uint8_t> hello = opening.hello();
  if (!opening.ok() || !sendAll(fd, hello.data(), hello.size(), connect_deadline, &why)) {
    *error = "cannot open an authenticated connection to the coordinator at " + address + ": " +
             (opening.ok() ? why : "no random nonce");
    return false;
  }
  uint8_t reply[te::auth::kReplyBytes];
  size_t got = 0;
  while (got < sizeof(reply)) {
    ssize_t n = receiveSome(fd, reply + got, sizeof(reply) - got, answer_deadline, &why);
    if (n <= 0) {
      *error = "the coordinator at " + address + " did not answer the authentication (" +
               (n == 0 ? "it closed the connection: another secret, or none" : why) + ")";
      return false;
    }
    got += static_cast<size_t>(n);
  }
  std::vector<uint8_t> proof;
  if (!opening.answer(reply, proof)) {
    *error = "the coordinator at " + address + " does not know this job's secret";
    return false;
  }
  if (!sendAll(fd, proof.data(), proof.size(), connect_deadline, &why)) {
    *error = "cannot finish the authentication with the coordinator at " + address + ": " + why;
    return false;
  }
  return true;
}

bool AgentImpl::greet(const std::string& address, const Hello& hello, const std::vector<Rejoin>& rejoins,
                      TimePoint connect_deadline, TimePoint answer_deadline, UniqueFd* fd_out, FrameDecoder* decoder,
                      std::string* error) {
  std::string host;
  uint16_t port = 0;
  if (!splitHostPort(address, &host, &port)) {
    *error = "invalid coordinator address '" + address + "' (expected host:port)";
    return false;
  }
  std::string why;
  UniqueFd fd = connectTo(host, port, connect_deadline, &why);
  if (!fd.valid()) {
    *error = "cannot connect to the coordinator at " + address + ": " + why;
    return false;
  }
  if (!options_.secret.empty() && !authenticate(fd.get(), address, connect_deadline, answer_deadline, error)) {
    return false;
  }
  std::vector<uint8_t> frames = encodeFrame(hello);
  for (const Rejoin& rejoin : rejoins) {
    std::vector<uint8_t> frame = encodeFrame(rejoin);
    frames.insert(frames.end(), frame.begin(), frame.end());
  }
  if (!sendAll(fd.get(), frames.data(), frames.size(), connect_deadline, &why)) {
    *error = "cannot greet the coordinator at " + address + ": " + why;
    return false;
  }
  for (;;) {
    Message message;
    DecodeResult result = decoder->next(&message, &why);
    if (result == DecodeResult::kError) {
      *error = "bad answer from the coordinator at " + address + ": " + why;
      return false;
    }
    if (result == DecodeResult::kFrame) {
      if (std::holds_alternative<Heartbeat>(message)) continue;
      const Reply* reply = std::get_if<Reply>(&message);
      if (reply == nullptr) {
        *error = std::string("unexpected ") + messageName(message) + " from the coordinator at " + address;
        return false;
      }
      if (!reply->error.empty()) {
        *error = "the coordinator at " + address + " refused global rank " + std::to_string(global_rank_) + ": " +
                 reply->error;
        return false;
      }
      break;
    }
    uint8_t buffer[4096];
    ssize_t n = receiveSome(fd.get(), buffer, sizeof(buffer), answer_deadline, &why);
    if (n <= 0) {
      *error = "no answer from the coordinator at " + address + " to the connection of global rank " +
               std::to_string(global_rank_) + ": " + (n == 0 ? "connection closed" : why);
      return false;
    }
    decoder->append(buffer, static_cast<size_t>(n));
  }
  *fd_out = std::move(fd);
  return true;
}

bool AgentImpl::send(const Message& message, std::string* error) {
  std::vector<uint8_t> frame = encodeFrame(message);
  std::lock_guard<std::mutex> serialize(send_mutex_);
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (lost_ || broken_) {
      *error = lost_ ? lost_reason_ : broken_reason_;
      return false;
    }
  }
  if (test_faults::controlCut()) return true;  // test only: lost on the cut cable, as TCP would not notice yet
  std::string why;
  if (sendAll(fd_.get(), frame.data(), frame.size(), Clock::now() + options_.request_timeout, &why)) return true;
  loseConnection("cannot send to the coordinator at " + address_ + ": " + why);
  std::lock_guard<std::mutex> lock(mutex_);
  *error = lost_ ? lost_reason_ : broken_reason_;
  return false;
}
void AgentImpl::leave() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (leaving_ || stopping_) return;
    leaving_ = true;
  }
  std::string ignored;  // a connection already gone has nobody to tell
  send(Goodbye{}, &ignored);
}

bool AgentImpl::firstSuccessor(int* global_rank, std::string* address) const {
  std::lock_guard<std::mutex> lock(mutex_);
  if (standbys_.ranks.empty()) return false;
  *global_rank = standbys_.ranks.front();
  *address = standbys_.addresses.front();
  return true;
}

void AgentImpl::loseConnection(const std::string& why) {
  bool quiet, planned;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (lost_ || broken_) return;
    broken_ = true;
    broken_reason_ = why;
    quiet = stopping_ || leaving_;
    planned = coordinator_leaving_;
    changed_.notify_all();
  }
  if (!quiet) {
    MC_LOG_AT(::mooncake::log::warningUnlessPlanned(planned))
        << "control plane agent (global rank " << global_rank_ << "): " << why
        << (planned ? " (the coordinator's process ended normally)" : "");
  }
  ::shutdown(fd_.get(), SHUT_RDWR);  // wakes the reader
}

void AgentImpl::readLoop() {
  reader_id_ = std::this_thread::get_id();
  try {
    uint8_t buffer[64 * 1024];
    for (;;) {
      Message message;
      std::string why;
      DecodeResult result = decoder_.next(&message, &why);
      if (result == DecodeResult::kFrame) {
        handle(std::move(message));
        continue;
      }
      if (result == DecodeResult::kError) {
        loseConnection("malformed message from the coordinator at " + address_ + ": " + why);
        return;
      }
      ssize_t n = receiveSome(fd_.get(), buffer, sizeof(buffer), TimePoint::max(), &why);
      if (test_faults::controlCut()) {
        // Test only: nothing arrives through a cut cable, not even the
        // Coordinator closing the connection; the heartbeat thread notices
        // the silence at the deadline, as it would on a real cut.
        if (n <= 0) {
          std::unique_lock<std::mutex> lock(mutex_);
          changed_.wait(lock, [&] { return stopping_ || lost_ || broken_; });
          return;
        }
        continue;
      }
      if (n <= 0) {
        loseConnection("lost the connection to the coordinator at " + address_ + ": " +
                       (n == 0 ? std::string("closed by the coordinator") : why));
        return;
      }
      decoder_.append(buffer, static_cast<size_t>(n));
      std::lock_guard<std::mutex> lock(mutex_);
      last_heard_ = Clock::now();
    }
  } catch (const std::exception& e) {
    loseConnection(std::string("control plane agent reader failed: ") + e.what());
  }
}

void AgentImpl::heartbeatLoop() {
  struct TellLossOnExit {
    AgentImpl* agent;
    ~TellLossOnExit() { agent->tellLoss(); }
  } tell_loss{this};
  try {
    std::unique_lock<std::mutex> lock(mutex_);
    while (!stopping_ && !lost_) {
      changed_.wait_for(lock, options_.heartbeat_interval, [&] { return stopping_ || lost_ || broken_; });
      if (stopping_ || lost_) return;
      if (broken_) {
        const std::string why = broken_reason_;
        lock.unlock();
        std::string final_why;
        bool recovered = failover(why, &final_why);
        lock.lock();
        if (!recovered && !stopping_) {
          lost_ = true;
          lost_reason_ = final_why;
          changed_.notify_all();
        }
        continue;
      }
      // A listener that runs long keeps the reader from reading: only
      // silence while the reader is free to hear counts against the
      // Coordinator.
      if (in_listener_ != nullptr) last_heard_ = Clock::now();
      bool silent = Clock::now() - last_heard_ > options_.heartbeat_timeout;
      lock.unlock();
      if (silent) {
        loseConnection("no sign of life from the coordinator at " + address_ + " for " +
                       millisecondsText(options_.heartbeat_timeout));
        lock.lock();
        continue;  // to the failover
      }
      std::string ignored;  // a failed send breaks the connection: the next round fails over
      send(Heartbeat{}, &ignored);
      lock.lock();
    }
  } catch (const std::exception& e) {
    loseConnection(std::string("control plane agent heartbeat failed: ") + e.what());
  }
}

void AgentImpl::handle(Message message) {
  if (auto* push = std::get_if<ViewPush>(&message)) {
    uint64_t epoch = deliver(push->view, /*notify=*/true);
    std::string ignored;
    send(ViewAck{push->view.key, std::max(epoch, push->view.epoch)}, &ignored);
  } else if (auto* reply = std::get_if<Reply>(&message)) {
    // A view in a plain reply answers a registration: it becomes the current
    // view without going to the listener (registerGroup returns it).
    if (reply->view) deliver(*reply->view, /*notify=*/false);
    complete(reply->request_id, std::move(message));
  } else if (auto* sync = std::get_if<SyncReply>(&message)) {
    // The view after reconciliation reaches the listener before the caller
    // of syncAfterFailure returns.
    if (sync->view) deliver(*sync->view, /*notify=*/true);
    complete(sync->request_id, std::move(message));
  } else if (auto* proposal = std::get_if<ProposeReply>(&message)) {
    complete(proposal->request_id, std::move(message));
  } else if (auto* standbys = std::get_if<Standbys>(&message)) {
    std::lock_guard<std::mutex> lock(mutex_);
    standbys_ = std::move(*standbys);
  } else if (std::holds_alternative<Goodbye>(message)) {
    std::lock_guard<std::mutex> lock(mutex_);
    coordinator_leaving_ = true;  // its end of stream follows
  } else if (!std::holds_alternative<Heartbeat>(message)) {
    loseConnection(std::string("protocol violation: the coordinator sent a ") + messageName(message));
  }
}

void AgentImpl::complete(RequestId id, Message reply) {
  std::lock_guard<std::mutex> lock(mutex_);
  auto it = calls_.find(id);
  if (it == calls_.end()) return;  // its caller gave up, or nobody waits (id 0)
  it->second.done = true;
  it->second.reply = std::move(reply);
  changed_.notify_all();
}

}  // namespace mooncake::pg::control
