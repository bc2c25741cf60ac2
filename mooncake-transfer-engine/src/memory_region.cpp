#include "mooncake/te/memory_region.h"

#include <algorithm>
#include <cstdlib>
#include <mutex>

#include "mooncake/te/status.h"

namespace mooncake::te {

int cudaDeviceOfLocation(const std::string& location) {
  constexpr const char kPrefix[] = "cuda:";
  if (location.compare(0, sizeof(kPrefix) - 1, kPrefix) != 0) return -1;
  const char* digits = location.c_str() + sizeof(kPrefix) - 1;
  if (*digits < '0' || *digits > '9') return -1;
  char* end = nullptr;
  long device = std::strtol(digits, &end, 10);
  return *end == '\0' && device < 1024 ? static_cast<int>(device) : -1;
}

bool RegionTable::overlapsLocked(const Map& regions, uint64_t addr, uint64_t length) {
  // The only candidates are the first region starting at or after addr and
  // the last one starting before it.
  auto next = regions.lower_bound(addr);
  if (next != regions.end() && next->first < addr + length) return true;
  if (next != regions.begin()) {
    auto prev = std::prev(next);
    if (prev->second->region.end() > addr) return true;
  }
  return false;
}

int RegionTable::add(const MemoryRegion& region) { return addAll({region}); }

int RegionTable::addAll(const std::vector<MemoryRegion>& regions) {
  Map staged;
  for (const auto& r : regions) {
    if (r.addr == 0 || r.length == 0 || r.addr + r.length < r.addr) return kInvalidArgument;
    if (overlapsLocked(staged, r.addr, r.length)) return kAddressOverlapped;
    staged.emplace(r.addr, std::make_shared<Entry>(r));
  }
  std::unique_lock lock(mutex_);
  for (const auto& [addr, entry] : staged) {
    if (overlapsLocked(regions_, addr, entry->region.length)) return kAddressOverlapped;
  }
  regions_.merge(staged);
  return kOk;
}

int RegionTable::remove(uint64_t addr, MemoryRegion* removed, bool interrupt) {
  std::shared_ptr<Entry> entry;
  {
    std::unique_lock lock(mutex_);
    auto it = regions_.find(addr);
    if (it == regions_.end()) return kAddressNotRegistered;
    entry = std::move(it->second);
    regions_.erase(it);
  }
  // Unlinked: no new withRegion() finds it. Wait for those that did.
  std::unique_lock pins(entry->mutex);
  if (interrupt) {
    // Under the entry's mutex: a pin's callback is valid until it unpins.
    for (const std::function<void()>* cut : entry->interrupts) (*cut)();
  }
  entry->unpinned.wait(pins, [&] { return entry->pins == 0; });
  if (removed != nullptr) *removed = entry->region;
  return kOk;
}

const std::shared_ptr<RegionTable::Entry>* RegionTable::findLocked(uint64_t addr, uint64_t length) const {
  auto it = regions_.upper_bound(addr);
  if (it == regions_.begin()) return nullptr;
  --it;
  return it->second->region.contains(addr, length) ? &it->second : nullptr;
}

std::optional<MemoryRegion> RegionTable::find(uint64_t addr, uint64_t length) const {
  std::shared_lock lock(mutex_);
  const std::shared_ptr<Entry>* entry = findLocked(addr, length);
  if (entry == nullptr) return std::nullopt;
  return (*entry)->region;
}

bool RegionTable::withRegion(uint64_t addr, uint64_t length, const std::function<void(const MemoryRegion&)>& fn,
                             const std::function<void()>* interrupt) const {
  std::shared_ptr<Entry> entry;
  {
    std::shared_lock lock(mutex_);
    const std::shared_ptr<Entry>* found = findLocked(addr, length);
    if (found == nullptr || !(*found)->region.remote_accessible) return false;
    entry = *found;
    // Pinned before the table is let go, so a remove() that unlinks it
    // from now on waits for fn.
    std::lock_guard pin(entry->mutex);
    ++entry->pins;
    if (interrupt != nullptr) entry->interrupts.push_back(interrupt);
  }
  struct Unpin {
    Entry& entry;
    const std::function<void()>* interrupt;
    ~Unpin() {
      std::lock_guard pin(entry.mutex);
      if (interrupt != nullptr) {
        auto& cuts = entry.interrupts;
        cuts.erase(std::find(cuts.begin(), cuts.end(), interrupt));
      }
      if (--entry.pins == 0) entry.unpinned.notify_all();
    }
  } unpin{*entry, interrupt};
  fn(entry->region);
  return true;
}

std::vector<MemoryRegion> RegionTable::snapshot() const {
  std::shared_lock lock(mutex_);
  std::vector<MemoryRegion> out;
  out.reserve(regions_.size());
  for (const auto& [addr, entry] : regions_) out.push_back(entry->region);
  return out;
}

size_t RegionTable::size() const {
  std::shared_lock lock(mutex_);
  return regions_.size();
}

}  // namespace mooncake::te
