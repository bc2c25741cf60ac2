// joinGroup, and proposals (activate/deactivate) with their acknowledgement
// barrier: FIFO per group, at most one barrier in flight.
#include <algorithm>
#include <set>

#include "control/coordinator_state.h"
#include "mooncake/te/log.h"

namespace mooncake::pg::control {

void CoordinatorState::handleJoin(TimePoint now, SessionId session, const JoinRequest& request, Effects* effects) {
  PendingCall call{session, request.request_id};
  Group* group = nullptr;
  int seat = -1;
  std::string refusal = findMembership(request.key, session, &group, &seat);
  if (!refusal.empty()) return reply(effects, call, refusal);
  Seat& joining = group->seats[seat];
  if (joining.state == MemberState::kInactive) {
    joining.state = MemberState::kAwaitingActivation;
    forgetLinks(*group, seat);  // its links are probed anew for this join
    publish(*group, effects);  // before the answer: the joiner sees itself AwaitingActivation first
    reply(effects, call, "");
    advanceProposals(now, *group, effects);  // an activation may have waited for it
    return;
  }
  // Already waiting or already Active: nothing to change (the Agent then
  // waits for, or already has, a view with the seat Active).
  reply(effects, call, "");
}

void CoordinatorState::handlePropose(TimePoint now, SessionId session, const ProposeRequest& request,
                                     Effects* effects) {
  Group* group = nullptr;
  int proposer = -1;
  std::string refusal = findMembership(request.key, session, &group, &proposer);
  auto reject = [&](const std::string& why) {
    ProposeViewUpdateResponse response;
    response.status = ProposalStatus::Rejected;
    response.new_epoch = group == nullptr ? 0 : static_cast<int64_t>(group->epoch);
    response.reject_reason = why;
    MC_LOG(Warning) << "control plane: proposal rejected: " << why;
    effects->sends.push_back({session, ProposeReply{request.request_id, response}});
  };
  if (!refusal.empty()) return reject(refusal);

  std::vector<int> outside, unregistered, left;
  std::set<int> seats;
  for (int seat : request.ranks) {
    if (seat < 0 || seat >= group->max_group_size) {
      outside.push_back(seat);
    } else if (group->seats[seat].state == MemberState::kNone) {
      unregistered.push_back(seat);
    } else if (group->seats[seat].state == MemberState::kLeft) {
      left.push_back(seat);
    } else {
      seats.insert(seat);
    }
  }
  if (!outside.empty() || !unregistered.empty() || !left.empty()) {
    std::string why = std::string(request.activate ? "activation" : "deactivation") +
                      " names invalid seats of group '" + request.key + "':";
    if (!outside.empty())
      why += " " + listText(outside) + " outside [0, " + std::to_string(group->max_group_size) + ")";
    if (!unregistered.empty()) why += " " + listText(unregistered) + " never registered";
    if (!left.empty()) why += " " + listText(left) + " left the group";
    return reject(why);
  }
  group->proposals.push_back({{session, request.request_id},
                              request.activate,
                              {seats.begin(), seats.end()},
                              now + options_.request_timeout,
                              /*evidence_deadline=*/std::nullopt});
  advanceProposals(now, *group, effects);
}

void CoordinatorState::advanceProposals(TimePoint now, Group& group, Effects* effects) {
  auto answer = [&](const PendingCall& caller, ProposalStatus status, std::vector<int> dropped, std::string why) {
    ProposeViewUpdateResponse response;
    response.status = status;
    response.new_epoch = static_cast<int64_t>(group.epoch);
    response.dropped_ranks = std::move(dropped);
    response.reject_reason = std::move(why);
    effects->sends.push_back({caller.session, ProposeReply{caller.request_id, std::move(response)}});
  };
  for (;;) {
    if (group.barrier) {
      if (!group.barrier->waiting.empty()) return;
      Barrier done = std::move(*group.barrier);
      group.barrier.reset();
      std::vector<int> dropped(done.dropped.begin(), done.dropped.end());
      answer(done.caller, dropped.empty() ? ProposalStatus::Applied : ProposalStatus::AppliedWithDroppedRanks, dropped,
             "");
      continue;
    }
    if (group.proposals.empty()) return;

    Proposal& proposal = group.proposals.front();
    std::vector<int> changing;
    std::vector<int> not_ready;  // activation targets not yet AwaitingActivation, online and with an endpoint
    for (int seat : proposal.seats) {
      const Seat& target = group.seats[seat];
      if (proposal.activate && target.state != MemberState::kActive) {
        changing.push_back(seat);
        if (target.state != MemberState::kAwaitingActivation || !isOnline(target.holder) || target.endpoint.empty()) {
          not_ready.push_back(seat);
        }
      } else if (!proposal.activate && target.state == MemberState::kActive) {
        changing.push_back(seat);
      }
    }
    if (changing.empty()) {
      answer(proposal.caller, ProposalStatus::Applied, {}, "");
      group.proposals.pop_front();
      continue;
    }
    if (now >= proposal.admission_deadline) {
      std::string why = "proposal for group '" + group.key + "' not admitted within request_timeout (" +
                        millisecondsText(options_.request_timeout) + ")";
      if (!not_ready.empty()) {
        why += ": seats " + listText(not_ready) + " are not AwaitingActivation, online and with an endpoint (";
        for (size_t i = 0; i < not_ready.size(); ++i) {
          const Seat& seat = group.seats[not_ready[i]];
          why += (i == 0 ? "" : ", ") + std::to_string(not_ready[i]) + " is " + memberStateName(seat.state) +
                 (isOnline(seat.holder) ? "" : ", offline") + (seat.endpoint.empty() ? ", without an endpoint" : "");
        }
        why += ")";
      } else {
        why += ": it was queued behind other proposals";
      }
      MC_LOG(Warning) << "control plane: " << why;
      answer(proposal.caller, ProposalStatus::Rejected, {}, why);
      group.proposals.pop_front();
      continue;
    }
    if (!not_ready.empty()) return;  // an activation waits for its targets to join
    if (proposal.activate) {
      // The resulting active set must be connected both ways: refused at
      // once on a link reported unreachable, and after link_timeout when
      // evidence is still missing; meanwhile it waits for the reports.
      std::set<int> future(changing.begin(), changing.end());
      for (size_t seat = 0; seat < group.seats.size(); ++seat) {
        if (group.seats[seat].state == MemberState::kActive) future.insert(static_cast<int>(seat));
      }
      LinkGaps gaps = linkGaps(group, changing, {future.begin(), future.end()});
      std::string why;
      if (!gaps.unreachable.empty()) {
        why = "activation of seats " + listText(changing) + " of group '" + group.key +
              "' refused: the resulting active set would not be connected both ways (unreachable: " +
              linksText(gaps.unreachable) + ")";
      } else if (!gaps.missing.empty()) {
        if (!proposal.evidence_deadline) proposal.evidence_deadline = now + options_.link_timeout;
        if (now < *proposal.evidence_deadline) return;
        why = "activation of seats " + listText(changing) + " of group '" + group.key + "' refused: no link evidence within link_timeout (" +
              millisecondsText(options_.link_timeout) + ") for " + linksText(gaps.missing);
      }
      if (!why.empty()) {
        for (int seat : changing) {
          const Seat& target = group.seats[seat];
          why += "; seat " + std::to_string(seat) + " (global rank " + std::to_string(target.global_rank) + ") is " +
                 rankStateName(rankState(target.global_rank));
        }
        MC_LOG(Warning) << "control plane: " << why;
        answer(proposal.caller, ProposalStatus::Rejected, {}, why);
        group.proposals.pop_front();
        continue;
      }
    }

    // Admit: one new view, then wait for the processes of the old and new
    // active sets to acknowledge it.
    std::set<int> involved(changing.begin(), changing.end());
    for (size_t seat = 0; seat < group.seats.size(); ++seat) {
      if (group.seats[seat].state == MemberState::kActive) involved.insert(static_cast<int>(seat));
    }
    for (int seat : changing)
      group.seats[seat].state = proposal.activate ? MemberState::kActive : MemberState::kInactive;
    publish(group, effects);
    Barrier barrier;
    barrier.caller = proposal.caller;
    barrier.epoch = group.epoch;
    barrier.deadline = now + options_.ack_timeout;
    for (int seat : involved) {
      SessionId holder = group.seats[seat].holder;
      if (isOnline(holder)) barrier.waiting[holder] = seat;
    }
    MC_LOG(Info) << "control plane: group '" << group.key << "' epoch " << group.epoch << ": "
                 << (proposal.activate ? "activated" : "deactivated") << " seats " << listText(changing);
    group.barrier = std::move(barrier);
    group.proposals.pop_front();
  }
}

void CoordinatorState::dropLaggards(TimePoint now, Group& group, Effects* effects) {
  const uint64_t epoch = group.barrier->epoch;
  std::vector<SessionId> laggards;
  for (const auto& entry : group.barrier->waiting) laggards.push_back(entry.first);
  goOffline(now, laggards,
            "did not acknowledge epoch " + std::to_string(epoch) + " of group '" + group.key +
                "' within ack_timeout (" + millisecondsText(options_.ack_timeout) + ")",
            effects);
  // goOffline took them out of the barrier and finished it (possibly
  // starting the next one). Should this barrier still wait (for a session
  // already gone), end it here rather than wake up for it forever.
  if (group.barrier && group.barrier->epoch == epoch && !group.barrier->waiting.empty()) {
    for (const auto& entry : group.barrier->waiting) group.barrier->dropped.insert(entry.second);
    group.barrier->waiting.clear();
    advanceProposals(now, group, effects);
  }
}

}  // namespace mooncake::pg::control
