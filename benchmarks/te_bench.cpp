// Transfer engine benchmark: one initiator process and one target process
// (this program started again with --target). For each size it times
// synchronous writes through each transport and, in the same run, the bound
// each transport is judged by:
//   shm: a single-thread memcpy between two pre-faulted buffers of this process,
//        for both ways the shm transport copies: into a target buffer in
//        shared memory (mapped, a memcpy) and into ordinary memory (attached,
//        process_vm_writev)
//   tcp: a raw TCP stream to the target (send the bytes, wait for a 1-byte ack),
//        the same request/acknowledge pattern as a synchronous engine write.
// Prints a markdown table (and CSV with --csv FILE) with the ratios.
//
// With --cuda, GPU memory instead (CUDA builds, one GPU is enough): the
// target's buffer is a cudaMalloc allocation, and for each size it times
//   cuda_ipc: synchronous writes and reads of the initiator's GPU buffer into
//             and out of the target's, and
//   tcp:      the same write over tcp, staged through host memory at both ends,
// against the bound: a local cudaMemcpy device-to-device of the same size in
// this process (bytes counted once), timed in the same run.
//
//   build/benchmarks/te_bench [--max-mib 64] [--seconds 0.3] [--csv docs/benchmarks/te.csv]
//   build/benchmarks/te_bench --cuda [--max-mib 256] [--csv docs/benchmarks/te_cuda.csv]
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <iostream>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#if MOONCAKE_WITH_CUDA
#include <cuda_runtime_api.h>
#endif

#include "common/piped_child.h"
#include "mooncake/te/shared_memory.h"
#include "mooncake/te/transfer_engine.h"

using namespace mooncake::te;
using Clock = std::chrono::steady_clock;

