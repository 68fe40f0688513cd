// Config: a real DeepSpeed ZeRO-3 offload config, the keys accepted but not acted on, and every
// kind of error: bad JSON, unknown spillway key, wrong type, impossible value, missing path.
#include "spillway/offload/config.h"

#include <gtest/gtest.h>

#include <cstdint>
#include <fstream>

namespace spillway::offload {
namespace {

bool Has(const Status& st, const std::string& text) {
  return st.message().find(text) != std::string::npos;
}

constexpr const char* kZero3Nvme = R"({
  "train_micro_batch_size_per_gpu": 1,
  "gradient_accumulation_steps": 4,
  "gradient_clipping": 1.0,
  "optimizer": {"type": "adamw", "params": {"lr": 3e-4, "betas": [0.9, 0.95], "eps": 1e-6,
                                            "weight_decay": 0.1, "torch_adam": false}},
  "bf16": {"enabled": true},
  "zero_optimization": {
    "stage": 3,
    "overlap_comm": true,
    "stage3_gather_16bit_weights_on_model_save": true,
    "sub_group_size": 1e8,
    "offload_param": {"device": "nvme", "nvme_path": "/local_nvme", "pin_memory": true,
                      "buffer_count": 6, "buffer_size": 2e8, "max_in_cpu": 1e9},
    "offload_optimizer": {"device": "cpu", "pin_memory": true, "pipeline_read": false,
                          "ratio": 0.5}
  },
  "aio": {"block_size": 8388608, "queue_depth": 32, "intra_op_parallelism": 2,
          "single_submit": false, "overlap_events": true},
  "spillway": {"host_budget_bytes": "64GiB", "nvme_budget_bytes": 2199023255552,
               "escape_policy": {"host": "reclaim", "nvme": "fail"},
               "metrics_address": "127.0.0.1:9500", "checksum": true}
})";

TEST(ConfigTest, ReadsAZero3NvmeOffloadConfig) {
  auto c = Config::Parse(kZero3Nvme);
  ASSERT_TRUE(c.ok()) << c.status().ToString();
  EXPECT_EQ(c->zero_stage, 3);
  EXPECT_EQ(c->offload_param.device, OffloadDevice::kNvme);
  EXPECT_EQ(c->offload_param.nvme_path, "/local_nvme");
  EXPECT_EQ(c->offload_param.buffer_count, 6u);
  EXPECT_EQ(c->offload_param.buffer_size, 200'000'000u);
  EXPECT_EQ(c->offload_optimizer.device, OffloadDevice::kCpu);
  EXPECT_EQ(c->offload_optimizer.ratio, 0.5);
  EXPECT_EQ(c->offload_optimizer.buffer_count, 4u);  // DeepSpeed's default
  EXPECT_EQ(c->sub_group_size, 100'000'000u);
  EXPECT_EQ(c->aio.block_size, 8u << 20);
  EXPECT_EQ(c->aio.queue_depth, 32u);
  EXPECT_EQ(c->spillway.host_budget_bytes, 64ull << 30);
  EXPECT_EQ(c->spillway.nvme_budget_bytes, 2ull << 40);
  EXPECT_EQ(c->spillway.host_escape_policy, allocator::EscapePolicy::kReclaim);
  EXPECT_EQ(c->spillway.nvme_escape_policy, allocator::EscapePolicy::kFail);
  // What the components get.
  auto h = c->HostArenaOptions();
  EXPECT_EQ(h.budget_bytes, 64ull << 30);
  EXPECT_EQ(h.pin, allocator::PinMode::kAuto);
  EXPECT_EQ(h.policy, allocator::EscapePolicy::kReclaim);
  auto e = c->EngineOptions(nullptr);
  EXPECT_EQ(e.block_size, 8u << 20);
  EXPECT_EQ(e.queue_depth, 32u);
  auto n = c->NvmeArenaOptions();
  EXPECT_EQ(n.directory, "/local_nvme");
  EXPECT_EQ(n.budget_bytes, 2ull << 40);
  EXPECT_EQ(n.policy, allocator::EscapePolicy::kFail);
  // The training keys the reference trainer acts on.
  EXPECT_EQ(c->training.micro_batch_size, 1u);
  EXPECT_EQ(c->training.gradient_accumulation_steps, 4u);
  EXPECT_EQ(c->training.gradient_clipping, 1.0);
  EXPECT_EQ(c->training.optimizer, "AdamW");
  EXPECT_EQ(c->training.lr, 3e-4);
  EXPECT_EQ(c->training.beta2, 0.95);
  EXPECT_EQ(c->training.eps, 1e-6);
  EXPECT_EQ(c->training.weight_decay, 0.1);
}

