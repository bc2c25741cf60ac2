// The table of memory a segment has registered: what peers may read and write.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <shared_mutex>
#include <string>
#include <vector>

namespace mooncake::te {

struct MemoryRegion {
  uint64_t addr = 0;
  uint64_t length = 0;
  std::string location;  // "cpu:<numa node>" or "cuda:<device ordinal>"
  // False: a source for this process's own transfers only. It is not in the
  // published descriptor, and peers' requests into it are refused.
  bool remote_accessible = true;
  // A receive window (TransferEngine::openReceiveWindow): served to peers'
  // tcp writes marked remote_window, but neither published in the
  // descriptor nor counted as a registration change, so that opening and
  // closing one per receive sends no peer to fetch the descriptor again.
  bool window = false;

  uint64_t end() const { return addr + length; }
  bool contains(uint64_t a, uint64_t len) const {
    return a >= addr && len <= length && a - addr <= length - len;
  }
};

// The CUDA device ordinal a location names ("cuda:3" -> 3), -1 for any other
// location: what transports check to tell GPU memory from host memory.
int cudaDeviceOfLocation(const std::string& location);

// Registered regions, disjoint by construction: a registration that overlaps
// an existing one is refused (kAddressOverlapped). Thread-safe. Readers that
// touch the memory itself (the TCP server copying into a region) do so under
// withRegion(), which pins that one region: its unregistration waits for
// them to finish, while registering or unregistering any other region (or
// a lookup) does not wait for transfers in flight.
class RegionTable {
 public:
  int add(const MemoryRegion& region);
  // All or nothing: on any error nothing is added.
  int addAll(const std::vector<MemoryRegion>& regions);
  // `addr` must be the base address of a registered region. Waits for the
  // withRegion() calls running on it; with `interrupt`, first asks those
  // that can be cut short to give up (their `interrupt` callback), so that
  // a request whose peer went silent mid-payload holds nothing up.
  int remove(uint64_t addr, MemoryRegion* removed = nullptr, bool interrupt = false);

  std::optional<MemoryRegion> find(uint64_t addr, uint64_t length) const;
  // For a peer's request: runs `fn` with the covering region while holding
  // it registered (pinned; the table itself is not locked while fn runs).
  // Returns false (without calling fn) when no region that peers may access
  // covers the range. `interrupt` (optional) makes fn return early (the TCP
  // server shuts the request's connection down); an interrupting remove()
  // calls it, while fn runs and never after.
  bool withRegion(uint64_t addr, uint64_t length, const std::function<void(const MemoryRegion&)>& fn,
                  const std::function<void()>* interrupt = nullptr) const;

  std::vector<MemoryRegion> snapshot() const;
  size_t size() const;

 private:
  // A region and the withRegion() calls running on it.
  struct Entry {
    explicit Entry(const MemoryRegion& r) : region(r) {}
    const MemoryRegion region;
    std::mutex mutex;
    std::condition_variable unpinned;
    int pins = 0;
    std::vector<const std::function<void()>*> interrupts;  // of the pins that can be cut short
  };
  using Map = std::map<uint64_t, std::shared_ptr<Entry>>;
  static bool overlapsLocked(const Map& regions, uint64_t addr, uint64_t length);
  const std::shared_ptr<Entry>* findLocked(uint64_t addr, uint64_t length) const;

  mutable std::shared_mutex mutex_;  // guards the map only, never held while memory is touched
  Map regions_;  // keyed by base address
};

}  // namespace mooncake::te
