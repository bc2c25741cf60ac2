// mooncake._ep_nccl: the Python face of EpNcclGroup (mooncake-ep/nccl), the
// NCCL transport of ElasticBuffer. Torch-free, as mooncake._ep_ipc: tensors
// arrive as device addresses and the stream as its raw handle; the calls
// have _ep_ipc's names and arguments, so the Python side runs either group
// through one seam (mooncake/_ep_elastic/ipc_rows.py: KernelRows).
//
// Importing this module never fails for the NCCL in the process: NCCL is
// opened at run time, and RUNTIME_PROBLEM says whether it can be used
// ("" yes, else why not and what to preload).
#include <pybind11/pybind11.h>

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <memory>
#include <stdexcept>
#include <string>

#include "../ep_ipc/ep_call_args.h"
#include "mooncake/ep/nccl/ep_nccl_group.h"
#include "mooncake/ep/nccl/nccl_rules.h"

namespace py = pybind11;
using namespace mooncake::ep::nccl;
using mooncake::ep::python::defineKernelCalls;
using mooncake::ep::python::KernelCalls;

namespace {

// Holds the group; close() ends it early (collective, bounded), as the destructor would.
class PyEpNcclGroup : public KernelCalls<PyEpNcclGroup> {
 public:
  PyEpNcclGroup(const py::bytes& unique_id, int rank, int num_ranks, int max_tokens_per_rank, int hidden,
                int num_experts, int device, int setup_timeout_ms) {
    EpIpcGroupOptions options;
    options.max_tokens_per_rank = max_tokens_per_rank;
    options.hidden = hidden;
    options.num_experts = num_experts;
    options.device = device;
    options.attach_timeout = std::chrono::milliseconds(setup_timeout_ms);
    const std::string id = unique_id;
    std::string error;
    {
      py::gil_scoped_release release;  // waits for the peers
      group_ = EpNcclGroup::open(id, rank, num_ranks, options, &error);
    }
    if (!group_) throw std::runtime_error(error);
  }

  ~PyEpNcclGroup() {
    try {
      close(false);
    } catch (const std::exception& e) {  // a destructor must not throw: the process would end
      std::fprintf(stderr, "mooncake EP: closing an NCCL group failed: %s\n", e.what());
    }
  }
  PyEpNcclGroup(const PyEpNcclGroup&) = delete;
  PyEpNcclGroup& operator=(const PyEpNcclGroup&) = delete;

  void close(bool abandon) {
    if (!group_) return;
    py::gil_scoped_release release;
    if (abandon) group_->abandon();
    group_.reset();
  }

  EpNcclGroup& group() {
    if (!group_) throw std::runtime_error("EP NCCL group: already closed");
    return *group_;
  }

 private:
  std::unique_ptr<EpNcclGroup> group_;
};

py::bytes makeUniqueId() {
  std::string error;
  const std::string id = EpNcclGroup::makeUniqueId(&error);
  if (id.empty()) throw std::runtime_error(error);
  return py::bytes(id);
}

}  // namespace

PYBIND11_MODULE(_ep_nccl, m) {
  m.doc() = "ElasticBuffer's NCCL transport: the EP kernels over an NCCL symmetric window (docs/ep-elastic.md)";
  m.attr("HEADER_VERSION") = ncclHeaderVersion();
  m.attr("MIN_VERSION") = kMinNcclVersionCode;
  m.attr("RUNTIME_VERSION") = ncclLoadedVersion();
  m.attr("RUNTIME_PROBLEM") = ncclRuntimeProblem();
  m.def("version_text", &ncclVersionText, py::arg("code"), "'2.32.6' for 23206");
  m.def("lsa_team_problem", &lsaTeamProblem, py::arg("num_ranks"), py::arg("lsa_team_size"));
  m.def("make_unique_id", &makeUniqueId, "A fresh ncclUniqueId as bytes (rank 0 makes it, the group broadcasts it)");
  py::class_<PyEpNcclGroup> group_class(m, "EpNcclGroup");
  group_class
      .def(py::init<const py::bytes&, int, int, int, int, int, int, int>(), py::arg("unique_id"), py::arg("rank"),
           py::arg("num_ranks"), py::arg("max_tokens_per_rank"), py::arg("hidden"), py::arg("num_experts"),
           py::arg("device"), py::arg("setup_timeout_ms"),
           "Collective over every rank, bounded by setup_timeout_ms: the same unique_id and sizes everywhere.")
      .def("close", &PyEpNcclGroup::close, py::arg("abandon") = false,
           "Collective, bounded; abandon=True (after a failure) aborts the communicator instead of meeting the "
           "peers");
  defineKernelCalls<PyEpNcclGroup>(group_class);
}
