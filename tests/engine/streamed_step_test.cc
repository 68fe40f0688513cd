// The streamed step on a real partition store (io_uring, O_DIRECT swap file, CRC32C): the same
// bits as the in-memory step, under a host budget smaller than the optimizer state, and with
// read and write faults that lose nothing.
#include "spillway/engine/streamed_step.h"

#include <gtest/gtest.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "../offload/store_test_util.h"
#include "optimizer_test_util.h"
#include "spillway/allocator/io_faults.h"
#include "spillway/base/bytes.h"

namespace spillway::engine {
namespace {

using offload::Access;
using offload::PartitionKey;
using offload::StateKind;
using offload::testing::OffloadJson;
using offload::testing::ParseOrDie;
using offload::testing::StoreRig;
using testing::GroupBuffers;

constexpr int kGroups = 6;
constexpr uint64_t kNumel = (1ull << 18) + 37;  // ~1 MiB per state, not a multiple of the block

struct Model {
  std::vector<GroupBuffers> ref;   // the in-memory twin, stepped by HostOptimizer::Step
  std::vector<GroupBuffers> host;  // gradients and parameter copies for the streamed run
  std::vector<StreamedGroup> groups;
};

// Registers master/exp_avg/exp_avg_sq per group (NVMe-homed under this config) and fills them
// with the same initial state as the in-memory twin.
Model MakeModel(offload::PartitionStore& store) {
  Model m;
  for (int i = 0; i < kGroups; ++i) {
    m.ref.emplace_back(kNumel + i, DType::kBf16, DType::kBf16, true, 100 + i);
    m.host.emplace_back(kNumel + i, DType::kBf16, DType::kBf16, true, 100 + i);
  }
  for (int i = 0; i < kGroups; ++i) {
    StreamedGroup g;
    g.name = StrCat("group ", i);
    g.numel = m.host[i].numel;
    const uint64_t bytes = g.numel * 4;
    g.master =
        *store.Register(PartitionKey{0, static_cast<uint32_t>(i), StateKind::kMasterWeight}, bytes);
    g.exp_avg =
        *store.Register(PartitionKey{0, static_cast<uint32_t>(i), StateKind::kExpAvg}, bytes);
    g.exp_avg_sq =
        *store.Register(PartitionKey{0, static_cast<uint32_t>(i), StateKind::kExpAvgSq}, bytes);
    auto h = store.Acquire(g.master, Access::kReadWrite);
    EXPECT_TRUE(h.ok()) << h.status().ToString();
    std::memcpy(*h->Data(), m.host[i].master.data(), bytes);
    EXPECT_TRUE(store.Release(*h).ok());
    EXPECT_TRUE(store.Evict(g.master).ok());
    g.grad = m.host[i].grad.data();
    g.grad_dtype = DType::kBf16;
    g.param = m.host[i].param.data();
    g.param_dtype = DType::kBf16;
    m.groups.push_back(g);
  }
  return m;
}

std::unique_ptr<HostOptimizer> Optimizer() {
  HostOptimizerOptions o;
  o.threads = 2;
  return std::move(HostOptimizer::Create(o).value());
}

void NewGradients(Model& m, uint64_t step) {
  for (int i = 0; i < kGroups; ++i) {
    m.ref[i].FillGrad(step * 100 + i, 1.0f);
    m.host[i].FillGrad(step * 100 + i, 1.0f);
  }
}

Status RefStep(HostOptimizer& opt, Model& m) {
  std::vector<SubGroup> views;
  for (auto& b : m.ref) views.push_back(b.View());
  auto r = opt.Step(views);
  return r.ok() ? Status::Ok() : r.status();
}

// Reads group i's state back from the store (swapping it in, CRC-checked) into `out`.
void ReadBack(offload::PartitionStore& store, const StreamedGroup& g, GroupBuffers& out) {
  const offload::PartitionId ids[3] = {g.master, g.exp_avg, g.exp_avg_sq};
  float* dst[3] = {out.master.data(), out.exp_avg.data(), out.exp_avg_sq.data()};
  for (int k = 0; k < 3; ++k) {
    auto h = store.Acquire(ids[k], Access::kRead);
    ASSERT_TRUE(h.ok()) << h.status().ToString();
    std::memcpy(dst[k], *h->Data(), g.numel * 4);
    ASSERT_TRUE(store.Release(*h).ok());
  }
}

bool SameAs(offload::PartitionStore& store, const Model& m, int i, const GroupBuffers& want) {
  GroupBuffers got = want;
  ReadBack(store, m.groups[i], got);
  got.param = m.host[i].param;
  return got.SameState(want);
}

TEST(StreamedStepTest, StreamingFromNvmeGivesTheSameBitsAsTheInMemoryStep) {
  StoreRig rig(ParseOrDie(OffloadJson("none", "nvme")), 512 * kMiB);
  ASSERT_NE(rig.store, nullptr);
  Model m = MakeModel(*rig.store);
  auto streamed = Optimizer(), in_memory = Optimizer();
  for (uint64_t step = 1; step <= 3; ++step) {
    NewGradients(m, step);
    ASSERT_TRUE(RefStep(*in_memory, m).ok());
    StreamedStepStats stats;
    auto r = StreamedStep(*streamed, *rig.store, m.groups, {}, &stats);
    ASSERT_TRUE(r.ok()) << r.status().ToString();
    EXPECT_EQ(r->step, step);
    EXPECT_EQ(stats.groups, static_cast<uint64_t>(kGroups));
    EXPECT_EQ(stats.evictions, 3u * kGroups);  // every NVMe-homed state written back
    for (int i = 0; i < kGroups; ++i) EXPECT_FALSE(rig.store->resident(m.groups[i].master));
  }
  for (int i = 0; i < kGroups; ++i) {
    EXPECT_TRUE(SameAs(*rig.store, m, i, m.ref[i])) << "group " << i;
    EXPECT_EQ(m.host[i].param, m.ref[i].param) << "group " << i;
  }
}

TEST(StreamedStepTest, AHostBudgetSmallerThanTheStateIsEnough) {
  // 6 groups x 3 states x ~1 MiB = ~18 MiB of state; the host gets the bounce pool plus room for
  // four groups (three in flight and slack for the arena's page rounding).
  const uint64_t budget = 8 * kMiB + 4 * 3 * (kNumel * 4 + 64 * 1024);
  ASSERT_LT(budget, 8 * kMiB + kGroups * 3 * kNumel * 4);  // the whole state does not fit
  StoreRig rig(ParseOrDie(OffloadJson("none", "nvme")), budget);
  ASSERT_NE(rig.store, nullptr);
  Model m = MakeModel(*rig.store);
  auto streamed = Optimizer(), in_memory = Optimizer();
  for (uint64_t step = 1; step <= 2; ++step) {
    NewGradients(m, step);
    ASSERT_TRUE(RefStep(*in_memory, m).ok());
    auto r = StreamedStep(*streamed, *rig.store, m.groups);
    ASSERT_TRUE(r.ok()) << r.status().ToString();
  }
  EXPECT_LE(rig.host->Stats().peak_live_bytes, budget);
  for (int i = 0; i < kGroups; ++i) EXPECT_TRUE(SameAs(*rig.store, m, i, m.ref[i])) << i;
}

// A store with a fault seam, the model, and step 1 applied both ways.
struct FaultRig {
  allocator::IoFaults faults;
  StoreRig rig{ParseOrDie(OffloadJson("none", "nvme")), 512 * kMiB, true, &faults};
  Model m = MakeModel(*rig.store);
  std::unique_ptr<HostOptimizer> streamed = Optimizer(), in_memory = Optimizer();
  Status StepOne() {
    NewGradients(m, 1);
    SPILLWAY_RETURN_IF_ERROR(RefStep(*in_memory, m));
    auto r = StreamedStep(*streamed, *rig.store, m.groups);
    return r.ok() ? Status::Ok() : r.status();
  }
  // Step 2's gradients, and the in-memory twin stepped; returns the state after step 1.
  std::vector<GroupBuffers> PrepareStepTwo() {
    std::vector<GroupBuffers> after_step1 = m.ref;
    NewGradients(m, 2);
    EXPECT_TRUE(RefStep(*in_memory, m).ok());
    return after_step1;
  }
};

TEST(StreamedStepTest, AFailedReadStopsBeforeTheGroupAndLosesNothing) {
  FaultRig f;
  ASSERT_TRUE(f.StepOne().ok());
  auto& [faults, rig, m, streamed, in_memory] = f;
  // Step 2: the first read fails with EIO. Which group's read comes first is up to the threads
  // (group 0's swap-in on the caller or group 1's on the reader), so the test reads the group the
  // error names and checks the promise about it: groups before it have step 2, the rest step 1.
  const std::vector<GroupBuffers> after_step1 = f.PrepareStepTwo();
  faults.read_errno = EIO;
  auto r = StreamedStep(*streamed, *rig.store, m.groups);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), StatusCode::kIoError) << r.status().ToString();
  const std::string msg = r.status().message();
  const size_t at = msg.find("stopped at group ");
  ASSERT_NE(at, std::string::npos) << msg;
  const int stopped = std::atoi(msg.c_str() + at + std::strlen("stopped at group "));
  ASSERT_GE(stopped, 0);
  ASSERT_LT(stopped, 2) << msg;  // the first read belongs to group 0 or group 1
  EXPECT_NE(msg.find("this one and those after it do not"), std::string::npos);
  // Every group holds exactly what the message says, checksums intact, nothing half-updated.
  faults.read_errno = 0;
  for (int i = 0; i < kGroups; ++i) {
    EXPECT_TRUE(SameAs(*rig.store, m, i, i < stopped ? m.ref[i] : after_step1[i])) << i;
  }
}

