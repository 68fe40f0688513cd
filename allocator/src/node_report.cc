// The node budget in words: the tier names, where the budget came from, what each rank holds, and
// NodeStats' table (`spillway node` and the over-budget messages). Note [Node governor] in
// docs/allocator.md.
#include <algorithm>
#include <cstdio>
#include <sstream>
#include <utility>
#include <vector>

#include "node_segment.h"
#include "spillway/allocator/node_governor.h"
#include "spillway/base/bytes.h"

namespace spillway::allocator {

const char* NodeTierName(NodeTier tier) {
  static constexpr const char* kNames[kNodeTierCount] = {"pinned", "pageable", "nvme"};
  return kNames[static_cast<int>(tier)];
}

std::string DescribeNodeBudget(const NodeStats& s) {
  if (s.budget_explicit) {
    return StrCat(
        "(set by job '", s.budget_by,
        "' with SPILLWAY_NODE_BUDGET_BYTES or SPILLWAY_NODE_RESERVE_BYTES; the memory limit is ",
        FormatBytes(s.memory_limit_bytes), ")");
  }
  return StrCat("(the memory limit ", FormatBytes(s.memory_limit_bytes), " less a reserve of ",
                FormatBytes(s.reserve_bytes),
                " for the OS, the page cache and what no arena counts)");
}

namespace {

// "optimizer_state 2.5 MiB, param 1.0 MiB": the kinds that hold bytes.
std::string KindsText(const KindBytes& by_kind) {
  std::string out;
  for (int k = 0; k < kKindCount; ++k) {
    if (by_kind[k] == 0) continue;
    out +=
        StrCat(out.empty() ? "" : ", ", KindName(static_cast<Kind>(k)), " ", FormatMiB(by_kind[k]));
  }
  return out;
}

}  // namespace

namespace node {

namespace {

constexpr MemoryOwner kHeldOutside[] = {MemoryOwner::kTorchCpu,   MemoryOwner::kTorchPinned,
                                        MemoryOwner::kCudaDriver, MemoryOwner::kPython,
                                        MemoryOwner::kMalloc,     MemoryOwner::kMallocFree,
                                        MemoryOwner::kUnowned};

}  // namespace

uint64_t HeldOutsideArenas(const ProcessMemory& memory) {
  uint64_t held = 0;
  for (const MemoryOwner o : kHeldOutside) held += memory.owners[static_cast<int>(o)];
  return held;
}

std::string DescribeHeldOutsideArenas(const ProcessMemory& memory, int most) {
  std::vector<std::pair<uint64_t, MemoryOwner>> held;
  for (const MemoryOwner o : kHeldOutside) {
    const uint64_t b = memory.owners[static_cast<int>(o)];
    if (b != 0) held.emplace_back(b, o);
  }
  std::sort(held.begin(), held.end(),
            [](const auto& a, const auto& b) { return a.first > b.first; });
  std::string out;
  for (size_t i = 0; i < held.size() && static_cast<int>(i) < most; ++i) {
    out += StrCat(out.empty() ? "" : ", ", MemoryOwnerName(held[i].second), " ",
                  FormatMiB(held[i].first));
  }
  return out.empty() ? "nothing" : out;
}

}  // namespace node

std::string DescribeNodeRanks(const NodeStats& stats) {
  std::string out;
  const bool name_jobs = stats.jobs.size() > 1;  // one job: its name is in the message already
  for (const NodeRankStats& r : stats.ranks) {
    out += StrCat(out.empty() ? "" : "; ", name_jobs ? StrCat("job '", r.job, "' ") : "",
                  "local rank ", r.local_rank, " (pid ", r.pid, ") pinned ", FormatMiB(r.bytes[0]),
                  ", pageable ", FormatMiB(r.bytes[1]));
    if (r.bytes[2] != 0) out += StrCat(", nvme ", FormatMiB(r.bytes[2]));
    const std::string kinds = KindsText(r.host_by_kind);
    if (!kinds.empty()) out += StrCat(" [", kinds, "]");
    if (r.workers != 0) {
      out += StrCat(", ", r.workers, " workers' private ", FormatMiB(r.workers_private_bytes));
    }
    if (r.memory.total != 0) {  // published (spillway.node.memory())
      out += StrCat(", outside the arenas ", FormatMiB(node::HeldOutsideArenas(r.memory)), " (",
                    node::DescribeHeldOutsideArenas(r.memory, 3), ")");
    }
  }
  return out.empty() ? "no rank holds anything" : out;
}

namespace {

std::string Cell(uint64_t bytes) { return bytes == 0 ? "-" : FormatMiB(bytes); }

}  // namespace

std::string NodeStats::ToString() const {
  std::ostringstream out;
  out << "ledger for " << scope << "  (segment " << path << ")\n";
  out << "host budget " << FormatBytes(host_budget_bytes) << " " << DescribeNodeBudget(*this)
      << "\n";
  out << "host committed " << FormatBytes(host_committed_bytes) << " (peak "
      << FormatBytes(peak_host_committed_bytes) << "), headroom "
      << FormatBytes(host_headroom_bytes) << "\n";
  out << "nvme committed " << FormatBytes(nvme_committed_bytes) << ", budget "
      << (nvme_budget_bytes == 0 ? std::string("not capped") : FormatBytes(nvme_budget_bytes))
      << "\n";
  out << "jobs " << jobs.size() << ", ranks " << ranks.size() << "; reaped " << reaped_ranks
      << ", trim requests " << trim_requests << ", refusals " << over_budget_count << "\n";
  for (const NodeJobStats& j : jobs) {
    out << "  job " << j.name << ": " << j.ranks << " of "
        << (j.local_world_size == 0 ? std::string("?") : std::to_string(j.local_world_size))
        << " ranks, host " << FormatMiB(j.host_bytes) << ", nvme " << FormatMiB(j.nvme_bytes)
        << ", declared " << FormatMiB(j.declared_bytes) << (j.name == job ? "  (this one)" : "")
        << "\n";
  }
  out << "\n";
  char line[384];
  std::snprintf(line, sizeof(line), "%-24s %-5s %-8s %12s %12s %12s %12s %12s %16s  %s\n", "job",
                "rank", "pid", "pinned", "pageable", "nvme", "peak host", "declared", "workers",
                "by kind");
  out << line;
  for (const NodeRankStats& r : ranks) {
    const std::string kinds = KindsText(r.host_by_kind);
    const std::string workers =
        r.workers == 0 ? "-" : StrCat(r.workers, " / ", FormatMiB(r.workers_private_bytes));
    std::snprintf(line, sizeof(line), "%-24s %-5d %-8d %12s %12s %12s %12s %12s %16s  %s\n",
                  r.job.c_str(), r.local_rank, static_cast<int>(r.pid), Cell(r.bytes[0]).c_str(),
                  Cell(r.bytes[1]).c_str(), Cell(r.bytes[2]).c_str(),
                  Cell(r.peak_host_bytes).c_str(), Cell(r.declared_bytes).c_str(), workers.c_str(),
                  kinds.empty() ? "-" : kinds.c_str());
    out << line;
  }
  for (const NodeRankStats& r : ranks) {
    if (r.memory.total == 0) continue;  // never published (a rank outside spillway.install())
    out << "  " << r.job << " rank " << r.local_rank << " resident " << FormatMiB(r.memory.total)
        << ": " << DescribeMemory(r.memory) << "\n";
  }
  return out.str();
}

}  // namespace spillway::allocator
