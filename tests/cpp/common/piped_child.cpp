#include "common/piped_child.h"

#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <thread>
#include <utility>

#include "common/spawn.h"

namespace mooncake::testing {
namespace {

using Clock = std::chrono::steady_clock;

// Both pipes close-on-exec: a spawned child keeps only the ends dup2'd onto
// its stdin and stdout (not the write end of its own input, which would keep
// it from ever seeing the end of it), and no child inherits another's pipes.
bool openPipes(int to_child[2], int from_child[2]) {
  if (::pipe2(to_child, O_CLOEXEC) != 0) return false;
  if (::pipe2(from_child, O_CLOEXEC) != 0) {
    ::close(to_child[0]);
    ::close(to_child[1]);
    return false;
  }
  return true;
}

// What is left until `deadline` as a poll() timeout: rounded up, so that a
// poll does not end just short of it; 0 once it passed (what is already in
// the pipe is still read).
int pollMsUntil(Clock::time_point deadline) {
  const auto left = std::chrono::duration_cast<std::chrono::microseconds>(deadline - Clock::now()).count();
  if (left <= 0) return 0;
  return static_cast<int>(std::min<int64_t>((left + 999) / 1000, 1 << 30));
}

// Calls `io` (::read or ::write) until all `n` bytes went through.
template <class Byte, class Io>
bool allBytes(Io io, int fd, Byte* p, size_t n) {
  while (n > 0) {
    const ssize_t moved = io(fd, p, n);
    if (moved <= 0) return false;
    p += moved;
    n -= static_cast<size_t>(moved);
  }
  return true;
}

}  // namespace

bool readAllFrom(int fd, void* data, size_t n) { return allBytes(::read, fd, static_cast<char*>(data), n); }

bool writeAllTo(int fd, const void* data, size_t n) { return allBytes(::write, fd, static_cast<const char*>(data), n); }

PipedChild PipedChild::fork(const std::function<int(int from_parent, int to_parent)>& body) {
  PipedChild child;
  int to_child[2], from_child[2];
  if (!openPipes(to_child, from_child)) return child;
  child.pid_ = ::fork();
  if (child.pid_ == 0) {
    ::close(to_child[1]);
    ::close(from_child[0]);
    ::_exit(body(to_child[0], from_child[1]));
  }
  ::close(to_child[0]);
  ::close(from_child[1]);
  child.to_child_ = to_child[1];
  child.from_child_ = from_child[0];
  return child;
}

PipedChild PipedChild::spawn(const std::string& path, const std::vector<std::string>& argv) {
  PipedChild child;
  int to_child[2], from_child[2];
  if (!openPipes(to_child, from_child)) return child;
  posix_spawn_file_actions_t actions;
  posix_spawn_file_actions_init(&actions);
  posix_spawn_file_actions_adddup2(&actions, to_child[0], 0);
  posix_spawn_file_actions_adddup2(&actions, from_child[1], 1);
  const pid_t pid = spawnProgram(path, argv, &actions);
  posix_spawn_file_actions_destroy(&actions);
  ::close(to_child[0]);
  ::close(from_child[1]);
  child.pid_ = pid;
  child.to_child_ = to_child[1];
  child.from_child_ = from_child[0];
  return child;
}

PipedChild::PipedChild(PipedChild&& other) noexcept
    : pid_(std::exchange(other.pid_, -1)),
      to_child_(std::exchange(other.to_child_, -1)),
      from_child_(std::exchange(other.from_child_, -1)) {}

PipedChild& PipedChild::operator=(PipedChild&& other) noexcept {
  if (this != &other) {
    release();
    pid_ = std::exchange(other.pid_, -1);
    to_child_ = std::exchange(other.to_child_, -1);
    from_child_ = std::exchange(other.from_child_, -1);
  }
  return *this;
}

PipedChild::~PipedChild() { release(); }

void PipedChild::release() {
  if (to_child_ >= 0) ::close(to_child_);
  if (from_child_ >= 0) ::close(from_child_);
  to_child_ = from_child_ = -1;
  if (pid_ > 0) {
    ::kill(pid_, SIGKILL);
    ::kill(pid_, SIGCONT);  // a stopped child takes SIGKILL too; this is belt and braces
    ::waitpid(pid_, nullptr, 0);
  }
  pid_ = -1;
}

bool PipedChild::writeAll(const void* data, size_t n) const { return writeAllTo(to_child_, data, n); }

bool PipedChild::readAll(void* data, size_t n) const { return readAllFrom(from_child_, data, n); }

std::optional<std::string> PipedChild::readLine(std::optional<std::chrono::milliseconds> limit) const {
  const auto deadline = Clock::now() + limit.value_or(std::chrono::milliseconds(0));
  std::string line;
  for (;;) {
    if (limit) {
      pollfd p{from_child_, POLLIN, 0};
      if (::poll(&p, 1, pollMsUntil(deadline)) <= 0) return std::nullopt;
    }
    char c;
    if (::read(from_child_, &c, 1) != 1) {
      if (line.empty()) return std::nullopt;
      return line;
    }
    if (c == '\n') return line;
    line += c;
  }
}

void PipedChild::signal(int sig) const { ::kill(pid_, sig); }

bool PipedChild::stop() const {
  int status = 0;
  return ::kill(pid_, SIGSTOP) == 0 && ::waitpid(pid_, &status, WUNTRACED) == pid_ && WIFSTOPPED(status);
}

bool PipedChild::waitStopped(std::chrono::milliseconds limit) const {
  const auto deadline = Clock::now() + limit;
  while (Clock::now() < deadline) {
    int status = 0;
    if (::waitpid(pid_, &status, WUNTRACED | WNOHANG) == pid_ && WIFSTOPPED(status)) return true;
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  return false;
}

void PipedChild::kill() {
  ::kill(pid_, SIGKILL);
  ::waitpid(pid_, nullptr, 0);
  pid_ = -1;
}

int PipedChild::closeAndWait() {
  if (to_child_ >= 0) ::close(to_child_);
  to_child_ = -1;
  int status = 0;
  ::waitpid(pid_, &status, 0);
  pid_ = -1;
  return exitStatusOf(status);
}

}  // namespace mooncake::testing
