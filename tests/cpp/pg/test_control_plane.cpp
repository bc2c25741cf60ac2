// The elastic control plane over real sockets on 127.0.0.1: a Coordinator,
// Agents in threads of this process, forked children for process death and
// stalls, and raw peers speaking the protocol by hand where a test needs a
// precise sequence (register, then vanish). Every wait is bounded, with
// short timeouts, so that no test can hang and the file runs in seconds.
#include <gtest/gtest.h>
#include <poll.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <condition_variable>
#include <functional>
#include <future>
#include <mutex>
#include <optional>
#include <random>
#include <thread>

#include "control/coordinator_state.h"
#include "control/protocol.h"
#include "control/reconciliation.h"
#include "control/socket_io.h"
#include "mooncake/pg/control_plane.h"
#include "mooncake/pg/test_faults.h"

namespace mooncake::pg {
namespace {

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

Ms since(SteadyClock::time_point start) { return std::chrono::duration_cast<Ms>(SteadyClock::now() - start); }

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

auto seatIs(int seat, MemberState state) {
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
    int to_child[2];
    int from_child[2];
    if (::pipe(to_child) != 0 || ::pipe(from_child) != 0) std::abort();
    pid_ = ::fork();
    if (pid_ == 0) {
      ::close(to_child[1]);
      ::close(from_child[0]);
      report_fd_ = from_child[1];
      std::string address;
      char c;
      while (::read(to_child[0], &c, 1) == 1 && c != '\n') address += c;
      if (address.empty()) ::_exit(1);  // the parent gave up
      body(address, *this);
      ::_exit(0);
    }
    ::close(to_child[0]);
    ::close(from_child[1]);
    command_fd_ = to_child[1];
    report_fd_ = from_child[0];
  }
  ~ChildProcess() {
    if (pid_ > 0) {
      ::kill(pid_, SIGKILL);
      ::waitpid(pid_, nullptr, 0);
    }
    ::close(command_fd_);
    ::close(report_fd_);
  }

  void go(const std::string& address) {
    std::string line = address + "\n";
    if (::write(command_fd_, line.data(), line.size()) != static_cast<ssize_t>(line.size())) ADD_FAILURE();
  }
  // In the child.
  void report(const std::string& line) {
    std::string text = line + "\n";
    if (::write(report_fd_, text.data(), text.size()) < 0) ::_exit(1);
  }
  // In the parent: the next reported line, "" if none came within `limit`.
  std::string nextReport(Ms limit) {
    std::string line;
    auto deadline = SteadyClock::now() + limit;
    char c;
    for (;;) {
      pollfd p{report_fd_, POLLIN, 0};
      if (::poll(&p, 1, control::pollTimeoutMs(deadline)) <= 0) return "";
      if (::read(report_fd_, &c, 1) != 1) return line;
      if (c == '\n') return line;
      line += c;
    }
  }
  void signal(int sig) { ::kill(pid_, sig); }
  bool waitStopped(Ms limit) {
    auto deadline = SteadyClock::now() + limit;
    while (SteadyClock::now() < deadline) {
      int status = 0;
      if (::waitpid(pid_, &status, WUNTRACED | WNOHANG) == pid_ && WIFSTOPPED(status)) return true;
      std::this_thread::sleep_for(1ms);
    }
    return false;
  }

