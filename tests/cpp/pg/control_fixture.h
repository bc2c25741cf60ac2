// What the control-plane tests share: fast options, a log of the views a
// listener got, members (an Agent each), forked child processes, a raw peer
// that speaks the protocol by hand, and the ControlPlane fixture (a
// Coordinator on 127.0.0.1 and helpers to connect, register and found
// groups). Every wait is bounded, with short timeouts, so that no test can
// hang. Included by the test_control_*.cpp files, each a part of the suite.
#pragma once
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <condition_variable>
#include <functional>
#include <future>
#include <mutex>
#include <optional>
#include <random>
#include <thread>

#include "common/piped_child.h"
#include "control/coordinator_state.h"
#include "control/protocol.h"
#include "control/reconciliation.h"
#include "control/socket_io.h"
#include "mooncake/pg/control_plane.h"
#include "mooncake/pg/test_faults.h"

namespace mooncake::pg {
namespace {

// A Hello from `global_rank` (the other fields at their defaults).
[[maybe_unused]] control::Hello helloFrom(int32_t global_rank, int32_t pid = 0) {
  control::Hello hello;
  hello.global_rank = global_rank;
  hello.pid = pid;
  return hello;
}

using namespace std::chrono_literals;
using Ms = std::chrono::milliseconds;
using SteadyClock = std::chrono::steady_clock;

ControlOptions testOptions() {
  ControlOptions options;
  options.heartbeat_interval = 50ms;
  options.heartbeat_timeout = 1000ms;
  options.reconciliation_window = 50ms;
  options.ack_timeout = 500ms;
  options.request_timeout = 2000ms;
  options.link_timeout = 500ms;
  return options;
}

[[maybe_unused]] Ms since(SteadyClock::time_point start) {
  return std::chrono::duration_cast<Ms>(SteadyClock::now() - start);
}

GroupRegistration registration(const std::string& key, int seat, const std::vector<int>& rank_order, int max,
                               bool is_extension = false, bool auto_deactivate = true) {
  GroupRegistration r;
  r.key = key;
  r.rank = seat;
  r.max_group_size = max;
  r.rank_order = rank_order;
  r.is_extension = is_extension;
  r.auto_deactivate = auto_deactivate;
  r.endpoint = "endpoint-of-" + std::to_string(rank_order[seat]);
  r.host = "host-" + std::to_string(rank_order[seat]);
  return r;
}

// Every view a listener was given, in order; waits with a limit.
class ViewLog {
 public:
  Agent::ViewListener listener() {
    return [this](const GroupView& view) {
      std::lock_guard<std::mutex> lock(mutex_);
      views_.push_back(view);
      changed_.notify_all();
    };
  }
  // The first view (already received or arriving within `limit`) that matches.
  std::optional<GroupView> waitFor(const std::function<bool(const GroupView&)>& match, Ms limit = 3000ms) {
    std::unique_lock<std::mutex> lock(mutex_);
    std::optional<GroupView> found;
    changed_.wait_for(lock, limit, [&] {
      for (const GroupView& view : views_) {
        if (match(view)) {
          found = view;
          return true;
        }
      }
      return false;
    });
    return found;
  }
  std::vector<GroupView> views() {
    std::lock_guard<std::mutex> lock(mutex_);
    return views_;
  }

 private:
  std::mutex mutex_;
  std::condition_variable changed_;
  std::vector<GroupView> views_;
};

[[maybe_unused]] auto seatIs(int seat, MemberState state) {
  return [seat, state](const GroupView& view) { return view.members[seat] == state; };
}

struct Member {
  ViewLog log;     // declared first: it outlives the Agent whose reader thread feeds it
  GroupView view;  // what registerGroup returned
  std::unique_ptr<Agent> agent;
};
using Members = std::vector<std::unique_ptr<Member>>;

// A child process, forked when it is constructed: construct it before the
// Coordinator or any Agent exists, so that the fork copies no lock another
// thread holds. The child waits for the Coordinator's address, runs `body`
// and exits; it reports progress as lines the parent reads with a limit.
class ChildProcess {
 public:
  using Body = std::function<void(const std::string& address, ChildProcess& self)>;

  explicit ChildProcess(Body body) {
    child_ = testing::PipedChild::fork([&](int from_parent, int to_parent) {
      report_fd_ = to_parent;
      std::string address;
      char c;
      while (::read(from_parent, &c, 1) == 1 && c != '\n') address += c;
      if (address.empty()) return 1;  // the parent gave up
      body(address, *this);
      return 0;
    });
    if (!child_.started()) std::abort();
  }

