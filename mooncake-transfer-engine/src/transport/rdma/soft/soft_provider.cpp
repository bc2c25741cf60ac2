// The software verbs provider: devices, their listeners, memory keys and
// completion queues. The requester side of a queue pair is in
// soft_queue_pair.cpp, the responder side in soft_responder.cpp.
#include "transport/rdma/soft/soft_provider.h"

#include <arpa/inet.h>
#include <ifaddrs.h>
#include <net/if.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <cstring>

#include "cuda/host_staging.h"
#include "mooncake/te/log.h"
#include "mooncake/te/status.h"
#include "transport/rdma/gid_choice.h"
#include "transport/rdma/soft/soft_internal.h"

#if MOONCAKE_WITH_CUDA
#include "cuda/cuda_driver.h"
#endif

namespace mooncake::te::rdma {
namespace soft {
namespace {

std::atomic<bool> g_responders_stalled{false};
std::atomic<bool> g_device_copies_failing{false};

constexpr const char* kDeviceCountEnv = "MC_SOFTVERBS_DEVICES";
constexpr const char* kDevicePrefix = "soft";
constexpr int kMaxDevices = 64;

int configuredDeviceCount() {
  const char* text = std::getenv(kDeviceCountEnv);
  if (text == nullptr || *text == '\0') return 1;
  char* end = nullptr;
  long count = std::strtol(text, &end, 10);
  if (*end != '\0' || count < 0 || count > kMaxDevices) {
    MC_LOG(Warning) << kDeviceCountEnv << "='" << text << "' is not a device count in [0, " << kMaxDevices
                    << "]: using 1";
    return 1;
  }
  return static_cast<int>(count);
}

Gid mappedGid(in_addr address) {
  Gid gid;
  gid.raw[10] = 0xff;
  gid.raw[11] = 0xff;
  std::memcpy(gid.raw.data() + 12, &address, 4);
  return gid;
}

// One GID per IPv4 address of an interface that is up, loopback last: a
// RoCE NIC's table holds the addresses of its netdev; this NIC is reachable
// on every address of the host.
std::vector<GidEntry> hostGids() {
  std::vector<GidEntry> routable, loopback;
  ifaddrs* list = nullptr;
  if (::getifaddrs(&list) == 0) {
    for (ifaddrs* ifa = list; ifa != nullptr; ifa = ifa->ifa_next) {
      if (ifa->ifa_addr == nullptr || ifa->ifa_addr->sa_family != AF_INET || (ifa->ifa_flags & IFF_UP) == 0) continue;
      GidEntry entry;
      entry.gid = mappedGid(reinterpret_cast<const sockaddr_in*>(ifa->ifa_addr)->sin_addr);
      entry.interface = ifa->ifa_name;
      entry.rocev2 = true;
      ((ifa->ifa_flags & IFF_LOOPBACK) != 0 ? loopback : routable).push_back(std::move(entry));
    }
    ::freeifaddrs(list);
  } else {
    MC_LOG(Warning) << "getifaddrs: " << std::strerror(errno) << ": the soft devices have only the loopback GID";
  }
  if (routable.empty() && loopback.empty()) {
    GidEntry entry;
    in_addr localhost{};
    localhost.s_addr = htonl(INADDR_LOOPBACK);
    entry.gid = mappedGid(localhost);
    entry.interface = "lo";
    entry.rocev2 = true;
    loopback.push_back(std::move(entry));
  }
  routable.insert(routable.end(), loopback.begin(), loopback.end());
  for (size_t i = 0; i < routable.size(); ++i) routable[i].index = static_cast<int>(i);
  return routable;
}

}  // namespace

void setResponderStalled(bool stalled) { g_responders_stalled.store(stalled, std::memory_order_release); }
bool responderStalled() { return g_responders_stalled.load(std::memory_order_acquire); }
void setDeviceCopiesFailing(bool failing) { g_device_copies_failing.store(failing, std::memory_order_release); }
bool deviceCopiesFailing() { return g_device_copies_failing.load(std::memory_order_acquire); }

bool ipv4OfGid(const Gid& gid, std::string& out) {
  if (!isIpv4Mapped(gid)) return false;
  char text[INET_ADDRSTRLEN];
  if (::inet_ntop(AF_INET, gid.raw.data() + 12, text, sizeof(text)) == nullptr) return false;
  out = text;
  return true;
}

// ---- RegionTable ------------------------------------------------------------

uint32_t RegionTable::freshKey() {
  // Random, so that a peer cannot guess a key it was not given; never equal
  // to another key of this device, lkey or rkey, so that one used for the
  // other fails instead of working by accident.
  for (;;) {
    uint32_t key = random_();
    if (key != 0 && by_lkey_.count(key) == 0 && by_rkey_.count(key) == 0) return key;
  }
}

int RegionTable::add(void* addr, size_t length, MemoryKeys& keys, int cuda_device) {
  auto base = reinterpret_cast<uintptr_t>(addr);
  if (addr == nullptr || length == 0 || base + length < base) return kInvalidArgument;
  std::lock_guard lock(mutex_);
  if (by_base_.count(base) != 0) return kInvalidArgument;
  auto region = std::make_shared<Region>();
  region->base = base;
  region->length = length;
  region->cuda_device = cuda_device;
  region->lkey = freshKey();
  by_lkey_[region->lkey] = region;
  region->rkey = freshKey();
  by_rkey_[region->rkey] = region;
  by_base_[base] = region;
  keys.lkey = region->lkey;
  keys.rkey = region->rkey;
  return kOk;
}

int RegionTable::remove(void* addr) {
  std::unique_lock lock(mutex_);
  auto it = by_base_.find(reinterpret_cast<uintptr_t>(addr));
  if (it == by_base_.end()) return kInvalidArgument;
  std::shared_ptr<Region> region = it->second;
  by_base_.erase(it);
  by_lkey_.erase(region->lkey);
  by_rkey_.erase(region->rkey);
  // No new pin can find it now; wait for the copies that hold one.
  unpinned_.wait(lock, [&] { return region->pins == 0; });
  return kOk;
}

std::shared_ptr<RegionTable::Region> RegionTable::find(KeyKind kind, uint32_t key) const {
  const auto& map = kind == KeyKind::kLocal ? by_lkey_ : by_rkey_;
  auto it = map.find(key);
  return it == map.end() ? nullptr : it->second;
}

namespace {
bool inside(uintptr_t base, size_t region_length, uint64_t addr, uint64_t length) {
  return addr >= base && length <= region_length && addr - base <= region_length - length;
}
}  // namespace

RegionTable::Check RegionTable::covers(KeyKind kind, uint32_t key, uint64_t addr, uint64_t length) const {
  std::lock_guard lock(mutex_);
  std::shared_ptr<Region> region = find(kind, key);
  if (!region) return Check::kUnknownKey;
  return inside(region->base, region->length, addr, length) ? Check::kOk : Check::kOutOfRange;
}

std::shared_ptr<RegionTable::Region> RegionTable::pin(KeyKind kind, uint32_t key, uint64_t addr, uint64_t length) {
  std::lock_guard lock(mutex_);
  std::shared_ptr<Region> region = find(kind, key);
  if (!region || !inside(region->base, region->length, addr, length)) return nullptr;
  ++region->pins;
  return region;
}

void RegionTable::unpin(Region& region) {
  std::lock_guard lock(mutex_);
  if (--region.pins == 0) unpinned_.notify_all();
}

RegionTable::Copy RegionTable::copyIn(KeyKind kind, uint32_t key, uint64_t addr, const void* from, size_t n) {
  std::shared_ptr<Region> region = pin(kind, key, addr, n);
  if (!region) return Copy::kNotCovered;
  auto* to = reinterpret_cast<void*>(static_cast<uintptr_t>(addr));
  bool ok = true;
  if (region->cuda_device == kHostMemory) {
    std::memcpy(to, from, n);
  } else {
    ok = !deviceCopiesFailing() && cuda::copyToDevice(to, from, n, region->cuda_device) == kOk;
  }
  unpin(*region);
  return ok ? Copy::kOk : Copy::kFailed;
}

RegionTable::Copy RegionTable::copyOut(KeyKind kind, uint32_t key, uint64_t addr, void* to, size_t n) {
  std::shared_ptr<Region> region = pin(kind, key, addr, n);
  if (!region) return Copy::kNotCovered;
  const auto* from = reinterpret_cast<const void*>(static_cast<uintptr_t>(addr));
  bool ok = true;
  if (region->cuda_device == kHostMemory) {
    std::memcpy(to, from, n);
  } else {
    ok = !deviceCopiesFailing() && cuda::copyToHost(to, from, n, region->cuda_device) == kOk;
  }
  unpin(*region);
  return ok ? Copy::kOk : Copy::kFailed;
}

// ---- CompletionQueue --------------------------------------------------------

void CompletionQueue::push(const WorkCompletion& completion) {
  std::lock_guard lock(mutex_);
  if (overrun_) return;
  if (entries_.size() >= capacity_) {
    // A real CQ overrun: the completion is lost and the CQ (with the device
    // behind it) unusable; saying so once is enough.
    overrun_ = true;
    MC_LOG(Error) << name_ << ": completion queue overrun (" << capacity_
                  << " entries not polled): the device is unusable";
    ready_.notify_all();
    return;
  }
  entries_.push_back(completion);
  ready_.notify_all();
}

int CompletionQueue::poll(WorkCompletion* out, int capacity, std::chrono::milliseconds timeout) {
  if (out == nullptr || capacity <= 0) return kInvalidArgument;
  std::unique_lock lock(mutex_);
  if (entries_.empty() && !overrun_ && timeout.count() > 0) {
    ready_.wait_for(lock, timeout, [&] { return !entries_.empty() || overrun_ || wake_pending_; });
    // A wake() that came while nobody waited ends the next wait instead of
    // being lost (a shutdown racing the poller's loop).
    if (entries_.empty()) wake_pending_ = false;
  }
  if (overrun_) return kEndpointError;
  int count = 0;
  while (count < capacity && !entries_.empty()) {
    out[count++] = entries_.front();
    entries_.pop_front();
  }
  return count;
}

void CompletionQueue::wake() {
  std::lock_guard lock(mutex_);
  wake_pending_ = true;
  ready_.notify_all();
}

// ---- DeviceCore -------------------------------------------------------------

DeviceCore::DeviceCore(std::string name, uint32_t cq_entries) : completions_(cq_entries) {
  port_.device = std::move(name);
  port_.port = 1;
  port_.ethernet = true;
  port_.lid = 0;
  port_.mtu = 4096;
  completions_.setName(port_.device);
}

DeviceCore::~DeviceCore() { shutdown(); }

int DeviceCore::open(const std::string& name, const DeviceOptions& options, std::shared_ptr<DeviceCore>& out) {
  if (options.cq_entries == 0) return kInvalidArgument;
  auto core = std::make_shared<DeviceCore>(name, options.cq_entries);
  core->port_.gids = hostGids();
  if (int rc = core->startListening(); rc != kOk) return rc;
  try {
    core->acceptor_ = std::thread([raw = core.get()] { raw->acceptLoop(); });
  } catch (const std::exception& e) {
    MC_LOG(Error) << name << ": cannot start the listener thread: " << e.what();
    return kEndpointError;
  }
  out = std::move(core);
  return kOk;
}

int DeviceCore::startListening() {
  // Every interface, on a port of the kernel's choosing: any number of NICs per host.
  if (listener_.open(0, 0, "0.0.0.0") != kOk) {
    MC_LOG(Error) << name() << ": cannot listen";
    return kEndpointError;
  }
  listen_port_ = listener_.port();
  return kOk;
}

void DeviceCore::reapFinishedLocked(std::list<std::unique_ptr<Inbound>>& finished) {
  for (auto it = inbound_.begin(); it != inbound_.end();) {
    if ((*it)->done.load(std::memory_order_acquire)) {
      finished.push_back(std::move(*it));
      it = inbound_.erase(it);
    } else {
      ++it;
    }
  }
}

void DeviceCore::acceptLoop() {
  for (;;) {
    net::Socket socket;
    const int rc = listener_.accept(socket);
    if (rc == kTooManyRequests) {
      std::this_thread::sleep_for(std::chrono::milliseconds(10));  // out of descriptors for now
      continue;
    }
    if (rc != kOk) {
      if (!shut_down_.load(std::memory_order_acquire)) {
        MC_LOG(Error) << name() << ": accept failed: the device stops answering";
      }
      return;  // shutdown() ended the listener, or a fatal error
    }
    std::list<std::unique_ptr<Inbound>> finished;
    {
      std::lock_guard lock(inbound_mutex_);
      if (stopping_) return;
      reapFinishedLocked(finished);
      auto in = std::make_unique<Inbound>();
      in->socket = std::move(socket);
      Inbound* raw = in.get();
      try {
        raw->thread = std::thread([this, raw] {
          try {
            serve(*raw);
          } catch (const std::exception& e) {
            MC_LOG(Error) << name() << ": responder failed: " << e.what();
          }
          raw->done.store(true, std::memory_order_release);
        });
        inbound_.push_back(std::move(in));
      } catch (const std::exception& e) {
        MC_LOG(Error) << name() << ": cannot start a responder thread: " << e.what();
      }
    }
    for (auto& f : finished) f->thread.join();
  }
}

void DeviceCore::shutdown() {
  if (shut_down_.exchange(true)) return;
  {
    std::lock_guard lock(inbound_mutex_);
    stopping_ = true;
  }
  listener_.stop();
  if (acceptor_.joinable()) acceptor_.join();
  // Queue pairs still open: stopped, so that none of them touches the CQ or
  // the keys of a device that is going away.
  std::vector<std::shared_ptr<QpCore>> live;
  {
    std::lock_guard lock(qps_mutex_);
    for (auto& weak : qps_) {
      if (auto qp = weak.lock()) live.push_back(std::move(qp));
    }
  }
  for (auto& qp : live) qp->stop();
  live.clear();
  std::list<std::unique_ptr<Inbound>> all;
  {
    std::lock_guard lock(inbound_mutex_);
    for (auto& in : inbound_) {
      in->closing.store(true, std::memory_order_release);
      in->socket.shutdownBoth();
    }
    all.swap(inbound_);
  }
  qp_state_changed_.notify_all();
  for (auto& in : all) in->thread.join();
  completions_.wake();
}

int DeviceCore::createQueuePair(uint32_t max_send_wr, uint32_t max_inline, std::shared_ptr<QpCore>& out) {
  if (max_send_wr == 0 || max_send_wr > kMaxSendWr || max_inline > kMaxInline) return kInvalidArgument;
  std::lock_guard lock(qps_mutex_);
  auto free_index = std::find(qp_index_used_.begin(), qp_index_used_.end(), false);
  if (free_index == qp_index_used_.end()) return kTooManyRequests;
  auto index = static_cast<uint8_t>(free_index - qp_index_used_.begin());
  uint32_t qp_num = (static_cast<uint32_t>(listen_port_) << 8) | index;
  auto qp = std::make_shared<QpCore>(shared_from_this(), index, qp_num, max_send_wr, max_inline);
  qps_[index] = qp;
  *free_index = true;
  out = std::move(qp);
  return kOk;
}

void DeviceCore::releaseQueuePair(const QpCore& qp) {
  std::lock_guard lock(qps_mutex_);
  std::shared_ptr<QpCore> held = qps_[qp.index()].lock();
  if (held.get() != &qp) return;
  qps_[qp.index()].reset();
  qp_index_used_[qp.index()] = false;
}

std::shared_ptr<QpCore> DeviceCore::findQueuePair(uint32_t qp_num) {
  if ((qp_num >> 8) != listen_port_) return nullptr;
  std::lock_guard lock(qps_mutex_);
  return qps_[qp_num & 0xff].lock();
}

void DeviceCore::queuePairStateChanged() {
  { std::lock_guard lock(qps_mutex_); }  // a waiter between its check and its wait sees the change
  qp_state_changed_.notify_all();
}

void DeviceCore::shutdownInboundTo(const QpCore* qp) {
  std::lock_guard lock(inbound_mutex_);
  for (auto& in : inbound_) {
    if (in->target != qp) continue;
    in->closing.store(true, std::memory_order_release);
    in->socket.shutdownBoth();
  }
}

}  // namespace soft

namespace {

class SoftQueuePair final : public QueuePair {
 public:
  explicit SoftQueuePair(std::shared_ptr<soft::QpCore> core, std::shared_ptr<soft::DeviceCore> device)
      : core_(std::move(core)), device_(std::move(device)) {}
  ~SoftQueuePair() override {
    core_->stop();
    device_->releaseQueuePair(*core_);
  }
  uint32_t number() const override { return core_->number(); }
  int connect(const QpAddress& remote, uint32_t psn, const ConnectOptions& options) override {
    return core_->connect(remote, psn, options);
  }
  int post(const WorkRequest* requests, size_t count, size_t& posted) override {
    return core_->post(requests, count, posted);
  }

