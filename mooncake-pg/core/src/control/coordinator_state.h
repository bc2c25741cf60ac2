// The Coordinator's membership state machine, without sockets or threads:
// inputs are connection events, decoded messages and the passing of time;
// outputs (Effects) are messages to send and connections to close. The
// Coordinator's poll loop feeds it; tests can drive it directly.
//
// Numbering and pushes (what control_plane.h leaves open):
//  - A group is Bootstrapping until every founder seat of its rank_order has
//    registered. Meanwhile its epoch is 0 and nothing is pushed; the last
//    registration makes it Ready at epoch 1, and every founder receives that
//    view as the answer to its registration (not through its listener).
//  - After that, each change of the group (seat states, endpoints, hosts,
//    online flags) is one new epoch, pushed to every online process holding
//    an Active, Inactive or AwaitingActivation seat, except the registering
//    process of an extension, which receives it as its answer instead.
//  - A failed bootstrap (a founder offline or gone, or request_timeout since
//    the first registration) answers every waiting founder with the reason
//    and is remembered: later founders of that key fail at once.
//  - A group whose seats are all None or Left is forgotten; its key can be
//    founded again (with a new uid).
#pragma once

#include <cstdint>
#include <deque>
#include <map>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "control/clock.h"
#include "control/protocol.h"
#include "control/text.h"
#include "mooncake/te/log.h"

namespace mooncake::pg::control {

using SessionId = uint64_t;  // one per connection, never reused

struct Outgoing {
  SessionId to = 0;
  Message message;
};

struct Effects {
  std::vector<Outgoing> sends;         // in order; those to closed sessions are dropped
  std::vector<SessionId> disconnects;  // close, after one attempt to send what was queued for them
};

class CoordinatorState {
 public:
  // incarnation: distinguishes this Coordinator's group uids from those of
  // any other Coordinator (e.g. a random number).
  CoordinatorState(const ControlOptions& options, std::string incarnation);

  void onConnected(TimePoint now, SessionId session);
  void onMessage(TimePoint now, SessionId session, Message message, Effects* effects);
  // The connection ended (end of stream, error, malformed input).
  void onDisconnected(TimePoint now, SessionId session, const std::string& why, Effects* effects);
  // Handles every deadline that has passed.
  void onTimer(TimePoint now, Effects* effects);
  // The earliest pending deadline, TimePoint::max() for none.
  TimePoint nextDeadline() const;
  // The state of the process of `global_rank` (control_plane.h, "Link evidence").
  RankState rankState(int global_rank) const;

  // Failover (control_plane.h, "Coordinator failover").
  // The global rank of the process hosting this coordinator: left out of the
  // candidate successors told to the Agents (-1: unknown).
  void setHostRank(int global_rank) { host_rank_ = global_rank; }
  // This coordinator takes over from the lost one of `lost_rank`'s process.
  // The processes expected to rejoin are the `candidates` and every process
  // a rejoined view shows online (but `lost_rank`). Until they all have
  // rejoined (Hello with resume, then its Rejoins), or failover_timeout has
  // passed, nothing else is served; then, with a strict majority of them,
  // the groups are rebuilt from what they reported and every rejoined
  // process is accepted; without, everyone is refused, now and later.
  // `planned`: the lost one ended normally (Goodbye): logged at Info.
  void beginTakeOver(TimePoint now, const std::vector<int>& candidates, int lost_rank, bool planned = false);
 private:
  struct Session {
    int global_rank = -1;   // set by Hello
    bool accepted = false;  // Hello answered with success: the process is online
    // Before acceptance: when to give up on it; after: last sign of life.
    TimePoint deadline;
    TimePoint last_seen;
    std::map<std::string, uint64_t> acked_epochs;  // group key -> newest acknowledged epoch
    std::string standby;                           // its standby coordinator ("" = none)
    bool leaving = false;  // it said Goodbye: its end is a normal exit, not a failure
    // A rejoining process (Hello with resume): the Rejoins it announced, and
    // those received so far.
    bool resume = false;
    uint32_t rejoins_expected = 0;
    std::vector<Rejoin> rejoins;
  };

  struct Seat {
    MemberState state = MemberState::kNone;
    int global_rank = -1;  // from the group's rank_order, -1 beyond it
    SessionId holder = 0;  // the process that registered it (0: none)
    std::string endpoint;
    std::string host;
    SessionId left_by = 0;  // the process that left it (Left): its founder registration is a re-init
    bool reports_links = false;
    std::map<int, bool> links;  // this seat's link evidence: peer seat -> reached
  };

