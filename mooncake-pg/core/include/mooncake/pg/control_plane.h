// The control plane of elastic groups: one Coordinator (in the process of
// global rank 0) and one Agent per process, over plain TCP. The Coordinator
// owns membership: which processes are alive, which in-group ranks (seats)
// of each group are active, and the epoch of each group's view. Agents
// register their process and groups, report failure evidence from the data
// plane, make proposals, and receive the views the Coordinator pushes.
//
// Liveness: each Agent keeps one connection to the Coordinator and sends a
// heartbeat every heartbeat_interval. A closed connection (a killed process:
// the kernel closes its sockets) marks the process offline at once; silence
// for heartbeat_timeout (a stalled or partitioned process) marks it offline
// at the deadline. Offline processes lose their Active (and
// AwaitingActivation) seats in every group that deactivates on failure, in
// one new view per group. The Coordinator heartbeats every Agent too: an
// Agent that hears nothing for heartbeat_timeout (while its listener is not
// running) drops the connection, and its pending and later calls fail.
//
// Link evidence: a process registered with reports_links probes the
// data-plane endpoints of the seats it may have to work with (every seat
// that is joining, and a joining seat probes the active ones) and reports
// which it reached (reportLinks). An activation is admitted only when every
// target is AwaitingActivation, online, has published an endpoint, and is
// connected both ways with every other seat of the resulting active set
// (each side of each pair that reports links has reached the other; pairs
// of seats already active are vouched for by their working data plane). A
// pair reported unreachable rejects the activation at once, with the
// reason; evidence still missing after link_timeout rejects it too.
// Evidence about a seat is forgotten when its process or endpoint changes
// and when it asks to join again. Processes are Offline (not connected),
// Synced (connected and heartbeating) or Healthy (Synced, and connected
// both ways with the active seats of every group where it reports links).
//
// Seats and views: a group has max_group_size seats, fixed at creation and
// never renumbered. A view is the state of every seat plus an epoch that
// only increases; every change of any seat's state, endpoint, host or online
// flag gives a new epoch. While founders register the epoch is 0 and nothing
// is pushed; the founding view has epoch 1. Views are pushed to every online
// process that holds an Active, Inactive or AwaitingActivation seat of the
// group, and acknowledged after the listener returns.
//
// Coordinator failover: every process may host a standby coordinator,
// listening from the start; its address travels in the Agent's Hello and the
// coordinator tells every Agent the ordered candidates (Standbys: the
// lowest 8 online processes with a standby, by global rank, without the
// coordinator's own process; told again to everyone only when they change).
// An Agent that loses the coordinator (closed, or silent for
// heartbeat_timeout) does not give up at once: it tries the candidates of
// the last list in order; when its own process's turn comes, it has its
// standby take over and connects to it. Each attempt is bounded (connect,
// then failover_timeout + heartbeat_timeout for the answer). The successor
// waits up to failover_timeout for the processes of its last list, and
// every process the rejoined views show online, to rejoin (each sends its
// registrations and newest views), continues every group's epochs above the
// highest reported, keeps its uid, and treats every process that did not
// rejoin (the old coordinator's first) as gone: their seats go through the
// normal failure path (Inactive where the group deactivates on failure), in
// one new view per group. A successor that does not hear from a strict
// majority of the processes it waited for refuses everyone: a process cut off alone cannot
// found a membership of its own. Calls in flight when the connection broke
// fail (syncAfterFailure is sent again to the successor); calls made during
// the failover wait for it. Only when no candidate takes the Agent back is
// the loss final (LossListener). A process cut off by the test hook
// (test_faults.h) never fails over. Limits: the successor and the old
// coordinator lost together leaves the next candidate to take over only after
// the successor's attempt timed out; registrations, proposals and joins in
// flight are lost with the old coordinator.
//
// The data plane stays out of here: endpoints are opaque strings that the
// data plane publishes and reads back from views.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "mooncake/pg/membership.h"

namespace mooncake::pg {

// The state of a process, as in the reference (see "Link evidence" above).
enum class RankState : uint8_t { kOffline = 0, kSynced = 1, kHealthy = 2 };

// The state of one seat (in-group rank), as in the reference.
enum class MemberState : uint8_t { kNone = 0, kInactive = 1, kAwaitingActivation = 2, kActive = 3, kLeft = 4 };

struct GroupView {
  std::string key;    // the group's key (as registered)
  std::string uid;    // unique per group incarnation: data-plane resources are named after it
  uint64_t epoch = 0;
  // The epoch of the last view that changed the active set or the endpoint
  // of an active seat. Data planes are formed per active configuration and
  // named after it, so every process derives the same one from whichever
  // later view it happens to apply.
  uint64_t active_epoch = 0;
  // One entry per seat (max_group_size entries each).
  std::vector<MemberState> members;
  std::vector<int> global_ranks;       // the process holding the seat, -1 for none
  std::vector<std::string> endpoints;  // what that process published for this group ("" = none)
  std::vector<std::string> hosts;      // its host identity ("" = none)
  std::vector<bool> online;            // whether that process is connected and heartbeating

