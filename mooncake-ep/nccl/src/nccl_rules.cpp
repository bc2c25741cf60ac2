#include "mooncake/ep/nccl/nccl_rules.h"

#include "mooncake/ep/cuda/ep_ipc_group.h"  // kMaxEpRanks
#include "region_layout.h"

namespace mooncake::ep::nccl {

namespace {

struct Parts {
  int major, minor, patch;
};

// NCCL 2.9 changed the encoding; codes below 2.9.0's 20900 use the old one.
Parts partsOf(int code) {
  if (code < 20900) return {code / 1000, code % 1000 / 100, code % 100};
  return {code / 10000, code % 10000 / 100, code % 100};
}

}  // namespace

int ncclVersionCode(int major, int minor, int patch) {
  if (major <= 2 && minor <= 8) return major * 1000 + minor * 100 + patch;
  return major * 10000 + minor * 100 + patch;
}

std::string ncclVersionText(int code) {
  const Parts p = partsOf(code);
  return std::to_string(p.major) + "." + std::to_string(p.minor) + "." + std::to_string(p.patch);
}

std::string runtimeVersionProblem(int runtime_code, int header_code) {
  const std::string built = ncclVersionText(header_code);
  const std::string preload =
      "preload the NCCL this module was built against before torch loads its own, e.g. "
      "LD_PRELOAD=<site-packages>/nvidia/nccl/lib/libnccl.so.2 of nvidia-nccl-cu13==" +
      built + " (docs/ep-elastic.md)";
  if (runtime_code <= 0) return "no NCCL library could be loaded (libnccl.so.2); " + preload;
  const std::string running = ncclVersionText(runtime_code);
  if (partsOf(runtime_code).major != partsOf(header_code).major) {
    return "the NCCL loaded in this process is " + running + ", another major version than the headers (" + built +
           "); " + preload;
  }
  if (runtime_code < header_code || runtime_code < kMinNcclVersionCode) {
    return "the NCCL loaded in this process is " + running + " (torch 2.11 ships 2.28.9); the NCCL transport needs " +
           ncclVersionText(header_code > kMinNcclVersionCode ? header_code : kMinNcclVersionCode) + " or newer; " +
           preload;
  }
  return {};
}

std::string lsaTeamProblem(int num_ranks, int lsa_team_size) {
  if (num_ranks > cuda::kMaxEpRanks) {
    return std::to_string(num_ranks) + " ranks: the EP kernels address at most " + std::to_string(cuda::kMaxEpRanks) +
           " peers";
  }
  if (lsa_team_size != num_ranks) {
    return "NCCL's LSA team of this rank holds " + std::to_string(lsa_team_size) + " of the " +
           std::to_string(num_ranks) +
           " ranks (the others are reached only over the network, through GIN, which "
           "this transport does not use yet); the NCCL transport needs every rank in one LSA team (one host, or one "
           "multi-node NVLink domain)";
  }
  return {};
}

size_t windowBytes(int max_tokens_per_rank, int hidden, int num_experts, int num_ranks) {
  const size_t region = cuda::RegionLayout::make(max_tokens_per_rank, hidden, num_experts, num_ranks).total;
  return (region + kWindowAlignment - 1) / kWindowAlignment * kWindowAlignment;
}

}  // namespace mooncake::ep::nccl
