// The transfer engine: one segment per process (or per engine object), whose
// registered memory peers read and write one-sidedly by virtual address.
//
//   TransferEngine engine;
//   engine.init("P2PHANDSHAKE", "10.0.0.5");          // listens on a port, segment "10.0.0.5:15123"
//   engine.registerLocalMemory(buf, len);
//   SegmentHandle peer = engine.openSegment("10.0.0.6:15877");
//   BatchId batch = engine.allocateBatchID(1);
//   engine.submitTransfer(batch, {{Opcode::kWrite, buf, peer, remote_addr, len}});
//   engine.waitBatch(batch, status);                    // bounded by MC_TRANSFER_TIMEOUT
//   engine.freeBatchID(batch);
//
// Every method is thread-safe. Every blocking call is bounded.
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "mooncake/te/config.h"
#include "mooncake/te/status.h"
#include "mooncake/te/transfer_request.h"

namespace mooncake::te {

class EngineImpl;

class TransferEngine {
 public:
  TransferEngine();
  ~TransferEngine();
  TransferEngine(const TransferEngine&) = delete;
  TransferEngine& operator=(const TransferEngine&) = delete;

  // metadata: "P2PHANDSHAKE" (the only mode; anything else is kInvalidArgument).
  // local_hostname: the address peers reach us at; a ":port" in it is ignored.
  // protocol: "" / "auto" picks per request: GPU memory of a same-host peer
  //   -> "cuda_ipc" (CUDA builds), host memory of a same-host peer -> "shm",
  //   anything else -> "tcp" (which stages GPU memory through host memory);
  //   "tcp" or "shm" forces that transport; "cuda_ipc", "nvlink",
  //   "nvlink_intra" mean auto where cuda_ipc is built (it is what they ask
  //   for GPU memory), and, like "rdma" and other vendor names, fall back to
  //   auto with one warning where it is not; anything else is kInvalidArgument.
  // device_filter: comma-separated RDMA device allow-list (kept for RDMA).
  int init(const std::string& metadata, const std::string& local_hostname,
           const std::string& protocol = "", const std::string& device_filter = "",
           const EngineConfig& config = EngineConfig::fromEnvironment());
  bool initialized() const;

  const std::string& segmentName() const;  // "host:port", IPv6 hosts bracketed
  const std::string& localHost() const;
  uint16_t rpcPort() const;
  const EngineConfig& config() const;
  std::vector<std::string> transports() const;  // installed transport names

  // Registration. location "*" detects it ("cuda:<device>" for GPU memory in
  // CUDA builds, else "cpu:<numa>"); a label contradicting the memory is corrected.
  // remote_accessible = false: a source for this engine's own transfers,
  // not published, and peers' requests into it are refused.
  int registerLocalMemory(void* addr, size_t length, const std::string& location = "*",
                          bool remote_accessible = true);
  int unregisterLocalMemory(void* addr);
  int registerLocalMemoryBatch(const std::vector<void*>& addrs, const std::vector<size_t>& lengths,
                               const std::string& location = "*");
  int unregisterLocalMemoryBatch(const std::vector<void*>& addrs);
  // A receive window: the caller's host memory [addr, addr + length) open to
  // peers' tcp writes marked TransferRequest::remote_window until
  // closeReceiveWindow (a P2P receive straight into the caller's buffer).
  // Unlike a registration it is not published in the descriptor, so opening
  // and closing one sends no peer to fetch the descriptor again (and no
  // same-host peer can write it through shared memory). A range overlapping
  // registered memory is refused (kAddressOverlapped) without an error in
  // the log: the caller then receives another way.
  int openReceiveWindow(void* addr, size_t length);
  // Closes the window at `addr` (kInvalidArgument if none starts there):
  // writes into it are refused from now on, and those still landing are cut
  // short (their connections are shut down, so their writers see a failed
  // transfer); returns once none touches it, without waiting for a peer that
  // went silent.
  int closeReceiveWindow(void* addr);

