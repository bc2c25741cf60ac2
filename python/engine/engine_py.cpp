// mooncake.engine: the Python face of the transfer engine, compatible with
// the reference module (names, argument order, defaults, 0/-1 results).
// Blocking calls release the GIL; every method may be called from many
// Python threads at once.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <tuple>
#include <type_traits>
#include <vector>

#include "array_args.h"
#include "managed_buffers.h"
#include "scatter_ticket.h"
#include "mooncake/te/log.h"
#include "mooncake/te/stream_transfers.h"
#include "mooncake/te/transfer_engine.h"

namespace py = pybind11;
using namespace mooncake;

namespace {

// A transport_hint names a transport of this build ("" = the engine's choice).
void checkHint(const std::string& hint) {
  static const std::vector<std::string> built = te::builtTransports();
  if (hint.empty() || std::find(built.begin(), built.end(), hint) != built.end()) return;
  std::string names = "\"\"";
  for (const auto& name : built) names += ", \"" + name + "\"";
  throw py::value_error("transport_hint must be one of " + names + "; got '" + hint + "'");
}

// The JSON the reference returns from get_local_topology: for each memory
// location, [preferred devices, other devices]: the RDMA NICs of this host.
std::string localTopologyJson() {
  auto names = [](const std::vector<std::string>& list) {
    std::string out;
    for (const std::string& name : list) out += (out.empty() ? "\"" : ", \"") + name + "\"";
    return out;
  };
  std::string json = "{";
  for (const te::NicAffinity& entry : te::rdmaNicAffinity()) {
    json += (json.size() > 1 ? ", \"" : "\"") + entry.location + "\": [[" + names(entry.preferred) + "], [" +
            names(entry.others) + "]]";
  }
  return json + "}";
}

struct TransferNotifyPy {
  std::string name;
  std::string msg;
};

// Tickets are destroyed without the GIL: an undrained one waits for its batch.
struct TicketDelete {
  void operator()(binding::ScatterTicket* ticket) const {
    if (PyGILState_Check()) {
      py::gil_scoped_release release;
      delete ticket;
    } else {
      delete ticket;
    }
  }
};
using TicketPtr = std::unique_ptr<binding::ScatterTicket, TicketDelete>;

template <typename... Args>
TicketPtr makeTicket(Args&&... args) {
  return TicketPtr(new binding::ScatterTicket(std::forward<Args>(args)...));
}

class InnerTransferEngine {
 public:
  explicit InnerTransferEngine(std::shared_ptr<te::TransferEngine> engine) : engine(std::move(engine)) {}
  std::shared_ptr<te::TransferEngine> engine;
};

class TransferEnginePy {
 public:
  TransferEnginePy()
      : engine_(std::make_shared<te::TransferEngine>()), managed_(*engine_), stream_transfers_(engine_) {}
  ~TransferEnginePy() {
    try {
      py::gil_scoped_release release;
      managed_.releaseAll();
    } catch (const std::exception& e) {  // a destructor must not throw: the process would end
      MC_LOG(Error) << "TransferEngine: releasing its managed buffers failed: " << e.what();
    }
  }

  // `auth_secret` (ours; "" = MC_TE_AUTH_SECRET, if set): every connection
  // with a peer engine proves knowledge of it (docs/security.md).
  int initialize(const std::string& local_hostname, const std::string& metadata_server, const std::string& protocol,
                 const std::string& device_name, const std::string& auth_secret = "") {
    py::gil_scoped_release release;
    te::EngineConfig config = te::EngineConfig::fromEnvironment();
    if (!auth_secret.empty()) config.auth_secret = auth_secret;
    return engine_->init(metadata_server, local_hostname, protocol, device_name, config) == te::kOk ? 0 : -1;
  }

  int initializeExt(const std::string& local_hostname, const std::string& metadata_server, const std::string& protocol,
                    const std::string& device_name, const std::string& metadata_type, const std::string& auth_secret) {
    // "<type>://<addr>" or P2PHANDSHAKE; only P2P mode exists here.
    std::string conn = metadata_server;
    if (metadata_server != "P2PHANDSHAKE" && metadata_server.find("://") == std::string::npos) {
      conn = metadata_type + "://" + metadata_server;
    }
    return initialize(local_hostname, conn, protocol, device_name, auth_secret);
  }

  int getRpcPort() const { return engine_->rpcPort(); }

  int registerMemory(uint64_t addr, size_t capacity, const std::string& location, bool remote_accessible) {
    return engine_->registerLocalMemory(reinterpret_cast<void*>(addr), capacity, location, remote_accessible);
  }
  int unregisterMemory(uint64_t addr) { return engine_->unregisterLocalMemory(reinterpret_cast<void*>(addr)); }

  int batchRegisterMemory(const std::vector<uint64_t>& addrs, const std::vector<size_t>& capacities,
                          const std::string& location) {
    py::gil_scoped_release release;
    return engine_->registerLocalMemoryBatch(toPointers(addrs), capacities, location);
  }
  int batchUnregisterMemory(const std::vector<uint64_t>& addrs) {
    py::gil_scoped_release release;
    return engine_->unregisterLocalMemoryBatch(toPointers(addrs));
  }

