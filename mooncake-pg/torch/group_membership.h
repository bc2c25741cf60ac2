// One group's elastic membership, as the torch backend sees it: its seat
// registration with the control plane, the views it receives, the live mask
// (get_active_ranks), the world size torch reports, and the data plane of the
// current active configuration.
//
// Modes (as in the reference): a founder starts Normal; a process joining an
// existing group (is_extension) starts Isolated, where collectives run on
// itself only and the world size is the declared one, until a view shows its
// seat Active. In Normal mode the world size is the highest active seat + 1.
//
// Views arrive on the Agent's thread: the mask, epoch and world size change
// at once, user P2P lanes are reopened for the new active set, and lanes to
// seats the view deactivated are closed (in both channels), so that nothing
// waits for a rank the membership gave up on. The
// collectives' plane is re-formed lazily, on the operation thread, when the
// next operation starts, so a view never changes a running operation.
//
// Cut off: once this process has lost the control plane (the Agent's
// connection closed or went silent), its view can no longer be trusted and
// the others go on without it. Its collectives and P2P then fail with the
// reason (a wait in an arena ends at once, naming this rank), instead of
// running on with a stale membership or waiting for a timeout.
#pragma once

#include <ATen/ATen.h>
#include <torch/csrc/distributed/c10d/Store.hpp>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "mooncake/pg/control_plane.h"
#include "mooncake/pg/data_plane.h"
#include "mooncake/pg/membership.h"
#include "mooncake/pg/p2p_channel.h"

namespace mooncake::pg {

struct MembershipConfig {
  std::string key;                // control-plane key of the group ("cpu:" + torch group name)
  int seat = 0;                   // this process's in-group rank
  int declared_size = 0;          // the size torch created the group with
  int max_group_size = 0;         // seats
  std::vector<int> rank_order;    // global rank per seat known at creation
  int global_rank = 0;
  bool is_extension = false;
  bool auto_deactivate = true;
  bool auto_sync = true;
  std::chrono::milliseconds timeout{300000};  // the group's timeout
  ShmGroupOptions shm;            // for the planes
  std::optional<at::Tensor> mirror;  // the user's active_ranks tensor, kept in sync
};

// The active configuration as the latest view has it.
struct ActiveConfig {
  bool isolated = false;     // a joiner before activation: it runs alone
  uint64_t active_epoch = 0;
  std::string uid;           // the group incarnation
  std::vector<int> active;   // ascending active seats
  bool one_host = false;     // every active seat runs on this seat's host
};

class GroupMembership {
 public:
  // Registers the seat (founders: waits until every founder has), with the
  // endpoints of the user P2P channel and the collectives' channel; forms the
  // first plane (founders) or the isolated one (joiners). Throws c10::Error.
  GroupMembership(const c10::intrusive_ptr<c10d::Store>& store, MembershipConfig config,
                  std::shared_ptr<P2pChannel> user_p2p, std::shared_ptr<P2pChannel> collectives);
  ~GroupMembership();

  int worldSize() const { return world_size_.load(std::memory_order_acquire); }
  int64_t epoch() const { return epoch_.load(std::memory_order_acquire); }
  int seats() const { return config_.max_group_size; }
  at::Tensor activeRanks() const { return mirror_; }
  bool isActive(int seat) const;
  // Any thread; computed when a view is applied (the CUDA plane asks on
  // every operation), so a call costs a shared_ptr copy.
  std::shared_ptr<const ActiveConfig> activeConfig() const;

