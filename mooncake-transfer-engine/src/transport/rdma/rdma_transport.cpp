#include "transport/rdma/rdma_transport.h"

#include <algorithm>
#include <random>
#include <sstream>

#include "mooncake/te/log.h"
#include "rpc/rpc.h"
#include "transport/rdma/gid_choice.h"
#include "transport/rdma/nic_affinity.h"

namespace mooncake::te {
namespace {

// Completion queue entries per device. Half of them bound the WRs in flight
// on the device, so that the flushed completions of a queue pair being torn
// down never overrun it.
constexpr uint32_t kCompletionQueueEntries = 16384;
constexpr uint32_t kInFlightPerDevice = kCompletionQueueEntries / 2;
// How often the progress thread looks for WRs past their deadline.
constexpr auto kDeadlineScan = std::chrono::milliseconds(10);

std::vector<std::string> splitNames(const std::string& list) {
  std::vector<std::string> names;
  std::stringstream in(list);
  for (std::string name; std::getline(in, name, ',');) {
    name.erase(0, name.find_first_not_of(" \t"));
    name.erase(name.find_last_not_of(" \t") + 1);
    if (!name.empty()) names.push_back(name);
  }
  return names;
}

// How many devices a peer's descriptor says it serves (0: none, or an
// attribute that does not decode).
size_t remoteDeviceCount(const SegmentDescriptor& d) {
  auto it = d.attrs.find(rdma::kDevicesAttr);
  std::vector<rdma::DeviceAddress> devices;
  return it != d.attrs.end() && rdma::decodeDevices(it->second, devices) ? devices.size() : 0;
}

uint32_t randomPsn() {
  static thread_local std::mt19937 generator{std::random_device{}()};
  return generator() & 0xffffff;
}

}  // namespace

struct RdmaTransport::LocalDevice {
  size_t index = 0;
  std::unique_ptr<rdma::Device> device;
  rdma::ConnectOptions options;
  rdma::DeviceAddress address;
  rdma::Place place;  // where it sits (PCIe, NUMA): which buffers it suits
  std::thread progress;
  std::atomic<uint64_t> next_wr_id{1};  // unique per device: a late completion of a torn-down QP matches nothing
  std::atomic<uint32_t> in_flight{0};   // WRs posted on the device, not yet settled
  std::atomic<bool> failed{false};      // its completion queue overran: it serves nothing more
  std::atomic<bool> starved{false};     // a queue pair has WRs waiting for room on the device
  std::mutex endpoints_mutex;
  std::unordered_map<uint32_t, std::weak_ptr<Endpoint>> by_qp;  // connected endpoints by queue pair number
};

struct RdmaTransport::Endpoint {
  SegmentHandle peer = 0;
  LocalDevice* device = nullptr;
  uint32_t remote_device = 0;
  std::string peer_name;
  std::string host;
  uint16_t port = 0;
  std::mutex connect_mutex;  // one connection attempt at a time; never held with `mutex` by the progress thread
  std::mutex mutex;          // guards everything below
  std::unique_ptr<rdma::QueuePair> qp;  // null: not connected (yet, or since a failure)
  uint32_t qp_num = 0;
  std::deque<Slice> waiting;  // not posted yet: the send queue was full
  std::deque<Posted> posted;  // posted, in order of wr_id
  uint32_t since_signal = 0;
  bool forgotten = false;  // its segment was closed: it connects no more
};

// ---- setup ----

RdmaTransport::RdmaTransport() = default;
RdmaTransport::~RdmaTransport() { shutdown(); }

int RdmaTransport::install(const TransportContext& context) {
  context_ = context;
  max_wr_ = static_cast<uint32_t>(std::clamp(context.config->rdma_max_wr, 1, 16384));
  slice_size_ = std::clamp<uint64_t>(context.config->rdma_slice_size, 4096, 1u << 30);
  provider_ = rdma::makeConfiguredProvider();
  if (!provider_) return kOk;  // not built with a provider: idle
  const std::vector<std::string> listed = provider_->deviceNames();
  const std::vector<std::string> wanted = splitNames(context.device_filter);
  for (const std::string& name : wanted) {
    if (std::find(listed.begin(), listed.end(), name) == listed.end()) {
      MC_LOG(Warning) << "rdma: device '" << name << "' of the device filter is not on this host (" << provider_->name()
                      << " lists " << listed.size() << ")";
    }
  }
  const std::string interface = rdma::interfaceOfAddress(context.local_host);
  for (const std::string& name : listed) {
    if (!wanted.empty() && std::find(wanted.begin(), wanted.end(), name) == wanted.end()) continue;
    auto local = std::make_unique<LocalDevice>();
    if (int rc = provider_->open(name, rdma::DeviceOptions{kCompletionQueueEntries}, local->device); rc != kOk) {
      MC_LOG(Info) << "rdma: device " << name << " is not usable: " << errorName(rc);
      continue;
    }
    const rdma::PortInfo& port = local->device->port();
    const int gid_index = rdma::chooseGidIndex(port, interface, context.config->rdma_gid_index);
    if (port.ethernet && gid_index < 0) {
      MC_LOG(Warning) << "rdma: device " << name << " has no usable GID" << (context.config->rdma_gid_index >= 0
                                                                                  ? " at MC_GID_INDEX"
                                                                                  : "");
      continue;
    }
    local->index = devices_.size();
    local->place = rdma::nicPlace(name);
    local->options.gid_index = std::max(gid_index, 0);
    local->address.name = name;
    local->address.ethernet = port.ethernet;
    local->address.lid = port.lid;
    local->address.mtu = port.mtu;
    for (const rdma::GidEntry& entry : port.gids) {
      if (entry.index == gid_index) local->address.gid = entry.gid;
    }
    addresses_.push_back(local->address);
    devices_.push_back(std::move(local));
  }
  if (devices_.empty()) {
    MC_LOG(Info) << "rdma: no usable device (" << provider_->name() << "); peers on other hosts are reached over tcp";
    return kOk;
  }
  for (auto& device : devices_) {
    LocalDevice* d = device.get();
    d->progress = std::thread([this, d] { progressLoop(*d); });
  }
  std::string names;
  for (const auto& a : addresses_) names += (names.empty() ? "" : ", ") + a.name + " (gid " + a.gid.str() + ")";
  MC_LOG(Info) << "rdma: " << provider_->name() << " devices " << names;
  return kOk;
}

void RdmaTransport::shutdown() {
  if (stopping_.exchange(true)) return;
  for (auto& d : devices_) d->device->wake();
  for (auto& d : devices_) {
    if (d->progress.joinable()) d->progress.join();
  }
  std::map<EndpointKey, std::shared_ptr<Endpoint>> endpoints;
  {
    std::lock_guard lock(endpoints_mutex_);
    endpoints.swap(endpoints_);
  }
  std::vector<Outcome> failed;
  for (auto& [key, endpoint] : endpoints) {
    std::lock_guard lock(endpoint->mutex);
    breakLocked(*endpoint, kEndpointError, failed);
  }
  report(failed);
  {
    std::lock_guard lock(responders_mutex_);
    responders_.clear();
  }
  {
    std::unique_lock lock(registrations_mutex_);
    for (auto& [addr, registration] : registrations_) {
      for (auto& d : devices_) d->device->deregisterMemory(reinterpret_cast<void*>(addr));
    }
    registrations_.clear();
  }
  devices_.clear();
}

void RdmaTransport::describe(std::map<std::string, std::string>& segment_attrs) const {
  if (!addresses_.empty()) segment_attrs[rdma::kDevicesAttr] = rdma::encodeDevices(addresses_);
}

// ---- memory ----

int RdmaTransport::registerMemory(const MemoryRegion& region, BufferDescriptor& buffer) {
  // Receive windows are tcp's (written through their peer's server, never
  // published).
  if (devices_.empty() || region.window) return kOk;
  const int gpu = cudaDeviceOfLocation(region.location);
  Registration registration{region.length, {}, {}};
  void* addr = reinterpret_cast<void*>(region.addr);
  for (auto& d : devices_) {
    rdma::MemoryKeys keys;
    const int rc = gpu < 0 ? d->device->registerMemory(addr, region.length, keys)
                           : d->device->registerDeviceMemory(addr, region.length, gpu, keys);
    if (rc != kOk) {
      for (size_t i = 0; i < registration.keys.size(); ++i) devices_[i]->device->deregisterMemory(addr);
      // Not an error of the registration: the memory is served by the other
      // transports. GPU memory without GPUDirect RDMA is common: said once.
      static std::atomic<bool> told_gpu{false};
      if (gpu < 0 || !told_gpu.exchange(true)) {
        MC_LOG(Warning) << "rdma: " << d->address.name << " cannot register [0x" << std::hex << region.addr << ", +0x"
                        << region.length << std::dec << ") (" << region.location << "): " << errorName(rc)
                        << "; it is reached over the other transports";
      }
      return kOk;
    }
    registration.keys.push_back(keys);
  }
  std::vector<uint32_t> rkeys;
  for (const auto& k : registration.keys) rkeys.push_back(k.rkey);
  buffer.attrs[rdma::kRkeysAttr] = rdma::encodeRkeys(rkeys);
  std::vector<rdma::Place> places;
  for (const auto& d : devices_) places.push_back(d->place);
  for (size_t i : rdma::nearestNics(places, rdma::memoryPlace(region.location))) {
    registration.nics.push_back(static_cast<uint32_t>(i));
  }
  buffer.attrs[rdma::kNicsAttr] = rdma::encodeNics(registration.nics);
  std::unique_lock lock(registrations_mutex_);
  registrations_[region.addr] = std::move(registration);
  return kOk;
}

int RdmaTransport::unregisterMemory(const MemoryRegion& region) {
  std::unique_lock lock(registrations_mutex_);
  auto it = registrations_.find(region.addr);
  if (it == registrations_.end()) return kOk;
  for (auto& d : devices_) d->device->deregisterMemory(reinterpret_cast<void*>(region.addr));
  registrations_.erase(it);
  return kOk;
}

// ---- choice ----

bool RdmaTransport::reaches(PeerSegment& peer) {
  if (devices_.empty()) return false;
  std::shared_ptr<const SegmentDescriptor> d = peer.descriptor();
  return d->servesTransport(name()) && remoteDeviceCount(*d) > 0;
}

bool RdmaTransport::carries(PeerSegment&, const MemoryRegion& local, const BufferDescriptor& remote) {
  if (devices_.empty()) return false;
  // Asked about host memory in general (transportFor(handle): zero-length
  // host descriptors): that is what rdma carries.
  if (local.length == 0 && remote.length == 0) {
    return cudaDeviceOfLocation(local.location) < 0 && cudaDeviceOfLocation(remote.location) < 0;
  }
  if (remote.attrs.count(rdma::kRkeysAttr) == 0) return false;
  std::shared_lock lock(registrations_mutex_);
  auto it = registrations_.find(local.addr);
  return it != registrations_.end() && it->second.length == local.length;
}

// ---- data path ----

std::shared_ptr<RdmaTransport::Endpoint> RdmaTransport::endpointFor(PeerSegment& peer, size_t device,
                                                                    size_t remote_device) {
  std::lock_guard lock(endpoints_mutex_);
  auto& endpoint = endpoints_[EndpointKey{peer.handle(), device, remote_device}];
  if (!endpoint) {
    endpoint = std::make_shared<Endpoint>();
    endpoint->peer = peer.handle();
    endpoint->device = devices_[device].get();
    endpoint->remote_device = static_cast<uint32_t>(remote_device);
    endpoint->peer_name = peer.name();
    endpoint->host = peer.host();
    endpoint->port = peer.port();
  }
  return endpoint;
}

int RdmaTransport::connect(const std::shared_ptr<Endpoint>& shared) {
  Endpoint& endpoint = *shared;
  std::lock_guard connecting(endpoint.connect_mutex);
  {
    std::lock_guard lock(endpoint.mutex);
    if (endpoint.qp) return kOk;
    if (endpoint.forgotten) return kEndpointError;
  }
  LocalDevice& device = *endpoint.device;
  if (device.failed.load(std::memory_order_acquire)) return kEndpointError;
  std::unique_ptr<rdma::QueuePair> qp;
  if (int rc = device.device->createQueuePair(max_wr_, kMaxTrailerBytes, qp); rc != kOk) {
    MC_LOG(Warning) << "rdma: cannot create a queue pair on " << device.address.name << ": " << errorName(rc);
    return rc;
  }
  const uint32_t psn = randomPsn();
  rdma::ConnectRequest request;
  request.requester = context_.local->name;
  request.requester_nonce = context_.local->engine_nonce;
  request.requester_device = static_cast<uint32_t>(device.index);
  request.responder_device = endpoint.remote_device;
  request.address = rdma::QpAddress{qp->number(), psn, device.address.lid, device.address.gid, device.address.mtu};
  std::string reply, why;
  const rpc::CallOptions options{context_.config->connect_timeout, context_.config->rpc_timeout,
                                 context_.config->max_rpc_message, context_.config->auth_secret};
  int rc = rpc::call(endpoint.host, endpoint.port, rpc::kRdmaConnect, rdma::encodeConnectRequest(request), reply,
                     options, &why);
  rdma::QpAddress theirs;
  if (rc == kOk && !rdma::decodeQpAddress(reply, theirs)) rc = kMalformedMessage;
  if (rc == kOk) rc = qp->connect(theirs, psn, device.options);
  if (rc != kOk) {
    MC_LOG(Warning) << "rdma: cannot connect " << device.address.name << " to " << endpoint.peer_name << ": "
                    << errorName(rc) << (why.empty() ? "" : ": ") << why;
    return rc;
  }
  MC_LOG(Info) << "rdma: connected " << device.address.name << " (queue pair " << qp->number() << ") to "
               << endpoint.peer_name << " (queue pair " << theirs.qp_num << ")";
  std::lock_guard lock(endpoint.mutex);
  if (endpoint.forgotten) return kEndpointError;  // its segment was closed meanwhile
  endpoint.qp_num = qp->number();
  endpoint.qp = std::move(qp);
  std::lock_guard by_qp(device.endpoints_mutex);
  device.by_qp[endpoint.qp_num] = shared;
  return kOk;
}

void RdmaTransport::submit(PeerSegment& peer, const std::vector<TransferTask*>& tasks, bool /*caller_waits*/) {
  bool stale = false;
  {
    std::lock_guard lock(stale_mutex_);
    stale = stale_peers_.erase(peer.handle()) > 0;
  }
  if (stale) peer.refresh();  // a refused rkey: the peer registered its memory anew
  std::shared_ptr<const SegmentDescriptor> d = peer.descriptor();
  const size_t remote_count = remoteDeviceCount(*d);
  if (devices_.empty() || stopping_.load() || remote_count == 0) {
    for (TransferTask* task : tasks) task->fail(kEndpointError);
    return;
  }
  // The peer's rkeys of the buffer holding [addr, addr + length), and the
  // devices nearest it (all of them where it does not say).
  auto remoteKeysOf = [&](uint64_t addr, uint64_t length, std::vector<uint32_t>& rkeys,
                          std::vector<uint32_t>* nics) {
    const BufferDescriptor* buffer = d->findBuffer(addr, length);
    if (buffer == nullptr) return false;
    auto it = buffer->attrs.find(rdma::kRkeysAttr);
    if (it == buffer->attrs.end() || !rdma::decodeRkeys(it->second, rkeys) || rkeys.size() != remote_count) {
      return false;
    }
    if (nics == nullptr) return true;
    auto near = buffer->attrs.find(rdma::kNicsAttr);
    nics->clear();
    if (near == buffer->attrs.end() || !rdma::decodeNics(near->second, *nics)) {
      for (uint32_t i = 0; i < remote_count; ++i) nics->push_back(i);
    }
    return std::all_of(nics->begin(), nics->end(), [&](uint32_t n) { return n < remote_count; });
  };
  std::map<std::pair<size_t, size_t>, std::vector<Slice>> per_pair;  // by (local, remote) device
  for (TransferTask* task : tasks) {
    const TransferRequest& r = task->request();
    std::vector<rdma::MemoryKeys> lkeys;
    std::vector<uint32_t> local_nics;
    {
      std::optional<MemoryRegion> region = context_.regions->find(reinterpret_cast<uint64_t>(r.source), r.length);
      std::shared_lock lock(registrations_mutex_);
      auto it = region ? registrations_.find(region->addr) : registrations_.end();
      if (it != registrations_.end()) {
        lkeys = it->second.keys;
        local_nics = it->second.nics;
      }
    }
    std::vector<uint32_t> rkeys, remote_nics, trailer_rkeys;
    const bool trailer = r.trailer_length > 0;
    if (lkeys.size() != devices_.size() || local_nics.empty() ||
        !remoteKeysOf(r.target_offset, r.length, rkeys, &remote_nics) ||
        (trailer && !remoteKeysOf(r.trailer_target, r.trailer_length, trailer_rkeys, nullptr))) {
      task->fail(kAddressNotRegistered);
      continue;
    }
    const uint64_t count = (r.length + slice_size_ - 1) / slice_size_;
    task->expectSlices(static_cast<uint32_t>(count + (trailer ? 1 : 0)));
    const net::Deadline deadline = net::after(context_.config->budgetFor(r.length));
    const uint64_t start = next_spread_.fetch_add(1, std::memory_order_relaxed);
    // Slice k goes between the k-th devices nearest each end's memory. A
    // request with a trailer keeps to one queue pair, whose order puts the
    // trailer after the whole payload.
    auto pairOf = [&](uint64_t k) {
      const uint64_t turn = start + (trailer ? 0 : k);
      return std::pair<size_t, size_t>{local_nics[turn % local_nics.size()], remote_nics[turn % remote_nics.size()]};
    };
    for (uint64_t k = 0; k < count; ++k) {
      const auto [local, remote] = pairOf(k);
      const uint64_t offset = k * slice_size_;
      Slice s;
      s.task = task;
      s.read = r.opcode == Opcode::kRead;
      s.local = static_cast<char*>(r.source) + offset;
      s.length = static_cast<uint32_t>(std::min(slice_size_, r.length - offset));
      s.lkey = lkeys[local].lkey;
      s.remote = r.target_offset + offset;
      s.rkey = rkeys[remote];
      s.deadline = deadline;
      per_pair[{local, remote}].push_back(s);
    }
    if (trailer) {
      const auto [local, remote] = pairOf(0);
      Slice s;
      s.task = task;
      s.trailer = true;
      s.local = static_cast<char*>(const_cast<void*>(r.trailer));
      s.length = r.trailer_length;
      s.remote = r.trailer_target;
      s.rkey = trailer_rkeys[remote];
      s.deadline = deadline;
      per_pair[{local, remote}].push_back(s);
    }
  }
  std::vector<Outcome> outcomes;
  for (auto& [devices, slices] : per_pair) {
    std::shared_ptr<Endpoint> endpoint = endpointFor(peer, devices.first, devices.second);
    int rc = connect(endpoint);
    std::lock_guard lock(endpoint->mutex);
    if (rc == kOk && !endpoint->qp) rc = kEndpointError;  // failed right after connecting
    if (rc != kOk) {
      for (const Slice& s : slices) outcomes.push_back(Outcome{s.task, 0, rc});
      continue;
    }
    endpoint->waiting.insert(endpoint->waiting.end(), slices.begin(), slices.end());
    pumpLocked(*endpoint, outcomes);
  }
  report(outcomes);
}

void RdmaTransport::pumpLocked(Endpoint& endpoint, std::vector<Outcome>& failed) {
  if (!endpoint.qp || endpoint.waiting.empty()) return;
  LocalDevice& device = *endpoint.device;
  std::vector<rdma::WorkRequest> chain;
  while (!endpoint.waiting.empty() && endpoint.posted.size() < max_wr_ &&
         device.in_flight.load(std::memory_order_relaxed) < kInFlightPerDevice) {
    const Slice& s = endpoint.waiting.front();
    rdma::WorkRequest wr;
    wr.wr_id = device.next_wr_id.fetch_add(1, std::memory_order_relaxed);
    wr.read = s.read;
    wr.inline_data = s.trailer;
    wr.local = s.local;
    wr.length = s.length;
    wr.lkey = s.lkey;
    wr.remote = s.remote;
    wr.rkey = s.rkey;
    wr.signaled = ++endpoint.since_signal >= kSignalEvery;
    if (wr.signaled) endpoint.since_signal = 0;
    chain.push_back(wr);
    endpoint.posted.push_back(Posted{wr.wr_id, s});
    endpoint.waiting.pop_front();
    device.in_flight.fetch_add(1, std::memory_order_relaxed);
  }
  if (!endpoint.waiting.empty() && endpoint.posted.size() < max_wr_) device.starved.store(true);
  if (chain.empty()) return;
  // The last WR of every chain asks for a completion, so that nothing
  // posted waits on WRs that may never come.
  chain.back().signaled = true;
  endpoint.since_signal = 0;
  size_t accepted = 0;
  if (int rc = endpoint.qp->post(chain.data(), chain.size(), accepted); rc != kOk) {
    MC_LOG(Warning) << "rdma: posting to " << endpoint.peer_name << " failed after " << accepted << " of "
                    << chain.size() << " WRs: " << errorName(rc);
    breakLocked(endpoint, kEndpointError, failed);
  }
}

void RdmaTransport::breakLocked(Endpoint& endpoint, int error, std::vector<Outcome>& failed) {
  LocalDevice& device = *endpoint.device;
  for (const Posted& p : endpoint.posted) failed.push_back(Outcome{p.slice.task, 0, error});
  for (const Slice& s : endpoint.waiting) failed.push_back(Outcome{s.task, 0, error});
  device.in_flight.fetch_sub(static_cast<uint32_t>(endpoint.posted.size()), std::memory_order_relaxed);
  endpoint.posted.clear();
  endpoint.waiting.clear();
  endpoint.since_signal = 0;
  if (endpoint.qp) {
    {
      std::lock_guard lock(device.endpoints_mutex);
      device.by_qp.erase(endpoint.qp_num);
    }
    endpoint.qp.reset();  // stops it: none of its WRs touches memory after this
    endpoint.qp_num = 0;
  }
}

int RdmaTransport::errorOf(rdma::Completion status) {
  switch (status) {
    case rdma::Completion::kRetryExceeded:
      return kPeerUnreachable;
    case rdma::Completion::kRemoteAccess:
    case rdma::Completion::kLocalProtection:
      return kAddressNotRegistered;
    default:
      return kEndpointError;
  }
}

void RdmaTransport::report(const std::vector<Outcome>& outcomes) {
  for (const Outcome& o : outcomes) o.task->completeSlice(o.bytes, o.error);
}

// ---- progress ----

void RdmaTransport::onCompletion(LocalDevice& device, const rdma::WorkCompletion& completion) {
  std::shared_ptr<Endpoint> endpoint;
  {
    std::lock_guard lock(device.endpoints_mutex);
    auto it = device.by_qp.find(completion.qp_num);
    if (it != device.by_qp.end()) endpoint = it->second.lock();
  }
  if (!endpoint) return;  // its queue pair was torn down: its WRs were settled then
  std::vector<Outcome> outcomes;
  {
    std::lock_guard lock(endpoint->mutex);
    auto& posted = endpoint->posted;
    if (endpoint->qp_num != completion.qp_num || posted.empty() || completion.wr_id < posted.front().wr_id) return;
    // Reliable connections complete in order: every WR before this one is done.
    size_t done = 0;
    while (done < posted.size() && posted[done].wr_id < completion.wr_id) ++done;
    const bool found = done < posted.size() && posted[done].wr_id == completion.wr_id;
    if (!found) return;
    const bool ok = completion.status == rdma::Completion::kSuccess;
    for (size_t i = 0; i < done + (ok ? 1 : 0); ++i) {
      const Slice& s = posted.front().slice;
      outcomes.push_back(Outcome{s.task, s.trailer ? 0 : s.length, kOk});
      posted.pop_front();
    }
    device.in_flight.fetch_sub(static_cast<uint32_t>(done + (ok ? 1 : 0)), std::memory_order_relaxed);
    if (ok) {
      pumpLocked(*endpoint, outcomes);
    } else {
      const Slice& s = posted.front().slice;
      const int error = errorOf(completion.status);
      if (completion.status == rdma::Completion::kRemoteAccess) {
        // Our copy of the peer's descriptor may hold an rkey it has since
        // replaced (it registered the range again): fetched anew next time.
        std::lock_guard stale(stale_mutex_);
        stale_peers_.insert(endpoint->peer);
      }
      MC_LOG(Warning) << "rdma " << (s.read ? "read" : "write") << " of " << s.length << " bytes at 0x" << std::hex
                      << s.remote << std::dec << " on " << device.address.name << " to " << endpoint->peer_name
                      << " failed: " << rdma::completionName(completion.status) << " (vendor error "
                      << completion.vendor_error << "); failing its queue pair's " << posted.size() << " WRs with "
                      << errorName(error);
      breakLocked(*endpoint, error, outcomes);
    }
  }
  report(outcomes);
}

void RdmaTransport::forEachEndpoint(LocalDevice& device,
                                    const std::function<void(Endpoint&, std::vector<Outcome>&)>& visit) {
  std::vector<std::shared_ptr<Endpoint>> endpoints;
  {
    std::lock_guard lock(device.endpoints_mutex);
    for (auto& [qp_num, weak] : device.by_qp) {
      if (auto e = weak.lock()) endpoints.push_back(std::move(e));
    }
  }
  std::vector<Outcome> outcomes;
  for (auto& endpoint : endpoints) {
    std::lock_guard lock(endpoint->mutex);
    visit(*endpoint, outcomes);
  }
  report(outcomes);
}

void RdmaTransport::expireDeadlines(LocalDevice& device) {
  const net::Deadline now = net::Clock::now();
  forEachEndpoint(device, [&](Endpoint& endpoint, std::vector<Outcome>& outcomes) {
    if (device.failed.load(std::memory_order_relaxed)) {
      breakLocked(endpoint, kEndpointError, outcomes);
      return;
    }
    // WRs past the device's budget wait in `waiting`: their deadlines count too.
    const bool late = (!endpoint.posted.empty() && endpoint.posted.front().slice.deadline < now) ||
                      (!endpoint.waiting.empty() && endpoint.waiting.front().deadline < now);
    if (late) {
      MC_LOG(Warning) << "rdma: " << endpoint.peer_name << " did not complete " << endpoint.posted.size()
                      << " WRs by their deadline; failing them with " << errorName(kTimeout);
      breakLocked(endpoint, kTimeout, outcomes);
    }
  });
}

void RdmaTransport::progressLoop(LocalDevice& device) {
  rdma::WorkCompletion completions[64];
  net::Deadline next_scan = net::after(kDeadlineScan);
  while (!stopping_.load(std::memory_order_acquire)) {
    const int n = device.device->pollCompletions(completions, 64, kDeadlineScan);
    if (n < 0 && !device.failed.exchange(true)) {
      MC_LOG(Error) << "rdma: the completion queue of " << device.address.name << " failed (" << errorName(n)
                    << "); its transfers fail and it takes no more";
    }
    if (n < 0) {
      expireDeadlines(device);  // fails what it held
      std::this_thread::sleep_for(kDeadlineScan);
      continue;
    }
    for (int i = 0; i < n; ++i) onCompletion(device, completions[i]);
    // Queue pairs held back by the device's budget: the completions made
    // room (and the tick covers a flag raised just after they were seen).
    const bool tick = net::Clock::now() >= next_scan;
    if ((n > 0 || tick) && device.starved.exchange(false)) {
      forEachEndpoint(device, [&](Endpoint& e, std::vector<Outcome>& outcomes) { pumpLocked(e, outcomes); });
    }
    if (tick) {
      expireDeadlines(device);
      next_scan = net::after(kDeadlineScan);
    }
  }
}

// ---- the responder side of a connection ----

int RdmaTransport::serveRpc(uint32_t type, const std::string& request, std::string& reply) {
  if (type != rpc::kRdmaConnect) return kNotImplemented;
  if (devices_.empty() || stopping_.load()) return kDeviceNotFound;
  rdma::ConnectRequest q;
  if (!rdma::decodeConnectRequest(request, q)) return kMalformedMessage;
  if (q.responder_device >= devices_.size()) return kInvalidArgument;
  LocalDevice& device = *devices_[q.responder_device];
  if (device.failed.load(std::memory_order_acquire)) return kEndpointError;
  // It only answers the requester's WRs: it posts none of its own.
  std::unique_ptr<rdma::QueuePair> qp;
  if (int rc = device.device->createQueuePair(1, 0, qp); rc != kOk) return rc;
  const uint32_t psn = randomPsn();
  if (int rc = qp->connect(q.address, psn, device.options); rc != kOk) return rc;
  reply = rdma::encodeQpAddress(
      rdma::QpAddress{qp->number(), psn, device.address.lid, device.address.gid, device.address.mtu});
  // A requester reconnecting (after a failure, or restarted at the same
  // name) replaces its previous queue pair.
  std::lock_guard lock(responders_mutex_);
  responders_[ResponderKey{q.requester, q.requester_device, q.responder_device}] = std::move(qp);
  return kOk;
}

void RdmaTransport::forget(SegmentHandle handle) {
  std::vector<std::shared_ptr<Endpoint>> removed;
  {
    std::lock_guard lock(endpoints_mutex_);
    for (auto it = endpoints_.begin(); it != endpoints_.end();) {
      if (it->first.peer == handle) {
        removed.push_back(it->second);
        it = endpoints_.erase(it);
      } else {
        ++it;
      }
    }
  }
  std::vector<Outcome> outcomes;
  for (auto& endpoint : removed) {
    std::lock_guard lock(endpoint->mutex);
    endpoint->forgotten = true;
    breakLocked(*endpoint, kEndpointError, outcomes);
  }
  report(outcomes);
}

}  // namespace mooncake::te
