#include "mooncake/te/transfer_engine.h"

#include <arpa/inet.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <list>
#include <map>
#include <mutex>
#include <random>
#include <shared_mutex>
#include <unordered_map>

#include "batch.h"
#include "mooncake/te/auth.h"
#include "mooncake/te/host_identity.h"
#include "mooncake/te/log.h"
#include "mooncake/te/memory_region.h"
#include "mooncake/te/transport.h"
#include "net/listen_address.h"
#include "rpc/connection_server.h"
#include "rpc/rpc.h"
#include "transport/rdma/nic_affinity.h"
#if MOONCAKE_WITH_RDMA
#include "transport/rdma/rdma_transport.h"
#endif
#include "transport/shm/shm_transport.h"
#include "transport/tcp/tcp_transport.h"
#include "wire.h"
#if MOONCAKE_WITH_CUDA
#include "cuda/devices.h"
#include "transport/cuda_ipc/cuda_ipc_transport.h"
#endif

namespace mooncake::te {
namespace {

// Every transport this build contains: what builtTransports() lists and
// what an engine installs, from one table so the two cannot disagree. The
// order is the automatic choice's preference: each request goes to the
// first transport that reaches its peer and carries its memory. cuda_ipc
// carries only requests with GPU memory, shm only host memory, tcp anything.
struct TransportEntry {
  const char* name;
  std::unique_ptr<Transport> (*make)(rpc::ConnectionServer& server);
};

const TransportEntry kTransports[] = {
#if MOONCAKE_WITH_CUDA
    {"cuda_ipc",
     [](rpc::ConnectionServer&) -> std::unique_ptr<Transport> { return std::make_unique<CudaIpcTransport>(); }},
#endif
    {"shm", [](rpc::ConnectionServer&) -> std::unique_ptr<Transport> { return std::make_unique<ShmTransport>(); }},
#if MOONCAKE_WITH_RDMA
    // Serves peers only where it opened a device; idle otherwise.
    {"rdma", [](rpc::ConnectionServer&) -> std::unique_ptr<Transport> { return std::make_unique<RdmaTransport>(); }},
#endif
    {"tcp",
     [](rpc::ConnectionServer& server) -> std::unique_ptr<Transport> {
       return std::make_unique<TcpTransport>(server);
     }},
};

bool built(const std::string& name) {
  return std::any_of(std::begin(kTransports), std::end(kTransports),
                     [&](const TransportEntry& e) { return name == e.name; });
}

}  // namespace

std::vector<std::string> builtTransports() {
  std::vector<std::string> names;
  for (const TransportEntry& e : kTransports) names.push_back(e.name);
  return names;
}

std::vector<std::string> rdmaNicNames() {
#if MOONCAKE_WITH_RDMA
  std::unique_ptr<rdma::Provider> provider = rdma::makeIbverbsProvider();
  return provider ? provider->deviceNames() : std::vector<std::string>{};
#else
  return {};  // a build without the rdma transport (MOONCAKE_WITH_RDMA=OFF) uses no NIC
#endif
}

std::vector<NicAffinity> rdmaNicAffinity() {
  const std::vector<std::string> names = rdmaNicNames();
  std::vector<rdma::Place> places;
  for (const std::string& name : names) places.push_back(rdma::nicPlace(name));
  std::vector<std::string> locations;
  for (int node : rdma::numaNodes()) locations.push_back("cpu:" + std::to_string(node));
#if MOONCAKE_WITH_CUDA
  for (int gpu = 0; gpu < cuda::deviceCount(); ++gpu) locations.push_back("cuda:" + std::to_string(gpu));
#endif
  std::vector<NicAffinity> out;
  for (const std::string& location : locations) {
    NicAffinity entry{location, {}, {}};
    std::vector<bool> near(names.size(), false);
    for (size_t i : rdma::nearestNics(places, rdma::memoryPlace(location))) near[i] = true;
    for (size_t i = 0; i < names.size(); ++i) (near[i] ? entry.preferred : entry.others).push_back(names[i]);
    out.push_back(std::move(entry));
  }
  return out;
}

// ---- segment names ----

bool parseSegmentName(const std::string& name, std::string& host, uint16_t& port) {
  std::string port_text;
  if (!name.empty() && name.front() == '[') {
    size_t close = name.find(']');
    if (close == std::string::npos || close + 1 >= name.size() || name[close + 1] != ':') return false;
    host = name.substr(1, close - 1);
    port_text = name.substr(close + 2);
  } else {
    size_t colon = name.rfind(':');
    if (colon == std::string::npos || colon == 0 || name.find(':') != colon) return false;
    host = name.substr(0, colon);
    port_text = name.substr(colon + 1);
  }
  if (host.empty() || port_text.empty() || port_text.size() > 5) return false;
  if (!std::all_of(port_text.begin(), port_text.end(), [](char c) { return c >= '0' && c <= '9'; })) return false;
  unsigned long value = std::stoul(port_text);
  if (value == 0 || value > 65535) return false;
  port = static_cast<uint16_t>(value);
  return true;
}

std::string formatSegmentName(const std::string& host, uint16_t port) {
  bool ipv6 = host.find(':') != std::string::npos;
  return (ipv6 ? "[" + host + "]" : host) + ":" + std::to_string(port);
}

namespace {

// Once per process: who can reach this engine's registered memory.
void logExposure(const net::ListenChoice& listen, bool authenticated) {
  if (listen.every_interface) {
    MC_LOG(Info) << "transfer engine: listening on every interface: " << listen.reason;
  }
  if (authenticated) return;
  // Once per process and kind: an engine on loopback (INFO) must not hide a
  // later one open beyond it (WARNING).
  const bool loopback = listen.address.rfind("127.", 0) == 0 || listen.address == "::1";
  static std::once_flag loopback_once, open_once;
  std::call_once(loopback ? loopback_once : open_once, [&] {
    const log::Level level = loopback ? log::Level::kInfo : log::Level::kWarning;
    MC_LOG_AT(level) << "transfer engine: no MC_TE_AUTH_SECRET: its registered memory is open to anyone who can "
                     << "reach " << (loopback ? "this host's loopback" : listen.address)
                     << " on its port (docs/security.md)";
  });
}

// "host", "host:port", "[v6]", "[v6]:port", "v6" -> host. A port given in the
// local host name is ignored: P2P mode always picks its own.
std::string stripPort(const std::string& text) {
  if (!text.empty() && text.front() == '[') {
    size_t close = text.find(']');
    return close == std::string::npos ? text : text.substr(1, close - 1);
  }
  size_t colon = text.find(':');
  if (colon != std::string::npos && text.find(':', colon + 1) == std::string::npos) return text.substr(0, colon);
  return text;  // bare IPv6 or plain host
}

// Protocol names that ask for GPU-to-GPU transfers on one host. The
// automatic choice already sends GPU memory of same-host peers over cuda_ipc
// and everything else over shm or tcp, so where cuda_ipc is built they select
// it; forcing cuda_ipc for every request would fail the host buffers such
// clients register beside their GPU ones.
constexpr const char* kCudaIpcProtocols[] = {"cuda_ipc", "nvlink", "nvlink_intra"};
// Protocol names users pass that this build cannot serve yet: fall back to
// the automatic choice with one warning. ("rdma" is served: see init().)
constexpr const char* kFallbackProtocols[] = {"efa", "hip", "musa", "ascend", "cxl"};

template <size_t N>
bool listed(const std::string& value, const char* const (&names)[N]) {
  return std::any_of(std::begin(names), std::end(names), [&](const char* n) { return value == n; });
}

// What the engine assumes of memory it is not told about (transportFor(handle)).
const MemoryRegion kHostRegion{0, 0, "cpu:0"};
const BufferDescriptor kHostBuffer{0, 0, "cpu:0", {}};

bool isOneOf(const std::string& value, std::initializer_list<const char*> names) {
  return std::any_of(names.begin(), names.end(), [&](const char* n) { return value == n; });
}

}  // namespace

// ---- the engine ----

namespace {

// A stamp outlives its engine (same-host peers may still read its address),
// so it is never freed; it stays reachable from here, which also tells leak
// checkers that it is kept on purpose.
SegmentStamp* keptStamp() {
  static std::mutex mutex;
  static auto* kept = new std::vector<std::unique_ptr<SegmentStamp>>();
  std::lock_guard lock(mutex);
  kept->push_back(std::make_unique<SegmentStamp>());
  return kept->back().get();
}

}  // namespace

class EngineImpl {
 public:
  EngineImpl() : stamp_(keptStamp()) {}  // never freed: see keptStamp
  ~EngineImpl() {
    stop();
    __atomic_store_n(&stamp_->nonce, 0, __ATOMIC_RELEASE);
  }

