# mooncake::warnings: the one set of compiler warnings of the project. Every
# target built from this tree's sources (libraries, modules, tests,
# benchmarks, fuzzers) links it PRIVATE, so that none is built without them.
# MOONCAKE_WERROR turns them into errors for C++ (not for nvcc's host pass,
# which also sees the CUDA headers).
add_library(mooncake_warnings INTERFACE)
add_library(mooncake::warnings ALIAS mooncake_warnings)
target_compile_options(mooncake_warnings INTERFACE
  "$<$<COMPILE_LANGUAGE:C,CXX>:-Wall;-Wextra>"
  "$<$<COMPILE_LANGUAGE:CUDA>:-Xcompiler=-Wall,-Wextra>"
  "$<$<AND:$<COMPILE_LANGUAGE:CXX>,$<BOOL:${MOONCAKE_WERROR}>>:-Werror>")
