// The exporter under a real Prometheus server, concurrent scrapers, bad HTTP input, promtool, and
// a port that is already taken.
#include "spillway/metrics/exporter.h"

#include <gtest/gtest.h>

#include <atomic>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <nlohmann/json.hpp>
#include <regex>
#include <thread>

#include "../allocator/test_util.h"
#include "http_util.h"
#include "spillway/base/bytes.h"

namespace spillway::metrics {
namespace {

using allocator::Kind;
using allocator::Lifetime;
using allocator::testing::Tag;

// The value of one sample line `name{labels} value` in an exposition, or -1.
double Sample(const std::string& text, const std::string& name_and_labels) {
  const auto p = text.find("\n" + name_and_labels + " ");
  if (p == std::string::npos) return -1;
  return std::stod(text.substr(p + name_and_labels.size() + 2));
}

struct Rig {
  Rig() {
    auto o = allocator::testing::PageableOptions(&ledger);
    arena = allocator::testing::MakeArena(o);
    auto e = Exporter::Start({"127.0.0.1:0", true});
    EXPECT_TRUE(e.ok()) << e.status().ToString();
    exporter = std::move(e.value());
    exporter->Watch(arena.get());
    exporter->Watch(&ledger);
  }
  ~Rig() { exporter.reset(); }
  allocator::Ledger ledger;
  std::unique_ptr<allocator::HostArena> arena;
  std::unique_ptr<Exporter> exporter;
};

// Asks Prometheus for one instant value.
double Query(int port, const std::string& promql) {
  std::string q;
  for (char c : promql) {
    if (std::isalnum(static_cast<unsigned char>(c)) || c == '_') {
      q += c;
    } else {
      char hex[4];
      std::snprintf(hex, sizeof(hex), "%%%02X", static_cast<unsigned char>(c));
      q += hex;
    }
  }
  const std::string body = testing::Body(testing::HttpGet(port, "/api/v1/query?query=" + q));
  auto j = nlohmann::json::parse(body, nullptr, false);
  if (j.is_discarded() || j["status"] != "success" || j["data"]["result"].empty()) return -1;
  return std::stod(j["data"]["result"][0]["value"][1].get<std::string>());
}

TEST(ExporterTest, ARealPrometheusScrapesTheArenaAsItIs) {
  if (!testing::PrometheusServer::Available()) {
    GTEST_SKIP() << "no /usr/bin/prometheus (Debian's prometheus package); scripts/install-deps "
                    "installs it";
  }
  Rig rig;
  testing::PrometheusServer prom(rig.exporter->port());
  ASSERT_TRUE(prom.WaitReady(std::chrono::seconds(60))) << prom.Log();
  // A workload with epoch boundaries: persistent state, a step buffer freed, one leaked.
  ASSERT_TRUE(rig.ledger.BeginEpoch(0).ok());
  auto state = rig.arena->Allocate(24 * kMiB, Tag(Kind::kOptimizerState, Lifetime::kPersistent));
  ASSERT_TRUE(state.ok());
  for (int s = 0; s < 3; ++s) {
    ASSERT_TRUE(rig.ledger.BeginStep(s).ok());
    auto tmp = rig.arena->Allocate(3 * kMiB, Tag(Kind::kTransient, Lifetime::kStep));
    ASSERT_TRUE(tmp.ok());
    if (s != 1) {
      ASSERT_TRUE(rig.arena->Free(*tmp).ok());
    }
    ASSERT_TRUE(rig.ledger.EndStep(nullptr).ok());
  }
  ASSERT_TRUE(rig.ledger.EndEpoch(nullptr).ok());
  const allocator::HostArenaStats st = rig.arena->Stats();
  ASSERT_GT(st.escape_count, 0u);
  // Prometheus scrapes every second; wait until it has seen the final state, then compare.
  double live = -1, escapes = -1, committed = -1, epoch = -2;
  for (int i = 0; i < 60; ++i) {
    live = Query(prom.port(), "spillway_host_bytes{state=\"live\"}");
    committed = Query(prom.port(), "spillway_host_bytes{state=\"committed\"}");
    escapes = Query(prom.port(), "sum(spillway_escapes_total{tier=\"host\"})");
    epoch = Query(prom.port(), "spillway_epoch");
    if (live == static_cast<double>(st.live_bytes) &&
        escapes == static_cast<double>(st.escape_count)) {
      break;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(500));
  }
  EXPECT_EQ(live, static_cast<double>(st.live_bytes)) << prom.Log();
  EXPECT_EQ(committed, static_cast<double>(st.committed_bytes));
  EXPECT_EQ(escapes, static_cast<double>(st.escape_count));
  EXPECT_EQ(epoch, 0.0);
  EXPECT_EQ(Query(prom.port(), "spillway_live_bytes_by_kind{kind=\"optimizer_state\"}"),
            static_cast<double>(24 * kMiB));
}

TEST(ExporterTest, ConcurrentScrapesNeverSeeTornValues) {
  Rig rig;
  std::atomic<bool> stop{false};
  std::vector<std::thread> workers;
  for (int t = 0; t < 4; ++t) {
    workers.emplace_back([&, t] {
      std::vector<void*> mine;
      uint64_t i = 0;
      while (!stop.load()) {
        auto p = rig.arena->Allocate((1 + (i * 7 + t) % 13) * 100000,
                                     Tag(Kind::kTransient, Lifetime::kStep));
        if (p.ok()) mine.push_back(*p);
        if (mine.size() > 8 || (!p.ok() && !mine.empty())) {
          ASSERT_TRUE(rig.arena->Free(mine.front()).ok());
          mine.erase(mine.begin());
        }
        ++i;
      }
      for (void* p : mine) ASSERT_TRUE(rig.arena->Free(p).ok());
    });
  }
  std::atomic<int> scrapes{0};
  std::vector<std::thread> scrapers;
  for (int c = 0; c < 3; ++c) {
    scrapers.emplace_back([&] {
      for (int i = 0; i < 40; ++i) {
        const std::string body = testing::Body(testing::HttpGet(rig.exporter->port(), "/metrics"));
        const double live = Sample(body, "spillway_host_bytes{arena=\"host\",state=\"live\"}");
        const double committed =
            Sample(body, "spillway_host_bytes{arena=\"host\",state=\"committed\"}");
        const double retained =
            Sample(body, "spillway_host_bytes{arena=\"host\",state=\"retained\"}");
        const double fragment =
            Sample(body, "spillway_host_bytes{arena=\"host\",state=\"fragment\"}");
        ASSERT_GE(live, 0) << body.substr(0, 400);
        // One snapshot per scrape: the invariant holds exactly in every one.
        ASSERT_LE(live, committed);
        ASSERT_EQ(committed, live + retained + fragment);
        scrapes++;
      }
    });
  }
  for (auto& s : scrapers) s.join();
  stop = true;
  for (auto& w : workers) w.join();
  EXPECT_EQ(scrapes.load(), 120);
}

TEST(ExporterTest, MalformedRequestsAndUnknownPathsGetErrorsAndServingGoesOn) {
  Rig rig;
  const int port = rig.exporter->port();
  const std::string garbage = testing::RawRequest(port, "\x01\x02 NOT HTTP AT ALL\r\n\r\n");
  // CivetWeb answers an unparseable request line with a bare "Error 400: Bad Request".
  EXPECT_NE(garbage.find("400"), std::string::npos) << garbage;
  const std::string missing = testing::HttpGet(port, "/no/such/path");
  EXPECT_NE(missing.find(" 404 "), std::string::npos) << missing;
  const std::string huge = testing::RawRequest(
      port, "GET /metrics?" + std::string(100000, 'x') + " HTTP/1.1\r\nHost: x\r\n\r\n");
  EXPECT_NE(huge.find(" 400 "), std::string::npos) << huge.substr(0, 200);
  const std::string ok = testing::HttpGet(port, "/metrics");
  EXPECT_NE(ok.find(" 200 "), std::string::npos);
  EXPECT_NE(ok.find("spillway_build_info"), std::string::npos);
}

TEST(ExporterTest, PromtoolFindsNothingWrongWithTheExposition) {
  if (std::system("command -v promtool >/dev/null 2>&1") != 0) {
    GTEST_SKIP() << "no promtool (Debian's prometheus package)";
  }
  Rig rig;
  ASSERT_TRUE(rig.ledger.BeginStep(0).ok());
  ASSERT_TRUE(rig.arena->Allocate(kMiB, Tag(Kind::kSwapBuffer, Lifetime::kStep)).ok());
  ASSERT_TRUE(rig.ledger.EndStep(nullptr).ok());
  const std::string path = ::testing::TempDir() + "/spillway-exposition.txt";
  { std::ofstream(path) << rig.exporter->Render(); }
  FILE* p = popen(("promtool check metrics < " + path + " 2>&1").c_str(), "r");
  std::string out;
  char buf[4096];
  while (size_t n = fread(buf, 1, sizeof(buf), p)) out.append(buf, n);
  const int rc = pclose(p);
  EXPECT_EQ(rc, 0) << out;
  EXPECT_EQ(out, "") << out;
}

TEST(ExporterTest, APortInUseIsAClearErrorAndTheFirstExporterKeepsServing) {
  Rig rig;
  const std::string taken = "127.0.0.1:" + std::to_string(rig.exporter->port());
  auto second = Exporter::Start({taken, true});
  ASSERT_FALSE(second.ok());
  EXPECT_EQ(second.status().code(), StatusCode::kUnavailable);
  EXPECT_NE(second.status().message().find(taken), std::string::npos) << second.status().ToString();
  EXPECT_NE(second.status().message().find("spillway.metrics_address"), std::string::npos);
  EXPECT_NE(testing::HttpGet(rig.exporter->port(), "/metrics").find(" 200 "), std::string::npos);
  auto bad = Exporter::Start({"no-port-here", true});
  EXPECT_EQ(bad.status().code(), StatusCode::kInvalidArgument);
}

TEST(ExporterTest, TurnedOffItServesNothingButStillRenders) {
  allocator::Ledger ledger;
  auto arena = allocator::testing::MakeArena(allocator::testing::PageableOptions(&ledger));
  auto e = Exporter::Start({"127.0.0.1:9464", false});
  ASSERT_TRUE(e.ok());
  EXPECT_EQ((*e)->port(), 0);
  (*e)->Watch(arena.get());
  EXPECT_NE((*e)->Render().find("spillway_host_bytes{arena=\"host\",state=\"live\"} 0"),
            std::string::npos);
  (*e)->Unwatch(arena.get());
  EXPECT_EQ((*e)->Render().find("spillway_host_bytes"), std::string::npos);
}

}  // namespace
}  // namespace spillway::metrics