  bool isActive(int rank) const { return members[rank] == MemberState::kActive; }
  std::vector<int> activeRanks() const;
};

// Proposals answer with ProposeViewUpdateResponse (membership.h): status,
// new_epoch, dropped_ranks (seats that did not acknowledge the new view in
// time), reject_reason.
struct SyncResult {
  SyncAfterFailureResponse response;
  GroupView view;  // the view after reconciliation (already given to the group's listener)
};

struct ControlOptions {
  std::chrono::milliseconds heartbeat_interval{100};
  std::chrono::milliseconds heartbeat_timeout{1000};
  // After the first failure evidence of a group, how long to collect more
  // before deciding (several ranks failing together give one new view).
  std::chrono::milliseconds reconciliation_window{100};
  std::chrono::milliseconds ack_timeout{2000};      // for acknowledgements of a pushed view
  std::chrono::milliseconds request_timeout{30000};  // bootstrap, admission of proposals, RPCs
  // How long an activation whose targets are ready waits for the link
  // evidence it still lacks before it is rejected.
  std::chrono::milliseconds link_timeout{5000};
  // Failover (see "Coordinator failover" above): how long a successor waits
  // for the processes of the last membership to rejoin it, and, plus
  // heartbeat_timeout, how long an Agent waits for one candidate's answer.
  std::chrono::milliseconds failover_timeout{1000};
  // Every connection between an Agent and a Coordinator opens with the
  // mutual challenge of te/auth_opening.h over this secret ("" = open).
  std::string secret;
};

class Coordinator {
 public:
  // Listens on `host`:0 (an ephemeral port) and serves at once. Null with
  // *error on failure.
  static std::unique_ptr<Coordinator> start(const std::string& host, const ControlOptions& options,
                                            std::string* error);
  // A standby in the process of `host_global_rank`: listens on `host`:0 now
  // (so its address can be handed out before any failure) but serves
  // nothing (connections wait in the backlog) until activate() or takeOver().
  static std::unique_ptr<Coordinator> standby(const std::string& host, const ControlOptions& options,
                                              int host_global_rank, std::string* error);
  virtual ~Coordinator() = default;
  virtual std::string address() const = 0;  // "host:port", what agents connect to
  // A standby starts serving as the job's first coordinator. Idempotent.
  virtual void activate() = 0;
  // A standby takes over from the lost coordinator in `lost_rank`'s process
  // (the Agent of its own process calls this when the failover order makes
  // it the successor): it waits up to failover_timeout for the `candidates`
  // (global ranks, its own included) and every process their views show
  // online (but `lost_rank`) to rejoin, then, if a strict majority of them
  // did, rebuilds the groups from what they report and serves; without a
  // majority it refuses everyone (this process is probably the one cut
  // off). Idempotent. `planned`: the lost coordinator said Goodbye (its
  // process ended normally), so the take-over is logged as routine.
  virtual void takeOver(const std::vector<int>& candidates, int lost_rank, bool planned) = 0;
  // This process ends normally: a serving coordinator tells every Agent
  // (Goodbye), so that they take over quietly instead of treating the end
  // of its process as a failure. Bounded (a few hundred ms); any thread.
  virtual void leave() = 0;
  virtual bool serving() const = 0;  // activated or taken over
  // Called once, on the caller's thread of takeOver, with this coordinator's
  // address and takeOver's `planned`.
  using TakeOverListener = std::function<void(const std::string& address, bool planned)>;
  virtual void onTakeOver(TakeOverListener listener) = 0;
};

struct GroupRegistration {
  std::string key;               // equal on every process for the same group (and its extensions)
  int rank = 0;                  // this process's seat
  int max_group_size = 0;        // seats
  std::vector<int> rank_order;   // the global rank of each seat this registration knows of (size <= max)
  bool is_extension = false;     // joining an existing group (its rank_order a prefix of ours), or taking
                                 // over a seat whose previous holder is gone
  bool auto_deactivate = true;   // the group deactivates offline/failed seats by itself
  std::string endpoint;          // this process's data-plane endpoint for the group
  std::string host;              // this process's host identity
  bool reports_links = false;    // this process reports link evidence for the group (reportLinks)
};

class Agent {
 public:
  // Connects this process (global rank `global_rank`) to the Coordinator at
  // `address`. A previous process of the same global rank must be offline
  // first; the Agent waits up to heartbeat_timeout for that, then fails.
  // `standby` (may be null; must outlive the Agent): this process's standby
  // coordinator, offered to the others as a candidate successor and taken
  // over by this Agent when the failover order names this process.
  static std::unique_ptr<Agent> connect(const std::string& address, int global_rank, const ControlOptions& options,
                                        std::string* error, Coordinator* standby = nullptr);
  virtual ~Agent() = default;  // disconnects: the Coordinator sees the process leave
  // This process ends normally (its exit, not a failure): tells the
  // Coordinator (Goodbye), which then logs its disconnection as a leave;
  // this Agent's own losses are no alarm from now on. Its seats are lost as
  // on any disconnection. Bounded by the send timeout; any thread.
  virtual void leave() = 0;
  // The candidate successor that takes over first if the coordinator's
  // process ends now (the head of the last announced list): false when none
  // was announced. A coordinator that leaves names it where later processes
  // look for the coordinator, while the place (a store in its own process,
  // often) still answers.
  virtual bool firstSuccessor(int* global_rank, std::string* address) const = 0;