TEST(StreamedStepTest, AFailedWriteBackKeepsTheUpdateInHostMemoryUntilFlush) {
  FaultRig f;
  ASSERT_TRUE(f.StepOne().ok());
  auto& [faults, rig, m, streamed, in_memory] = f;
  const std::vector<GroupBuffers> after_step1 = f.PrepareStepTwo();
  // The first write of step 2 is group 0's write-back; it fails once.
  faults.write_errno = EIO;
  auto r = StreamedStep(*streamed, *rig.store, m.groups);
  ASSERT_FALSE(r.ok());
  const std::string msg = r.status().message();
  EXPECT_NE(msg.find("groups 0..1 have the step applied"), std::string::npos) << msg;
  EXPECT_NE(msg.find("nothing lost"), std::string::npos) << msg;
  EXPECT_TRUE(rig.store->resident(m.groups[0].master));  // the host copy was kept
  // Flush retries the write; then every group reads back as the message said.
  ASSERT_TRUE(rig.store->Flush().ok());
  for (int i = 0; i < kGroups; ++i) {
    ASSERT_TRUE(rig.store->Evict(m.groups[i].master).ok());
    ASSERT_TRUE(rig.store->Evict(m.groups[i].exp_avg).ok());
    ASSERT_TRUE(rig.store->Evict(m.groups[i].exp_avg_sq).ok());
    EXPECT_TRUE(SameAs(*rig.store, m, i, i <= 1 ? m.ref[i] : after_step1[i])) << "group " << i;
  }
}

