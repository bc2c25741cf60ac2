#include "control_runtime.h"

#include <c10/util/Exception.h>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#include <netdb.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include <cstdlib>
#include <memory>
#include <mutex>
#include <thread>

#include <c10/util/Logging.h>

#include "settings.h"

namespace mooncake::pg {
namespace {

constexpr const char* kCoordinatorKey = "mooncake_pg/coordinator";
// The global rank whose process serves as coordinator (set with the address;
// a successor that took over sets both, where the store survived).
constexpr const char* kCoordinatorRankKey = "mooncake_pg/coordinator_rank";

bool failoverEnabled() {
  const char* text = std::getenv("MOONCAKE_PG_COORDINATOR_FAILOVER");
  return text == nullptr || std::string(text) != "0";
}

std::vector<uint8_t> bytes(const std::string& text) { return std::vector<uint8_t>(text.begin(), text.end()); }

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
  // This process's coordinator: serving in global rank 0's process, a
  // standby (a candidate successor) in the others.
  std::unique_ptr<Coordinator> coordinator;
  std::unique_ptr<Agent> agent;
  int global_rank = -1;
  // The job's root store, where later processes look for the coordinator.
  c10::intrusive_ptr<c10d::Store> root;
};

ControlRuntime& runtime() {
  // Never destroyed: groups may be torn down by Python's exit after static
  // destructors would have run.
  static auto* r = new ControlRuntime();
  return *r;
}

// Whether a TCP store's server still accepts connections (within 300 ms),
// tried with a plain socket: a store call to a server that is gone prints a
// c10 warning with a stack trace before it throws. Other stores: true.
bool storeAnswers(const c10::intrusive_ptr<c10d::Store>& store) {
  auto* tcp = dynamic_cast<c10d::TCPStore*>(store.get());
  if (tcp == nullptr) return true;
  addrinfo hints{};
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* found = nullptr;
  if (::getaddrinfo(tcp->getHost().c_str(), std::to_string(tcp->getPort()).c_str(), &hints, &found) != 0) return false;
  bool answers = false;
  for (addrinfo* a = found; a != nullptr && !answers; a = a->ai_next) {
    const int fd = ::socket(a->ai_family, a->ai_socktype | SOCK_NONBLOCK | SOCK_CLOEXEC, a->ai_protocol);
    if (fd < 0) continue;
    if (::connect(fd, a->ai_addr, a->ai_addrlen) == 0) {
      answers = true;
    } else if (errno == EINPROGRESS) {
      pollfd p{fd, POLLOUT, 0};
      int error = 0;
      socklen_t length = sizeof(error);
      answers = ::poll(&p, 1, 300) == 1 && ::getsockopt(fd, SOL_SOCKET, SO_ERROR, &error, &length) == 0 && error == 0;
    }
    ::close(fd);
  }
  ::freeaddrinfo(found);
  return answers;
}

void publishCoordinator(const c10::intrusive_ptr<c10d::Store>& root, const std::string& address, int global_rank) {
  root->set(kCoordinatorKey, bytes(address));
  root->set(kCoordinatorRankKey, bytes(std::to_string(global_rank)));
}

// A serving coordinator that leaves names its successor in the store first:
// the store is often in this very process, so the successor could not
// (its attempt would race this process's exit).
void publishSuccessor(const ControlRuntime& r) {
  if (!r.coordinator || !r.coordinator->serving() || !r.agent || !r.root) return;
  int rank = -1;
  std::string address;
  if (!r.agent->firstSuccessor(&rank, &address) || !storeAnswers(r.root)) return;
  try {
    publishCoordinator(r.root, address, rank);
  } catch (const std::exception& e) {
    LOG(INFO) << "mooncake: leaving, could not name the successor coordinator in the store: " << e.what();
  }
}

// At a normal exit (not os._exit, not a signal) this process leaves the
// control plane: its Agent says Goodbye, and a serving coordinator tells
// every Agent, so that the others log a leave and take over quietly instead
// of failing over with warnings.
void leaveAtExit() {
  ControlRuntime& r = runtime();
  std::unique_lock lock(r.mutex, std::try_to_lock);  // never wait at exit for a call in flight
  if (!lock.owns_lock()) return;
  publishSuccessor(r);
  if (r.agent) r.agent->leave();
  if (r.coordinator) r.coordinator->leave();
}

}  // namespace

