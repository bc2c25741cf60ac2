// The process's place in the control plane: the Coordinator (started in the
// process of global rank 0) and this process's Agent, both started with the
// process's first group and kept until it exits (groups come and go; the
// process stays one member).
#pragma once

#include <torch/csrc/distributed/c10d/Store.hpp>

#include <chrono>

#include "mooncake/pg/control_plane.h"

namespace mooncake::pg {

// The Agent of this process (global rank `global_rank`), connecting it on
// first use. The Coordinator's address travels through the job's root store
// (below every PrefixStore), which every group of the job shares. Throws
// c10::Error with the reason when the control plane cannot be reached.
Agent& controlAgent(const c10::intrusive_ptr<c10d::Store>& store, int global_rank, std::chrono::milliseconds timeout);

// The options every Agent and the Coordinator of this process use
// (environment and set_fault_reconciliation_window_us).
ControlOptions controlOptions();

}  // namespace mooncake::pg
