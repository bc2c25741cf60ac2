// mooncake.pg_<torch version>: the torch-facing module. python/mooncake/pg.py
// loads it, re-exports its names and registers the backends with
// torch.distributed.
#include <torch/csrc/distributed/c10d/Types.hpp>
#include <torch/csrc/utils/pybind.h>
#include <torch/python.h>

#include "backend_options.h"
#ifdef MOONCAKE_PG_WITH_CUDA
#include "cuda/cuda_backend.h"
#endif
#include "mooncake/pg/membership.h"
#include "mooncake/pg/test_faults.h"
#include "process_group.h"
#include "settings.h"
#include "work.h"

namespace py = pybind11;
using namespace mooncake::pg;

namespace {

MooncakeProcessGroup& requireMooncake(const c10::intrusive_ptr<c10d::ProcessGroup>& group, const char* fn) {
  auto* pg = dynamic_cast<MooncakeProcessGroup*>(group.get());
  TORCH_CHECK_TYPE(pg != nullptr, fn, ": backend must be a process group created with backend \"mooncake\" or "
                   "\"mooncake-cpu\", got one of backend \"", group ? group->getBackendName() : "None", "\"");
  return *pg;
}

MooncakeBackendOptions optionsFrom(const py::object& pg_options) {
  if (pg_options.is_none()) {
    MooncakeBackendOptions o;
    // Without options, the environment decides the failure policy (as in the reference).
    auto flag = [](const char* name) {
      const char* v = std::getenv(name);
      return v == nullptr || std::string(v) != "0";
    };
    o.auto_deactivate_on_failure = flag("MOONCAKE_PG_AUTO_DEACTIVATE_ON_FAILURE");
    o.auto_sync_on_failure = flag("MOONCAKE_PG_AUTO_SYNC_ON_FAILURE");
    if (!o.auto_deactivate_on_failure) o.auto_sync_on_failure = false;
    return o;
  }
  TORCH_CHECK_TYPE(py::isinstance<MooncakeBackendOptions>(pg_options),
                   "pg_options must be mooncake.pg.MooncakeBackendOptions or None, got ",
                   std::string(py::str(py::type::handle_of(pg_options))));
  return pg_options.cast<MooncakeBackendOptions>();
}

// The host backend of a group: all of "mooncake-cpu", and the membership
// and host paths of "mooncake".
c10::intrusive_ptr<MooncakeCpuBackend> createHostBackend(const c10d::DistributedBackendOptions& opts,
                                                         const py::object& pg_options, const char* key_prefix) {
  MooncakeBackendOptions options = optionsFrom(pg_options);
  auto timeout = std::chrono::duration_cast<std::chrono::milliseconds>(opts.timeout);
  GroupIdentity identity;
  identity.rank = opts.group_rank;
  identity.size = opts.group_size;
  identity.group_name = opts.group_id;
  for (int64_t g : opts.global_ranks_in_group) identity.global_ranks.push_back(static_cast<int>(g));
  if (identity.global_ranks.empty()) {  // torch names them for every group it creates; be safe anyway
    for (int r = 0; r < opts.group_size; ++r) identity.global_ranks.push_back(r);
  }
  identity.key_prefix = key_prefix;
  c10::intrusive_ptr<MooncakeCpuBackend> backend;
  {
    py::gil_scoped_release release;  // registration waits until every founder arrives
    backend = c10::make_intrusive<MooncakeCpuBackend>(opts.store, identity, timeout, options);
  }
  settings().groups_created++;
  return backend;
}

c10::intrusive_ptr<c10d::ProcessGroup> createCpuGroup(const c10d::DistributedBackendOptions& opts,
                                                      const py::object& pg_options) {
  auto backend = createHostBackend(opts, pg_options, "cpu:");
  return c10::make_intrusive<MooncakeProcessGroup>(opts.store, opts.group_rank, opts.group_size, backend);
}

c10::intrusive_ptr<c10d::ProcessGroup> createCudaGroup(const c10d::DistributedBackendOptions& opts,
                                                       const py::object& pg_options) {
#ifdef MOONCAKE_PG_WITH_CUDA
  auto host = createHostBackend(opts, pg_options, "cuda:");
  auto cuda = c10::make_intrusive<MooncakeCudaBackend>(host);
  return c10::make_intrusive<MooncakeProcessGroup>(opts.store, opts.group_rank, opts.group_size, host, cuda);
#else
  (void)opts;
  (void)pg_options;
  TORCH_CHECK(false, "backend \"mooncake\" (CUDA tensors) is not built in this version of mooncake (it was built "
              "without CUDA, or against a torch without CUDA); use \"mooncake-cpu\" for CPU tensors");
#endif
}

MooncakeBackendOptions makeOptions(std::optional<at::Tensor> active_ranks, bool is_extension, int max_group_size,
                                   bool auto_deactivate, bool auto_sync) {
  MooncakeBackendOptions o{std::move(active_ranks), is_extension, max_group_size, auto_deactivate, auto_sync};
  try {
    o.validate();
  } catch (const std::invalid_argument& e) {
    throw py::value_error(e.what());
  }
  return o;
}

void beforeAnyGroup(const char* fn) {
  TORCH_CHECK(settings().groups_created.load() == 0, fn, " must be called before the first Mooncake process group is "
              "created");
}

}  // namespace

