// The Agent: one connection to the Coordinator, a reader thread that
// delivers views to listeners (acknowledging each after its listener
// returned) and completes calls, and a heartbeat thread that also watches
// for a Coordinator that went silent. Calls are synchronous request/reply
// with deadlines; a lost connection fails every pending call at once, and is
// then told to each group's loss listener (on the heartbeat thread).
//
// Failover (control_plane.h, "Coordinator failover"): a broken connection
// first fails the calls in flight, then the heartbeat thread tries the
// candidate successors the Coordinator last announced, in order (taking over
// with this process's standby when its turn comes), rejoining with every
// registration and newest view. A new reader thread serves the new
// connection; only when no candidate takes this Agent back is the loss
// final and told to the loss listeners.
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <condition_variable>
#include <map>
#include <mutex>
#include <thread>

#include "control/protocol.h"
#include "control/socket_io.h"
#include "control/text.h"
#include "mooncake/pg/control_plane.h"
#include "mooncake/pg/test_faults.h"
#include "mooncake/te/auth_opening.h"
#include "mooncake/te/log.h"

namespace mooncake::pg {

namespace control {
namespace {

class AgentImpl final : public Agent {
 public:
  AgentImpl(const std::string& address, int global_rank, const ControlOptions& options, Coordinator* standby)
      : address_(address), global_rank_(global_rank), options_(options), standby_(standby) {}

  ~AgentImpl() override {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      stopping_ = true;
      changed_.notify_all();
    }
    {
      std::lock_guard<std::mutex> serialize(send_mutex_);  // a failover replaces fd_ under it
      ::shutdown(fd_.get(), SHUT_RDWR);  // the Coordinator sees the end of stream at once; wakes the reader
    }
    if (heartbeat_.joinable()) heartbeat_.join();
    if (reader_.joinable()) {
      if (onReaderThread()) {
        MC_LOG(Error) << "control plane agent destroyed from its own view listener; its reader thread is left behind";
        reader_.detach();
      } else {
        reader_.join();
      }
    }
  }

  bool start(std::string* error);
  void leave() override;

  bool registerGroup(const GroupRegistration& registration, ViewListener on_view, GroupView* view,
                     std::string* error) override;
  void unregisterGroup(const std::string& key) override;
  void reportFailure(const std::string& key, const std::vector<int>& ranks) override;
  void reportLinks(const std::string& key, const std::vector<int>& reached, const std::vector<int>& unreached) override;
  SyncResult syncAfterFailure(const std::string& key, const std::vector<int>& ranks) override;
  bool joinGroup(const std::string& key, std::chrono::milliseconds deadline, std::string* error) override;
  void onConnectionLost(const std::string& key, LossListener listener) override;
  ProposeViewUpdateResponse propose(const std::string& key, bool activate, const std::vector<int>& ranks) override;
  GroupView view(const std::string& key) const override;

 private:
  struct GroupSlot {
    GroupRegistration registration;  // as registered: sent again to a successor coordinator
    ViewListener listener;
    LossListener on_loss;
    GroupView view;                 // the newest view (set before its listener runs)
    bool delivered_active = false;  // the last view whose delivery completed shows the seat Active
  };
  struct PendingCall {
    bool done = false;
    Message reply;
  };

  // Time the Coordinator may take beyond its own deadlines before an answer
  // is considered lost.
  TimePoint answerDeadline(std::chrono::milliseconds coordinator_bound) const {
    return Clock::now() + coordinator_bound + options_.heartbeat_timeout;
  }

  bool onReaderThread() const { return std::this_thread::get_id() == reader_id_.load(); }
  bool onHeartbeatThread() const { return std::this_thread::get_id() == heartbeat_.get_id(); }
  bool send(const Message& message, std::string* error);
  // Sends a request (its id is assigned here) and waits for the reply.
  // With `resend`, a call whose connection broke is sent again to the
  // successor once the failover completed (before the deadline).
  template <class Request>
  bool call(Request request, TimePoint deadline, Message* reply, std::string* error, bool resend = false);
  // The connection is broken: calls in flight fail, the heartbeat thread fails over.
  void loseConnection(const std::string& why);
  std::string standbyAddress() const { return standby_ != nullptr ? standby_->address() : std::string(); }
  // What this process says when it connects: who it is, where its standby
  // listens, and whether it resumes with `rejoins` groups (failover).
  Hello hello(bool resume, uint32_t rejoins) const {
    return Hello{global_rank_, static_cast<int32_t>(::getpid()), standbyAddress(), resume, rejoins};
  }
  // Connects to `address`, says `hello` (and sends `rejoins`), and waits for
  // the answer. On success *fd and *decoder hold the connection.
  bool authenticate(int fd, const std::string& address, TimePoint connect_deadline, TimePoint answer_deadline,
                    std::string* error);
  bool greet(const std::string& address, const Hello& hello, const std::vector<Rejoin>& rejoins,
             TimePoint connect_deadline, TimePoint answer_deadline, UniqueFd* fd, FrameDecoder* decoder,
             std::string* error);
  // On the heartbeat thread, once the connection broke: the old reader is
  // joined, then the candidates are tried. True with a new connection (and
  // reader); false with *final_why.
  bool failover(const std::string& why, std::string* final_why);

