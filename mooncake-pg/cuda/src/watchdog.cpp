#include "watchdog.h"

#include <string>

namespace mooncake::pg::cuda {
namespace {

using std::chrono::microseconds;

constexpr microseconds kBusyPeriod{100};     // an operation in flight
constexpr microseconds kDrainPeriod{50};     // broken, operations still queued
constexpr microseconds kIdlePeriod{2000};    // nothing in flight: only peers' deaths matter
constexpr std::chrono::seconds kDrainPatience{1};  // broken, and no progress for this long: drain slowly

bool after(uint32_t a, uint32_t b) { return static_cast<int32_t>(a - b) > 0; }

std::string joinRanks(const ControlBlock& control, const std::vector<int>& ranks) {
  std::string s;
  for (size_t i = 0; i < ranks.size(); ++i) s += (i ? ", " : "") + control.rankName(ranks[i]);
  return s;
}

}  // namespace

Watchdog::Watchdog(ControlBlock& control, std::chrono::milliseconds timeout)
    : control_(control), timeout_(timeout), thread_([this] { run(); }) {}

Watchdog::~Watchdog() {
  {
    std::lock_guard lock(stop_mutex_);
    stop_ = true;
  }
  stop_cv_.notify_all();
  thread_.join();
}

void Watchdog::run() {
  std::unique_lock lock(stop_mutex_);
  while (!stop_) {
    lock.unlock();
    const microseconds pause = tick();
    lock.lock();
    stop_cv_.wait_for(lock, pause, [this] { return stop_; });
  }
}

uint32_t Watchdog::finishedAtBreak() {
  std::lock_guard lock(snapshot_mutex_);
  if (!snapshot_taken_) {
    RankControl& me = control_.mine();
    // finished first: a kernel's report is written before the stream's
    // finished mark, so it is visible once the mark is.
    uint32_t finished = me.finished.load(std::memory_order_acquire);
    const uint32_t error = __atomic_load_n(&me.report.error, __ATOMIC_ACQUIRE);
    const uint32_t op = __atomic_load_n(&me.report.op_id, __ATOMIC_RELAXED);
    // The operation whose kernel failed or skipped its work failed, even
    // though its stream went on to finish it.
    if (error != kDeviceOk && op != 0 && !after(op, finished)) finished = op - 1;
    finished_at_break_ = finished;
    snapshot_taken_ = true;
  }
  return finished_at_break_;
}

std::chrono::microseconds Watchdog::tick() {
  RankControl& me = control_.mine();
  const bool in_flight =
      after(me.started.load(std::memory_order_acquire), me.finished.load(std::memory_order_acquire));
  if (control_.broken()) {
    finishedAtBreak();
    releaseOwnWaits();
    const uint32_t finished = me.finished.load(std::memory_order_acquire);
    const auto now = std::chrono::steady_clock::now();
    if (finished != drain_finished_ || drain_progress_ == std::chrono::steady_clock::time_point{}) {
      drain_finished_ = finished;
      drain_progress_ = now;
    }
    // Graph replays leave no marks: they are released at the idle pace.
    return in_flight && now - drain_progress_ < kDrainPatience ? kDrainPeriod : kIdlePeriod;
  }
  if (breakOnDeviceReport()) return kDrainPeriod;
  if (std::vector<int> dead = control_.deadPeers(); !dead.empty()) {
    control_.breakGroup(
        joinRanks(control_, dead) + " (pid " + std::to_string(control_.block(dead[0]).presence.pid) + ") exited", dead);
    return kDrainPeriod;
  }
  if (!in_flight) {
    watching_ = false;
    return kIdlePeriod;
  }
  const uint32_t started = me.started.load(std::memory_order_acquire);
  const auto now = std::chrono::steady_clock::now();
  if (!watching_ || started != watched_id_) {
    watching_ = true;
    watched_id_ = started;
    watched_since_ = now;
  } else if (now - watched_since_ > timeout_) {
    const std::vector<int> missing = missingRanks();
    control_.breakGroup("timed out after " + std::to_string(timeout_.count()) + " ms waiting for " +
                            joinRanks(control_, missing),
                        missing);
    return kDrainPeriod;
  }
  return kBusyPeriod;
}

bool Watchdog::breakOnDeviceReport() {
  const DeviceReport& report = control_.mine().report;
  const uint32_t error = __atomic_load_n(&report.error, __ATOMIC_ACQUIRE);  // pairs with the kernel's release
  if (error == kDeviceOk || error == kDeviceAborted) return false;  // aborted only follows a break
  const int rank = __atomic_load_n(&report.rank, __ATOMIC_RELAXED);
  if (error == kDeviceSignatureMismatch) {
    control_.breakGroup(control_.rankName(rank) +
                            " called a different collective (operation, dtype, size or root differ): every rank "
                            "must issue the same collectives in the same order",
                        {rank});
  } else {
    std::vector<int> missing = missingRanks();
    if (missing.empty()) missing = {rank};
    control_.breakGroup("timed out after " + std::to_string(timeout_.count()) + " ms waiting for " +
                            joinRanks(control_, missing) + " (on the device)",
                        missing);
  }
  return true;
}

void Watchdog::releaseOwnWaits() {
  RankControl& me = control_.mine();
  for (int set = 0; set < kBarrierSets; ++set) {
    for (int q = 0; q < control_.size(); ++q) {
      if (q != control_.rank()) me.arrival[set][q].store(1, std::memory_order_release);
    }
  }
}

// The ranks this rank's stream is waiting for. While it waits in a barrier,
// every peer that reached it has set its flag in the barrier's set, and no
// peer can have set a flag of the other set (that needs this barrier to
// complete everywhere), so a peer with neither flag set is one missing.
std::vector<int> Watchdog::missingRanks() const {
  RankControl& me = control_.mine();
  std::vector<int> missing;
  for (int q = 0; q < control_.size(); ++q) {
    if (q == control_.rank()) continue;
    const bool signaled_any = me.arrival[0][q].load(std::memory_order_acquire) != 0 ||
                              me.arrival[1][q].load(std::memory_order_acquire) != 0;
    if (!signaled_any) missing.push_back(q);
  }
  return missing;
}

}  // namespace mooncake::pg::cuda