TEST(ConfigTest, DeepSpeedKeysSpillwayDoesNotActOnAreListed) {
  auto c = Config::Parse(kZero3Nvme);
  ASSERT_TRUE(c.ok());
  const std::vector<std::string> expected = {
      "optimizer.params.torch_adam", "bf16", "zero_optimization.overlap_comm",
      "zero_optimization.stage3_gather_16bit_weights_on_model_save"};
  for (const auto& k : expected) {
    EXPECT_NE(std::find(c->ignored_keys.begin(), c->ignored_keys.end(), k), c->ignored_keys.end())
        << k;
  }
  EXPECT_EQ(c->ignored_keys.size(), expected.size());
}

TEST(ConfigTest, DefaultsAreDeepSpeeds) {
  auto c = Config::Parse("{}");
  ASSERT_TRUE(c.ok());
  EXPECT_EQ(c->offload_param.device, OffloadDevice::kNone);
  EXPECT_EQ(c->offload_param.buffer_count, 5u);
  EXPECT_EQ(c->offload_param.buffer_size, 100'000'000u);
  EXPECT_EQ(c->offload_param.max_in_cpu, 1'000'000'000u);
  EXPECT_FALSE(c->offload_param.pin_memory);
  EXPECT_EQ(c->aio.block_size, 1u << 20);
  EXPECT_EQ(c->aio.queue_depth, 8u);
  EXPECT_EQ(c->sub_group_size, 1'000'000'000u);
  EXPECT_EQ(c->HostArenaOptions().pin, allocator::PinMode::kPageable);  // pin_memory=false
  EXPECT_EQ(c->spillway.metrics_address, "127.0.0.1:9464");
  EXPECT_EQ(c->training.micro_batch_size, 1u);
  EXPECT_EQ(c->training.gradient_accumulation_steps, 1u);
  EXPECT_EQ(c->training.gradient_clipping, 0.0);
  EXPECT_EQ(c->training.lr, 1e-3);
  EXPECT_EQ(c->training.weight_decay, 0.0);
}

TEST(ConfigTest, PrefetchAndSpillSettings) {
  auto c = Config::Parse("{}");
  ASSERT_TRUE(c.ok());
  EXPECT_EQ(c->PrefetchWindow(), 2u);
  EXPECT_EQ(c->spillway.spill_path, "");
  c = Config::Parse(R"({"zero_optimization": {"stage3_prefetch_bucket_size": 0},
                        "spillway": {"prefetch_partitions": 6, "spill_path": "/scratch"}})");
  ASSERT_TRUE(c.ok()) << c.status().ToString();
  EXPECT_EQ(c->PrefetchWindow(), 0u) << "DeepSpeed's 0 turns prefetching off";
  EXPECT_EQ(c->SpillArenaOptions().directory, "/scratch");
  c = Config::Parse(R"({"zero_optimization": {"stage3_prefetch_bucket_size": "auto"},
                        "spillway": {"prefetch_partitions": 6}})");
  ASSERT_TRUE(c.ok()) << c.status().ToString();
  EXPECT_EQ(c->PrefetchWindow(), 6u) << "the HF Trainer's \"auto\" keeps prefetching on";
  EXPECT_TRUE(c->ignored_keys.empty());
  EXPECT_EQ(c->spillway.eviction, Eviction::kOpt);
  c = Config::Parse(R"({"spillway": {"eviction": "lru"}})");
  ASSERT_TRUE(c.ok()) << c.status().ToString();
  EXPECT_EQ(c->spillway.eviction, Eviction::kLru);
}

