// The Coordinator's network side: one thread polls the listening socket,
// every Agent connection and a wake-up eventfd, feeds CoordinatorState, and
// carries out its effects. It also heartbeats every connection, so Agents
// notice a stalled Coordinator as the Coordinator notices stalled Agents.
#include <poll.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <condition_variable>
#include <cstdio>
#include <cstring>
#include <map>
#include <mutex>
#include <random>
#include <thread>

#include "control/coordinator_state.h"
#include "control/protocol.h"
#include "control/socket_io.h"
#include "mooncake/pg/control_plane.h"
#include "mooncake/te/auth_opening.h"
#include "mooncake/te/log.h"

namespace mooncake::pg {
namespace control {
namespace {

// An Agent that does not read its messages must not make the Coordinator
// buffer without bound.
constexpr size_t kMaxQueuedBytes = 64u << 20;
// A connection that has not proved the job's secret within this is closed.
constexpr std::chrono::seconds kOpeningTimeout{10};
// Unproven connections held at once; more are closed at accept.
constexpr size_t kMaxPendingOpenings = 256;
// After the process ran out of descriptors, how long the listener is left alone.
constexpr std::chrono::milliseconds kAcceptPause{100};

std::string randomIncarnation() {
  std::random_device device;
  char text[16];
  std::snprintf(text, sizeof(text), "%08x", static_cast<unsigned>(device()));
  return text;
}

class CoordinatorImpl final : public Coordinator {
 public:
  explicit CoordinatorImpl(const ControlOptions& options)
      : options_(options), state_(options, "pg" + randomIncarnation()) {}

  ~CoordinatorImpl() override {
    stopping_ = true;
    uint64_t one = 1;
    if (::write(wake_.get(), &one, sizeof(one)) < 0) {
      // Nothing else to do: the loop also wakes at its next deadline.
    }
    std::thread thread;
    {
      std::lock_guard<std::mutex> lock(start_mutex_);
      thread.swap(thread_);
    }
    if (thread.joinable()) thread.join();
  }

  void setHostRank(int global_rank) { state_.setHostRank(global_rank); }

  // Binds the listener; with `serve`, serves at once.
  bool start(const std::string& host, std::string* error, bool serve = true) {
    uint16_t port = 0;
    listener_ = listenOn(host, &port, error);
    if (!listener_.valid()) return false;
    wake_ = UniqueFd(::eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC));
    if (!wake_.valid()) {
      *error = std::string("eventfd: ") + std::strerror(errno);
      return false;
    }
    address_ = joinHostPort(host, port);
    if (serve) activate();
    return true;
  }

  std::string address() const override { return address_; }

  void activate() override {
    std::lock_guard<std::mutex> lock(start_mutex_);
    if (thread_.joinable() || stopping_) return;
    thread_ = std::thread([this] { run(); });
  }

  void takeOver(const std::vector<int>& candidates, int lost_rank, bool planned) override {
    TakeOverListener listener;
    {
      std::lock_guard<std::mutex> lock(start_mutex_);
      if (thread_.joinable() || stopping_) return;
      // Before the thread starts: nothing else touches the state yet.
      state_.beginTakeOver(Clock::now(), candidates, lost_rank, planned);
      thread_ = std::thread([this] { run(); });
      listener = take_over_listener_;
    }
    if (listener) {
      try {
        listener(address_, planned);
      } catch (const std::exception& e) {
        MC_LOG(Warning) << "control plane coordinator: take-over listener threw: " << e.what();
      } catch (...) {
        MC_LOG(Warning) << "control plane coordinator: take-over listener threw";
      }
    }
  }

  void leave() override {
    {
      std::lock_guard<std::mutex> lock(start_mutex_);
      if (!thread_.joinable() || stopping_) return;  // a standby has nobody to tell
    }
    std::unique_lock<std::mutex> lock(goodbye_mutex_);
    goodbye_requested_ = true;
    uint64_t one = 1;
    if (::write(wake_.get(), &one, sizeof(one)) < 0) {
      // The loop also wakes at its next deadline.
    }
    goodbye_sent_cv_.wait_for(lock, std::chrono::milliseconds(300), [this] { return goodbye_sent_; });
  }

  bool serving() const override {
    std::lock_guard<std::mutex> lock(start_mutex_);
    return thread_.joinable();
  }

  void onTakeOver(TakeOverListener listener) override {
    std::lock_guard<std::mutex> lock(start_mutex_);
    take_over_listener_ = std::move(listener);
  }

