// Collector: every Spillway metric family, built from stats snapshots at scrape time.
// Names follow the Prometheus conventions: one prefix, base units, _total on counters, few
// bounded labels (arena names are chosen by the operator; kinds, lifetimes, ops are enums).
#include "collector.h"

#include <algorithm>
#include <fstream>
#include <map>
#include <string>

namespace spillway::metrics {
namespace {

using prometheus::ClientMetric;
using prometheus::MetricFamily;
using prometheus::MetricType;
using Labels = std::vector<std::pair<std::string, std::string>>;

class Families {
 public:
  // Returns the family of that name, creating it with its help text and type on first use.
  MetricFamily& Get(const std::string& name, const std::string& help, MetricType type) {
    auto it = index_.find(name);
    if (it != index_.end()) return families_[it->second];
    index_[name] = families_.size();
    families_.push_back(MetricFamily{name, help, type, {}});
    return families_.back();
  }
  void Gauge(const std::string& name, const std::string& help, const Labels& labels, double v) {
    Get(name, help, MetricType::Gauge).metric.push_back(Sample(labels, v, false));
  }
  void Counter(const std::string& name, const std::string& help, const Labels& labels, double v) {
    Get(name, help, MetricType::Counter).metric.push_back(Sample(labels, v, true));
  }
  void Histogram(const std::string& name, const std::string& help, const Labels& labels,
                 const uint64_t* counts, size_t n, double sum) {
    ClientMetric m = Sample(labels, 0, false);
    uint64_t cumulative = 0;
    for (size_t i = 0; i < n; ++i) {
      cumulative += counts[i];
      ClientMetric::Bucket b;
      b.cumulative_count = cumulative;
      b.upper_bound = i < allocator::kIoLatencyBuckets.size()
                          ? allocator::kIoLatencyBuckets[i]
                          : std::numeric_limits<double>::infinity();
      m.histogram.bucket.push_back(b);
    }
    m.histogram.sample_count = cumulative;
    m.histogram.sample_sum = sum;
    Get(name, help, MetricType::Histogram).metric.push_back(std::move(m));
  }
  std::vector<MetricFamily> Take() { return std::move(families_); }