TEST(ConfigTest, ReduceBucketSizeIsReadAndAutoKeepsDeepSpeedsDefault) {
  auto c = Config::Parse("{}");
  ASSERT_TRUE(c.ok());
  EXPECT_EQ(c->reduce_bucket_size, 500'000'000u);
  c = Config::Parse(R"({"zero_optimization": {"reduce_bucket_size": 2e8}})");
  ASSERT_TRUE(c.ok()) << c.status().ToString();
  EXPECT_EQ(c->reduce_bucket_size, 200'000'000u);
  EXPECT_TRUE(c->ignored_keys.empty());
  c = Config::Parse(R"({"zero_optimization": {"reduce_bucket_size": "auto"}})");
  ASSERT_TRUE(c.ok()) << c.status().ToString();
  EXPECT_EQ(c->reduce_bucket_size, 500'000'000u)
      << "HF fills \"auto\"; the file's plan keeps the larger";
  c = Config::Parse(R"({"zero_optimization": {"reduce_bucket_size": 1e16}})");
  ASSERT_FALSE(c.ok());
  EXPECT_NE(
      c.status().message().find("zero_optimization.reduce_bucket_size': is 1e+16; at most 1e15"),
      std::string::npos)
      << c.status().ToString();
  c = Config::Parse(R"({"zero_optimization": {"reduce_bucket_size": -1}})");
  ASSERT_FALSE(c.ok());
  EXPECT_NE(c.status().message().find("reduce_bucket_size"), std::string::npos);
}

TEST(ConfigTest, RegionAndBounceSettingsReachTheArenaAndTheEngine) {
  auto c = Config::Parse("{}");
  ASSERT_TRUE(c.ok());
  EXPECT_EQ(c->HostArenaOptions().region_bytes, allocator::HostArenaOptions{}.region_bytes);
  EXPECT_EQ(c->EngineOptions(nullptr).bounce_buffers, allocator::IoEngineOptions{}.bounce_buffers);
  c = Config::Parse(R"({"spillway": {"host_region_bytes": "2MiB", "bounce_buffers": 1}})");
  ASSERT_TRUE(c.ok()) << c.status().ToString();
  EXPECT_EQ(c->HostArenaOptions().region_bytes, 2u << 20);
  EXPECT_EQ(c->EngineOptions(nullptr).bounce_buffers, 1u);
}

// A Config built in code skips Parse's ranges. Its counts must reach the engine saturated, never
// wrapped to 32 bits: 2^32 + 1 bounce buffers is not one bounce buffer.
TEST(ConfigTest, EngineOptionsOfACodeBuiltConfigSaturateInsteadOfWrapping) {
  Config c;
  c.spillway.bounce_buffers = (1ull << 32) + 1;
  c.aio.queue_depth = (1ull << 32) + 8;
  c.aio.intra_op_parallelism = 1ull << 32;
  const auto o = c.EngineOptions(nullptr);
  EXPECT_EQ(o.bounce_buffers, UINT32_MAX);
  EXPECT_EQ(o.queue_depth, UINT32_MAX);
  EXPECT_EQ(o.pool_threads, UINT32_MAX);
}

struct BadCase {
  const char* name;
  const char* json;
  const char* expect;  // a piece of the message
};

class ConfigErrorTest : public ::testing::TestWithParam<BadCase> {};

