#include "group_membership.h"

#include <c10/util/Exception.h>
#include <c10/util/Logging.h>
#include <unistd.h>

#include <algorithm>
#include <stdexcept>

#include "control_runtime.h"
#ifdef MOONCAKE_PG_WITH_CUDA
#include "cuda/device_mask.h"
#endif
#include "mooncake/te/host_identity.h"

namespace mooncake::pg {
namespace {
// A live transfer engine answers a probe in well under a millisecond; one
// that does not answer in this long is taken as unreachable.
constexpr std::chrono::milliseconds kLinkProbeTimeout{500};

ActiveConfig activeConfigOf(const GroupView& view, int seat) {
  ActiveConfig config;
  config.active_epoch = view.active_epoch;
  config.uid = view.uid;
  if (view.members.empty()) return config;
  config.active = view.activeRanks();
  const std::string& mine = view.hosts[seat];
  config.one_host = std::all_of(config.active.begin(), config.active.end(),
                                [&](int s) { return view.hosts[s] == mine; });
  return config;
}

}  // namespace

GroupMembership::GroupMembership(const c10::intrusive_ptr<c10d::Store>& store, MembershipConfig config,
                                 std::shared_ptr<P2pChannel> user_p2p, std::shared_ptr<P2pChannel> collectives)
    : config_(std::move(config)), user_p2p_(std::move(user_p2p)), collectives_channel_(std::move(collectives)) {
  mirror_ = config_.mirror ? *config_.mirror : at::zeros({config_.max_group_size}, at::TensorOptions().dtype(at::kInt));
  mask_host_ = mirror_;
  if (!mirror_.device().is_cpu()) {
#ifdef MOONCAKE_PG_WITH_CUDA
    mask_host_ = at::zeros({mirror_.numel()}, at::TensorOptions().dtype(at::kInt).pinned_memory(true));
#else
    TORCH_CHECK_VALUE(false, "MooncakeBackendOptions: active_ranks is on ", mirror_.device(),
                      "; this build of mooncake has no CUDA support: pass a CPU tensor");
#endif
  }
  opened_endpoints_.resize(config_.max_group_size);
  probed_endpoints_.resize(config_.max_group_size);
  world_size_.store(config_.declared_size);
  // A joiner is isolated until a view shows its seat Active. Set before
  // registering: views may reach the listener before registerGroup returns.
  isolated_.store(config_.is_extension);
  agent_ = &controlAgent(store, config_.global_rank, config_.timeout);
  GroupRegistration registration;
  registration.key = config_.key;
  registration.rank = config_.seat;
  registration.max_group_size = config_.max_group_size;
  registration.rank_order = config_.rank_order;
  registration.is_extension = config_.is_extension;
  registration.auto_deactivate = config_.auto_deactivate;
  registration.endpoint = endpointText();
  registration.host = te::hostIdentity();
  registration.reports_links = user_p2p_ != nullptr || collectives_channel_ != nullptr;
  GroupView view;
  std::string error;
  bool ok = agent_->registerGroup(registration, [this](const GroupView& v) { onView(v); }, &view, &error);
  TORCH_CHECK(ok, "mooncake: rank ", config_.seat, " could not register group ", config_.key, ": ", error);
  agent_->onConnectionLost(config_.key, [this](const std::string& why) { onControlLost(why); });
  applyView(view);  // (a founder's seat is Active in it; a joiner's only after join_group)
  if (!isolated_.load()) plane();  // founders meet in the first plane now: errors surface at creation
}

GroupMembership::~GroupMembership() { shutdown(); }

void GroupMembership::shutdown() {
  leave();
  plane_.reset();
  std::shared_ptr<P2pChannel> user, collectives;
  {
    std::lock_guard lock(mutex_);
    user.swap(user_p2p_);
    collectives.swap(collectives_channel_);
  }
  // Destroyed here, outside the lock: their pending messages fail now.
}

std::string GroupMembership::endpointText() const {
  auto text = [](const std::shared_ptr<P2pChannel>& c) { return c ? c->localEndpoint().encode() : std::string("none"); };
  return text(user_p2p_) + "|" + text(collectives_channel_);
}

bool GroupMembership::decodeEndpoints(const std::string& text, P2pEndpoint& user, P2pEndpoint& collectives) {
  const size_t bar = text.find('|');
  if (bar == std::string::npos) return false;
  return P2pEndpoint::decode(text.substr(0, bar), user) && P2pEndpoint::decode(text.substr(bar + 1), collectives);
}

void GroupMembership::onView(const GroupView& view) {
  try {
    applyView(view);
  } catch (const std::exception& e) {  // never let an error escape into the Agent's thread
    LOG(WARNING) << "mooncake: group " << config_.key << ": applying view " << view.epoch << " failed: " << e.what();
  }
}

void GroupMembership::onControlLost(const std::string& why) {
  const std::string reason = "rank " + std::to_string(config_.seat) + " of group " + config_.key +
                             " lost the membership's control plane (" + why +
                             "): cut off, it takes part in nothing more, and the others go on without it";
  std::shared_ptr<P2pChannel> user, collectives;
  {
    std::lock_guard lock(mutex_);
    if (left_) return;
    cut_off_reason_ = reason;
    cut_off_.store(true, std::memory_order_release);
    user = user_p2p_;
    collectives = collectives_channel_;
  }
  view_moved_.notify_all();
  LOG(WARNING) << "mooncake: " << reason;
  // Pending messages fail now with the reason, naming this seat; the peers
  // are told where they can still be reached.
  for (const std::shared_ptr<P2pChannel>& channel : {user, collectives}) {
    if (channel) channel->abort(reason, {config_.seat});
  }
}

std::string GroupMembership::cutOff() const {
  if (!cut_off_.load(std::memory_order_acquire)) return {};
  std::lock_guard lock(mutex_);
  return cut_off_reason_;
}

void GroupMembership::applyView(const GroupView& view) {
  std::vector<std::pair<int, P2pEndpoint>> peers;  // active peers, for the user P2P lanes
  uint32_t lane_epoch = 0;
  std::shared_ptr<P2pChannel> channel;
  std::vector<int> deactivated;  // seats this view made inactive (not this one)
  std::vector<std::shared_ptr<P2pChannel>> channels;
  {
    std::lock_guard lock(mutex_);
    if (!view_.key.empty() && view.epoch <= view_.epoch) return;  // stale or repeated
    for (int s = 0; s < static_cast<int>(view_.members.size()) && s < static_cast<int>(view.members.size()); ++s) {
      if (s != config_.seat && view_.isActive(s) && !view.isActive(s)) deactivated.push_back(s);
    }
    if (!deactivated.empty()) channels = {user_p2p_, collectives_channel_};
    view_ = view;
    view_moved_.notify_all();
    active_config_ = std::make_shared<const ActiveConfig>(activeConfigOf(view_, config_.seat));
    int32_t* mask = mask_host_.data_ptr<int32_t>();
    int highest = -1;
    for (int s = 0; s < config_.max_group_size && s < static_cast<int>(view.members.size()); ++s) {
      mask[s] = view.isActive(s) ? 1 : 0;
      if (view.isActive(s)) highest = s;
    }
    publishMask();
    if (view.isActive(config_.seat)) isolated_.store(false);
    world_size_.store(isolated_.load() ? config_.declared_size : highest + 1, std::memory_order_release);
    epoch_.store(static_cast<int64_t>(view.epoch), std::memory_order_release);
    if (!isolated_.load() && view.isActive(config_.seat) && view.active_epoch != p2p_epoch_ && user_p2p_) {
      p2p_epoch_ = view.active_epoch;
      lane_epoch = static_cast<uint32_t>(view.active_epoch);
      channel = user_p2p_;
      for (int s : view.activeRanks()) {
        P2pEndpoint user, collectives;
        if (s != config_.seat && decodeEndpoints(view.endpoints[s], user, collectives)) peers.emplace_back(s, user);
      }
    }
  }
  // Whoever waits for a deactivated seat stops now, naming it: in an arena
  // through ShmGroupOptions::deactivated, in a channel here (a leader
  // waiting for another host's leader, a user's recv).
  std::lock_guard lanes_lock(lanes_mutex_);  // in order with the reopening below, on either thread
  for (int seat : deactivated) {
    if (isActive(seat)) continue;  // a newer view, applied meanwhile, activated it again
    const std::string why = "rank " + std::to_string(seat) + " was deactivated by the membership (epoch " +
                            std::to_string(view.epoch) + ")";
    for (const std::shared_ptr<P2pChannel>& c : channels) {
      if (c) c->close(seat, why);
    }
  }
  // User P2P lanes follow the active configuration, but only where they
  // must: lanes to a new process (another endpoint) and lanes closed by a
  // failure reopen at the configuration's epoch; healthy lanes between
  // surviving peers keep their messages flowing. (A peer that reopens tells
  // us, and our side follows: see P2pChannel::isOpen.)
  for (auto& [seat, endpoint] : peers) {
    const std::string text = endpoint.encode();
    if (opened_endpoints_[seat] != text || !channel->isOpen(seat)) {
      channel->reopen(seat, endpoint, lane_epoch);
      opened_endpoints_[seat] = text;
    }
  }
  probeLinks(view);
}

void GroupMembership::probeLinks(const GroupView& view) {
  std::shared_ptr<P2pChannel> prober;
  bool through_user_channel = false;
  {
    std::lock_guard lock(mutex_);
    through_user_channel = user_p2p_ != nullptr;
    prober = through_user_channel ? user_p2p_ : collectives_channel_;
  }
  if (!prober || cut_off_.load(std::memory_order_acquire)) return;
  const int seats = std::min(config_.max_group_size, static_cast<int>(view.members.size()));
  const MemberState mine = view.members[config_.seat];
  const bool joining = mine == MemberState::kAwaitingActivation;
  const bool member = joining || mine == MemberState::kActive;
  std::vector<int> reached, unreached;
  for (int s = 0; s < seats; ++s) {
    const MemberState state = view.members[s];
    const bool needed = s != config_.seat && view.online[s] && !view.endpoints[s].empty() &&
                        ((member && state == MemberState::kAwaitingActivation) ||
                         (joining && state == MemberState::kActive));
    if (!needed) {
      probed_endpoints_[s].clear();  // probed again when it (or this seat) joins again
      continue;
    }
    if (probed_endpoints_[s] == view.endpoints[s]) continue;  // already reported for this activation
    probed_endpoints_[s] = view.endpoints[s];
    P2pEndpoint user, collectives;
    const bool ok = decodeEndpoints(view.endpoints[s], user, collectives) &&
                    prober->reachable(through_user_channel ? user : collectives, kLinkProbeTimeout);
    (ok ? reached : unreached).push_back(s);
  }
  if (reached.empty() && unreached.empty()) return;
  if (!unreached.empty()) {
    std::string ranks;
    for (int s : unreached) ranks += (ranks.empty() ? "" : ", ") + std::to_string(s);
    LOG(WARNING) << "mooncake: group " << config_.key << ": rank " << config_.seat << " cannot reach the data-plane "
                 << "endpoints of ranks " << ranks << "; an activation involving them will be refused";
  }
  agent_->reportLinks(config_.key, reached, unreached);
}

void GroupMembership::publishMask() {
  if (mask_host_.is_same(mirror_)) return;  // a CPU mirror is written in place
#ifdef MOONCAKE_PG_WITH_CUDA
  copyMaskToDevice(mask_host_, mirror_);
#endif
}

GroupView GroupMembership::latestView() const {
  std::lock_guard lock(mutex_);
  return view_;
}

uint64_t GroupMembership::activeEpoch() const {
  std::lock_guard lock(mutex_);
  return view_.active_epoch;
}

bool GroupMembership::awaitViewAfter(uint64_t active_epoch) const {
  std::unique_lock lock(mutex_);
  view_moved_.wait_for(lock, config_.timeout,
                       [&] { return view_.active_epoch != active_epoch || cut_off_.load(std::memory_order_acquire); });
  return view_.active_epoch != active_epoch;
}

bool GroupMembership::isActive(int seat) const {
  std::lock_guard lock(mutex_);
  return seat >= 0 && seat < static_cast<int>(view_.members.size()) && view_.isActive(seat);
}

std::shared_ptr<const ActiveConfig> GroupMembership::activeConfig() const {
  if (isolated_.load()) {
    static const std::shared_ptr<const ActiveConfig> kIsolated = [] {
      ActiveConfig config;
      config.isolated = true;  // a joiner before activation runs alone
      return std::make_shared<const ActiveConfig>(config);
    }();
    return kIsolated;
  }
  std::lock_guard lock(mutex_);
  if (!active_config_) return std::make_shared<const ActiveConfig>();  // before the first view
  return active_config_;
}

Collectives& GroupMembership::plane() {
  if (std::string why = cutOff(); !why.empty()) throw std::runtime_error(why);
  if (isolated_.load()) {
    // Before activation a joiner's collectives involve itself only.
    if (!plane_ || plane_key_ != "isolated") {
      plane_.reset();
      std::string error;
      static std::atomic<int> counter{0};
      const std::string name = "/mooncake-pg-iso-" + std::to_string(::getpid()) + "-" + std::to_string(counter++);
      ShmGroupOptions shm = config_.shm;
      shm.rank_names = {config_.seat};
      std::unique_ptr<ShmGroup> alone = ShmGroup::open(name, 0, 1, shm, &error);
      if (!alone) throw std::runtime_error("cannot open this rank's local arena: " + error);
      plane_ = std::make_unique<MemberCollectives>(std::vector<int>{config_.seat}, config_.seat, std::move(alone));
      plane_key_ = "isolated";
    }
    return *plane_;
  }
  // Each pass forms the plane of the latest view; another pass only when
  // the view moved while forming (bounded by the membership's changes).
  for (;;) {
    GroupView view = latestView();
    if (!view.isActive(config_.seat)) {
      throw std::runtime_error("rank " + std::to_string(config_.seat) + " is not active in this group (epoch " +
                               std::to_string(view.epoch) + "); it was deactivated: call join_group to rejoin");
    }
    if (left_out_epoch_ != view.active_epoch) left_out_.clear();  // a new configuration decides anew
    std::vector<int> active;
    for (int s : view.activeRanks()) {
      if (!std::binary_search(left_out_.begin(), left_out_.end(), s)) active.push_back(s);
    }
    std::string variant;
    uint32_t lane_epoch = static_cast<uint32_t>(view.active_epoch);
    if (!left_out_.empty()) {
      // Every survivor names this plane alike: the epoch and the seats left out.
      uint32_t h = 2166136261u;
      for (int s : left_out_) {
        variant += "x" + std::to_string(s);
        h = (h ^ static_cast<uint32_t>(s)) * 16777619u;
      }
      lane_epoch = 0x80000000u | ((lane_epoch * 40503u) ^ h);
    }
    const std::string key = std::to_string(view.active_epoch) + variant;
    if (!plane_ || plane_key_ != key) {
      plane_.reset();  // leave the old arenas before meeting in the new ones
      plane_key_.clear();
      PlaneConfig pc;
      pc.uid = view.uid;
      pc.epoch = lane_epoch;
      pc.variant = variant;
      pc.my_seat = config_.seat;
      pc.active = active;
      pc.host_of_seat = view.hosts;
      pc.shm = config_.shm;
      pc.shm.deactivated = [this](int seat) { return !isActive(seat); };
      pc.shm.cut_off = [this] { return cutOff(); };
      pc.channel = collectives_channel_;
      pc.channel_endpoints.resize(config_.max_group_size);
      for (int s : pc.active) {
        P2pEndpoint user;
        decodeEndpoints(view.endpoints[s], user, pc.channel_endpoints[s]);
      }
      // Forming ends early once the membership moves on (a survivor that saw
      // the newer view forms that one while this rank would wait for it here
      // under the older name): then this loop forms the newer one.
      pc.shm.superseded = [this, epoch = view.active_epoch] { return activeEpoch() != epoch; };
      std::string error;
      plane_ = formPlane(pc, &error);
      if (!plane_) {
        // Superseded: this rank's view moved while forming, or a member that
        // saw a newer view first left the arena and broke it on its way
        // there. Either way a newer view exists: form that one, once it has
        // come here too (bounded by the group's timeout, and a cut-off).
        if (error.find(kSupersededError) != std::string::npos && awaitViewAfter(view.active_epoch)) continue;
        throw std::runtime_error("cannot form the data plane of epoch " + std::to_string(view.active_epoch) + variant +
                                 ": " + error);
      }
      plane_key_ = key;
      std::vector<std::string> hosts;
      for (int s : pc.active) hosts.push_back(view.hosts[s]);
      std::sort(hosts.begin(), hosts.end());
      const auto distinct = std::unique(hosts.begin(), hosts.end()) - hosts.begin();
      if (distinct > 1) {
        LOG(INFO) << "mooncake: group " << config_.key << " (epoch " << view.active_epoch << variant << "): its "
                  << pc.active.size() << " active ranks span " << distinct << " hosts: shared memory inside hosts, the "
                  << "transfer engine between them";
      }
    }
    return *plane_;
  }
}

bool GroupMembership::leaveOut(const std::vector<int>& seats) {
  GroupView view = latestView();
  if (left_out_epoch_ != view.active_epoch) {
    left_out_.clear();
    left_out_epoch_ = view.active_epoch;
  }
  for (int s : seats) {
    if (s == config_.seat) return false;
    if (s >= 0 && s < config_.max_group_size && view.isActive(s)) left_out_.push_back(s);
  }
  std::sort(left_out_.begin(), left_out_.end());
  left_out_.erase(std::unique(left_out_.begin(), left_out_.end()), left_out_.end());
  return view.isActive(config_.seat);
}

void GroupMembership::afterFailure(const OpResult& failure) {
  if (cut_off_.load(std::memory_order_acquire)) return;  // nobody to tell
  if (!config_.auto_sync) {
    agent_->reportFailure(config_.key, failure.failed_ranks);
    return;
  }
  SyncResult sync = agent_->syncAfterFailure(config_.key, failure.failed_ranks);
  if (sync.response.status != SyncAfterFailureStatus::Rejected) applyView(sync.view);
}

void GroupMembership::joinGroup() {
  std::string error;
  TORCH_CHECK(agent_->joinGroup(config_.key, config_.timeout, &error), "join_group: ", error);
  applyView(agent_->view(config_.key));
}

ProposeViewUpdateResponse GroupMembership::propose(bool activate, const std::vector<int>& ranks) {
  ProposeViewUpdateResponse response = agent_->propose(config_.key, activate, ranks);
  applyView(agent_->view(config_.key));
  return response;
}

SyncAfterFailureResponse GroupMembership::syncAfterFailure() {
  SyncResult sync = agent_->syncAfterFailure(config_.key, {});
  if (sync.response.status != SyncAfterFailureStatus::Rejected) applyView(sync.view);
  return sync.response;
}

bool GroupMembership::peerState(int rank) const {
  std::lock_guard lock(mutex_);
  if (rank < 0 || rank >= static_cast<int>(view_.members.size())) return false;
  const MemberState state = view_.members[rank];
  return (state == MemberState::kActive || state == MemberState::kAwaitingActivation) && view_.online[rank] &&
         !view_.endpoints[rank].empty();
}

int GroupMembership::numSyncedRanks() const {
  int n = 0;
  for (int s = 0; s < config_.max_group_size; ++s) n += peerState(s) ? 1 : 0;
  return n;
}

void GroupMembership::leave() {
  {
    std::lock_guard lock(mutex_);
    if (left_) return;
    left_ = true;
  }
  // Outside the lock: the Agent's thread may be delivering a view to us.
  agent_->unregisterGroup(config_.key);
}

}  // namespace mooncake::pg
