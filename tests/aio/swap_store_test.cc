// SwapStore (aio/): DeepSpeed's swap files as extents of one NvmeArena on a real swap folder. Files
// read back exactly; a rewrite with another size remakes the extent; prefixes list and remove;
// every refusal names the path and leaves the other files intact; a flipped byte on disk is a
// checksum error; the budget holds. Note [DeepSpeed swap] in docs/deepspeed.md.
#include "spillway/aio/swap_store.h"

#include <gtest/gtest.h>

#include <memory>
#include <string>
#include <vector>

#include "../allocator/nvme_test_util.h"
#include "spillway/base/bytes.h"

namespace spillway::aio {
namespace {

using allocator::Kind;
using allocator::testing::FillRandom;
using allocator::testing::MakeArena;
using allocator::testing::NvmeTestDir;
using allocator::testing::PageableOptions;

class SwapStoreTest : public ::testing::Test {
 protected:
  void SetUp() override {
    auto o = PageableOptions(&ledger_);
    o.budget_bytes = 64 * kMiB;
    host_ = MakeArena(o);
    allocator::IoEngineOptions eo;
    eo.arena = host_.get();
    eo.block_size = 64 * 1024;
    auto engine = allocator::IoEngine::Create(eo);
    ASSERT_TRUE(engine.ok()) << engine.status().ToString();
    engine_ = std::move(*engine);
  }
  void TearDown() override {
    engine_.reset();  // before the arena its bounce buffers come from
    host_.reset();
  }
  std::unique_ptr<SwapStore> Make(uint64_t budget = 0) {
    SwapStoreOptions o;
    o.directory = NvmeTestDir();
    o.budget_bytes = budget;
    o.engine = engine_;
    o.ledger = &ledger_;
    auto s = SwapStore::Create(o);
    EXPECT_TRUE(s.ok()) << s.status().ToString();
    return s.ok() ? std::move(*s) : nullptr;
  }
  static std::vector<char> Random(size_t n, uint64_t seed) {
    std::vector<char> v(n);
    FillRandom(v.data(), n, seed);
    return v;
  }