  // Peers. openSegment fetches the descriptor on first use and caches it;
  // returns kInvalidSegment when the peer cannot be reached or the name is bad.
  SegmentHandle openSegment(const std::string& segment_name);
  int closeSegment(SegmentHandle handle);
  // The transport the engine would use for host memory to `handle` ("" when
  // none reaches it), and the one for `request`'s memory on both ends.
  std::string transportFor(SegmentHandle handle, const std::string& transport_hint = "");
  std::string transportFor(const TransferRequest& request, const std::string& transport_hint = "");
  // The first registered buffer's address in a peer's descriptor, 0 if none.
  uint64_t firstBufferAddress(const std::string& segment_name);

  // Batches. A batch holds up to `capacity` requests over its lifetime.
  BatchId allocateBatchID(size_t capacity);
  // kBatchBusy while any request is still in flight.
  int freeBatchID(BatchId batch);
  // transport_hint: "" uses the engine's choice, or names an installed transport.
  int submitTransfer(BatchId batch, const std::vector<TransferRequest>& requests,
                     const std::string& transport_hint = "");
  int getTransferStatus(BatchId batch, size_t task_index, TransferStatus& status);
  // Aggregate: kCompleted when all tasks completed, kFailed/kTimeout/kCanceled
  // as soon as one did, kPending otherwise; `sent` once every task's bytes
  // are on the wire (TransferStatus::sent).
  int getBatchTransferStatus(BatchId batch, TransferStatus& status);
  // Ours: ends the batch's requests still in flight at once, with kCanceled
  // (a request blocked on a silent peer's connection too); requests that
  // already ended keep their outcome. The batch must still be freed.
  int cancelBatch(BatchId batch);
  // Blocks until the batch is terminal or `timeout` passes (then kTimeout is
  // reported in status and returned). Negative timeout: the engine's budget for
  // the batch's bytes (MC_TRANSFER_TIMEOUT + 1 ns/byte).
  int waitBatch(BatchId batch, TransferStatus& status,
                std::chrono::milliseconds timeout = std::chrono::milliseconds(-1));

  // Submits, waits and frees in one call: kOk, or the first task's error.
  int transferSync(const std::vector<TransferRequest>& requests, const std::string& transport_hint = "");

  // Notifications: a short message delivered to the target's queue.
  int sendNotify(const std::string& segment_name, const Notify& notify);
  std::vector<Notify> getNotifies();

  // Liveness: kOk when the peer's listener answered within `timeout`.
  int probe(const std::string& segment_name, std::chrono::milliseconds timeout = std::chrono::milliseconds(2000));

 private:
  std::unique_ptr<EngineImpl> impl_;
};

// Names of the transports this build contains ("cuda_ipc", "shm", "rdma",
// "tcp"), in the order the automatic choice tries them.
std::vector<std::string> builtTransports();

// The RDMA NICs on this host (rdma-core's device list): empty in a build
// without rdma-core, and on a host without a NIC. The software provider's
// devices are not NICs and are not listed.
std::vector<std::string> rdmaNicNames();

// For each memory location of this host ("cpu:N" for each NUMA node, then
// "cuda:K" for each GPU), the RDMA NICs nearest it and the others: what
// get_local_topology reports, and how the rdma transport spreads a buffer's
// transfers (transport/rdma/nic_affinity.h).
struct NicAffinity {
  std::string location;
  std::vector<std::string> preferred;
  std::vector<std::string> others;
};
std::vector<NicAffinity> rdmaNicAffinity();

// Splits "host:port" / "[v6]:port" into parts. False when malformed.
bool parseSegmentName(const std::string& name, std::string& host, uint16_t& port);
// Formats the inverse, bracketing IPv6 hosts.
std::string formatSegmentName(const std::string& host, uint16_t port);

}  // namespace mooncake::te