  // On the operation thread: the collectives of the current configuration
  // (re-formed first when a view changed it), without the seats left out
  // after failures (below). Throws std::runtime_error when this seat is not
  // active (deactivated: join_group to come back).
  Collectives& plane();
  // After a collective failed because of `seats`: until the active set
  // changes, this rank's collectives leave them out (the survivors, which
  // all saw the same failure, meet in a plane without them). So a failed
  // collective can be run again over the survivors even when the view does
  // not change (auto-deactivation off). False when this seat is left out.
  bool leaveOut(const std::vector<int>& seats);
  // The seats of the current plane (operation thread; empty before the first).
  std::vector<int> planeSeats() const { return plane_ ? plane_->active() : std::vector<int>{}; }
  // On the operation thread, after an operation failed: reports the ranks it
  // saw fail; with auto-sync, waits for the reconciled view and applies it,
  // so that the Work completes with the new mask in place.
  void afterFailure(const OpResult& failure);

  // Module functions.
  void joinGroup();
  ProposeViewUpdateResponse propose(bool activate, const std::vector<int>& ranks);
  SyncAfterFailureResponse syncAfterFailure();
  bool peerState(int rank) const;
  int numSyncedRanks() const;
  // destroy_process_group: leaves the seat (the others get a view without it).
  void leave();
  // The group is going away: leaves, and drops the plane and the channels
  // (their pending messages fail). Only once the operation thread stopped.
  void shutdown();

 private:
  void onView(const GroupView& view);  // the Agent's thread
  void onControlLost(const std::string& why);  // the Agent's heartbeat thread
  // "" while connected, else why this process is cut off from the group.
  std::string cutOff() const;
  void applyView(const GroupView& view);
  // Link evidence for activations (control_plane.h): probes the endpoints of
  // the seats this process may soon work with (joining seats; the active
  // ones too while this seat is joining), once per seat and endpoint, and
  // reports them. Under lanes_mutex_.
  void probeLinks(const GroupView& view);
  GroupView latestView() const;
  uint64_t activeEpoch() const;  // the latest view's, without copying the view
  std::string endpointText() const;
  static bool decodeEndpoints(const std::string& text, P2pEndpoint& user, P2pEndpoint& collectives);

  MembershipConfig config_;
  Agent* agent_ = nullptr;
  std::shared_ptr<P2pChannel> user_p2p_;
  std::shared_ptr<P2pChannel> collectives_channel_;
  at::Tensor mirror_;  // int32[max_group_size]: the user's tensor (CPU or CUDA) or our own (CPU)
  // Where views write the mask: mirror_ itself on the CPU; for a CUDA mirror,
  // a pinned host copy whose values are then copied to the device.
  at::Tensor mask_host_;
  void publishMask();  // under mutex_
  // Waits, up to the group's timeout, until the latest view's active
  // configuration is no longer `active_epoch`: true when it moved, false
  // when the wait ran out or this rank was cut off.
  bool awaitViewAfter(uint64_t active_epoch) const;

  mutable std::mutex mutex_;  // guards view_ and p2p_epoch_
  GroupView view_;            // the latest view
  // Told when view_ moves or this rank is cut off (awaitViewAfter).
  mutable std::condition_variable view_moved_;
  std::shared_ptr<const ActiveConfig> active_config_;  // of view_ (isolated: see activeConfig)
  uint64_t p2p_epoch_ = 0;    // active configuration the user P2P lanes were last checked for
  std::mutex lanes_mutex_;  // guards opened_endpoints_ (views are applied on two threads)
  std::vector<std::string> opened_endpoints_;  // per seat: the endpoint its user P2P lanes were opened with
  std::vector<std::string> probed_endpoints_;  // per seat: the endpoint probed for the pending activation
  std::atomic<int> world_size_{0};
  std::atomic<int64_t> epoch_{0};
  std::atomic<bool> isolated_{false};
  bool left_ = false;
  std::atomic<bool> cut_off_{false};
  std::string cut_off_reason_;  // guarded by mutex_, set before cut_off_

  // Operation thread only.
  std::unique_ptr<MemberCollectives> plane_;
  std::string plane_key_;              // the configuration plane_ was formed for ("" = none)
  uint64_t left_out_epoch_ = 0;        // active configuration left_out_ applies to
  std::vector<int> left_out_;          // ascending seats left out after failures
};

}  // namespace mooncake::pg
