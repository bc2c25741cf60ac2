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
//
// This file: the group API and the factory. The connection is in
// agent_connection.cpp, failover in agent_failover.cpp, the class in
// agent_impl.h.
#include "control/agent_impl.h"

namespace mooncake::pg {
namespace control {

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