namespace {

char* allocTouched(size_t n) {
  auto* p = static_cast<char*>(std::aligned_alloc(4096, (n + 4095) & ~size_t{4095}));
  std::memset(p, 1, n);  // fault every page in before timing
  return p;
}

bool readAll(int fd, char* p, size_t n) {
  while (n > 0) {
    ssize_t r = ::recv(fd, p, n, 0);
    if (r <= 0) return false;
    p += r;
    n -= static_cast<size_t>(r);
  }
  return true;
}

bool writeAll(int fd, const char* p, size_t n) {
  while (n > 0) {
    ssize_t r = ::send(fd, p, n, MSG_NOSIGNAL);
    if (r <= 0) return false;
    p += r;
    n -= static_cast<size_t>(r);
  }
  return true;
}

// Target side: an engine with one registered buffer, plus a raw TCP sink
// that reads [u64 length][payload] and answers one byte per message.
int runTarget(size_t bytes) {
  char* buffer = allocTouched(bytes);
  char* shared = static_cast<char*>(allocateSharedMemory(bytes));
  if (shared == nullptr) return 1;
  std::memset(shared, 1, bytes);
  TransferEngine engine;
  if (engine.init("P2PHANDSHAKE", "127.0.0.1") != kOk || engine.registerLocalMemory(buffer, bytes) != kOk ||
      engine.registerLocalMemory(shared, bytes) != kOk) {
    return 1;
  }
  int listener = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof(a);
  if (::bind(listener, reinterpret_cast<sockaddr*>(&a), sizeof(a)) != 0 || ::listen(listener, 4) != 0) {
    std::perror("te_bench target: its control listener");
    std::exit(1);
  }
  ::getsockname(listener, reinterpret_cast<sockaddr*>(&a), &len);
  std::cout << engine.segmentName() << " " << reinterpret_cast<uint64_t>(buffer) << " "
            << reinterpret_cast<uint64_t>(shared) << " " << ntohs(a.sin_port) << std::endl;
  std::thread sink([&] {
    int fd = ::accept(listener, nullptr, nullptr);
    int one = 1;
    ::setsockopt(fd, IPPROTO_TCP, 1 /*TCP_NODELAY*/, &one, sizeof(one));
    uint64_t n = 0;
    char ack = 1;
    while (readAll(fd, reinterpret_cast<char*>(&n), sizeof(n)) && n <= bytes && readAll(fd, buffer, n) &&
           writeAll(fd, &ack, 1)) {
    }
    ::close(fd);
  });
  std::string line;
  std::getline(std::cin, line);  // until the initiator closes our stdin
  ::shutdown(listener, SHUT_RDWR);
  sink.join();
  return 0;
}

#if MOONCAKE_WITH_CUDA
// GPU target: an engine with one registered cudaMalloc buffer.
int runGpuTarget(size_t bytes) {
  void* buffer = nullptr;
  if (cudaMalloc(&buffer, bytes) != cudaSuccess || cudaMemset(buffer, 1, bytes) != cudaSuccess) return 1;
  TransferEngine engine;
  if (engine.init("P2PHANDSHAKE", "127.0.0.1") != kOk || engine.registerLocalMemory(buffer, bytes) != kOk) return 1;
  std::cout << engine.segmentName() << " " << reinterpret_cast<uint64_t>(buffer) << std::endl;
  std::string line;
  std::getline(std::cin, line);  // until the initiator closes our stdin
  return 0;
}
#endif

struct Timing {
  double us_per_op = 0;
  double gbps = 0;  // 1e9 bytes per second
};

// Repeats `op` for about `seconds` (at least 5 times) after two warm-ups.
Timing timeIt(size_t bytes, double seconds, const std::function<bool()>& op) {
  for (int i = 0; i < 2; ++i) {
    if (!op()) return {};
  }
  int iters = 0;
  auto start = Clock::now();
  double elapsed = 0;
  do {
    if (!op()) return {};
    ++iters;
    elapsed = std::chrono::duration<double>(Clock::now() - start).count();
  } while (elapsed < seconds || iters < 5);
  return Timing{elapsed / iters * 1e6, bytes * static_cast<double>(iters) / elapsed / 1e9};
}

std::string fmt(double v, int precision = 2) {
  std::ostringstream s;
  s.setf(std::ios::fixed);
  s.precision(precision);
  s << v;
  return s.str();
}

std::string sizeLabel(size_t n) {
  if (n >= (1u << 20)) return std::to_string(n >> 20) + " MiB";
  if (n >= (1u << 10)) return std::to_string(n >> 10) + " KiB";
  return std::to_string(n) + " B";
}

// Starts the target: this program again with `args`, talking over a pipe;
// `ready` gets its first line of output ("" on failure). Closing the pipe to
// it (closeAndWait) tells it to exit.
mooncake::testing::PipedChild spawnTarget(char* self, const std::vector<std::string>& args, std::string& ready) {
  std::vector<std::string> argv = {self};
  argv.insert(argv.end(), args.begin(), args.end());
  auto target = mooncake::testing::PipedChild::spawn("/proc/self/exe", argv);
  ready = target.started() ? target.readLine().value_or("") : "";
  return target;
}

#if MOONCAKE_WITH_CUDA
int runCudaBench(char* self, size_t max_bytes, double seconds, const std::string& csv_path) {
  auto fail = [](const char* what) {
    std::fprintf(stderr, "te_bench --cuda: %s\n", what);
    return 1;
  };
  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0) return fail("no CUDA device");
  std::string first_line;
  auto target = spawnTarget(self, {"--target", std::to_string(max_bytes), "--gpu"}, first_line);
  std::istringstream ready(first_line);
  std::string segment;
  uint64_t remote = 0;
  ready >> segment >> remote;
  if (remote == 0) return fail("the target did not start");

