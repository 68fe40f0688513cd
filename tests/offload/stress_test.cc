// A randomized, seeded, time-bounded stress of the data path: 4 threads allocate, free, write,
// read, spill, evict, flush, prefetch, fill device views and cross ledger step boundaries on one
// HostArena + IoEngine + NvmeArena + PartitionStore (a host budget far under the partitions'
// size, a prefetch window, a CPU device pipeline). A model remembers the last version written to
// every partition, host buffer and NVMe extent, and every byte read back is checked against it.
// It runs in scripts/test under the default build, ASan+UBSan and TSan.
//   SPILLWAY_STRESS_SECONDS (default 3) bounds the run; SPILLWAY_STRESS_SEED (default 1) seeds it.
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "spillway/base/bytes.h"
#include "spillway/offload/device.h"
#include "spillway/offload/partition_store.h"
#include "spillway/offload/transfer_pipeline.h"
#include "store_test_util.h"

namespace spillway::offload {
namespace {

using testing::OffloadJson;
using testing::ParseOrDie;
using testing::StoreRig;

constexpr int kThreads = 4;
constexpr int kPartsPerThread = 4;
constexpr uint64_t kPartBytes = 256 * 1024 + 4096 * 3 + 40;  // not a multiple of a chunk
constexpr uint64_t kBounce = 8 * kMiB;

double EnvOr(const char* name, double fallback) {
  const char* v = std::getenv(name);
  return v != nullptr ? std::atof(v) : fallback;
}

// The bytes of version `v` of object `id`: every 8-byte word differs by id, version and index.
void Fill(void* dst, uint64_t bytes, uint64_t id, uint64_t v) {
  auto* p = static_cast<unsigned char*>(dst);
  for (uint64_t i = 0; i < bytes; ++i) {
    const uint64_t w = (id * 0x9E3779B97F4A7C15ull) ^ (v * 0xC2B2AE3D27D4EB4Full) ^ (i / 8);
    p[i] = static_cast<unsigned char>(w >> ((i % 8) * 8));
  }
}

// The first differing byte, or -1.
int64_t Diff(const void* got, uint64_t bytes, uint64_t id, uint64_t v) {
  std::vector<unsigned char> want(bytes);
  Fill(want.data(), bytes, id, v);
  const auto* g = static_cast<const unsigned char*>(got);
  for (uint64_t i = 0; i < bytes; ++i) {
    if (g[i] != want[i]) return static_cast<int64_t>(i);
  }
  return -1;
}

struct Counts {
  std::atomic<uint64_t> ops{0}, reads{0}, writes{0}, device{0}, evicts{0}, flushes{0},
      host_buffers{0}, extents{0}, boundaries{0};
};

TEST(StoreStressTest, EveryByteReadIsTheLastWritten) {
  const double seconds = EnvOr("SPILLWAY_STRESS_SECONDS", 3);
  const auto seed = static_cast<uint64_t>(EnvOr("SPILLWAY_STRESS_SEED", 1));
  // Params on NVMe, optimizer state on the host: both homes, spilling both ways.
  StoreRig rig(ParseOrDie(OffloadJson("nvme", "cpu")), kBounce + 3 * kMiB, true, nullptr,
               /*prefetch_window=*/2);
  PartitionStore& store = *rig.store;
  store.set_memory_wait(std::chrono::minutes(2));  // a slow sanitizer run is not a failure
  auto device = std::move(Device::OpenCpu().value());
  auto pipe = std::move(
      TransferPipeline::Create(rig.host.get(), rig.nvme.get(), device.get(), {64 * 1024, 3})
          .value());
  ASSERT_TRUE(store.AttachDevice(pipe.get()).ok());

  std::vector<PartitionId> ids;
  std::vector<uint64_t> version;  // the model: last version written, per partition (owner only)
  for (uint32_t t = 0; t < kThreads; ++t) {
    for (uint32_t g = 0; g < kPartsPerThread; ++g) {
      const StateKind kind = g % 2 == 0 ? StateKind::kParam : StateKind::kMasterWeight;
      auto id = store.Register({t, g, kind}, kPartBytes);
      ASSERT_TRUE(id.ok()) << id.status().ToString();
      ids.push_back(*id);
      version.push_back(0);
    }
  }
  // Fresh partitions read as zeros: version 0 is "all zero" for the model.
  ASSERT_TRUE(store.SetSchedule(ids).ok());
  ASSERT_TRUE(rig.ledger.BeginEpoch(0).ok());

  Counts n;
  std::atomic<bool> failed{false};
  std::atomic<bool> stop{false};
  const auto deadline = std::chrono::steady_clock::now() +
                        std::chrono::microseconds(static_cast<int64_t>(seconds * 1e6));
  auto check = [&](const Status& st, const char* what) {
    if (!st.ok()) {
      ADD_FAILURE() << what << ": " << st.ToString();
      failed = true;
    }
    return st.ok();
  };
  auto verify = [&](const void* data, uint64_t bytes, uint64_t id, uint64_t v, const char* where) {
    bool ok;
    if (v == 0) {
      std::vector<unsigned char> zeros(bytes, 0);
      ok = std::memcmp(data, zeros.data(), bytes) == 0;
    } else {
      ok = Diff(data, bytes, id, v) < 0;
    }
    if (!ok) {
      ADD_FAILURE() << where << ": object " << id << " does not hold version " << v
                    << " (first bad byte " << (v == 0 ? -2 : Diff(data, bytes, id, v)) << ")";
      failed = true;
    }
  };

  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      std::mt19937_64 rng(seed * 1000 + static_cast<uint64_t>(t));
      struct Buffer {
        void* p;
        uint64_t bytes, id, v;
      };
      struct Extent {
        uint64_t off, bytes, id, v;
      };
      std::vector<Buffer> buffers;
      std::vector<Extent> extents;
      uint64_t next_object = 1'000'000ull * static_cast<uint64_t>(t + 1);
      std::vector<char> scratch(kPartBytes);
      while (!failed && !stop && std::chrono::steady_clock::now() < deadline) {
        const int dice = static_cast<int>(rng() % 100);
        const size_t k = static_cast<size_t>(t) * kPartsPerThread + rng() % kPartsPerThread;
        const PartitionId id = ids[k];
        n.ops++;
        if (dice < 25) {  // write a new version through a host handle
          auto h = store.Acquire(id, Access::kReadWrite);
          if (!check(h.status(), "Acquire for write")) break;
          verify(*h->Data(), kPartBytes, id, version[k], "before a write");
          Fill(*h->Data(), kPartBytes, id, ++version[k]);
          if (!check(store.Release(*h), "Release after write")) break;
          n.writes++;
        } else if (dice < 45) {  // read and check
          auto h = store.Acquire(id, Access::kRead);
          if (!check(h.status(), "Acquire for read")) break;
          verify(*h->Data(), kPartBytes, id, version[k], "host read");
          n.reads++;
        } else if (dice < 55) {  // a new version through a device view (fill, write back)
          auto dv = store.Acquire(id, Access::kReadWrite, Placement::kDevice);
          if (!check(dv.status(), "Acquire on the device")) break;
          if (!check(device->CopyToHost(scratch.data(), *dv->Data(), kPartBytes), "device read"))
            break;
          verify(scratch.data(), kPartBytes, id, version[k], "device view");
          Fill(scratch.data(), kPartBytes, id, ++version[k]);
          if (!check(device->CopyFromHost(*dv->Data(), scratch.data(), kPartBytes), "device write"))
            break;
          if (!check(store.Release(*dv), "device write-back")) break;
          n.device++;
        } else if (dice < 62) {
          if (!check(store.Evict(id), "Evict")) break;
          n.evicts++;
        } else if (dice < 65) {
          if (!check(store.Flush(), "Flush")) break;
          n.flushes++;
        } else if (dice < 68) {
          if (!check(store.Prefetch({id}), "Prefetch")) break;
        } else if (dice < 82) {  // host arena buffers: allocate and fill, or check and free
          if (buffers.size() < 3 && rng() % 2 == 0) {
            const uint64_t bytes = 1 + rng() % (192 * 1024);
            auto p = rig.host->Allocate(
                bytes, {allocator::Kind::kGrad, allocator::Lifetime::kPersistent, 0});
            if (p.ok()) {
              const uint64_t obj = next_object++;
              Fill(*p, bytes, obj, 1);
              buffers.push_back({*p, bytes, obj, 1});
            } else if (p.status().code() != StatusCode::kOverBudget) {
              check(p.status(), "HostArena::Allocate");
              break;
            }
          } else if (!buffers.empty()) {
            const size_t i = rng() % buffers.size();
            verify(buffers[i].p, buffers[i].bytes, buffers[i].id, buffers[i].v, "host buffer");
            if (!check(rig.host->Free(buffers[i].p), "HostArena::Free")) break;
            buffers[i] = buffers.back();
            buffers.pop_back();
          }
          n.host_buffers++;
        } else {  // raw NVMe extents: allocate+write, rewrite, or read+check+free
          const int what = static_cast<int>(rng() % 3);
          if (extents.size() < 3 && what == 0) {
            const uint64_t bytes = 4096 + rng() % (128 * 1024);
            auto off = rig.nvme->Allocate(
                bytes, {allocator::Kind::kSwapBuffer, allocator::Lifetime::kPersistent, 0});
            if (!check(off.status(), "NvmeArena::Allocate")) break;
            std::vector<char> data(bytes);
            const uint64_t obj = next_object++;
            Fill(data.data(), bytes, obj, 1);
            if (!check(rig.nvme->Write(*off, data.data(), bytes), "NvmeArena::Write")) break;
            extents.push_back({*off, bytes, obj, 1});
          } else if (!extents.empty()) {
            const size_t i = rng() % extents.size();
            Extent& e = extents[i];
            std::vector<char> data(e.bytes);
            if (what == 1) {
              Fill(data.data(), e.bytes, e.id, ++e.v);
              if (!check(rig.nvme->Write(e.off, data.data(), e.bytes), "NvmeArena::Write")) break;
            } else {
              if (!check(rig.nvme->Read(e.off, data.data(), e.bytes), "NvmeArena::Read")) break;
              verify(data.data(), e.bytes, e.id, e.v, "NVMe extent");
              if (!check(rig.nvme->Free(e.off), "NvmeArena::Free")) break;
              extents[i] = extents.back();
              extents.pop_back();
            }
          }
          n.extents++;
        }
      }
      for (const Buffer& b : buffers) {
        verify(b.p, b.bytes, b.id, b.v, "host buffer at the end");
        (void)rig.host->Free(b.p);
      }
      for (const Extent& e : extents) (void)rig.nvme->Free(e.off);
    });
  }
  // The driver crosses ledger step boundaries while the threads run.
  std::thread driver([&] {
    int64_t step = 0;
    while (!failed && std::chrono::steady_clock::now() < deadline) {
      if (!check(rig.ledger.BeginStep(step++), "BeginStep")) break;
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
      allocator::BoundaryReport report;
      if (!check(rig.ledger.EndStep(&report), "EndStep")) break;
      n.boundaries++;
    }
  });
  for (auto& th : threads) th.join();
  stop = true;
  driver.join();
  store.DrainPrefetch();
  // Every partition, read back through the store after everything settled, holds its last version.
  for (size_t k = 0; k < ids.size(); ++k) {
    auto h = store.Acquire(ids[k], Access::kRead);
    ASSERT_TRUE(h.ok()) << h.status().ToString();
    verify(*h->Data(), kPartBytes, ids[k], version[k], "final read");
  }
  const PartitionStoreStats s = store.Stats();
  std::printf(
      "stress: seed %llu, %.1f s: %llu ops (%llu writes, %llu reads, %llu device, %llu "
      "evicts, %llu flushes, %llu host buffer ops, %llu extent ops, %llu boundaries); "
      "store: %llu spills, %llu swap-ins, %llu prefetches, %llu memory waits\n",
      static_cast<unsigned long long>(seed), seconds, static_cast<unsigned long long>(n.ops.load()),
      static_cast<unsigned long long>(n.writes.load()),
      static_cast<unsigned long long>(n.reads.load()),
      static_cast<unsigned long long>(n.device.load()),
      static_cast<unsigned long long>(n.evicts.load()),
      static_cast<unsigned long long>(n.flushes.load()),
      static_cast<unsigned long long>(n.host_buffers.load()),
      static_cast<unsigned long long>(n.extents.load()),
      static_cast<unsigned long long>(n.boundaries.load()),
      static_cast<unsigned long long>(s.spills), static_cast<unsigned long long>(s.swap_ins),
      static_cast<unsigned long long>(s.prefetches),
      static_cast<unsigned long long>(s.memory_waits));
  EXPECT_GT(s.spills, 0u);
  EXPECT_GT(n.device.load(), 0u);
  EXPECT_TRUE(rig.host->Validate().ok());
  EXPECT_TRUE(rig.nvme->Validate().ok());
}

}  // namespace
}  // namespace spillway::offload