  struct PendingCall {
    SessionId session = 0;
    RequestId request_id = 0;
  };

  struct Proposal {
    PendingCall caller;
    bool activate = false;
    std::vector<int> seats;  // sorted, unique, all registered
    TimePoint admission_deadline;
    std::optional<TimePoint> evidence_deadline;  // set once its targets are ready but link evidence is missing
  };

  struct Barrier {
    PendingCall caller;
    uint64_t epoch = 0;
    TimePoint deadline;
    std::map<SessionId, int> waiting;  // processes yet to acknowledge -> their seat
    std::set<int> dropped;
  };

  struct Group {
    std::string key;
    std::string uid;
    int max_group_size = 0;
    std::vector<int> rank_order;
    bool auto_deactivate = true;
    bool ready = false;
    uint64_t epoch = 0;
    // The epoch at which the active configuration (active seats and their
    // endpoints) last changed, and that configuration, to tell changes.
    uint64_t active_epoch = 0;
    std::string active_configuration;
    std::vector<Seat> seats;
    // Bootstrapping
    TimePoint bootstrap_deadline;
    std::vector<PendingCall> waiting_founders;
    // Failure evidence and its reconciliation window
    std::map<int, std::set<int>> evidence;  // reporter seat -> reported seats
    std::optional<TimePoint> window_closes;
    std::vector<PendingCall> waiting_syncs;
    // Proposals: FIFO, at most one barrier in flight
    std::deque<Proposal> proposals;
    std::optional<Barrier> barrier;
  };

  // Sessions and liveness (coordinator_state.cpp)
  bool isOnline(SessionId session) const;
  Session* acceptedSession(SessionId session);
  void handleHello(TimePoint now, SessionId session, const Hello& hello, Effects* effects);
  // Accepts the session: it counts online and gets its answer.
  void admit(TimePoint now, SessionId session, Effects* effects);
  // admit(), then the session learns the standby candidates.
  void accept(TimePoint now, SessionId session, Effects* effects);
  // The processes of these sessions are offline: their connections close,
  // their seats go Inactive in groups that deactivate on failure, and each
  // group they hold seats of gets one new view.
  void goOffline(TimePoint now, const std::vector<SessionId>& sessions, const std::string& why, Effects* effects);
  // A seat whose process is gone: Inactive when the group deactivates on
  // failure and the seat was Active or awaiting activation. True when it was
  // one of those (a loss worth naming).
  static bool loseSeat(const Group& group, Seat& seat);
  void handleAck(TimePoint now, SessionId session, const ViewAck& ack, Effects* effects);

  // Views (coordinator_state.cpp)
  GroupView makeView(const Group& group) const;
  // A new epoch of the group, pushed to its online seat holders but `skip`.
  void publish(Group& group, Effects* effects, SessionId skip = 0);
  // Moves active_epoch to the current epoch when the active configuration changed.
  static void noteActiveConfiguration(Group& group);
  int seatOf(const Group& group, SessionId session) const;
  Group* findGroup(const std::string& key);
  // "" when `session` holds a seat of the formed group `key` (then *group
  // and *seat are set), else why not.
  std::string findMembership(const std::string& key, SessionId session, Group** group, int* seat);
  static void reply(Effects* effects, const PendingCall& call, std::string error,
                    std::optional<GroupView> view = std::nullopt);

  // The candidate successors, to every accepted session (or only `to`).
  void tellStandbys(Effects* effects, SessionId to = 0);
  // Failover (coordinator_takeover.cpp)
  void handleResumeHello(TimePoint now, SessionId session, const Hello& hello, Effects* effects);
  void handleRejoin(TimePoint now, SessionId session, const Rejoin& rejoin, Effects* effects);
  // Ends the take-over when every expected process rejoined or `deadline_passed`.
  void finishTakeOver(TimePoint now, bool deadline_passed, Effects* effects);
  // `level`: of its log lines (Info after a planned take-over).
  void rebuildGroups(const std::vector<SessionId>& rejoined, Effects* effects, ::mooncake::log::Level level);

