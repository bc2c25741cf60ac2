# Use ccache for every compiler launch when it is installed: builds against
# torch and CUDA are slow on small machines, and rebuilds are the common case.
find_program(MOONCAKE_CCACHE ccache)
if(MOONCAKE_CCACHE AND NOT CMAKE_CXX_COMPILER_LAUNCHER)
  set(CMAKE_C_COMPILER_LAUNCHER "${MOONCAKE_CCACHE}")
  set(CMAKE_CXX_COMPILER_LAUNCHER "${MOONCAKE_CCACHE}")
  set(CMAKE_CUDA_COMPILER_LAUNCHER "${MOONCAKE_CCACHE}")
endif()