  using ViewListener = std::function<void(const GroupView&)>;

  // Founders (is_extension false): returns the founding view once every seat
  // of rank_order has registered (all Active), or fails within
  // request_timeout, and at once when a founder goes offline meanwhile. A
  // group that failed to form is remembered: later founders of the key fail
  // at once. A founder registration of an already formed group with the
  // same rank_order and max_group_size attaches like an extension.
  // Extension: returns the current view at once, this seat Inactive. Every
  // later view of the group goes to `on_view` (on the Agent's thread; the
  // acknowledgement is sent when it returns). Returns false with *error.
  //
  // The listener gets views in epoch order, never a stale one, and never
  // while the Agent holds a lock. It may run before registerGroup returns
  // (with a view newer than the founding one; *view is then that newer
  // view). It must not wait on this Agent: registerGroup, syncAfterFailure,
  // joinGroup and propose fail at once when called from it, and
  // unregisterGroup does not wait there.
  virtual bool registerGroup(const GroupRegistration& registration, ViewListener on_view, GroupView* view,
                             std::string* error) = 0;
  // Leaves the seat (Left). If it was Active, the others get a view without it.
  // On return the group's listener is not running and is not called again.
  virtual void unregisterGroup(const std::string& key) = 0;

  // Failure evidence from the data plane: these seats failed an operation
  // with this process. Returns at once. The first evidence opens the group's
  // reconciliation window (never extended); when it closes, in a group with
  // auto_deactivate: Active seats whose process is offline, and reported
  // seats with at least one reporter that is Active and not reported itself,
  // become Inactive; if every reporter is also reported (mutual), only the
  // highest such seat does. Without auto_deactivate nothing changes.
  virtual void reportFailure(const std::string& key, const std::vector<int>& ranks) = 0;
  // Reports `ranks` (may be empty) and waits for any open reconciliation of
  // the group; the resulting view has been given to the listener on return.
  virtual SyncResult syncAfterFailure(const std::string& key, const std::vector<int>& ranks) = 0;

  // Link evidence (see above): this process probed the data-plane endpoints
  // of these seats and reached `reached`, not `unreached`. Returns at once;
  // a later report about a seat replaces an earlier one.
  virtual void reportLinks(const std::string& key, const std::vector<int>& reached,
                           const std::vector<int>& unreached) = 0;

  // join_group: this seat becomes AwaitingActivation; returns once a view
  // with it Active has been given to the listener, or fails at the deadline.
  // An already Active seat returns true at once.
  virtual bool joinGroup(const std::string& key, std::chrono::milliseconds deadline, std::string* error) = 0;
  // activate_ranks / deactivate_ranks. Activation waits (up to
  // request_timeout) until every target is AwaitingActivation, online and
  // has an endpoint, then (up to link_timeout) for link evidence.
  // Returns after the new view was acknowledged by the online processes of
  // the old and new active sets (or they were dropped: offline, and listed
  // in dropped_ranks). new_epoch is the group's epoch when the answer is
  // sent, and this Agent already has that view. Proposals of a group are
  // served one at a time in arrival order; one not admitted within
  // request_timeout is Rejected. Invalid seats are Rejected with a reason.
  virtual ProposeViewUpdateResponse propose(const std::string& key, bool activate, const std::vector<int>& ranks) = 0;

  // Called once when the connection to the Coordinator is lost (closed, or
  // silent for heartbeat_timeout), never when the Agent is destroyed: from
  // then on this process is cut off from the membership (its views are
  // stale, its calls fail, and the Coordinator deactivates its seats). Runs
  // on the Agent's heartbeat thread, or here at once when the loss was
  // already told. Replaces the group's previous loss listener; gone with
  // unregisterGroup, which waits for a running one (except from inside it).
  using LossListener = std::function<void(const std::string& why)>;
  virtual void onConnectionLost(const std::string& key, LossListener listener) = 0;

  // The latest view this Agent has of the group (no communication).
  virtual GroupView view(const std::string& key) const = 0;
};

}  // namespace mooncake::pg