TEST_P(ConfigErrorTest, NamesTheKeyAndWhatIsAllowed) {
  auto c = Config::Parse(GetParam().json);
  ASSERT_FALSE(c.ok()) << GetParam().name;
  EXPECT_EQ(c.status().code(), StatusCode::kInvalidArgument);
  EXPECT_TRUE(Has(c.status(), GetParam().expect)) << c.status().ToString();
}

INSTANTIATE_TEST_SUITE_P(
    Cases, ConfigErrorTest,
    ::testing::Values(
        BadCase{"NotJson", R"({"aio": )", "not valid JSON"},
        BadCase{"NotAnObject", R"([1, 2])", "a DeepSpeed config is a JSON object"},
        BadCase{
            "UnknownSpillwayKey", R"({"spillway": {"host_budget": 1}})",
            "'spillway.host_budget': is not a Spillway setting; allowed keys: host_budget_bytes"},
        BadCase{"WrongType", R"({"aio": {"queue_depth": "deep"}})",
                "'aio.queue_depth': is \"deep\"; expected a number"},
        BadCase{"NotWhole", R"({"aio": {"queue_depth": 2.5}})", "expected a whole number >= 1"},
        BadCase{"Zero", R"({"aio": {"queue_depth": 0}})", "'aio.queue_depth': is 0"},
        BadCase{"BadDevice", R"({"zero_optimization": {"offload_optimizer": {"device": "gpu"}}})",
                "allowed values: none, cpu, nvme"},
        BadCase{"NvmeWithoutPath",
                R"({"zero_optimization": {"stage": 3, "offload_param": {"device": "nvme"}}})",
                "'zero_optimization.offload_param.nvme_path' is missing"},
        BadCase{"ParamOffloadNeedsStage3",
                R"({"zero_optimization": {"stage": 2, "offload_param": {"device": "cpu"}}})",
                "parameter offload needs stage 3"},
        BadCase{"StageOutOfRange", R"({"zero_optimization": {"stage": 4}})",
                "allowed values: 0, 1, 2, 3"},
        BadCase{"RatioOutOfRange",
                R"({"zero_optimization": {"offload_optimizer": {"ratio": 1.5}}})",
                "expected a fraction in (0, 1]"},
        BadCase{"Auto", R"({"zero_optimization": {"sub_group_size": "auto"}})",
                "Replace \"auto\" with a number"},
        BadCase{"BadBytes", R"({"spillway": {"host_budget_bytes": "lots"}})",
                "expected bytes, e.g. 68719476736 or \"64GiB\""},
        BadCase{"BadPolicy", R"({"spillway": {"escape_policy": "ignore"}})",
                "allowed values: report, reclaim, fail"},
        BadCase{"BadPolicyTier", R"({"spillway": {"escape_policy": {"gpu": "report"}}})",
                "allowed keys: host, nvme"},
        BadCase{"BadMetricsAddress", R"({"spillway": {"metrics_address": "9464"}})",
                "expected host:port or \"off\""},
        BadCase{"BlockSizeNotAligned", R"({"aio": {"block_size": 1000000}})",
                "must be a multiple of 4096"},
        BadCase{"IntraOpDoesNotDivide", R"({"aio": {"block_size": 1048576,
                                           "intra_op_parallelism": 3}})",
                "must divide evenly"},
        BadCase{"Gds", R"({"aio": {"use_gds": true}})", "does not implement GPUDirect Storage"},
        BadCase{"SectionNotObject", R"({"aio": 5})", "'aio': is 5; expected an object"},
        BadCase{"UnknownOptimizer", R"({"optimizer": {"type": "Lamb"}})",
                "'optimizer.type': is \"Lamb\"; Spillway's host optimizer implements"},
        BadCase{"BadBetas", R"({"optimizer": {"params": {"betas": [0.9]}}})",
                "expected [beta1, beta2], each in [0, 1)"},
        BadCase{"ZeroLr", R"({"optimizer": {"params": {"lr": 0}}})", "expected lr > 0"},
        BadCase{"NegativeClip", R"({"gradient_clipping": -1})", "expected a finite number >= 0"},
        BadCase{"TooMuchPrefetch", R"({"spillway": {"prefetch_partitions": 5000}})",
                "'spillway.prefetch_partitions': is 5000; at most 1024"},
        BadCase{"NoBounceBuffers", R"({"spillway": {"bounce_buffers": 0}})",
                "'spillway.bounce_buffers': is 0"},
        BadCase{"TooManyBounceBuffers", R"({"spillway": {"bounce_buffers": 5000}})",
                "'spillway.bounce_buffers': is 5000; at most 1024"},
        BadCase{"ZeroRegion", R"({"spillway": {"host_region_bytes": 0}})",
                "'spillway.host_region_bytes': is 0"},
        BadCase{"RegionBelowAPage", R"({"spillway": {"host_region_bytes": "0.5KiB"}})",
                "'spillway.host_region_bytes': is 512; at least 4096"},
        BadCase{"RegionOverTheBudget",
                R"({"spillway": {"host_region_bytes": "64MiB", "host_budget_bytes": "32MiB"}})",
                "'spillway.host_region_bytes': is 64.00 MiB (67108864 bytes), more than "
                "spillway.host_budget_bytes"},
        BadCase{"UnknownEviction", R"({"spillway": {"eviction": "fifo"}})",
                "'spillway.eviction': is \"fifo\"; expected \"opt\""},
        BadCase{"SpillPathNotAString", R"({"spillway": {"spill_path": 3}})",
                "'spillway.spill_path': is 3; expected a string"},
        BadCase{"ZeroAccumulation", R"({"gradient_accumulation_steps": 0})",
                "'gradient_accumulation_steps': is 0"}),
    [](const ::testing::TestParamInfo<BadCase>& p) { return std::string(p.param.name); });

