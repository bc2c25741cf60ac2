// A POSIX shared-memory object that one process of a host creates and the
// others attach to by name: the rendezvous under every per-host region
// (ShmArena, the CUDA control block, the EP control block). Written once
// here: creating or attaching, the creator's header and the others' check of
// it, every rank publishing its pid and waiting for the rest, unlinking the
// name, and watching the peers' processes (pidfds). Each user keeps only its
// own header fields and checks (AttachedRegion::Handshake).
#pragma once

#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

namespace mooncake::pg {

// The words of one rank that the handshake writes and reads, a member of
// every region's per-rank block (the same bytes the blocks held before as
// `attached` and `pid`).
struct RankPresence {
  std::atomic<uint32_t> attached;  // release: the rank's pid and the user's fields are written
  int32_t pid;
};
static_assert(sizeof(RankPresence) == 8);

// The processes of a region's peers, watched through pidfds: a pidfd turns
// readable once its process exits, so a dead peer is seen even after its pid
// was reused. Where pidfd_open is unavailable, kill(pid, 0) answers instead.
class PeerLiveness {
 public:
  PeerLiveness() = default;
  ~PeerLiveness();
  PeerLiveness(const PeerLiveness&) = delete;
  PeerLiveness& operator=(const PeerLiveness&) = delete;

  // pids[r] is rank r's process; no pidfd is opened for `self` nor for the
  // ranks `skip` names (ranks that take no part).
  void watch(std::vector<int32_t> pids, int self, const std::function<bool(int)>& skip);
  bool alive(int peer) const;
  int32_t pid(int peer) const { return pids_[peer]; }
  // Every rank but `self` whose process has exited.
  std::vector<int> dead() const;

 private:
  int self_ = -1;
  std::vector<int32_t> pids_;
  std::vector<int> pidfds_;
};

// How an error starts when forming stopped because it was superseded
// (AttachedRegion::Handshake::superseded, ShmGroupOptions::superseded).
inline constexpr char kSupersededError[] = "superseded";

class AttachedRegion {
 public:
  // What a user of the region adds to the handshake: where its words are,
  // what its header holds, and what each rank publishes.
  struct Handshake {
    int rank = 0;
    int size = 0;
    int creator = 0;  // the rank that created the region (map(create = true))
    // Ranks that take no part: nobody waits for them, nobody watches them.
    std::function<bool(int)> absent;
    // "rank N" in messages (rank r by default).
    std::function<std::string(int)> rank_name;
    // The creator raises it (release) once write_header has run.
    std::atomic<uint32_t>* ready = nullptr;
    std::function<RankPresence&(int)> presence;
    // The creator: the header's fields (the object is zero-filled).
    std::function<void()> write_header;
    // The others, once `ready`: "" or why their view of the layout differs.
    std::function<std::string()> check_header;
    // Why the header never became ready, as the user words it.
    std::string never_ready;
    // Every rank: its own fields, written before its presence is raised.
    std::function<void()> publish_mine;
    // True once waiting is pointless (ShmGroupOptions::superseded): the
    // handshake then fails at once with kSupersededError.
    std::function<bool()> superseded;
  };

  // The creator makes `name` (exclusively) of `bytes` zeroed bytes; the
  // others retry until it exists with exactly that size, or `deadline`
  // passes (then *error says the creator did not make `what` in time).
  // Returns the mapping, or nullptr with *error set; a creator that fails
  // unlinks the name. `deadline` also bounds the handshake.
  // `superseded` (may be empty) ends the others' wait early, as the handshake's.
  static std::unique_ptr<AttachedRegion> map(const std::string& name, bool create, size_t bytes,
                                             std::chrono::steady_clock::time_point deadline, const std::string& what,
                                             std::string* error, const std::function<bool()>& superseded = {});
  ~AttachedRegion();
  AttachedRegion(const AttachedRegion&) = delete;
  AttachedRegion& operator=(const AttachedRegion&) = delete;

  // The creator writes the header and raises `ready`; the others wait for it
  // and check the header; every rank publishes its pid and fields and waits
  // for every rank taking part, until the deadline of map(). Once all are
  // there, the creator unlinks the name (nothing is left behind) and the
  // peers' processes are watched (peers()). False with *error set otherwise;
  // a creator that times out unlinks the name too.
  bool handshake(const Handshake& steps, std::string* error);

  void* base() const { return base_; }
  size_t bytes() const { return bytes_; }
  template <typename T>
  T* at(size_t offset) const {
    return reinterpret_cast<T*>(static_cast<char*>(base_) + offset);
  }
  const PeerLiveness& peers() const { return peers_; }

 private:
  AttachedRegion() = default;

  std::string name_;
  void* base_ = nullptr;
  size_t bytes_ = 0;
  std::chrono::steady_clock::time_point deadline_;
  PeerLiveness peers_;
};

}  // namespace mooncake::pg