 private:
  pid_t pid_ = -1;
  int command_fd_ = -1;
  int report_fd_ = -1;
};

// In a child: connects as founder `seat` of `key`, registers, reports
// "registered" (or "error: ..." and exits), and returns the Agent.
std::unique_ptr<Agent> childFounder(const std::string& address, ChildProcess& self, const std::string& key, int seat,
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
    send(control::Hello{global_rank, 0});
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

// ---------------------------------------------------------------- protocol

GroupView sampleView() {
  GroupView view;
  view.key = "cpu:7";
  view.uid = "pg1234-3";
  view.epoch = 42;
  view.members = {MemberState::kActive, MemberState::kInactive, MemberState::kAwaitingActivation, MemberState::kLeft,
                  MemberState::kNone};
  view.global_ranks = {0, 5, 2, 9, -1};
  view.endpoints = {"a:1", "", "c:3", "", ""};
  view.hosts = {"h0", "h1", "", "h3", ""};
  view.online = {true, false, true, false, false};
  return view;
}

std::vector<control::Message> sampleMessages() {
  ProposeViewUpdateResponse proposed;
  proposed.status = ProposalStatus::AppliedWithDroppedRanks;
  proposed.new_epoch = 17;
  proposed.dropped_ranks = {2, 3};
  return {
      control::Hello{3, 1234},
      control::Reply{9, "nope", sampleView()},
      control::Heartbeat{},
      control::RegisterGroupRequest{5, [] {
                                      GroupRegistration r = registration("k", 1, {4, 6, 8}, 4, true, false);
                                      r.reports_links = true;
                                      return r;
                                    }()},
      control::UnregisterGroupRequest{6, "k"},
      control::FailureReport{"k", {1, 2}},
      control::SyncRequest{7, "k", {}},
      control::SyncReply{7, {SyncAfterFailureStatus::Reconciled, ""}, sampleView()},
      control::JoinRequest{8, "k"},
      control::ProposeRequest{10, "k", true, {3}},
      control::ProposeReply{10, proposed},
      control::ViewPush{sampleView()},
      control::ViewAck{"k", 42},
      control::LinkReport{"k", {0, 2}, {1}},
      control::Hello{4, 99, "h:7", true, 2},
      control::Rejoin{registration("k", 1, {4, 6, 8}, 4), sampleView()},
      control::Standbys{2, {3, 5}, {"a:1", "b:2"}},
      control::Goodbye{},
  };
}

TEST(ControlProtocol, EveryMessageRoundTrips) {
  for (const control::Message& original : sampleMessages()) {
    std::vector<uint8_t> frame = control::encodeFrame(original);
    control::Message decoded;
    size_t used = 0;
    std::string error;
    ASSERT_EQ(control::decodeFrame(frame.data(), frame.size(), &decoded, &used, &error), control::DecodeResult::kFrame)
        << control::messageName(original) << ": " << error;
    EXPECT_EQ(used, frame.size());
    EXPECT_EQ(decoded.index(), original.index());
    // Encoding is deterministic: equal bytes mean equal fields.
    EXPECT_EQ(control::encodeFrame(decoded), frame) << control::messageName(original);
  }
  control::Message push = control::ViewPush{sampleView()};
  std::vector<uint8_t> frame = control::encodeFrame(push);
  control::Message decoded;
  size_t used = 0;
  std::string error;
  ASSERT_EQ(control::decodeFrame(frame.data(), frame.size(), &decoded, &used, &error), control::DecodeResult::kFrame);
  const GroupView& view = std::get<control::ViewPush>(decoded).view;
  EXPECT_EQ(view.key, "cpu:7");
  EXPECT_EQ(view.epoch, 42u);
  EXPECT_EQ(view.members[2], MemberState::kAwaitingActivation);
  EXPECT_EQ(view.global_ranks[4], -1);
  EXPECT_EQ(view.online, (std::vector<bool>{true, false, true, false, false}));
  EXPECT_EQ(view.activeRanks(), std::vector<int>{0});
}

TEST(ControlProtocol, StreamDecoderSplitsFramesFedByteByByte) {
  std::vector<uint8_t> stream;
  auto messages = sampleMessages();
  for (const auto& m : messages) {
    auto frame = control::encodeFrame(m);
    stream.insert(stream.end(), frame.begin(), frame.end());
  }
  control::FrameDecoder decoder;
  size_t decoded = 0;
  for (uint8_t byte : stream) {
    decoder.append(&byte, 1);
    control::Message m;
    std::string error;
    for (;;) {
      auto result = decoder.next(&m, &error);
      ASSERT_NE(result, control::DecodeResult::kError) << error;
      if (result == control::DecodeResult::kNeedMore) break;
      EXPECT_EQ(m.index(), messages[decoded].index());
      ++decoded;
    }
  }
  EXPECT_EQ(decoded, messages.size());
}

TEST(ControlProtocol, MalformedFramesAreErrorsNeverCrashes) {
  control::Message m;
  size_t used = 0;
  std::string error;
  auto decode = [&](const std::vector<uint8_t>& bytes) {
    error.clear();
    return control::decodeFrame(bytes.data(), bytes.size(), &m, &used, &error);
  };
  auto setU32 = [](std::vector<uint8_t>& bytes, size_t at, uint32_t v) {
    for (int i = 0; i < 4; ++i) bytes[at + i] = static_cast<uint8_t>(v >> (8 * i));
  };

  for (const control::Message& original : sampleMessages()) {
    std::vector<uint8_t> frame = control::encodeFrame(original);
    // Every truncation is incomplete, never a frame and never an error.
    for (size_t n = 0; n < frame.size(); ++n) {
      std::vector<uint8_t> prefix(frame.begin(), frame.begin() + n);
      EXPECT_EQ(decode(prefix), control::DecodeResult::kNeedMore) << n;
    }
    // A payload cut short but announced as complete (the length field
    // shrunk) is malformed.
    if (frame.size() > control::kFrameHeaderBytes) {
      for (size_t cut = 1; cut <= frame.size() - control::kFrameHeaderBytes; ++cut) {
        std::vector<uint8_t> shortened(frame.begin(), frame.end() - cut);
        setU32(shortened, 8, static_cast<uint32_t>(shortened.size() - control::kFrameHeaderBytes));
        auto result = decode(shortened);
        EXPECT_NE(result, control::DecodeResult::kNeedMore);
        if (result == control::DecodeResult::kFrame) {
          EXPECT_EQ(used, shortened.size());
        }
      }
    }
    // Trailing bytes inside the announced payload are an error.
    std::vector<uint8_t> padded = frame;
    padded.push_back(0);
    setU32(padded, 8, static_cast<uint32_t>(padded.size() - control::kFrameHeaderBytes));
    EXPECT_EQ(decode(padded), control::DecodeResult::kError);
  }

  std::vector<uint8_t> frame = control::encodeFrame(control::ViewPush{sampleView()});
  std::vector<uint8_t> bad = frame;
  bad[0] ^= 0xff;
  EXPECT_EQ(decode(bad), control::DecodeResult::kError);
  EXPECT_NE(error.find("magic"), std::string::npos);
  bad = frame;
  bad[4] = 99;  // version
  EXPECT_EQ(decode(bad), control::DecodeResult::kError);
  EXPECT_NE(error.find("version"), std::string::npos);
  bad = frame;
  bad[6] = 200;  // tag
  EXPECT_EQ(decode(bad), control::DecodeResult::kError);
  bad = frame;
  setU32(bad, 8, control::kMaxPayloadBytes + 1);
  EXPECT_EQ(decode(bad), control::DecodeResult::kError);
  // A count of seats the payload cannot hold is refused before allocating.
  std::vector<uint8_t> huge_count = control::encodeFrame(control::FailureReport{"", {}});
  setU32(huge_count, control::kFrameHeaderBytes + 4, 0xffffffffu);
  EXPECT_EQ(decode(huge_count), control::DecodeResult::kError);
  // An enum out of range, a bool that is neither 0 nor 1.
  std::vector<uint8_t> ack = control::encodeFrame(control::ProposeRequest{1, "", false, {}});
  ack[control::kFrameHeaderBytes + 8 + 4] = 2;  // activate
  EXPECT_EQ(decode(ack), control::DecodeResult::kError);
  std::vector<uint8_t> push = control::encodeFrame(control::SyncReply{1, {}, std::nullopt});
  push[control::kFrameHeaderBytes + 8] = 7;  // status
  EXPECT_EQ(decode(push), control::DecodeResult::kError);

  // Random mutations and random bytes: any outcome but a crash; a frame
  // never claims more bytes than it was given.
  std::mt19937 random(12345);
  auto messages = sampleMessages();
  for (int round = 0; round < 20000; ++round) {
    std::vector<uint8_t> bytes = control::encodeFrame(messages[round % messages.size()]);
    int flips = 1 + static_cast<int>(random() % 4);
    for (int f = 0; f < flips; ++f) bytes[random() % bytes.size()] = static_cast<uint8_t>(random());
    if (random() % 3 == 0) bytes.resize(random() % (bytes.size() + 1));
    if (decode(bytes) == control::DecodeResult::kFrame) {
      EXPECT_LE(used, bytes.size());
    }
  }
  for (int round = 0; round < 20000; ++round) {
    std::vector<uint8_t> bytes(random() % 96);
    for (auto& b : bytes) b = static_cast<uint8_t>(random());
    if (round % 2 == 0 && bytes.size() >= control::kFrameHeaderBytes) {
      // A valid header over a random payload: exercises every message's reader.
      setU32(bytes, 0, control::kFrameMagic);
      setU32(bytes, 4, control::kProtocolVersion | static_cast<uint32_t>(random() % 13) << 16);
      setU32(bytes, 8, static_cast<uint32_t>(bytes.size() - control::kFrameHeaderBytes));
    }
    if (decode(bytes) == control::DecodeResult::kFrame) {
      EXPECT_LE(used, bytes.size());
    }
  }
  // A stream decoder stays failed after an error.
  control::FrameDecoder decoder;
  std::vector<uint8_t> junk = {1, 2, 3, 4, 5};
  decoder.append(junk.data(), junk.size());
  EXPECT_EQ(decoder.next(&m, &error), control::DecodeResult::kError);
  decoder.append(frame.data(), frame.size());
  EXPECT_EQ(decoder.next(&m, &error), control::DecodeResult::kError);
}

// ---------------------------------------------------------- reconciliation

std::vector<control::SeatHealth> allActiveOnline(int n) {
  return std::vector<control::SeatHealth>(static_cast<size_t>(n), control::SeatHealth{true, true});
}

TEST(ControlReconciliation, WitnessedSeatsGoMutualAccusationsCostOneSeat) {
  // 0 reports 2: 0 is not reported, so 2 goes.
  EXPECT_EQ(control::seatsToDeactivate(allActiveOnline(4), {{0, {2}}}), std::vector<int>{2});
  // 1 and 2 report each other: only the higher goes.
  EXPECT_EQ(control::seatsToDeactivate(allActiveOnline(4), {{1, {2}}, {2, {1}}}), std::vector<int>{2});
  // A cycle 0 -> 1 -> 2 -> 0: the highest.
  EXPECT_EQ(control::seatsToDeactivate(allActiveOnline(4), {{0, {1}}, {1, {2}}, {2, {0}}}), std::vector<int>{2});
  // 1 <-> 2 and 3 (a clean witness) reports 2: 2 goes, 1 stays.
  EXPECT_EQ(control::seatsToDeactivate(allActiveOnline(4), {{1, {2}}, {2, {1}}, {3, {2}}}), std::vector<int>{2});
  // 0 and 1 both report 3: 3 goes alone.
  EXPECT_EQ(control::seatsToDeactivate(allActiveOnline(4), {{0, {3}}, {1, {3}}}), std::vector<int>{3});
  // Offline Active seats go even without reports; reports from Inactive
  // reporters and about Inactive seats count for nothing.
  auto seats = allActiveOnline(4);
  seats[1].online = false;
  seats[3].active = false;
  EXPECT_EQ(control::seatsToDeactivate(seats, {{3, {0}}, {0, {3}}}), std::vector<int>{1});
  EXPECT_TRUE(control::seatsToDeactivate(allActiveOnline(2), {}).empty());
}

// ---------------------------------------------- the state machine alone

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
      send(g + 1, control::Hello{g, 0});
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
    send(session, control::Hello{g, 0});
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

TEST(ControlCoordinatorState, ProposalsQueueBehindTheBarrierInFlight) {
  StateMachine machine;
  machine.found("q", 3);
  // Seat 1 proposes to deactivate seat 2: epoch 2 goes to all three, and
  // the answer waits for their acknowledgements.
  auto first = machine.send(2, control::ProposeRequest{10, "q", false, {2}});
  auto pushes = StateMachine::sent<control::ViewPush>(first);
  ASSERT_EQ(pushes.size(), 3u);
  EXPECT_EQ(pushes[0].second.view.epoch, 2u);
  EXPECT_TRUE(StateMachine::sent<control::ProposeReply>(first).empty());
  // A second proposal waits its turn: nothing happens yet.
  auto second = machine.send(1, control::ProposeRequest{11, "q", false, {1}});
  EXPECT_TRUE(second.sends.empty());
  machine.send(1, control::ViewAck{"q", 2});
  machine.send(2, control::ViewAck{"q", 2});
  // The last acknowledgement answers the first and admits the second.
  auto next = machine.send(3, control::ViewAck{"q", 2});
  auto replies = StateMachine::sent<control::ProposeReply>(next);
  ASSERT_EQ(replies.size(), 1u);
  EXPECT_EQ(replies[0].first, 2u);
  EXPECT_EQ(replies[0].second.request_id, 10u);
  EXPECT_EQ(replies[0].second.response.status, ProposalStatus::Applied);
  EXPECT_EQ(replies[0].second.response.new_epoch, 2);
  pushes = StateMachine::sent<control::ViewPush>(next);
  ASSERT_EQ(pushes.size(), 3u);  // seat 2 is Inactive but still hears about the group
  EXPECT_EQ(pushes[0].second.view.epoch, 3u);
  EXPECT_EQ(pushes[0].second.view.activeRanks(), std::vector<int>{0});
  // Its barrier covers the old and new active sets (seats 0 and 1), not seat 2.
  machine.send(1, control::ViewAck{"q", 3});
  auto done = machine.send(2, control::ViewAck{"q", 3});
  replies = StateMachine::sent<control::ProposeReply>(done);
  ASSERT_EQ(replies.size(), 1u);
  EXPECT_EQ(replies[0].second.request_id, 11u);
  EXPECT_EQ(replies[0].second.response.new_epoch, 3);
}

// Link evidence: seats 0 and 1 found the group (3 seats), global rank 2
// joins seat 2; everyone reports links. Session 1 proposes the activation.
class LinkEvidence : public ::testing::Test {
 protected:
  void SetUp() override {
    machine.found("l", 2, 3, /*reports_links=*/true);
    machine.join("l", 2, 3, /*reports_links=*/true);
  }
  control::Effects report(int global_rank, std::vector<int32_t> reached, std::vector<int32_t> unreached = {}) {
    return machine.send(global_rank + 1, control::LinkReport{"l", std::move(reached), std::move(unreached)});
  }
  static std::optional<control::ProposeReply> answer(const control::Effects& effects) {
    auto replies = StateMachine::sent<control::ProposeReply>(effects);
    if (replies.empty()) return std::nullopt;
    return replies[0].second;
  }
  static bool activated(const control::Effects& effects) {
    for (const auto& [to, push] : StateMachine::sent<control::ViewPush>(effects)) {
      if (push.view.isActive(2)) return true;
    }
    return false;
  }
  StateMachine machine;
};

TEST_F(LinkEvidence, ActivationWaitsUntilTheJoinerIsConnectedBothWays) {
  EXPECT_EQ(machine.rankState(2), RankState::kSynced);  // AwaitingActivation, no evidence yet
  EXPECT_EQ(machine.rankState(0), RankState::kHealthy);
  EXPECT_EQ(machine.rankState(7), RankState::kOffline);
  auto proposed = machine.send(1, control::ProposeRequest{10, "l", true, {2}});
  EXPECT_FALSE(answer(proposed) || activated(proposed));
  // One direction of each pair is not enough.
  auto half = report(2, {0, 1});
  EXPECT_FALSE(answer(half) || activated(half));
  EXPECT_EQ(machine.rankState(2), RankState::kSynced);
  auto three_quarters = report(0, {2});
  EXPECT_FALSE(answer(three_quarters) || activated(three_quarters));
  // The last missing link admits it: the new view shows seat 2 Active.
  auto complete = report(1, {2});
  EXPECT_TRUE(activated(complete));
  EXPECT_EQ(machine.rankState(2), RankState::kHealthy);
}

TEST_F(LinkEvidence, ALinkReportedUnreachableRejectsTheActivationAtOnceWithTheReason) {
  report(2, {0, 1});
  report(0, {2});
  report(1, {}, {2});  // seat 1 cannot reach the joiner's endpoint
  auto proposed = machine.send(1, control::ProposeRequest{10, "l", true, {2}});
  auto reply = answer(proposed);
  ASSERT_TRUE(reply.has_value());
  EXPECT_FALSE(activated(proposed));
  EXPECT_EQ(reply->response.status, ProposalStatus::Rejected);
  const std::string& why = reply->response.reject_reason;
  EXPECT_NE(why.find("not be connected both ways"), std::string::npos) << why;
  EXPECT_NE(why.find("unreachable: 1->2"), std::string::npos) << why;
  EXPECT_NE(why.find("seat 2 (global rank 2) is Synced"), std::string::npos) << why;
}

TEST_F(LinkEvidence, MissingEvidenceRejectsTheActivationAtTheLinkTimeout) {
  report(2, {0, 1});
  report(0, {2});  // seat 1 never reports
  auto proposed = machine.send(1, control::ProposeRequest{10, "l", true, {2}});
  EXPECT_FALSE(answer(proposed));
  EXPECT_FALSE(answer(machine.advance(400ms)));  // link_timeout is 500 ms
  auto expired = machine.advance(200ms);
  auto reply = answer(expired);
  ASSERT_TRUE(reply.has_value());
  EXPECT_FALSE(activated(expired));
  EXPECT_EQ(reply->response.status, ProposalStatus::Rejected);
  EXPECT_NE(reply->response.reject_reason.find("no link evidence within link_timeout (500 ms) for 1->2"),
            std::string::npos)
      << reply->response.reject_reason;
}

TEST_F(LinkEvidence, EvidenceAboutASeatIsForgottenWhenAnotherProcessTakesIt) {
  report(2, {0, 1});
  report(0, {2});
  report(1, {2});
  EXPECT_EQ(machine.rankState(2), RankState::kHealthy);
  machine.disconnect(3);  // the joiner dies before anyone activates it
  EXPECT_EQ(machine.rankState(2), RankState::kOffline);
  machine.join("l", 2, 3, /*reports_links=*/true, /*session=*/4);  // its replacement
  EXPECT_EQ(machine.rankState(2), RankState::kSynced);
  auto proposed = machine.send(1, control::ProposeRequest{10, "l", true, {2}});
  EXPECT_FALSE(answer(proposed) || activated(proposed));  // the old process's links prove nothing
  machine.send(4, control::LinkReport{"l", {0, 1}, {}});     // the replacement's own
  report(0, {2});
  EXPECT_TRUE(activated(report(1, {2})));
}

TEST_F(LinkEvidence, ProcessesThatDoNotReportLinksAreActivatedWithoutEvidence) {
  StateMachine plain;
  plain.found("p", 2, 3);
  plain.join("p", 2, 3, /*reports_links=*/false);
  auto proposed = plain.send(1, control::ProposeRequest{10, "p", true, {2}});
  EXPECT_TRUE(activated(proposed));
}

// ------------------------------------------------------ bootstrap, views

TEST_F(ControlPlane, FoundersGetTheSameFoundingView) {
  start();
  Members members = found("g", 3, 4);
  ASSERT_EQ(members.size(), 3u);
  for (const auto& member : members) {
    const GroupView& view = member->view;
    EXPECT_EQ(view.epoch, 1u);
    EXPECT_EQ(view.key, "g");
    EXPECT_FALSE(view.uid.empty());
    EXPECT_EQ(view.uid, members[0]->view.uid);
    EXPECT_EQ(view.members, (std::vector<MemberState>{MemberState::kActive, MemberState::kActive, MemberState::kActive,
                                                      MemberState::kNone}));
    EXPECT_EQ(view.global_ranks, (std::vector<int>{0, 1, 2, -1}));
    EXPECT_EQ(view.endpoints, (std::vector<std::string>{"endpoint-of-0", "endpoint-of-1", "endpoint-of-2", ""}));
    EXPECT_EQ(view.hosts[2], "host-2");
    EXPECT_EQ(view.online, (std::vector<bool>{true, true, true, false}));
    EXPECT_EQ(member->agent->view("g").epoch, 1u);
  }
}

TEST_F(ControlPlane, FounderOfflineDuringBootstrapFailsTheOthersAtOnce) {
  ControlOptions options = testOptions();
  options.request_timeout = 5000ms;
  start(options);
  Members members = connectAll({0, 1});
  auto results = registerAsync(members, "boot", {0, 1, 2, 3}, 4);
  std::this_thread::sleep_for(100ms);
  // Global rank 2 registers its founder seat and its process is gone
  // (end of stream right after the registration, in that order).
  auto started = SteadyClock::now();
  {
    RawPeer peer(address());
    peer.hello(2);
    peer.send(control::RegisterGroupRequest{1, registration("boot", 2, {0, 1, 2, 3}, 4)});
  }
  for (auto& result : results) {
    ASSERT_EQ(result.wait_for(2s), std::future_status::ready);
    std::string error = result.get();
    EXPECT_NE(error.find("seat 2 (global rank 2)"), std::string::npos) << error;
    EXPECT_NE(error.find("went offline"), std::string::npos) << error;
  }
  EXPECT_LT(since(started), 1000ms);  // far below request_timeout (5 s)
  // A founder that comes later learns at once that the group cannot form.
  auto late = connect(3);
  std::string error;
  GroupView view;
  started = SteadyClock::now();
  EXPECT_FALSE(late->agent->registerGroup(registration("boot", 3, {0, 1, 2, 3}, 4), nullptr, &view, &error));
  EXPECT_LT(since(started), 500ms);
  EXPECT_NE(error.find("cannot be formed"), std::string::npos) << error;
}

TEST_F(ControlPlane, BootstrapGivesUpAfterRequestTimeoutNamingMissingSeats) {
  ControlOptions options = testOptions();
  options.request_timeout = 300ms;
  start(options);
  Members members = connectAll({5});
  auto started = SteadyClock::now();
  auto results = registerAsync(members, "lonely", {5, 6}, 2);
  ASSERT_EQ(results[0].wait_for(3s), std::future_status::ready);
  std::string error = results[0].get();
  EXPECT_GE(since(started), 250ms);
  EXPECT_NE(error.find("founder seats [1] (global ranks [6]) never registered"), std::string::npos) << error;
}

TEST_F(ControlPlane, FoundersThatDisagreeAreRefused) {
  start();
  Members members = connectAll({0, 1});
  auto first = registerAsync(members, "mismatch", {0, 1}, 2);  // both founders: forms
  for (auto& r : first) ASSERT_EQ(r.get(), "");
  std::string error;
  GroupView view;
  auto other = connect(2);
  // A different max_group_size for a group being formed.
  auto pending = registerAsync(members, "m2", {0, 1, 2}, 4);
  std::this_thread::sleep_for(50ms);
  EXPECT_FALSE(other->agent->registerGroup(registration("m2", 2, {0, 1, 2}, 5), nullptr, &view, &error));
  EXPECT_NE(error.find("disagree"), std::string::npos) << error;
  EXPECT_TRUE(other->agent->registerGroup(registration("m2", 2, {0, 1, 2}, 4), nullptr, &view, &error)) << error;
  for (auto& r : pending) EXPECT_EQ(r.get(), "");
  // A seat whose global rank is not this process's.
  EXPECT_FALSE(other->agent->registerGroup(registration("m3", 0, {0, 2}, 2), nullptr, &view, &error));
  EXPECT_NE(error.find("this process is global rank 2"), std::string::npos) << error;
}

// --------------------------------------------------------------- liveness

TEST_F(ControlPlane, KilledProcessGoesOfflineAtOnce) {
  ChildProcess child([](const std::string& address, ChildProcess& self) {
    auto agent = childFounder(address, self, "kill", 2, {0, 1, 2}, 3);
    for (;;) ::pause();
  });
  start();
  Members members = connectAll({0, 1});
  child.go(address());
  auto results = registerAsync(members, "kill", {0, 1, 2}, 3);
  ASSERT_EQ(child.nextReport(5s), "registered");
  for (auto& r : results) ASSERT_EQ(r.get(), "");

  auto killed = SteadyClock::now();
  child.signal(SIGKILL);
  for (auto& member : members) {
    auto view = member->log.waitFor([](const GroupView& v) { return v.members[2] == MemberState::kInactive; });
    ASSERT_TRUE(view.has_value());
    EXPECT_FALSE(view->online[2]);
    EXPECT_EQ(view->epoch, 2u);
    EXPECT_EQ(view->activeRanks(), (std::vector<int>{0, 1}));
  }
  // End of stream: no waiting for the heartbeat timeout (1 s).
  EXPECT_LT(since(killed), 500ms);
}

TEST_F(ControlPlane, StalledProcessGoesOfflineAtTheHeartbeatTimeout) {
  ChildProcess child([](const std::string& address, ChildProcess& self) {
    auto agent = childFounder(address, self, "stall", 1, {0, 1}, 2);
    ::raise(SIGSTOP);  // alive, connected, silent
    for (;;) ::pause();
  });
  start();
  Members members = connectAll({0});
  child.go(address());
  auto results = registerAsync(members, "stall", {0, 1}, 2);
  ASSERT_EQ(child.nextReport(5s), "registered");
  ASSERT_EQ(results[0].get(), "");
  ASSERT_TRUE(child.waitStopped(5s));
  auto stopped = SteadyClock::now();
  auto view = members[0]->log.waitFor(seatIs(1, MemberState::kInactive), 3s);
  Ms detected = since(stopped);
  ASSERT_TRUE(view.has_value());
  EXPECT_FALSE(view->online[1]);
  EXPECT_GE(detected, 800ms);   // not before ~heartbeat_timeout (1 s)
  EXPECT_LT(detected, 1500ms);  // nor much after
}

TEST_F(ControlPlane, ReplacementWaitsForItsPredecessorThenFails) {
  ControlOptions options = testOptions();
  options.heartbeat_timeout = 300ms;
  start(options);
  auto old = connect(1);
  // The old process keeps heartbeating: the new one is refused after
  // heartbeat_timeout, with a clear reason.
  std::string error;
  auto started = SteadyClock::now();
  EXPECT_EQ(Agent::connect(address(), 1, options_, &error), nullptr);
  EXPECT_GE(since(started), 250ms);
  EXPECT_LT(since(started), 1500ms);
  EXPECT_NE(error.find("still held by a live process"), std::string::npos) << error;
  // A replacement whose predecessor leaves while it waits is accepted then.
  auto replacement = std::async(std::launch::async, [&] {
    std::string why;
    return Agent::connect(address(), 1, options_, &why);
  });
  std::this_thread::sleep_for(100ms);
  started = SteadyClock::now();
  old.reset();
  ASSERT_EQ(replacement.wait_for(2s), std::future_status::ready);
  EXPECT_NE(replacement.get(), nullptr);
  EXPECT_LT(since(started), 500ms);  // when the old one left, not at the end of the wait
}

// ------------------------------------------------------- failure evidence

TEST_F(ControlPlane, ReportedSeatIsDeactivatedWhenTheWindowCloses) {
  start();
  Members members = found("report", 3, 3);
  auto reported = SteadyClock::now();
  members[0]->agent->reportFailure("report", {2});  // 2 stalls in the data plane but is online
  for (auto& member : members) {
    auto view = member->log.waitFor(seatIs(2, MemberState::kInactive));
    ASSERT_TRUE(view.has_value());
    EXPECT_TRUE(view->online[2]);
    EXPECT_EQ(view->epoch, 2u);
    EXPECT_EQ(view->activeRanks(), (std::vector<int>{0, 1}));
  }
  EXPECT_GE(since(reported), 40ms);  // the window (50 ms) collected evidence first
  EXPECT_LT(since(reported), 1000ms);
}

TEST_F(ControlPlane, MutualReportsDeactivateOnlyTheHigherSeat) {
  ControlOptions options = testOptions();
  options.reconciliation_window = 300ms;  // both reports surely inside it
  start(options);
  Members members = found("mutual", 3, 3);
  members[1]->agent->reportFailure("mutual", {2});
  members[2]->agent->reportFailure("mutual", {1});
  auto view = members[0]->log.waitFor(seatIs(2, MemberState::kInactive));
  ASSERT_TRUE(view.has_value());
  EXPECT_EQ(view->members[1], MemberState::kActive);
  EXPECT_EQ(view->epoch, 2u);  // one decision, one view
}

TEST_F(ControlPlane, WithoutAutoDeactivateReportsChangeNothing) {
  start();
  Members members = found("manual", 3, 3, /*auto_deactivate=*/false);
  members[0]->agent->reportFailure("manual", {2});
  SyncResult result = members[1]->agent->syncAfterFailure("manual", {2});
  EXPECT_EQ(result.response.status, SyncAfterFailureStatus::Reconciled);
  EXPECT_EQ(result.view.epoch, 1u);
  EXPECT_EQ(result.view.activeRanks(), (std::vector<int>{0, 1, 2}));
  EXPECT_TRUE(members[0]->log.views().empty());
  // Deactivation is the framework's call.
  auto response = members[0]->agent->propose("manual", /*activate=*/false, {2});
  EXPECT_EQ(response.status, ProposalStatus::Applied);
  EXPECT_EQ(response.new_epoch, 2);
}

TEST_F(ControlPlane, SyncAfterFailureReconcilesOrReportsNothingPending) {
  ControlOptions options = testOptions();
  options.reconciliation_window = 300ms;
  start(options);
  Members members = found("sync", 3, 3);
  auto started = SteadyClock::now();
  SyncResult quiet = members[0]->agent->syncAfterFailure("sync", {});
  EXPECT_EQ(quiet.response.status, SyncAfterFailureStatus::NoPending);
  EXPECT_EQ(quiet.view.epoch, 1u);
  EXPECT_LT(since(started), 200ms);  // no window to wait for

  started = SteadyClock::now();
  SyncResult reconciled = members[0]->agent->syncAfterFailure("sync", {1});
  EXPECT_GE(since(started), 250ms);  // answered when the window closed
  EXPECT_EQ(reconciled.response.status, SyncAfterFailureStatus::Reconciled);
  EXPECT_EQ(reconciled.view.epoch, 2u);
  EXPECT_EQ(reconciled.view.members[1], MemberState::kInactive);
  // The listener had the view before syncAfterFailure returned.
  auto views = members[0]->log.views();
  ASSERT_FALSE(views.empty());
  EXPECT_EQ(views.back().epoch, 2u);
  EXPECT_EQ(members[0]->agent->view("sync").epoch, 2u);

  SyncResult unknown = members[0]->agent->syncAfterFailure("nonexistent", {});
  EXPECT_EQ(unknown.response.status, SyncAfterFailureStatus::Rejected);
  EXPECT_NE(unknown.response.reject_reason.find("unknown group"), std::string::npos);
  auto stranger = connect(7);
  SyncResult not_member = stranger->agent->syncAfterFailure("sync", {});
  EXPECT_EQ(not_member.response.status, SyncAfterFailureStatus::Rejected);
  EXPECT_NE(not_member.response.reject_reason.find("holds no seat"), std::string::npos);
}

// ------------------------------------------ extension, join, replacement

TEST_F(ControlPlane, ExtensionJoinsInactiveAndIsActivatedByAFounder) {
  start();
  Members members = found("grow", 3, 4);
  members.push_back(connect(3));
  Member& joiner = *members[3];
  std::string error;
  auto registered = SteadyClock::now();
  ASSERT_TRUE(joiner.agent->registerGroup(registration("grow", 3, {0, 1, 2, 3}, 4, /*is_extension=*/true),
                                          joiner.log.listener(), &joiner.view, &error))
      << error;
  EXPECT_LT(since(registered), 200ms);  // at once
  EXPECT_EQ(joiner.view.epoch, 2u);
  EXPECT_EQ(joiner.view.active_epoch, 1u);  // an inactive seat joining changes no active configuration
  EXPECT_EQ(joiner.view.members[3], MemberState::kInactive);
  EXPECT_EQ(joiner.view.global_ranks[3], 3);
  EXPECT_EQ(joiner.view.endpoints[3], "endpoint-of-3");
  for (int founder = 0; founder < 3; ++founder) {
    EXPECT_TRUE(members[founder]->log.waitFor(seatIs(3, MemberState::kInactive)).has_value());
  }

  // The activation waits for the joiner to be ready.
  auto activation = std::async(std::launch::async, [&] { return members[0]->agent->propose("grow", true, {3}); });
  std::this_thread::sleep_for(100ms);
  auto joined = std::async(std::launch::async, [&] {
    std::string why;
    return joiner.agent->joinGroup("grow", 3000ms, &why) ? std::string() : why;
  });
  ASSERT_EQ(activation.wait_for(3s), std::future_status::ready);
  ProposeViewUpdateResponse response = activation.get();
  EXPECT_EQ(response.status, ProposalStatus::Applied) << response.reject_reason;
  EXPECT_EQ(response.new_epoch, 4);  // 3: AwaitingActivation, 4: Active
  ASSERT_EQ(joined.wait_for(3s), std::future_status::ready);
  EXPECT_EQ(joined.get(), "");
  for (auto& member : members) {
    auto view = member->log.waitFor(seatIs(3, MemberState::kActive));
    ASSERT_TRUE(view.has_value());
    EXPECT_EQ(view->epoch, 4u);
    EXPECT_EQ(view->active_epoch, 4u);  // the activation is the first change of the active set since founding
    EXPECT_EQ(view->activeRanks(), (std::vector<int>{0, 1, 2, 3}));
    // Epochs only increase, one view per change.
    auto views = member->log.views();
    for (size_t i = 1; i < views.size(); ++i) EXPECT_GT(views[i].epoch, views[i - 1].epoch);
  }
  EXPECT_TRUE(members[3]->log.waitFor(seatIs(3, MemberState::kAwaitingActivation)).has_value());
}

TEST_F(ControlPlane, ExtensionThatArrivesBeforeTheFoundersWaitsForTheGroup) {
  // A joiner started alongside the founders registers first: it waits for
  // the group to be formed, then attaches Inactive; without founders it is
  // refused at request_timeout.
  start();
  auto joiner = connect(2);
  std::string error;
  GroupView joiner_view;
  auto registered = std::async(std::launch::async, [&] {
    return joiner->agent->registerGroup(registration("early", 2, {0, 1, 2}, 3, /*is_extension=*/true), nullptr,
                                        &joiner_view, &error);
  });
  std::this_thread::sleep_for(100ms);
  EXPECT_EQ(registered.wait_for(0ms), std::future_status::timeout) << "it must wait for the founders";
  Members founders = found("early", 2, 3);
  ASSERT_EQ(registered.wait_for(3s), std::future_status::ready);
  ASSERT_TRUE(registered.get()) << error;
  EXPECT_EQ(joiner_view.members[2], MemberState::kInactive);
  EXPECT_EQ(joiner_view.activeRanks(), (std::vector<int>{0, 1}));

  auto lonely = connect(5);
  auto started = SteadyClock::now();
  GroupView none;
  EXPECT_FALSE(lonely->agent->registerGroup(registration("never", 1, {4, 5}, 2, true), nullptr, &none, &error));
  EXPECT_GE(since(started), options_.request_timeout - 50ms);
  EXPECT_NE(error.find("no group 'never' was formed"), std::string::npos) << error;
}

TEST_F(ControlPlane, RefoundingAfterEveryoneLeftMakesANewIncarnation) {
  // destroy_process_group then init_process_group in the same processes:
  // the first to come back waits until the old incarnation is deserted,
  // then everyone founds a new one (another uid), instead of attaching to
  // the old one as a replacement would.
  start();
  Members members = found("again", 2, 2);
  const std::string old_uid = members[0]->view.uid;
  members[0]->agent->unregisterGroup("again");
  std::string error0;
  GroupView view0;
  auto first = std::async(std::launch::async, [&] {
    return members[0]->agent->registerGroup(registration("again", 0, {0, 1}, 2), nullptr, &view0, &error0);
  });
  std::this_thread::sleep_for(100ms);
  EXPECT_EQ(first.wait_for(0ms), std::future_status::timeout) << "seat 1 still holds the old incarnation";
  members[1]->agent->unregisterGroup("again");
  std::string error1;
  GroupView view1;
  ASSERT_TRUE(members[1]->agent->registerGroup(registration("again", 1, {0, 1}, 2), nullptr, &view1, &error1))
      << error1;
  ASSERT_EQ(first.wait_for(3s), std::future_status::ready);
  ASSERT_TRUE(first.get()) << error0;
  EXPECT_NE(view0.uid, old_uid);
  EXPECT_EQ(view0.uid, view1.uid);
  EXPECT_EQ(view0.activeRanks(), (std::vector<int>{0, 1}));
}

TEST_F(ControlPlane, JoinGroupFailsAtItsDeadlineWithoutActivation) {
  start();
  Members members = found("wait", 2, 3);
  members.push_back(connect(2));
  std::string error;
  ASSERT_TRUE(members[2]->agent->registerGroup(registration("wait", 2, {0, 1, 2}, 3, true), nullptr, &members[2]->view,
                                               &error));
  auto started = SteadyClock::now();
  EXPECT_FALSE(members[2]->agent->joinGroup("wait", 200ms, &error));
  EXPECT_GE(since(started), 190ms);
  EXPECT_LT(since(started), 1000ms);
  EXPECT_NE(error.find("not activated within 200 ms"), std::string::npos) << error;
}

TEST_F(ControlPlane, ReplacementTakesOverTheSeatOfADeadProcess) {
  start();
  Members members = found("replace", 3, 3);
  auto left = SteadyClock::now();
  members[2].reset();  // the destructor disconnects: seen at once
  auto gone = members[0]->log.waitFor(seatIs(2, MemberState::kInactive));
  ASSERT_TRUE(gone.has_value());
  EXPECT_LT(since(left), 500ms);
  EXPECT_FALSE(gone->online[2]);

  members[2] = connect(2);  // the predecessor is offline: accepted at once
  Member& successor = *members[2];
  GroupRegistration takeover = registration("replace", 2, {0, 1, 2}, 3, /*is_extension=*/true);
  takeover.endpoint = "new-endpoint";
  std::string error;
  ASSERT_TRUE(successor.agent->registerGroup(takeover, successor.log.listener(), &successor.view, &error)) << error;
  EXPECT_EQ(successor.view.members[2], MemberState::kInactive);
  EXPECT_TRUE(successor.view.online[2]);
  EXPECT_EQ(successor.view.endpoints[2], "new-endpoint");
  auto seen = members[1]->log.waitFor([](const GroupView& v) { return v.endpoints[2] == "new-endpoint"; });
  ASSERT_TRUE(seen.has_value());
  EXPECT_TRUE(seen->online[2]);

  auto joined = std::async(std::launch::async, [&] {
    std::string why;
    return successor.agent->joinGroup("replace", 3000ms, &why) ? std::string() : why;
  });
  // Activation may race the join: it waits for the seat to be ready.
  ProposeViewUpdateResponse response = members[0]->agent->propose("replace", true, {2});
  EXPECT_EQ(response.status, ProposalStatus::Applied) << response.reject_reason;
  ASSERT_EQ(joined.wait_for(3s), std::future_status::ready);
  EXPECT_EQ(joined.get(), "");
  EXPECT_TRUE(members[1]->log.waitFor(seatIs(2, MemberState::kActive)).has_value());
}

// -------------------------------------------------------------- proposals

TEST_F(ControlPlane, ProcessThatNeverAcknowledgesIsDropped) {
  start();
  std::mutex mutex;
  std::condition_variable release;
  bool released = false;
  Members members = connectAll({0, 1, 2});
  std::vector<std::future<std::string>> results;
  for (int seat = 0; seat < 3; ++seat) {
    Member* member = members[seat].get();
    Agent::ViewListener listener = member->log.listener();
    if (seat == 2) {
      // Seat 2's listener hangs on the next view: its acknowledgement never comes in time.
      listener = [&, inner = listener](const GroupView& view) {
        inner(view);
        std::unique_lock<std::mutex> lock(mutex);
        release.wait_for(lock, 5s, [&] { return released; });
      };
    }
    GroupRegistration r = registration("ack", seat, {0, 1, 2}, 3);
    results.push_back(std::async(std::launch::async, [member, r, listener] {
      std::string error;
      return member->agent->registerGroup(r, listener, &member->view, &error) ? std::string() : error;
    }));
  }
  for (auto& r : results) ASSERT_EQ(r.get(), "");

  auto proposed = SteadyClock::now();
  ProposeViewUpdateResponse response = members[0]->agent->propose("ack", /*activate=*/false, {1});
  Ms took = since(proposed);
  EXPECT_EQ(response.status, ProposalStatus::AppliedWithDroppedRanks) << response.reject_reason;
  EXPECT_EQ(response.dropped_ranks, std::vector<int>{2});
  EXPECT_EQ(response.new_epoch, 3);  // 2: seat 1 Inactive; 3: the dropped seat 2 Inactive and offline
  EXPECT_GE(took, 450ms);            // ack_timeout (500 ms)
  EXPECT_LT(took, 1500ms);
  GroupView view = members[0]->agent->view("ack");  // current when propose returned
  EXPECT_EQ(view.epoch, 3u);
  EXPECT_EQ(view.activeRanks(), std::vector<int>{0});
  EXPECT_FALSE(view.online[2]);
  {
    std::lock_guard<std::mutex> lock(mutex);
    released = true;
  }
  release.notify_all();
}

TEST_F(ControlPlane, InvalidProposalsAreRejectedWithReasons) {
  ControlOptions options = testOptions();
  options.request_timeout = 300ms;
  start(options);
  Members members = found("bad", 2, 4);
  Agent& agent = *members[0]->agent;

  auto outside = agent.propose("bad", true, {7, -1});
  EXPECT_EQ(outside.status, ProposalStatus::Rejected);
  EXPECT_NE(outside.reject_reason.find("[7, -1] outside [0, 4)"), std::string::npos) << outside.reject_reason;
  auto unregistered = agent.propose("bad", false, {1, 3});
  EXPECT_EQ(unregistered.status, ProposalStatus::Rejected);
  EXPECT_NE(unregistered.reject_reason.find("[3] never registered"), std::string::npos) << unregistered.reject_reason;
  auto unknown = agent.propose("nonexistent", true, {0});
  EXPECT_EQ(unknown.status, ProposalStatus::Rejected);
  EXPECT_NE(unknown.reject_reason.find("unknown group"), std::string::npos);

  // Nothing to change: Applied at the current epoch.
  auto nothing = agent.propose("bad", true, {0, 1});
  EXPECT_EQ(nothing.status, ProposalStatus::Applied);
  EXPECT_EQ(nothing.new_epoch, 1);
  EXPECT_EQ(agent.propose("bad", false, {}).status, ProposalStatus::Applied);

  // A registered seat that never joins: not admitted within request_timeout.
  members.push_back(connect(2));
  std::string error;
  ASSERT_TRUE(
      members[2]->agent->registerGroup(registration("bad", 2, {0, 1, 2}, 4, true), nullptr, &members[2]->view, &error));
  auto started = SteadyClock::now();
  auto waited = agent.propose("bad", true, {2});
  EXPECT_GE(since(started), 250ms);
  EXPECT_EQ(waited.status, ProposalStatus::Rejected);
  EXPECT_NE(waited.reject_reason.find("seats [2] are not AwaitingActivation, online and with an endpoint (2 is Inactive)"),
            std::string::npos)
      << waited.reject_reason;
}

// ---------------------------------------------------- leaving, coordinator

TEST_F(ControlPlane, UnregisteringAnActiveSeatTellsTheOthers) {
  start();
  Members members = found("leave", 3, 3);
  members[1]->agent->unregisterGroup("leave");
  for (int other : {0, 2}) {
    auto view = members[other]->log.waitFor(seatIs(1, MemberState::kLeft));
    ASSERT_TRUE(view.has_value());
    EXPECT_EQ(view->activeRanks(), (std::vector<int>{0, 2}));
    EXPECT_EQ(view->endpoints[1], "");
  }
  EXPECT_TRUE(members[1]->log.views().empty());  // the leaver hears nothing more
  EXPECT_EQ(members[1]->agent->view("leave").epoch, 0u);
}

TEST_F(ControlPlane, LostCoordinatorFailsPendingCallsPromptly) {
  ControlOptions options = testOptions();
  options.request_timeout = 10000ms;
  start(options);
  Members members = connectAll({0, 1});
  auto results = registerAsync(members, "orphan", {0, 1, 2}, 3);  // waits for founder 2
  std::this_thread::sleep_for(100ms);
  auto lost = SteadyClock::now();
  coordinator_.reset();
  for (auto& r : results) {
    ASSERT_EQ(r.wait_for(2s), std::future_status::ready);
    std::string error = r.get();
    EXPECT_NE(error.find("lost the connection to the coordinator"), std::string::npos) << error;
  }
  EXPECT_LT(since(lost), 500ms);
  // Later calls fail at once.
  auto response = members[0]->agent->propose("orphan", true, {0});
  EXPECT_EQ(response.status, ProposalStatus::Rejected);
  EXPECT_NE(response.reject_reason.find("lost the connection"), std::string::npos);
}

TEST_F(ControlPlane, CoordinatorDropsPeersThatSendGarbageAndCarriesOn) {
  start();
  RawPeer garbage(address());
  garbage.sendBytes({'G', 'E', 'T', ' ', '/', ' ', 'H', 'T', 'T', 'P'});
  EXPECT_TRUE(garbage.closedByPeer(1s));
  RawPeer rude(address());
  rude.send(control::ViewAck{"x", 1});  // before Hello
  EXPECT_TRUE(rude.closedByPeer(1s));
  Members members = found("after", 2, 2);
  EXPECT_EQ(members[0]->view.epoch, 1u);
}

}  // namespace
}  // namespace mooncake::pg

