// Engine settings, read once from the environment when an engine initializes.
// Names and defaults follow the reference engine where it has the same knob
// (MC_MIN_RPC_PORT, MC_MAX_RPC_PORT, MC_TRANSFER_TIMEOUT, ...); the ones it
// lacks are marked "ours" in docs/transfer-engine.md.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <string>

namespace mooncake::te {

struct EngineConfig {
  // Handshake/RPC listener: a random free port in [min_rpc_port, max_rpc_port].
  uint16_t min_rpc_port = 15000;  // MC_MIN_RPC_PORT
  uint16_t max_rpc_port = 17000;  // MC_MAX_RPC_PORT
  // Bound on one transfer: timeout + length / (1 GB/s), as the reference does.
  std::chrono::milliseconds transfer_timeout{30000};  // MC_TRANSFER_TIMEOUT (seconds, may be fractional)
  std::chrono::milliseconds connect_timeout{5000};    // MC_HANDSHAKE_CONNECT_TIMEOUT (seconds)
  // MC_RPC_TIMEOUT (seconds): descriptor fetch, notify; default min(10 s, transfer_timeout).
  std::chrono::milliseconds rpc_timeout{10000};
  size_t max_rpc_message = 64u << 20;                 // MC_HANDSHAKE_MAX_LENGTH (bytes)
  // TCP transport: requests larger than one slice are split and the slices
  // run on several connections at once.
  size_t tcp_slice_size = 4u << 20;  // MC_TCP_SLICE_SIZE
  int tcp_workers = 4;               // MC_TCP_WORKERS
  // Same-host transport: bytes per process_vm_* call, so that a peer that dies
  // during a large copy is noticed between chunks.
  size_t shm_chunk_size = 64u << 20;  // MC_SHM_CHUNK_SIZE
  // RDMA transport: requests are split into WRs of at most one slice, and
  // each queue pair holds at most max_wr of them in flight.
  size_t rdma_slice_size = 256u << 10;  // MC_RDMA_SLICE_SIZE (ours)
  int rdma_max_wr = 256;                // MC_MAX_WR
  int rdma_gid_index = -1;              // MC_GID_INDEX; -1: chosen per port (rdma/gid_choice.h)
  bool force_tcp = false;             // MC_FORCE_TCP: same as protocol "tcp"
  // Every connection to or from this engine proves knowledge of this secret
  // (te/auth.h); "" = open connections, as the reference (docs/security.md).
  std::string auth_secret;            // MC_TE_AUTH_SECRET (ours)
  // Listen on every interface instead of the initialize() host's address.
  bool listen_all = false;            // MC_LISTEN_ALL=1 (ours)

  static EngineConfig fromEnvironment();

  // Deadline budget for moving `bytes`: the fixed timeout plus 1 ns per byte.
  std::chrono::nanoseconds budgetFor(uint64_t bytes) const {
    return std::chrono::duration_cast<std::chrono::nanoseconds>(transfer_timeout) +
           std::chrono::nanoseconds(bytes);
  }
};

}  // namespace mooncake::te
