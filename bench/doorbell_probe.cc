// mlaverify-doorbell-probe: the floor of a GPU-doorbell layer, measured
// without the service. Two processes on one GPU play the two sides of a
// device-driven step (docs/steps.md): the "server" owns two 64-bit words in
// device memory and shares them by CUDA IPC; per layer its stream waits on
// the doorbell word, optionally runs a busy kernel (a stand-in for the
// attention), then writes the completion word; the "client" stream,
// optionally after its own busy kernel (the scheduler's work), rings the
// doorbell and waits on the completion. Each round enqueues one step's
// layers on both sides; the client times each layer from the event after
// one completion to the event after the next (layers 1..L-1 of each round:
// the first pays the round's start), so a layer's time is its whole cycle:
// both kernels plus two cross-process hops.
//
//   mlaverify-doorbell-probe --layers 61 --rounds 50 [--client-work-us 50]
//       [--server-work-us 30] [--device 0] [--json out.json]
// Prints the per-layer median and the floor per hop, and writes the JSON.
#include <cuda_runtime_api.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <string>
#include <vector>

#include "CLI/CLI.hpp"
#include "absl/status/status.h"
#include "client/client_work.h"
#include "kernels/stream_memops.h"
#include "nlohmann/json.hpp"

namespace {

struct Options {
  int layers = 61;
  int rounds = 50;
  double client_work_us = 0;
  double server_work_us = 0;
  int device = 0;
  std::string json;
};

bool Ok(cudaError_t err, const char* what) {
  if (err == cudaSuccess) return true;
  std::fprintf(stderr, "%s: %s\n", what, cudaGetErrorString(err));
  return false;
}
bool Ok(const absl::Status& s, const char* what) {
  if (s.ok()) return true;
  std::fprintf(stderr, "%s: %s\n", what, s.ToString().c_str());
  return false;
}

bool ReadAll(int fd, void* data, size_t bytes) {
  auto* p = static_cast<uint8_t*>(data);
  while (bytes > 0) {
    const ssize_t n = read(fd, p, bytes);
    if (n <= 0) return false;
    p += n;
    bytes -= static_cast<size_t>(n);
  }
  return true;
}

// The server side: owns the words, answers every ring of every round.
int Server(const Options& o, pid_t client, int to_client, int from_client) {
  if (!Ok(cudaSetDevice(o.device), "cudaSetDevice")) return 1;
  uint64_t* words = nullptr;
  if (!Ok(cudaMalloc(reinterpret_cast<void**>(&words), 2 * sizeof(uint64_t)), "cudaMalloc") ||
      !Ok(cudaMemset(words, 0, 2 * sizeof(uint64_t)), "cudaMemset")) {
    return 1;
  }
  cudaIpcMemHandle_t handle;
  if (!Ok(cudaIpcGetMemHandle(&handle, words), "cudaIpcGetMemHandle")) return 1;
  if (write(to_client, &handle, sizeof(handle)) != sizeof(handle)) return 1;
  cudaStream_t stream = nullptr;
  if (!Ok(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), "stream")) return 1;
  const uint64_t doorbell = reinterpret_cast<uint64_t>(words), completion = doorbell + 8;
  for (int r = 0; r < o.rounds; ++r) {
    const uint64_t base = static_cast<uint64_t>(r) * (o.layers + 1);
    for (int l = 0; l < o.layers; ++l) {
      const uint64_t v = base + l + 1;
      if (!Ok(mlaverify::kernels::StreamWaitValue64(stream, doorbell, v), "wait") ||
          !Ok(mlaverify::client::LaunchClientWork(stream, o.server_work_us), "server work") ||
          !Ok(mlaverify::kernels::StreamWriteValue64(stream, completion, v), "write")) {
        return 1;
      }
    }
    // The round's end, or the client gone (its rings would never come).
    while (cudaStreamQuery(stream) == cudaErrorNotReady) {
      if (waitpid(client, nullptr, WNOHANG) == client) {
        std::fprintf(stderr, "the client process ended mid-round\n");
        return 1;
      }
      usleep(100);
    }
    if (!Ok(cudaStreamSynchronize(stream), "server round")) return 1;
  }
  char done = 0;
  ReadAll(from_client, &done, 1);  // the client finished with the words
  cudaFree(words);
  return 0;
}