  int init(const std::string& metadata, const std::string& local_hostname, const std::string& protocol,
           const std::string& device_filter, const EngineConfig& config);
  void stop();
  // Undoes a failed init() so that a later attempt starts from scratch.
  void teardown();
  void bumpRegistrationVersion() { __atomic_add_fetch(&stamp_->registration_version, 1, __ATOMIC_RELEASE); }

  bool initialized() const { return initialized_.load(std::memory_order_acquire); }
  // `window`: a receive window (MemoryRegion::window); an overlap is then the
  // caller's cue to do without, not an error to log.
  int registerMemory(const std::vector<void*>& addrs, const std::vector<size_t>& lengths, const std::string& location,
                     bool remote_accessible = true, bool window = false);
  // `interrupt`: peers' requests landing in the memory are cut short (RegionTable::remove).
  int unregisterMemory(const std::vector<void*>& addrs, bool interrupt = false);
  // A receive window's base only (kInvalidArgument for anything else).
  int closeWindow(void* addr) {
    std::optional<MemoryRegion> found = regions_.find(reinterpret_cast<uint64_t>(addr), 1);
    if (!found || !found->window || found->addr != reinterpret_cast<uint64_t>(addr)) return kInvalidArgument;
    return unregisterMemory({addr}, /*interrupt=*/true);
  }

  SegmentHandle openSegment(const std::string& name);
  int closeSegment(SegmentHandle handle);
  std::shared_ptr<PeerSegment> peer(SegmentHandle handle);
  int fetchDescriptor(PeerSegment& peer);

  BatchId allocateBatch(size_t capacity);
  std::shared_ptr<Batch> batch(BatchId id);
  int freeBatch(BatchId id);
  void abandonBatch(BatchId id);
  int submit(BatchId id, const std::vector<TransferRequest>& requests, const std::string& hint, bool caller_waits);
  std::chrono::nanoseconds waitBudget(const Batch& batch) const;
  void dropCanceled() {
    for (auto& t : transports_) t->dropCanceled();
  }