ControlOptions controlOptions() {
  ControlOptions o;
  o.heartbeat_interval = envMs("MOONCAKE_PG_HEARTBEAT_INTERVAL_MS", o.heartbeat_interval);
  o.heartbeat_timeout = envMs("MOONCAKE_PG_HEARTBEAT_TIMEOUT_MS", o.heartbeat_timeout);
  o.ack_timeout = envMs("MOONCAKE_PG_VIEW_ACK_TIMEOUT_MS", o.ack_timeout);
  o.link_timeout = envMs("MOONCAKE_PG_LINK_TIMEOUT_MS", o.link_timeout);
  o.failover_timeout = envMs("MOONCAKE_PG_FAILOVER_TIMEOUT_MS", o.heartbeat_timeout);
  const int64_t window_us = settings().fault_reconciliation_window_us.load();
  if (window_us >= 0) o.reconciliation_window = std::chrono::milliseconds(window_us / 1000);
  return o;
}

Agent& controlAgent(const c10::intrusive_ptr<c10d::Store>& store, int global_rank, std::chrono::milliseconds timeout) {
  ControlRuntime& r = runtime();
  std::lock_guard lock(r.mutex);
  c10::intrusive_ptr<c10d::Store> root = rootStore(store);
  r.root = root;  // the newest job's: torn down and initialised again, a job has a new store
  ControlOptions options = controlOptions();
  options.secret = jobSecret(store);
  const bool failover = failoverEnabled();
  std::string error;
  static const bool leave_at_exit = (std::atexit(leaveAtExit), true);
  (void)leave_at_exit;
  if (!r.coordinator && (global_rank == 0 || failover)) {
    r.coordinator = Coordinator::standby(hostIp(), options, global_rank, &error);
    TORCH_CHECK(r.coordinator != nullptr, "mooncake: cannot start the membership coordinator: ", error);
    // A take-over after a failure tells later processes (joiners, a
    // replacement of global rank 0) where the coordinator is now, if the
    // store survived; off the Agent's thread, since a store in the lost
    // process may not answer. After a planned leave the leaver named this
    // successor already (publishSuccessor), while its store still answered.
    r.coordinator->onTakeOver([root, global_rank](const std::string& address, bool planned) {
      if (planned) return;
      std::thread([root, global_rank, address] {
        if (!storeAnswers(root)) {
          LOG(INFO) << "mooncake: the store is gone (with the old coordinator's process): the new coordinator's "
                    << "address " << address << " is not published";
          return;
        }
        try {
          publishCoordinator(root, address, global_rank);
        } catch (const c10::Error& e) {
          LOG(WARNING) << "mooncake: could not publish the new coordinator's address in the store (it may have "
                       << "died with the old coordinator): " << e.what_without_backtrace();
        } catch (const std::exception& e) {
          LOG(WARNING) << "mooncake: could not publish the new coordinator's address in the store: " << e.what();
        } catch (...) {
        }
      }).detach();
    });
  }
  if (global_rank == 0) {
    // Unless a successor took over from an earlier global rank 0 (this
    // process replaces it), this process serves. Every time: a job torn
    // down and initialised again has a new store.
    bool taken_over = false;
    if (!r.coordinator->serving() && root->check({kCoordinatorRankKey})) {
      std::vector<uint8_t> v = root->get(kCoordinatorRankKey);
      taken_over = std::string(v.begin(), v.end()) != "0";
    }
    if (!taken_over) {
      r.coordinator->activate();
      publishCoordinator(root, r.coordinator->address(), 0);
    }
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
  r.agent = Agent::connect(address, global_rank, options, &error, failover ? r.coordinator.get() : nullptr);
  TORCH_CHECK(r.agent != nullptr, "mooncake: cannot join the membership coordinator at ", address, ": ", error);
  r.global_rank = global_rank;
  return *r.agent;
}

}  // namespace mooncake::pg