TEST(StreamedStepTest, AThreadThatCannotStartIsAStatusAndLosesNothing) {
  FaultRig f;
  ASSERT_TRUE(f.StepOne().ok());
  auto& [faults, rig, m, streamed, in_memory] = f;
  const std::vector<GroupBuffers> after_step1 = f.PrepareStepTwo();
  FailThreadLaunchesForTesting(1);  // the reader for group 1, started before group 0's update
  auto r = StreamedStep(*streamed, *rig.store, m.groups);
  FailThreadLaunchesForTesting(0);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), StatusCode::kUnavailable) << r.status().ToString();
  const std::string msg = r.status().message();
  EXPECT_NE(msg.find("cannot start the streamed step's reader thread"), std::string::npos) << msg;
  EXPECT_NE(msg.find("stopped at group 0"), std::string::npos) << msg;
  for (int i = 0; i < kGroups; ++i) EXPECT_TRUE(SameAs(*rig.store, m, i, after_step1[i])) << i;
}

TEST(StreamedStepTest, AGroupThatDoesNotMatchItsPartitionsIsRefusedBeforeAnythingMoves) {
  StoreRig rig(ParseOrDie(OffloadJson("none", "nvme")), 512 * kMiB);
  ASSERT_NE(rig.store, nullptr);
  Model m = MakeModel(*rig.store);
  auto opt = Optimizer();
  std::vector<StreamedGroup> bad = m.groups;
  bad[3].numel += 1;
  auto r = StreamedStep(*opt, *rig.store, bad);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(r.status().message().find("group 3 (group 3): partition"), std::string::npos)
      << r.status().message();
  bad = m.groups;
  bad[1].exp_avg = 999;
  r = StreamedStep(*opt, *rig.store, bad);
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find("is not registered"), std::string::npos);
  EXPECT_EQ(opt->step(), 0u);  // no step number was consumed
}

}  // namespace
}  // namespace spillway::engine
