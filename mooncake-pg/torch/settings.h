// Process-wide settings of the PG, set through module functions of
// mooncake.pg before groups are created (set_host_ip, set_*_timeout_us, ...).
#pragma once

#include <atomic>
#include <cstdint>
#include <mutex>
#include <string>
#include <vector>

#include <torch/csrc/distributed/c10d/Store.hpp>

namespace mooncake::te {
class TransferEngine;
}

namespace mooncake::pg {

struct PgSettings {
  std::mutex mutex;
  std::string host_ip;  // set_host_ip's, or the one hostIp() chose; empty before either
  std::string engine_secret;  // the secret pgTransferEngine()'s own engine was started with
  std::vector<std::string> device_filter;
  uint64_t transfer_engine_ptr = 0;  // an external TransferEngine (set_transfer_engine), 0 = own
  // Negative: not set; the group's torch timeout applies.
  std::atomic<int64_t> collective_timeout_us{-1};
  std::atomic<int64_t> p2p_timeout_us{-1};
  std::atomic<int64_t> fault_reconciliation_window_us{-1};  // -1: the control plane's default
  std::atomic<int> groups_created{0};
};

PgSettings& settings();

// The address this process is reached at (transfer engine, coordinator):
// set_host_ip's; else the host of set_transfer_engine's engine; else
// MC_TCP_BIND_ADDRESS; else this host's address on the
// route to MASTER_ADDR (the job's store: on a multi-host job, the network
// the peers share; a loopback MASTER_ADDR gives 127.0.0.1); else 127.0.0.1.
// Chosen once, then kept in settings().host_ip. Takes settings().mutex.
std::string hostIp();

// A byte count from the environment variable `name` (plain decimal), or
// `fallback` when it is unset or empty; a ValueError naming the variable
// when it is not a number of at least `minimum` bytes.
size_t envBytes(const char* name, size_t fallback, size_t minimum = 4096);

// The store under every PrefixStore: where keys of the whole job live.
c10::intrusive_ptr<c10d::Store> rootStore(c10::intrusive_ptr<c10d::Store> store);

// The secret every connection of this job's processes proves (its transfer
// engines', its control plane's): MC_TE_AUTH_SECRET when set; else one
// proposed by every process with compare-and-set on the job's root store
// (the first proposal wins; a process whose engine already runs proposes
// the secret it has), so that every process of the job, replacements
// included, gets the same one whichever group it creates first; "" without
// a crypto library or when the store cannot compare-and-set.
std::string jobSecret(const c10::intrusive_ptr<c10d::Store>& store);

// The process's transfer engine for P2P: the one given to set_transfer_engine,
// else one made on first use (P2PHANDSHAKE on the host of set_host_ip, its
// connections authenticated with `secret` when one is given: see jobSecret).
// Null, with *error set, when it cannot be started.
te::TransferEngine* pgTransferEngine(std::string* error, const std::string& secret = "");

}  // namespace mooncake::pg
