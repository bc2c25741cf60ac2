// CudaIpcGroup benchmark: all_reduce, all_gather and broadcast between W
// processes (this program started W times with --rank), rank r on GPU
// r % G (G: MOONCAKE_TEST_GPUS, default every visible GPU; 1 puts every
// rank on GPU 0, where the processes share it), for
// sizes from 4 KiB to 256 MiB, against the bounds measured in the same run:
//   ipc copy  rank 0 copies the same bytes into rank 1's buffer through its
//             CUDA IPC mapping (cudaMemcpyAsync, bytes counted once);
//   d2d       a local cudaMemcpyAsync device-to-device of the same bytes.
// Times are CUDA events on rank 0's stream around back-to-back operations
// (the group keeps every rank in step), so they include the launch path.
// algbw = size / time; busbw as nccl-tests count it: all_reduce x 2(W-1)/W,
// all_gather x (W-1)/W (size = the gathered output), broadcast x 1.
//
// World 1 times the kernels alone (no peer, no bound but d2d). The staging
// size and the one-shot threshold can be changed to see what the number of
// barriers costs when processes time-slice one GPU.
//
//   build/benchmarks/pg_cuda_bench [--worlds 1,2,4] [--min-kib 4] [--max-mib 256] [--sync auto|kernels]
//                                  [--staging-mib 64] [--one-shot-kib 256] [--csv FILE]
//                                  [--ops all_reduce,all_gather,broadcast]
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <sstream>
#include <string>
#include <vector>

#include "common/spawn.h"
#include "common/test_gpus.h"
#include "mooncake/pg/cuda/cuda_ipc_group.h"

using namespace mooncake::pg;
using namespace mooncake::pg::cuda;

