message(STATUS "mooncake: CUDA=${MOONCAKE_WITH_CUDA_ENABLED} RDMA=${MOONCAKE_WITH_RDMA_ENABLED} "
               "EP=${MOONCAKE_WITH_EP_ENABLED} NCCL_DEVICE=${MOONCAKE_WITH_NCCL_DEVICE_ENABLED} "
               "python=${MOONCAKE_BUILD_PYTHON} tests=${MOONCAKE_BUILD_TESTS}")
if(NOT MOONCAKE_WITH_RDMA_ENABLED)
  message(STATUS "mooncake: no rdma transport in this build (MOONCAKE_WITH_RDMA=${MOONCAKE_WITH_RDMA}; "
                 "AUTO needs rdma-core's headers, Debian: libibverbs-dev)")
endif()
if(MOONCAKE_WITH_NCCL_DEVICE_ENABLED)
  message(STATUS "mooncake: NCCL device API ${MOONCAKE_NCCL_VERSION} from ${MOONCAKE_NCCL_INCLUDE_DIR}")
else()
  message(STATUS "mooncake: no NCCL transport for ElasticBuffer in this build: ${MOONCAKE_NCCL_WHY_NOT}")
endif()
