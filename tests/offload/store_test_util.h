// A partition store over real arenas and a real io_uring engine, for the offload and engine tests.
#pragma once

#include <gtest/gtest.h>

#include <memory>
#include <string>

#include "../allocator/nvme_test_util.h"
#include "spillway/allocator/host_arena.h"
#include "spillway/allocator/io_engine.h"
#include "spillway/allocator/io_faults.h"
#include "spillway/allocator/nvme_arena.h"
#include "spillway/base/bytes.h"
#include "spillway/offload/config.h"
#include "spillway/offload/partition_store.h"

namespace spillway::offload::testing {

inline Config ParseOrDie(const std::string& json) {
  auto c = Config::Parse(json);
  EXPECT_TRUE(c.ok()) << c.status().ToString();
  return c.ok() ? *c : Config{};
}

inline std::string OffloadJson(const char* param_dev, const char* opt_dev) {
  const std::string dir = allocator::testing::NvmeTestDir();
  return StrCat(R"({"zero_optimization": {"stage": 3, "offload_param": {"device": ")", param_dev,
                R"(", "nvme_path": ")", dir, R"("}, "offload_optimizer": {"device": ")", opt_dev,
                R"(", "nvme_path": ")", dir, R"("}}})");
}

// A ledger, a host arena with `budget`, an engine, an NVMe arena, and a store over them.
struct StoreRig {
  StoreRig(const Config& config, uint64_t host_budget, bool with_nvme = true,
           allocator::IoFaults* faults = nullptr, uint32_t prefetch_window = 0) {
    auto ho = allocator::testing::PageableOptions(&ledger);
    ho.budget_bytes = host_budget;
    ho.retain_limit_bytes = 4 * kMiB;
    host = allocator::testing::MakeArena(ho);
    allocator::IoEngineOptions eo;
    eo.arena = host.get();
    eo.faults = faults;
    engine = std::move(allocator::IoEngine::Create(eo).value());
    if (with_nvme) {
      allocator::NvmeArenaOptions no;
      no.directory = allocator::testing::NvmeTestDir();
      no.budget_bytes = 512 * kMiB;
      no.ledger = &ledger;
      nvme = std::move(allocator::NvmeArena::Create(no, engine.get()).value());
    }
    auto s = PartitionStore::Create(config, host.get(), nvme.get(), allocator::kProcessScope,
                                    prefetch_window);
    EXPECT_TRUE(s.ok()) << s.status().ToString();
    if (s.ok()) store = std::move(s.value());
  }
  ~StoreRig() {
    store.reset();
    nvme.reset();
    engine.reset();
    host.reset();
  }
  allocator::Ledger ledger;
  std::unique_ptr<allocator::HostArena> host;
  std::unique_ptr<allocator::IoEngine> engine;
  std::unique_ptr<allocator::NvmeArena> nvme;
  std::unique_ptr<PartitionStore> store;
};

}  // namespace spillway::offload::testing