  // The transport for a request to `peer` from `local` into `remote`: the
  // hint, else the forced protocol, else the first in kTransports that
  // carries the memory and reaches the peer; null when none does.
  Transport* chooseTransport(PeerSegment& peer, const std::string& hint, const MemoryRegion& local,
                             const BufferDescriptor& remote);

  std::string transportFor(const TransferRequest& request, const std::string& hint);

  int sendNotify(const std::string& name, const Notify& notify);
  std::vector<Notify> drainNotifies();
  int probe(const std::string& name, std::chrono::milliseconds timeout);

  EngineConfig config_;
  std::string local_host_;
  std::string segment_name_;
  uint16_t rpc_port_ = 0;
  std::vector<std::string> transport_names_;

 private:
  int dispatchRpc(uint32_t type, const std::string& request, std::string& reply);
  std::string encodeLocalDescriptor();
  Transport* transportByName(const std::string& name);
  rpc::CallOptions callOptions() const {
    return rpc::CallOptions{config_.connect_timeout, config_.rpc_timeout, config_.max_rpc_message, config_.auth_secret};
  }

  std::atomic<bool> initialized_{false};
  std::mutex init_mutex_;
  std::string preferred_;  // forced transport name, "" = automatic
  bool rdma_first_ = false;  // protocol "rdma": rdma wherever it carries the memory, then the automatic choice
  std::unique_ptr<rpc::ConnectionServer> server_;  // made anew by each init attempt
  std::vector<std::unique_ptr<Transport>> transports_;

  // Local segment: registrations and the descriptor peers fetch.
  RegionTable regions_;
  std::mutex descriptor_mutex_;       // serializes registration changes and descriptor reads
  SegmentDescriptor local_;           // identity fields + buffers in registration order
  SegmentStamp* const stamp_;         // address published for same-host peers

  // Peers.
  std::mutex peers_mutex_;
  std::unordered_map<std::string, SegmentHandle> handle_by_name_;
  std::unordered_map<SegmentHandle, std::shared_ptr<PeerSegment>> peers_;
  SegmentHandle next_handle_ = 1;

  // Batches. Ids are never reused, so a stale id is an error, not undefined behaviour.
  std::mutex batches_mutex_;
  std::unordered_map<BatchId, std::shared_ptr<Batch>> batches_;
  std::list<std::shared_ptr<Batch>> abandoned_;  // freed while in flight: dropped once settled
  BatchId next_batch_ = 1;