  allocator::Ledger ledger_;
  std::unique_ptr<allocator::HostArena> host_;
  std::shared_ptr<allocator::IoEngine> engine_;
};

TEST_F(SwapStoreTest, FilesReadBackExactly) {
  auto s = Make();
  ASSERT_NE(s, nullptr);
  const auto a = Random(300001, 1), b = Random(4096, 2);
  ASSERT_TRUE(
      s->Write("/swap/zero_stage_3/a.tensor.swp", a.data(), a.size(), Kind::kOptimizerState).ok());
  ASSERT_TRUE(s->Write("/swap/zero_stage_3/b.tensor.swp", b.data(), b.size(), Kind::kParam).ok());
  std::vector<char> in(a.size());
  ASSERT_TRUE(s->Read("/swap/zero_stage_3/a.tensor.swp", in.data(), in.size()).ok());
  EXPECT_EQ(in, a);
  EXPECT_TRUE(s->Contains("/swap/zero_stage_3/b.tensor.swp"));
  EXPECT_EQ(s->Size("/swap/zero_stage_3/a.tensor.swp"), 300001);
  EXPECT_EQ(s->Size("/swap/nothing"), -1);
  EXPECT_EQ(s->files(), 2u);
  const allocator::NvmeArenaStats st = s->arena().Stats();
  EXPECT_EQ(st.requested_bytes, 300001u + 4096u);  // live_bytes is granule-rounded
  EXPECT_GE(st.live_by_kind[static_cast<int>(Kind::kOptimizerState)], 300001u);
  EXPECT_EQ(st.live_by_kind[static_cast<int>(Kind::kParam)], 4096u);
  EXPECT_EQ(s->arena().tier_name(), "deepspeed-swap:" + NvmeTestDir());
}

TEST_F(SwapStoreTest, ARewriteWithAnotherSizeRemakesTheExtent) {
  auto s = Make();
  ASSERT_NE(s, nullptr);
  const auto a = Random(8192, 3), b = Random(100, 4);
  ASSERT_TRUE(s->Write("p", a.data(), a.size(), Kind::kParam).ok());
  ASSERT_TRUE(s->Write("p", b.data(), b.size(), Kind::kParam).ok());
  EXPECT_EQ(s->Size("p"), 100);
  EXPECT_EQ(s->arena().Stats().requested_bytes, 100u);
  std::vector<char> in(100);
  ASSERT_TRUE(s->Read("p", in.data(), in.size()).ok());
  EXPECT_EQ(in, b);
}

TEST_F(SwapStoreTest, PrefixesListAndRemove) {
  auto s = Make();
  ASSERT_NE(s, nullptr);
  const auto v = Random(512, 5);
  for (const char* p : {"/d/2", "/d/1", "/e/1"}) {
    ASSERT_TRUE(s->Write(p, v.data(), v.size(), Kind::kParam).ok());
  }
  EXPECT_EQ(s->Paths("/d/"), (std::vector<std::string>{"/d/1", "/d/2"}));
  auto removed = s->Remove("/d/");
  ASSERT_TRUE(removed.ok());
  EXPECT_EQ(*removed, 2u);
  EXPECT_EQ(s->Paths(""), (std::vector<std::string>{"/e/1"}));
  EXPECT_EQ(s->arena().Stats().requested_bytes, 512u);
}

TEST_F(SwapStoreTest, RefusalsNameThePathAndLeaveTheOtherFiles) {
  auto s = Make();
  ASSERT_NE(s, nullptr);
  const auto v = Random(4096, 6);
  ASSERT_TRUE(s->Write("kept", v.data(), v.size(), Kind::kParam).ok());
  std::vector<char> in(4096);
  const Status missing = s->Read("never", in.data(), in.size());
  EXPECT_EQ(missing.code(), StatusCode::kFailedPrecondition);
  EXPECT_NE(missing.ToString().find("DeepSpeed swap file never"), std::string::npos);
  const Status prefix = s->Read("kept", in.data(), 100);
  EXPECT_EQ(prefix.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(prefix.ToString().find("fast_init"), std::string::npos);
  ASSERT_TRUE(s->Read("kept", in.data(), in.size()).ok());
  EXPECT_EQ(in, v);
  SwapStoreOptions none;
  none.directory = NvmeTestDir();
  EXPECT_EQ(SwapStore::Create(none).status().code(), StatusCode::kInvalidArgument);
  none.engine = engine_;
  none.ledger = &ledger_;
  none.directory = "/no/such/swap/folder";
  EXPECT_EQ(SwapStore::Create(none).status().code(), StatusCode::kIoError);
}

TEST_F(SwapStoreTest, TheBudgetHoldsAndNamesTheKnob) {
  auto s = Make(1 * kMiB);
  ASSERT_NE(s, nullptr);
  const auto big = Random(768 * 1024, 7);
  ASSERT_TRUE(s->Write("a", big.data(), big.size(), Kind::kParam).ok());
  const Status over = s->Write("b", big.data(), big.size(), Kind::kParam);
  EXPECT_FALSE(over.ok());
  EXPECT_NE(over.ToString().find("SPILLWAY_NVME_BUDGET_BYTES"), std::string::npos);
  EXPECT_FALSE(s->Contains("b"));
  std::vector<char> in(big.size());
  ASSERT_TRUE(s->Read("a", in.data(), in.size()).ok());
  EXPECT_EQ(in, big);
}

TEST_F(SwapStoreTest, AFlippedByteOnDiskIsAChecksumError) {
  auto s = Make();
  ASSERT_NE(s, nullptr);
  const auto v = Random(65536, 8);
  ASSERT_TRUE(s->Write("c", v.data(), v.size(), Kind::kOptimizerState).ok());
  ASSERT_TRUE(s->CorruptForTesting("c", 777).ok());
  std::vector<char> in(v.size());
  EXPECT_EQ(s->Read("c", in.data(), in.size()).code(), StatusCode::kChecksumMismatch);
  EXPECT_EQ(s->CorruptForTesting("c", 65536).code(), StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace spillway::aio
