// spillway::torch_alloc on real libtorch: tensors over an arena (exact sizes, every error), tag
// scopes, installing torch's two host allocators (routing by tag, the pinned allocator's deferred
// free, a forked child's own arena) and every refusal of Install. Each installing test runs in a
// process of its own (a death test that exits 0): an installation is once per process.
#include <ATen/core/CachingHostAllocator.h>
#include <c10/core/CPUAllocator.h>
#include <gtest/gtest.h>
#include <sys/wait.h>
#include <torch/torch.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <memory>
#include <string>

#include "spillway/torch_alloc/blocks.h"
#include "spillway/torch_alloc/cpu_router.h"
#include "spillway/torch_alloc/installation.h"
#include "spillway/torch_alloc/pinned_allocator.h"
#include "spillway/torch_alloc/tag_scope.h"
#include "spillway/torch_alloc/tensors.h"

namespace spillway::torch_alloc {
namespace {

const allocator::OwnerTag kTag{allocator::Kind::kOptimizerState, allocator::Lifetime::kPersistent,
                               3, allocator::kProcessScope, "test"};

std::shared_ptr<SharedArena> MakeArena(const char* name, uint64_t budget = 0,
                                       const std::shared_ptr<SharedArena>& share = nullptr) {
  SharedArenaOptions o;
  o.name = name;
  o.budget_bytes = budget;
  o.pin = allocator::PinMode::kPageable;
  auto a = SharedArena::Create(o, share);
  if (!a.ok()) {
    std::fprintf(stderr, "making arena %s: %s\n", name, a.status().ToString().c_str());
    std::abort();
  }
  return *a;
}

// In an installing test's own process: a failed expectation there ends it with a message.
#define REQUIRE(cond)                                                                 \
  do {                                                                                \
    if (!(cond)) {                                                                    \
      std::fprintf(stderr, "%s:%d: REQUIRE(%s) failed\n", __FILE__, __LINE__, #cond); \
      std::_Exit(1);                                                                  \
    }                                                                                 \
  } while (0)

bool Mentions(const Status& st, const char* text) {
  return st.ToString().find(text) != std::string::npos;
}

// Another CPU allocator, registered above Spillway's priority.
struct ForwardingAllocator final : c10::Allocator {
  c10::DataPtr allocate(size_t n) override { return c10::GetDefaultCPUAllocator()->allocate(n); }
  void copy_data(void* dest, const void* src, std::size_t count) const override {
    default_copy_data(dest, src, count);
  }
};

// Another pinned host allocator, registered above Spillway's priority.
struct OtherHostAllocator final : at::HostAllocator {
  c10::DataPtr allocate(size_t n) override { return c10::GetDefaultCPUAllocator()->allocate(n); }
  void copy_data(void* dest, const void* src, std::size_t count) const override {
    default_copy_data(dest, src, count);
  }
  bool record_event(void*, void*, c10::Stream) override { return false; }
  void empty_cache() override {}
  at::HostStats get_stats() override { return {}; }
  void reset_accumulated_stats() override {}
  void reset_peak_stats() override {}
};

class TorchAllocDeathTest : public ::testing::Test {
 protected:
  void SetUp() override { GTEST_FLAG_SET(death_test_style, "threadsafe"); }
};

TEST(TorchAllocTensors, EmptyTensorIsExactSizeAndBookedUnderItsTag) {
  auto arena = MakeArena("tensors");
  auto t = EmptyTensor(arena, {3, 333}, at::kBFloat16, kTag);
  ASSERT_TRUE(t.ok()) << t.status().ToString();
  EXPECT_EQ(t->sizes(), (std::vector<int64_t>{3, 333}));
  EXPECT_EQ(t->scalar_type(), at::kBFloat16);
  const allocator::HostArenaStats s = arena->get()->Stats();
  EXPECT_EQ(s.requested_bytes, 3u * 333 * 2);
  EXPECT_EQ(s.live_by_kind[static_cast<int>(allocator::Kind::kOptimizerState)], s.live_bytes);
  EXPECT_TRUE(ArenaOwns(*arena, *t));
  EXPECT_FALSE(ArenaOwns(*arena, torch::zeros({4})));
  std::weak_ptr<SharedArena> weak = arena;
  arena.reset();
  EXPECT_FALSE(weak.expired()) << "the tensor keeps its arena alive";
  t->fill_(1.0);
  *t = at::Tensor();
  EXPECT_TRUE(weak.expired());
}

TEST(TorchAllocTensors, EmptyTensorRefusesBadShapesAndOverBudget) {
  auto arena = MakeArena("tensors", 1 << 20);
  auto neg = EmptyTensor(arena, {4, -1}, at::kFloat, kTag);
  EXPECT_EQ(neg.status().code(), StatusCode::kInvalidArgument);
  EXPECT_TRUE(Mentions(neg.status(), "negative dimension -1"));
  auto huge = EmptyTensor(arena, {int64_t{1} << 40, int64_t{1} << 40}, at::kFloat, kTag);
  EXPECT_EQ(huge.status().code(), StatusCode::kInvalidArgument);
  EXPECT_TRUE(Mentions(huge.status(), "overflows 64 bits"));
  auto bytes = EmptyTensor(arena, {int64_t{1} << 62}, at::kDouble, kTag);
  EXPECT_TRUE(Mentions(bytes.status(), "size in bytes overflows"));
  auto over = EmptyTensor(arena, {1 << 20}, at::kFloat, kTag);
  EXPECT_EQ(over.status().code(), StatusCode::kOverBudget);
  EXPECT_EQ(arena->get()->Stats().requested_bytes, 0u) << "a refusal leaves the arena as it was";
}

TEST(TorchAllocTensors, TransientTensorFreesOnTheLastReference) {
  auto arena = MakeArena("transient");
  {
    auto t = TransientTensor(arena->get(), 1001, kTag);
    ASSERT_TRUE(t.ok()) << t.status().ToString();
    EXPECT_EQ(arena->get()->Stats().requested_bytes, 4004u);
    at::Tensor view = t->narrow(0, 0, 10);
    *t = at::Tensor();
    EXPECT_EQ(arena->get()->Stats().requested_bytes, 4004u) << "a view keeps the storage";
  }
  EXPECT_EQ(arena->get()->Stats().requested_bytes, 0u);
  EXPECT_EQ(TransientTensor(arena->get(), -1, kTag).status().code(), StatusCode::kInvalidArgument);
}

TEST(TorchAllocTensors, ArenaTensorsWaitForTheirEvents) {
  auto arena = MakeArena("events");
  Blocks& blocks = Blocks::ForThisProcess();
  blocks.traits().SetManual(true);
  auto t = EmptyTensor(arena, {1024}, at::kFloat, kTag);
  ASSERT_TRUE(t.ok());
  const c10::DataPtr& d = t->storage().data_ptr();
  ASSERT_TRUE(
      blocks.Record(d.get_context(), c10::Stream(c10::Stream::DEFAULT, c10::Device("cpu"))));
  *t = at::Tensor();
  EXPECT_EQ(arena->get()->Stats().requested_bytes, 4096u);
  blocks.Poll();
  EXPECT_EQ(arena->get()->Stats().requested_bytes, 4096u);
  blocks.traits().CompleteManual();
  EXPECT_EQ(blocks.Poll(), 1u);
  EXPECT_EQ(arena->get()->Stats().requested_bytes, 0u);
  blocks.traits().SetManual(false);
}

TEST(TorchAllocTags, ScopesNestAndRefuseTheWrongExit) {
  EXPECT_EQ(CurrentTag(), nullptr);
  auto bad = EnterTag("not_a_kind", "step", 0);
  EXPECT_EQ(bad.status().code(), StatusCode::kInvalidArgument);
  auto outer = EnterTag("optimizer_state", "persistent", 1);
  ASSERT_TRUE(outer.ok()) << outer.status().ToString();
  auto inner = EnterTag("param", "step", 2);
  ASSERT_TRUE(inner.ok());
  EXPECT_EQ(CurrentTag()->label, "param/step");
  const Status wrong = ExitTag(*outer);
  EXPECT_EQ(wrong.code(), StatusCode::kFailedPrecondition);
  EXPECT_TRUE(Mentions(wrong, "while spillway.tag('param/step'), entered after it, is still open"));
  EXPECT_EQ(CurrentTag(), inner->get()) << "a refused exit changes nothing";
  EXPECT_TRUE(ExitTag(*inner).ok());
  EXPECT_TRUE(ExitTag(*outer).ok());
  EXPECT_EQ(CurrentTag(), nullptr);
  EXPECT_EQ(g_open_scopes.load(), 0);
  const Status none = ExitTag(*outer);
  EXPECT_TRUE(Mentions(none, "while no tag scope is open on this thread"));
}

TEST_F(TorchAllocDeathTest, InstalledRouterServesTaggedTensorsFromTheArenaExactly) {
  EXPECT_EXIT(
      {
        auto host = MakeArena("host");
        auto pinned = MakeArena("pinned", 0, host);
        c10::Allocator* before = c10::GetCPUAllocator();
        REQUIRE(Installation::Install(host, pinned, 4096, 100).ok());
        REQUIRE(Installation::Installed());
        REQUIRE(Installation::TorchAllocatorsAreOurs().cpu);
        REQUIRE(Installation::TorchAllocatorsAreOurs().pinned);
        REQUIRE(c10::GetCPUAllocator() != before);
        at::Tensor untagged = torch::empty({100000});
        REQUIRE(host->get()->Stats().requested_bytes == 0);
        {
          auto scope = EnterTag("optimizer_state", "persistent", 0);
          REQUIRE(scope.ok());
          at::Tensor small = torch::empty({10});  // under small_bytes: torch's allocator
          at::Tensor t = torch::empty({12345}, torch::kFloat32);
          REQUIRE(host->get()->Stats().requested_bytes == 12345u * 4);
          REQUIRE(host->get()->Stats().live_by_kind[static_cast<int>(
                      allocator::Kind::kOptimizerState)] == host->get()->Stats().live_bytes);
          const RouterStats& rs = Installation::Get()->router().stats();
          REQUIRE(rs.routed_allocations.load() == 1);
          REQUIRE(rs.small_forwarded.load() == 1);
          REQUIRE(ExitTag(*scope).ok());
        }
        REQUIRE(host->get()->Stats().requested_bytes == 0);
        std::exit(0);
      },
      ::testing::ExitedWithCode(0), "");
}

TEST_F(TorchAllocDeathTest, PinnedAllocatorDefersTheFreeUntilTheEventCompletes) {
  EXPECT_EXIT(
      {
        auto host = MakeArena("host");
        auto pinned = MakeArena("pinned", 0, host);
        REQUIRE(Installation::Install(host, pinned, 1, 100).ok());
        at::HostAllocator* a = at::getHostAllocator(at::kCUDA);
        REQUIRE(a == &Installation::Get()->pinned());
        Blocks::ForThisProcess().traits().SetManual(true);
        at::Tensor t = TensorOver(a->allocate(1000001), 1000001, a);
        REQUIRE(pinned->get()->Stats().requested_bytes == 1000001);
        const c10::DataPtr& d = t.storage().data_ptr();
        REQUIRE(a->record_event(d.get(), d.get_context(),
                                c10::Stream(c10::Stream::DEFAULT, c10::Device("cpu"))));
        t = at::Tensor();
        REQUIRE(pinned->get()->Stats().requested_bytes == 1000001);
        REQUIRE(a->get_stats().allocations.current == 1);
        Blocks::ForThisProcess().traits().CompleteManual();
        a->empty_cache();  // polls
        REQUIRE(pinned->get()->Stats().requested_bytes == 0);
        std::exit(0);
      },
      ::testing::ExitedWithCode(0), "");
}

TEST_F(TorchAllocDeathTest, AForkedChildAllocatesTaggedTensorsFromItsOwnArena) {
  EXPECT_EXIT(
      {
        auto host = MakeArena("host");
        auto pinned = MakeArena("pinned", 0, host);
        REQUIRE(Installation::Install(host, pinned, 1, 100).ok());
        const pid_t pid = fork();
        REQUIRE(pid >= 0);
        if (pid == 0) {
          REQUIRE(Installation::Forked());
          REQUIRE(!CpuRouter::ChildStats().has_value());
          auto scope = EnterTag("optimizer_state", "persistent", 0);
          {
            at::Tensor t = torch::empty({2000});
            REQUIRE(CpuRouter::ChildStats().has_value());
            REQUIRE(CpuRouter::ChildStats()->requested_bytes == 8000);
          }
          REQUIRE(CpuRouter::ChildStats()->requested_bytes == 0);
          bool refused = false;
          try {
            at::getHostAllocator(at::kCUDA)->allocate(64);
          } catch (const c10::Error& e) {
            refused =
                std::string(e.what()).find("forked after spillway.install()") != std::string::npos;
          }
          REQUIRE(refused);
          const Status in_child = Installation::Install(host, pinned, 1, 100);
          REQUIRE(in_child.code() == StatusCode::kFailedPrecondition);
          REQUIRE(Mentions(in_child, "install in the parent"));
          std::_Exit(0);
        }
        int status = 0;
        REQUIRE(waitpid(pid, &status, 0) == pid);
        REQUIRE(WIFEXITED(status) && WEXITSTATUS(status) == 0);
        REQUIRE(!Installation::Forked());
        REQUIRE(host->get()->Stats().requested_bytes == 0);
        std::exit(0);
      },
      ::testing::ExitedWithCode(0), "");
}

TEST_F(TorchAllocDeathTest, InstallRefusesBadArgumentsAndInstallsNothing) {
  EXPECT_EXIT(
      {
        auto host = MakeArena("host");
        auto pinned = MakeArena("pinned", 0, host);
        c10::Allocator* before = c10::GetCPUAllocator();
        const Status p0 = Installation::Install(host, pinned, 1, 0);
        REQUIRE(p0.code() == StatusCode::kInvalidArgument && Mentions(p0, "must be 1..255"));
        REQUIRE(Installation::Install(host, pinned, 1, 256).code() == StatusCode::kInvalidArgument);
        const Status small = Installation::Install(host, pinned, 0, 100);
        REQUIRE(Mentions(small, "small_bytes=0"));
        const Status null = Installation::Install(host, nullptr, 1, 100);
        REQUIRE(null.code() == StatusCode::kInvalidArgument);
        REQUIRE(Installation::Get() == nullptr);
        REQUIRE(c10::GetCPUAllocator() == before);
        REQUIRE(Installation::Install(host, pinned, 1, 100).ok());
        const Status twice = Installation::Install(host, pinned, 1, 100);
        REQUIRE(twice.code() == StatusCode::kFailedPrecondition && Mentions(twice, "already ran"));
        std::exit(0);
      },
      ::testing::ExitedWithCode(0), "");
}

TEST_F(TorchAllocDeathTest, InstallBelowAnotherAllocatorsPriorityNamesIt) {
  EXPECT_EXIT(
      {
        auto host = MakeArena("host");
        auto pinned = MakeArena("pinned", 0, host);
        static ForwardingAllocator other;
        c10::SetCPUAllocator(&other, 200);
        const Status kept = Installation::Install(host, pinned, 1, 100);
        REQUIRE(kept.code() == StatusCode::kFailedPrecondition);
        REQUIRE(Mentions(kept, "torch kept its CPU allocator"));
        REQUIRE(Mentions(kept, "priority above 100"));
        REQUIRE(!Installation::Installed());
        REQUIRE(c10::GetCPUAllocator() == &other);
        const Status again = Installation::Install(host, pinned, 1, 255);
        REQUIRE(Mentions(again, "an earlier spillway.install() in this process failed"));
        std::exit(0);
      },
      ::testing::ExitedWithCode(0), "");
}

// The pinned registration is refused after the CPU one took: the CPU allocator is put back, so
// nothing is left installed.
TEST_F(TorchAllocDeathTest, APinnedAllocatorAboveOursLeavesNothingInstalled) {
  EXPECT_EXIT(
      {
        auto host = MakeArena("host");
        auto pinned = MakeArena("pinned", 0, host);
        static OtherHostAllocator other;
        at::setHostAllocator(at::kCUDA, &other, 200);
        c10::Allocator* before = c10::GetCPUAllocator();
        const Status kept = Installation::Install(host, pinned, 1, 100);
        REQUIRE(kept.code() == StatusCode::kFailedPrecondition);
        REQUIRE(Mentions(kept, "torch kept its pinned host allocator"));
        REQUIRE(!Installation::Installed());
        REQUIRE(c10::GetCPUAllocator() == before);
        REQUIRE(at::getHostAllocator(at::kCUDA) == &other);
        std::exit(0);
      },
      ::testing::ExitedWithCode(0), "");
}

}  // namespace
}  // namespace spillway::torch_alloc