namespace spillway::metrics {
namespace {

TEST(ExporterTest, TheDashboardUsesOnlyExportedMetricNames) {
  // A full exposition: host and NVMe arenas, an engine that moved bytes, the ledger.
  allocator::Ledger ledger;
  auto host = allocator::testing::MakeArena(allocator::testing::PageableOptions(&ledger));
  allocator::IoEngineOptions eo;
  eo.arena = host.get();
  auto engine = allocator::IoEngine::Create(eo);
  ASSERT_TRUE(engine.ok());
  allocator::NvmeArenaOptions no;
  no.directory = ".";
  no.budget_bytes = 64 * kMiB;
  no.ledger = &ledger;
  auto nvme = allocator::NvmeArena::Create(no, engine->get());
  ASSERT_TRUE(nvme.ok()) << nvme.status().ToString();
  auto e = Exporter::Start({"127.0.0.1:0", false});
  ASSERT_TRUE(e.ok());
  (*e)->Watch(host.get());
  (*e)->Watch(nvme->get());
  (*e)->Watch(engine->get());
  (*e)->Watch(&ledger);
  auto opt = std::move(engine::HostOptimizer::Create({}).value());
  (*e)->Watch(opt.get());
  allocator::NodeGovernorOptions go;  // the node's ledger, for the node panels
  go.job = StrCat("exporter-test-", getpid());
  go.ledger = go.job;  // its own, not this machine's (tests run beside each other)
  go.local_rank = 0;
  go.host_budget_bytes = 256 * kMiB;
  auto node = allocator::NodeGovernor::Join(go);
  ASSERT_TRUE(node.ok()) << node.status().ToString();
  (*e)->Watch(node->get());
  const std::string exposition = (*e)->Render();
  (*e)->Unwatch(node->get());
  std::ifstream in(std::string(SPILLWAY_SOURCE_DIR) + "/docs/grafana/spillway.json");
  ASSERT_TRUE(in.good());
  auto dash = nlohmann::json::parse(in);
  std::regex name_re("spillway_[a-z_]+");
  int names = 0;
  for (const auto& panel : dash["panels"]) {
    for (const auto& target : panel["targets"]) {
      const std::string expr = target["expr"];
      for (std::sregex_iterator it(expr.begin(), expr.end(), name_re), end; it != end; ++it) {
        std::string name = it->str();
        if (name.size() > 7 && name.compare(name.size() - 7, 7, "_bucket") == 0) {
          name = name.substr(0, name.size() - 7);  // histogram series
        }
        ++names;
        EXPECT_NE(exposition.find("\n" + name), std::string::npos)
            << panel["title"] << " uses " << name << ", which the exporter does not export";
      }
    }
  }
  EXPECT_GT(names, 15);
  // The engine's fallbacks and ring failures are exported, not only logged.
  for (const char* family : {"\nspillway_io_engine_info{", "\nspillway_io_ring_failures_total{",
                             "\nspillway_io_buffer_registration_failures_total{",
                             "\nspillway_io_sqe_shortages_total{"}) {
    EXPECT_NE(exposition.find(family), std::string::npos) << family;
  }
  (*e)->Unwatch(nvme->get());
  nvme->reset();
  (*e)->Unwatch(engine->get());
  engine->reset();
  (*e)->Unwatch(opt.get());
}

}  // namespace
}  // namespace spillway::metrics