  void readLoop();
  void heartbeatLoop();
  // Once the connection is lost (and the Agent is not shutting down): gives
  // the reason to every group's loss listener, once.
  void tellLoss();
  void handle(Message message);
  void complete(RequestId id, Message reply);
  // Makes `view` the group's current one if newer; with `notify`, gives it
  // to the listener first. Returns the group's newest epoch.
  uint64_t deliver(const GroupView& view, bool notify);

  std::string address_;  // the coordinator's; changes with a failover (under send_mutex_ and mutex_)
  const int global_rank_;
  const ControlOptions options_;
  Coordinator* const standby_;
  UniqueFd fd_;            // replaced by a failover, under send_mutex_ and mutex_
  FrameDecoder decoder_;   // used by start() and failover(), then only by the reader thread
  std::mutex send_mutex_;  // one frame at a time on the socket; taken before mutex_, never after
  mutable std::mutex mutex_;
  std::condition_variable changed_;  // any call completed, view delivered, connection lost, stopping
  bool stopping_ = false;
  bool leaving_ = false;              // leave(): this process ends normally
  bool coordinator_leaving_ = false;  // the coordinator said Goodbye: losing it is planned
  bool lost_ = false;  // for good: no failover took this Agent back
  std::string lost_reason_;
  bool broken_ = false;  // the connection broke; a failover is pending
  std::string broken_reason_;
  uint64_t generation_ = 0;  // of the connection: one more per failover
  Standbys standbys_;        // the candidate successors, as last announced
  RequestId next_request_id_ = 1;
  std::map<RequestId, PendingCall> calls_;
  std::map<std::string, std::shared_ptr<GroupSlot>> groups_;
  const GroupSlot* in_listener_ = nullptr;  // the slot whose listener runs now
  const GroupSlot* in_loss_listener_ = nullptr;  // the slot whose loss listener runs now
  bool loss_told_ = false;                       // tellLoss has run
  TimePoint last_heard_;                    // from the Coordinator
  std::atomic<std::thread::id> reader_id_{};
  std::thread reader_;
  std::thread heartbeat_;
};

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

bool AgentImpl::failover(const std::string& why, std::string* final_why) {
  if (reader_.joinable()) reader_.join();  // its socket was shut down: it ends (after a running listener)
  Standbys standbys;
  std::vector<Rejoin> rejoins;
  bool planned;  // the coordinator ended normally (or this process does): routine, logged at Info
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (stopping_) return false;
    planned = coordinator_leaving_ || leaving_;
    standbys = standbys_;
    for (const auto& [key, slot] : groups_) {
      if (slot->view.epoch == 0 || slot->view.members.empty()) continue;  // not formed yet: lost with the coordinator
      rejoins.push_back({slot->registration, slot->view});
    }
  }
  *final_why = why;
  if (test_faults::controlCut()) {
    *final_why += " (cut off from the control plane: no failover)";
    return false;
  }
  if (standbys.ranks.empty()) return false;
  std::vector<int> expected(standbys.ranks.begin(), standbys.ranks.end());
  const auto level = ::mooncake::log::warningUnlessPlanned(planned);
  MC_LOG_AT(level) << "control plane agent (global rank " << global_rank_ << "): " << why
                   << "; failing over (candidates: global ranks " << listText(expected) << ")";
  const Hello resume = hello(/*resume=*/true, static_cast<uint32_t>(rejoins.size()));
  std::string tried;
  for (size_t i = 0; i < standbys.ranks.size(); ++i) {
    const int rank = standbys.ranks[i];
    std::string address = standbys.addresses[i];
    {
      std::lock_guard<std::mutex> lock(mutex_);
      if (stopping_) return false;
    }
    if (rank == global_rank_) {
      if (standby_ == nullptr) continue;
      standby_->takeOver(expected, standbys.coordinator_rank, planned);  // the next in line: its standby serves
      address = standby_->address();
    }
    const TimePoint now = Clock::now();
    UniqueFd fd;
    FrameDecoder decoder;
    std::string error;
    if (!greet(address, resume, rejoins, now + std::min(options_.heartbeat_timeout, options_.failover_timeout),
               now + options_.failover_timeout + options_.heartbeat_timeout, &fd, &decoder, &error)) {
      MC_LOG_AT(level) << "control plane agent (global rank " << global_rank_ << "): candidate global rank " << rank
                       << ": " << error;
      tried += (tried.empty() ? "" : "; ") + std::string("global rank ") + std::to_string(rank) + ": " + error;
      continue;
    }
    {
      std::lock_guard<std::mutex> serialize(send_mutex_);
      std::lock_guard<std::mutex> lock(mutex_);
      if (stopping_) return false;  // fd closes here: the successor sees this process leave
      fd_ = std::move(fd);
      decoder_ = std::move(decoder);
      address_ = address;
      ++generation_;
      broken_ = false;
      broken_reason_.clear();
      coordinator_leaving_ = false;  // a new coordinator: its end would be news again
      last_heard_ = Clock::now();
      changed_.notify_all();
    }
    MC_LOG_AT(level) << "control plane agent (global rank " << global_rank_ << "): failed over to the coordinator "
                     << "of global rank " << rank << " at " << address;
    reader_ = std::thread([this] { readLoop(); });
    return true;
  }
  *final_why = why + "; no successor coordinator took this process back (" + tried + ")";
  return false;
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

template <class Request>
bool AgentImpl::call(Request request, TimePoint deadline, Message* reply, std::string* error, bool resend) {
  if (onReaderThread()) {
    *error = "called from a view listener (the agent's reader thread), where waiting for an answer would deadlock";
    return false;
  }
  for (;;) {
    RequestId id = 0;
    uint64_t generation = 0;
    {
      // A failover in progress: wait for its outcome (bounded).
      std::unique_lock<std::mutex> lock(mutex_);
      changed_.wait_until(lock, deadline, [&] { return !broken_ || lost_ || stopping_; });
      if (lost_ || stopping_ || broken_) {
        *error = lost_       ? lost_reason_
                 : stopping_ ? "the agent is shutting down"
                             : broken_reason_ + " (no successor coordinator took over in time)";
        return false;
      }
      id = request.request_id = next_request_id_++;
      calls_[id];
      generation = generation_;
    }
    bool sent = send(request, error);
    std::unique_lock<std::mutex> lock(mutex_);
    if (sent) {
      changed_.wait_until(lock, deadline, [&] {
        return calls_[id].done || lost_ || stopping_ || broken_ || generation_ != generation;
      });
    }
    PendingCall outcome = std::move(calls_[id]);
    calls_.erase(id);
    if (outcome.done) {
      *reply = std::move(outcome.reply);
      return true;
    }
    const bool failing_over = !lost_ && !stopping_ && (broken_ || generation_ != generation);
    if (resend && failing_over && Clock::now() < deadline) continue;  // to the successor
    if (sent) {
      *error = lost_       ? lost_reason_
               : stopping_ ? "the agent is shutting down"
               : broken_   ? broken_reason_
               : generation_ != generation
                   ? "the coordinator was lost during the call (this process failed over to " + address_ + ")"
                   : "no answer from the coordinator at " + address_ + " in time";
    }
    return false;
  }
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

void AgentImpl::tellLoss() {
  std::string why;
  std::vector<std::shared_ptr<GroupSlot>> slots;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (!lost_ || stopping_ || loss_told_) return;
    loss_told_ = true;
    why = lost_reason_;
    for (const auto& entry : groups_) slots.push_back(entry.second);
  }
  for (const std::shared_ptr<GroupSlot>& slot : slots) {
    LossListener listener;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      bool registered = false;
      for (const auto& entry : groups_) registered |= entry.second == slot;
      if (!registered || stopping_) continue;  // unregistered meanwhile
      listener = slot->on_loss;
      if (listener) in_loss_listener_ = slot.get();
    }
    if (!listener) continue;
    try {
      listener(why);
    } catch (const std::exception& e) {
      MC_LOG(Warning) << "control plane: a connection-loss listener threw: " << e.what();
    } catch (...) {
      MC_LOG(Warning) << "control plane: a connection-loss listener threw";
    }
    std::lock_guard<std::mutex> lock(mutex_);
    in_loss_listener_ = nullptr;
    changed_.notify_all();
  }
}

void AgentImpl::onConnectionLost(const std::string& key, LossListener listener) {
  std::string why;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    auto it = groups_.find(key);
    if (it == groups_.end()) return;
    it->second->on_loss = listener;
    if (!loss_told_) return;  // tellLoss will call it
    why = lost_reason_;       // already lost and told: this one hears it now
  }
  if (listener) listener(why);
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

uint64_t AgentImpl::deliver(const GroupView& view, bool notify) {
  std::shared_ptr<GroupSlot> slot;
  ViewListener listener;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    auto it = groups_.find(view.key);
    if (it == groups_.end()) return view.epoch;  // unregistered meanwhile
    slot = it->second;
    if (view.epoch <= slot->view.epoch) return slot->view.epoch;  // stale
    slot->view = view;
    if (notify) {
      listener = slot->listener;
      in_listener_ = slot.get();
    }
  }
  if (listener) {
    try {
      listener(view);
    } catch (const std::exception& e) {
      MC_LOG(Warning) << "control plane: view listener of group '" << view.key << "' threw: " << e.what();
    } catch (...) {
      MC_LOG(Warning) << "control plane: view listener of group '" << view.key << "' threw";
    }
  }
  std::lock_guard<std::mutex> lock(mutex_);
  in_listener_ = nullptr;
  if (slot->view.epoch == view.epoch) {
    slot->delivered_active =
        slot->registration.rank >= 0 && slot->registration.rank < static_cast<int>(view.members.size()) &&
        view.isActive(slot->registration.rank);
  }
  changed_.notify_all();
  return slot->view.epoch;
}