namespace mooncake::pg {
namespace {

// ------------------------------------------------- failover: the successor

// The view every process of a 4-seat group "t" (global ranks 0..3) had when
// the coordinator in global rank 0's process was lost.
GroupView lastView(uint64_t epoch) {
  GroupView view;
  view.key = "t";
  view.uid = "old-7";
  view.epoch = epoch;
  view.active_epoch = 3;
  view.members.assign(4, MemberState::kActive);
  view.global_ranks = {0, 1, 2, 3};
  for (int g = 0; g < 4; ++g) {
    view.endpoints.push_back("endpoint-of-" + std::to_string(g));
    view.hosts.push_back("host-" + std::to_string(g));
  }
  view.online.assign(4, true);
  return view;
}

// Global rank g (session g + 1) rejoins the successor with its seat g of "t".
control::Effects rejoin(StateMachine& machine, int g, uint64_t epoch, bool auto_deactivate = true) {
  machine.state().onConnected(machine.now(), g + 1);
  control::Effects effects = machine.send(g + 1, control::Hello{g, 0, "standby-" + std::to_string(g), true, 1});
  control::Effects more = machine.send(
      g + 1, control::Rejoin{registration("t", g, {0, 1, 2, 3}, 4, false, auto_deactivate), lastView(epoch)});
  effects.sends.insert(effects.sends.end(), more.sends.begin(), more.sends.end());
  effects.disconnects.insert(effects.disconnects.end(), more.disconnects.begin(), more.disconnects.end());
  return effects;
}

std::vector<std::string> replyErrors(const control::Effects& effects) {
  std::vector<std::string> errors;
  for (const auto& [to, reply] : StateMachine::sent<control::Reply>(effects)) errors.push_back(reply.error);
  return errors;
}

TEST(ControlTakeOver, SuccessorRebuildsTheGroupsAndFailsTheLostCoordinatorsSeats) {
  StateMachine machine;
  machine.state().setHostRank(1);
  machine.state().beginTakeOver(machine.now(), {1, 2, 3}, 0);
  // Nothing is answered until every expected process has rejoined.
  EXPECT_TRUE(replyErrors(rejoin(machine, 1, 5)).empty());
  EXPECT_TRUE(replyErrors(rejoin(machine, 2, 4)).empty());  // its push of epoch 5 was in flight
  auto done = rejoin(machine, 3, 5);
  EXPECT_EQ(replyErrors(done), (std::vector<std::string>{"", "", ""}));
  auto pushes = StateMachine::sent<control::ViewPush>(done);
  ASSERT_EQ(pushes.size(), 3u);
  for (const auto& [to, push] : pushes) {
    const GroupView& view = push.view;
    EXPECT_EQ(view.epoch, 6u);  // above the highest reported
    EXPECT_EQ(view.uid, "old-7");  // the same incarnation: data-plane names go on
    EXPECT_EQ(view.members[0], MemberState::kInactive);
    EXPECT_FALSE(view.online[0]);
    EXPECT_EQ(view.activeRanks(), (std::vector<int>{1, 2, 3}));
    EXPECT_EQ(view.active_epoch, 6u);
    EXPECT_EQ(view.endpoints[2], "endpoint-of-2");
  }
  // The candidates now: everyone online but the new coordinator's process.
  auto standbys = StateMachine::sent<control::Standbys>(done);
  ASSERT_FALSE(standbys.empty());
  EXPECT_EQ(standbys.back().second.coordinator_rank, 1);
  EXPECT_EQ(standbys.back().second.ranks, (std::vector<int32_t>{2, 3}));
  EXPECT_EQ(standbys.back().second.addresses, (std::vector<std::string>{"standby-2", "standby-3"}));
  EXPECT_EQ(machine.rankState(2), RankState::kHealthy);  // active and connected to the successor

  // It serves: a sync, a proposal, and a replacement of global rank 0.
  machine.send(3, control::SyncRequest{9, "t", {0}});
  auto synced = machine.advance(100ms);
  auto syncs = StateMachine::sent<control::SyncReply>(synced);
  ASSERT_EQ(syncs.size(), 1u);
  EXPECT_NE(syncs[0].second.response.status, SyncAfterFailureStatus::Rejected);
  machine.state().onConnected(machine.now(), 10);
  EXPECT_EQ(replyErrors(machine.send(10, control::Hello{0, 0})), std::vector<std::string>{""});
  auto attached = machine.send(10, control::RegisterGroupRequest{1, registration("t", 0, {0, 1, 2, 3}, 4, true)});
  auto replies = StateMachine::sent<control::Reply>(attached);
  ASSERT_EQ(replies.size(), 1u);
  EXPECT_EQ(replies[0].second.error, "");
  ASSERT_TRUE(replies[0].second.view.has_value());
  EXPECT_EQ(replies[0].second.view->members[0], MemberState::kInactive);
  EXPECT_TRUE(replies[0].second.view->online[0]);
  EXPECT_EQ(replies[0].second.view->epoch, 7u);
}

TEST(ControlTakeOver, WithoutAutoDeactivateTheLostSeatsStayActiveButOffline) {
  StateMachine machine;
  machine.state().setHostRank(1);
  // Only 1 and 2 were told as candidates (the list is capped), but the
  // views show global rank 3 online too: it is waited for, until the deadline.
  machine.state().beginTakeOver(machine.now(), {1, 2}, 0);
  rejoin(machine, 1, 5, /*auto_deactivate=*/false);
  EXPECT_TRUE(replyErrors(rejoin(machine, 2, 5, /*auto_deactivate=*/false)).empty());
  auto done = machine.advance(1100ms);
  EXPECT_EQ(replyErrors(done), (std::vector<std::string>{"", ""}));  // 2 of 3: a majority
  auto pushes = StateMachine::sent<control::ViewPush>(done);
  ASSERT_EQ(pushes.size(), 2u);
  EXPECT_EQ(pushes[0].second.view.activeRanks(), (std::vector<int>{0, 1, 2, 3}));
  EXPECT_EQ(pushes[0].second.view.online, (std::vector<bool>{false, true, true, false}));
}

TEST(ControlTakeOver, ProcessesThatDoNotRejoinInTimeAreFailedAndRefusedLater) {
  StateMachine machine;
  machine.state().setHostRank(1);
  machine.state().beginTakeOver(machine.now(), {1, 2, 3}, 0);
  rejoin(machine, 1, 5);
  EXPECT_TRUE(replyErrors(rejoin(machine, 2, 5)).empty());
  EXPECT_TRUE(replyErrors(machine.advance(500ms)).empty());
  auto done = machine.advance(600ms);  // failover_timeout (1 s) passed: 2 of 3 is a majority
  EXPECT_EQ(replyErrors(done), (std::vector<std::string>{"", ""}));
  auto pushes = StateMachine::sent<control::ViewPush>(done);
  ASSERT_EQ(pushes.size(), 2u);
  EXPECT_EQ(pushes[0].second.view.activeRanks(), (std::vector<int>{1, 2}));
  // The late one is refused: its seat went through the failure path.
  auto late = rejoin(machine, 3, 5);
  ASSERT_EQ(replyErrors(late).size(), 1u);
  EXPECT_NE(replyErrors(late)[0].find("completed without this process"), std::string::npos);
}

TEST(ControlTakeOver, WithoutAMajorityEveryoneIsRefusedNowAndLater) {
  // A process cut off alone finds itself first in line: it must not found a
  // membership of its own.
  StateMachine machine;
  machine.state().setHostRank(1);
  machine.state().beginTakeOver(machine.now(), {1, 2, 3}, 0);
  rejoin(machine, 1, 5);
  auto done = machine.advance(1100ms);
  auto errors = replyErrors(done);
  ASSERT_EQ(errors.size(), 1u);
  EXPECT_NE(errors[0].find("no majority"), std::string::npos) << errors[0];
  EXPECT_EQ(done.disconnects, std::vector<control::SessionId>{2});
  EXPECT_TRUE(StateMachine::sent<control::ViewPush>(done).empty());
  machine.state().onConnected(machine.now(), 20);
  errors = replyErrors(machine.send(20, control::Hello{2, 0}));
  ASSERT_EQ(errors.size(), 1u);
  EXPECT_NE(errors[0].find("could not take over"), std::string::npos) << errors[0];
}

TEST(ControlTakeOver, CandidatesAreTheLowestEightAndToldAgainOnlyWhenTheyChange) {
  StateMachine machine;
  machine.state().setHostRank(0);
  control::Effects last;
  for (int g = 0; g < 11; ++g) {
    machine.state().onConnected(machine.now(), g + 1);
    last = machine.send(g + 1, control::Hello{g, 0, "standby-" + std::to_string(g)});
  }
  // The eleventh changes nothing: only it is told.
  auto told = StateMachine::sent<control::Standbys>(last);
  ASSERT_EQ(told.size(), 1u);
  EXPECT_EQ(told[0].first, 11u);
  EXPECT_EQ(told[0].second.coordinator_rank, 0);
  EXPECT_EQ(told[0].second.ranks, (std::vector<int32_t>{1, 2, 3, 4, 5, 6, 7, 8}));
  // A candidate goes: everyone is told the new list.
  control::Effects gone;
  machine.state().onDisconnected(machine.now(), 3, "test", &gone);
  told = StateMachine::sent<control::Standbys>(gone);
  ASSERT_EQ(told.size(), 10u);
  EXPECT_EQ(told[0].second.ranks, (std::vector<int32_t>{1, 3, 4, 5, 6, 7, 8, 9}));
  // A process that is no candidate goes: nobody is told.
  gone = {};
  machine.state().onDisconnected(machine.now(), 11, "test", &gone);
  EXPECT_TRUE(StateMachine::sent<control::Standbys>(gone).empty());
}

TEST(ControlTakeOver, NewProcessesAreRefusedWhileTheSuccessorWaitsForTheOthers) {
  StateMachine machine;
  machine.state().setHostRank(1);
  machine.state().beginTakeOver(machine.now(), {1, 2}, 0);
  machine.state().onConnected(machine.now(), 30);
  auto errors = replyErrors(machine.send(30, control::Hello{7, 0}));
  ASSERT_EQ(errors.size(), 1u);
  EXPECT_NE(errors[0].find("taking over"), std::string::npos) << errors[0];
}

// ------------------------------------- failover: over sockets, a real kill

// Global rank 0 (coordinator and agent) runs in a child, which gets `sig`
// (SIGKILL: its sockets close; SIGSTOP: it falls silent) once the group
// formed; the survivors must be served by the successor within `limit`.
void failOverAfter(int sig, Ms limit) {
  ChildProcess child([](const std::string&, ChildProcess& self) {
    std::string error;
    auto coordinator = Coordinator::standby("127.0.0.1", testOptions(), 0, &error);
    if (!coordinator) ::_exit(1);
    coordinator->activate();
    self.report(coordinator->address());
    auto agent = Agent::connect(coordinator->address(), 0, testOptions(), &error, coordinator.get());
    GroupView view;
    if (!agent || !agent->registerGroup(registration("f", 0, {0, 1, 2, 3}, 5), nullptr, &view, &error)) {
      self.report("error: " + error);
      ::_exit(1);
    }
    self.report("registered");
    for (;;) ::pause();
  });
  child.go("start");
  const std::string address = child.nextReport(5s);
  ASSERT_FALSE(address.empty());
  std::vector<std::unique_ptr<Coordinator>> standbys(4);
  Members members(4);
  std::vector<std::future<std::string>> results;
  for (int g = 1; g < 4; ++g) {
    std::string error;
    standbys[g] = Coordinator::standby("127.0.0.1", testOptions(), g, &error);
    ASSERT_NE(standbys[g], nullptr) << error;
    members[g] = std::make_unique<Member>();
    members[g]->agent = Agent::connect(address, g, testOptions(), &error, standbys[g].get());
    ASSERT_NE(members[g]->agent, nullptr) << error;
    Member* member = members[g].get();
    results.push_back(std::async(std::launch::async, [member, g] {
      std::string error;
      bool ok = member->agent->registerGroup(registration("f", g, {0, 1, 2, 3}, 5), member->log.listener(),
                                             &member->view, &error);
      return ok ? std::string() : error;
    }));
  }
  ASSERT_EQ(child.nextReport(5s), "registered");
  for (auto& r : results) ASSERT_EQ(r.get(), "");
  const std::string uid = members[1]->view.uid;
  std::this_thread::sleep_for(100ms);  // the candidates reach every agent

  auto killed = SteadyClock::now();
  child.signal(sig);
  for (int g = 1; g < 4; ++g) {
    auto view = members[g]->log.waitFor(seatIs(0, MemberState::kInactive), 5000ms);
    ASSERT_TRUE(view.has_value()) << "global rank " << g;
    EXPECT_EQ(view->epoch, 2u);
    EXPECT_EQ(view->uid, uid);
    EXPECT_FALSE(view->online[0]);
    EXPECT_EQ(view->activeRanks(), (std::vector<int>{1, 2, 3}));
  }
  EXPECT_LT(since(killed), limit);
  EXPECT_TRUE(standbys[1]->serving());
  EXPECT_FALSE(standbys[2]->serving());

  // The successor serves: a sync, a deactivation, then a replacement of
  // global rank 0 that connects to it and is activated again.
  auto sync = members[2]->agent->syncAfterFailure("f", {0});
  EXPECT_NE(sync.response.status, SyncAfterFailureStatus::Rejected) << sync.response.reject_reason;
  auto member0 = std::make_unique<Member>();
  std::string error;
  member0->agent = Agent::connect(standbys[1]->address(), 0, testOptions(), &error);
  ASSERT_NE(member0->agent, nullptr) << error;
  GroupRegistration again = registration("f", 0, {0, 1, 2, 3}, 5, /*is_extension=*/true);
  ASSERT_TRUE(member0->agent->registerGroup(again, member0->log.listener(), &member0->view, &error)) << error;
  EXPECT_EQ(member0->view.members[0], MemberState::kInactive);
  auto joined = std::async(std::launch::async, [&] {
    std::string why;
    return member0->agent->joinGroup("f", 5000ms, &why) ? std::string() : why;
  });
  ProposeViewUpdateResponse activated;
  for (int attempt = 0; attempt < 20; ++attempt) {
    activated = members[3]->agent->propose("f", true, {0});
    if (activated.status != ProposalStatus::Rejected) break;
    std::this_thread::sleep_for(50ms);
  }
  EXPECT_EQ(activated.status, ProposalStatus::Applied) << activated.reject_reason;
  EXPECT_EQ(joined.get(), "");
  auto back = members[1]->log.waitFor([](const GroupView& v) { return v.isActive(0); });
  ASSERT_TRUE(back.has_value());
  EXPECT_EQ(back->activeRanks(), (std::vector<int>{0, 1, 2, 3}));
  members.clear();
}

TEST(ControlFailover, SurvivorsFailOverWhenTheCoordinatorsProcessIsKilled) {
  failOverAfter(SIGKILL, 900ms);  // closed connections: no waiting for the heartbeat timeout (1 s)
}

TEST(ControlFailover, SurvivorsFailOverWhenTheCoordinatorsProcessFallsSilent) {
  failOverAfter(SIGSTOP, 2500ms);  // the heartbeat timeout (1 s), then the take-over
}

TEST(ControlFailover, AProcessCutOffAloneLearnsItAndNeverTakesOver) {
  // Global rank 1, first in line to succeed, is cut off: it must learn it is
  // cut off, its standby must not serve, and the others' view drops it.
  ChildProcess child([](const std::string& address, ChildProcess& self) {
    std::string error;
    auto standby = Coordinator::standby("127.0.0.1", testOptions(), 1, &error);
    auto agent = Agent::connect(address, 1, testOptions(), &error, standby.get());
    GroupView view;
    if (!agent || !agent->registerGroup(registration("cut", 1, {0, 1, 2}, 3), nullptr, &view, &error)) {
      self.report("error: " + error);
      ::_exit(1);
    }
    std::promise<std::string> told;
    agent->onConnectionLost("cut", [&](const std::string& why) { told.set_value(why); });
    self.report("registered");
    std::this_thread::sleep_for(200ms);  // the candidates reach it
    test_faults::cutTraffic();
    auto future = told.get_future();
    if (future.wait_for(5s) != std::future_status::ready) {
      self.report("not told");
      ::_exit(1);
    }
    self.report(future.get());
    self.report(standby->serving() ? "serving" : "not serving");
    ::_exit(0);
  });
  std::string error;
  auto coordinator = Coordinator::standby("127.0.0.1", testOptions(), 0, &error);
  ASSERT_NE(coordinator, nullptr) << error;
  coordinator->activate();
  std::vector<std::unique_ptr<Coordinator>> standbys;
  Members members;
  std::vector<std::future<std::string>> results;
  for (int g : {0, 2}) {
    members.push_back(std::make_unique<Member>());
    Coordinator* standby = coordinator.get();
    if (g == 2) {
      standbys.push_back(Coordinator::standby("127.0.0.1", testOptions(), 2, &error));
      standby = standbys.back().get();
    }
    members.back()->agent = Agent::connect(coordinator->address(), g, testOptions(), &error, standby);
    ASSERT_NE(members.back()->agent, nullptr) << error;
    Member* member = members.back().get();
    results.push_back(std::async(std::launch::async, [member, g] {
      std::string error;
      bool ok = member->agent->registerGroup(registration("cut", g, {0, 1, 2}, 3), member->log.listener(),
                                             &member->view, &error);
      return ok ? std::string() : error;
    }));
  }
  child.go(coordinator->address());
  ASSERT_EQ(child.nextReport(5s), "registered");
  for (auto& r : results) ASSERT_EQ(r.get(), "");
  const std::string why = child.nextReport(6s);
  EXPECT_NE(why.find("cut off"), std::string::npos) << why;
  EXPECT_EQ(child.nextReport(2s), "not serving");
  for (auto& member : members) {
    auto view = member->log.waitFor(seatIs(1, MemberState::kInactive), 3000ms);
    ASSERT_TRUE(view.has_value());
    EXPECT_EQ(view->activeRanks(), (std::vector<int>{0, 2}));
  }
  EXPECT_FALSE(standbys[0]->serving());
  members.clear();
}

}  // namespace
}  // namespace mooncake::pg
