# Torch discovery for the modules that are built against torch (the process
# group adapter, the EP binding). Such a module carries the torch version in its
# name, mooncake.<component>_<major>_<minor>_<patch> (pg_2_11_0 for torch
# 2.11.0+cu130), so that builds for several torch versions live side by side and
# python/mooncake/_torch_ext.py loads the one that matches the running torch.
# The suffix rule is the same in both places: keep them in step.

# mooncake_torch_version_suffix(<out> <version>): "2.11.0+cu130" -> "2_11_0".
function(mooncake_torch_version_suffix out version)
  if(NOT version MATCHES "^([0-9]+)\\.([0-9]+)\\.([0-9]+)")
    message(FATAL_ERROR "cannot parse torch version '${version}'")
  endif()
  set(${out} "${CMAKE_MATCH_1}_${CMAKE_MATCH_2}_${CMAKE_MATCH_3}" PARENT_SCOPE)
endfunction()

# mooncake_find_torch(): sets MOONCAKE_TORCH_FOUND, MOONCAKE_TORCH_VERSION,
# MOONCAKE_TORCH_SUFFIX and imports Torch's CMake package when present.
function(mooncake_find_torch)
  execute_process(
    COMMAND "${Python_EXECUTABLE}" -c
            "import torch, torch.utils; print(torch.__version__); print(torch.utils.cmake_prefix_path)"
    OUTPUT_VARIABLE _out OUTPUT_STRIP_TRAILING_WHITESPACE RESULT_VARIABLE _rc ERROR_QUIET)
  if(NOT _rc EQUAL 0)
    set(MOONCAKE_TORCH_FOUND OFF PARENT_SCOPE)
    return()
  endif()
  string(REPLACE "\n" ";" _lines "${_out}")
  list(GET _lines 0 _version)
  list(GET _lines 1 _prefix)
  mooncake_torch_version_suffix(_suffix "${_version}")
  set(MOONCAKE_TORCH_FOUND ON PARENT_SCOPE)
  set(MOONCAKE_TORCH_VERSION "${_version}" PARENT_SCOPE)
  set(MOONCAKE_TORCH_SUFFIX "${_suffix}" PARENT_SCOPE)
  set(MOONCAKE_TORCH_CMAKE_PREFIX "${_prefix}" PARENT_SCOPE)
endfunction()