  void go(const std::string& address) {
    std::string line = address + "\n";
    if (!child_.writeAll(line.data(), line.size())) ADD_FAILURE();
  }
  // In the child.
  void report(const std::string& line) {
    std::string text = line + "\n";
    if (::write(report_fd_, text.data(), text.size()) < 0) ::_exit(1);
  }
  // In the parent: the next reported line, "" if none came within `limit`.
  std::string nextReport(Ms limit) { return child_.readLine(limit).value_or(""); }
  void signal(int sig) { child_.signal(sig); }
  bool waitStopped(Ms limit) { return child_.waitStopped(limit); }

 private:
  testing::PipedChild child_;  // killed and reaped when this goes
  int report_fd_ = -1;         // in the child: its end of the pipe to the parent
};

// In a child: connects as founder `seat` of `key`, registers, reports
// "registered" (or "error: ..." and exits), and returns the Agent.
[[maybe_unused]] std::unique_ptr<Agent> childFounder(const std::string& address, ChildProcess& self,
                                                     const std::string& key, int seat,
                                                     const std::vector<int>& rank_order, int max) {
  std::string error;
  auto agent = Agent::connect(address, rank_order[seat], testOptions(), &error);
  GroupView view;
  if (!agent || !agent->registerGroup(registration(key, seat, rank_order, max), nullptr, &view, &error)) {
    self.report("error: " + error);
    ::_exit(1);
  }
  self.report("registered");
  return agent;
}

// Speaks the protocol by hand: for exact sequences (register, then vanish)
// and for feeding the Coordinator garbage.
class RawPeer {
 public:
  explicit RawPeer(const std::string& address) {
    std::string host;
    uint16_t port = 0;
    std::string error;
    EXPECT_TRUE(control::splitHostPort(address, &host, &port));
    fd_ = control::connectTo(host, port, SteadyClock::now() + 2s, &error);
    EXPECT_TRUE(fd_.valid()) << error;
  }
  void sendBytes(const std::vector<uint8_t>& bytes) {
    std::string error;
    EXPECT_TRUE(control::sendAll(fd_.get(), bytes.data(), bytes.size(), SteadyClock::now() + 2s, &error)) << error;
  }
  void send(const control::Message& message) { sendBytes(control::encodeFrame(message)); }
  // The next message other than a heartbeat, within `limit`.
  std::optional<control::Message> receive(Ms limit = 2000ms) {
    auto deadline = SteadyClock::now() + limit;
    for (;;) {
      control::Message message;
      std::string error;
      auto result = decoder_.next(&message, &error);
      if (result == control::DecodeResult::kFrame) {
        if (std::holds_alternative<control::Heartbeat>(message)) continue;
        return message;
      }
      if (result == control::DecodeResult::kError) return std::nullopt;
      uint8_t buffer[4096];
      ssize_t n = control::receiveSome(fd_.get(), buffer, sizeof(buffer), deadline, &error);
      if (n <= 0) return std::nullopt;
      decoder_.append(buffer, static_cast<size_t>(n));
    }
  }
  // True once the Coordinator closed the connection (within `limit`).
  bool closedByPeer(Ms limit) {
    auto deadline = SteadyClock::now() + limit;
    uint8_t buffer[4096];
    std::string error;
    for (;;) {
      ssize_t n = control::receiveSome(fd_.get(), buffer, sizeof(buffer), deadline, &error);
      if (n == 0) return true;
      if (n < 0) return error != "timed out";
    }
  }
  void hello(int global_rank) {
    send(helloFrom(global_rank, 0));
    auto answer = receive();
    ASSERT_TRUE(answer && std::holds_alternative<control::Reply>(*answer));
    EXPECT_EQ(std::get<control::Reply>(*answer).error, "");
  }
  // Closes as a process that exits does, but only after the Coordinator has
  // read everything sent (a close with unread input would reset the
  // connection instead).
  ~RawPeer() {
    if (!fd_.valid()) return;
    ::shutdown(fd_.get(), SHUT_WR);
    closedByPeer(1s);
  }

 private:
  control::UniqueFd fd_;
  control::FrameDecoder decoder_;
};

class ControlPlane : public ::testing::Test {
 protected:
  void start(const ControlOptions& options = testOptions()) {
    options_ = options;
    std::string error;
    coordinator_ = Coordinator::start("127.0.0.1", options_, &error);
    ASSERT_NE(coordinator_, nullptr) << error;
  }
  std::string address() const { return coordinator_->address(); }