  std::mutex notify_mutex_;
  std::vector<Notify> notifies_;
};

int EngineImpl::init(const std::string& metadata, const std::string& local_hostname, const std::string& protocol,
                     const std::string& device_filter, const EngineConfig& config) {
  std::lock_guard lock(init_mutex_);
  if (initialized()) {
    MC_LOG(Error) << "initialize: this engine is already initialized as " << segment_name_;
    return kInvalidArgument;
  }
  if (metadata != "P2PHANDSHAKE") {
    MC_LOG(Error) << "initialize: metadata '" << metadata
                  << "' is not supported; only \"P2PHANDSHAKE\" (peers found by \"host:port\") is";
    return kInvalidArgument;
  }
  std::string host = stripPort(local_hostname);
  if (host.empty()) {
    MC_LOG(Error) << "initialize: local_hostname is empty; pass the address peers reach this process at";
    return kInvalidArgument;
  }
  config_ = config;
  if (!config_.auth_secret.empty() && !auth::available()) {
    MC_LOG(Error) << "initialize: a secret (MC_TE_AUTH_SECRET) was given, but this build has no crypto library "
                     "(rebuild with OpenSSL's libcrypto: Debian libssl-dev)";
    return kInvalidArgument;
  }
  std::string proto = protocol;
  std::transform(proto.begin(), proto.end(), proto.begin(), [](unsigned char c) { return std::tolower(c); });
  if (config_.force_tcp) proto = "tcp";
  if (proto.empty() || proto == "auto") {
    preferred_.clear();
  } else if (isOneOf(proto, {"tcp", "shm"})) {
    preferred_ = proto;
  } else if (listed(proto, kCudaIpcProtocols) && built("cuda_ipc")) {
    MC_LOG(Info) << "initialize: protocol '" << proto
                 << "': GPU memory of same-host peers goes over cuda_ipc, other memory over shm or tcp";
    preferred_.clear();
  } else if (proto == "rdma") {
    preferred_.clear();  // reported once the rdma transport says whether it has a device
  } else if (listed(proto, kFallbackProtocols) || listed(proto, kCudaIpcProtocols)) {
    MC_LOG(Warning) << "initialize: protocol '" << proto
                    << "' is not available in this build/host; choosing per request among the built transports";
    preferred_.clear();
  } else {
    MC_LOG(Error) << "initialize: unknown protocol '" << protocol
                  << "' (expected \"\", \"auto\", \"tcp\", \"shm\", \"cuda_ipc\", \"nvlink\", \"rdma\", ...)";
    return kInvalidArgument;
  }

  local_.host_id = hostIdentity();
  local_.pid = static_cast<int32_t>(::getpid());
  local_.process_start_ticks = processStartTicks(::getpid());
  local_.stamp_addr = reinterpret_cast<uint64_t>(stamp_);
  local_.engine_nonce = std::random_device{}() | (static_cast<uint64_t>(std::random_device{}()) << 32) | 1;
  __atomic_store_n(&stamp_->nonce, local_.engine_nonce, __ATOMIC_RELEASE);

  server_ = std::make_unique<rpc::ConnectionServer>();
  for (const TransportEntry& entry : kTransports) transports_.push_back(entry.make(*server_));
  TransportContext context{&config_, &regions_, &local_, host, device_filter};
  for (auto& t : transports_) {
    if (int rc = t->install(context); rc != kOk) {
      MC_LOG(Error) << "initialize: transport " << t->name() << " failed to install: " << errorName(rc);
      teardown();
      return rc;
    }
    if (!t->serving()) continue;
    t->describe(local_.attrs);
    transport_names_.push_back(t->name());
    local_.transports.push_back(t->name());
  }
  rdma_first_ = proto == "rdma";
  if (rdma_first_) {
    const bool serving = std::find(transport_names_.begin(), transport_names_.end(), "rdma") != transport_names_.end();
    if (serving) {
      MC_LOG(Info) << "initialize: protocol 'rdma': peers on other hosts are reached over rdma, same-host ones over "
                   << "shm (or cuda_ipc)";
    } else {
      MC_LOG(Warning) << "initialize: protocol 'rdma': no RDMA device is usable on this host; peers on other hosts "
                      << "are reached over tcp";
    }
  }
  server_->addHandler(rpc::kRpcMagic, [this](net::Socket& socket) {
    rpc::serveRpc(
        socket, [this](uint32_t type, const std::string& req, std::string& reply) { return dispatchRpc(type, req, reply); },
        config_.max_rpc_message, config_.rpc_timeout);
  });
  const net::ListenChoice listen = net::listenAddressFor(host, config_.listen_all);
  if (int rc = server_->start(config_.min_rpc_port, config_.max_rpc_port, listen.address, config_.auth_secret,
                              config_.connect_timeout);
      rc != kOk) {
    teardown();
    return rc;
  }
  logExposure(listen, !config_.auth_secret.empty());
  rpc_port_ = server_->port();
  local_host_ = host;
  segment_name_ = formatSegmentName(host, rpc_port_);
  local_.name = segment_name_;
  initialized_.store(true, std::memory_order_release);
  std::string names;
  for (const auto& n : transport_names_) names += (names.empty() ? "" : ", ") + n;
  MC_LOG(Info) << "transfer engine " << segment_name_ << " up; transports: " << names
               << "; choice: " << (preferred_.empty() ? "per request" : preferred_);
  return kOk;
}

void EngineImpl::stop() {
  if (server_) server_->stop();
  for (auto& t : transports_) t->shutdown();
}

void EngineImpl::teardown() {
  stop();
  transports_.clear();
  server_.reset();
  transport_names_.clear();
  local_.transports.clear();
  local_.attrs.clear();
}

// ---- registration ----

int EngineImpl::registerMemory(const std::vector<void*>& addrs, const std::vector<size_t>& lengths,
                               const std::string& location, bool remote_accessible, bool window) {
  if (!initialized()) return kNotInitialized;
  if (addrs.size() != lengths.size()) {
    MC_LOG(Error) << "register: " << addrs.size() << " addresses but " << lengths.size() << " lengths";
    return kInvalidArgument;
  }
  std::vector<MemoryRegion> regions;
  for (size_t i = 0; i < addrs.size(); ++i) {
    if (addrs[i] == nullptr || lengths[i] == 0) {
      MC_LOG(Error) << "register: buffer " << i << " has a null address or zero length";
      return kInvalidArgument;
    }
    regions.push_back(MemoryRegion{reinterpret_cast<uint64_t>(addrs[i]), lengths[i],
                                   resolveMemoryLocation(addrs[i], location), remote_accessible, window});
  }
  std::lock_guard lock(descriptor_mutex_);
  if (int rc = regions_.addAll(regions); rc != kOk) {
    if (!window || rc != kAddressOverlapped) {
      MC_LOG(Error) << "register: " << errorName(rc) << " (a range must not overlap one already registered)";
    }
    return rc;
  }
  std::vector<BufferDescriptor> added;
  for (const auto& r : regions) {
    BufferDescriptor b{r.addr, r.length, r.location, {}};
    for (auto& t : transports_) {
      if (int rc = t->registerMemory(r, b); rc != kOk) {
        MC_LOG(Error) << "register: transport " << t->name() << " refused [0x" << std::hex << r.addr << ", +0x"
                      << r.length << "): " << errorName(rc);
        for (const auto& undo : regions) regions_.remove(undo.addr);
        for (const auto& prior : added) {
          for (auto& tt : transports_) tt->unregisterMemory(MemoryRegion{prior.addr, prior.length, prior.location});
        }
        return rc;
      }
    }
    added.push_back(std::move(b));
  }
  if (window) return kOk;  // served, not published
  // Only what peers may reach is published.
  if (remote_accessible) local_.buffers.insert(local_.buffers.end(), added.begin(), added.end());
  bumpRegistrationVersion();
  return kOk;
}

int EngineImpl::unregisterMemory(const std::vector<void*>& addrs, bool interrupt) {
  if (!initialized()) return kNotInitialized;
  std::lock_guard lock(descriptor_mutex_);
  int first_error = kOk;
  bool published_changed = false;
  for (void* addr : addrs) {
    MemoryRegion removed;
    int rc = regions_.remove(reinterpret_cast<uint64_t>(addr), &removed, interrupt);
    if (rc != kOk) {
      MC_LOG(Error) << "unregister: 0x" << std::hex << reinterpret_cast<uint64_t>(addr)
                    << " is not the base address of a registered buffer";
      if (first_error == kOk) first_error = rc;
      continue;
    }
    for (auto& t : transports_) t->unregisterMemory(removed);
    if (removed.window) continue;  // never published
    published_changed = true;
    auto& bufs = local_.buffers;
    bufs.erase(std::remove_if(bufs.begin(), bufs.end(), [&](const BufferDescriptor& b) { return b.addr == removed.addr; }),
               bufs.end());
  }
  if (published_changed) bumpRegistrationVersion();
  return first_error;
}

std::string EngineImpl::encodeLocalDescriptor() {
  std::lock_guard lock(descriptor_mutex_);
  local_.registration_version = __atomic_load_n(&stamp_->registration_version, __ATOMIC_ACQUIRE);
  return local_.encode();
}

// ---- handshake server ----

int EngineImpl::dispatchRpc(uint32_t type, const std::string& request, std::string& reply) {
  switch (type) {
    case rpc::kGetDescriptor:
      reply = encodeLocalDescriptor();
      return kOk;
    case rpc::kProbe:
      return kOk;
    case rpc::kNotify: {
      wire::Reader r(request);
      Notify n;
      if (!r.str(n.name) || !r.str(n.msg) || !r.done()) return kMalformedMessage;
      std::lock_guard lock(notify_mutex_);
      notifies_.push_back(std::move(n));
      return kOk;
    }
    default:
      for (auto& t : transports_) {
        if (int rc = t->serveRpc(type, request, reply); rc != kNotImplemented) return rc;
      }
      MC_LOG(Warning) << "handshake: unknown request type " << type;
      return kNotImplemented;
  }
}

// ---- peers ----

int EngineImpl::fetchDescriptor(PeerSegment& peer) {
  std::string reply, why;
  int rc = rpc::call(peer.host(), peer.port(), rpc::kGetDescriptor, segment_name_, reply, callOptions(), &why);
  if (rc != kOk) {
    MC_LOG(Warning) << "cannot fetch the descriptor of " << peer.name() << ": " << errorName(rc)
                    << (why.empty() ? "" : ": ") << why;
    return rc;
  }
  SegmentDescriptor d;
  if (int drc = SegmentDescriptor::decode(reply, d); drc != kOk) {
    MC_LOG(Warning) << "descriptor from " << peer.name() << " is malformed";
    return drc;
  }
  peer.setDescriptor(std::move(d));
  return kOk;
}

SegmentHandle EngineImpl::openSegment(const std::string& name) {
  if (!initialized()) return kInvalidSegment;
  {
    std::lock_guard lock(peers_mutex_);
    auto it = handle_by_name_.find(name);
    if (it != handle_by_name_.end()) return it->second;
  }
  std::string host;
  uint16_t port = 0;
  if (!parseSegmentName(name, host, port)) {
    MC_LOG(Error) << "segment name '" << name << "' is not \"host:port\" (IPv6 as \"[addr]:port\")";
    return kInvalidSegment;
  }
  // Fetch outside the lock: a slow peer must not stall transfers to others.
  auto candidate = std::make_shared<PeerSegment>(0, name, host, port);
  if (fetchDescriptor(*candidate) != kOk) return kInvalidSegment;
  std::lock_guard lock(peers_mutex_);
  auto it = handle_by_name_.find(name);
  if (it != handle_by_name_.end()) return it->second;  // opened concurrently
  SegmentHandle handle = next_handle_++;
  auto peer = std::make_shared<PeerSegment>(handle, name, host, port);
  peer->setDescriptor(*candidate->descriptor());
  peer->setRefresher([this](PeerSegment& p) { return fetchDescriptor(p); });
  peers_.emplace(handle, peer);
  handle_by_name_.emplace(name, handle);
  return handle;
}

int EngineImpl::closeSegment(SegmentHandle handle) {
  std::shared_ptr<PeerSegment> removed;
  {
    std::lock_guard lock(peers_mutex_);
    auto it = peers_.find(handle);
    if (it == peers_.end()) return kInvalidArgument;
    removed = it->second;
    handle_by_name_.erase(removed->name());
    peers_.erase(it);
  }
  for (auto& t : transports_) t->forget(handle);
  return kOk;
}

std::shared_ptr<PeerSegment> EngineImpl::peer(SegmentHandle handle) {
  std::lock_guard lock(peers_mutex_);
  auto it = peers_.find(handle);
  return it == peers_.end() ? nullptr : it->second;
}

// ---- batches ----

BatchId EngineImpl::allocateBatch(size_t capacity) {
  if (capacity == 0) return kInvalidBatch;
  std::lock_guard lock(batches_mutex_);
  abandoned_.remove_if([](const std::shared_ptr<Batch>& b) { return b->settled(); });
  BatchId id = next_batch_++;
  batches_.emplace(id, std::make_shared<Batch>(capacity));
  return id;
}

std::shared_ptr<Batch> EngineImpl::batch(BatchId id) {
  std::lock_guard lock(batches_mutex_);
  auto it = batches_.find(id);
  return it == batches_.end() ? nullptr : it->second;
}

int EngineImpl::freeBatch(BatchId id) {
  std::lock_guard lock(batches_mutex_);
  auto it = batches_.find(id);
  if (it == batches_.end()) return kInvalidArgument;
  if (!it->second->settled()) return kBatchBusy;
  batches_.erase(it);
  return kOk;
}

void EngineImpl::abandonBatch(BatchId id) {
  std::lock_guard lock(batches_mutex_);
  auto it = batches_.find(id);
  if (it == batches_.end()) return;
  if (!it->second->settled()) abandoned_.push_back(it->second);
  batches_.erase(it);
}

std::chrono::nanoseconds EngineImpl::waitBudget(const Batch& batch) const {
  // A little beyond the transports' own deadlines, so that they report the
  // precise failure before the waiter gives up.
  return config_.budgetFor(batch.totalBytes()) + std::chrono::seconds(1);
}

Transport* EngineImpl::transportByName(const std::string& name) {
  for (auto& t : transports_) {
    if (name == t->name()) return t.get();
  }
  return nullptr;
}

Transport* EngineImpl::chooseTransport(PeerSegment& peer, const std::string& hint, const MemoryRegion& local,
                                       const BufferDescriptor& remote) {
  const std::string& wanted = hint.empty() ? preferred_ : hint;
  if (!wanted.empty()) {
    Transport* t = transportByName(wanted);
    if (t != nullptr && t->carries(peer, local, remote) && t->reaches(peer)) return t;
    MC_LOG(Warning) << "transport '" << wanted << "' cannot reach " << peer.name() << " for memory " << local.location
                    << " -> " << remote.location;
    return nullptr;
  }
  // carries() first: it is the cheap test, and keeps reaches() from starting
  // anything (CUDA) for memory a transport would refuse anyway.
  Transport* rdma = transportByName("rdma");
  if (rdma_first_ && rdma != nullptr && rdma->carries(peer, local, remote) && rdma->reaches(peer)) return rdma;
  for (auto& t : transports_) {
    // Same-host peers go over rdma only when asked to (protocol "rdma", a
    // hint): the same-host transports copy once, without the NIC.
    if (t.get() == rdma && peer.descriptor()->host_id == local_.host_id) continue;
    if (t->carries(peer, local, remote) && t->reaches(peer)) return t.get();
  }
  MC_LOG(Warning) << "no transport reaches " << peer.name() << " for memory " << local.location << " -> "
                  << remote.location;
  return nullptr;
}

std::string EngineImpl::transportFor(const TransferRequest& r, const std::string& hint) {
  std::shared_ptr<PeerSegment> p = peer(r.target_id);
  std::optional<MemoryRegion> local = regions_.find(reinterpret_cast<uint64_t>(r.source), r.length);
  if (!p || !local) return "";
  if (!p->covers(r.target_offset, r.length)) p->refresh();
  std::shared_ptr<const SegmentDescriptor> d = p->descriptor();
  const BufferDescriptor* remote = d->findBuffer(r.target_offset, r.length);
  Transport* t = remote != nullptr ? chooseTransport(*p, hint, *local, *remote) : nullptr;
  return t != nullptr ? t->name() : "";
}

int EngineImpl::submit(BatchId id, const std::vector<TransferRequest>& requests, const std::string& hint,
                       bool caller_waits) {
  if (!initialized()) return kNotInitialized;
  std::shared_ptr<Batch> b = batch(id);
  if (!b) {
    MC_LOG(Error) << "submit: unknown batch id " << id;
    return kInvalidArgument;
  }
  if (!hint.empty() && transportByName(hint) == nullptr) {
    MC_LOG(Error) << "submit: unknown transport hint '" << hint << "'";
    return kInvalidArgument;
  }
  // Structural errors refuse the whole submission; address errors fail tasks.
  std::map<SegmentHandle, std::shared_ptr<PeerSegment>> targets;
  for (const auto& r : requests) {
    if (r.source == nullptr || r.length == 0 || r.opcode > Opcode::kWrite) {
      MC_LOG(Error) << "submit: a request has a null buffer, zero length or a bad opcode";
      return kInvalidArgument;
    }
    if (r.trailer_length > 0 &&
        (r.trailer == nullptr || r.trailer_length > kMaxTrailerBytes || r.opcode != Opcode::kWrite)) {
      MC_LOG(Error) << "submit: a trailer must be 1-" << kMaxTrailerBytes << " bytes on a WRITE, got "
                    << r.trailer_length << " bytes";
      return kInvalidArgument;
    }
    auto& p = targets[r.target_id];
    if (!p && !(p = peer(r.target_id))) {
      MC_LOG(Error) << "submit: unknown segment handle " << r.target_id;
      return kInvalidArgument;
    }
  }
  std::vector<TransferTask*> tasks;
  if (int rc = b->addTasks(requests, tasks); rc != kOk) return rc;

  // Each task with the registered region holding its source.
  std::map<SegmentHandle, std::vector<std::pair<TransferTask*, MemoryRegion>>> by_target;
  for (TransferTask* task : tasks) {
    const TransferRequest& r = task->request();
    std::optional<MemoryRegion> local = regions_.find(reinterpret_cast<uint64_t>(r.source), r.length);
    if (!local && r.unregistered_source) {
      local = MemoryRegion{reinterpret_cast<uint64_t>(r.source), r.length, kHostRegion.location, false};
    }
    if (!local) {
      MC_LOG(Error) << "submit: local buffer [0x" << std::hex << reinterpret_cast<uint64_t>(r.source) << ", +0x"
                    << r.length << ") is not inside a registered region";
      task->fail(kAddressNotRegistered);
      continue;
    }
    by_target[r.target_id].emplace_back(task, std::move(*local));
  }
  for (auto& [handle, group] : by_target) {
    PeerSegment& p = *targets[handle];
    // A remote range the cached descriptor does not cover may have been
    // registered since we fetched it: refresh once, then judge.
    auto trailer_covered = [&](const TransferRequest& r) {
      return r.trailer_length == 0 || p.covers(r.trailer_target, r.trailer_length);
    };
    bool all_covered = std::all_of(group.begin(), group.end(), [&](const auto& entry) {
      const TransferRequest& r = entry.first->request();
      return (r.remote_window || p.covers(r.target_offset, r.length)) && trailer_covered(r);
    });
    if (!all_covered) p.refresh();
    std::shared_ptr<const SegmentDescriptor> d = p.descriptor();
    // Transports are chosen per request (the memory on both ends decides),
    // then each gets its share in one call.
    std::vector<std::pair<Transport*, std::vector<TransferTask*>>> by_transport;
    for (auto& [task, local] : group) {
      const TransferRequest& r = task->request();
      const BufferDescriptor* remote = d->findBuffer(r.target_offset, r.length);
      std::optional<BufferDescriptor> window;  // host memory; the peer checks it
      if (remote == nullptr && r.remote_window)
        remote = &window.emplace(BufferDescriptor{r.target_offset, r.length, kHostBuffer.location, {}});
      if (remote == nullptr) {
        MC_LOG(Error) << "submit: remote range [0x" << std::hex << r.target_offset << ", +0x" << r.length
                      << ") is not registered by " << p.name();
        task->fail(kAddressNotRegistered);
        continue;
      }
      if (!trailer_covered(r)) {
        MC_LOG(Error) << "submit: trailer range [0x" << std::hex << r.trailer_target << ", +0x" << r.trailer_length
                      << ") is not registered by " << p.name();
        task->fail(kAddressNotRegistered);
        continue;
      }
      Transport* transport = chooseTransport(p, hint, local, *remote);
      if (transport == nullptr) {
        task->fail(kEndpointError);
        continue;
      }
      if (r.remote_window && std::string(transport->name()) != "tcp") {
        MC_LOG(Error) << "submit: a write into a receive window goes over tcp only, not " << transport->name();
        task->fail(kInvalidArgument);
        continue;
      }
      if (r.trailer_length > 0 && !transport->ordersTrailers()) {
        MC_LOG(Error) << "submit: transport " << transport->name() << " cannot carry a write's trailer";
        task->fail(kInvalidArgument);
        continue;
      }
      auto it = std::find_if(by_transport.begin(), by_transport.end(),
                             [&](const auto& entry) { return entry.first == transport; });
      if (it == by_transport.end()) it = by_transport.insert(by_transport.end(), {transport, {}});
      it->second.push_back(task);
    }
    for (auto& [transport, share] : by_transport) transport->submit(p, share, caller_waits);
  }
  return kOk;
}

// ---- notifications and liveness ----

int EngineImpl::sendNotify(const std::string& name, const Notify& notify) {
  std::string host;
  uint16_t port = 0;
  if (!parseSegmentName(name, host, port)) return kInvalidArgument;
  wire::Writer w;
  w.str(notify.name);
  w.str(notify.msg);
  std::string reply;
  return rpc::call(host, port, rpc::kNotify, w.take(), reply, callOptions());
}

std::vector<Notify> EngineImpl::drainNotifies() {
  std::lock_guard lock(notify_mutex_);
  std::vector<Notify> out;
  out.swap(notifies_);
  return out;
}

int EngineImpl::probe(const std::string& name, std::chrono::milliseconds timeout) {
  std::string host;
  uint16_t port = 0;
  if (!parseSegmentName(name, host, port)) return kInvalidArgument;
  std::string reply;
  return rpc::call(host, port, rpc::kProbe, {}, reply, rpc::CallOptions{timeout, timeout, 1024, config_.auth_secret});
}

// ---- facade ----

TransferEngine::TransferEngine() : impl_(std::make_unique<EngineImpl>()) {}
TransferEngine::~TransferEngine() = default;

int TransferEngine::init(const std::string& metadata, const std::string& local_hostname, const std::string& protocol,
                         const std::string& device_filter, const EngineConfig& config) {
  return impl_->init(metadata, local_hostname, protocol, device_filter, config);
}
bool TransferEngine::initialized() const { return impl_->initialized(); }
const std::string& TransferEngine::segmentName() const { return impl_->segment_name_; }
const std::string& TransferEngine::localHost() const { return impl_->local_host_; }
uint16_t TransferEngine::rpcPort() const { return impl_->rpc_port_; }
const EngineConfig& TransferEngine::config() const { return impl_->config_; }
std::vector<std::string> TransferEngine::transports() const { return impl_->transport_names_; }

int TransferEngine::registerLocalMemory(void* addr, size_t length, const std::string& location,
                                        bool remote_accessible) {
  return impl_->registerMemory({addr}, {length}, location, remote_accessible);
}
int TransferEngine::unregisterLocalMemory(void* addr) { return impl_->unregisterMemory({addr}); }
int TransferEngine::openReceiveWindow(void* addr, size_t length) {
  return impl_->registerMemory({addr}, {length}, "*", /*remote_accessible=*/true, /*window=*/true);
}
int TransferEngine::closeReceiveWindow(void* addr) { return impl_->closeWindow(addr); }
int TransferEngine::registerLocalMemoryBatch(const std::vector<void*>& addrs, const std::vector<size_t>& lengths,
                                             const std::string& location) {
  return impl_->registerMemory(addrs, lengths, location);
}
int TransferEngine::unregisterLocalMemoryBatch(const std::vector<void*>& addrs) {
  return impl_->unregisterMemory(addrs);
}

SegmentHandle TransferEngine::openSegment(const std::string& segment_name) {
  return impl_->openSegment(segment_name);
}
int TransferEngine::closeSegment(SegmentHandle handle) { return impl_->closeSegment(handle); }

std::string TransferEngine::transportFor(SegmentHandle handle, const std::string& transport_hint) {
  std::shared_ptr<PeerSegment> p = impl_->peer(handle);
  Transport* t = p ? impl_->chooseTransport(*p, transport_hint, kHostRegion, kHostBuffer) : nullptr;
  return t ? t->name() : "";
}

std::string TransferEngine::transportFor(const TransferRequest& request, const std::string& transport_hint) {
  return impl_->transportFor(request, transport_hint);
}

uint64_t TransferEngine::firstBufferAddress(const std::string& segment_name) {
  SegmentHandle handle = impl_->openSegment(segment_name);
  std::shared_ptr<PeerSegment> p = impl_->peer(handle);
  if (!p || impl_->fetchDescriptor(*p) != kOk) return 0;
  auto d = p->descriptor();
  return d->buffers.empty() ? 0 : d->buffers.front().addr;
}

BatchId TransferEngine::allocateBatchID(size_t capacity) { return impl_->allocateBatch(capacity); }
int TransferEngine::freeBatchID(BatchId batch) { return impl_->freeBatch(batch); }

int TransferEngine::submitTransfer(BatchId batch, const std::vector<TransferRequest>& requests,
                                   const std::string& transport_hint) {
  return impl_->submit(batch, requests, transport_hint, /*caller_waits=*/false);
}

int TransferEngine::getTransferStatus(BatchId batch, size_t task_index, TransferStatus& status) {
  std::shared_ptr<Batch> b = impl_->batch(batch);
  TransferTask* task = b ? b->task(task_index) : nullptr;
  if (task == nullptr) return kInvalidArgument;
  status = task->status();
  return kOk;
}

int TransferEngine::getBatchTransferStatus(BatchId batch, TransferStatus& status) {
  std::shared_ptr<Batch> b = impl_->batch(batch);
  if (!b) return kInvalidArgument;
  status = b->aggregate();
  return kOk;
}

int TransferEngine::cancelBatch(BatchId batch) {
  std::shared_ptr<Batch> b = impl_->batch(batch);
  if (!b) return kInvalidArgument;
  b->cancelAll();
  impl_->dropCanceled();
  return kOk;
}

int TransferEngine::waitBatch(BatchId batch, TransferStatus& status, std::chrono::milliseconds timeout) {
  std::shared_ptr<Batch> b = impl_->batch(batch);
  if (!b) return kInvalidArgument;
  auto budget = timeout.count() < 0 ? impl_->waitBudget(*b) : std::chrono::nanoseconds(timeout);
  if (!b->waitSettled(net::after(budget))) {
    status = b->aggregate();
    status.state = TransferState::kTimeout;
    status.error = kTimeout;
    return kTimeout;
  }
  status = b->aggregate();
  return status.error;
}

int TransferEngine::transferSync(const std::vector<TransferRequest>& requests, const std::string& transport_hint) {
  BatchId id = impl_->allocateBatch(std::max<size_t>(requests.size(), 1));
  int rc = impl_->submit(id, requests, transport_hint, /*caller_waits=*/true);
  if (rc == kOk) {
    TransferStatus status;
    rc = waitBatch(id, status);
  }
  // On a timeout the transports still own the tasks: the batch is released
  // when they settle (each transport bounds its own waits).
  impl_->abandonBatch(id);
  return rc;
}

int TransferEngine::sendNotify(const std::string& segment_name, const Notify& notify) {
  if (!initialized()) return kNotInitialized;
  return impl_->sendNotify(segment_name, notify);
}
std::vector<Notify> TransferEngine::getNotifies() { return impl_->drainNotifies(); }

int TransferEngine::probe(const std::string& segment_name, std::chrono::milliseconds timeout) {
  if (!initialized()) return kNotInitialized;
  return impl_->probe(segment_name, timeout);
}

}  // namespace mooncake::te
