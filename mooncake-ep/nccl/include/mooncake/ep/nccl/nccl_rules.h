// The NCCL transport's rules that need no NCCL and no GPU, so that CI checks
// them in every build: which NCCL runtime a build may run on, which
// topologies it runs on, and how many bytes its symmetric window takes.
#pragma once

#include <cstddef>
#include <string>

namespace mooncake::ep::nccl {

// NCCL_VERSION(2, 30, 4): the oldest NCCL the transport is held to (issue 17;
// cmake/MooncakeNccl.cmake applies the same floor to the headers).
constexpr int kMinNcclVersionCode = 23004;

// NCCL's version code for major.minor.patch (NCCL's NCCL_VERSION macro:
// X * 1000 + Y * 100 + Z up to 2.8, X * 10000 + Y * 100 + Z after).
int ncclVersionCode(int major, int minor, int patch);
// "2.32.6" for 23206 (and "2.8.4" for the old encoding's 2804).
std::string ncclVersionText(int code);

// "" when code built against NCCL headers `header_code` may run on the NCCL
// library of version `runtime_code` already loaded in the process (0: none
// could be loaded); else why not, saying what to preload. The rule: the same
// major version, not older than the headers (an older library lacks what the
// headers declare) and not older than kMinNcclVersionCode.
std::string runtimeVersionProblem(int runtime_code, int header_code);

// "" when a group of `num_ranks` ranks can run on NCCL's LSA team of
// `lsa_team_size` ranks that this rank is in, else why not. The kernels
// address every rank directly (no GIN path yet), so every rank must be in
// the LSA team: any number of ranks up to the kernels' kMaxEpRanks, on one
// host or a multi-node NVLink domain, in whatever order NCCL numbers them.
std::string lsaTeamProblem(int num_ranks, int lsa_team_size);

// Bytes of one rank's symmetric window for the EP kernels' receive region of
// these sizes: the region, rounded up to NCCL's window alignment.
size_t windowBytes(int max_tokens_per_rank, int hidden, int num_experts, int num_ranks);
constexpr size_t kWindowAlignment = 4096;  // NCCL_WIN_REQUIRED_ALIGNMENT

}  // namespace mooncake::ep::nccl
