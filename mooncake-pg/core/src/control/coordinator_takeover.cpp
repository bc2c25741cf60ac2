// Failover: a standby coordinator takes over from a lost one, rebuilding the
// groups from what the rejoining processes report (control_plane.h,
// "Coordinator failover").
#include <algorithm>

#include "control/coordinator_state.h"
#include "mooncake/te/log.h"

namespace mooncake::pg::control {

void CoordinatorState::beginTakeOver(TimePoint now, const std::vector<int>& candidates, int lost_rank,
                                     bool planned) {
  Recovery recovery;
  recovery.planned = planned;
  recovery.candidates.insert(candidates.begin(), candidates.end());
  recovery.candidates.erase(lost_rank);
  recovery.lost_rank = lost_rank;
  recovery.deadline = now + options_.failover_timeout;
  recovery_ = std::move(recovery);
  told_standbys_.reset();
  MC_LOG_AT(::mooncake::log::warningUnlessPlanned(planned))
      << "control plane: global rank " << host_rank_ << " takes over as coordinator from global rank " << lost_rank
      << (planned ? " (which left)" : "") << "; waiting up to " << millisecondsText(options_.failover_timeout)
                  << " for global ranks " << listText(candidates) << " and the others online in their views";
}

void CoordinatorState::handleResumeHello(TimePoint now, SessionId session, const Hello& hello, Effects* effects) {
  Session& s = sessions_.at(session);
  for (const auto& [id, other] : sessions_) {
    if (id != session && other.resume && other.global_rank == hello.global_rank) {
      effects->sends.push_back({session, Reply{0, "global rank " + std::to_string(hello.global_rank) +
                                                      " has already rejoined this coordinator",
                                               {}}});
      goOffline(now, {session}, "duplicate rejoin", effects);
      return;
    }
  }
  s.resume = true;
  s.rejoins_expected = hello.rejoins;
  s.deadline = std::max(s.deadline, recovery_->deadline);
  finishTakeOver(now, /*deadline_passed=*/false, effects);
}

void CoordinatorState::handleRejoin(TimePoint now, SessionId session, const Rejoin& rejoin, Effects* effects) {
  Session& s = sessions_.at(session);
  if (!recovery_ || s.rejoins.size() >= s.rejoins_expected) {
    goOffline(now, {session}, "protocol violation: an unannounced Rejoin", effects);
    return;
  }
  s.rejoins.push_back(rejoin);
  finishTakeOver(now, /*deadline_passed=*/false, effects);
}

void CoordinatorState::finishTakeOver(TimePoint now, bool deadline_passed, Effects* effects) {
  if (!recovery_) return;
  std::vector<SessionId> rejoined;
  std::set<int> ranks;
  std::set<int> awaited = recovery_->candidates;  // and whoever a rejoined view shows online
  for (const auto& [id, s] : sessions_) {
    if (!s.resume) continue;
    for (const Rejoin& r : s.rejoins) {
      for (size_t i = 0; i < r.view.global_ranks.size() && i < r.view.online.size(); ++i) {
        if (r.view.online[i] && r.view.global_ranks[i] >= 0) awaited.insert(r.view.global_ranks[i]);
      }
    }
    if (s.rejoins.size() == s.rejoins_expected) {
      rejoined.push_back(id);
      ranks.insert(s.global_rank);
    }
  }
  awaited.erase(recovery_->lost_rank);
  size_t present = 0;
  for (int g : awaited) present += ranks.count(g);
  if (!deadline_passed && present < awaited.size()) return;
  const size_t expected = awaited.size();
  std::vector<int> missing;
  for (int g : awaited) {
    if (ranks.count(g) == 0) missing.push_back(g);
  }
  // After a planned leave the others often end too (the end of a job): no alarm either way.
  const auto level = ::mooncake::log::warningUnlessPlanned(recovery_->planned);
  recovery_.reset();
  if (present * 2 <= expected) {
    refuse_all_ = "global rank " + std::to_string(host_rank_) + " could not take over as coordinator: only " +
                  std::to_string(present) + " of the " + std::to_string(expected) +
                  " processes of the last membership rejoined it within " +
                  millisecondsText(options_.failover_timeout) +
                  " (no majority: this process is probably the one cut off)";
    MC_LOG_AT(level) << "control plane: " << refuse_all_;
    std::vector<SessionId> everyone;
    for (const auto& [id, s] : sessions_) {
      effects->sends.push_back({id, Reply{0, refuse_all_, {}}});
      everyone.push_back(id);
    }
    goOffline(now, everyone, "take-over failed", effects);
    return;
  }
  MC_LOG_AT(level) << "control plane: global rank " << host_rank_ << " serves as coordinator; " << present << " of "
                   << expected << " processes rejoined"
                   << (missing.empty() ? std::string() : " (gone: global ranks " + listText(missing) + ")");
  // Late resumers (not counted: outside `expected`) are accepted alike.
  for (SessionId id : rejoined) {
    if (online_by_global_rank_.count(sessions_.at(id).global_rank) == 0) admit(now, id, effects);
  }
  rebuildGroups(rejoined, effects, level);
  tellStandbys(effects);  // once, to everyone
  // Processes that connected without resume meanwhile were refused; those
  // still saying nothing keep their Hello deadline.
}

void CoordinatorState::rebuildGroups(const std::vector<SessionId>& rejoined, Effects* effects,
                                     ::mooncake::log::Level level) {
  struct Reported {
    GroupView newest;
    std::vector<std::pair<SessionId, GroupRegistration>> holders;
  };
  std::map<std::string, Reported> reported;
  for (SessionId id : rejoined) {
    if (!isOnline(id)) continue;
    for (const Rejoin& r : sessions_.at(id).rejoins) {
      const size_t seats = r.view.members.size();
      if (r.view.key != r.registration.key || seats == 0 ||
          seats != static_cast<size_t>(r.registration.max_group_size) || r.registration.rank < 0 ||
          r.registration.rank >= static_cast<int>(seats)) {
        MC_LOG(Warning) << "control plane: ignoring an inconsistent rejoin of group '" << r.registration.key
                        << "' by global rank " << sessions_.at(id).global_rank;
        continue;
      }
      Reported& group = reported[r.registration.key];
      if (group.holders.empty() || r.view.epoch > group.newest.epoch) group.newest = r.view;
      group.holders.emplace_back(id, r.registration);
    }
  }
  for (auto& [key, group_report] : reported) {
    const GroupView& newest = group_report.newest;
    Group group;
    group.key = key;
    group.uid = newest.uid;  // data-plane names stay those of the same incarnation
    group.max_group_size = static_cast<int>(newest.members.size());
    group.auto_deactivate = group_report.holders.front().second.auto_deactivate;
    group.ready = true;
    group.epoch = newest.epoch;
    group.seats.resize(newest.members.size());
    for (size_t i = 0; i < newest.members.size(); ++i) {
      Seat& seat = group.seats[i];
      seat.state = newest.members[i];
      seat.global_rank = newest.global_ranks[i];
      seat.endpoint = newest.endpoints[i];
      seat.host = newest.hosts[i];
    }
    for (const auto& [session, registration] : group_report.holders) {
      if (static_cast<int>(registration.rank_order.size()) > static_cast<int>(group.rank_order.size()) &&
          registration.max_group_size == group.max_group_size) {
        group.rank_order = registration.rank_order;
      }
      Seat& seat = group.seats[registration.rank];
      if (seat.holder != 0) continue;  // two processes claim it: the first stands
      seat.holder = session;
      seat.global_rank = sessions_.at(session).global_rank;
      seat.endpoint = registration.endpoint;
      seat.host = registration.host;
      seat.reports_links = registration.reports_links;
      if (seat.state == MemberState::kNone || seat.state == MemberState::kLeft) seat.state = MemberState::kInactive;
    }
    // Seats the newest view knows beyond the registrations' rank_order (extensions seen in views).
    for (size_t i = group.rank_order.size(); i < group.seats.size() && group.seats[i].global_rank >= 0; ++i) {
      group.rank_order.push_back(group.seats[i].global_rank);
    }
    // The active configuration as it was: only a change makes a new active_epoch.
    noteActiveConfiguration(group);
    group.active_epoch = newest.active_epoch;
    // Every seat nobody rejoined for is gone, as if its process went offline.
    std::vector<int> gone;
    for (size_t i = 0; i < group.seats.size(); ++i) {
      if (group.seats[i].holder == 0 && loseSeat(group, group.seats[i])) gone.push_back(static_cast<int>(i));
    }
    Group& stored = groups_[key] = std::move(group);
    MC_LOG_AT(level) << "control plane: group '" << key << "' rebuilt from " << group_report.holders.size()
                    << " rejoined seats at epoch " << stored.epoch << "; seats without a process: " << listText(gone);
    publish(stored, effects);
  }
}

}  // namespace mooncake::pg::control