  // Synchronous transfers: 0 on success, -1 on any failure (logged).
  int transferSync(const std::string& target, uint64_t buffer, uint64_t peer_addr, size_t length, te::Opcode opcode,
                   std::optional<TransferNotifyPy> notify, const std::string& hint,
      const std::string& /*nic_hint*/ = "") {
    return batchTransferSync(target, {buffer}, {peer_addr}, {length}, opcode, std::move(notify), hint);
  }

  int batchTransferSync(const std::string& target, const std::vector<uint64_t>& buffers,
                        const std::vector<uint64_t>& peer_addrs, const std::vector<size_t>& lengths, te::Opcode opcode,
                        std::optional<TransferNotifyPy> notify, const std::string& hint,
      const std::string& /*nic_hint*/ = "") {
    checkHint(hint);
    py::gil_scoped_release release;
    std::vector<te::TransferRequest> requests;
    te::SegmentHandle handle = 0;
    if (!buildRequests(target, buffers, peer_addrs, lengths, opcode, requests, handle)) return -1;
    if (requests.empty()) return 0;
    int rc = engine_->transferSync(requests, hint);
    if (rc != te::kOk) {
      forgetIfGone(handle, rc);
      return -1;
    }
    if (notify && engine_->sendNotify(target, te::Notify{notify->name, notify->msg}) != te::kOk) return -1;
    return 0;
  }

  // Asynchronous: a batch id (never 0), or 0 when nothing was submitted.
  uint64_t batchTransferAsync(const std::string& target, const std::vector<uint64_t>& buffers,
                              const std::vector<uint64_t>& peer_addrs, const std::vector<size_t>& lengths,
                              te::Opcode opcode, const std::string& hint,
      const std::string& /*nic_hint*/ = "") {
    checkHint(hint);
    py::gil_scoped_release release;
    std::vector<te::TransferRequest> requests;
    te::SegmentHandle handle = 0;
    if (!buildRequests(target, buffers, peer_addrs, lengths, opcode, requests, handle) || requests.empty()) return 0;
    te::BatchId id = engine_->allocateBatchID(requests.size());
    if (id == te::kInvalidBatch) return 0;
    if (engine_->submitTransfer(id, requests, hint) != te::kOk) {
      engine_->freeBatchID(id);
      return 0;
    }
    std::lock_guard lock(async_mutex_);
    async_[id] = AsyncBatch{handle, std::chrono::steady_clock::now() + budget(lengths)};
    return id;
  }

  // Blocks until every batch completes (0) or any fails or times out (-1).
  // The ids are released in both cases.
  int getBatchTransferStatus(const std::vector<uint64_t>& ids) {
    py::gil_scoped_release release;
    int result = 0;
    for (uint64_t id : ids) {
      std::optional<AsyncBatch> info = takeAsync(id);
      if (!info) {
        MC_LOG(Error) << "get_batch_transfer_status: unknown or already released batch id " << id;
        result = -1;
        continue;
      }
      te::TransferStatus status;
      auto left = std::chrono::duration_cast<std::chrono::milliseconds>(info->deadline - std::chrono::steady_clock::now());
      int rc = engine_->waitBatch(id, status, std::max(left, std::chrono::milliseconds(0)));
      if (rc != te::kOk) {
        forgetIfGone(info->handle, rc);
        result = -1;
      }
      releaseBatch(id);
    }
    return result;
  }

  uint64_t transferSubmitWrite(const std::string& target, uint64_t buffer, uint64_t peer_addr, size_t length,
                               const std::string& hint,
      const std::string& /*nic_hint*/ = "") {
    return batchTransferAsync(target, {buffer}, {peer_addr}, {length}, te::Opcode::kWrite, hint);
  }

  // 1 completed (released), 0 pending, -1 failed (released), -2 timed out (released).
  int transferCheckStatus(uint64_t id) {
    te::TransferStatus status;
    if (engine_->getTransferStatus(id, 0, status) != te::kOk) return -1;
    if (status.state == te::TransferState::kPending) {
      std::lock_guard lock(async_mutex_);
      auto it = async_.find(id);
      if (it == async_.end() || std::chrono::steady_clock::now() < it->second.deadline) return 0;
      status.state = te::TransferState::kTimeout;
    }
    takeAsync(id);
    releaseBatch(id);
    switch (status.state) {
      case te::TransferState::kCompleted: return 1;
      case te::TransferState::kTimeout: return -2;
      default: return -1;
    }
  }

  uint64_t allocateManagedBuffer(size_t length) { return managed_.allocate(length); }
  int freeManagedBuffer(uint64_t addr, size_t length) { return managed_.release(addr, length) == te::kOk ? 0 : -1; }

  // `data`: bytes, or a str (its UTF-8 bytes), as the reference takes both.
  int writeBytesToBuffer(uint64_t dest, const py::object& data, size_t length) {
    std::string text;  // a str's bytes; bytes are read in place
    py::bytes raw;
    std::string_view view;
    if (py::isinstance<py::str>(data)) {
      text = data.cast<std::string>();
      view = text;
    } else if (py::isinstance<py::bytes>(data)) {
      raw = data.cast<py::bytes>();
      view = raw;
    } else {
      throw py::type_error("write_bytes_to_buffer: src_ptr must be bytes or str");
    }
    if (length > view.size()) {
      throw py::value_error("length (" + std::to_string(length) + ") exceeds len(data) (" +
                            std::to_string(view.size()) + ")");
    }
    std::memcpy(reinterpret_cast<void*>(dest), view.data(), length);
    return 0;
  }

