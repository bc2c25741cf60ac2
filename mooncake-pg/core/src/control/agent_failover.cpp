// A lost connection (control_plane.h, "Coordinator failover"): the calls in
// flight fail first, then the heartbeat thread tries the candidate
// successors the Coordinator last announced, in order (taking over with this
// process's standby when its turn comes), rejoining with every registration
// and newest view; only when no candidate takes this Agent back is the loss
// final and told to the loss listeners.
#include "control/agent_impl.h"

namespace mooncake::pg::control {

bool AgentImpl::failover(const std::string& why, std::string* final_why) {
  if (reader_.joinable()) reader_.join();  // its socket was shut down: it ends (after a running listener)
  Standbys standbys;
  std::vector<Rejoin> rejoins;
  bool planned;  // the coordinator ended normally (or this process does): routine, logged at Info
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (stopping_) return false;
    planned = coordinator_leaving_ || leaving_;
    standbys = standbys_;
    for (const auto& [key, slot] : groups_) {
      if (slot->view.epoch == 0 || slot->view.members.empty()) continue;  // not formed yet: lost with the coordinator
      rejoins.push_back({slot->registration, slot->view});
    }
  }
  *final_why = why;
  if (test_faults::controlCut()) {
    *final_why += " (cut off from the control plane: no failover)";
    return false;
  }
  if (standbys.ranks.empty()) return false;
  std::vector<int> expected(standbys.ranks.begin(), standbys.ranks.end());
  const auto level = ::mooncake::log::warningUnlessPlanned(planned);
  MC_LOG_AT(level) << "control plane agent (global rank " << global_rank_ << "): " << why
                   << "; failing over (candidates: global ranks " << listText(expected) << ")";
  const Hello resume = hello(/*resume=*/true, static_cast<uint32_t>(rejoins.size()));
  std::string tried;
  for (size_t i = 0; i < standbys.ranks.size(); ++i) {
    const int rank = standbys.ranks[i];
    std::string address = standbys.addresses[i];
    {
      std::lock_guard<std::mutex> lock(mutex_);
      if (stopping_) return false;
    }
    if (rank == global_rank_) {
      if (standby_ == nullptr) continue;
      standby_->takeOver(expected, standbys.coordinator_rank, planned);  // the next in line: its standby serves
      address = standby_->address();
    }
    const TimePoint now = Clock::now();
    UniqueFd fd;
    FrameDecoder decoder;
    std::string error;
    if (!greet(address, resume, rejoins, now + std::min(options_.heartbeat_timeout, options_.failover_timeout),
               now + options_.failover_timeout + options_.heartbeat_timeout, &fd, &decoder, &error)) {
      MC_LOG_AT(level) << "control plane agent (global rank " << global_rank_ << "): candidate global rank " << rank
                       << ": " << error;
      tried += (tried.empty() ? "" : "; ") + std::string("global rank ") + std::to_string(rank) + ": " + error;
      continue;
    }
    {
      std::lock_guard<std::mutex> serialize(send_mutex_);
      std::lock_guard<std::mutex> lock(mutex_);
      if (stopping_) return false;  // fd closes here: the successor sees this process leave
      fd_ = std::move(fd);
      decoder_ = std::move(decoder);
      address_ = address;
      ++generation_;
      broken_ = false;
      broken_reason_.clear();
      coordinator_leaving_ = false;  // a new coordinator: its end would be news again
      last_heard_ = Clock::now();
      changed_.notify_all();
    }
    MC_LOG_AT(level) << "control plane agent (global rank " << global_rank_ << "): failed over to the coordinator "
                     << "of global rank " << rank << " at " << address;
    reader_ = std::thread([this] { readLoop(); });
    return true;
  }
  *final_why = why + "; no successor coordinator took this process back (" + tried + ")";
  return false;
}

void AgentImpl::tellLoss() {
  std::string why;
  std::vector<std::shared_ptr<GroupSlot>> slots;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (!lost_ || stopping_ || loss_told_) return;
    loss_told_ = true;
    why = lost_reason_;
    for (const auto& entry : groups_) slots.push_back(entry.second);
  }
  for (const std::shared_ptr<GroupSlot>& slot : slots) {
    LossListener listener;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      bool registered = false;
      for (const auto& entry : groups_) registered |= entry.second == slot;
      if (!registered || stopping_) continue;  // unregistered meanwhile
      listener = slot->on_loss;
      if (listener) in_loss_listener_ = slot.get();
    }
    if (!listener) continue;
    try {
      listener(why);
    } catch (const std::exception& e) {
      MC_LOG(Warning) << "control plane: a connection-loss listener threw: " << e.what();
    } catch (...) {
      MC_LOG(Warning) << "control plane: a connection-loss listener threw";
    }
    std::lock_guard<std::mutex> lock(mutex_);
    in_loss_listener_ = nullptr;
    changed_.notify_all();
  }
}

void AgentImpl::onConnectionLost(const std::string& key, LossListener listener) {
  std::string why;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    auto it = groups_.find(key);
    if (it == groups_.end()) return;
    it->second->on_loss = listener;
    if (!loss_told_) return;  // tellLoss will call it
    why = lost_reason_;       // already lost and told: this one hears it now
  }
  if (listener) listener(why);
}

}  // namespace mooncake::pg::control