 private:
  struct Connection {
    UniqueFd fd;
    // With a secret: the opening still to complete before any message
    // (te/auth_opening.h), and when it must have completed.
    std::unique_ptr<te::auth::ServerOpening> opening;
    TimePoint opening_deadline;
    FrameDecoder decoder;
    std::vector<uint8_t> output;
    size_t output_sent = 0;
    bool closing = false;  // close after one more attempt to send `output`
  };

  void run() {
    next_heartbeat_ = Clock::now();
    while (!stopping_) {
      try {
        step();
      } catch (const std::exception& e) {
        MC_LOG(Warning) << "control plane coordinator: " << e.what();
      }
    }
    for (auto& entry : connections_) ::shutdown(entry.second.fd.get(), SHUT_RDWR);
    connections_.clear();
  }

  void step() {
    const bool accepting = Clock::now() >= accept_paused_until_;
    std::vector<pollfd> polled = {{wake_.get(), POLLIN, 0}, {accepting ? listener_.get() : -1, POLLIN, 0}};
    std::vector<SessionId> polled_sessions;
    for (const auto& [id, connection] : connections_) {
      short events = connection.output.size() > connection.output_sent ? POLLIN | POLLOUT : POLLIN;
      polled.push_back({connection.fd.get(), events, 0});
      polled_sessions.push_back(id);
    }
    TimePoint wake_at = std::min(state_.nextDeadline(), next_heartbeat_);
    if (!accepting) wake_at = std::min(wake_at, accept_paused_until_);
    for (const auto& entry : connections_) {
      if (entry.second.opening) wake_at = std::min(wake_at, entry.second.opening_deadline);
    }
    if (::poll(polled.data(), polled.size(), pollTimeoutMs(wake_at)) < 0 && errno != EINTR) {
      MC_LOG(Warning) << "control plane coordinator: poll: " << std::strerror(errno);
    }
    if (stopping_) return;
    TimePoint now = Clock::now();
    Effects effects;
    if (polled[1].revents != 0) acceptConnections(now);
    for (size_t i = 0; i < polled_sessions.size(); ++i) {
      short revents = polled[i + 2].revents;
      if ((revents & (POLLIN | POLLHUP | POLLERR)) != 0) receive(now, polled_sessions[i], &effects);
    }
    expireOpenings(now);
    state_.onTimer(now, &effects);
    const bool goodbye = queueGoodbyeIfAsked(&effects);
    if (now >= next_heartbeat_) {
      for (const auto& entry : connections_) {
        if (!entry.second.opening) effects.sends.push_back({entry.first, Heartbeat{}});
      }
      next_heartbeat_ = now + options_.heartbeat_interval;
    }
    apply(now, effects);
    if (goodbye) {  // flushed by apply: the caller of leave() may let the process end
      std::lock_guard<std::mutex> lock(goodbye_mutex_);
      goodbye_sent_ = true;
      goodbye_sent_cv_.notify_all();
    }
  }

  // leave(): a Goodbye to every connection, in this round's sends (the
  // frames are tiny: flushed at once). True when queued now.
  bool queueGoodbyeIfAsked(Effects* effects) {
    std::lock_guard<std::mutex> lock(goodbye_mutex_);
    if (!goodbye_requested_ || goodbye_queued_) return false;
    for (const auto& entry : connections_) {
      if (!entry.second.opening) effects->sends.push_back({entry.first, Goodbye{}});
    }
    goodbye_queued_ = true;
    return true;
  }

  void acceptConnections(TimePoint now) {
    for (;;) {
      int fd = ::accept4(listener_.get(), nullptr, nullptr, SOCK_CLOEXEC | SOCK_NONBLOCK);
      if (fd < 0) {
        if (errno == EINTR || errno == ECONNABORTED) continue;
        if (errno == EMFILE || errno == ENFILE || errno == ENOBUFS || errno == ENOMEM) {
          // Out of descriptors or memory: the listener stays readable, so
          // polling it again at once would spin; leave it alone for a while.
          accept_paused_until_ = now + kAcceptPause;
          MC_LOG(Warning) << "control plane coordinator: cannot accept (" << std::strerror(errno)
                          << "); accepting again in " << kAcceptPause.count() << " ms";
        }
        return;  // EAGAIN: all taken; anything else: retried at the next wake-up
      }
      if (pendingOpenings() >= kMaxPendingOpenings) {  // a flood of unproven connections: the newest goes
        ::close(fd);
        ++refusals_;
        continue;
      }
      setNoDelay(fd);
      SessionId id = next_session_++;
      Connection& connection = connections_[id];
      connection.fd = UniqueFd(fd);
      if (options_.secret.empty()) {
        state_.onConnected(now, id);
      } else {  // the state hears of it once it has proved the secret
        connection.opening = std::make_unique<te::auth::ServerOpening>(options_.secret);
        connection.opening_deadline = now + kOpeningTimeout;
      }
    }
  }

