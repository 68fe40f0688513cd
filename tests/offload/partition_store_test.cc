// PartitionStore on the real arenas and engine: tier round trips, spill under a quarter budget
// with results identical to an unbounded run, the OPT choice, handles, faults, 4-thread stress.
#include "spillway/offload/partition_store.h"

#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstring>
#include <future>
#include <mutex>
#include <optional>
#include <thread>

#include "../allocator/nvme_test_util.h"
#include "pausing_device.h"
#include "spillway/allocator/io_faults.h"
#include "spillway/base/bytes.h"
#include "spillway/offload/transfer_pipeline.h"
#include "store_test_util.h"

namespace spillway::offload {
namespace {

using allocator::testing::FillRandom;

using allocator::testing::Has;
using testing::OffloadJson;
using testing::ParseOrDie;
using testing::StoreRig;

// The 8 MiB bounce pool of the engine lives in the host arena too.
constexpr uint64_t kBounce = 8 * kMiB;

struct TierCase {
  const char* param;
  const char* optimizer;
};

class TierRoundTripTest : public ::testing::TestWithParam<TierCase> {};

TEST_P(TierRoundTripTest, RandomDataSurvivesEveryTierAndEviction) {
  StoreRig rig(ParseOrDie(OffloadJson(GetParam().param, GetParam().optimizer)), 256 * kMiB);
  ASSERT_NE(rig.store, nullptr);
  std::vector<PartitionId> ids;
  std::vector<std::vector<char>> expect;
  const StateKind kinds[] = {StateKind::kParam, StateKind::kGrad, StateKind::kMasterWeight,
                             StateKind::kExpAvg, StateKind::kExpAvgSq};
  for (uint32_t g = 0; g < 2; ++g) {
    for (StateKind k : kinds) {
      const uint64_t bytes = 3 * kMiB + 4096 * g + 12;  // odd sizes
      auto id = rig.store->Register({0, g, k}, bytes);
      ASSERT_TRUE(id.ok()) << id.status().ToString();
      ids.push_back(*id);
      auto h = rig.store->Acquire(*id);
      ASSERT_TRUE(h.ok());
      std::vector<char> data(bytes);
      FillRandom(data.data(), bytes, *id + 1);
      std::memcpy(*h->Data(), data.data(), bytes);
      expect.push_back(std::move(data));
    }
  }
  ASSERT_TRUE(rig.store->Flush().ok());
  for (PartitionId id : ids) {
    if (rig.store->home(id) == Placement::kNvme) {
      ASSERT_TRUE(rig.store->Evict(id).ok());
    }
  }
  for (size_t i = 0; i < ids.size(); ++i) {
    auto h = rig.store->Acquire(ids[i], Access::kRead);
    ASSERT_TRUE(h.ok()) << h.status().ToString();
    ASSERT_EQ(std::memcmp(*h->Data(), expect[i].data(), expect[i].size()), 0) << i;
  }
  const bool param_nvme = std::string(GetParam().param) == "nvme";
  EXPECT_EQ(rig.store->home(ids[0]), param_nvme ? Placement::kNvme : Placement::kHost);
}

INSTANTIATE_TEST_SUITE_P(Tiers, TierRoundTripTest,
                         ::testing::Values(TierCase{"cpu", "cpu"}, TierCase{"nvme", "nvme"},
                                           TierCase{"nvme", "cpu"}, TierCase{"cpu", "nvme"}),
                         [](const ::testing::TestParamInfo<TierCase>& p) {
                           return std::string(p.param.param) + "_" + p.param.optimizer;
                         });

// Five "optimizer steps" over 16 partitions of 4 MiB in schedule order; returns a digest of
// each partition's final contents.
std::vector<uint64_t> Train(PartitionStore& store, int parts, int steps) {
  std::vector<PartitionId> ids;
  for (int i = 0; i < parts; ++i) {
    ids.push_back(
        *store.Register({0, static_cast<uint32_t>(i), StateKind::kMasterWeight}, 4 * kMiB));
  }
  EXPECT_TRUE(store.SetSchedule(ids).ok());
  for (int s = 0; s < steps; ++s) {
    for (PartitionId id : ids) {
      auto h = store.Acquire(id);
      EXPECT_TRUE(h.ok()) << h.status().ToString();
      if (!h.ok()) return {};
      auto* w = static_cast<uint32_t*>(*h->Data());
      for (uint64_t i = 0; i < 4 * kMiB / 4; i += 7) w[i] = w[i] * 3 + s + id;
    }
  }
  std::vector<uint64_t> digest;
  for (PartitionId id : ids) {
    auto h = store.Acquire(id, Access::kRead);
    const auto* w = static_cast<const uint32_t*>(*h->Data());
    uint64_t d = 1469598103934665603ull;
    for (uint64_t i = 0; i < 4 * kMiB / 4; ++i) d = (d ^ w[i]) * 1099511628211ull;
    digest.push_back(d);
  }
  return digest;
}

TEST(PartitionStoreTest, SpillUnderAQuarterOfTheStatesMatchesAnUnboundedRun) {
  const Config cfg = ParseOrDie(OffloadJson("cpu", "cpu"));
  StoreRig unbounded(cfg, 1024 * kMiB);
  const auto expected = Train(*unbounded.store, 16, 5);
  EXPECT_EQ(unbounded.store->Stats().spills, 0u);
  StoreRig bounded(cfg, kBounce + 16 * kMiB);  // 16 of the 64 MiB of states fit
  const auto got = Train(*bounded.store, 16, 5);
  EXPECT_EQ(got, expected);
  const PartitionStoreStats st = bounded.store->Stats();
  EXPECT_GT(st.spills, 40u);
  EXPECT_GT(st.swap_ins, 40u);
  EXPECT_LE(bounded.host->Stats().peak_committed_bytes, kBounce + 16 * kMiB);
  EXPECT_TRUE(bounded.host->Validate().ok());
}

TEST(PartitionStoreTest, PrefetchBringsInTheNextPartitionsOfTheScheduleAhead) {
  StoreRig rig(ParseOrDie(OffloadJson("nvme", "nvme")), 256 * kMiB, true, nullptr,
               /*prefetch_window=*/2);
  std::vector<PartitionId> ids;
  for (uint32_t g = 0; g < 5; ++g) {
    ids.push_back(*rig.store->Register({0, g, StateKind::kParam}, 2 * kMiB));
    {
      auto h = rig.store->Acquire(ids.back());
      std::memset(*h->Data(), static_cast<int>(g + 1), 2 * kMiB);
    }
    ASSERT_TRUE(rig.store->Evict(ids.back()).ok());
  }
  ASSERT_TRUE(rig.store->SetSchedule(ids).ok());
  rig.store->DrainPrefetch();
  const uint64_t before = rig.store->Stats().prefetches;
  {
    auto a = rig.store->Acquire(ids[0]);
    ASSERT_TRUE(a.ok());
  }
  rig.store->DrainPrefetch();
  EXPECT_TRUE(rig.store->resident(ids[1]));
  EXPECT_TRUE(rig.store->resident(ids[2]));
  EXPECT_FALSE(rig.store->resident(ids[3]));  // outside the window
  EXPECT_EQ(rig.store->Stats().prefetches - before, 2u);
  auto b = rig.store->Acquire(ids[1], Access::kRead);  // already there: no swap-in on the path
  ASSERT_TRUE(b.ok());
  EXPECT_EQ(static_cast<unsigned char*>(*b->Data())[2 * kMiB - 1], 2);
}

TEST(PartitionStoreTest, AnAcquireOffTheScheduleNeitherPrefetchesNorMovesTheCursor) {
  StoreRig rig(ParseOrDie(OffloadJson("nvme", "nvme")), 256 * kMiB, true, nullptr,
               /*prefetch_window=*/2);
  std::vector<PartitionId> ids;
  for (uint32_t g = 0; g < 5; ++g) {
    ids.push_back(*rig.store->Register({0, g, StateKind::kParam}, 2 * kMiB));
    ASSERT_TRUE(rig.store->Evict(ids.back()).ok());
  }
  ASSERT_TRUE(rig.store->SetSchedule(ids).ok());
  {
    PartitionStore::OffSchedule off(*rig.store);
    auto c = rig.store->Acquire(ids[2], Access::kRead);  // a checkpoint's read, say
    ASSERT_TRUE(c.ok());
  }
  rig.store->DrainPrefetch();
  EXPECT_FALSE(rig.store->resident(ids[3]));
  EXPECT_FALSE(rig.store->resident(ids[4]));
  EXPECT_EQ(rig.store->Stats().prefetches, 0u);
  // Back on the schedule, an Acquire prefetches from its own position as before.
  { ASSERT_TRUE(rig.store->Acquire(ids[0], Access::kRead).ok()); }
  rig.store->DrainPrefetch();
  EXPECT_TRUE(rig.store->resident(ids[1]));
  EXPECT_EQ(rig.store->Stats().prefetches, 1u);  // ids[2] was still resident
}

TEST(PartitionStoreTest, PrefetchingUnderAQuarterBudgetStillMatchesAnUnboundedRun) {
  const Config cfg = ParseOrDie(OffloadJson("cpu", "cpu"));
  StoreRig unbounded(cfg, 1024 * kMiB);
  const auto expected = Train(*unbounded.store, 16, 5);
  StoreRig bounded(cfg, kBounce + 16 * kMiB, true, nullptr, /*prefetch_window=*/2);
  const auto got = Train(*bounded.store, 16, 5);
  EXPECT_EQ(got, expected);
  EXPECT_GT(bounded.store->Stats().prefetches, 0u);
  EXPECT_TRUE(bounded.host->Validate().ok());
}

// Device views on the CPU backend (the same schedule the CUDA backend runs).
struct DeviceRig {
  explicit DeviceRig(const Config& cfg, uint32_t prefetch_window = 0, Device* dev = nullptr,
                     allocator::IoFaults* faults = nullptr)
      : rig(cfg, 256 * kMiB, true, faults, prefetch_window) {
    if (dev == nullptr) {
      owned = std::move(Device::OpenCpu().value());
      dev = owned.get();
    }
    device = dev;
    pipe = std::move(
        TransferPipeline::Create(rig.host.get(), rig.nvme.get(), device, {kMiB, 4}).value());
    EXPECT_TRUE(rig.store->AttachDevice(pipe.get()).ok());
  }
  ~DeviceRig() { rig.store.reset(); }
  std::vector<char> ReadDevice(const Handle& h) {
    std::vector<char> out(h.bytes());
    EXPECT_TRUE(device->CopyToHost(out.data(), *h.Data(), h.bytes()).ok());
    return out;
  }
  StoreRig rig;
  std::unique_ptr<Device> owned;
  Device* device = nullptr;
  std::unique_ptr<TransferPipeline> pipe;
};

// Polls `done` for up to 30 s.
template <typename F>
bool Eventually(F done) {
  for (int i = 0; i < 30'000; ++i) {
    if (done()) return true;
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  return done();
}

// Registers an NVMe-homed param holding `data` and evicts it: not resident, its bytes on NVMe.
PartitionId RegisterEvicted(PartitionStore& store, const std::vector<char>& data) {
  auto id = store.Register({0, 0, StateKind::kParam}, data.size());
  EXPECT_TRUE(id.ok()) << id.status().ToString();
  {
    auto h = store.Acquire(*id);
    std::memcpy(*h->Data(), data.data(), data.size());
  }
  EXPECT_TRUE(store.Evict(*id).ok());
  return *id;
}

TEST(PartitionStoreTest, DeviceViewsFillFromHostOrStraightFromNvmeAndWriteBack) {
  DeviceRig d(ParseOrDie(OffloadJson("nvme", "cpu")));
  PartitionStore& store = *d.rig.store;
  const uint64_t bytes = 3 * kMiB + 100;
  std::vector<char> v1(bytes), v2(bytes);
  FillRandom(v1.data(), bytes, 1);
  FillRandom(v2.data(), bytes, 2);
  // A host-homed master weight: the device view comes from the host copy and goes back into it.
  auto master = *store.Register({0, 0, StateKind::kMasterWeight}, bytes);
  {
    auto h = store.Acquire(master);
    std::memcpy(*h->Data(), v1.data(), bytes);
  }
  {
    auto dv = store.Acquire(master, Access::kReadWrite, Placement::kDevice);
    ASSERT_TRUE(dv.ok()) << dv.status().ToString();
    EXPECT_EQ(d.ReadDevice(*dv), v1);
    ASSERT_TRUE(d.device->CopyFromHost(*dv->Data(), v2.data(), bytes).ok());
    ASSERT_TRUE(store.Release(*dv).ok());
  }
  {
    auto h = store.Acquire(master, Access::kRead);
    EXPECT_EQ(std::memcmp(*h->Data(), v2.data(), bytes), 0);
  }
  // An NVMe-homed param that is not resident: filled straight from NVMe, written back to NVMe,
  // and no host copy is made on the way.
  const PartitionId param = RegisterEvicted(store, v1);
  {
    auto dv = store.Acquire(param, Access::kReadWrite, Placement::kDevice);
    ASSERT_TRUE(dv.ok()) << dv.status().ToString();
    EXPECT_FALSE(store.resident(param));
    EXPECT_EQ(d.ReadDevice(*dv), v1);
    ASSERT_TRUE(d.device->CopyFromHost(*dv->Data(), v2.data(), bytes).ok());
  }  // the destructor writes it back
  EXPECT_FALSE(store.resident(param));
  {
    auto h = store.Acquire(param, Access::kRead);
    EXPECT_EQ(std::memcmp(*h->Data(), v2.data(), bytes), 0);
  }
  const PartitionStoreStats st = store.Stats();
  EXPECT_EQ(st.device_fills, 2u);
  EXPECT_EQ(st.device_writebacks, 2u);
  EXPECT_EQ(d.pipe->Stats().nvme_to_device_bytes, bytes);
  EXPECT_EQ(d.pipe->Stats().device_to_nvme_bytes, bytes);
}

TEST(PartitionStoreTest, APartitionIsUsedInOneTierAtATime) {
  DeviceRig d(ParseOrDie(OffloadJson("cpu", "cpu")));
  PartitionStore& store = *d.rig.store;
  auto id = *store.Register({0, 0, StateKind::kGrad}, kMiB);
  {
    auto h = store.Acquire(id);
    ASSERT_TRUE(h.ok());
    auto dv = store.Acquire(id, Access::kRead, Placement::kDevice);
    EXPECT_EQ(dv.status().code(), StatusCode::kFailedPrecondition);
    EXPECT_TRUE(Has(dv.status(), "in use on host by 1 handles")) << dv.status().ToString();
  }
  auto dv = store.Acquire(id, Access::kRead, Placement::kDevice);
  ASSERT_TRUE(dv.ok());
  auto h = store.Acquire(id);
  EXPECT_TRUE(Has(h.status(), "in use on device")) << h.status().ToString();
  EXPECT_EQ(store.Acquire(id, Access::kRead, Placement::kNvme).status().code(),
            StatusCode::kInvalidArgument);
}

// A partition never written reads as zeros in a device view too, over every 64 KiB block of the
// zero fill and its odd tail. The device hands out memory poisoned with 0xCC (real device memory
// is not zeroed), so a block the fill skipped shows.
TEST(PartitionStoreTest, ANeverWrittenPartitionsDeviceViewIsZeros) {
  class PoisonDevice : public Device {
   public:
    PoisonDevice() : cpu_(std::move(Device::OpenCpu().value())) {}
    DeviceId id() const override { return cpu_->id(); }
    Result<void*> Allocate(uint64_t bytes) override {
      SPILLWAY_ASSIGN_OR_RETURN(void* p, cpu_->Allocate(bytes));
      const std::vector<char> poison(bytes, static_cast<char>(0xCC));
      SPILLWAY_RETURN_IF_ERROR(cpu_->CopyFromHost(p, poison.data(), bytes));
      return p;
    }
    Status Free(void* ptr) override { return cpu_->Free(ptr); }
    Result<std::unique_ptr<Stream>> NewStream() override { return cpu_->NewStream(); }
    Status CopyToHost(void* host, const void* device, uint64_t bytes) override {
      return cpu_->CopyToHost(host, device, bytes);
    }
    Status CopyFromHost(void* device, const void* host, uint64_t bytes) override {
      return cpu_->CopyFromHost(device, host, bytes);
    }

   private:
    std::unique_ptr<Device> cpu_;
  } poison;
  DeviceRig d(ParseOrDie(OffloadJson("nvme", "nvme")), 0, &poison);
  const uint64_t bytes = 3 * kMiB + 12345;
  const PartitionId id = *d.rig.store->Register({0, 0, StateKind::kParam}, bytes);
  auto dv = d.rig.store->Acquire(id, Access::kRead, Placement::kDevice);
  ASSERT_TRUE(dv.ok()) << dv.status().ToString();
  const std::vector<char> got = d.ReadDevice(*dv);
  EXPECT_EQ(std::count(got.begin(), got.end(), 0), static_cast<std::ptrdiff_t>(bytes));
}

TEST(PartitionStoreTest, TheDeviceTierNeedsAnAttachedDevice) {
  StoreRig rig(ParseOrDie(OffloadJson("cpu", "cpu")), 256 * kMiB);
  auto id = *rig.store->Register({0, 0, StateKind::kGrad}, kMiB);
  auto dv = rig.store->Acquire(id, Access::kRead, Placement::kDevice);
  EXPECT_EQ(dv.status().code(), StatusCode::kFailedPrecondition);
  EXPECT_TRUE(Has(dv.status(), "AttachDevice")) << dv.status().ToString();
}

TEST(PartitionStoreTest, AStoreCopiesThroughOnePipelineForItsLifetime) {
  DeviceRig d(ParseOrDie(OffloadJson("nvme", "cpu")));
  auto id = *d.rig.store->Register({0, 0, StateKind::kParam}, kMiB);
  auto view = d.rig.store->Acquire(id, Access::kRead, Placement::kDevice);
  ASSERT_TRUE(view.ok()) << view.status().ToString();
  // The same pipeline again (Tiers attaches it, then the trainer): nothing changes, the view lives.
  EXPECT_TRUE(d.rig.store->AttachDevice(d.pipe.get()).ok());
  // Another pipeline, or none, would pull the copies' path from under live views: refused.
  auto other =
      TransferPipeline::Create(d.rig.host.get(), d.rig.nvme.get(), d.device, {kMiB, 4}).value();
  Status st = d.rig.store->AttachDevice(other.get());
  EXPECT_EQ(st.code(), StatusCode::kFailedPrecondition);
  EXPECT_TRUE(Has(st, "a different pipeline is already attached")) << st.ToString();
  st = d.rig.store->AttachDevice(nullptr);
  EXPECT_EQ(st.code(), StatusCode::kInvalidArgument);
  EXPECT_TRUE(Has(st, "null")) << st.ToString();
  EXPECT_TRUE(d.rig.store->Release(*view).ok());
}

TEST(PartitionStoreTest, OptSpillsThePartitionNeededFurthestInTheFuture) {
  StoreRig rig(ParseOrDie(OffloadJson("cpu", "cpu")), kBounce + 12 * kMiB);  // room for 3
  std::vector<PartitionId> id;
  for (uint32_t g = 0; g < 3; ++g) {
    id.push_back(*rig.store->Register({0, g, StateKind::kExpAvg}, 4 * kMiB));
  }
  // D does not fit yet; register it on NVMe by evicting nothing: it spills one of A, B, C.
  ASSERT_TRUE(rig.store->SetSchedule({}).ok());
  auto d = rig.store->Register({0, 3, StateKind::kExpAvg}, 4 * kMiB);
  ASSERT_TRUE(d.ok()) << d.status().ToString();
  id.push_back(*d);
  // Now the schedule A B C D: after using A, B, C, the next use of A is the soonest, of C the
  // furthest. Bringing D back in must spill C (an LRU policy would spill A).
  ASSERT_TRUE(rig.store->SetSchedule(id).ok());
  for (int i = 0; i < 3; ++i) {
    auto h = rig.store->Acquire(id[i]);
    ASSERT_TRUE(h.ok()) << i << ": " << h.status().ToString();
  }
  ASSERT_TRUE(rig.store->resident(id[0]) && rig.store->resident(id[1]) &&
              rig.store->resident(id[2]));
  ASSERT_FALSE(rig.store->resident(id[3]));
  auto hd = rig.store->Acquire(id[3]);
  ASSERT_TRUE(hd.ok()) << hd.status().ToString();
  EXPECT_TRUE(rig.store->resident(id[0]));
  EXPECT_TRUE(rig.store->resident(id[1]));
  EXPECT_FALSE(rig.store->resident(id[2]));
}

// spillway.eviction "lru": the same uses as above spill A, acquired longest ago, although it is the
// next one the schedule needs.
TEST(PartitionStoreTest, LruEvictionSpillsThePartitionUsedLongestAgo) {
  Config config = ParseOrDie(OffloadJson("cpu", "cpu"));
  config.spillway.eviction = Eviction::kLru;
  StoreRig rig(config, kBounce + 12 * kMiB);  // room for 3
  std::vector<PartitionId> id;
  for (uint32_t g = 0; g < 4; ++g) {
    auto r = rig.store->Register({0, g, StateKind::kExpAvg}, 4 * kMiB);
    ASSERT_TRUE(r.ok()) << r.status().ToString();
    id.push_back(*r);
  }
  ASSERT_TRUE(rig.store->SetSchedule(id).ok());
  for (int i = 0; i < 3; ++i) {
    auto h = rig.store->Acquire(id[i]);
    ASSERT_TRUE(h.ok()) << i << ": " << h.status().ToString();
  }
  ASSERT_FALSE(rig.store->resident(id[3]));
  auto hd = rig.store->Acquire(id[3]);
  ASSERT_TRUE(hd.ok()) << hd.status().ToString();
  EXPECT_FALSE(rig.store->resident(id[0]));
  EXPECT_TRUE(rig.store->resident(id[1]));
  EXPECT_TRUE(rig.store->resident(id[2]));
}

// The arena tells the spill handler the size of the request that failed. Freeing small partitions
// scattered through a shared region makes room in no single place, so the store prefers one
// victim at least as large as the request over OPT's order among smaller ones.
TEST(PartitionStoreTest, ASpillForALargeRequestFreesOneLargeVictimNotScatteredSmallOnes) {
  // 64 partitions of 64 KiB fill one shared 4 MiB region; one of 2 MiB has a region of its own.
  constexpr uint64_t kSmall = 64 * 1024, kLarge = 2 * kMiB;
  StoreRig rig(ParseOrDie(OffloadJson("cpu", "cpu")), kBounce + 4 * kMiB + kLarge);
  std::vector<PartitionId> small;
  for (uint32_t g = 0; g < 64; ++g) {
    auto id = rig.store->Register({0, g, StateKind::kExpAvg}, kSmall);
    ASSERT_TRUE(id.ok()) << g << ": " << id.status().ToString();
    small.push_back(*id);
  }
  auto large = rig.store->Register({0, 64, StateKind::kExpAvg}, kLarge);
  ASSERT_TRUE(large.ok()) << large.status().ToString();
  // The schedule uses the large one first, then the odd small ones, then the even ones: by next
  // use alone the even ones go first, and they are not adjacent, so freeing them frees no 2 MiB.
  std::vector<PartitionId> order{*large};
  for (size_t i = 1; i < small.size(); i += 2) order.push_back(small[i]);
  for (size_t i = 0; i < small.size(); i += 2) order.push_back(small[i]);
  ASSERT_TRUE(rig.store->SetSchedule(order).ok());
  const uint64_t spills_before = rig.store->Stats().spills;

  auto second = rig.store->Register({0, 65, StateKind::kExpAvg}, kLarge);
  ASSERT_TRUE(second.ok()) << second.status().ToString();
  EXPECT_EQ(rig.store->Stats().spills - spills_before, 1u)
      << "small partitions were spilled for nothing";
  EXPECT_FALSE(rig.store->resident(*large));
  for (PartitionId id : small) EXPECT_TRUE(rig.store->resident(id)) << id;
}

TEST(PartitionStoreTest, HandlesReleaseOnceAndAReleasedHandleIsAnError) {
  StoreRig rig(ParseOrDie(OffloadJson("cpu", "nvme")), 256 * kMiB);
  auto id = rig.store->Register({0, 0, StateKind::kMasterWeight}, kMiB);
  ASSERT_TRUE(id.ok());
  auto h = rig.store->Acquire(*id);
  ASSERT_TRUE(h.ok());
  ASSERT_NE(h->data(), nullptr);
  EXPECT_EQ(h->data(), *h->Data());  // the plain view and the checked one agree while held
  ASSERT_TRUE(rig.store->Release(*h).ok());
  EXPECT_EQ(h->data(), nullptr);  // a released handle shows no memory
  Status twice = rig.store->Release(*h);
  EXPECT_EQ(twice.code(), StatusCode::kFailedPrecondition);
  EXPECT_TRUE(Has(twice, "already released")) << twice.ToString();
  EXPECT_EQ(h->Data().status().code(), StatusCode::kFailedPrecondition);
  {
    auto scoped = rig.store->Acquire(*id);
    ASSERT_TRUE(scoped.ok());
    EXPECT_EQ(rig.store->Evict(*id).code(), StatusCode::kFailedPrecondition);  // in use
  }  // the handle's destructor released it
  EXPECT_TRUE(rig.store->Evict(*id).ok());
  EXPECT_FALSE(rig.store->resident(*id));
  EXPECT_EQ(rig.store->Stats().live_handles, 0u);
  EXPECT_EQ(rig.store->Acquire(999).status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(rig.store->Register({0, 0, StateKind::kMasterWeight}, kMiB).status().code(),
            StatusCode::kInvalidArgument);  // registered twice
}

TEST(PartitionStoreTest, PartitionsInUseAreNeverSpilledAndTheErrorSaysSo) {
  StoreRig rig(ParseOrDie(OffloadJson("cpu", "cpu")), kBounce + 8 * kMiB);  // room for 2
  auto a = rig.store->Register({0, 0, StateKind::kGrad}, 4 * kMiB);
  auto b = rig.store->Register({0, 1, StateKind::kGrad}, 4 * kMiB);
  ASSERT_TRUE(a.ok() && b.ok());
  auto ha = rig.store->Acquire(*a);
  auto hb = rig.store->Acquire(*b);
  ASSERT_TRUE(ha.ok() && hb.ok());
  std::memset(*ha->Data(), 0x11, 4 * kMiB);
  auto c = rig.store->Register({0, 2, StateKind::kGrad}, 4 * kMiB);
  EXPECT_EQ(c.status().code(), StatusCode::kOverBudget);
  EXPECT_TRUE(Has(c.status(), "host budget")) << c.status().ToString();
  // Only this thread's own handles hold the memory: no wait, and the error says whose they are.
  EXPECT_TRUE(Has(c.status(), "held by this thread's own live handles")) << c.status().ToString();
  EXPECT_EQ(rig.store->Stats().memory_waits, 0u);
  EXPECT_TRUE(rig.store->resident(*a) && rig.store->resident(*b));
  EXPECT_EQ(static_cast<unsigned char*>(*ha->Data())[4 * kMiB - 1], 0x11);
}

TEST(PartitionStoreTest, WithoutNvmeTheBudgetErrorSaysHowToAllowSpill) {
  Config cfg = ParseOrDie(R"({"zero_optimization": {"offload_optimizer": {"device": "cpu"}}})");
  StoreRig rig(cfg, kBounce + 4 * kMiB, /*with_nvme=*/false);
  ASSERT_TRUE(rig.store->Register({0, 0, StateKind::kExpAvg}, 4 * kMiB).ok());
  auto b = rig.store->Register({0, 1, StateKind::kExpAvg}, 4 * kMiB);
  EXPECT_EQ(b.status().code(), StatusCode::kOverBudget);
  EXPECT_TRUE(Has(b.status(), "offload_optimizer.device")) << b.status().ToString();
  EXPECT_TRUE(Has(b.status(), "exp_avg rank 0 group 1")) << b.status().ToString();
}

// Regression: a failed Register left a tombstone that kept the key, so registering the same
// partition again, once there was room, failed as "already registered" for ever.
TEST(PartitionStoreTest, AFailedRegisterCanBeRetriedOnceThereIsRoom) {
  Config cfg = ParseOrDie(R"({"zero_optimization": {"offload_optimizer": {"device": "cpu"}}})");
  StoreRig rig(cfg, kBounce + 4 * kMiB, /*with_nvme=*/false);
  auto a = rig.store->Register({0, 0, StateKind::kExpAvg}, 4 * kMiB);
  ASSERT_TRUE(a.ok());
  auto b = rig.store->Register({0, 1, StateKind::kExpAvg}, 4 * kMiB);
  ASSERT_EQ(b.status().code(), StatusCode::kOverBudget);
  auto retry = rig.store->Register({0, 1, StateKind::kExpAvg}, 4 * kMiB);
  EXPECT_EQ(retry.status().code(), StatusCode::kOverBudget)
      << retry.status().ToString();  // still no room
  auto smaller = rig.store->Register({0, 1, StateKind::kExpAvg}, 4096);
  // There is no room for a second 4 MiB partition, but a page fits under the budget's slack, or
  // else fails for the budget again: either way it is never refused as "already registered".
  EXPECT_FALSE(Has(smaller.status(), "already registered")) << smaller.status().ToString();
  EXPECT_FALSE(Has(retry.status(), "already registered")) << retry.status().ToString();
  EXPECT_TRUE(rig.store->Register({0, 0, StateKind::kExpAvg}, kMiB).status().code() ==
              StatusCode::kInvalidArgument);  // a live partition's key still is
}

TEST(PartitionStoreTest, AnNvmeConfigWithoutAnNvmeArenaIsRefused) {
  allocator::Ledger ledger;
  auto host = allocator::testing::MakeArena(allocator::testing::PageableOptions(&ledger));
  auto s = PartitionStore::Create(ParseOrDie(OffloadJson("nvme", "cpu")), host.get(), nullptr, 0);
  EXPECT_TRUE(Has(s.status(), "no NVMe arena was given")) << s.status().ToString();
}

TEST(PartitionStoreTest, AReadFaultSurfacesThroughAcquireAndTheDataIsStillThere) {
  allocator::IoFaults faults;
  StoreRig rig(ParseOrDie(OffloadJson("nvme", "nvme")), 256 * kMiB, true, &faults);
  auto id = rig.store->Register({0, 0, StateKind::kParam}, 2 * kMiB);
  ASSERT_TRUE(id.ok());
  std::vector<char> data(2 * kMiB);
  FillRandom(data.data(), data.size(), 77);
  {
    auto h = rig.store->Acquire(*id);
    ASSERT_TRUE(h.ok());
    std::memcpy(*h->Data(), data.data(), data.size());
  }
  ASSERT_TRUE(rig.store->Evict(*id).ok());
  faults.read_errno = EIO;
  auto bad = rig.store->Acquire(*id);
  EXPECT_EQ(bad.status().code(), StatusCode::kIoError);
  EXPECT_TRUE(Has(bad.status(), "acquiring param rank 0 group 0")) << bad.status().ToString();
  EXPECT_FALSE(rig.store->resident(*id));
  auto good = rig.store->Acquire(*id);
  ASSERT_TRUE(good.ok()) << good.status().ToString();
  EXPECT_EQ(std::memcmp(*good->Data(), data.data(), data.size()), 0);
}

// A dirty device view whose write-back failed is the only good copy: the store keeps it, and a host
// Acquire must not swap in the stale NVMe bytes meanwhile (it did: found by review of the
// PartitionStore::Validate invariants). A device Acquire and Release retries the write-back.
TEST(PartitionStoreTest, AKeptDeviceViewIsNotShadowedByAStaleHostCopy) {
  allocator::IoFaults faults;
  DeviceRig d(ParseOrDie(OffloadJson("nvme", "cpu")), 0, nullptr, &faults);
  PartitionStore& store = *d.rig.store;
  const uint64_t bytes = 2 * kMiB;
  std::vector<char> v1(bytes), v2(bytes);
  FillRandom(v1.data(), bytes, 1);
  FillRandom(v2.data(), bytes, 2);
  const PartitionId param = RegisterEvicted(store, v1);
  {
    auto dv = store.Acquire(param, Access::kReadWrite, Placement::kDevice);
    ASSERT_TRUE(dv.ok()) << dv.status().ToString();
    ASSERT_TRUE(d.device->CopyFromHost(*dv->Data(), v2.data(), bytes).ok());
    faults.write_errno = EIO;
    Status st = store.Release(*dv);
    EXPECT_EQ(st.code(), StatusCode::kIoError) << st.ToString();
    EXPECT_NE(st.message().find("the device copy is kept"), std::string::npos) << st.ToString();
  }
  faults.write_errno = 0;
  {
    auto h = store.Acquire(param, Access::kRead);
    ASSERT_FALSE(h.ok()) << "a host copy of the stale NVMe bytes was made";
    EXPECT_EQ(h.status().code(), StatusCode::kFailedPrecondition);
    EXPECT_NE(h.status().message().find("acquire it on the device tier"), std::string::npos)
        << h.status().ToString();
  }
  EXPECT_TRUE(store.Validate().ok()) << store.Validate().ToString();
  {
    auto dv = store.Acquire(param, Access::kRead, Placement::kDevice);
    ASSERT_TRUE(dv.ok()) << dv.status().ToString();
    EXPECT_EQ(d.ReadDevice(*dv), v2);
    ASSERT_TRUE(store.Release(*dv).ok());  // the retried write-back
  }
  auto h = store.Acquire(param, Access::kRead);
  ASSERT_TRUE(h.ok()) << h.status().ToString();
  EXPECT_EQ(std::memcmp(*h->Data(), v2.data(), bytes), 0);
}

TEST(PartitionStoreTest, AWriteFaultDuringSpillKeepsTheHostCopy) {
  allocator::IoFaults faults;
  StoreRig rig(ParseOrDie(OffloadJson("cpu", "cpu")), kBounce + 4 * kMiB, true, &faults);
  auto a = rig.store->Register({0, 0, StateKind::kMasterWeight}, 4 * kMiB);
  ASSERT_TRUE(a.ok());
  {
    auto h = rig.store->Acquire(*a);
    std::memset(*h->Data(), 0x5a, 4 * kMiB);
  }
  faults.write_errno = EIO;
  auto b = rig.store->Register({0, 1, StateKind::kMasterWeight}, 4 * kMiB);
  EXPECT_EQ(b.status().code(), StatusCode::kOverBudget);  // the spill failed, so no room
  ASSERT_TRUE(rig.store->resident(*a));
  auto h = rig.store->Acquire(*a, Access::kRead);
  EXPECT_EQ(static_cast<unsigned char*>(*h->Data())[123], 0x5a);
}

// With 4 threads each holding one handle at a time, memory is always coming back: every Acquire
// must succeed (before spills waited for each other, one failed now and then, worst under TSan).
TEST(PartitionStoreTest, FourThreadsUnderATightBudget) {
  StoreRig rig(ParseOrDie(OffloadJson("cpu", "cpu")), kBounce + 12 * kMiB);
  rig.store->set_memory_wait(std::chrono::minutes(2));  // a slow sanitizer run is not a failure
  constexpr int kPerThread = 4;
  std::vector<std::vector<PartitionId>> ids(4);
  for (uint32_t t = 0; t < 4; ++t) {
    for (uint32_t i = 0; i < kPerThread; ++i) {
      auto id = rig.store->Register({t, i, StateKind::kMasterWeight}, kMiB);
      ASSERT_TRUE(id.ok()) << id.status().ToString();
      ids[t].push_back(*id);
    }
  }
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&, t] {
      for (int round = 0; round < 25; ++round) {
        for (PartitionId id : ids[t]) {
          auto h = rig.store->Acquire(id);
          ASSERT_TRUE(h.ok()) << h.status().ToString();
          auto* w = static_cast<uint32_t*>(*h->Data());
          for (int k = 0; k < 64; ++k) w[k * 1024] += 1;
        }
      }
    });
  }
  for (auto& th : threads) th.join();
  for (int t = 0; t < 4; ++t) {
    for (PartitionId id : ids[t]) {
      auto h = rig.store->Acquire(id, Access::kRead);
      ASSERT_TRUE(h.ok());
      const auto* w = static_cast<const uint32_t*>(*h->Data());
      for (int k = 0; k < 64; ++k) ASSERT_EQ(w[k * 1024], 25u) << "partition " << id;
    }
  }
  EXPECT_GT(rig.store->Stats().spills, 0u);
  EXPECT_TRUE(rig.host->Validate().ok());
  EXPECT_TRUE(rig.nvme->Validate().ok());
}

}  // namespace
}  // namespace spillway::offload