bool AgentImpl::registerGroup(const GroupRegistration& registration, ViewListener on_view, GroupView* view,
                              std::string* error) {
  std::string ignored_error;
  if (error == nullptr) error = &ignored_error;
  const std::string& key = registration.key;
  auto fail = [&](const std::string& why) {
    *error = "registerGroup('" + key + "', seat " + std::to_string(registration.rank) + "): " + why;
    return false;
  };
  auto slot = std::make_shared<GroupSlot>();
  slot->registration = registration;
  slot->listener = std::move(on_view);
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (!groups_.emplace(key, slot).second) return fail("this process has already registered the group");
  }
  auto forget = [&] {
    std::lock_guard<std::mutex> lock(mutex_);
    auto it = groups_.find(key);
    if (it != groups_.end() && it->second == slot) groups_.erase(it);
  };
  Message answer;
  std::string why;
  if (!call(RegisterGroupRequest{0, registration}, answerDeadline(options_.request_timeout), &answer, &why)) {
    forget();
    return fail(why);
  }
  const Reply* reply = std::get_if<Reply>(&answer);
  if (reply == nullptr || !reply->error.empty() || !reply->view) {
    forget();
    return fail(reply == nullptr ? "unexpected answer from the coordinator" : reply->error);
  }
  std::lock_guard<std::mutex> lock(mutex_);
  if (view != nullptr) *view = slot->view;  // the answer's view, or a newer one already given to the listener
  return true;
}

