// mooncake.engine: the Python face of the transfer engine, compatible with
// the reference module (names, argument order, defaults, 0/-1 results).
// Blocking calls release the GIL; every method may be called from many
// Python threads at once.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <dirent.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "managed_buffers.h"
#include "mooncake/te/log.h"
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
// location, [preferred devices, other devices]. No RDMA devices in this build.
std::string localTopologyJson() {
  std::vector<int> nodes;
  if (DIR* dir = ::opendir("/sys/devices/system/node")) {
    while (dirent* e = ::readdir(dir)) {
      if (std::strncmp(e->d_name, "node", 4) == 0 && e->d_name[4] >= '0' && e->d_name[4] <= '9') {
        nodes.push_back(std::atoi(e->d_name + 4));
      }
    }
    ::closedir(dir);
  }
  if (nodes.empty()) nodes.push_back(0);
  std::sort(nodes.begin(), nodes.end());
  std::string json = "{";
  for (size_t i = 0; i < nodes.size(); ++i) {
    json += (i ? ", " : "") + std::string("\"cpu:") + std::to_string(nodes[i]) + "\": [[], []]";
  }
  return json + "}";
}

struct TransferNotifyPy {
  std::string name;
  std::string msg;
};

class InnerTransferEngine {
 public:
  explicit InnerTransferEngine(std::shared_ptr<te::TransferEngine> engine) : engine(std::move(engine)) {}
  std::shared_ptr<te::TransferEngine> engine;
};

class TransferEnginePy {
 public:
  TransferEnginePy() : engine_(std::make_shared<te::TransferEngine>()), managed_(*engine_) {}
  ~TransferEnginePy() {
    py::gil_scoped_release release;
    managed_.releaseAll();
  }

  int initialize(const std::string& local_hostname, const std::string& metadata_server, const std::string& protocol,
                 const std::string& device_name) {
    py::gil_scoped_release release;
    return engine_->init(metadata_server, local_hostname, protocol, device_name) == te::kOk ? 0 : -1;
  }

  int initializeExt(const std::string& local_hostname, const std::string& metadata_server, const std::string& protocol,
                    const std::string& device_name, const std::string& metadata_type) {
    // "<type>://<addr>" or P2PHANDSHAKE; only P2P mode exists here.
    std::string conn = metadata_server;
    if (metadata_server != "P2PHANDSHAKE" && metadata_server.find("://") == std::string::npos) {
      conn = metadata_type + "://" + metadata_server;
    }
    return initialize(local_hostname, conn, protocol, device_name);
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

  py::class_<InnerTransferEngine>(m, "InnerTransferEngine");

  py::class_<TransferEnginePy> cls(m, "TransferEngine");
  cls.def(py::init<>())
      .def("initialize", &TransferEnginePy::initialize, py::arg("local_hostname"), py::arg("metadata_server"),
           py::arg("protocol"), py::arg("device_name"))
      .def("initialize_ext", &TransferEnginePy::initializeExt, py::arg("local_hostname"), py::arg("metadata_server"),
           py::arg("protocol"), py::arg("device_name"), py::arg("metadata_type"))
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
             const std::string& hint,
      const std::string& /*nic_hint*/ = "") { return self.transferSync(target, buffer, peer, length, te::Opcode::kWrite, std::nullopt, hint); },
          py::arg("target_hostname"), py::arg("buffer"), py::arg("peer_buffer_address"), py::arg("length"),
          py::arg("transport_hint") = "", py::arg("nic_hint") = "")
      .def(
          "transfer_sync_read",
          [](TransferEnginePy& self, const std::string& target, uint64_t buffer, uint64_t peer, size_t length,
             const std::string& hint,
      const std::string& /*nic_hint*/ = "") { return self.transferSync(target, buffer, peer, length, te::Opcode::kRead, std::nullopt, hint); },
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
           py::arg("buffer"), py::arg("peer_buffer_address"), py::arg("length"), py::arg("transport_hint") = "", py::arg("nic_hint") = "")
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
          "get_local_topology", [](TransferEnginePy&, py::object) { return localTopologyJson(); },
          py::arg("device_name") = py::none())
      .def(
          "warmup_efa_segment", [](TransferEnginePy&, const std::string&) { return 0; }, py::arg("segment_name"));
  cls.attr("TransferOpcode") = opcode;

  // What this build's transfer engine can move: the flags turn true with the
  // transports (CUDA IPC, RDMA) that serve them, not with the toolkits alone.
  const auto transports = te::builtTransports();
  auto built = [&](const char* name) { return std::find(transports.begin(), transports.end(), name) != transports.end(); };
  m.attr("SUPPORT_CUDA") = built("cuda_ipc");
  m.attr("SUPPORT_RDMA") = built("rdma");
  m.attr("SUPPORT_EFA") = false;
  m.attr("SUPPORT_HIP") = false;
  m.attr("SUPPORT_MNNVL") = false;
  m.attr("SUPPORT_MUSA") = false;
  m.attr("SUPPORT_INTRA_NVLINK") = false;
  // One engine serves several transports at once, chosen per request.
  m.attr("SUPPORT_MULTI_PROTOCOL") = true;
  m.attr("__version__") = MOONCAKE_VERSION;
}
