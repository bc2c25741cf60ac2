# Python and pybind11 discovery, and where extension modules land.
#
# In a developer build (plain cmake) the modules are written next to the
# package sources in python/mooncake/, so `PYTHONPATH=python` imports the
# working tree. Under `pip install .` (scikit-build-core sets SKBUILD) they are
# installed into the wheel's mooncake/ package instead.
find_package(Python 3.9 REQUIRED COMPONENTS Interpreter Development.Module)
execute_process(
  COMMAND "${Python_EXECUTABLE}" -c "import pybind11; print(pybind11.get_cmake_dir())"
  OUTPUT_VARIABLE _pybind11_dir OUTPUT_STRIP_TRAILING_WHITESPACE RESULT_VARIABLE _pybind11_rc)
if(NOT _pybind11_rc EQUAL 0)
  message(FATAL_ERROR "pybind11 is missing: pip install pybind11 (scripts/setup.sh does this)")
endif()
find_package(pybind11 CONFIG REQUIRED HINTS "${_pybind11_dir}")

# A build of its own (scripts/build_nccl_device.sh) may place them elsewhere.
set(MOONCAKE_PYTHON_PACKAGE_DIR "${PROJECT_SOURCE_DIR}/python/mooncake" CACHE PATH
    "Where a plain (non-pip) build places the extension modules")

# mooncake_add_python_module(<target> <module name> SOURCES ...): one extension
# module of the mooncake package, e.g. `engine` -> mooncake.engine.
function(mooncake_add_python_module target module_name)
  cmake_parse_arguments(ARG "" "" "SOURCES;LIBRARIES" ${ARGN})
  pybind11_add_module(${target} MODULE ${ARG_SOURCES})
  set_target_properties(${target} PROPERTIES OUTPUT_NAME "${module_name}")
  target_link_libraries(${target} PRIVATE ${ARG_LIBRARIES} mooncake::warnings)
  if(DEFINED SKBUILD)
    install(TARGETS ${target} LIBRARY DESTINATION mooncake)
  else()
    set_target_properties(${target} PROPERTIES LIBRARY_OUTPUT_DIRECTORY "${MOONCAKE_PYTHON_PACKAGE_DIR}")
  endif()
endfunction()
