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

# NCCL device API (ElasticBuffer's transport='nccl'): no source of this tree
# uses it yet, so nothing can be built for it, whatever headers are found.
# ON fails here, saying so; AUTO and OFF build without it (reported below and
# by mooncake.ep.has_nccl_device_support()). When the path is written, detect
# nccl_device.h (NCCL >= 2.28) here and gate its sources on
# MOONCAKE_WITH_NCCL_DEVICE_ENABLED.
if(MOONCAKE_WITH_NCCL_DEVICE STREQUAL "ON")
  message(FATAL_ERROR "MOONCAKE_WITH_NCCL_DEVICE=ON, but this source tree has no NCCL device API path yet "
                      "(no source uses nccl_device.h; ElasticBuffer's transport='nccl' is not implemented): "
                      "configure with MOONCAKE_WITH_NCCL_DEVICE=AUTO or OFF")
endif()
set(MOONCAKE_WITH_NCCL_DEVICE_ENABLED OFF)

if(MOONCAKE_WITH_CUDA_ENABLED)
  enable_language(CUDA)
endif()
