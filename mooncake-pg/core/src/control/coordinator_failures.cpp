// Failure evidence from the data plane, its reconciliation window, and
// syncAfterFailure.
#include "control/coordinator_state.h"
#include "control/reconciliation.h"
#include "mooncake/te/log.h"

namespace mooncake::pg::control {

std::string CoordinatorState::recordEvidence(TimePoint now, SessionId session, const std::string& key,
                                             const std::vector<int32_t>& ranks) {
  Group* group = nullptr;
  int reporter = -1;
  std::string refusal = findMembership(key, session, &group, &reporter);
  if (!refusal.empty()) return refusal;
  bool recorded = false;
  for (int seat : ranks) {
    if (seat < 0 || seat >= group->max_group_size || seat == reporter) continue;
    group->evidence[reporter].insert(seat);
    recorded = true;
  }
  // The window opens with the first evidence and is never extended: more
  // evidence joins the decision already scheduled.
  if (recorded && !group->window_closes) group->window_closes = now + options_.reconciliation_window;
  return "";
}

void CoordinatorState::handleReport(TimePoint now, SessionId session, const FailureReport& report) {
  std::string refusal = recordEvidence(now, session, report.key, report.ranks);
  if (!refusal.empty()) {
    MC_LOG(Warning) << "control plane: failure report ignored: " << refusal;
  }
}

void CoordinatorState::handleSync(TimePoint now, SessionId session, const SyncRequest& request, Effects* effects) {
  std::string refusal = recordEvidence(now, session, request.key, request.ranks);
  if (!refusal.empty()) {
    SyncReply rejected{request.request_id, {SyncAfterFailureStatus::Rejected, refusal}, std::nullopt};
    effects->sends.push_back({session, std::move(rejected)});
    return;
  }
  Group& group = *findGroup(request.key);
  if (group.window_closes) {
    group.waiting_syncs.push_back({session, request.request_id});
    return;
  }
  SyncReply nothing_pending{request.request_id, {SyncAfterFailureStatus::NoPending, ""}, makeView(group)};
  effects->sends.push_back({session, std::move(nothing_pending)});
}

void CoordinatorState::closeWindow(TimePoint now, Group& group, Effects* effects) {
  group.window_closes.reset();
  if (group.auto_deactivate) {
    std::vector<SeatHealth> health;
    for (const Seat& seat : group.seats) health.push_back({seat.state == MemberState::kActive, isOnline(seat.holder)});
    std::vector<int> failed = seatsToDeactivate(health, group.evidence);
    if (!failed.empty()) {
      for (int seat : failed) group.seats[seat].state = MemberState::kInactive;
      publish(group, effects);
      MC_LOG(Warning) << "control plane: group '" << group.key << "' deactivated seats " << listText(failed)
                      << " after failure reports (epoch " << group.epoch << ")";
    }
  } else if (!group.evidence.empty()) {
    MC_LOG(Info) << "control plane: group '" << group.key
                 << "' does not deactivate on failure; the reports were recorded and nothing changed";
  }
  group.evidence.clear();

  GroupView view = makeView(group);
  for (const PendingCall& sync : group.waiting_syncs) {
    effects->sends.push_back(
        {sync.session, SyncReply{sync.request_id, {SyncAfterFailureStatus::Reconciled, ""}, view}});
  }
  group.waiting_syncs.clear();
  advanceProposals(now, group, effects);
}

}  // namespace mooncake::pg::control