  py::bytes readBytesFromBuffer(uint64_t src, size_t length) {
    return py::bytes(reinterpret_cast<const char*>(src), length);
  }

  // The *_arrays forms: the batch calls over arrays of 8-byte integers.
  int batchTransferSyncArrays(const std::string& target, const py::buffer& buffers, const py::buffer& peers,
                              const py::buffer& lengths, te::Opcode opcode, const std::string& hint) {
    auto [b, p, n] = arrayBatch(buffers, peers, lengths);
    return batchTransferSync(target, b, p, n, opcode, std::nullopt, hint);
  }
  uint64_t batchTransferAsyncArrays(const std::string& target, const py::buffer& buffers, const py::buffer& peers,
                                    const py::buffer& lengths, te::Opcode opcode, const std::string& hint) {
    auto [b, p, n] = arrayBatch(buffers, peers, lengths);
    return batchTransferAsync(target, b, p, n, opcode, hint);
  }

  // The *_pages form: `fields` rows are (local base, local stride, remote
  // base, remote stride, length); descriptor (f, i) moves `length` bytes
  // between local base + src_pages[i] * local stride and remote base +
  // dst_pages[i] * remote stride (write: local to remote; read: remote to
  // local). At most `max_batch_size` descriptors per batch (0: all in one).
  int batchTransferSyncPages(const std::string& target, const py::buffer& src_pages, const py::buffer& dst_pages,
                             const py::buffer& fields, int64_t max_batch_size, te::Opcode opcode,
                             const std::string& hint) {
    std::vector<uint64_t> src = binding::words(src_pages, "src_pages");
    std::vector<uint64_t> dst = binding::words(dst_pages, "dst_pages");
    if (src.size() != dst.size()) throw py::value_error("src_pages and dst_pages must have the same length");
    size_t rows = 0;
    std::vector<uint64_t> table = binding::table(fields, "fields", 5, rows);
    if (max_batch_size < 0) throw py::value_error("max_batch_size must be >= 0 (0: one batch)");
    std::vector<uint64_t> locals, remotes;
    std::vector<size_t> lengths;
    for (size_t f = 0; f < rows; ++f) {
      const uint64_t* row = &table[f * 5];
      for (size_t i = 0; i < src.size(); ++i) {
        locals.push_back(row[0] + src[i] * row[1]);
        remotes.push_back(row[2] + dst[i] * row[3]);
        lengths.push_back(row[4]);
      }
    }
    const size_t step = max_batch_size == 0 ? std::max<size_t>(locals.size(), 1) : size_t(max_batch_size);
    for (size_t at = 0; at < locals.size(); at += step) {
      const size_t end = std::min(locals.size(), at + step);
      auto slice = [&](const auto& v) { return std::vector<typename std::decay_t<decltype(v)>::value_type>(
                                            v.begin() + at, v.begin() + end); };
      if (batchTransferSync(target, slice(locals), slice(remotes), slice(lengths), opcode, std::nullopt, hint) != 0) {
        return -1;
      }
    }
    return 0;
  }

