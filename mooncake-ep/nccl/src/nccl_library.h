// The NCCL library, opened at run time rather than linked. By the time this
// code runs, torch has loaded its own NCCL (2.28.9 with torch 2.11) under the
// same soname; a linked module would then fail to load with an undefined
// symbol. Opened here, the library already in the process is used, its
// version is checked against the headers, and what is missing is said in
// words (nccl_rules.h: runtimeVersionProblem).
#pragma once

#include <nccl.h>
#include <nccl_device/host.h>

#include <string>

namespace mooncake::ep::nccl {

// The entry points the transport calls, each resolved by name.
struct NcclLibrary {
  int version = 0;  // ncclGetVersion of the library in the process
  decltype(&ncclGetVersion) getVersion = nullptr;
  decltype(&ncclGetErrorString) getErrorString = nullptr;
  decltype(&ncclGetLastError) getLastError = nullptr;
  decltype(&ncclGetUniqueId) getUniqueId = nullptr;
  decltype(&ncclCommInitRankConfig) commInitRankConfig = nullptr;
  decltype(&ncclCommGetAsyncError) commGetAsyncError = nullptr;
  decltype(&ncclCommFinalize) commFinalize = nullptr;
  decltype(&ncclCommDestroy) commDestroy = nullptr;
  decltype(&ncclCommAbort) commAbort = nullptr;
  decltype(&ncclAllReduce) allReduce = nullptr;
  decltype(&ncclMemAlloc) memAlloc = nullptr;
  decltype(&ncclMemFree) memFree = nullptr;
  decltype(&ncclCommWindowRegister) commWindowRegister = nullptr;
  decltype(&ncclCommWindowDeregister) commWindowDeregister = nullptr;
  decltype(&ncclTeamLsa) teamLsa = nullptr;
  decltype(&ncclTeamRankToWorld) teamRankToWorld = nullptr;
  decltype(&ncclGetLsaDevicePointer) getLsaDevicePointer = nullptr;
};

// The library of this process (opened once), or null with *error saying why
// (none loadable, a missing entry point, or a version the headers rule out).
const NcclLibrary* ncclLibrary(std::string* error);

// The version of the NCCL library in this process, 0 when none can be opened.
int ncclRuntimeVersion();

}  // namespace mooncake::ep::nccl
