// Link evidence: which seats' processes reached which others' data-plane
// endpoints, and the process states (Synced/Healthy) it gives. Activation
// admission (coordinator_proposals.cpp) asks linkGaps.
#include <algorithm>
#include <set>

#include "control/coordinator_state.h"

namespace mooncake::pg::control {

void CoordinatorState::handleLinkReport(TimePoint now, SessionId session, const LinkReport& report,
                                        Effects* effects) {
  Group* group = nullptr;
  int seat = -1;
  if (!findMembership(report.key, session, &group, &seat).empty()) return;  // a group it left meanwhile
  Seat& reporter = group->seats[seat];
  auto note = [&](const std::vector<int32_t>& peers, bool reached) {
    for (int peer : peers) {
      if (peer >= 0 && peer < group->max_group_size && peer != seat) reporter.links[peer] = reached;
    }
  };
  note(report.reached, true);
  note(report.unreached, false);
  advanceProposals(now, *group, effects);  // an activation may wait for this evidence
}

void CoordinatorState::forgetLinks(Group& group, int seat) {
  group.seats[seat].links.clear();
  for (Seat& other : group.seats) other.links.erase(seat);
}

CoordinatorState::LinkGaps CoordinatorState::linkGaps(const Group& group, const std::vector<int>& targets,
                                                      const std::vector<int>& future) {
  std::set<std::pair<int, int>> unreachable, missing;
  // One direction: what `from` reported about `to` (nothing is required of a
  // process that does not report links).
  auto check = [&](int from, int to) {
    const Seat& reporter = group.seats[from];
    if (!reporter.reports_links) return;
    auto it = reporter.links.find(to);
    if (it == reporter.links.end()) {
      missing.insert({from, to});
    } else if (!it->second) {
      unreachable.insert({from, to});
    }
  };
  for (int target : targets) {
    for (int other : future) {
      if (other == target) continue;
      check(target, other);
      check(other, target);
    }
  }
  return {{unreachable.begin(), unreachable.end()}, {missing.begin(), missing.end()}};
}

std::string CoordinatorState::linksText(const std::vector<std::pair<int, int>>& links) {
  std::string text;
  for (const auto& [from, to] : links) text += (text.empty() ? "" : ", ") + std::to_string(from) + "->" + std::to_string(to);
  return text;
}

RankState CoordinatorState::rankState(int global_rank) const {
  auto online = online_by_global_rank_.find(global_rank);
  if (online == online_by_global_rank_.end()) return RankState::kOffline;
  for (const auto& [key, group] : groups_) {
    if (!group.ready) continue;
    std::vector<int> active;
    for (size_t s = 0; s < group.seats.size(); ++s) {
      if (group.seats[s].state == MemberState::kActive) active.push_back(static_cast<int>(s));
    }
    for (size_t s = 0; s < group.seats.size(); ++s) {
      const Seat& seat = group.seats[s];
      // An active seat is vouched for by its working data plane; a joining
      // one must show its links with the active seats.
      if (seat.holder != online->second || seat.state != MemberState::kAwaitingActivation) continue;
      LinkGaps gaps = linkGaps(group, {static_cast<int>(s)}, active);
      if (!gaps.unreachable.empty() || !gaps.missing.empty()) return RankState::kSynced;
    }
  }
  return RankState::kHealthy;
}

}  // namespace mooncake::pg::control
