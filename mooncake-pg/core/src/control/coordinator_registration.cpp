// Registration of seats (founding a group, extending it, taking over a seat)
// and leaving it.
#include <algorithm>
#include <set>

#include "control/coordinator_state.h"
#include "mooncake/te/log.h"

namespace mooncake::pg::control {
namespace {

constexpr int kMaxGroupSize = 1 << 16;  // bounds what one registration can make the Coordinator allocate

// "" or why the registration is malformed in itself.
std::string validate(const GroupRegistration& r, int global_rank) {
  if (r.key.empty()) return "the group key is empty";
  if (r.max_group_size <= 0 || r.max_group_size > kMaxGroupSize) {
    return "max_group_size " + std::to_string(r.max_group_size) + " is outside [1, " + std::to_string(kMaxGroupSize) +
           "]";
  }
  if (r.rank_order.empty() || r.rank_order.size() > static_cast<size_t>(r.max_group_size)) {
    return "rank_order has " + std::to_string(r.rank_order.size()) + " entries, it needs 1 to max_group_size (" +
           std::to_string(r.max_group_size) + ")";
  }
  if (r.rank < 0 || r.rank >= static_cast<int>(r.rank_order.size())) {
    return "seat " + std::to_string(r.rank) + " is outside rank_order " + listText(r.rank_order);
  }
  if (r.rank_order[r.rank] != global_rank) {
    return "seat " + std::to_string(r.rank) + " is global rank " + std::to_string(r.rank_order[r.rank]) +
           " in rank_order " + listText(r.rank_order) + ", but this process is global rank " +
           std::to_string(global_rank);
  }
  std::set<int> seen;
  for (int g : r.rank_order) {
    if (g < 0) return "rank_order " + listText(r.rank_order) + " holds a negative global rank";
    if (!seen.insert(g).second) {
      return "global rank " + std::to_string(g) + " appears twice in rank_order " + listText(r.rank_order);
    }
  }
  return "";
}

}  // namespace

bool CoordinatorState::mustWait(SessionId session, const GroupRegistration& registration) {
  if (failed_bootstraps_.count(registration.key) != 0) return false;  // refused at once below
  const Group* group = findGroup(registration.key);
  if (registration.is_extension) return group == nullptr || !group->ready;
  if (group == nullptr || !group->ready || registration.rank >= static_cast<int>(group->seats.size())) return false;
  const Seat& seat = group->seats[registration.rank];
  return seat.state == MemberState::kLeft && seat.left_by == session;
}

void CoordinatorState::handleRegister(TimePoint now, SessionId session, const RegisterGroupRequest& request,
                                      Effects* effects, std::optional<TimePoint> deadline) {
  const GroupRegistration& registration = request.registration;
  int global_rank = sessions_.at(session).global_rank;
  std::string error = validate(registration, global_rank);
  if (error.empty() && mustWait(session, registration)) {
    waiting_registrations_[registration.key].push_back(
        {session, request, deadline.value_or(now + options_.request_timeout)});
    return;  // answered when the group forms or is erased, or at the deadline
  }
  if (error.empty()) {
    error = registration.is_extension ? attachSeat(session, request, effects)
                                      : registerFounder(now, session, request, effects);
  }
  if (!error.empty()) {
    MC_LOG(Warning) << "control plane: registration of global rank " << global_rank << " for group '"
                    << registration.key << "' refused: " << error;
    reply(effects, {session, request.request_id}, error);
  }
}

std::string CoordinatorState::registerFounder(TimePoint now, SessionId session, const RegisterGroupRequest& request,
                                              Effects* effects) {
  const GroupRegistration& registration = request.registration;
  const std::string& key = registration.key;
  auto failed = failed_bootstraps_.find(key);
  if (failed != failed_bootstraps_.end()) return "group '" + key + "' cannot be formed: " + failed->second;

  Group* group = findGroup(key);
  if (group != nullptr && group->ready) {
    // The same group again (a replacement that did not say is_extension):
    // attach, with the rules of an extension.
    if (group->rank_order == registration.rank_order && group->max_group_size == registration.max_group_size) {
      return attachSeat(session, request, effects);
    }
    return "group '" + key + "' is already formed (rank_order " + listText(group->rank_order) + ", max_group_size " +
           std::to_string(group->max_group_size) + "); a registration that changes it needs is_extension=true";
  }
  if (group == nullptr) {
    Group fresh;
    fresh.key = key;
    fresh.uid = incarnation_ + "-" + std::to_string(++groups_created_);
    fresh.max_group_size = registration.max_group_size;
    fresh.rank_order = registration.rank_order;
    fresh.auto_deactivate = registration.auto_deactivate;
    fresh.seats.resize(static_cast<size_t>(registration.max_group_size));
    for (size_t seat = 0; seat < fresh.rank_order.size(); ++seat)
      fresh.seats[seat].global_rank = fresh.rank_order[seat];
    fresh.bootstrap_deadline = now + options_.request_timeout;
    // Epochs restart with the new incarnation: forget acknowledgements of an
    // earlier group of the same key.
    for (auto& entry : sessions_) entry.second.acked_epochs.erase(key);
    group = &groups_.emplace(key, std::move(fresh)).first->second;
  } else if (group->rank_order != registration.rank_order || group->max_group_size != registration.max_group_size) {
    return "founders of group '" + key + "' disagree: it was created with rank_order " + listText(group->rank_order) +
           " and max_group_size " + std::to_string(group->max_group_size) + ", this registration has rank_order " +
           listText(registration.rank_order) + " and max_group_size " + std::to_string(registration.max_group_size);
  }
  if (registration.auto_deactivate != group->auto_deactivate) {
    MC_LOG(Warning) << "control plane: founders of group '" << key
                    << "' disagree on auto_deactivate; the first registration's value ("
                    << (group->auto_deactivate ? "true" : "false") << ") stands";
  }

  Seat& seat = group->seats[registration.rank];
  if (seat.state != MemberState::kNone) {
    return "founder seat " + std::to_string(registration.rank) + " of group '" + key + "' is already registered";
  }
  seat.state = MemberState::kActive;
  seat.holder = session;
  seat.endpoint = registration.endpoint;
  seat.host = registration.host;
  seat.reports_links = registration.reports_links;
  forgetLinks(*group, registration.rank);
  group->waiting_founders.push_back({session, request.request_id});

  bool complete = std::all_of(group->seats.begin(), group->seats.begin() + group->rank_order.size(),
                              [](const Seat& s) { return s.state == MemberState::kActive; });
  if (complete) {
    group->ready = true;
    group->epoch = 1;
    noteActiveConfiguration(*group);
    GroupView view = makeView(*group);
    for (const PendingCall& founder : group->waiting_founders) reply(effects, founder, "", view);
    group->waiting_founders.clear();
    retryWaitingRegistrations(now, key, effects);
  }
  return "";
}

void CoordinatorState::retryWaitingRegistrations(TimePoint now, const std::string& key, Effects* effects) {
  auto waiting = waiting_registrations_.find(key);
  if (waiting == waiting_registrations_.end()) return;
  std::vector<WaitingRegistration> registrations = std::move(waiting->second);
  waiting_registrations_.erase(waiting);
  for (const WaitingRegistration& w : registrations) {
    if (isOnline(w.session)) handleRegister(now, w.session, w.request, effects, w.deadline);
  }
}

void CoordinatorState::expireWaitingRegistrations(TimePoint now, Effects* effects) {
  for (auto it = waiting_registrations_.begin(); it != waiting_registrations_.end();) {
    auto& waiting = it->second;
    auto failed = failed_bootstraps_.find(it->first);
    for (auto w = waiting.begin(); w != waiting.end();) {
      if (failed == failed_bootstraps_.end() && now < w->deadline) {
        ++w;
        continue;
      }
      std::string why;
      if (failed != failed_bootstraps_.end()) {
        why = "group '" + it->first + "' cannot be formed: " + failed->second;
      } else if (w->request.registration.is_extension) {
        why = "no group '" + it->first + "' was formed within " + millisecondsText(options_.request_timeout) +
              " for this extension to join";
      } else {
        why = "group '" + it->first + "', which this process left, still has members after " +
              millisecondsText(options_.request_timeout) +
              ": a new incarnation is founded only once every member has left the old one";
      }
      reply(effects, {w->session, w->request.request_id}, why);
      w = waiting.erase(w);
    }
    it = waiting.empty() ? waiting_registrations_.erase(it) : std::next(it);
  }
}

std::string CoordinatorState::attachSeat(SessionId session, const RegisterGroupRequest& request, Effects* effects) {
  const GroupRegistration& registration = request.registration;
  const std::string& key = registration.key;
  Group* group = findGroup(key);
  if (group == nullptr) {
    return "there is no group '" + key + "' to extend (an extension joins an existing group, it never creates one)";
  }
  if (!group->ready) {
    return "group '" + key + "' is still being formed; an extension can join only once every founder has registered";
  }
  if (registration.max_group_size != group->max_group_size) {
    return "max_group_size " + std::to_string(registration.max_group_size) + " does not match group '" + key + "' (" +
           std::to_string(group->max_group_size) + ")";
  }
  const std::vector<int>& current = group->rank_order;
  const std::vector<int>& wanted = registration.rank_order;
  if (wanted.size() < current.size() || !std::equal(current.begin(), current.end(), wanted.begin())) {
    return "rank_order " + listText(wanted) + " does not extend group '" + key + "' (its rank_order " +
           listText(current) + " must be a prefix of it)";
  }
  int rank = registration.rank;
  if (rank < static_cast<int>(current.size())) {
    const Seat& seat = group->seats[rank];
    bool free = seat.state == MemberState::kNone || seat.state == MemberState::kInactive ||
                seat.state == MemberState::kLeft || !isOnline(seat.holder);
    if (!free) {
      return "seat " + std::to_string(rank) + " of group '" + key + "' is " + memberStateName(seat.state) +
             " and its process (global rank " + std::to_string(seat.global_rank) +
             ") is online; only a seat whose process is gone, or an Inactive or Left seat, can be taken over";
    }
  }
  for (size_t appended = current.size(); appended < wanted.size(); ++appended) {
    group->seats[appended].global_rank = wanted[appended];
  }
  group->rank_order = wanted;

  Seat& seat = group->seats[rank];
  seat.state = MemberState::kInactive;
  seat.holder = session;
  seat.endpoint = registration.endpoint;
  seat.host = registration.host;
  seat.reports_links = registration.reports_links;
  forgetLinks(*group, rank);
  publish(*group, effects, /*skip=*/session);
  reply(effects, {session, request.request_id}, "", makeView(*group));
  return "";
}

void CoordinatorState::failBootstrap(const std::string& key, const std::string& reason, Effects* effects) {
  Group* group = findGroup(key);
  if (group == nullptr) return;
  MC_LOG(Warning) << "control plane: " << reason;
  for (const PendingCall& founder : group->waiting_founders) reply(effects, founder, reason);
  failed_bootstraps_[key] = reason;
  groups_.erase(key);
  expireWaitingRegistrations(TimePoint::min(), effects);  // those of `key` are refused now
}

void CoordinatorState::handleUnregister(TimePoint now, SessionId session, const UnregisterGroupRequest& request,
                                        Effects* effects) {
  PendingCall call{session, request.request_id};
  Group* group = nullptr;
  int seat = -1;
  std::string refusal = findMembership(request.key, session, &group, &seat);
  if (seat < 0) return reply(effects, call, refusal);
  if (!group->ready) {
    failBootstrap(request.key,
                  "founder seat " + std::to_string(seat) + " (global rank " +
                      std::to_string(group->seats[seat].global_rank) + ") left group '" + request.key +
                      "' before it was formed",
                  effects);
    reply(effects, call, "");
    return;
  }
  forgetCalls(*group, session, /*dropped=*/false);
  Seat& leaving = group->seats[seat];
  leaving.state = MemberState::kLeft;
  leaving.left_by = session;
  leaving.holder = 0;
  leaving.endpoint.clear();
  leaving.host.clear();
  reply(effects, call, "");

  bool deserted = std::all_of(group->seats.begin(), group->seats.end(), [](const Seat& s) {
    return s.state == MemberState::kNone || s.state == MemberState::kLeft;
  });
  if (deserted) {
    groups_.erase(request.key);
    retryWaitingRegistrations(now, request.key, effects);  // founders of the next incarnation
    return;
  }
  publish(*group, effects);  // the others learn at once (the reference tells nobody)
  advanceProposals(now, *group, effects);
}

void CoordinatorState::forgetCalls(Group& group, SessionId session, bool dropped) {
  auto bySession = [session](const auto& item) { return item.session == session; };
  group.waiting_syncs.erase(std::remove_if(group.waiting_syncs.begin(), group.waiting_syncs.end(), bySession),
                            group.waiting_syncs.end());
  group.proposals.erase(std::remove_if(group.proposals.begin(), group.proposals.end(),
                                       [session](const Proposal& p) { return p.caller.session == session; }),
                        group.proposals.end());
  if (!group.barrier) return;
  auto waiting = group.barrier->waiting.find(session);
  if (waiting == group.barrier->waiting.end()) return;
  if (dropped) group.barrier->dropped.insert(waiting->second);
  group.barrier->waiting.erase(waiting);
}

}  // namespace mooncake::pg::control