// The client side: rings every layer, times each cycle.
int Client(const Options& o, int from_server, int to_server) {
  cudaIpcMemHandle_t handle;
  if (!ReadAll(from_server, &handle, sizeof(handle))) return 1;
  if (!Ok(cudaSetDevice(o.device), "cudaSetDevice")) return 1;
  void* words = nullptr;
  if (!Ok(cudaIpcOpenMemHandle(&words, handle, cudaIpcMemLazyEnablePeerAccess), "IPC open")) {
    return 1;
  }
  cudaStream_t stream = nullptr;
  if (!Ok(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), "stream")) return 1;
  std::vector<cudaEvent_t> events(o.layers);
  for (auto& e : events) {
    if (!Ok(cudaEventCreate(&e), "event")) return 1;
  }
  const uint64_t doorbell = reinterpret_cast<uint64_t>(words), completion = doorbell + 8;
  std::vector<double> cycles_us;
  for (int r = 0; r < o.rounds; ++r) {
    const uint64_t base = static_cast<uint64_t>(r) * (o.layers + 1);
    for (int l = 0; l < o.layers; ++l) {
      const uint64_t v = base + l + 1;
      if (!Ok(mlaverify::client::LaunchClientWork(stream, o.client_work_us), "client work") ||
          !Ok(mlaverify::kernels::StreamWriteValue64(stream, doorbell, v), "ring") ||
          !Ok(mlaverify::kernels::StreamWaitValue64(stream, completion, v), "wait") ||
          !Ok(cudaEventRecord(events[l], stream), "event")) {
        return 1;
      }
    }
    if (!Ok(cudaStreamSynchronize(stream), "client round")) return 1;
    for (int l = 1; l < o.layers; ++l) {
      float ms = 0;
      if (!Ok(cudaEventElapsedTime(&ms, events[l - 1], events[l]), "elapsed")) return 1;
      if (r > 0) cycles_us.push_back(ms * 1e3);  // round 0: warm-up
    }
  }
  const char done = 1;
  if (write(to_server, &done, 1) != 1) return 1;
  cudaIpcCloseMemHandle(words);
  std::sort(cycles_us.begin(), cycles_us.end());
  const auto at = [&](double p) {
    return cycles_us.empty() ? 0.0 : cycles_us[static_cast<size_t>(p * (cycles_us.size() - 1))];
  };
  cudaDeviceProp prop{};
  cudaGetDeviceProperties(&prop, o.device);
  const double work = o.client_work_us + o.server_work_us;
  std::printf(
      "doorbell probe (%s): %d layers x %d rounds, client work %.0f us, server work %.0f us: "
      "layer cycle p50 %.2f us, p90 %.2f, p99 %.2f; beyond the work %.2f us (two hops)\n",
      prop.name, o.layers, o.rounds, o.client_work_us, o.server_work_us, at(0.5), at(0.9), at(0.99),
      at(0.5) - work);
  if (!o.json.empty()) {
    nlohmann::ordered_json j = {{"device", prop.name},
                                {"layers", o.layers},
                                {"rounds", o.rounds},
                                {"client_work_us", o.client_work_us},
                                {"server_work_us", o.server_work_us},
                                {"samples", cycles_us.size()},
                                {"cycle_us_p50", at(0.5)},
                                {"cycle_us_p90", at(0.9)},
                                {"cycle_us_p99", at(0.99)},
                                {"cycle_us_min", cycles_us.empty() ? 0.0 : cycles_us.front()},
                                {"hops_us_p50", at(0.5) - work}};
    std::ofstream(o.json) << j.dump(2) << "\n";
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  Options o;
  CLI::App app{"mlaverify-doorbell-probe: cross-process GPU doorbell ping-pong on one GPU"};
  app.add_option("--layers", o.layers, "layers per round")->check(CLI::Range(2, 1024));
  app.add_option("--rounds", o.rounds, "rounds (steps); the first is warm-up")
      ->check(CLI::Range(2, 100000));
  app.add_option("--client-work-us", o.client_work_us, "client's busy kernel per layer");
  app.add_option("--server-work-us", o.server_work_us, "server's busy kernel per layer");
  app.add_option("--device", o.device, "CUDA device");
  app.add_option("--json", o.json, "write the result here");
  CLI11_PARSE(app, argc, argv);
  // One hardware queue per stream (docs/steps.md), as the server sets it.
  setenv("CUDA_DEVICE_MAX_CONNECTIONS", "32", /*overwrite=*/0);
  // Fork before either side touches CUDA (a forked child cannot use it).
  int to_client[2], to_server[2];
  if (pipe(to_client) != 0 || pipe(to_server) != 0) return 1;
  const pid_t child = fork();
  if (child < 0) return 1;
  if (child == 0) {
    close(to_client[1]);
    close(to_server[0]);
    _exit(Client(o, to_client[0], to_server[1]));
  }
  close(to_client[0]);
  close(to_server[1]);
  const int server = Server(o, child, to_client[1], to_server[0]);
  int status = 0;
  if (server != 0) kill(child, SIGKILL);
  waitpid(child, &status, 0);
  const int client = WIFEXITED(status) ? WEXITSTATUS(status) : 1;
  return server != 0 ? server : client;
}