 private:
  std::shared_ptr<soft::QpCore> core_;
  std::shared_ptr<soft::DeviceCore> device_;
};

class SoftDevice final : public Device {
 public:
  explicit SoftDevice(std::shared_ptr<soft::DeviceCore> core) : core_(std::move(core)) {}
  ~SoftDevice() override { core_->shutdown(); }
  const PortInfo& port() const override { return core_->port(); }
  int registerMemory(void* addr, size_t length, MemoryKeys& keys) override {
    return core_->regions().add(addr, length, keys);
  }
#if MOONCAKE_WITH_CUDA
  int registerDeviceMemory(void* addr, size_t length, int cuda_device, MemoryKeys& keys) override {
    // Refused where the range is not GPU memory of that device, as far as
    // its first and last byte tell: a NIC could not map it as such.
    if (addr == nullptr || length == 0 || cuda_device < 0) return kInvalidArgument;
    const auto last = reinterpret_cast<const void*>(reinterpret_cast<uintptr_t>(addr) + (length - 1));
    if (cuda::deviceOfPointer(addr) != cuda_device || cuda::deviceOfPointer(last) != cuda_device) {
      return kInvalidArgument;
    }
    return core_->regions().add(addr, length, keys, cuda_device);
  }
#endif
  int deregisterMemory(void* addr) override { return core_->regions().remove(addr); }
  int createQueuePair(uint32_t max_send_wr, uint32_t max_inline, std::unique_ptr<QueuePair>& out) override {
    std::shared_ptr<soft::QpCore> qp;
    if (int rc = core_->createQueuePair(max_send_wr, max_inline, qp); rc != kOk) return rc;
    out = std::make_unique<SoftQueuePair>(std::move(qp), core_);
    return kOk;
  }
  int pollCompletions(WorkCompletion* out, int capacity, std::chrono::milliseconds timeout) override {
    return core_->completions().poll(out, capacity, timeout);
  }
  void wake() override { core_->completions().wake(); }

 private:
  std::shared_ptr<soft::DeviceCore> core_;
};

class SoftProvider final : public Provider {
 public:
  const char* name() const override { return "software"; }
  std::vector<std::string> deviceNames() override {
    std::vector<std::string> names;
    for (int i = 0, n = soft::configuredDeviceCount(); i < n; ++i)
      names.push_back(soft::kDevicePrefix + std::to_string(i));
    return names;
  }
  int open(const std::string& device, const DeviceOptions& options, std::unique_ptr<Device>& out) override {
    std::vector<std::string> names = deviceNames();
    if (std::find(names.begin(), names.end(), device) == names.end()) return kDeviceNotFound;
    std::shared_ptr<soft::DeviceCore> core;
    if (int rc = soft::DeviceCore::open(device, options, core); rc != kOk) return rc;
    out = std::make_unique<SoftDevice>(std::move(core));
    return kOk;
  }
};

}  // namespace

std::unique_ptr<Provider> makeSoftwareProvider() { return std::make_unique<SoftProvider>(); }

}  // namespace mooncake::te::rdma