TEST(ConfigTest, AMissingFileSaysWhichAndWhy) {
  auto c = Config::Load("/nonexistent/ds_config.json");
  EXPECT_EQ(c.status().code(), StatusCode::kInvalidArgument);
  EXPECT_TRUE(Has(c.status(), "cannot read config file '/nonexistent/ds_config.json'"));
  EXPECT_TRUE(Has(c.status(), "No such file or directory"));
}

TEST(ConfigTest, LoadNamesTheFileInErrors) {
  const std::string path = ::testing::TempDir() + "/spillway-bad-config.json";
  std::ofstream(path) << R"({"spillway": {"checksum": "yes"}})";
  auto c = Config::Load(path);
  EXPECT_TRUE(Has(c.status(), path)) << c.status().ToString();
  EXPECT_TRUE(Has(c.status(), "'spillway.checksum': is \"yes\"; expected true or false"));
}

}  // namespace
}  // namespace spillway::offload

namespace spillway::offload {
namespace {

TEST(ParseByteSizeTest, UnitsAndErrors) {
  EXPECT_EQ(*ParseByteSize("68719476736"), 68719476736u);
  EXPECT_EQ(*ParseByteSize("64GiB"), 64ull << 30);
  EXPECT_EQ(*ParseByteSize("512 MiB"), 512ull << 20);
  EXPECT_EQ(*ParseByteSize("1.5TB"), 1'500'000'000'000u);
  EXPECT_EQ(*ParseByteSize("1TiB"), 1ull << 40);
  EXPECT_EQ(*ParseByteSize("34e9"), 34'000'000'000u);
  for (const char* bad : {"", "lots", "-5GiB", "0", "64 GiB extra", "64Gb", "1e30"}) {
    auto r = ParseByteSize(bad);
    ASSERT_FALSE(r.ok()) << bad;
    EXPECT_NE(r.status().message().find("is not a byte size"), std::string::npos) << bad;
  }
}

}  // namespace
}  // namespace spillway::offload