 private:
  static ClientMetric Sample(const Labels& labels, double v, bool counter) {
    ClientMetric m;
    for (const auto& [k, val] : labels) m.label.push_back({k, val});
    if (counter) {
      m.counter.value = v;
    } else {
      m.gauge.value = v;
    }
    return m;
  }
  std::vector<MetricFamily> families_;
  std::map<std::string, size_t> index_;
};

// Rss and Pss of this process, in bytes, from /proc/self/smaps_rollup.
std::pair<double, double> ProcessMemory() {
  std::ifstream in("/proc/self/smaps_rollup");
  std::string key;
  double rss = 0, pss = 0, kb = 0;
  while (in >> key) {
    if (key == "Rss:" && in >> kb) rss = kb * 1024;
    if (key == "Pss:" && in >> kb) pss = kb * 1024;
  }
  return {rss, pss};
}

void AddOwnerFamilies(Families& f, const std::string& tier, const std::string& arena,
                      const allocator::LiveStats& s) {
  using allocator::Kind;
  using allocator::Lifetime;
  for (int k = 0; k < allocator::kKindCount; ++k) {
    const char* kind = allocator::KindName(static_cast<Kind>(k));
    f.Gauge("spillway_live_bytes_by_kind", "Live bytes by owner kind.",
            {{"tier", tier}, {"arena", arena}, {"kind", kind}},
            static_cast<double>(s.live_by_kind[k]));
    for (int l = 0; l < allocator::kLifetimeCount; ++l) {
      const char* lifetime = allocator::LifetimeName(static_cast<Lifetime>(l));
      f.Counter("spillway_escapes_total",
                "Allocations found alive past their lifetime at a step or epoch boundary.",
                {{"tier", tier}, {"arena", arena}, {"kind", kind}, {"lifetime", lifetime}},
                static_cast<double>(s.escapes_by[k][l]));
      f.Counter("spillway_escaped_bytes_total", "Bytes of the escapes found at boundaries.",
                {{"tier", tier}, {"arena", arena}, {"kind", kind}, {"lifetime", lifetime}},
                static_cast<double>(s.escaped_bytes_by[k][l]));
    }
  }
  for (int l = 0; l < allocator::kLifetimeCount; ++l) {
    f.Gauge("spillway_live_bytes_by_lifetime", "Live bytes by lifetime.",
            {{"tier", tier},
             {"arena", arena},
             {"lifetime", allocator::LifetimeName(static_cast<Lifetime>(l))}},
            static_cast<double>(s.live_by_lifetime[l]));
  }
  const Labels ta = {{"tier", tier}, {"arena", arena}};
  f.Gauge("spillway_live_allocations", "Live allocations.", ta,
          static_cast<double>(s.live_allocations));
  f.Counter("spillway_allocations_total", "Allocations made.", ta,
            static_cast<double>(s.alloc_count));
  f.Counter("spillway_frees_total", "Allocations freed (by Free, reclaim or scope release).", ta,
            static_cast<double>(s.free_count));
  f.Counter("spillway_reclaimed_total", "Escapes freed by the reclaim policy.", ta,
            static_cast<double>(s.reclaim_count));
  f.Counter("spillway_reclaimed_bytes_total", "Bytes freed by the reclaim policy.", ta,
            static_cast<double>(s.reclaimed_bytes));
  f.Counter("spillway_scope_freed_bytes_total", "Bytes freed by releasing owner scopes.", ta,
            static_cast<double>(s.scope_freed_bytes));
  f.Counter("spillway_bad_frees_total", "Frees refused: double, foreign or interior.", ta,
            static_cast<double>(s.bad_free_count));
}

// This process's build and memory (Rss and Pss: syscalls, so before the collector's lock).
void AddProcessFamilies(Families& f) {
  const auto [rss, pss] = ProcessMemory();
  f.Gauge("spillway_build_info", "Build information; the value is always 1.",
          {{"version", "0.1.0"}, {"cuda", SPILLWAY_WITH_CUDA ? "true" : "false"}}, 1);
  f.Gauge("spillway_process_resident_bytes", "Resident set size of this process (Rss).", {}, rss);
  f.Gauge("spillway_process_proportional_bytes",
          "Proportional set size of this process (Pss): shared pages divided among sharers, so "
          "copy-on-write copies after a fork show up here.",
          {}, pss);
}

// The epoch and step of a ledger.
void AddLedgerFamilies(Families& f, const allocator::Ledger& l) {
  f.Gauge("spillway_epoch", "The current (or last) epoch; -1 before the first.", {},
          static_cast<double>(l.epoch()));
  f.Gauge("spillway_step", "The current (or last) step; -1 before the first.", {},
          static_cast<double>(l.step()));
}

// A host arena: bytes by state, its budget, spills, regions, and its owners.
void AddHostFamilies(Families& f, const allocator::HostArena& a) {
  const allocator::HostArenaStats s = a.Stats();
  const std::string& name = a.tier_name();
  const std::pair<const char*, uint64_t> states[] = {
      {"reserved", s.reserved_bytes}, {"committed", s.committed_bytes},
      {"pinned", s.pinned_bytes},     {"live", s.live_bytes},
      {"retained", s.retained_bytes}, {"fragment", s.fragment_bytes}};
  for (const auto& [state, bytes] : states) {
    f.Gauge("spillway_host_bytes",
            "Host arena bytes by state: reserved, committed (held from the OS), pinned, live "
            "(handed out), retained (empty regions cached), fragment (free inside used regions).",
            {{"arena", name}, {"state", state}}, static_cast<double>(bytes));
  }
  f.Gauge("spillway_host_peak_committed_bytes", "Most host bytes ever held from the OS.",
          {{"arena", name}}, static_cast<double>(s.peak_committed_bytes));
  f.Gauge("spillway_host_pin_mode_info", "How the host arena pins memory; the value is 1.",
          {{"arena", name}, {"mode", allocator::PinModeName(s.pin_mode)}}, 1);
  f.Gauge("spillway_budget_bytes", "The configured budget of each tier.",
          {{"tier", "host"}, {"arena", name}}, static_cast<double>(s.budget_bytes));
  f.Counter("spillway_over_budget_total", "Requests refused because they would cross a budget.",
            {{"tier", "host"}, {"arena", name}}, static_cast<double>(s.over_budget_count));
  f.Counter("spillway_spills_total", "Calls to the spill handler to make room under a budget.",
            {{"arena", name}}, static_cast<double>(s.spill_calls));
  f.Counter("spillway_spilled_bytes_total", "Bytes the spill handler freed.", {{"arena", name}},
            static_cast<double>(s.spilled_bytes));
  f.Counter("spillway_host_region_maps_total", "Regions mapped (and pinned) from the OS.",
            {{"arena", name}}, static_cast<double>(s.region_map_count));
  f.Counter("spillway_host_region_unmaps_total", "Regions given back to the OS.", {{"arena", name}},
            static_cast<double>(s.region_unmap_count));
  AddOwnerFamilies(f, "host", name, s);
}

// An NVMe arena: bytes by state, its budget, checksum and no-space failures, and its owners.
void AddNvmeFamilies(Families& f, const allocator::NvmeArena& a) {
  const allocator::NvmeArenaStats s = a.Stats();
  const std::string& name = a.tier_name();
  const std::pair<const char*, uint64_t> states[] = {
      {"capacity", s.capacity_bytes}, {"live", s.live_bytes}, {"free", s.free_bytes}};
  for (const auto& [state, bytes] : states) {
    f.Gauge("spillway_nvme_bytes",
            "NVMe arena bytes by state: capacity (the preallocated swap file), live, free.",
            {{"arena", name}, {"state", state}}, static_cast<double>(bytes));
  }
  f.Gauge("spillway_budget_bytes", "The configured budget of each tier.",
          {{"tier", "nvme"}, {"arena", name}}, static_cast<double>(s.budget_bytes));
  f.Counter("spillway_over_budget_total", "Requests refused because they would cross a budget.",
            {{"tier", "nvme"}, {"arena", name}}, static_cast<double>(s.over_budget_count));
  f.Counter("spillway_checksum_failures_total", "Reads whose CRC32C did not match.",
            {{"arena", name}}, static_cast<double>(s.checksum_failures));
  f.Counter("spillway_nvme_no_space_total", "Swap-file growths refused by the filesystem.",
            {{"arena", name}}, static_cast<double>(s.no_space_count));
  AddOwnerFamilies(f, "nvme", name, s);
}

// An I/O engine: bytes, operations and latency by op, its queue, retries, bounces, fallbacks.
void AddIoEngineFamilies(Families& f, const allocator::IoEngine& e) {
  const allocator::IoEngineStats s = e.Stats();
  const char* backend = allocator::IoBackendName(s.backend);
  for (const char* op : {"read", "write"}) {
    const bool read = op[0] == 'r';
    const Labels l = {{"op", op}, {"backend", backend}};
    f.Counter("spillway_io_bytes_total", "Bytes moved between host memory and files.", l,
              static_cast<double>(read ? s.read_bytes : s.write_bytes));
    f.Counter("spillway_io_operations_total", "Chunk operations completed.", l,
              static_cast<double>(read ? s.read_ops : s.write_ops));
    const auto& h = read ? s.read_latency : s.write_latency;
    f.Histogram("spillway_io_latency_seconds", "Latency of one chunk, submission to completion.", l,
                h.data(), h.size(),
                read ? s.read_latency_sum_seconds : s.write_latency_sum_seconds);
  }
  const Labels b = {{"backend", backend}};
  f.Gauge("spillway_io_in_flight", "Chunks submitted and not yet complete.", b,
          static_cast<double>(s.in_flight_chunks));
  f.Gauge("spillway_io_queued_requests", "Requests accepted and not yet complete.", b,
          static_cast<double>(s.queued_requests));
  f.Counter("spillway_io_failed_requests_total", "Requests that completed with an error.", b,
            static_cast<double>(s.failed_requests));
  f.Counter("spillway_io_retries_total", "Chunks resubmitted after EINTR or EAGAIN.", b,
            static_cast<double>(s.retries));
  f.Counter("spillway_io_short_resubmits_total", "Short transfers whose rest was resubmitted.", b,
            static_cast<double>(s.short_resubmits));
  f.Counter("spillway_bounce_buffer_uses_total",
            "Chunks staged through the bounce pool (buffer outside the arena or unaligned).", b,
            static_cast<double>(s.bounce_chunks));
  f.Counter("spillway_bounce_bytes_total", "Bytes staged through the bounce pool.", b,
            static_cast<double>(s.bounce_bytes));
  f.Gauge("spillway_io_registered_regions", "Host arena regions registered as fixed buffers.", b,
          static_cast<double>(s.registered_regions));
  // Every fallback shows here, not only in a log line.
  f.Gauge("spillway_io_engine_info",
          "1, labelled with the backend, why the thread pool runs (if it does), and how the "
          "ring's tables are registered.",
          {{"backend", backend},
           {"fallback_reason", s.fallback_reason},
           {"registration", s.registration}},
          1.0);
  f.Counter("spillway_io_ring_failures_total",
            "io_uring_submit_and_wait failures that stopped the ring (its requests failed).", b,
            static_cast<double>(s.ring_failures));
  f.Counter("spillway_io_buffer_registration_failures_total",
            "Arena regions that could not be registered as fixed buffers (served unfixed).", b,
            static_cast<double>(s.registration_failures));
  f.Counter("spillway_io_sqe_shortages_total",
            "Chunks deferred because the submission queue had no free entry.", b,
            static_cast<double>(s.sqe_shortages));
}

// A partition store: partitions, where their bytes are, swap-ins, spills, prefetches, handles.
void AddStoreFamilies(Families& f, const offload::PartitionStore& store) {
  const offload::PartitionStoreStats s = store.Stats();
  f.Gauge("spillway_partitions", "ZeRO-3 partitions registered in the store.", {},
          static_cast<double>(s.partitions));
  f.Gauge("spillway_partition_bytes", "Partition bytes by where their copies are now.",
          {{"tier", "host"}}, static_cast<double>(s.resident_bytes));
  f.Gauge("spillway_partition_bytes", "Partition bytes by where their copies are now.",
          {{"tier", "nvme"}}, static_cast<double>(s.nvme_bytes));
  f.Counter("spillway_partition_swap_ins_total", "Partitions read back into host memory.", {},
            static_cast<double>(s.swap_ins));
  f.Counter("spillway_partition_swap_in_bytes_total", "Bytes read back into host memory.", {},
            static_cast<double>(s.swap_in_bytes));
  f.Counter("spillway_partition_spills_total",
            "Partitions dropped from host memory under the budget (OPT victims).", {},
            static_cast<double>(s.spills));
  f.Counter("spillway_partition_spill_bytes_total", "Bytes dropped from host memory.", {},
            static_cast<double>(s.spill_bytes));
  f.Counter("spillway_partition_prefetches_total", "Swap-ins done ahead of use.", {},
            static_cast<double>(s.prefetches));
  f.Gauge("spillway_partition_handles", "Live partition handles.", {},
          static_cast<double>(s.live_handles));
}

// A transfer pipeline: bytes by direction and its failures.
void AddPipelineFamilies(Families& f, const offload::TransferPipeline& p) {
  const offload::TransferPipelineStats s = p.Stats();
  const std::pair<const char*, double> dirs[] = {
      {"nvme_to_device", static_cast<double>(s.nvme_to_device_bytes)},
      {"device_to_nvme", static_cast<double>(s.device_to_nvme_bytes)},
      {"host_to_device", static_cast<double>(s.host_to_device_bytes)}};
  for (const auto& [dir, bytes] : dirs) {
    f.Counter("spillway_transfer_bytes_total", "Bytes moved by the transfer pipeline.",
              {{"direction", dir}}, bytes);
  }
  f.Counter("spillway_transfer_failures_total", "Pipeline transfers that failed.", {},
            static_cast<double>(s.failures));
  f.Counter("spillway_transfer_checksum_failures_total",
            "Pipeline transfers whose chunked checksum did not match.", {},
            static_cast<double>(s.checksum_failures));
}

// A host optimizer: steps, skipped steps, elements and time, by ISA.
void AddOptimizerFamilies(Families& f, const engine::HostOptimizer& o) {
  const engine::HostOptimizerStats s = o.Stats();
  const Labels isa = {{"isa", engine::IsaName(o.isa())}};
  f.Counter("spillway_optimizer_steps_total", "Host optimizer steps applied.", isa,
            static_cast<double>(s.steps));
  f.Counter("spillway_optimizer_skipped_steps_total",
            "Host optimizer steps skipped for inf/NaN gradients (loss scaling).", isa,
            static_cast<double>(s.skipped_steps));
  f.Counter("spillway_optimizer_elements_total", "Elements updated by the host optimizer.", isa,
            static_cast<double>(s.elements_updated));
  f.Counter("spillway_optimizer_step_seconds_total", "Time spent in host optimizer steps.", isa,
            static_cast<double>(s.step_ns_total) / 1e9);
  f.Gauge("spillway_optimizer_last_step_seconds", "Duration of the last host optimizer step.", isa,
          static_cast<double>(s.last_step_ns) / 1e9);
}

// One rank of a node governor's ledger: its bookings by tier, live bytes by kind, its workers'
// bytes and its memory by owner.
void AddNodeRankFamilies(Families& f, const allocator::NodeRankStats& r) {
  const auto d = [](uint64_t v) { return static_cast<double>(v); };
  // "node_job", not "job": Prometheus gives "job" to the scrape target.
  const std::string rank = std::to_string(r.local_rank);
  for (int t = 0; t < allocator::kNodeTierCount; ++t) {
    f.Gauge("spillway_node_rank_bytes", "Bytes each local rank has booked, by tier.",
            {{"node_job", r.job},
             {"local_rank", rank},
             {"tier", allocator::NodeTierName(static_cast<allocator::NodeTier>(t))}},
            d(r.bytes[t]));
  }
  for (int k = 0; k < allocator::kKindCount; ++k) {
    f.Gauge("spillway_node_rank_live_bytes",
            "Each local rank's live host bytes by kind (as of its last region change or "
            "boundary).",
            {{"node_job", r.job},
             {"local_rank", rank},
             {"kind", allocator::KindName(static_cast<allocator::Kind>(k))}},
            d(r.host_by_kind[k]));
  }
  f.Gauge("spillway_node_rank_workers_private_bytes",
          "Private bytes of each local rank's child processes (DataLoader workers), read "
          "from /proc at its last epoch boundary.",
          {{"node_job", r.job}, {"local_rank", rank}}, d(r.workers_private_bytes));
  if (r.memory.total == 0) return;  // it never published its memory (Note [Every byte named])
  for (int o = 0; o < allocator::kMemoryOwnerCount; ++o) {
    f.Gauge("spillway_node_rank_memory_bytes",
            "Each local rank's resident memory by owner (arenas, torch_cpu, python, malloc, "
            "libraries, unowned, ...), read from /proc/self/smaps and the allocators' "
            "counters at its step boundaries.",
            {{"node_job", r.job},
             {"local_rank", rank},
             {"owner", allocator::MemoryOwnerName(static_cast<allocator::MemoryOwner>(o))}},
            d(r.memory.owners[o]));
  }
}

// A node governor's ledger: budgets, bookings, headroom, ranks and jobs, then each rank's.
void AddNodeFamilies(Families& f, const allocator::NodeGovernor& g) {
  const allocator::NodeStats s = g.Snapshot();  // the segment's lock only: no system call
  const auto d = [](uint64_t v) { return static_cast<double>(v); };
  const char* kBudgetHelp =
      "The budget of the memory limit's ledger, shared by every rank of every job under it "
      "(nvme 0: not capped).";
  f.Gauge("spillway_node_budget_bytes", kBudgetHelp, {{"tier", "host"}}, d(s.host_budget_bytes));
  f.Gauge("spillway_node_budget_bytes", kBudgetHelp, {{"tier", "nvme"}}, d(s.nvme_budget_bytes));
  const char* kCommittedHelp = "Bytes every rank of every job has booked in the ledger.";
  f.Gauge("spillway_node_committed_bytes", kCommittedHelp, {{"tier", "host"}},
          d(s.host_committed_bytes));
  f.Gauge("spillway_node_committed_bytes", kCommittedHelp, {{"tier", "nvme"}},
          d(s.nvme_committed_bytes));
  f.Gauge("spillway_node_headroom_bytes", "Host node budget not booked by any rank.", {},
          d(s.host_headroom_bytes));
  f.Gauge("spillway_node_memory_limit_bytes",
          "The memory limit the node budget was taken from (cgroup memory.max, else RAM).", {},
          d(s.memory_limit_bytes));
  f.Gauge("spillway_node_reserve_bytes",
          "Memory limit less the node budget: the OS, page cache, what no arena counts.", {},
          d(s.reserve_bytes));
  f.Gauge("spillway_node_ranks", "Ranks of every job holding a slot in the memory limit's ledger.",
          {}, d(s.ranks.size()));
  f.Gauge("spillway_node_jobs", "Jobs with live ranks in the memory limit's ledger.", {},
          d(s.jobs.size()));
  f.Counter("spillway_node_reaped_ranks_total", "Dead ranks whose bytes were given back.", {},
            d(s.reaped_ranks));
  f.Counter("spillway_node_trim_requests_total", "Cross-rank trims asked under node pressure.", {},
            d(s.trim_requests));
  f.Counter("spillway_node_over_budget_total", "Reservations the node budget refused.", {},
            d(s.over_budget_count));
  for (const allocator::NodeRankStats& r : s.ranks) AddNodeRankFamilies(f, r);
}

// `families` with the collector's constant labels added to every sample.
std::vector<MetricFamily> WithConstLabels(std::vector<MetricFamily> families,
                                          const Labels& labels) {
  if (!labels.empty()) {
    for (MetricFamily& family : families) {
      for (ClientMetric& m : family.metric) {
        for (const auto& [k, v] : labels) m.label.push_back({k, v});
      }
    }
  }
  return families;
}

}  // namespace

void Collector::Watch(const allocator::HostArena* a) {
  std::lock_guard<std::mutex> lock(mu_);
  hosts_.push_back(a);
}
void Collector::Watch(const allocator::NvmeArena* a) {
  std::lock_guard<std::mutex> lock(mu_);
  // A swap store made while spillway.metrics.serve() runs is offered twice; its series appear once.
  if (std::find(nvmes_.begin(), nvmes_.end(), a) != nvmes_.end()) return;
  nvmes_.push_back(a);
}
void Collector::Watch(const allocator::IoEngine* e) {
  std::lock_guard<std::mutex> lock(mu_);
  engines_.push_back(e);
}
void Collector::Watch(const allocator::Ledger* l) {
  std::lock_guard<std::mutex> lock(mu_);
  // Arenas that share a ledger each watch it; its series must appear once.
  if (std::find(ledgers_.begin(), ledgers_.end(), l) != ledgers_.end()) return;
  ledgers_.push_back(l);
}
void Collector::Watch(const offload::PartitionStore* st) {
  std::lock_guard<std::mutex> lock(mu_);
  stores_.push_back(st);
}
void Collector::Watch(const offload::TransferPipeline* p) {
  std::lock_guard<std::mutex> lock(mu_);
  pipelines_.push_back(p);
}

void Collector::Watch(const engine::HostOptimizer* o) {
  std::lock_guard<std::mutex> lock(mu_);
  optimizers_.push_back(o);
}

void Collector::Watch(const allocator::NodeGovernor* g) {
  std::lock_guard<std::mutex> lock(mu_);
  nodes_.push_back(g);
}

void Collector::SetConstLabels(std::vector<std::pair<std::string, std::string>> labels) {
  std::lock_guard<std::mutex> lock(mu_);
  const_labels_ = std::move(labels);
}

void Collector::Unwatch(const void* c) {
  std::lock_guard<std::mutex> lock(mu_);
  auto drop = [c](auto& v) {
    v.erase(std::remove_if(v.begin(), v.end(), [c](const void* p) { return p == c; }), v.end());
  };
  drop(hosts_);
  drop(nvmes_);
  drop(engines_);
  drop(ledgers_);
  drop(stores_);
  drop(pipelines_);
  drop(optimizers_);
  drop(nodes_);
}

std::vector<MetricFamily> Collector::Collect() const {
  Families f;
  AddProcessFamilies(f);  // syscalls before taking mu_
  std::lock_guard<std::mutex> lock(mu_);
  for (const allocator::Ledger* l : ledgers_) AddLedgerFamilies(f, *l);
  for (const allocator::HostArena* a : hosts_) AddHostFamilies(f, *a);
  for (const allocator::NvmeArena* a : nvmes_) AddNvmeFamilies(f, *a);
  for (const allocator::IoEngine* e : engines_) AddIoEngineFamilies(f, *e);
  for (const offload::PartitionStore* store : stores_) AddStoreFamilies(f, *store);
  for (const offload::TransferPipeline* p : pipelines_) AddPipelineFamilies(f, *p);
  for (const engine::HostOptimizer* o : optimizers_) AddOptimizerFamilies(f, *o);
  for (const allocator::NodeGovernor* g : nodes_) AddNodeFamilies(f, *g);
  return WithConstLabels(f.Take(), const_labels_);
}

}  // namespace spillway::metrics