  // Reads what is there and hands every complete message to the state.
  void receive(TimePoint now, SessionId id, Effects* effects) {
    auto it = connections_.find(id);
    if (it == connections_.end()) return;
    Connection& connection = it->second;
    uint8_t buffer[64 * 1024];
    for (;;) {
      ssize_t n = ::recv(connection.fd.get(), buffer, sizeof(buffer), MSG_DONTWAIT);
      if (n > 0 && connection.opening) {
        if (!advanceOpening(now, id, connection, buffer, static_cast<size_t>(n))) return;
        if (static_cast<size_t>(n) < sizeof(buffer)) break;
        continue;
      }
      if (n > 0) {
        connection.decoder.append(buffer, static_cast<size_t>(n));
        if (static_cast<size_t>(n) < sizeof(buffer)) break;
        continue;
      }
      if (n < 0 && errno == EINTR) continue;
      if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) break;
      std::string why = n == 0 ? "connection closed" : std::string("connection error: ") + std::strerror(errno);
      if (connection.opening) {  // never known to the state
        // A peer that left before proving anything (a process exiting while
        // it connects, a port probe) is no attack: not a warning.
        refuse(id, connection, "closed before proving the secret", log::Level::kInfo);
        return;
      }
      drop(now, id, why, effects);
      return;
    }
    for (;;) {
      Message message;
      std::string error;
      DecodeResult result = connection.decoder.next(&message, &error);
      if (result == DecodeResult::kNeedMore) return;
      if (result == DecodeResult::kError) {
        drop(now, id, "malformed input: " + error, effects);
        return;
      }
      state_.onMessage(now, id, std::move(message), effects);
      if (connections_.count(id) == 0 || connection.closing) return;
    }
  }

  // Feeds bytes to a connection's opening; false when the connection is gone.
  bool advanceOpening(TimePoint now, SessionId id, Connection& connection, const uint8_t* data, size_t length) {
    std::vector<uint8_t> out;
    switch (connection.opening->feed(data, length, out)) {
      case te::auth::ServerOpening::Step::kNeedMore:
        return true;
      case te::auth::ServerOpening::Step::kReply:
        connection.output.insert(connection.output.end(), out.begin(), out.end());
        return true;
      case te::auth::ServerOpening::Step::kRefused:
        refuse(id, connection, connection.opening->why());
        return false;
      case te::auth::ServerOpening::Step::kDone: {
        std::vector<uint8_t> rest = connection.opening->takeRest();
        if (connection.opening->kind() != kControlPlaneKind) {
          refuse(id, connection, "an authenticated connection of another kind");
          return false;
        }
        connection.opening.reset();
        connection.decoder.append(rest.data(), rest.size());
        state_.onConnected(now, id);
        return true;
      }
    }
    return true;
  }

  // Closes a connection the state never heard of (it did not prove the
  // secret), logged: the first ten, then one in a thousand.
  void refuse(SessionId id, Connection& connection, const std::string& why,
              log::Level level = log::Level::kWarning) {
    ++refusals_;
    if (refusals_ <= 10 || refusals_ % 1000 == 0) {
      MC_LOG_AT(level) << "control plane coordinator: closed a connection: " << why << " (refusal " << refusals_
                       << ")";
    }
    ::shutdown(connection.fd.get(), SHUT_RDWR);
    connections_.erase(id);
  }

  size_t pendingOpenings() const {
    size_t n = 0;
    for (const auto& entry : connections_) n += entry.second.opening ? 1 : 0;
    return n;
  }

  // Connections that have not proved the secret in time.
  void expireOpenings(TimePoint now) {
    std::vector<SessionId> late;
    for (auto& [id, connection] : connections_) {
      if (connection.opening && now >= connection.opening_deadline) late.push_back(id);
    }
    for (SessionId id : late) refuse(id, connections_.at(id), "no authenticated opening in time");
  }

  void drop(TimePoint now, SessionId id, const std::string& why, Effects* effects) {
    connections_.erase(id);
    state_.onDisconnected(now, id, why, effects);
  }