namespace spillway::metrics {
namespace {

TEST(ExporterTest, AnNvmeArenaOfferedTwiceIsRenderedOnce) {
  // spillway.metrics.serve() and a DeepSpeed swap store made while it runs can both watch the
  // store's arena; a duplicated sample would make Prometheus reject the scrape.
  allocator::Ledger ledger;
  auto host = allocator::testing::MakeArena(allocator::testing::PageableOptions(&ledger));
  allocator::IoEngineOptions eo;
  eo.arena = host.get();
  auto engine = std::move(allocator::IoEngine::Create(eo).value());
  allocator::NvmeArenaOptions no;
  no.name = "deepspeed-swap:/nvme";
  no.directory = ".";
  no.budget_bytes = 64 * kMiB;
  no.ledger = &ledger;
  auto nvme = std::move(allocator::NvmeArena::Create(no, engine.get()).value());
  auto e = Exporter::Start({"127.0.0.1:0", false});
  ASSERT_TRUE(e.ok());
  (*e)->Watch(nvme.get());
  (*e)->Watch(nvme.get());
  const std::string text = (*e)->Render();
  const std::string line = "\nspillway_budget_bytes{tier=\"nvme\",arena=\"deepspeed-swap:/nvme\"} ";
  const size_t first = text.find(line);
  ASSERT_NE(first, std::string::npos) << text;
  EXPECT_EQ(text.find(line, first + 1), std::string::npos) << text;
}

TEST(ExporterTest, AFullExpositionWithTheOffloadLayerReportsItAndPassesPromtool) {
  allocator::Ledger ledger;
  auto ho = allocator::testing::PageableOptions(&ledger);
  auto host = allocator::testing::MakeArena(ho);
  allocator::IoEngineOptions eo;
  eo.arena = host.get();
  auto engine = std::move(allocator::IoEngine::Create(eo).value());
  allocator::NvmeArenaOptions no;
  no.directory = ".";
  no.budget_bytes = 64 * kMiB;
  no.ledger = &ledger;
  auto nvme = std::move(allocator::NvmeArena::Create(no, engine.get()).value());
  auto cfg = offload::Config::Parse(
      R"({"zero_optimization": {"stage": 3, "offload_param": {"device": "nvme", "nvme_path": "."}}})");
  ASSERT_TRUE(cfg.ok());
  auto store = std::move(offload::PartitionStore::Create(*cfg, host.get(), nvme.get(), 0).value());
  auto device = std::move(offload::Device::OpenCpu().value());
  auto pipe = std::move(
      offload::TransferPipeline::Create(host.get(), nvme.get(), device.get(), {kMiB, 2}).value());
  ASSERT_TRUE(store->AttachDevice(pipe.get()).ok());
  auto id = *store->Register({0, 0, offload::StateKind::kParam}, 2 * kMiB);
  { auto h = store->Acquire(id); }
  ASSERT_TRUE(store->Evict(id).ok());
  { auto d = store->Acquire(id, offload::Access::kRead, offload::Placement::kDevice); }
  auto e = Exporter::Start({"127.0.0.1:0", false});
  ASSERT_TRUE(e.ok());
  (*e)->Watch(host.get());
  (*e)->Watch(nvme.get());
  (*e)->Watch(engine.get());
  (*e)->Watch(&ledger);
  (*e)->Watch(store.get());
  (*e)->Watch(pipe.get());
  // The host optimizer: one applied step, one skipped for an inf gradient.
  auto opt = std::move(engine::HostOptimizer::Create({}).value());
  std::vector<float> w(1000, 1.0f), m(1000), v(1000), g(1000, 0.5f);
  engine::SubGroup sg;
  sg.numel = w.size();
  sg.master = w.data();
  sg.exp_avg = m.data();
  sg.exp_avg_sq = v.data();
  sg.grad = g.data();
  ASSERT_TRUE(opt->Step({&sg, 1}).ok());
  g[7] = INFINITY;
  ASSERT_TRUE(opt->Step({&sg, 1})->skipped);
  (*e)->Watch(opt.get());
  // Two local ranks of one job on the node: rank 1 books 8 MiB pinned.
  allocator::NodeGovernorOptions go;
  go.job = StrCat("exporter-promtool-", getpid());
  go.ledger = go.job;
  go.local_rank = 0;
  go.host_budget_bytes = 512 * kMiB;
  auto rank0 = std::move(allocator::NodeGovernor::Join(go).value());
  go.local_rank = 1;
  go.host_budget_bytes = 0;
  auto rank1 = std::move(allocator::NodeGovernor::Join(go).value());
  ASSERT_TRUE(rank1->Reserve(allocator::NodeTier::kPinned, 8 * kMiB).ok());
  // Rank 1 publishes this process's real memory by owner; rank 0 publishes none.
  allocator::HeapCounters counters;
  allocator::ReadMallocCounters(&counters);
  auto mapped = allocator::ReadMappedBytes();
  ASSERT_TRUE(mapped.ok()) << mapped.status().ToString();
  const allocator::ProcessMemory memory = allocator::AttributeMemory(*mapped, counters);
  rank1->PublishMemory(memory);
  (*e)->Watch(rank0.get());
  const std::string text = (*e)->Render();
  (*e)->Unwatch(rank0.get());
  EXPECT_EQ(Sample(text, "spillway_node_budget_bytes{tier=\"host\"}"), 512.0 * kMiB);
  EXPECT_EQ(Sample(text, "spillway_node_committed_bytes{tier=\"host\"}"), 8.0 * kMiB);
  EXPECT_EQ(Sample(text, "spillway_node_headroom_bytes"), 504.0 * kMiB);
  EXPECT_EQ(Sample(text, "spillway_node_ranks"), 2);
  EXPECT_EQ(Sample(text, "spillway_node_jobs"), 1);
  const std::string job = StrCat("node_job=\"", go.job, "\",");
  EXPECT_EQ(Sample(text, "spillway_node_rank_bytes{" + job + "local_rank=\"1\",tier=\"pinned\"}"),
            8.0 * kMiB);
  EXPECT_EQ(Sample(text, "spillway_node_rank_bytes{" + job + "local_rank=\"0\",tier=\"pinned\"}"),
            0);
  EXPECT_EQ(
      Sample(text,
             "spillway_node_rank_memory_bytes{" + job + "local_rank=\"1\",owner=\"libraries\"}"),
      static_cast<double>(memory.owners[static_cast<int>(allocator::MemoryOwner::kLibraries)]));
  EXPECT_GT(memory.owners[static_cast<int>(allocator::MemoryOwner::kLibraries)], 0u);
  EXPECT_EQ(text.find("spillway_node_rank_memory_bytes{" + job + "local_rank=\"0\""),
            std::string::npos)
      << "a rank that published nothing has no series";
  const std::string isa = StrCat("{isa=\"", engine::IsaName(opt->isa()), "\"}");
  EXPECT_EQ(Sample(text, "spillway_optimizer_steps_total" + isa), 1);
  EXPECT_EQ(Sample(text, "spillway_optimizer_skipped_steps_total" + isa), 1);
  EXPECT_EQ(Sample(text, "spillway_optimizer_elements_total" + isa), 1000);
  EXPECT_GT(Sample(text, "spillway_optimizer_step_seconds_total" + isa), 0);
  EXPECT_EQ(Sample(text, "spillway_partitions"), 1);
  EXPECT_EQ(Sample(text, "spillway_partition_spills_total"), 1);
  EXPECT_EQ(Sample(text, "spillway_transfer_bytes_total{direction=\"nvme_to_device\"}"),
            static_cast<double>(2 * kMiB));
  EXPECT_EQ(Sample(text, "spillway_partition_bytes{tier=\"nvme\"}"), static_cast<double>(2 * kMiB));
  if (std::system("command -v promtool >/dev/null 2>&1") == 0) {
    const std::string path = ::testing::TempDir() + "/spillway-full-exposition.txt";
    std::ofstream(path) << text;
    FILE* p = popen(("promtool check metrics < " + path + " 2>&1").c_str(), "r");
    std::string out;
    char buf[4096];
    while (size_t n = fread(buf, 1, sizeof(buf), p)) out.append(buf, n);
    EXPECT_EQ(pclose(p), 0) << out;
    EXPECT_EQ(out, "") << out;
  }
  (*e)->Unwatch(store.get());
  (*e)->Unwatch(pipe.get());
  (*e)->Unwatch(opt.get());
  store.reset();
  pipe.reset();
  nvme.reset();
  engine.reset();
}

}  // namespace
}  // namespace spillway::metrics