  // Registration (coordinator_registration.cpp)
  void handleRegister(TimePoint now, SessionId session, const RegisterGroupRequest& request, Effects* effects,
                      std::optional<TimePoint> waiting_since_deadline = std::nullopt);
  // Whether the registration must wait (see WaitingRegistration).
  bool mustWait(SessionId session, const GroupRegistration& registration);
  std::string registerFounder(TimePoint now, SessionId session, const RegisterGroupRequest& request, Effects* effects);
  std::string attachSeat(SessionId session, const RegisterGroupRequest& request, Effects* effects);
  void failBootstrap(const std::string& key, const std::string& reason, Effects* effects);
  // Tries the waiting registrations of `key` again (its group formed or was erased).
  void retryWaitingRegistrations(TimePoint now, const std::string& key, Effects* effects);
  // Refuses waiting registrations past their deadline, and those of failed bootstraps.
  void expireWaitingRegistrations(TimePoint now, Effects* effects);
  void handleUnregister(TimePoint now, SessionId session, const UnregisterGroupRequest& request, Effects* effects);
  // Drops what `session` waits for in the group (syncs, queued proposals,
  // its place in a barrier; `dropped`: count it as a laggard).
  void forgetCalls(Group& group, SessionId session, bool dropped);

  // Failure evidence (coordinator_failures.cpp)
  void handleReport(TimePoint now, SessionId session, const FailureReport& report);
  void handleSync(TimePoint now, SessionId session, const SyncRequest& request, Effects* effects);
  // Records evidence and opens the window; "" or why the reporter is refused.
  std::string recordEvidence(TimePoint now, SessionId session, const std::string& key,
                             const std::vector<int32_t>& ranks);
  void closeWindow(TimePoint now, Group& group, Effects* effects);

  // Link evidence (coordinator_links.cpp)
  void handleLinkReport(TimePoint now, SessionId session, const LinkReport& report, Effects* effects);
  // Forgets the evidence of and about `seat`: its process or endpoint
  // changed, or it asks to join again.
  static void forgetLinks(Group& group, int seat);
  // What keeps `targets` from being connected both ways with every other
  // seat of `future` (the resulting active set): directed links (from, to)
  // reported unreachable, and those nobody reported yet.
  struct LinkGaps {
    std::vector<std::pair<int, int>> unreachable;
    std::vector<std::pair<int, int>> missing;
  };
  static LinkGaps linkGaps(const Group& group, const std::vector<int>& targets, const std::vector<int>& future);
  static std::string linksText(const std::vector<std::pair<int, int>>& links);  // "3->0, 1->3"

  // Join and proposals (coordinator_proposals.cpp)
  void handleJoin(TimePoint now, SessionId session, const JoinRequest& request, Effects* effects);
  void handlePropose(TimePoint now, SessionId session, const ProposeRequest& request, Effects* effects);
  // Answers or admits queued proposals until one must wait.
  void advanceProposals(TimePoint now, Group& group, Effects* effects);
  void dropLaggards(TimePoint now, Group& group, Effects* effects);

  const ControlOptions options_;
  const std::string incarnation_;
  int host_rank_ = -1;
  struct Recovery {
    std::set<int> candidates;
    int lost_rank = -1;
    TimePoint deadline;
    bool planned = false;
  };
  // The candidates told last (at most kMaxCandidates): told again to
  // everyone only when they change.
  std::optional<Standbys> told_standbys_;
  std::optional<Recovery> recovery_;  // taking over, not serving yet
  std::string refuse_all_;            // a take-over without majority: why everyone is refused
  uint64_t groups_created_ = 0;
  std::map<SessionId, Session> sessions_;           // connected
  std::map<int, SessionId> online_by_global_rank_;  // accepted sessions
  std::map<std::string, Group> groups_;
  std::map<std::string, std::string> failed_bootstraps_;  // key -> why
  // Registrations that must wait, up to request_timeout: an extension that
  // arrived before its group was formed (a joiner started alongside the
  // founders), and a founder of a group it left that the others have not
  // left yet (destroy_process_group then init again: a new incarnation is
  // founded once the old one is deserted). Tried again when the group forms
  // or is erased.
  struct WaitingRegistration {
    SessionId session = 0;
    RegisterGroupRequest request;
    TimePoint deadline;
  };
  std::map<std::string, std::vector<WaitingRegistration>> waiting_registrations_;  // key -> waiting
};

}  // namespace mooncake::pg::control