PYBIND11_MODULE(MOONCAKE_PG_MODULE_NAME, m) {
  m.doc() = "Mooncake process group for torch.distributed (built against torch " MOONCAKE_TORCH_VERSION ")";
  py::module_::import("torch.distributed");

  // NOLINTNEXTLINE(bugprone-unused-raii): registering the class is the point; the object is not kept.
  py::class_<MooncakeProcessGroup, c10d::ProcessGroup, c10::intrusive_ptr<MooncakeProcessGroup>>(
      m, "MooncakeProcessGroup");

  // Tensor overloads first, so that a one-element tensor is not taken for an int.
  py::class_<MooncakeBackendOptions>(m, "MooncakeBackendOptions")
      .def(py::init([](at::Tensor active) { return makeOptions(active, false, 0, true, true); }), py::arg("active_ranks"))
      .def(py::init([](at::Tensor active, bool ext) { return makeOptions(active, ext, 0, true, true); }),
           py::arg("active_ranks"), py::arg("is_extension"))
      .def(py::init([](at::Tensor active, bool ext, int max) { return makeOptions(active, ext, max, true, true); }),
           py::arg("active_ranks"), py::arg("is_extension"), py::arg("max_group_size"))
      .def(py::init([](int max) { return makeOptions(std::nullopt, false, max, true, true); }), py::arg("max_group_size"))
      .def(py::init([](int max, bool ext) { return makeOptions(std::nullopt, ext, max, true, true); }),
           py::arg("max_group_size"), py::arg("is_extension"))
      .def(py::init([](int max, bool ext, bool deact, bool sync) {
             return makeOptions(std::nullopt, ext, max, deact, sync);
           }),
           py::arg("max_group_size"), py::arg("is_extension"), py::arg("auto_deactivate_on_failure"),
           py::arg("auto_sync_on_failure"));


  // Membership statuses and responses (no export_values, as in the reference).
  py::enum_<SyncAfterFailureStatus> sync_status(m, "SyncAfterFailureStatus");
  sync_status.value("Reconciled", SyncAfterFailureStatus::Reconciled)
      .value("NoPending", SyncAfterFailureStatus::NoPending)
      .value("Rejected", SyncAfterFailureStatus::Rejected);
  py::enum_<ProposalStatus> proposal_status(m, "ProposalStatus");
  proposal_status.value("Rejected", ProposalStatus::Rejected)
      .value("Applied", ProposalStatus::Applied)
      .value("AppliedWithDroppedRanks", ProposalStatus::AppliedWithDroppedRanks);
  m.attr("ViewUpdateStatus") = proposal_status;
  py::class_<SyncAfterFailureResponse>(m, "SyncAfterFailureResponse")
      .def_readonly("status", &SyncAfterFailureResponse::status)
      .def_readonly("reject_reason", &SyncAfterFailureResponse::reject_reason);
  py::class_<ProposeViewUpdateResponse>(m, "ProposeViewUpdateResponse")
      .def_readonly("status", &ProposeViewUpdateResponse::status)
      .def_readonly("new_epoch", &ProposeViewUpdateResponse::new_epoch)
      .def_readonly("dropped_ranks", &ProposeViewUpdateResponse::dropped_ranks)
      .def_readonly("reject_reason", &ProposeViewUpdateResponse::reject_reason);

  m.def("createMooncakeCpuBackend", &createCpuGroup, py::arg("distributed_backend_options"), py::arg("pg_options"));
  m.def("createMooncakeBackend", &createCudaGroup, py::arg("distributed_backend_options"), py::arg("pg_options"));

  m.def("set_host_ip", [](const std::string& host) {
    TORCH_CHECK_VALUE(!host.empty(), "set_host_ip: host must not be empty");
    std::lock_guard lock(settings().mutex);
    TORCH_CHECK(settings().groups_created.load() == 0 || settings().host_ip.empty() || settings().host_ip == host,
                "set_host_ip: cannot change the host after the first group was created");
    settings().host_ip = host;
  }, py::arg("host"));
  m.def("set_device_filter", [](std::vector<std::string> filter) {
    std::sort(filter.begin(), filter.end());
    filter.erase(std::unique(filter.begin(), filter.end()), filter.end());
    std::lock_guard lock(settings().mutex);
    TORCH_CHECK(settings().groups_created.load() == 0 || settings().device_filter == filter,
                "set_device_filter: cannot change the device filter after the first group was created");
    settings().device_filter = filter;
  }, py::arg("device_filter"));
  m.def(
      "set_transfer_engine",
      [](const py::object& engine) {
        beforeAnyGroup("set_transfer_engine");
        settings().transfer_engine_ptr = engine.is_none() ? 0 : engine.attr("get_engine_ptr")().cast<uint64_t>();
      },
      py::arg("engine"));
  m.def("set_collective_timeout_us", [](int64_t us) {
    TORCH_CHECK_VALUE(us > 0, "set_collective_timeout_us: timeout must be positive, got ", us);
    settings().collective_timeout_us = us;
  }, py::arg("us"));  // the reference's keyword
  m.def("set_p2p_timeout_us", [](int64_t us) {
    TORCH_CHECK_VALUE(us >= 0, "set_p2p_timeout_us: timeout must not be negative, got ", us);
    settings().p2p_timeout_us = us;
  }, py::arg("us"));

  m.def("get_active_ranks", [](const c10::intrusive_ptr<c10d::ProcessGroup>& backend) {
    return requireMooncake(backend, "get_active_ranks").activeRanks();
  }, py::arg("backend"));
  m.def("get_num_synced_ranks", [](const c10::intrusive_ptr<c10d::ProcessGroup>& backend) {
    return requireMooncake(backend, "get_num_synced_ranks").membership().numSyncedRanks();
  }, py::arg("backend"));
  m.def("get_current_epoch", [](const c10::intrusive_ptr<c10d::ProcessGroup>& backend) {
    return requireMooncake(backend, "get_current_epoch").epoch();
  }, py::arg("backend"));
  m.def("get_peer_state", [](const c10::intrusive_ptr<c10d::ProcessGroup>& backend, const std::vector<int>& ranks) {
    MooncakeProcessGroup& group = requireMooncake(backend, "get_peer_state");
    std::vector<bool> states;
    for (int r : ranks) {
      TORCH_CHECK_VALUE(r >= 0 && r < group.maxGroupSize(), "get_peer_state: rank ", r, " is outside [0, ",
                        group.maxGroupSize(), ") (max_group_size)");
      states.push_back(group.membership().peerState(r));
    }
    return states;
  }, py::arg("backend"), py::arg("ranks"));
  m.def("join_group", [](const c10::intrusive_ptr<c10d::ProcessGroup>& backend) {
    GroupMembership& membership = requireMooncake(backend, "join_group").membership();
    py::gil_scoped_release release;
    membership.joinGroup();
  }, py::arg("backend"));
  auto propose = [](bool activate, const char* fn) {
    return [activate, fn](const c10::intrusive_ptr<c10d::ProcessGroup>& backend, const std::vector<int>& ranks) {
      MooncakeProcessGroup& group = requireMooncake(backend, fn);
      for (int r : ranks) {
        TORCH_CHECK_VALUE(r >= 0 && r < group.maxGroupSize(), fn, ": rank ", r, " is outside [0, ",
                          group.maxGroupSize(), ") (max_group_size)");
      }
      py::gil_scoped_release release;
      return group.membership().propose(activate, ranks);
    };
  };
  m.def("activate_ranks", propose(true, "activate_ranks"), py::arg("backend"), py::arg("ranks"));
  m.def("recover_ranks", propose(true, "recover_ranks"), py::arg("backend"), py::arg("ranks"));
  m.def("deactivate_ranks", propose(false, "deactivate_ranks"), py::arg("backend"), py::arg("ranks"));
  m.def("sync_after_failure", [](const c10::intrusive_ptr<c10d::ProcessGroup>& backend) {
    GroupMembership& membership = requireMooncake(backend, "sync_after_failure").membership();
    py::gil_scoped_release release;
    return membership.syncAfterFailure();
  }, py::arg("backend"));
  m.def("set_fault_reconciliation_window_us", [](int64_t us) {
    TORCH_CHECK_VALUE(us >= 0, "set_fault_reconciliation_window_us: the window must not be negative, got ", us);
    settings().fault_reconciliation_window_us.store(us);
  }, py::arg("us"));
  m.def("extend_group_size_to", [](const c10::intrusive_ptr<c10d::ProcessGroup>& backend, int) {
    requireMooncake(backend, "extend_group_size_to");
    TORCH_WARN("extend_group_size_to is deprecated and does nothing: seats are fixed by max_group_size; use "
               "join_group and activate_ranks");
  }, py::arg("backend"), py::arg("size"));
  m.def("get_failed_ranks_hint", [](const c10::intrusive_ptr<c10d::Work>& work) -> py::object {
    auto* w = dynamic_cast<MooncakeWork*>(work.get());
    if (w == nullptr) return py::none();
    {
      py::gil_scoped_release release;  // CUDA work may still be running on its stream
      w->awaitOutcome();
    }
    return py::cast(w->failedRanksHint());
  }, py::arg("work"));
  m.def("get_local_success", [](const c10::intrusive_ptr<c10d::Work>& work) {
    auto* w = dynamic_cast<MooncakeWork*>(work.get());
    if (w == nullptr) return false;
    {
      py::gil_scoped_release release;
      w->awaitOutcome();
    }
    return w->localSuccess();
  }, py::arg("work"));

  // TEST ONLY (mooncake/pg/test_faults.h): cuts this process's network
  // traffic for good, as a pulled cable would (control=False: only the data
  // plane's); the process keeps running.
  m.def("_test_cut_traffic", [](bool control) { test_faults::cutTraffic(control); }, py::arg("control") = true);

  m.attr("TORCH_VERSION") = MOONCAKE_TORCH_VERSION;
#ifdef MOONCAKE_PG_WITH_CUDA
  m.attr("SUPPORT_CUDA") = true;
#else
  m.attr("SUPPORT_CUDA") = false;
#endif
}