  void *src = nullptr, *dst = nullptr;
  if (cudaMalloc(&src, max_bytes) != cudaSuccess || cudaMalloc(&dst, max_bytes) != cudaSuccess) {
    return fail("cudaMalloc failed");
  }
  cudaMemset(src, 2, max_bytes);
  cudaMemset(dst, 3, max_bytes);
  cudaStream_t stream = nullptr;
  cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking);

  // One engine with the automatic choice and one forced to tcp, both aimed at the target.
  struct Initiator {
    const char* protocol;
    TransferEngine engine;
    SegmentHandle peer = kInvalidSegment;
  };
  Initiator ipc{"", {}, kInvalidSegment}, tcp{"tcp", {}, kInvalidSegment};
  for (Initiator* i : {&ipc, &tcp}) {
    if (i->engine.init("P2PHANDSHAKE", "127.0.0.1", i->protocol) != kOk ||
        i->engine.registerLocalMemory(src, max_bytes) != kOk || i->engine.registerLocalMemory(dst, max_bytes) != kOk) {
      return fail("engine setup failed");
    }
    i->peer = i->engine.openSegment(segment);
    if (i->peer == kInvalidSegment) return fail("cannot open the target's segment");
  }
  for (Initiator* i : {&ipc, &tcp}) {
    std::string t = i->engine.transportFor(TransferRequest{Opcode::kWrite, src, i->peer, remote, 4096});
    std::fprintf(stderr, "initiator with protocol '%s': transport %s\n", i->protocol, t.c_str());
  }

  auto transfer = [&](Initiator& i, Opcode op, size_t n) {
    return [&i, op, n, src, dst, remote] {
      void* local = op == Opcode::kWrite ? src : dst;
      return i.engine.transferSync({TransferRequest{op, local, i.peer, remote, n}}) == kOk;
    };
  };
  auto deviceCopy = [&](size_t n) {
    return [&, n] {
      return cudaMemcpyAsync(dst, src, n, cudaMemcpyDeviceToDevice, stream) == cudaSuccess &&
             cudaStreamSynchronize(stream) == cudaSuccess;
    };
  };

  FILE* csv = csv_path.empty() ? nullptr : std::fopen(csv_path.c_str(), "w");
  if (csv) {
    std::fprintf(csv, "bytes,ipc_write_us,ipc_read_us,device_copy_us,ipc_write_gbps,ipc_read_gbps,device_copy_gbps,"
                      "tcp_write_gbps\n");
  }
  std::printf("| size | cuda_ipc write µs | cuda_ipc read µs | device copy µs | cuda_ipc write GB/s | "
              "cuda_ipc read GB/s | device copy GB/s | write/bound | read/bound | tcp (staged) write GB/s |\n");
  std::printf("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n");
  for (size_t n = 64; n <= max_bytes; n *= 4) {
    Timing write = timeIt(n, seconds, transfer(ipc, Opcode::kWrite, n));
    Timing read = timeIt(n, seconds, transfer(ipc, Opcode::kRead, n));
    Timing bound = timeIt(n, seconds, deviceCopy(n));
    Timing staged = timeIt(n, seconds, transfer(tcp, Opcode::kWrite, n));
    std::printf("| %s | %s | %s | %s | %s | %s | %s | %s | %s | %s |\n", sizeLabel(n).c_str(),
                fmt(write.us_per_op).c_str(), fmt(read.us_per_op).c_str(), fmt(bound.us_per_op).c_str(),
                fmt(write.gbps).c_str(), fmt(read.gbps).c_str(), fmt(bound.gbps).c_str(),
                fmt(write.gbps / bound.gbps).c_str(), fmt(read.gbps / bound.gbps).c_str(), fmt(staged.gbps).c_str());
    std::fflush(stdout);
    if (csv) {
      std::fprintf(csv, "%zu,%.4f,%.4f,%.4f,%.4f,%.4f,%.4f,%.4f\n", n, write.us_per_op, read.us_per_op,
                   bound.us_per_op, write.gbps, read.gbps, bound.gbps, staged.gbps);
    }
  }
  if (csv) std::fclose(csv);
  target.closeAndWait();  // the target exits at end of input
  return 0;
}
#endif

}  // namespace

