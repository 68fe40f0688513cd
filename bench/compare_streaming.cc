// compare_streaming: streams a model's layer partitions in schedule order with a fixed synthetic
// compute per layer (a sleep: GPU work that does not use the host CPU), from NVMe and from pinned
// host memory, with the pipeline prefetching layer i+1 while layer i computes, and with the serial
// read-then-copy baseline (DeepSpeed's swap-in pattern). overlap = compute-only time / streamed
// step time (1.0 = transfers fully hidden). Runs on the CUDA device when present, else on the CPU
// backend (device memory is host memory; the schedule is the same). Last line: one JSON object.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <future>
#include <string>
#include <thread>
#include <vector>

#include "bench_util.h"
#include "spillway/allocator/host_arena.h"
#include "spillway/allocator/io_engine.h"
#include "spillway/allocator/nvme_arena.h"
#include "spillway/base/bytes.h"
#include "spillway/offload/transfer_pipeline.h"

namespace {

using namespace spillway;
using bench::Clock;
using bench::Median;
using bench::Must;

}  // namespace

int main(int argc, char** argv) {
  int layers = 16;
  uint64_t layer_mib = 32;
  double compute_ms = 40;
  std::string dir = ".";
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    if (a == "--layers" && i + 1 < argc)
      layers = std::atoi(argv[++i]);
    else if (a == "--layer-mib" && i + 1 < argc)
      layer_mib = std::strtoull(argv[++i], nullptr, 10);
    else if (a == "--compute-ms" && i + 1 < argc)
      compute_ms = std::atof(argv[++i]);
    else if (a == "--dir" && i + 1 < argc)
      dir = argv[++i];
    else {
      std::fprintf(stderr,
                   "usage: compare_streaming [--layers N] [--layer-mib N] "
                   "[--compute-ms F] [--dir NVME_DIR]\n");
      return 2;
    }
  }
  const uint64_t bytes = layer_mib * kMiB;
  allocator::Ledger ledger;
  allocator::HostArenaOptions ho;
  ho.ledger = &ledger;
  ho.budget_bytes = (layers + 8) * bytes + 256 * kMiB;
  auto host = Must(allocator::HostArena::Create(ho));
  allocator::IoEngineOptions eo;
  eo.arena = host.get();
  eo.block_size = 4 * kMiB;
  eo.queue_depth = 16;
  auto engine = Must(allocator::IoEngine::Create(eo));
  allocator::NvmeArenaOptions no;
  no.directory = dir;
  no.budget_bytes = (layers + 1) * bytes;
  no.grow_bytes = layers * bytes;
  no.ledger = &ledger;
  auto nvme = Must(allocator::NvmeArena::Create(no, engine.get()));
  auto device = Must(offload::Device::OpenDefault());
  auto pipe =
      Must(offload::TransferPipeline::Create(host.get(), nvme.get(), device.get(), {4 * kMiB, 4}));
  // The model: one partition per layer on NVMe, and the same in pinned host memory.
  std::vector<uint64_t> on_nvme;
  std::vector<void*> on_host;
  for (int l = 0; l < layers; ++l) {
    void* h = Must(host->Allocate(bytes, {allocator::Kind::kParam, allocator::Lifetime::kPersistent,
                                          static_cast<uint64_t>(l), 0, nullptr}));
    std::memset(h, l + 1, bytes);
    on_host.push_back(h);
    const uint64_t off =
        Must(nvme->Allocate(bytes, {allocator::Kind::kParam, allocator::Lifetime::kPersistent,
                                    static_cast<uint64_t>(l), 0, nullptr}));
    Must(nvme->Write(off, h, bytes));
    on_nvme.push_back(off);
  }
  void* dev[2] = {Must(device->Allocate(bytes)), Must(device->Allocate(bytes))};
  void* bounce = Must(host->Allocate(
      bytes, {allocator::Kind::kSwapBuffer, allocator::Lifetime::kPersistent, 0, 0, nullptr}));
  const auto compute = std::chrono::microseconds(static_cast<int64_t>(compute_ms * 1000));

  auto run = [&](const char* mode) {
    const bool from_nvme = mode[0] == 'n';
    const bool serial = std::string(mode).find("serial") != std::string::npos;
    auto fetch = [&](int l, void* d) {
      return from_nvme ? pipe->NvmeToDevice(on_nvme[l], bytes, d)
                       : pipe->HostToDevice(on_host[l], d, bytes);
    };
    const auto t0 = Clock::now();
    if (serial) {
      for (int l = 0; l < layers; ++l) {
        if (from_nvme)
          Must(pipe->NvmeToDeviceSerial(on_nvme[l], bytes, bounce, dev[0]));
        else
          Must(pipe->HostToDevice(on_host[l], dev[0], bytes));
        std::this_thread::sleep_for(compute);
      }
    } else {
      Must(fetch(0, dev[0]));
      for (int l = 0; l < layers; ++l) {
        std::future<Status> next;
        if (l + 1 < layers) next = std::async(std::launch::async, fetch, l + 1, dev[(l + 1) % 2]);
        std::this_thread::sleep_for(compute);  // layer l computes on dev[l % 2]
        if (next.valid()) Must(next.get());
      }
    }
    return std::chrono::duration<double>(Clock::now() - t0).count();
  };
  auto t0 = Clock::now();
  for (int l = 0; l < layers; ++l) std::this_thread::sleep_for(compute);
  const double compute_only = std::chrono::duration<double>(Clock::now() - t0).count();

  const char* modes[] = {"nvme pipelined", "nvme serial", "pinned pipelined", "pinned serial"};
  std::vector<std::vector<double>> secs(4);
  for (int rep = 0; rep < 3; ++rep) {
    for (int k = 0; k < 4; ++k) {
      const int m = (k + rep) % 4;  // rotate the order
      secs[m].push_back(run(modes[m]));
    }
  }
  std::printf("model: %d layers x %llu MiB, compute %.0f ms per layer, device %s\n", layers,
              static_cast<unsigned long long>(layer_mib), compute_ms,
              device->id().ToString().c_str());
  std::printf("compute only: %.3f s\n", compute_only);
  std::printf("%-18s %12s %9s %12s\n", "mode", "step s (med)", "overlap", "GB/s moved");
  double med[4];
  for (int m = 0; m < 4; ++m) {
    med[m] = Median(secs[m]);
    std::printf("%-18s %12.3f %9.3f %12.3f\n", modes[m], med[m], compute_only / med[m],
                layers * bytes / med[m] / 1e9);
  }
  std::printf(
      "{\"bench\":\"streaming\",\"overlap_nvme\":%.3f,\"overlap_pinned\":%.3f,"
      "\"speedup_vs_serial\":%.3f,\"overlap_nvme_serial\":%.3f,\"device\":\"%s\"}\n",
      compute_only / med[0], compute_only / med[2], med[1] / med[0], compute_only / med[1],
      device->id().ToString().c_str());
  Must(device->Free(dev[0]));
  Must(device->Free(dev[1]));
  pipe.reset();
  nvme.reset();
  engine.reset();
  return 0;
}
