#include "control_runtime.h"

#include <c10/util/Exception.h>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>

#include <cstdlib>
#include <memory>
#include <mutex>

#include "settings.h"

namespace mooncake::pg {
namespace {

constexpr const char* kCoordinatorKey = "mooncake_pg/coordinator";

c10::intrusive_ptr<c10d::Store> rootStore(c10::intrusive_ptr<c10d::Store> store) {
  while (auto* prefixed = dynamic_cast<c10d::PrefixStore*>(store.get())) store = prefixed->getUnderlyingStore();
  return store;
}

std::chrono::milliseconds envMs(const char* name, std::chrono::milliseconds fallback) {
  const char* text = std::getenv(name);
  if (text == nullptr || *text == '\0') return fallback;
  char* end = nullptr;
  long long v = std::strtoll(text, &end, 10);
  TORCH_CHECK_VALUE(end != text && *end == '\0' && v > 0, name, " must be a positive number of milliseconds, got '",
                    text, "'");
  return std::chrono::milliseconds(v);
}

struct ControlRuntime {
  std::mutex mutex;
  std::unique_ptr<Coordinator> coordinator;
  std::unique_ptr<Agent> agent;
  int global_rank = -1;
};

ControlRuntime& runtime() {
  // Never destroyed: groups may be torn down by Python's exit after static
  // destructors would have run.
  static auto* r = new ControlRuntime();
  return *r;
}

}  // namespace

ControlOptions controlOptions() {
  ControlOptions o;
  o.heartbeat_interval = envMs("MOONCAKE_PG_HEARTBEAT_INTERVAL_MS", o.heartbeat_interval);
  o.heartbeat_timeout = envMs("MOONCAKE_PG_HEARTBEAT_TIMEOUT_MS", o.heartbeat_timeout);
  o.ack_timeout = envMs("MOONCAKE_PG_VIEW_ACK_TIMEOUT_MS", o.ack_timeout);
  o.link_timeout = envMs("MOONCAKE_PG_LINK_TIMEOUT_MS", o.link_timeout);
  const int64_t window_us = settings().fault_reconciliation_window_us.load();
  if (window_us >= 0) o.reconciliation_window = std::chrono::milliseconds(window_us / 1000);
  return o;
}

Agent& controlAgent(const c10::intrusive_ptr<c10d::Store>& store, int global_rank, std::chrono::milliseconds timeout) {
  ControlRuntime& r = runtime();
  std::lock_guard lock(r.mutex);
  c10::intrusive_ptr<c10d::Store> root = rootStore(store);
  const ControlOptions options = controlOptions();
  std::string error;
  if (global_rank == 0) {
    if (!r.coordinator) {
      r.coordinator = Coordinator::start(settings().host_ip, options, &error);
      TORCH_CHECK(r.coordinator != nullptr, "mooncake: cannot start the membership coordinator: ", error);
    }
    // Every time: a job torn down and initialised again has a new store.
    const std::string address = r.coordinator->address();
    root->set(kCoordinatorKey, std::vector<uint8_t>(address.begin(), address.end()));
  }
  if (r.agent && r.global_rank == global_rank) return *r.agent;
  TORCH_CHECK(!r.agent, "mooncake: this process joined the control plane as global rank ", r.global_rank,
              " and now creates a group as global rank ", global_rank);
  std::string address;
  {
    const auto deadline_guard = root->getTimeout();
    root->setTimeout(timeout);
    try {
      std::vector<uint8_t> v = root->get(kCoordinatorKey);
      address.assign(v.begin(), v.end());
    } catch (const std::exception& e) {
      root->setTimeout(deadline_guard);
      TORCH_CHECK(false, "mooncake: the membership coordinator (started by global rank 0) did not publish its "
                         "address within the group timeout: ", e.what());
    }
    root->setTimeout(deadline_guard);
  }
  r.agent = Agent::connect(address, global_rank, options, &error);
  TORCH_CHECK(r.agent != nullptr, "mooncake: cannot join the membership coordinator at ", address, ": ", error);
  r.global_rank = global_rank;
  return *r.agent;
}

}  // namespace mooncake::pg
