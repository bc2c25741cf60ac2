# NCCL's device API (ElasticBuffer's transport='nccl'): detection of the
# headers and the version rule. Only headers: the library is not linked but
# opened at run time (mooncake-ep/nccl/src/nccl_library.cpp), because the
# process already holds torch's NCCL by then and the module must be able to
# say that it is too old instead of failing to load.
#
# Where to look: MOONCAKE_NCCL_ROOT or NCCL_ROOT (CMake variables or
# environment), a folder with include/nccl.h and include/nccl_device.h (the
# PyPI wheel nvidia-nccl-cu13 unpacks to that: scripts/build_nccl_device.sh),
# then the system's default paths.
#
# The rule: headers of NCCL >= MOONCAKE_NCCL_MIN_VERSION, the floor the
# transport is held to (issue 17). The transport asks the symmetric window
# for every LSA peer's address on the host (ncclGetLsaDevicePointer) and the
# communicator for its properties (ncclCommQueryProperties); NCCL 2.28, the
# one torch 2.11 ships, has neither.
# Sets MOONCAKE_NCCL_FOUND, MOONCAKE_NCCL_INCLUDE_DIR, MOONCAKE_NCCL_VERSION ("2.32.6"), MOONCAKE_NCCL_VERSION_CODE (23206) and,
# when not found, MOONCAKE_NCCL_WHY_NOT.
set(MOONCAKE_NCCL_MIN_VERSION "2.30.4")  # kMinNcclVersionCode in mooncake/ep/nccl/nccl_rules.h

function(mooncake_find_nccl_device)
  set(MOONCAKE_NCCL_FOUND OFF PARENT_SCOPE)
  set(_hints)
  foreach(_root IN ITEMS "${MOONCAKE_NCCL_ROOT}" "$ENV{MOONCAKE_NCCL_ROOT}" "${NCCL_ROOT}" "$ENV{NCCL_ROOT}")
    if(_root)
      list(APPEND _hints "${_root}")
    endif()
  endforeach()
  # Cached results are dropped so that a new root (or new headers) is seen
  # at the next configure.
  unset(MOONCAKE_NCCL_INCLUDE_DIR CACHE)
  find_path(MOONCAKE_NCCL_INCLUDE_DIR nccl_device.h HINTS ${_hints} PATH_SUFFIXES include)
  if(NOT MOONCAKE_NCCL_INCLUDE_DIR OR NOT EXISTS "${MOONCAKE_NCCL_INCLUDE_DIR}/nccl.h")
    string(CONCAT _why "no nccl.h with nccl_device.h found (set MOONCAKE_NCCL_ROOT or NCCL_ROOT to a folder with "
                  "include/; scripts/build_nccl_device.sh fetches PyPI's nvidia-nccl-cu13)")
    set(MOONCAKE_NCCL_WHY_NOT "${_why}" PARENT_SCOPE)
    return()
  endif()
  file(STRINGS "${MOONCAKE_NCCL_INCLUDE_DIR}/nccl.h" _lines REGEX "^#define NCCL_(MAJOR|MINOR|PATCH) +[0-9]+")
  foreach(_part MAJOR MINOR PATCH)
    string(REGEX MATCH "NCCL_${_part} +([0-9]+)" _match "${_lines}")
    set(_${_part} "${CMAKE_MATCH_1}")
  endforeach()
  if(_MAJOR STREQUAL "" OR _MINOR STREQUAL "" OR _PATCH STREQUAL "")
    set(MOONCAKE_NCCL_WHY_NOT "${MOONCAKE_NCCL_INCLUDE_DIR}/nccl.h has no NCCL_MAJOR/MINOR/PATCH" PARENT_SCOPE)
    return()
  endif()
  set(_version "${_MAJOR}.${_MINOR}.${_PATCH}")
  if(_version VERSION_LESS MOONCAKE_NCCL_MIN_VERSION)
    string(CONCAT _why "the NCCL headers in ${MOONCAKE_NCCL_INCLUDE_DIR} are ${_version}; the transport needs >= "
                  "${MOONCAKE_NCCL_MIN_VERSION} (PyPI: nvidia-nccl-cu13==2.32.6)")
    set(MOONCAKE_NCCL_WHY_NOT "${_why}" PARENT_SCOPE)
    return()
  endif()
  math(EXPR _code "${_MAJOR} * 10000 + ${_MINOR} * 100 + ${_PATCH}")
  set(MOONCAKE_NCCL_FOUND ON PARENT_SCOPE)
  set(MOONCAKE_NCCL_VERSION "${_version}" PARENT_SCOPE)
  set(MOONCAKE_NCCL_VERSION_CODE "${_code}" PARENT_SCOPE)
endfunction()

# mooncake_use_nccl_headers(<target>): NCCL's headers (no library: see
# above) for one of the transport's targets, ahead of every other include
# folder: the CUDA toolkit carries an NCCL of its own in its include folder,
# which must not shadow the one found here.
function(mooncake_use_nccl_headers target)
  target_include_directories(${target} SYSTEM BEFORE PRIVATE "${MOONCAKE_NCCL_INCLUDE_DIR}")
endfunction()