  std::unique_ptr<Member> connect(int global_rank) {
    auto member = std::make_unique<Member>();
    std::string error;
    member->agent = Agent::connect(address(), global_rank, options_, &error);
    EXPECT_NE(member->agent, nullptr) << error;
    return member;
  }
  Members connectAll(const std::vector<int>& global_ranks) {
    Members members;
    for (int g : global_ranks) members.push_back(connect(g));
    return members;
  }

  // Starts registerGroup of every member (member i as seat i) on its own thread.
  std::vector<std::future<std::string>> registerAsync(Members& members, const std::string& key,
                                                      const std::vector<int>& rank_order, int max,
                                                      bool auto_deactivate = true) {
    std::vector<std::future<std::string>> results;
    for (size_t seat = 0; seat < members.size(); ++seat) {
      Member* member = members[seat].get();
      GroupRegistration r = registration(key, static_cast<int>(seat), rank_order, max, false, auto_deactivate);
      results.push_back(std::async(std::launch::async, [member, r] {
        std::string error;
        bool ok = member->agent->registerGroup(r, member->log.listener(), &member->view, &error);
        return ok ? std::string() : (error.empty() ? std::string("failed without a reason") : error);
      }));
    }
    return results;
  }
  // Founds `key` with global ranks 0..n-1 in seats 0..n-1.
  Members found(const std::string& key, int n, int max, bool auto_deactivate = true) {
    std::vector<int> rank_order;
    for (int g = 0; g < n; ++g) rank_order.push_back(g);
    Members members = connectAll(rank_order);
    auto results = registerAsync(members, key, rank_order, max, auto_deactivate);
    for (auto& result : results) {
      EXPECT_EQ(result.wait_for(5s), std::future_status::ready);
      EXPECT_EQ(result.get(), "");
    }
    return members;
  }

  ControlOptions options_;
  std::unique_ptr<Coordinator> coordinator_;
};

// Drives CoordinatorState directly: no sockets, no threads, no clock.
class StateMachine {
 public:
  using SessionId = control::SessionId;

  // Sessions 1..n are global ranks 0..n-1, founders of `key` in seats 0..n-1
  // (of `max` seats, n by default).
  void found(const std::string& key, int n, int max = 0, bool reports_links = false) {
    std::vector<int> rank_order;
    for (int g = 0; g < n; ++g) rank_order.push_back(g);
    for (int g = 0; g < n; ++g) {
      state_.onConnected(now_, g + 1);
      send(g + 1, helloFrom(g, 0));
    }
    for (int g = 0; g < n; ++g) {
      GroupRegistration r = registration(key, g, rank_order, max > 0 ? max : n);
      r.reports_links = reports_links;
      send(g + 1, control::RegisterGroupRequest{1, r});
    }
  }
  // Global rank g (session g + 1, or `session`) extends `key` into seat g
  // and asks to join.
  void join(const std::string& key, int g, int max, bool reports_links, SessionId session = 0) {
    if (session == 0) session = g + 1;
    std::vector<int> rank_order;
    for (int r = 0; r <= g; ++r) rank_order.push_back(r);
    state_.onConnected(now_, session);
    send(session, helloFrom(g, 0));
    GroupRegistration r = registration(key, g, rank_order, max, /*is_extension=*/true);
    r.reports_links = reports_links;
    send(session, control::RegisterGroupRequest{1, r});
    send(session, control::JoinRequest{2, key});
  }
  void disconnect(SessionId session) {
    control::Effects effects;
    state_.onDisconnected(now_, session, "test", &effects);
  }
  control::Effects advance(Ms by) {
    now_ += by;
    control::Effects effects;
    state_.onTimer(now_, &effects);
    return effects;
  }
  RankState rankState(int global_rank) const { return state_.rankState(global_rank); }
  control::CoordinatorState& state() { return state_; }
  control::TimePoint now() const { return now_; }
  control::Effects send(SessionId from, control::Message message) {
    control::Effects effects;
    state_.onMessage(now_, from, std::move(message), &effects);
    return effects;
  }
  template <class T>
  static std::vector<std::pair<SessionId, T>> sent(const control::Effects& effects) {
    std::vector<std::pair<SessionId, T>> found;
    for (const auto& outgoing : effects.sends) {
      if (auto* m = std::get_if<T>(&outgoing.message)) found.emplace_back(outgoing.to, *m);
    }
    return found;
  }

 private:
  control::CoordinatorState state_{testOptions(), "test"};
  control::TimePoint now_ = control::Clock::now();
};

}  // namespace
}  // namespace mooncake::pg