  // Scatter: range r spans [local base r, + local capacity r) here and
  // [remote base r, + remote capacity r) at the peer; fragment j of it moves
  // lengths[r][j] bytes between the two offsets. One batch for everything.
  TicketPtr submitScatter(
      const std::string& endpoint, const std::vector<uint64_t>& local_bases, const std::vector<uint64_t>& local_caps,
      const std::vector<uint64_t>& remote_bases, const std::vector<uint64_t>& remote_caps,
      const std::vector<std::vector<uint64_t>>& local_offsets, const std::vector<std::vector<uint64_t>>& remote_offsets,
      const std::vector<std::vector<uint64_t>>& lengths, te::Opcode opcode) {
    const size_t ranges = local_bases.size();
    const std::pair<const char*, size_t> per_range[] = {
        {"local_capacities", local_caps.size()},   {"remote_base_addresses", remote_bases.size()},
        {"remote_capacities", remote_caps.size()}, {"local_offsets", local_offsets.size()},
        {"remote_offsets", remote_offsets.size()}, {"lengths", lengths.size()}};
    for (const auto& [name, size] : per_range) {
      if (size != ranges) {
        throw py::value_error(std::string(name) + " must have one entry per range (" + std::to_string(ranges) +
                              " local_base_addresses), got " + std::to_string(size));
      }
    }
    std::vector<uint64_t> locals, remotes;
    std::vector<size_t> sizes;
    for (size_t r = 0; r < ranges; ++r) {
      if (local_offsets[r].size() != lengths[r].size() || remote_offsets[r].size() != lengths[r].size()) {
        throw py::value_error("local_offsets, remote_offsets and lengths must have the same number of fragments "
                              "in range " + std::to_string(r));
      }
      for (size_t j = 0; j < lengths[r].size(); ++j) {
        const uint64_t n = lengths[r][j];
        if (local_offsets[r][j] > local_caps[r] || n > local_caps[r] - local_offsets[r][j] ||
            remote_offsets[r][j] > remote_caps[r] || n > remote_caps[r] - remote_offsets[r][j]) {
          throw py::value_error("fragment " + std::to_string(j) + " of range " + std::to_string(r) +
                                " (local offset " + std::to_string(local_offsets[r][j]) + ", remote offset " +
                                std::to_string(remote_offsets[r][j]) + ", length " + std::to_string(n) +
                                ") does not fit the range's capacities (" + std::to_string(local_caps[r]) + ", " +
                                std::to_string(remote_caps[r]) + ")");
        }
        if (n == 0) continue;
        locals.push_back(local_bases[r] + local_offsets[r][j]);
        remotes.push_back(remote_bases[r] + remote_offsets[r][j]);
        sizes.push_back(n);
      }
    }
    using binding::ScatterStatus;
    if (locals.empty()) return makeTicket(ScatterStatus::kCompleted);
    py::gil_scoped_release release;
    std::vector<te::TransferRequest> requests;
    te::SegmentHandle handle = 0;
    if (!buildRequests(endpoint, locals, remotes, sizes, opcode, requests, handle)) {
      return makeTicket(ScatterStatus::kFailedDrained);
    }
    te::BatchId id = engine_->allocateBatchID(requests.size());
    if (id == te::kInvalidBatch) return makeTicket(ScatterStatus::kFailedDrained);
    if (engine_->submitTransfer(id, requests) != te::kOk) {
      engine_->freeBatchID(id);
      return makeTicket(ScatterStatus::kFailedDrained);
    }
    return makeTicket(engine_, id, budget(sizes));
  }

  // The *_on_cuda forms: queued on `stream_ptr` (0: the legacy default
  // stream), they start when the stream's earlier work has finished and hold
  // its later work until they end (te/stream_transfers.h). Raises when nothing
  // could be queued (the segment does not open, the launch fails), and for an
  // earlier stream-ordered transfer of this engine that failed (logged when it
  // did); the reference's engine exits the process there instead.
  void transferOnStream(const char* what, const std::string& target, const std::vector<uint64_t>& buffers,
                        const std::vector<uint64_t>& peer_addrs, const std::vector<size_t>& lengths, te::Opcode opcode,
                        uint64_t stream_ptr, const std::string& hint) {
    checkHint(hint);
    std::string earlier = stream_transfers_.takeFailure();
    if (!earlier.empty())
      throw std::runtime_error(std::string(what) + ": an earlier stream-ordered transfer failed: " + earlier);
    if (buffers.size() != peer_addrs.size() || buffers.size() != lengths.size()) {
      throw py::value_error(std::string(what) +
                            ": buffers, peer_buffer_addresses and lengths must have the same "
                            "length (" +
                            std::to_string(buffers.size()) + ", " + std::to_string(peer_addrs.size()) + ", " +
                            std::to_string(lengths.size()) + ")");
    }
    py::gil_scoped_release release;
    std::vector<te::TransferRequest> requests;
    te::SegmentHandle handle = 0;
    if (!buildRequests(target, buffers, peer_addrs, lengths, opcode, requests, handle)) {
      throw std::runtime_error(std::string(what) + ": cannot open segment '" + target + "'");
    }
    if (requests.empty()) return;
    int rc = stream_transfers_.enqueue(reinterpret_cast<void*>(stream_ptr), std::move(requests), hint,
                                       std::string(what) + " to '" + target + "'");
    if (rc != te::kOk) {
      throw std::runtime_error(std::string(what) + ": could not queue the transfer on stream " +
                               std::to_string(stream_ptr) + ": " + te::errorName(rc));
    }
  }

  uint64_t getFirstBufferAddress(const std::string& segment_name) {
    py::gil_scoped_release release;
    return engine_->firstBufferAddress(segment_name);
  }

  std::vector<TransferNotifyPy> getNotifies() {
    std::vector<TransferNotifyPy> out;
    for (auto& n : engine_->getNotifies()) out.push_back(TransferNotifyPy{std::move(n.name), std::move(n.msg)});
    return out;
  }

  int sendProbe(const std::string& peer) {
    py::gil_scoped_release release;
    return engine_->probe(peer) == te::kOk ? 0 : -1;
  }

  InnerTransferEngine getEngine() const { return InnerTransferEngine(engine_); }
  uint64_t getEnginePtr() const { return reinterpret_cast<uint64_t>(engine_.get()); }

 private:
  struct AsyncBatch {
    te::SegmentHandle handle;
    std::chrono::steady_clock::time_point deadline;
  };