void AgentImpl::unregisterGroup(const std::string& key) {
  {
    std::unique_lock<std::mutex> lock(mutex_);
    auto it = groups_.find(key);
    if (it == groups_.end()) return;
    const GroupSlot* slot = it->second.get();
    groups_.erase(it);
    // After this returns the listeners are not called again, and are not
    // running (unless called from one of them).
    if (!onReaderThread() && !onHeartbeatThread()) {
      changed_.wait(lock, [&] { return in_listener_ != slot && in_loss_listener_ != slot; });
    }
  }
  std::string why;
  if (onReaderThread()) {
    if (!send(UnregisterGroupRequest{0, key}, &why)) {  // no waiting on the reader thread
      MC_LOG(Warning) << "control plane: unregisterGroup('" << key << "'): " << why;
    }
    return;
  }
  Message answer;
  if (!call(UnregisterGroupRequest{0, key}, answerDeadline(options_.request_timeout), &answer, &why)) {
    MC_LOG(Warning) << "control plane: unregisterGroup('" << key << "'): " << why;
    return;
  }
  const Reply* reply = std::get_if<Reply>(&answer);
  if (reply != nullptr && !reply->error.empty()) {
    MC_LOG(Warning) << "control plane: unregisterGroup('" << key << "'): " << reply->error;
  }
}

void AgentImpl::reportFailure(const std::string& key, const std::vector<int>& ranks) {
  std::string why;
  if (!send(FailureReport{key, ranks}, &why)) {
    MC_LOG(Warning) << "control plane: reportFailure('" << key << "') not delivered: " << why;
  }
}