namespace spillway::offload {
namespace {

// Room for one 4 MiB partition: a spill in progress by one thread must make the next thread wait
// for it, not fail with "0 B held by partitions in use".
TEST(PartitionStoreTest, ASpillWaitsForAnotherThreadsSpillInsteadOfFailing) {
  StoreRig rig(ParseOrDie(OffloadJson("nvme", "nvme")), kBounce + 4 * kMiB);
  PartitionId ids[3];
  for (uint32_t g = 0; g < 3; ++g)
    ids[g] = *rig.store->Register({0, g, StateKind::kParam}, 4 * kMiB);
  {
    auto h = rig.store->Acquire(ids[0]);  // resident and dirty: the next swap-in spills it
    ASSERT_TRUE(h.ok()) << h.status().ToString();
    std::memset(*h->Data(), 0x5a, 4 * kMiB);
  }
  testing::Gate gate;
  StoreHooks hooks;
  hooks.before_spill_write = [&](uint32_t) { gate.Hit(); };
  rig.store->SetHooksForTesting(&hooks);
  gate.Arm();
  Status first, second;
  std::thread a([&] { first = rig.store->Acquire(ids[1]).status(); });
  gate.WaitHeld();  // thread a is spilling partition 0
  std::atomic<bool> b_done{false};
  std::thread b([&] {
    second = rig.store->Acquire(ids[2]).status();
    b_done = true;
  });
  EXPECT_TRUE(Eventually([&] { return b_done.load() || rig.store->Stats().memory_waits > 0; }));
  gate.Resume();
  a.join();
  b.join();
  rig.store->SetHooksForTesting(nullptr);
  EXPECT_TRUE(first.ok()) << first.ToString();
  EXPECT_TRUE(second.ok()) << second.ToString();
  EXPECT_GE(rig.store->Stats().memory_waits, 1u);
  auto h = rig.store->Acquire(ids[0], Access::kRead);
  ASSERT_TRUE(h.ok()) << h.status().ToString();
  EXPECT_EQ(static_cast<unsigned char*>(*h->Data())[4 * kMiB - 1], 0x5a);
}

// The same room, given back by another thread's Evict instead of a spill this thread can repeat:
// the waiting spill finds nothing left to spill, and the memory the Evict freed must still be
// taken (the arena retries when memory came free while its spill handler ran), not refused as
// over budget with the whole budget free.
TEST(PartitionStoreTest, AnAcquireWaitingForAnotherThreadsEvictTakesTheMemoryItFreed) {
  StoreRig rig(ParseOrDie(OffloadJson("nvme", "nvme")), kBounce + 4 * kMiB);
  const PartitionId p0 = *rig.store->Register({0, 0, StateKind::kParam}, 4 * kMiB);
  const PartitionId p1 = *rig.store->Register({0, 1, StateKind::kParam}, 4 * kMiB);
  {
    auto h = rig.store->Acquire(p0);  // resident and dirty: Evict writes it first
    ASSERT_TRUE(h.ok()) << h.status().ToString();
    std::memset(*h->Data(), 0x5a, 4 * kMiB);
  }
  testing::Gate gate;
  StoreHooks hooks;
  hooks.before_spill_write = [&](uint32_t) { gate.Hit(); };
  rig.store->SetHooksForTesting(&hooks);
  gate.Arm();
  Status evicted, acquired;
  std::thread c([&] { evicted = rig.store->Evict(p0); });
  gate.WaitHeld();  // thread c is writing partition 0: busy, its host copy still held
  std::atomic<bool> b_done{false};
  std::thread b([&] {
    acquired = rig.store->Acquire(p1).status();
    b_done = true;
  });
  EXPECT_TRUE(Eventually([&] { return b_done.load() || rig.store->Stats().memory_waits > 0; }));
  gate.Resume();
  c.join();
  b.join();
  rig.store->SetHooksForTesting(nullptr);
  EXPECT_TRUE(evicted.ok()) << evicted.ToString();
  EXPECT_TRUE(acquired.ok()) << acquired.ToString();
  auto h = rig.store->Acquire(p0, Access::kRead);
  ASSERT_TRUE(h.ok()) << h.status().ToString();
  EXPECT_EQ(static_cast<unsigned char*>(*h->Data())[4 * kMiB - 1], 0x5a);
}

// Note [Fork] (docs/allocator.md): in a forked child every status-returning entry point of the
// store refuses. A resident partition's Acquire touched no arena, so it succeeded and handed the
// child a pointer into memory the child does not have (MADV_DONTFORK) or that reads as zeros.
TEST(PartitionStoreTest, InAForkedChildEveryCallRefuses) {
  StoreRig rig(ParseOrDie(OffloadJson("nvme", "nvme")), kBounce + 16 * kMiB);
  const PartitionId p0 = *rig.store->Register({0, 0, StateKind::kParam}, kMiB);
  std::optional<Handle> held;
  {
    auto h = rig.store->Acquire(p0);  // resident
    ASSERT_TRUE(h.ok()) << h.status().ToString();
    std::memset(*h->Data(), 0x5a, kMiB);
    held.emplace(std::move(*h));
  }
  const pid_t pid = fork();
  ASSERT_GE(pid, 0);
  if (pid == 0) {
    alarm(30);
    allocator::testing::RefusedInChild expect;
    expect(rig.store->Acquire(p0, Access::kRead).status(), "PartitionStore::Acquire");
    expect(held->Data().status(), "Handle::Data");
    expect(rig.store->Release(*held), "PartitionStore::Release");
    expect(rig.store->Register({0, 1, StateKind::kParam}, kMiB).status(),
           "PartitionStore::Register");
    expect(rig.store->SetSchedule({p0}), "PartitionStore::SetSchedule");
    expect(rig.store->Prefetch({p0}), "PartitionStore::Prefetch");
    expect(rig.store->Flush(), "PartitionStore::Flush");
    expect(rig.store->Evict(p0), "PartitionStore::Evict");
    std::fflush(stderr);
    _exit(expect.bad == 0 ? 0 : 1);
  }
  int status = 0;
  ASSERT_EQ(waitpid(pid, &status, 0), pid);
  ASSERT_TRUE(WIFEXITED(status)) << "the child died of signal " << WTERMSIG(status);
  EXPECT_EQ(WEXITSTATUS(status), 0) << "a call in the child did not refuse (its stderr says which)";
  // The parent carries on.
  EXPECT_EQ(static_cast<unsigned char*>(*held->Data())[kMiB - 1], 0x5a);
  EXPECT_TRUE(rig.store->Release(*held).ok());
  EXPECT_TRUE(rig.store->Evict(p0).ok());
}

// Memory another thread's handle holds is waited for, a bounded time, and the error says so.
TEST(PartitionStoreTest, AnAcquireWaitsForAnotherThreadsHandleAndGivesUpAfterTheBound) {
  StoreRig rig(ParseOrDie(OffloadJson("nvme", "nvme")), kBounce + 4 * kMiB);
  const PartitionId a = *rig.store->Register({0, 0, StateKind::kParam}, 4 * kMiB);
  const PartitionId b = *rig.store->Register({0, 1, StateKind::kParam}, 4 * kMiB);
  auto held = std::make_unique<Handle>(std::move(rig.store->Acquire(a).value()));
  std::atomic<bool> done{false};
  Status waited;
  std::thread t([&] {
    waited = rig.store->Acquire(b).status();
    done = true;
  });
  ASSERT_TRUE(Eventually([&] { return rig.store->Stats().memory_waits > 0; }));
  EXPECT_FALSE(done.load());
  held.reset();  // the memory comes back: the waiting Acquire spills it and goes on
  t.join();
  EXPECT_TRUE(waited.ok()) << waited.ToString();

  rig.store->set_memory_wait(std::chrono::milliseconds(200));
  held = std::make_unique<Handle>(std::move(rig.store->Acquire(a).value()));
  std::thread u([&] { waited = rig.store->Acquire(b).status(); });
  u.join();
  EXPECT_EQ(waited.code(), StatusCode::kOverBudget) << waited.ToString();
  EXPECT_TRUE(Has(waited, "waited 200 ms for the 4.00 MiB (4194304 bytes) that other threads hold"))
      << waited.ToString();
  EXPECT_EQ(rig.store->Stats().memory_wait_timeouts, 1u);
  EXPECT_TRUE(rig.store->resident(a));
}

// The last device handle's write-back waits for a flush that holds the partition busy; before, it
// wrote into the host copy under the flush, which then marked the copy clean and lost the write.
TEST(PartitionStoreTest, ReleasingTheLastDeviceHandleWaitsForAFlushInProgress) {
  DeviceRig d(ParseOrDie(OffloadJson("cpu", "cpu")));
  PartitionStore& store = *d.rig.store;
  const uint64_t bytes = 2 * kMiB;
  std::vector<char> v1(bytes), v2(bytes);
  FillRandom(v1.data(), bytes, 11);
  FillRandom(v2.data(), bytes, 12);
  const PartitionId id = *store.Register({0, 0, StateKind::kMasterWeight}, bytes);
  ASSERT_TRUE(store.Evict(id).ok());  // it has an NVMe extent now, so Flush writes it
  {
    auto h = store.Acquire(id);
    std::memcpy(*h->Data(), v1.data(), bytes);
  }
  auto dv = store.Acquire(id, Access::kReadWrite, Placement::kDevice);
  ASSERT_TRUE(dv.ok()) << dv.status().ToString();
  ASSERT_TRUE(d.device->CopyFromHost(*dv->Data(), v2.data(), bytes).ok());
  testing::Gate gate;
  StoreHooks hooks;
  hooks.after_flush_write = [&](uint32_t) { gate.Hit(); };
  store.SetHooksForTesting(&hooks);
  gate.Arm();
  Status flushed, released;
  std::thread flusher([&] { flushed = store.Flush(); });
  gate.WaitHeld();  // v1 is on NVMe; the flush has not marked the partition clean yet
  std::atomic<bool> release_done{false};
  std::thread releaser([&] {
    released = store.Release(*dv);
    release_done = true;
  });
  std::this_thread::sleep_for(std::chrono::milliseconds(200));
  EXPECT_FALSE(release_done.load()) << "the write-back ran under the flush";
  gate.Resume();
  flusher.join();
  releaser.join();
  store.SetHooksForTesting(nullptr);
  EXPECT_TRUE(flushed.ok()) << flushed.ToString();
  EXPECT_TRUE(released.ok()) << released.ToString();
  ASSERT_TRUE(store.Evict(id).ok());
  auto h = store.Acquire(id, Access::kRead);
  ASSERT_TRUE(h.ok()) << h.status().ToString();
  EXPECT_EQ(std::memcmp(*h->Data(), v2.data(), bytes), 0) << "the device view's write was lost";
}

// Flush skips a partition with a live write handle: writing it out would read bytes the handle is
// changing (TSan saw the engine copy a chunk while the handle wrote it). It stays dirty and goes
// out once released.
TEST(PartitionStoreTest, FlushSkipsAPartitionWithALiveWriteHandle) {
  StoreRig rig(ParseOrDie(OffloadJson("cpu", "cpu")), 256 * kMiB);
  PartitionStore& store = *rig.store;
  const uint64_t bytes = 2 * kMiB;
  const PartitionId id = *store.Register({0, 0, StateKind::kMasterWeight}, bytes);
  ASSERT_TRUE(store.Evict(id).ok());
  {
    auto h = store.Acquire(id);
    std::memset(*h->Data(), 1, bytes);
  }
  auto writer = store.Acquire(id);
  ASSERT_TRUE(writer.ok());
  const uint64_t before = store.Stats().flush_writes;
  ASSERT_TRUE(store.Flush().ok());
  EXPECT_EQ(store.Stats().flush_writes, before) << "flushed under a live write handle";
  std::memset(*writer->Data(), 2, bytes);
  ASSERT_TRUE(store.Release(*writer).ok());
  auto reader = store.Acquire(id, Access::kRead);  // a read handle does not stop a flush
  ASSERT_TRUE(store.Flush().ok());
  EXPECT_EQ(store.Stats().flush_writes, before + 1);
  ASSERT_TRUE(store.Release(*reader).ok());
  ASSERT_TRUE(store.Evict(id).ok());
  auto h = store.Acquire(id, Access::kRead);
  ASSERT_TRUE(h.ok());
  EXPECT_EQ(static_cast<unsigned char*>(*h->Data())[bytes - 1], 2) << "the write was lost";
}

// The prefetcher never makes a host copy of a partition whose device view is live.
TEST(PartitionStoreTest, ThePrefetcherLeavesAPartitionWithALiveDeviceViewAlone) {
  DeviceRig d(ParseOrDie(OffloadJson("nvme", "nvme")), /*prefetch_window=*/2);
  PartitionStore& store = *d.rig.store;
  std::vector<PartitionId> ids;
  for (uint32_t g = 0; g < 3; ++g) {
    ids.push_back(*store.Register({0, g, StateKind::kParam}, 2 * kMiB));
    {
      auto h = store.Acquire(ids.back());
      std::memset(*h->Data(), static_cast<int>(g + 1), 2 * kMiB);
    }
    ASSERT_TRUE(store.Evict(ids.back()).ok());
  }
  ASSERT_TRUE(store.SetSchedule(ids).ok());
  store.DrainPrefetch();
  auto dv = store.Acquire(ids[1], Access::kReadWrite, Placement::kDevice);
  ASSERT_TRUE(dv.ok()) << dv.status().ToString();
  store.DrainPrefetch();
  ASSERT_TRUE(store.Evict(ids[2]).ok());
  ASSERT_TRUE(store.Evict(ids[0]).ok());
  {
    auto h = store.Acquire(ids[0]);  // queues ids[1] and ids[2] for prefetch
    ASSERT_TRUE(h.ok());
  }
  store.DrainPrefetch();
  EXPECT_TRUE(store.resident(ids[2]));
  EXPECT_FALSE(store.resident(ids[1])) << "a host copy was made under a live device view";
}

// Two threads filling device views through the store's one pipeline: the store serialises them
// (the pipeline refuses a second driver).
TEST(PartitionStoreTest, TwoThreadsFillingDeviceViewsShareThePipelineInTurn) {
  testing::PausingDevice device;
  DeviceRig d(ParseOrDie(OffloadJson("cpu", "cpu")), 0, &device);
  PartitionStore& store = *d.rig.store;
  const uint64_t bytes = 2 * kMiB;
  std::vector<char> v[2] = {std::vector<char>(bytes), std::vector<char>(bytes)};
  PartitionId ids[2];
  for (uint32_t g = 0; g < 2; ++g) {
    FillRandom(v[g].data(), bytes, 20 + g);
    ids[g] = *store.Register({0, g, StateKind::kMasterWeight}, bytes);
    auto h = store.Acquire(ids[g]);
    std::memcpy(*h->Data(), v[g].data(), bytes);
  }
  device.Arm();
  Result<Handle> first = Status::Internal("not run"), second = Status::Internal("not run");
  std::thread a([&] { first = store.Acquire(ids[0], Access::kRead, Placement::kDevice); });
  device.WaitPaused();  // thread a is inside the pipeline
  std::thread b([&] { second = store.Acquire(ids[1], Access::kRead, Placement::kDevice); });
  std::this_thread::sleep_for(std::chrono::milliseconds(100));
  device.Resume();
  a.join();
  b.join();
  ASSERT_TRUE(first.ok()) << first.status().ToString();
  ASSERT_TRUE(second.ok()) << second.status().ToString();
  EXPECT_EQ(d.ReadDevice(*first), v[0]);
  EXPECT_EQ(d.ReadDevice(*second), v[1]);
}

// A handle that outlives its store: fatal, naming the partition, in debug builds; harmless in
// release builds.
TEST(PartitionStoreTest, AHandleThatOutlivesItsStore) {
#ifndef NDEBUG
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  EXPECT_DEATH(
      {
        StoreRig rig(ParseOrDie(OffloadJson("cpu", "cpu")), 256 * kMiB);
        const PartitionId id = *rig.store->Register({0, 0, StateKind::kGrad}, kMiB);
        Handle h = std::move(rig.store->Acquire(id).value());
        rig.store.reset();
      },
      "Handle of partition 0 outlived its PartitionStore");
#else
  StoreRig rig(ParseOrDie(OffloadJson("cpu", "cpu")), 256 * kMiB);
  const PartitionId id = *rig.store->Register({0, 0, StateKind::kGrad}, kMiB);
  Handle h = std::move(rig.store->Acquire(id).value());
  rig.store.reset();
  EXPECT_EQ(h.Data().status().code(), StatusCode::kFailedPrecondition);
  EXPECT_TRUE(Has(h.Data().status(), "outlived its PartitionStore"))
      << h.Data().status().ToString();
  h = Handle();  // releasing it touches nothing
  EXPECT_TRUE(rig.host->Validate().ok());
#endif
}

}  // namespace
}  // namespace spillway::offload
