# Build options. Every optional part is detected: AUTO builds it when its
# toolchain or library is present, ON requires it, OFF skips it. What was built
# is reported at configure time (MooncakeSummary) and at run time through the
# SUPPORT_* flags of mooncake.engine.

set(MOONCAKE_WITH_CUDA AUTO CACHE STRING "CUDA transports and kernels (AUTO/ON/OFF)")
set(MOONCAKE_WITH_RDMA AUTO CACHE STRING "RDMA transport over rdma-core ibverbs (AUTO/ON/OFF)")
set(MOONCAKE_WITH_EP AUTO CACHE STRING "Expert-parallel dispatch/combine (AUTO/ON/OFF)")
set(MOONCAKE_WITH_NCCL_DEVICE AUTO CACHE STRING "NCCL device API path for ElasticBuffer (AUTO/ON/OFF)")
set_property(CACHE MOONCAKE_WITH_CUDA MOONCAKE_WITH_RDMA MOONCAKE_WITH_EP MOONCAKE_WITH_NCCL_DEVICE
             PROPERTY STRINGS AUTO ON OFF)

option(MOONCAKE_BUILD_PYTHON "Build the Python extension modules" ON)
option(MOONCAKE_BUILD_TESTS "Build the GoogleTest suites" ON)
option(MOONCAKE_BUILD_BENCHMARKS "Build the C++ benchmarks" ON)
option(MOONCAKE_WERROR "Treat compiler warnings as errors" OFF)
# libFuzzer targets (tests/fuzz): clang only, in a build tree of their own,
# where every library is built with the fuzzer's coverage and ASan/UBSan.
option(MOONCAKE_BUILD_FUZZERS "Build the libFuzzer targets (clang)" OFF)

# mooncake_resolve_feature(<var> <found>): turn AUTO/ON/OFF plus a detection
# result into a boolean <var>_ENABLED, failing loudly when ON cannot be met.
function(mooncake_resolve_feature name found)
  set(request "${${name}}")
  if(request STREQUAL "OFF")
    set(${name}_ENABLED OFF PARENT_SCOPE)
  elseif(found)
    set(${name}_ENABLED ON PARENT_SCOPE)
  elseif(request STREQUAL "ON")
    message(FATAL_ERROR "${name}=ON but its dependency was not found")
  else()
    set(${name}_ENABLED OFF PARENT_SCOPE)
  endif()
endfunction()

# CUDA: a working nvcc is enough to compile; nothing here needs a GPU at build time.
set(_cuda_found OFF)
if(NOT MOONCAKE_WITH_CUDA STREQUAL "OFF")
  include(CheckLanguage)
  check_language(CUDA)
  if(CMAKE_CUDA_COMPILER)
    find_package(CUDAToolkit QUIET)
    if(CUDAToolkit_FOUND)
      set(_cuda_found ON)
    endif()
  endif()
endif()
mooncake_resolve_feature(MOONCAKE_WITH_CUDA ${_cuda_found})

# RDMA: rdma-core's libibverbs headers (the library is opened at run time).
# Enabled, it builds the rdma transport (src/transport/rdma/) with the libibverbs
# and software providers; otherwise neither is built (mooncake-transfer-engine).
set(_rdma_found OFF)
if(NOT MOONCAKE_WITH_RDMA STREQUAL "OFF")
  find_path(IBVERBS_INCLUDE_DIR infiniband/verbs.h)
  if(IBVERBS_INCLUDE_DIR)
    set(_rdma_found ON)
  endif()
endif()
mooncake_resolve_feature(MOONCAKE_WITH_RDMA ${_rdma_found})

# EP's kernels need CUDA; without them EP still runs on its collective path
# (Python, over the process group's own operations).
mooncake_resolve_feature(MOONCAKE_WITH_EP ${MOONCAKE_WITH_CUDA_ENABLED})

# NCCL device API (ElasticBuffer's transport='nccl', mooncake-ep/nccl/): the
# EP kernels over an NCCL symmetric window. Needs EP (hence CUDA) and NCCL
# headers >= 2.30.4 with the library (cmake/MooncakeNccl.cmake: where it
# looks, MOONCAKE_NCCL_ROOT / NCCL_ROOT). AUTO builds it only when found, so
# a build without those headers is the same as before; ON fails here, saying
# what is missing.
include(MooncakeNccl)
set(MOONCAKE_NCCL_WHY_NOT "MOONCAKE_WITH_NCCL_DEVICE=OFF")
set(_nccl_found OFF)
if(NOT MOONCAKE_WITH_NCCL_DEVICE STREQUAL "OFF")
  if(NOT MOONCAKE_WITH_EP_ENABLED)
    set(MOONCAKE_NCCL_WHY_NOT "it needs the EP kernels, hence CUDA (MOONCAKE_WITH_EP is off or no CUDA toolkit)")
  else()
    mooncake_find_nccl_device()
    set(_nccl_found ${MOONCAKE_NCCL_FOUND})
  endif()
endif()
if(MOONCAKE_WITH_NCCL_DEVICE STREQUAL "ON" AND NOT _nccl_found)
  message(FATAL_ERROR "MOONCAKE_WITH_NCCL_DEVICE=ON, but ${MOONCAKE_NCCL_WHY_NOT}")
endif()
mooncake_resolve_feature(MOONCAKE_WITH_NCCL_DEVICE ${_nccl_found})

if(MOONCAKE_WITH_CUDA_ENABLED)
  enable_language(CUDA)
endif()