void AgentImpl::reportLinks(const std::string& key, const std::vector<int>& reached, const std::vector<int>& unreached) {
  std::string why;
  if (!send(LinkReport{key, {reached.begin(), reached.end()}, {unreached.begin(), unreached.end()}}, &why)) {
    MC_LOG(Warning) << "control plane: reportLinks('" << key << "') not delivered: " << why;
  }
}

SyncResult AgentImpl::syncAfterFailure(const std::string& key, const std::vector<int>& ranks) {
  SyncResult result;
  Message answer;
  std::string why;
  TimePoint deadline = answerDeadline(options_.reconciliation_window + options_.request_timeout);
  const SyncReply* reply = nullptr;
  if (call(SyncRequest{0, key, ranks}, deadline, &answer, &why, /*resend=*/true)) {
    reply = std::get_if<SyncReply>(&answer);
    if (reply == nullptr) why = "unexpected answer from the coordinator";
  }
  if (reply == nullptr) {
    result.response.status = SyncAfterFailureStatus::Rejected;
    result.response.reject_reason = "syncAfterFailure('" + key + "'): " + why;
    result.view = view(key);
    return result;
  }
  result.response = reply->response;
  std::lock_guard<std::mutex> lock(mutex_);
  auto it = groups_.find(key);
  if (it != groups_.end()) {
    result.view = it->second->view;  // already given to the listener, and at least as new as the answer's
  } else if (reply->view) {
    result.view = *reply->view;
  }
  return result;
}

bool AgentImpl::joinGroup(const std::string& key, std::chrono::milliseconds deadline, std::string* error) {
  std::string ignored_error;
  if (error == nullptr) error = &ignored_error;
  TimePoint until = Clock::now() + deadline;
  auto fail = [&](const std::string& why) {
    *error = "joinGroup('" + key + "'): " + why;
    return false;
  };
  std::shared_ptr<GroupSlot> slot;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    auto it = groups_.find(key);
    if (it == groups_.end()) return fail("this process has not registered the group");
    slot = it->second;
  }
  Message answer;
  std::string why;
  if (!call(JoinRequest{0, key}, until, &answer, &why)) return fail(why);
  const Reply* reply = std::get_if<Reply>(&answer);
  if (reply == nullptr || !reply->error.empty()) {
    return fail(reply == nullptr ? "unexpected answer from the coordinator" : reply->error);
  }
  std::unique_lock<std::mutex> lock(mutex_);
  auto unregistered = [&] {
    auto it = groups_.find(key);
    return it == groups_.end() || it->second != slot;
  };
  changed_.wait_until(lock, until, [&] { return slot->delivered_active || lost_ || stopping_ || unregistered(); });
  if (slot->delivered_active) return true;
  if (lost_) return fail(lost_reason_);
  if (stopping_) return fail("the agent is shutting down");
  if (unregistered()) return fail("the group was unregistered while joining");
  return fail("seat " + std::to_string(slot->registration.rank) + " was not activated within " + millisecondsText(deadline) +
              " (a member must propose its activation)");
}

ProposeViewUpdateResponse AgentImpl::propose(const std::string& key, bool activate, const std::vector<int>& ranks) {
  Message answer;
  std::string why;
  TimePoint deadline = answerDeadline(options_.request_timeout + options_.ack_timeout);
  if (call(ProposeRequest{0, key, activate, ranks}, deadline, &answer, &why)) {
    if (auto* reply = std::get_if<ProposeReply>(&answer)) return reply->response;
    why = "unexpected answer from the coordinator";
  }
  ProposeViewUpdateResponse rejected;
  rejected.status = ProposalStatus::Rejected;
  rejected.new_epoch = static_cast<int64_t>(view(key).epoch);
  rejected.reject_reason =
      std::string(activate ? "activate" : "deactivate") + " proposal for group '" + key + "': " + why;
  MC_LOG(Warning) << "control plane: " << rejected.reject_reason;
  return rejected;
}

GroupView AgentImpl::view(const std::string& key) const {
  std::lock_guard<std::mutex> lock(mutex_);
  auto it = groups_.find(key);
  if (it != groups_.end()) return it->second->view;
  GroupView none;
  none.key = key;
  return none;
}

}  // namespace
}  // namespace control

std::unique_ptr<Agent> Agent::connect(const std::string& address, int global_rank, const ControlOptions& options,
                                      std::string* error, Coordinator* standby) {
  std::string why;
  try {
    auto agent = std::make_unique<control::AgentImpl>(address, global_rank, options, standby);
    if (agent->start(&why)) return agent;
  } catch (const std::exception& e) {  // e.g. no thread could be started
    why = std::string("cannot start the agent: ") + e.what();
  }
  if (error != nullptr) *error = why;
  return nullptr;
}

}  // namespace mooncake::pg