  static std::tuple<std::vector<uint64_t>, std::vector<uint64_t>, std::vector<size_t>> arrayBatch(
      const py::buffer& buffers, const py::buffer& peers, const py::buffer& lengths) {
    std::vector<uint64_t> b = binding::words(buffers, "buffers");
    std::vector<uint64_t> p = binding::words(peers, "peer_buffer_addresses");
    std::vector<uint64_t> n = binding::words(lengths, "lengths");
    if (b.size() != p.size() || b.size() != n.size()) {
      throw py::value_error("buffers, peer_buffer_addresses and lengths must have the same length (" +
                            std::to_string(b.size()) + ", " + std::to_string(p.size()) + ", " +
                            std::to_string(n.size()) + ")");
    }
    return {std::move(b), std::move(p), std::vector<size_t>(n.begin(), n.end())};
  }

  static std::vector<void*> toPointers(const std::vector<uint64_t>& addrs) {
    std::vector<void*> out;
    out.reserve(addrs.size());
    for (uint64_t a : addrs) out.push_back(reinterpret_cast<void*>(a));
    return out;
  }

  std::chrono::nanoseconds budget(const std::vector<size_t>& lengths) const {
    uint64_t total = 0;
    for (size_t n : lengths) total += n;
    return engine_->config().budgetFor(total) + std::chrono::seconds(1);
  }

  bool buildRequests(const std::string& target, const std::vector<uint64_t>& buffers,
                     const std::vector<uint64_t>& peer_addrs, const std::vector<size_t>& lengths, te::Opcode opcode,
                     std::vector<te::TransferRequest>& out, te::SegmentHandle& handle) {
    if (buffers.size() != peer_addrs.size() || buffers.size() != lengths.size()) {
      MC_LOG(Error) << "transfer: buffers, peer_buffer_addresses and lengths differ in length (" << buffers.size()
                    << ", " << peer_addrs.size() << ", " << lengths.size() << ")";
      return false;
    }
    if (!engine_->initialized()) {
      MC_LOG(Error) << "transfer: call initialize() first";
      return false;
    }
    handle = engine_->openSegment(target);
    if (handle == te::kInvalidSegment) {
      MC_LOG(Error) << "transfer: cannot open segment '" << target << "'";
      return false;
    }
    for (size_t i = 0; i < buffers.size(); ++i) {
      out.push_back(te::TransferRequest{opcode, reinterpret_cast<void*>(buffers[i]), handle, peer_addrs[i], lengths[i]});
    }
    return true;
  }

  // A peer that went away is closed, so that a later call fetches the
  // descriptor of whatever process serves that name then.
  void forgetIfGone(te::SegmentHandle handle, int rc) {
    if (rc == te::kPeerUnreachable || rc == te::kTimeout) engine_->closeSegment(handle);
  }

  std::optional<AsyncBatch> takeAsync(uint64_t id) {
    std::lock_guard lock(async_mutex_);
    auto it = async_.find(id);
    if (it == async_.end()) return std::nullopt;
    AsyncBatch info = it->second;
    async_.erase(it);
    return info;
  }

  // Frees a batch; one still in flight is released when its transport ends it.
  void releaseBatch(uint64_t id) {
    if (engine_->freeBatchID(id) == te::kBatchBusy) {
      te::TransferStatus ignored;
      engine_->waitBatch(id, ignored);
      engine_->freeBatchID(id);
    }
  }

  std::shared_ptr<te::TransferEngine> engine_;
  binding::ManagedBuffers managed_;
  te::StreamTransfers stream_transfers_;
  std::mutex async_mutex_;
  std::map<uint64_t, AsyncBatch> async_;
};

}  // namespace

