// A child process with a pipe each way, for tests that drive a peer step by
// step (send it a request, read its answer) and then kill or stop it. The
// child is killed and reaped when its PipedChild goes, stopped or not, so a
// test that fails midway leaves no process behind.
#pragma once

#include <sys/types.h>

#include <chrono>
#include <functional>
#include <optional>
#include <string>
#include <vector>

namespace mooncake::testing {

class PipedChild {
 public:
  // Forks; the child runs body(from_parent, to_parent) on its ends of the
  // pipes and exits with what it returned. Fork before this process starts
  // threads of its own: the child gets a copy of any lock another thread held.
  static PipedChild fork(const std::function<int(int from_parent, int to_parent)>& body);
  // posix_spawns `path` with `argv` (argv[0] included): its stdin is what
  // the parent writes, its stdout what the parent reads; its stderr is ours.
  static PipedChild spawn(const std::string& path, const std::vector<std::string>& argv);

  PipedChild() = default;
  PipedChild(PipedChild&& other) noexcept;
  PipedChild& operator=(PipedChild&& other) noexcept;
  PipedChild(const PipedChild&) = delete;
  PipedChild& operator=(const PipedChild&) = delete;
  ~PipedChild();

  bool started() const { return pid_ > 0; }
  // The parent's ends: what it writes to the child, what it reads from it.
  int toChild() const { return to_child_; }
  int fromChild() const { return from_child_; }

  bool writeAll(const void* data, size_t n) const;
  bool readAll(void* data, size_t n) const;
  // The next line the child writes, without its '\n' (or what came before
  // the pipe ended); nullopt if nothing came by `limit` (or ever, without one)
  // or the pipe ended first. Read a byte at a time, so nothing past the line
  // is taken from the pipe.
  std::optional<std::string> readLine(std::optional<std::chrono::milliseconds> limit = std::nullopt) const;

  void signal(int sig) const;
  // SIGSTOP, returning once the child has stopped (a signal is delivered
  // asynchronously: the child could still answer a request sent right after).
  bool stop() const;
  // True once the child is stopped (by a signal sent before), within `limit`.
  bool waitStopped(std::chrono::milliseconds limit) const;
  // SIGKILL, and reaped.
  void kill();
  // Closes the pipe to the child (the end of its input) and waits for it to
  // exit; its status as exitStatusOf (spawn.h) reports it.
  int closeAndWait();

 private:
  void release();

  pid_t pid_ = -1;
  int to_child_ = -1;
  int from_child_ = -1;
};

// Moves all `n` bytes through `fd` (read or write, looping over partial
// transfers); false at an error or the end of the pipe. For both sides of
// a PipedChild.
bool readAllFrom(int fd, void* data, size_t n);
bool writeAllTo(int fd, const void* data, size_t n);

}  // namespace mooncake::testing
