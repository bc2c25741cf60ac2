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
            "import os, torch; print(torch.__version__); print(os.path.dirname(torch.__file__)); print(int(torch._C._GLIBCXX_USE_CXX11_ABI))"
    OUTPUT_VARIABLE _out OUTPUT_STRIP_TRAILING_WHITESPACE RESULT_VARIABLE _rc ERROR_QUIET)
  if(NOT _rc EQUAL 0)
    set(MOONCAKE_TORCH_FOUND OFF PARENT_SCOPE)
    return()
  endif()
  string(REPLACE "\n" ";" _lines "${_out}")
  list(GET _lines 0 _version)
  list(GET _lines 1 _root)
  list(GET _lines 2 _abi)
  mooncake_torch_version_suffix(_suffix "${_version}")
  set(MOONCAKE_TORCH_FOUND ON PARENT_SCOPE)
  set(MOONCAKE_TORCH_VERSION "${_version}" PARENT_SCOPE)
  set(MOONCAKE_TORCH_SUFFIX "${_suffix}" PARENT_SCOPE)
  set(MOONCAKE_TORCH_ROOT "${_root}" PARENT_SCOPE)
  set(MOONCAKE_TORCH_CXX11_ABI "${_abi}" PARENT_SCOPE)
  message(STATUS "mooncake: torch ${_version} at ${_root}")
endfunction()

# mooncake_add_torch_module(<target> <component> SOURCES ... LIBRARIES ...):
# the extension module mooncake.<component>_<suffix>, compiled against the
# torch found above (headers and libraries straight from the wheel: no CUDA
# toolkit is needed for CPU-only modules).
function(mooncake_add_torch_module target component)
  cmake_parse_arguments(ARG "" "" "SOURCES;LIBRARIES" ${ARGN})
  set(module "${component}_${MOONCAKE_TORCH_SUFFIX}")
  mooncake_add_python_module(${target} ${module} SOURCES ${ARG_SOURCES} LIBRARIES ${ARG_LIBRARIES})
  target_include_directories(${target} SYSTEM PRIVATE
    "${MOONCAKE_TORCH_ROOT}/include" "${MOONCAKE_TORCH_ROOT}/include/torch/csrc/api/include")
  set(lib "${MOONCAKE_TORCH_ROOT}/lib")
  target_link_libraries(${target} PRIVATE "${lib}/libtorch.so" "${lib}/libtorch_cpu.so" "${lib}/libc10.so"
                                          "${lib}/libtorch_python.so")
  target_compile_definitions(${target} PRIVATE
    MOONCAKE_PG_MODULE_NAME=${module}
    MOONCAKE_TORCH_VERSION="${MOONCAKE_TORCH_VERSION}"
    TORCH_EXTENSION_NAME=${module}
    TORCH_API_INCLUDE_EXTENSION_H
    _GLIBCXX_USE_CXX11_ABI=${MOONCAKE_TORCH_CXX11_ABI})
  # Found next to torch's own libraries: in the build tree and in site-packages.
  set_target_properties(${target} PROPERTIES BUILD_RPATH "${lib}" INSTALL_RPATH "$ORIGIN/../torch/lib")
endfunction()