PYBIND11_MODULE(engine, m) {
  m.doc() = "Mooncake-compatible transfer engine: one-sided reads and writes of registered memory between processes.";

  // Arithmetic, and built from an int, as the reference's enum: int(op),
  // op == 1, and 1 where an opcode is asked for all work.
  py::enum_<te::Opcode> opcode(m, "TransferOpcode", py::arithmetic());
  opcode.value("Read", te::Opcode::kRead).value("Write", te::Opcode::kWrite).export_values();
  py::implicitly_convertible<int, te::Opcode>();

  py::class_<TransferNotifyPy>(m, "TransferNotify")
      .def(py::init<>())
      .def(py::init([](std::string name, std::string msg) { return TransferNotifyPy{std::move(name), std::move(msg)}; }),
           py::arg("name"), py::arg("msg"))
      .def_readwrite("name", &TransferNotifyPy::name)
      .def_readwrite("msg", &TransferNotifyPy::msg)
      .def("__repr__", [](const TransferNotifyPy& n) { return "TransferNotify(name='" + n.name + "', msg='" + n.msg + "')"; });

  py::enum_<binding::ScatterStatus>(m, "ScatterTransferCompletionStatus", py::arithmetic())
      .value("COMPLETED", binding::ScatterStatus::kCompleted)
      .value("FAILED_DRAINED", binding::ScatterStatus::kFailedDrained)
      .value("COMPLETION_UNKNOWN", binding::ScatterStatus::kCompletionUnknown);

  py::class_<binding::ScatterTicket, TicketPtr>(m, "ScatterTransferTicket",
                                                "Keeps a scatter operation alive until every request of it ended.")
      .def_property_readonly("status", [](binding::ScatterTicket& t) {
        py::gil_scoped_release release;
        return t.status();
      })
      .def_property_readonly("drained", [](binding::ScatterTicket& t) {
        py::gil_scoped_release release;
        return t.drained();
      })
      .def(
          "drain",
          [](binding::ScatterTicket& t, int64_t timeout_ms) {
            py::gil_scoped_release release;
            return t.drain(std::chrono::milliseconds(timeout_ms));
          },
          py::arg("timeout_ms"));

  py::class_<InnerTransferEngine>(m, "InnerTransferEngine");  // NOLINT(bugprone-unused-raii): registers it

  py::class_<TransferEnginePy> cls(m, "TransferEngine");
  cls.def(py::init<>())
      .def(
          "initialize",
          [](TransferEnginePy& self, const std::string& host, const std::string& metadata, const std::string& protocol,
             const std::string& device) { return self.initialize(host, metadata, protocol, device); },
          py::arg("local_hostname"), py::arg("metadata_server"), py::arg("protocol"), py::arg("device_name"))
      .def("initialize_ext", &TransferEnginePy::initializeExt, py::arg("local_hostname"), py::arg("metadata_server"),
           py::arg("protocol"), py::arg("device_name"), py::arg("metadata_type"), py::arg("auth_secret") = "")
      .def("get_rpc_port", &TransferEnginePy::getRpcPort)
      .def("register_memory", &TransferEnginePy::registerMemory, py::arg("buffer_addr"), py::arg("capacity"),
           py::arg("location") = "*", py::arg("remote_accessible") = true)
      .def("unregister_memory", &TransferEnginePy::unregisterMemory, py::arg("buffer_addr"))
      .def("batch_register_memory", &TransferEnginePy::batchRegisterMemory, py::arg("buffer_addresses"),
           py::arg("capacities"), py::arg("location") = "*")
      .def("batch_unregister_memory", &TransferEnginePy::batchUnregisterMemory, py::arg("buffer_addresses"))
      .def(
          "transfer_sync_write",
          [](TransferEnginePy& self, const std::string& target, uint64_t buffer, uint64_t peer, size_t length,
             const std::string& hint, const std::string& /*nic_hint*/ = "") {
            return self.transferSync(target, buffer, peer, length, te::Opcode::kWrite, std::nullopt, hint);
          },
          py::arg("target_hostname"), py::arg("buffer"), py::arg("peer_buffer_address"), py::arg("length"),
          py::arg("transport_hint") = "", py::arg("nic_hint") = "")
      .def(
          "transfer_sync_read",
          [](TransferEnginePy& self, const std::string& target, uint64_t buffer, uint64_t peer, size_t length,
             const std::string& hint, const std::string& /*nic_hint*/ = "") {
            return self.transferSync(target, buffer, peer, length, te::Opcode::kRead, std::nullopt, hint);
          },
          py::arg("target_hostname"), py::arg("buffer"), py::arg("peer_buffer_address"), py::arg("length"),
          py::arg("transport_hint") = "", py::arg("nic_hint") = "")
      .def("transfer_sync", &TransferEnginePy::transferSync, py::arg("target_hostname"), py::arg("buffer"),
           py::arg("peer_buffer_address"), py::arg("length"), py::arg("opcode"), py::arg("notify") = py::none(),
           py::arg("transport_hint") = "", py::arg("nic_hint") = "")
      .def(
          "batch_transfer_sync_write",
          [](TransferEnginePy& self, const std::string& target, const std::vector<uint64_t>& buffers,
             const std::vector<uint64_t>& peers, const std::vector<size_t>& lengths, const std::string& hint,
             const std::string& /*nic_hint*/) {
            return self.batchTransferSync(target, buffers, peers, lengths, te::Opcode::kWrite, std::nullopt, hint);
          },
          py::arg("target_hostname"), py::arg("buffers"), py::arg("peer_buffer_addresses"), py::arg("lengths"),
          py::arg("transport_hint") = "", py::arg("nic_hint") = "")
      .def(
          "batch_transfer_sync_read",
          [](TransferEnginePy& self, const std::string& target, const std::vector<uint64_t>& buffers,
             const std::vector<uint64_t>& peers, const std::vector<size_t>& lengths, const std::string& hint,
             const std::string& /*nic_hint*/) {
            return self.batchTransferSync(target, buffers, peers, lengths, te::Opcode::kRead, std::nullopt, hint);
          },
          py::arg("target_hostname"), py::arg("buffers"), py::arg("peer_buffer_addresses"), py::arg("lengths"),
          py::arg("transport_hint") = "", py::arg("nic_hint") = "")
      .def("batch_transfer_sync", &TransferEnginePy::batchTransferSync, py::arg("target_hostname"), py::arg("buffers"),
           py::arg("peer_buffer_addresses"), py::arg("lengths"), py::arg("opcode"), py::arg("notify") = py::none(),
           py::arg("transport_hint") = "", py::arg("nic_hint") = "")
      .def(
          "batch_transfer_async_write",
          [](TransferEnginePy& self, const std::string& target, const std::vector<uint64_t>& buffers,
             const std::vector<uint64_t>& peers, const std::vector<size_t>& lengths, const std::string& hint,
             const std::string& /*nic_hint*/) {
            return self.batchTransferAsync(target, buffers, peers, lengths, te::Opcode::kWrite, hint);
          },
          py::arg("target_hostname"), py::arg("buffers"), py::arg("peer_buffer_addresses"), py::arg("lengths"),
          py::arg("transport_hint") = "", py::arg("nic_hint") = "")
      .def(
          "batch_transfer_async_read",
          [](TransferEnginePy& self, const std::string& target, const std::vector<uint64_t>& buffers,
             const std::vector<uint64_t>& peers, const std::vector<size_t>& lengths, const std::string& hint,
             const std::string& /*nic_hint*/) {
            return self.batchTransferAsync(target, buffers, peers, lengths, te::Opcode::kRead, hint);
          },
          py::arg("target_hostname"), py::arg("buffers"), py::arg("peer_buffer_addresses"), py::arg("lengths"),
          py::arg("transport_hint") = "", py::arg("nic_hint") = "")
      .def("batch_transfer_async", &TransferEnginePy::batchTransferAsync, py::arg("target_hostname"),
           py::arg("buffers"), py::arg("peer_buffer_addresses"), py::arg("lengths"), py::arg("opcode"),
           py::arg("transport_hint") = "", py::arg("nic_hint") = "")
      .def("get_batch_transfer_status", &TransferEnginePy::getBatchTransferStatus, py::arg("batch_ids"))
      .def("transfer_submit_write", &TransferEnginePy::transferSubmitWrite, py::arg("target_hostname"),
           py::arg("buffer"), py::arg("peer_buffer_address"), py::arg("length"), py::arg("transport_hint") = "",
           py::arg("nic_hint") = "")
      .def("transfer_check_status", &TransferEnginePy::transferCheckStatus, py::arg("batch_id"))
      .def("allocate_managed_buffer", &TransferEnginePy::allocateManagedBuffer, py::arg("length"))
      .def("free_managed_buffer", &TransferEnginePy::freeManagedBuffer, py::arg("buffer_addr"), py::arg("length"))
      .def("write_bytes_to_buffer", &TransferEnginePy::writeBytesToBuffer, py::arg("dest_address"), py::arg("src_ptr"),
           py::arg("length"))
      .def("read_bytes_from_buffer", &TransferEnginePy::readBytesFromBuffer, py::arg("source_address"),
           py::arg("length"))
      .def("get_first_buffer_address", &TransferEnginePy::getFirstBufferAddress, py::arg("segment_name"))
      .def("get_notifies", &TransferEnginePy::getNotifies)
      .def("send_probe", &TransferEnginePy::sendProbe, py::arg("peer_server_name"))
      .def("get_engine", &TransferEnginePy::getEngine)
      .def("get_engine_ptr", &TransferEnginePy::getEnginePtr)
      .def(
          "get_local_topology", [](TransferEnginePy&, const py::object&) { return localTopologyJson(); },
          py::arg("device_name") = py::none())
      .def(
          "warmup_efa_segment", [](TransferEnginePy&, const std::string&) { return 0; }, py::arg("segment_name"));
  // The *_arrays, *_pages and scatter forms.
  for (auto [suffix, opcode_value] : {std::pair{"write", te::Opcode::kWrite}, std::pair{"read", te::Opcode::kRead}}) {
    const te::Opcode op = opcode_value;
    const std::string s = suffix;
    cls.def(
        ("batch_transfer_sync_" + s + "_arrays").c_str(),
        [op](TransferEnginePy& self, const std::string& target, const py::buffer& buffers, const py::buffer& peers,
             const py::buffer& lengths, const std::string& hint, const std::string& /*nic_hint*/) {
          return self.batchTransferSyncArrays(target, buffers, peers, lengths, op, hint);
        },
        py::arg("target_hostname"), py::arg("buffers"), py::arg("peer_buffer_addresses"), py::arg("lengths"),
        py::arg("transport_hint") = "", py::arg("nic_hint") = "");
    cls.def(
        ("batch_transfer_async_" + s + "_arrays").c_str(),
        [op](TransferEnginePy& self, const std::string& target, const py::buffer& buffers, const py::buffer& peers,
             const py::buffer& lengths, const std::string& hint, const std::string& /*nic_hint*/) {
          return self.batchTransferAsyncArrays(target, buffers, peers, lengths, op, hint);
        },
        py::arg("target_hostname"), py::arg("buffers"), py::arg("peer_buffer_addresses"), py::arg("lengths"),
        py::arg("transport_hint") = "", py::arg("nic_hint") = "");
    cls.def(
        ("batch_transfer_sync_" + s + "_pages").c_str(),
        [op](TransferEnginePy& self, const std::string& target, const py::buffer& src_pages, const py::buffer& dst_pages,
             const py::buffer& fields, int64_t max_batch_size, const std::string& hint,
             const std::string& /*nic_hint*/) {
          return self.batchTransferSyncPages(target, src_pages, dst_pages, fields, max_batch_size, op, hint);
        },
        py::arg("target_hostname"), py::arg("src_pages"), py::arg("dst_pages"), py::arg("fields"),
        py::arg("max_batch_size") = 0, py::arg("transport_hint") = "", py::arg("nic_hint") = "");
    cls.def(
        ("submit_scatter_" + s).c_str(),
        [op](TransferEnginePy& self, const std::string& endpoint, const std::vector<uint64_t>& local_bases,
             const std::vector<uint64_t>& local_caps, const std::vector<uint64_t>& remote_bases,
             const std::vector<uint64_t>& remote_caps, const std::vector<std::vector<uint64_t>>& local_offsets,
             const std::vector<std::vector<uint64_t>>& remote_offsets,
             const std::vector<std::vector<uint64_t>>& lengths) {
          return self.submitScatter(endpoint, local_bases, local_caps, remote_bases, remote_caps, local_offsets,
                                    remote_offsets, lengths, op);
        },
        py::arg("endpoint"), py::arg("local_base_addresses"), py::arg("local_capacities"),
        py::arg("remote_base_addresses"), py::arg("remote_capacities"), py::arg("local_offsets"),
        py::arg("remote_offsets"), py::arg("lengths"),
        // The engine (and its managed buffers) outlives every ticket: requests may still be in flight.
        py::keep_alive<0, 1>());
    cls.def(
        ("scatter_transfer_sync_" + s + "_with_ticket").c_str(),
        [op](TransferEnginePy& self, const std::string& endpoint, const std::vector<uint64_t>& local_bases,
             const std::vector<uint64_t>& local_caps, const std::vector<uint64_t>& remote_bases,
             const std::vector<uint64_t>& remote_caps, const std::vector<std::vector<uint64_t>>& local_offsets,
             const std::vector<std::vector<uint64_t>>& remote_offsets,
             const std::vector<std::vector<uint64_t>>& lengths) {
          TicketPtr ticket = self.submitScatter(endpoint, local_bases, local_caps, remote_bases, remote_caps,
                                                local_offsets, remote_offsets, lengths, op);
          py::gil_scoped_release release;
          ticket->drain(std::chrono::milliseconds(-1));
          return ticket;
        },
        py::arg("endpoint"), py::arg("local_base_addresses"), py::arg("local_capacities"),
        py::arg("remote_base_addresses"), py::arg("remote_capacities"), py::arg("local_offsets"),
        py::arg("remote_offsets"), py::arg("lengths"),
        // The engine (and its managed buffers) outlives every ticket: requests may still be in flight.
        py::keep_alive<0, 1>());
  }
#if MOONCAKE_WITH_CUDA
  // Stream-ordered transfers, bound in CUDA builds only (as the reference does).
  for (auto [suffix, opcode_value] : {std::pair{"write", te::Opcode::kWrite}, std::pair{"read", te::Opcode::kRead}}) {
    const te::Opcode op = opcode_value;
    const std::string single = "transfer_" + std::string(suffix) + "_on_cuda";
    const std::string batch = "batch_" + single;
    cls.def(
        single.c_str(),
        [op, single](TransferEnginePy& self, const std::string& target, uint64_t buffer, uint64_t peer, size_t length,
                     uint64_t stream_ptr, const std::string& hint, const std::string& /*nic_hint*/) {
          self.transferOnStream(single.c_str(), target, {buffer}, {peer}, {length}, op, stream_ptr, hint);
        },
        py::arg("target_hostname"), py::arg("buffer"), py::arg("peer_buffer_address"), py::arg("length"),
        py::arg("stream_ptr") = 0, py::arg("transport_hint") = "", py::arg("nic_hint") = "");
    cls.def(
        batch.c_str(),
        [op, batch](TransferEnginePy& self, const std::string& target, const std::vector<uint64_t>& buffers,
                    const std::vector<uint64_t>& peers, const std::vector<size_t>& lengths, uint64_t stream_ptr,
                    const std::string& hint, const std::string& /*nic_hint*/) {
          self.transferOnStream(batch.c_str(), target, buffers, peers, lengths, op, stream_ptr, hint);
        },
        py::arg("target_hostname"), py::arg("buffers"), py::arg("peer_buffer_addresses"), py::arg("lengths"),
        py::arg("stream_ptr") = 0, py::arg("transport_hint") = "", py::arg("nic_hint") = "");
  }
#endif
  cls.attr("TransferOpcode") = opcode;

  // What this build's transfer engine can move: the flags turn true with the
  // transports (CUDA IPC, RDMA) that serve them, not with the toolkits alone.
  const auto transports = te::builtTransports();
  auto built = [&](const char* name) { return std::find(transports.begin(), transports.end(), name) != transports.end(); };
  m.attr("SUPPORT_CUDA") = built("cuda_ipc");
  // An RDMA NIC is usable: built with rdma-core and a device present (the
  // transport itself is in every build; the software provider is for tests).
  m.attr("SUPPORT_RDMA") = !te::rdmaNicNames().empty();
  m.attr("SUPPORT_EFA") = false;
  m.attr("SUPPORT_HIP") = false;
  m.attr("SUPPORT_MNNVL") = false;
  m.attr("SUPPORT_MUSA") = false;
  m.attr("SUPPORT_INTRA_NVLINK") = false;
  // One engine serves several transports at once, chosen per request.
  m.attr("SUPPORT_MULTI_PROTOCOL") = true;
  m.attr("__version__") = MOONCAKE_VERSION;
}