int main(int argc, char** argv) {
  size_t max_bytes = 64u << 20;
  double seconds = 0.3;
  std::string csv_path;
  bool cuda = false;
  for (int i = 1; i < argc; ++i) {
    std::string arg = argv[i];
    if (arg == "--target" && i + 1 < argc) {
#if MOONCAKE_WITH_CUDA
      if (i + 2 < argc && std::string(argv[i + 2]) == "--gpu") {
        return runGpuTarget(std::strtoull(argv[i + 1], nullptr, 10));
      }
#endif
      return runTarget(std::strtoull(argv[i + 1], nullptr, 10));
    }
    if (arg == "--max-mib" && i + 1 < argc) max_bytes = std::strtoull(argv[++i], nullptr, 10) << 20;
    else if (arg == "--seconds" && i + 1 < argc) seconds = std::atof(argv[++i]);
    else if (arg == "--csv" && i + 1 < argc) csv_path = argv[++i];
    else if (arg == "--cuda") cuda = true;
    else {
      std::fprintf(stderr, "usage: %s [--cuda] [--max-mib N] [--seconds S] [--csv FILE]\n", argv[0]);
      return 2;
    }
  }
  if (cuda) {
#if MOONCAKE_WITH_CUDA
    return runCudaBench(argv[0], max_bytes, seconds, csv_path);
#else
    std::fprintf(stderr, "--cuda: this build has no CUDA (MOONCAKE_WITH_CUDA=OFF)\n");
    return 2;
#endif
  }

  std::string first_line;
  auto target = spawnTarget(argv[0], {"--target", std::to_string(max_bytes)}, first_line);
  std::istringstream ready(first_line);
  std::string segment;
  uint64_t remote_addr = 0, remote_shared = 0;
  int sink_port = 0;
  ready >> segment >> remote_addr >> remote_shared >> sink_port;

  char* src = allocTouched(max_bytes);
  char* dst = allocTouched(max_bytes);
  TransferEngine engine;
  if (engine.init("P2PHANDSHAKE", "127.0.0.1") != kOk || engine.registerLocalMemory(src, max_bytes) != kOk) return 1;
  SegmentHandle peer = engine.openSegment(segment);
  if (peer == kInvalidSegment) return 1;

  int raw = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  a.sin_port = htons(static_cast<uint16_t>(sink_port));
  if (::connect(raw, reinterpret_cast<sockaddr*>(&a), sizeof(a)) != 0) return 1;
  int one = 1;
  ::setsockopt(raw, IPPROTO_TCP, 1 /*TCP_NODELAY*/, &one, sizeof(one));

  auto engineWrite = [&](const char* transport, uint64_t target, size_t n) {
    return [&, transport, target, n] {
      return engine.transferSync({TransferRequest{Opcode::kWrite, src, peer, target, n}}, transport) == kOk;
    };
  };
  auto rawStream = [&](size_t n) {
    return [&, n] {
      uint64_t len = n;
      char ack = 0;
      return writeAll(raw, reinterpret_cast<char*>(&len), sizeof(len)) && writeAll(raw, src, n) &&
             readAll(raw, &ack, 1);
    };
  };

  std::vector<size_t> sizes;
  for (size_t n = 64; n <= max_bytes; n *= 4) sizes.push_back(n);
  FILE* csv = csv_path.empty() ? nullptr : std::fopen(csv_path.c_str(), "w");
  if (csv) {
    std::fprintf(csv,
                 "bytes,shm_mapped_us,shm_attached_us,memcpy_us,shm_mapped_gbps,shm_attached_gbps,memcpy_gbps,"
                 "tcp_us,rawtcp_us,tcp_gbps,rawtcp_gbps\n");
  }
  std::printf("| size | shm mapped µs | shm attached µs | memcpy µs | shm mapped GB/s | shm attached GB/s | memcpy GB/s | "
              "mapped/memcpy | attached/memcpy | tcp µs | raw TCP µs | tcp GB/s | raw TCP GB/s | tcp/raw |\n");
  std::printf("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n");
  for (size_t n : sizes) {
    Timing mapped = timeIt(n, seconds, engineWrite("shm", remote_shared, n));
    Timing shm = timeIt(n, seconds, engineWrite("shm", remote_addr, n));
    Timing mem = timeIt(n, seconds, [&] {
      std::memcpy(dst, src, n);
      asm volatile("" ::: "memory");  // keep the copy
      return true;
    });
    Timing tcp = timeIt(n, seconds, engineWrite("tcp", remote_addr, n));
    Timing rawt = timeIt(n, seconds, rawStream(n));
    std::printf("| %s | %s | %s | %s | %s | %s | %s | %s | %s | %s | %s | %s | %s | %s |\n", sizeLabel(n).c_str(),
                fmt(mapped.us_per_op).c_str(), fmt(shm.us_per_op).c_str(), fmt(mem.us_per_op, 3).c_str(),
                fmt(mapped.gbps).c_str(), fmt(shm.gbps).c_str(), fmt(mem.gbps).c_str(),
                fmt(mapped.gbps / mem.gbps).c_str(), fmt(shm.gbps / mem.gbps).c_str(), fmt(tcp.us_per_op).c_str(),
                fmt(rawt.us_per_op).c_str(), fmt(tcp.gbps).c_str(), fmt(rawt.gbps).c_str(),
                fmt(tcp.gbps / rawt.gbps).c_str());
    std::fflush(stdout);
    if (csv) {
      std::fprintf(csv, "%zu,%.4f,%.4f,%.4f,%.4f,%.4f,%.4f,%.4f,%.4f,%.4f,%.4f\n", n, mapped.us_per_op,
                   shm.us_per_op, mem.us_per_op, mapped.gbps, shm.gbps, mem.gbps, tcp.us_per_op, rawt.us_per_op,
                   tcp.gbps, rawt.gbps);
    }
  }
  if (csv) std::fclose(csv);
  ::close(raw);
  target.closeAndWait();  // the target exits at end of input
  return 0;
}
