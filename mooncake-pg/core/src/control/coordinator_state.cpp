// Sessions, liveness, views and timers of the Coordinator's state machine.
#include "control/coordinator_state.h"

#include <algorithm>

#include "mooncake/te/log.h"

namespace mooncake::pg::control {
namespace {

template <class... Handlers>
struct Overloaded : Handlers... {
  using Handlers::operator()...;
};
template <class... Handlers>
Overloaded(Handlers...) -> Overloaded<Handlers...>;

}  // namespace

CoordinatorState::CoordinatorState(const ControlOptions& options, std::string incarnation)
    : options_(options), incarnation_(std::move(incarnation)) {}

void CoordinatorState::onConnected(TimePoint now, SessionId session) {
  Session& s = sessions_[session];
  s.deadline = now + options_.request_timeout;  // to say Hello
  s.last_seen = now;
}

void CoordinatorState::onMessage(TimePoint now, SessionId session, Message message, Effects* effects) {
  auto it = sessions_.find(session);
  if (it == sessions_.end()) return;
  Session& sender = it->second;
  sender.last_seen = now;
  if (!sender.accepted) {
    const Hello* hello = std::get_if<Hello>(&message);
    const Rejoin* rejoin = std::get_if<Rejoin>(&message);
    if (hello != nullptr && sender.global_rank < 0) {
      handleHello(now, session, *hello, effects);
    } else if (rejoin != nullptr && sender.resume) {
      handleRejoin(now, session, *rejoin, effects);
    } else {
      goOffline(now, {session}, std::string("protocol violation: ") + messageName(message) + " before being accepted",
                effects);
    }
    return;
  }
  std::visit(Overloaded{
                 [&](const Heartbeat&) {},
                 [&](const Goodbye&) { sender.leaving = true; },
                 [&](const RegisterGroupRequest& m) { handleRegister(now, session, m, effects); },
                 [&](const UnregisterGroupRequest& m) { handleUnregister(now, session, m, effects); },
                 [&](const FailureReport& m) { handleReport(now, session, m); },
                 [&](const SyncRequest& m) { handleSync(now, session, m, effects); },
                 [&](const JoinRequest& m) { handleJoin(now, session, m, effects); },
                 [&](const ProposeRequest& m) { handlePropose(now, session, m, effects); },
                 [&](const ViewAck& m) { handleAck(now, session, m, effects); },
                 [&](const LinkReport& m) { handleLinkReport(now, session, m, effects); },
                 [&](const auto&) {
                   goOffline(now, {session},
                             std::string("protocol violation: unexpected ") + messageName(message) + " from an agent",
                             effects);
                 },
             },
             message);
}

void CoordinatorState::onDisconnected(TimePoint now, SessionId session, const std::string& why, Effects* effects) {
  goOffline(now, {session}, why, effects);
}

bool CoordinatorState::isOnline(SessionId session) const {
  auto it = sessions_.find(session);
  return it != sessions_.end() && it->second.accepted;
}

CoordinatorState::Session* CoordinatorState::acceptedSession(SessionId session) {
  auto it = sessions_.find(session);
  return it != sessions_.end() && it->second.accepted ? &it->second : nullptr;
}

void CoordinatorState::handleHello(TimePoint now, SessionId session, const Hello& hello, Effects* effects) {
  if (hello.global_rank < 0) {
    effects->sends.push_back({session, Reply{0, "invalid global rank " + std::to_string(hello.global_rank), {}}});
    goOffline(now, {session}, "invalid Hello", effects);
    return;
  }
  Session& s = sessions_.at(session);
  s.global_rank = hello.global_rank;
  s.standby = hello.standby;
  std::string refusal = refuse_all_;
  if (refusal.empty() && recovery_ && !hello.resume) {
    refusal = "this coordinator is taking over from a lost one; new processes can connect once it serves";
  }
  if (refusal.empty() && !recovery_ && hello.resume) {
    refusal = "this coordinator is not taking over from a lost one (any more): a failover, if there was one, "
              "completed without this process";
  }
  if (!refusal.empty()) {
    effects->sends.push_back({session, Reply{0, refusal, {}}});
    goOffline(now, {session}, "refused: " + refusal, effects);
    return;
  }
  if (hello.resume) {
    handleResumeHello(now, session, hello, effects);
    return;
  }
  if (online_by_global_rank_.count(hello.global_rank) == 0) {
    accept(now, session, effects);
    return;
  }
  // A replacement while the previous process still counts as online: it
  // gets heartbeat_timeout for the old one to be found dead (or to leave).
  s.deadline = now + options_.heartbeat_timeout;
  MC_LOG(Warning) << "control plane: a new process (pid " << hello.pid << ") for global rank " << hello.global_rank
                  << " connected while the previous one is still online; waiting up to "
                  << millisecondsText(options_.heartbeat_timeout) << " for it to go offline";
}

void CoordinatorState::admit(TimePoint now, SessionId session, Effects* effects) {
  Session& s = sessions_.at(session);
  s.accepted = true;
  s.last_seen = now;
  online_by_global_rank_[s.global_rank] = session;
  effects->sends.push_back({session, Reply{0, "", {}}});
}

void CoordinatorState::accept(TimePoint now, SessionId session, Effects* effects) {
  admit(now, session, effects);
  tellStandbys(effects, session);
}

void CoordinatorState::tellStandbys(Effects* effects, SessionId to) {
  // The lowest candidates only: enough to survive the loss of several at
  // once, and small enough to tell everyone whenever they change.
  constexpr size_t kMaxCandidates = 8;
  Standbys standbys;
  standbys.coordinator_rank = host_rank_;
  for (const auto& [global_rank, session] : online_by_global_rank_) {
    const Session& s = sessions_.at(session);
    if (global_rank == host_rank_ || s.standby.empty()) continue;
    if (standbys.ranks.size() == kMaxCandidates) break;
    standbys.ranks.push_back(global_rank);
    standbys.addresses.push_back(s.standby);
  }
  bool changed = !told_standbys_ || told_standbys_->ranks != standbys.ranks ||
                 told_standbys_->addresses != standbys.addresses;
  if (!changed) {
    if (to != 0) effects->sends.push_back({to, standbys});
    return;
  }
  told_standbys_ = standbys;
  for (const auto& [global_rank, session] : online_by_global_rank_) effects->sends.push_back({session, standbys});
}

bool CoordinatorState::loseSeat(const Group& group, Seat& seat) {
  if (seat.state != MemberState::kActive && seat.state != MemberState::kAwaitingActivation) return false;
  if (group.auto_deactivate) seat.state = MemberState::kInactive;
  return true;
}

void CoordinatorState::goOffline(TimePoint now, const std::vector<SessionId>& sessions, const std::string& why,
                                 Effects* effects) {
  std::map<SessionId, int> gone;  // accepted sessions that went -> their global rank
  for (SessionId session : sessions) {
    auto it = sessions_.find(session);
    if (it == sessions_.end()) continue;
    effects->disconnects.push_back(session);
    if (it->second.accepted) {
      gone[session] = it->second.global_rank;
      online_by_global_rank_.erase(it->second.global_rank);
      // A process that said Goodbye ended normally: its seats are lost all
      // the same, without an alarm.
      MC_LOG_AT(::mooncake::log::warningUnlessPlanned(it->second.leaving))
          << "control plane: global rank " << it->second.global_rank
          << (it->second.leaving ? " left (a normal exit)" : " is offline: " + why);
    }
    sessions_.erase(it);
  }
  if (gone.empty()) return;

  std::vector<std::string> keys;
  for (const auto& entry : groups_) keys.push_back(entry.first);
  for (const auto& key : keys) {
    Group* group = findGroup(key);
    if (group == nullptr) continue;
    std::vector<int> lost_seats;
    for (const auto& [session, global_rank] : gone) {
      int seat = seatOf(*group, session);
      if (seat < 0) continue;
      lost_seats.push_back(seat);
      if (group->ready) forgetCalls(*group, session, /*dropped=*/true);
    }
    if (lost_seats.empty()) continue;
    if (!group->ready) {
      int seat = lost_seats.front();
      failBootstrap(key,
                    "founder seat " + std::to_string(seat) + " (global rank " +
                        std::to_string(group->seats[seat].global_rank) + ") of group '" + key +
                        "' went offline before the group was formed (" + why + ")",
                    effects);
      continue;
    }
    for (int seat : lost_seats) loseSeat(*group, group->seats[seat]);
    publish(*group, effects);  // at least the online flags changed
    advanceProposals(now, *group, effects);
  }

  // Replacements that waited for these global ranks can be accepted now.
  for (const auto& [session, global_rank] : gone) {
    for (auto& [id, waiting] : sessions_) {
      if (!waiting.accepted && !waiting.resume && waiting.global_rank == global_rank) {
        accept(now, id, effects);
        break;
      }
    }
  }
  tellStandbys(effects);
}

void CoordinatorState::handleAck(TimePoint now, SessionId session, const ViewAck& ack, Effects* effects) {
  Session* s = acceptedSession(session);
  uint64_t& acked = s->acked_epochs[ack.key];
  acked = std::max(acked, ack.epoch);
  Group* group = findGroup(ack.key);
  if (group == nullptr || !group->barrier) return;
  auto waiting = group->barrier->waiting.find(session);
  if (waiting == group->barrier->waiting.end() || acked < group->barrier->epoch) return;
  group->barrier->waiting.erase(waiting);
  advanceProposals(now, *group, effects);
}

GroupView CoordinatorState::makeView(const Group& group) const {
  GroupView view;
  view.key = group.key;
  view.uid = group.uid;
  view.epoch = group.epoch;
  view.active_epoch = group.active_epoch;
  for (const Seat& seat : group.seats) {
    view.members.push_back(seat.state);
    view.global_ranks.push_back(seat.global_rank);
    view.endpoints.push_back(seat.endpoint);
    view.hosts.push_back(seat.host);
    view.online.push_back(seat.holder != 0 && isOnline(seat.holder));
  }
  return view;
}

void CoordinatorState::noteActiveConfiguration(Group& group) {
  std::string configuration;
  for (size_t i = 0; i < group.seats.size(); ++i) {
    if (group.seats[i].state == MemberState::kActive) configuration += std::to_string(i) + "=" + group.seats[i].endpoint + ";";
  }
  if (configuration != group.active_configuration) {
    group.active_configuration = configuration;
    group.active_epoch = group.epoch;
  }
}

void CoordinatorState::publish(Group& group, Effects* effects, SessionId skip) {
  ++group.epoch;
  noteActiveConfiguration(group);
  GroupView view = makeView(group);
  for (const Seat& seat : group.seats) {
    bool holds = seat.state == MemberState::kActive || seat.state == MemberState::kInactive ||
                 seat.state == MemberState::kAwaitingActivation;
    if (holds && seat.holder != skip && isOnline(seat.holder)) effects->sends.push_back({seat.holder, ViewPush{view}});
  }
}

int CoordinatorState::seatOf(const Group& group, SessionId session) const {
  for (size_t i = 0; i < group.seats.size(); ++i) {
    if (group.seats[i].holder == session) return static_cast<int>(i);
  }
  return -1;
}

CoordinatorState::Group* CoordinatorState::findGroup(const std::string& key) {
  auto it = groups_.find(key);
  return it == groups_.end() ? nullptr : &it->second;
}

std::string CoordinatorState::findMembership(const std::string& key, SessionId session, Group** group, int* seat) {
  *group = findGroup(key);
  if (*group == nullptr) return "unknown group '" + key + "'";
  *seat = seatOf(**group, session);
  if (*seat < 0) {
    return "global rank " + std::to_string(sessions_.at(session).global_rank) + " holds no seat in group '" + key + "'";
  }
  if (!(*group)->ready) return "group '" + key + "' is not formed yet";
  return "";
}

void CoordinatorState::reply(Effects* effects, const PendingCall& call, std::string error,
                             std::optional<GroupView> view) {
  effects->sends.push_back({call.session, Reply{call.request_id, std::move(error), std::move(view)}});
}

void CoordinatorState::onTimer(TimePoint now, Effects* effects) {
  if (recovery_ && now >= recovery_->deadline) finishTakeOver(now, /*deadline_passed=*/true, effects);
  expireWaitingRegistrations(now, effects);
  std::vector<SessionId> silent;
  std::vector<SessionId> expired;
  for (const auto& [id, s] : sessions_) {
    if (s.accepted ? now - s.last_seen >= options_.heartbeat_timeout : now >= s.deadline) {
      (s.accepted ? silent : expired).push_back(id);
    }
  }
  goOffline(now, silent, "no heartbeat for " + millisecondsText(options_.heartbeat_timeout), effects);
  for (SessionId id : expired) {
    auto it = sessions_.find(id);
    if (it == sessions_.end() || it->second.accepted) continue;  // accepted meanwhile: its old process went
    int global_rank = it->second.global_rank;
    if (global_rank >= 0) {
      std::string refusal = "global rank " + std::to_string(global_rank) +
                            " is still held by a live process (it keeps heartbeating); a new process for it "
                            "can connect only once the old one is gone (waited " +
                            millisecondsText(options_.heartbeat_timeout) + ")";
      effects->sends.push_back({id, Reply{0, refusal, {}}});
    }
    goOffline(now, {id}, global_rank >= 0 ? "replacement refused" : "no Hello within request_timeout", effects);
  }

  std::vector<std::string> keys;
  for (const auto& entry : groups_) keys.push_back(entry.first);
  for (const auto& key : keys) {
    Group* group = findGroup(key);
    if (group == nullptr) continue;
    if (!group->ready) {
      if (now < group->bootstrap_deadline) continue;
      std::vector<int> missing;
      std::vector<int> missing_ranks;
      for (size_t seat = 0; seat < group->rank_order.size(); ++seat) {
        if (group->seats[seat].state != MemberState::kActive) {
          missing.push_back(static_cast<int>(seat));
          missing_ranks.push_back(group->rank_order[seat]);
        }
      }
      failBootstrap(key,
                    "group '" + key + "' was not formed within request_timeout (" +
                        millisecondsText(options_.request_timeout) + "): founder seats " + listText(missing) +
                        " (global ranks " + listText(missing_ranks) + ") never registered",
                    effects);
      continue;
    }
    if (group->window_closes && now >= *group->window_closes) closeWindow(now, *group, effects);
    if (group->barrier && now >= group->barrier->deadline) dropLaggards(now, *group, effects);
    advanceProposals(now, *group, effects);  // admission deadlines
  }
}

TimePoint CoordinatorState::nextDeadline() const {
  TimePoint next = recovery_ ? recovery_->deadline : TimePoint::max();
  for (const auto& [id, s] : sessions_) {
    next = std::min(next, s.accepted ? s.last_seen + options_.heartbeat_timeout : s.deadline);
  }
  for (const auto& [key, waiting] : waiting_registrations_) {
    for (const WaitingRegistration& w : waiting) next = std::min(next, w.deadline);
  }
  for (const auto& [key, group] : groups_) {
    if (!group.ready) {
      next = std::min(next, group.bootstrap_deadline);
      continue;
    }
    if (group.window_closes) next = std::min(next, *group.window_closes);
    if (group.barrier) {
      next = std::min(next, group.barrier->deadline);
    } else if (!group.proposals.empty()) {
      const Proposal& proposal = group.proposals.front();
      next = std::min(next, proposal.evidence_deadline.value_or(proposal.admission_deadline));
    }
  }
  return next;
}

}  // namespace mooncake::pg::control
