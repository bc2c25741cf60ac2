// The Agent's implementation class, shared by the three files that define
// it: agent_connection.cpp (the connection to the Coordinator: opening,
// greeting, requests, the reader and heartbeat threads), agent_failover.cpp
// (a lost connection: the candidate successors, then the loss listeners)
// and agent.cpp (the group API and the factory). Private to mooncake-pg.
#pragma once

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

namespace mooncake::pg::control {

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
  bool firstSuccessor(int* global_rank, std::string* address) const override;

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


// Defined here: agent.cpp's group calls instantiate it too.
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

}  // namespace mooncake::pg::control