namespace {

#define CUDA_OK(call)                                                                         \
  do {                                                                                        \
    cudaError_t err_ = (call);                                                                \
    if (err_ != cudaSuccess) {                                                                \
      std::fprintf(stderr, "%s:%d: %s: %s\n", __FILE__, __LINE__, #call, cudaGetErrorString(err_)); \
      std::exit(1);                                                                           \
    }                                                                                         \
  } while (0)

struct Args {
  std::vector<int> worlds = {2, 4};
  size_t min_bytes = 4096;
  size_t max_bytes = size_t{256} << 20;
  size_t staging_bytes = CudaIpcGroupOptions{}.staging_bytes;
  size_t one_shot_bytes = CudaIpcGroupOptions{}.one_shot_bytes;
  std::string sync = "auto";
  std::string csv;
  std::string ops = "all_reduce,all_gather,broadcast";
  // set for a rank
  int rank = -1, world = 0;
  std::string name;
};

double elapsedUs(cudaEvent_t a, cudaEvent_t b) {
  float ms = 0;
  CUDA_OK(cudaEventElapsedTime(&ms, a, b));
  return ms * 1000.0;
}

void check(const OpResult& r, const char* what) {
  if (!r.ok) {
    std::fprintf(stderr, "%s failed: %s\n", what, r.error.c_str());
    std::exit(1);
  }
}

void complete(CudaIpcGroup& g, const CudaOp& op, const char* what) {
  check(op.result, what);
  check(g.wait(op.id), what);
}

class Timer {
 public:
  explicit Timer(cudaStream_t stream) : stream_(stream) {
    CUDA_OK(cudaEventCreate(&start_));
    CUDA_OK(cudaEventCreate(&stop_));
  }
  ~Timer() {
    cudaEventDestroy(start_);
    cudaEventDestroy(stop_);
  }
  // Mean microseconds of `body` over `iterations` back-to-back runs.
  double meanUs(int iterations, const std::function<void()>& body) {
    CUDA_OK(cudaEventRecord(start_, stream_));
    for (int i = 0; i < iterations; ++i) body();
    CUDA_OK(cudaEventRecord(stop_, stream_));
    CUDA_OK(cudaEventSynchronize(stop_));
    return elapsedUs(start_, stop_) / iterations;
  }

 private:
  cudaStream_t stream_;
  cudaEvent_t start_ = nullptr, stop_ = nullptr;
};

int iterationsFor(size_t bytes) { return static_cast<int>(std::clamp<size_t>((size_t{4} << 30) / bytes, 5, 100)); }

int runRank(const Args& args) {
  const int device = mooncake::testing::testDeviceOf(args.rank);  // MOONCAKE_TEST_GPUS=1: all on GPU 0
  if (device < 0) {
    std::fprintf(stderr, "rank %d: no CUDA device\n", args.rank);
    return 1;
  }
  CUDA_OK(cudaSetDevice(device));
  CudaIpcGroupOptions options;
  if (args.sync == "kernels") options.sync = SyncMode::kKernels;
  options.staging_bytes = args.staging_bytes;
  options.one_shot_bytes = args.one_shot_bytes;
  std::string error;
  auto group = CudaIpcGroup::open(args.name, args.rank, args.world, options, &error);
  if (!group) {
    std::fprintf(stderr, "rank %d: %s\n", args.rank, error.c_str());
    return 1;
  }
  CudaIpcGroup& g = *group;
  const int W = g.size(), R = g.rank();
  cudaStream_t stream;
  CUDA_OK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  char *input = nullptr, *output = nullptr, *target = nullptr;
  CUDA_OK(cudaMalloc(reinterpret_cast<void**>(&input), args.max_bytes));
  CUDA_OK(cudaMalloc(reinterpret_cast<void**>(&output), args.max_bytes));
  CUDA_OK(cudaMalloc(reinterpret_cast<void**>(&target), args.max_bytes));
  CUDA_OK(cudaMemset(input, 1, args.max_bytes));

  // The bound's target: rank 1's buffer, opened by rank 0 through CUDA IPC
  // (handles exchanged with the group's own all_gather).
  cudaIpcMemHandle_t mine;
  CUDA_OK(cudaIpcGetMemHandle(&mine, target));
  std::vector<cudaIpcMemHandle_t> handles(W);
  char* handle_buffer = output;
  CUDA_OK(cudaMemcpy(handle_buffer + args.max_bytes / 2, &mine, sizeof(mine), cudaMemcpyHostToDevice));
  complete(g, g.allgather(handle_buffer + args.max_bytes / 2, handle_buffer, sizeof(mine), stream), "handle exchange");
  CUDA_OK(cudaMemcpy(handles.data(), handle_buffer, sizeof(mine) * W, cudaMemcpyDeviceToHost));
  void* peer_target = nullptr;  // world 1: no peer, no ipc bound
  if (R == 0 && W > 1) CUDA_OK(cudaIpcOpenMemHandle(&peer_target, handles[1], cudaIpcMemLazyEnablePeerAccess));

  Timer timer(stream);
  FILE* csv = R == 0 && !args.csv.empty() ? std::fopen(args.csv.c_str(), args.world == args.worlds.front() ? "w" : "a")
                                          : nullptr;
  if (csv && args.world == args.worlds.front()) {
    std::fprintf(csv, "world,sync,op,bytes,time_us,algbw_gbs,busbw_gbs,ipc_copy_gbs,d2d_gbs,busbw_over_ipc\n");
  }
  if (R == 0) {
    int gpus = 0;
    for (int r = 0; r < W; ++r) gpus = std::max(gpus, mooncake::testing::testDeviceOf(r) + 1);
    std::printf("\nworld %d on %d GPU(s), %s barriers, %zu MiB staging, one shot up to %zu KiB\n\n", W, gpus,
                g.usesStreamMemOps() ? "stream-memory-operation" : "kernel", args.staging_bytes >> 20,
                args.one_shot_bytes >> 10);
    std::printf("| op | size | time (us) | algbw (GB/s) | busbw (GB/s) | ipc copy (GB/s) | d2d (GB/s) "
                "| busbw / ipc |\n");
    std::printf("|---|---:|---:|---:|---:|---:|---:|---:|\n");
  }
  for (size_t bytes = args.min_bytes; bytes <= args.max_bytes; bytes *= 4) {
    const int iterations = iterationsFor(bytes);
    // Bounds, measured by rank 0 while the others wait in a barrier.
    double ipc_us = 0, d2d_us = 0;
    if (R == 0) {
      for (int warm = 0; warm < 2 && peer_target != nullptr; ++warm) {
        ipc_us = timer.meanUs(iterations, [&] {
          CUDA_OK(cudaMemcpyAsync(peer_target, input, bytes, cudaMemcpyDeviceToDevice, stream));
        });
      }
      for (int warm = 0; warm < 2; ++warm) {
        d2d_us = timer.meanUs(iterations, [&] {
          CUDA_OK(cudaMemcpyAsync(output, input, bytes, cudaMemcpyDeviceToDevice, stream));
        });
      }
    }
    complete(g, g.barrier(stream), "barrier");
    const double ipc_gbs = ipc_us > 0 ? bytes / ipc_us / 1e3 : 0, d2d_gbs = bytes / d2d_us / 1e3;

    struct Case {
      const char* op;
      double bus_factor;
      std::function<CudaOp()> run;
    };
    const size_t count = bytes / 4;
    const std::vector<Case> cases = {
        {"all_reduce", 2.0 * (W - 1) / W,
         [&] { return g.allreduce(input, output, count, DataType::kFloat32, ReduceOp::kSum, stream); }},
        {"all_gather", 1.0 * (W - 1) / W,
         [&] { return g.allgather(input, output, bytes / W / 16 * 16, stream); }},
        {"broadcast", 1.0, [&] { return g.broadcast(output, bytes, 0, stream); }},
    };
    for (const Case& c : cases) {
      if (("," + args.ops + ",").find("," + std::string(c.op) + ",") == std::string::npos) continue;
      for (int warm = 0; warm < 3; ++warm) check(c.run().result, c.op);
      complete(g, g.barrier(stream), "barrier");
      const double us = timer.meanUs(iterations, [&] { check(c.run().result, c.op); });
      complete(g, g.barrier(stream), "barrier");
      if (R != 0) continue;
      const double algbw = bytes / us / 1e3, busbw = algbw * c.bus_factor;
      char size[32];
      if (bytes < (1u << 20)) std::snprintf(size, sizeof size, "%zu KiB", bytes >> 10);
      else std::snprintf(size, sizeof size, "%zu MiB", bytes >> 20);
      const double ratio = ipc_gbs > 0 ? busbw / ipc_gbs : 0;
      std::printf("| %s | %s | %.1f | %.1f | %.1f | %.1f | %.1f | %.2f |\n", c.op, size, us, algbw, busbw, ipc_gbs,
                  d2d_gbs, ratio);
      std::fflush(stdout);
      if (csv) {
        std::fprintf(csv, "%d,%s,%s,%zu,%.2f,%.2f,%.2f,%.2f,%.2f,%.3f\n", W,
                     g.usesStreamMemOps() ? "memops" : "kernels", c.op, bytes, us, algbw, busbw, ipc_gbs, d2d_gbs,
                     ratio);
      }
    }
  }
  if (csv) std::fclose(csv);
  if (peer_target) cudaIpcCloseMemHandle(peer_target);
  group.reset();  // collective: before the buffers it may still read go
  cudaFree(input);
  cudaFree(output);
  cudaFree(target);
  cudaStreamDestroy(stream);
  return 0;
}

// Starts this program `world` times as ranks and waits for them.
int runWorld(const Args& args, int world) {
  const std::string name = mooncake::testing::uniqueShmName("mc-pg-cuda-bench-" + std::to_string(world));
  std::vector<pid_t> pids;
  std::string worlds;
  for (int w : args.worlds) worlds += (worlds.empty() ? "" : ",") + std::to_string(w);
  for (int r = 0; r < world; ++r) {
    std::vector<std::string> argv_s = {"/proc/self/exe", "--rank", std::to_string(r), "--world", std::to_string(world),
                                       "--name", name, "--max-mib", std::to_string(args.max_bytes >> 20),
                                       "--min-kib", std::to_string(args.min_bytes >> 10),
                                       "--staging-mib", std::to_string(args.staging_bytes >> 20),
                                       "--one-shot-kib", std::to_string(args.one_shot_bytes >> 10),
                                       "--sync", args.sync, "--worlds", worlds, "--ops", args.ops};
    if (!args.csv.empty()) argv_s.insert(argv_s.end(), {"--csv", args.csv});
    const pid_t pid = mooncake::testing::spawnProgram("/proc/self/exe", argv_s);
    if (pid < 0) return 1;
    pids.push_back(pid);
  }
  int failed = 0;
  for (int status : mooncake::testing::waitAll(pids)) failed += status != 0;  // no deadline: a benchmark may run long
  return failed;
}

}  // namespace

int main(int argc, char** argv) {
  Args args;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string key = argv[i], value = argv[i + 1];
    if (key == "--worlds") {
      args.worlds.clear();
      std::stringstream ss(value);
      for (std::string w; std::getline(ss, w, ',');) args.worlds.push_back(std::stoi(w));
    } else if (key == "--max-mib") {
      args.max_bytes = std::stoull(value) << 20;
    } else if (key == "--min-kib") {
      args.min_bytes = std::stoull(value) << 10;
    } else if (key == "--staging-mib") {
      args.staging_bytes = std::stoull(value) << 20;
    } else if (key == "--one-shot-kib") {
      args.one_shot_bytes = std::stoull(value) << 10;
    } else if (key == "--sync") {
      args.sync = value;
    } else if (key == "--ops") {
      args.ops = value;
    } else if (key == "--csv") {
      args.csv = value;
    } else if (key == "--rank") {
      args.rank = std::stoi(value);
    } else if (key == "--world") {
      args.world = std::stoi(value);
    } else if (key == "--name") {
      args.name = value;
    }
  }
  if (args.rank >= 0) return runRank(args);
  int failed = 0;
  for (int world : args.worlds) failed += runWorld(args, world);
  return failed == 0 ? 0 : 1;
}