  void apply(TimePoint now, const Effects& effects) {
    for (const Outgoing& outgoing : effects.sends) {
      auto it = connections_.find(outgoing.to);
      if (it == connections_.end() || it->second.closing) continue;
      std::vector<uint8_t> frame = encodeFrame(outgoing.message);
      it->second.output.insert(it->second.output.end(), frame.begin(), frame.end());
    }
    for (SessionId id : effects.disconnects) {
      auto it = connections_.find(id);
      if (it != connections_.end()) it->second.closing = true;
    }
    Effects more;
    std::vector<SessionId> finished;
    for (auto& [id, connection] : connections_) {
      std::string error;
      if (!flush(connection, &error)) {
        finished.push_back(id);
        if (!connection.closing && !connection.opening) state_.onDisconnected(now, id, error, &more);
      } else if (connection.closing) {
        finished.push_back(id);  // after one attempt to send its last words, never waiting on a stalled peer
      }
    }
    for (SessionId id : finished) {
      auto it = connections_.find(id);
      if (it == connections_.end()) continue;
      ::shutdown(it->second.fd.get(), SHUT_RDWR);  // the peer sees the end at once
      connections_.erase(it);
    }
    if (!more.sends.empty() || !more.disconnects.empty()) apply(now, more);
  }

  // Writes what the socket takes now; false when the connection is broken
  // or the Agent has let too much pile up.
  bool flush(Connection& connection, std::string* error) {
    while (connection.output_sent < connection.output.size()) {
      ssize_t n = ::send(connection.fd.get(), connection.output.data() + connection.output_sent,
                         connection.output.size() - connection.output_sent, MSG_NOSIGNAL | MSG_DONTWAIT);
      if (n > 0) {
        connection.output_sent += static_cast<size_t>(n);
        continue;
      }
      if (n < 0 && errno == EINTR) continue;
      if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) break;
      *error = std::string("connection error: ") + std::strerror(errno);
      return false;
    }
    if (connection.output_sent == connection.output.size()) {
      connection.output.clear();
      connection.output_sent = 0;
    } else if (connection.output.size() - connection.output_sent > kMaxQueuedBytes) {
      *error = "does not read its messages (over " + std::to_string(kMaxQueuedBytes >> 20) + " MiB queued)";
      return false;
    }
    return true;
  }

  const ControlOptions options_;
  CoordinatorState state_;
  UniqueFd listener_;
  UniqueFd wake_;
  std::string address_;
  std::atomic<bool> stopping_{false};
  mutable std::mutex start_mutex_;  // guards thread_ (started once) and take_over_listener_
  std::thread thread_;
  TakeOverListener take_over_listener_;
  std::map<SessionId, Connection> connections_;
  SessionId next_session_ = 1;
  uint64_t refusals_ = 0;
  TimePoint accept_paused_until_{};
  std::mutex goodbye_mutex_;  // guards the four below
  bool goodbye_requested_ = false;
  bool goodbye_queued_ = false;
  bool goodbye_sent_ = false;
  std::condition_variable goodbye_sent_cv_;
  TimePoint next_heartbeat_;
};

}  // namespace
}  // namespace control

namespace {

// A coordinator that serves at once (`serve`), or a standby of the process
// of global rank `host_rank` that listens until it takes over.
std::unique_ptr<Coordinator> startCoordinator(const std::string& host, const ControlOptions& options, int host_rank,
                                              bool serve, std::string* error) {
  std::string why;
  try {
    auto coordinator = std::make_unique<control::CoordinatorImpl>(options);
    coordinator->setHostRank(host_rank);
    if (coordinator->start(host, &why, serve)) return coordinator;
  } catch (const std::exception& e) {  // e.g. no thread could be started
    why = e.what();
  }
  if (error != nullptr) {
    *error = std::string("cannot start the ") + (serve ? "" : "standby ") + "control-plane coordinator on " + host +
             ": " + why;
  }
  return nullptr;
}

}  // namespace

std::unique_ptr<Coordinator> Coordinator::start(const std::string& host, const ControlOptions& options,
                                                std::string* error) {
  return startCoordinator(host, options, /*host_rank=*/-1, /*serve=*/true, error);
}

std::unique_ptr<Coordinator> Coordinator::standby(const std::string& host, const ControlOptions& options,
                                                  int host_global_rank, std::string* error) {
  return startCoordinator(host, options, host_global_rank, /*serve=*/false, error);
}

}  // namespace mooncake::pg
