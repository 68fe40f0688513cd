// NodeGovernor's admission: whether a rank's declared need (and what its DataLoader workers will
// copy at a fork) fits the node before it allocates, with the verdict in one segment-wide record,
// and the over-budget message that names every rank's bytes. Note [Node governor] in
// docs/allocator.md.
#include <unistd.h>

#include <algorithm>
#include <string>
#include <utility>
#include <vector>

#include "node_segment.h"
#include "spillway/allocator/node_governor.h"
#include "spillway/base/bytes.h"
#include "spillway/base/log.h"

namespace spillway::allocator {

using node::Declaration;
using node::kMaxSlots;
using node::NowNs;
using node::Segment;
using node::SegmentLock;
using node::SleepMs;
using node::Slot;
using node::Verdict;

namespace {

// Takes a refused round's need back out of a declaration; the last call's numbers are zeroed, so a
// second take-back of the same round takes nothing.
void TakeBackLast(Declaration* d) {
  d->need -= std::min(d->need, d->last_need);
  d->fork -= std::min(d->fork, d->last_fork);
  d->last_need = d->last_fork = 0;
}

// "a; b; and 3 more job(s) with 12.0 MiB": the texts of the `most` largest of `by` (bytes, text),
// then what the rest hold together; the verdict's text is bounded (kVerdictChars).
std::string NameLargest(std::vector<std::pair<uint64_t, std::string>> by, size_t most,
                        const char* what) {
  std::sort(by.begin(), by.end(), [](const auto& a, const auto& b) { return a.first > b.first; });
  std::string out;
  uint64_t rest = 0;
  for (size_t i = 0; i < by.size(); ++i) {
    if (i < most) {
      out += StrCat(out.empty() ? "" : "; ", by[i].second);
    } else {
      rest += by[i].first;
    }
  }
  if (by.size() > most)
    out += StrCat("; and ", by.size() - most, " more ", what, " with ", FormatMiB(rest));
  return out;
}

// The largest few other jobs or ranks named in a verdict: with every process a job there may be
// 63, and the verdict's text is bounded (kVerdictChars).
constexpr size_t kNamed = 8;

// Writes the round's verdict into the job's entry; assumes the segment's lock.
void WriteVerdict(node::JobEntry& e, uint32_t round, Verdict v, const std::string& text) {
  if (v != Verdict::kFits) {
    // The refused round is taken back for every rank of the job now, not when each returns: the
    // other jobs' admission must not count needs nobody will hold.
    for (Declaration& d : e.declarations) {
      if (d.round == round) TakeBackLast(&d);
    }
  }
  // The round last: a writer killed midway leaves the previous round's verdict, never this
  // round's number on another round's verdict.
  e.verdict = v;
  std::snprintf(e.verdict_text, sizeof(e.verdict_text), "%s", text.c_str());
  __atomic_store_n(&e.verdict_round, round, __ATOMIC_RELEASE);
}

// This rank's answer from the verdict of its round; assumes the segment's lock.
Status ReadVerdict(node::JobEntry& e, int local_rank, uint32_t round) {
  const std::string text = e.verdict_text;
  if (e.verdict == Verdict::kFits) return Status::Ok();
  // A refused round's need is taken back (a retry with a smaller config is judged on its own):
  // when the verdict was written, for the ranks that had declared by then; here for a rank that
  // declared after it (last_need was zeroed for the others, so nothing is taken twice).
  Declaration& mine = e.declarations[local_rank];
  if (mine.round == round) TakeBackLast(&mine);
  if (e.verdict == Verdict::kOverBudget) return Status::OverBudget(text);
  return Status::Make(StatusCode::kUnavailable, text);
}

// The job's local ranks expected in the round (below its local world size, or holding a slot)
// that have not declared in it yet; assumes the segment's lock.
std::vector<int> MissingRanks(const Segment* s, const node::JobEntry& e, int job, uint32_t round) {
  std::vector<int> missing;
  for (int r = 0; r < kMaxSlots; ++r) {
    const bool expected = r < e.local_world_size || node::RankSlot(s, job, r) >= 0;
    if (expected && e.declarations[r].round < round) missing.push_back(r);
  }
  return missing;
}

// What the job's ranks declared: their sum, how many declared, and each rank's need in words.
struct Declared {
  uint64_t total = 0;
  int ranks = 0;
  std::string each;
};
Declared SumDeclarations(const node::JobEntry& e) {
  Declared out;
  for (int r = 0; r < kMaxSlots; ++r) {
    const Declaration& d = e.declarations[r];
    if (d.round == 0) continue;
    ++out.ranks;
    out.total += d.need;
    out.each +=
        StrCat(out.each.empty() ? "" : "; ", "local rank ", r, " ", FormatMiB(d.need),
               d.fork != 0 ? StrCat(" (of which its workers' fork copy ", FormatMiB(d.fork), ")")
                           : std::string());
  }
  return out;
}

// What the other jobs under the same memory limit hold or declared, each live rank's; *named: the
// largest few of them by name.
uint64_t OtherJobsHeld(const Segment* s, int job, std::string* named) {
  uint64_t others = 0;
  std::vector<std::pair<uint64_t, std::string>> held_by;
  for (int j = 0; j < node::kMaxJobs; ++j) {
    if (j == job) continue;
    int ranks = 0;
    const uint64_t held = node::JobHeldOrDeclared(s, j, &ranks);
    if (ranks == 0) continue;
    others += held;
    held_by.emplace_back(
        held, StrCat("job '", s->jobs[j].name, "' ", FormatMiB(held), " (", ranks, " rank(s))"));
  }
  *named = NameLargest(std::move(held_by), kNamed, "job(s)");
  return others;
}

// What the ranks under the limit hold outside the arenas, as each last published it (this job's
// ranks just before they declared): measured, where the budget's reserve is a fixed guess.
// *named: the largest few ranks by name.
uint64_t HeldOutside(const NodeStats& snap, const std::string& job_name, std::string* named) {
  uint64_t outside = 0;
  std::vector<std::pair<uint64_t, std::string>> outside_by;
  for (const NodeRankStats& r : snap.ranks) {
    const uint64_t held = node::HeldOutsideArenas(r.memory);
    if (held == 0) continue;
    outside += held;
    outside_by.emplace_back(held, StrCat(r.job == job_name ? "" : StrCat("job '", r.job, "' "),
                                         "local rank ", r.local_rank, " ", FormatMiB(held), " (",
                                         node::DescribeHeldOutsideArenas(r.memory, 3), ")"));
  }
  *named = NameLargest(std::move(outside_by), kNamed, "rank(s)");
  return outside;
}

// The verdict of a round every rank of the job declared in, with its text: the job's needs
// beside the other jobs' against the node budget and, with what the ranks hold outside the
// arenas, against the memory limit. Assumes the segment's lock.
std::pair<Verdict, std::string> JudgeRound(const Segment* s, const std::string& path,
                                           const node::JobEntry& e, int job,
                                           const std::string& job_name, const std::string& detail) {
  const NodeStats snap = node::ReadStats(s, path, job_name);
  const Declared declared = SumDeclarations(e);
  const uint64_t total = declared.total;
  std::string other_jobs, outside_each;
  const uint64_t others = OtherJobsHeld(s, job, &other_jobs);
  const uint64_t outside = HeldOutside(snap, job_name, &outside_each);
  // The job's needs (or what its ranks already hold in the arenas, where more) must fit the
  // memory limit beside what the ranks hold outside the arenas too.
  int own_ranks = 0;
  const uint64_t own = std::max(total, node::JobHeldOrDeclared(s, job, &own_ranks));
  const bool over_limit =
      snap.memory_limit_bytes != 0 && own + others + outside > snap.memory_limit_bytes;
  if (total + others <= snap.host_budget_bytes && !over_limit) return {Verdict::kFits, ""};
  if (total + others <= snap.host_budget_bytes) {
    return {Verdict::kOverBudget,
            StrCat("node admission: the ", declared.ranks, " local ranks of job '", job_name,
                   "' need ", FormatBytes(total), " of host memory together",
                   others != 0 ? StrCat(", beside ", FormatBytes(others),
                                        " that the other jobs' arenas hold or declared")
                               : std::string(),
                   ", and the ranks under this memory limit already hold ", FormatBytes(outside),
                   " outside Spillway's arenas, as each last published it (", outside_each,
                   "): together more than the memory limit of ",
                   FormatBytes(snap.memory_limit_bytes), " for ", snap.scope,
                   ", though within the node budget of ", FormatBytes(snap.host_budget_bytes),
                   ", whose reserve is too small for what these ranks hold besides. Each rank's "
                   "need: ",
                   declared.each,
                   ". Nothing was allocated. Free what the ranks hold outside the arenas (a "
                   "model loaded on every rank: zero.Init, or load it on one), run fewer ranks "
                   "per node, or offload more state to NVMe.",
                   detail.empty() ? "" : " ", detail)};
  }
  return {Verdict::kOverBudget,
          StrCat("node admission: the ", declared.ranks, " local ranks of job '", job_name,
                 "' need ", FormatBytes(total), " of host memory together",
                 others != 0 ? StrCat(", beside ", FormatBytes(others),
                                      " that the other jobs under the same memory limit hold "
                                      "or declared (",
                                      other_jobs, ")")
                             : std::string(),
                 ": more than the node budget of ", FormatBytes(snap.host_budget_bytes), " for ",
                 snap.scope, " ", DescribeNodeBudget(snap), ". Each rank's need: ", declared.each,
                 ". Nothing was allocated.", detail.empty() ? "" : " ", detail)};
}

}  // namespace

std::string NodeGovernor::DescribeOverBudget(NodeTier tier, uint64_t bytes,
                                             const std::vector<std::string>& silent) const {
  const NodeStats s = Stats();
  if (tier == NodeTier::kNvme) {
    return StrCat(
        "node budget: local rank ", local_rank(), " of job '", job(), "' needs ",
        FormatBytes(bytes), " more NVMe space, but the node's NVMe budget of ",
        FormatBytes(s.nvme_budget_bytes),
        " (SPILLWAY_NODE_NVME_BUDGET_BYTES, else 90% of the free space where the first NVMe arena "
        "under this memory limit swaps) has ",
        FormatBytes(s.nvme_committed_bytes), " booked by ", s.ranks.size(),
        " rank(s): ", DescribeNodeRanks(s),
        ". Free space on the disk behind nvme_path and raise SPILLWAY_NODE_NVME_BUDGET_BYTES, keep "
        "more state in host memory, or run fewer ranks per node");
  }
  std::string trimmed = "after every rank trimmed its retained cache";
  if (!silent.empty()) {
    std::string names;
    for (const std::string& r : silent) names += StrCat(names.empty() ? "" : ", ", r);
    trimmed = StrCat("after a trim request that ", names, " did not answer within ",
                     options_.trim_timeout.count(), " ms");
  }
  return StrCat(
      "node budget: local rank ", local_rank(), " of job '", job(), "' needs ", FormatBytes(bytes),
      " more ", NodeTierName(tier), " memory, but the host budget of ",
      FormatBytes(s.host_budget_bytes), " for ", s.scope, " ", DescribeNodeBudget(s), " has ",
      FormatBytes(s.host_committed_bytes), " booked by ", s.ranks.size(), " rank(s) of ",
      s.jobs.size(), " job(s) ", trimmed, ": ", DescribeNodeRanks(s),
      ". Offload more state to NVMe (offload_optimizer.device / offload_param.device = nvme), run "
      "fewer ranks per node, or raise SPILLWAY_NODE_BUDGET_BYTES (SPILLWAY_NODE_RESERVE_BYTES) "
      "if the node's memory holds more than the reserve keeps back");
}

Status NodeGovernor::Admit(uint64_t need_bytes, uint64_t workers_fork_bytes,
                           std::chrono::milliseconds timeout, const std::string& detail) {
  SPILLWAY_RETURN_IF_ERROR(process_.Check("NodeGovernor", "Admit"));
  if (left_.load(std::memory_order_acquire)) {
    return Status::FailedPrecondition("node governor: Admit after this rank left the node");
  }
  const uint32_t round = admit_rounds_.fetch_add(1, std::memory_order_acq_rel) + 1;
  {
    SPILLWAY_ASSIGN_OR_RETURN(auto lock, SegmentLock::Take(segment_, options_.lock_timeout, path_));
    if (!OwnsSlotLocked()) {
      return Status::FailedPrecondition(StrCat("node admission: local rank ", local_rank(),
                                               " of job '", job(),
                                               "' already left the node (or was reaped as dead)"));
    }
    if (entry().local_world_size == 0) {
      return Status::FailedPrecondition(
          StrCat("node admission for job '", job(),
                 "': the number of local ranks is not known, so no rank can tell when all have "
                 "declared; start the ranks with a launcher that sets LOCAL_WORLD_SIZE (torchrun, "
                 "accelerate) or LOCAL_SIZE (deepspeed), or set LOCAL_WORLD_SIZE yourself"));
    }
    Declaration& mine = entry().declarations[local_rank()];
    mine.need += need_bytes;
    mine.fork += workers_fork_bytes;
    mine.last_need = need_bytes;
    mine.last_fork = workers_fork_bytes;
    mine.round = round;
  }
  const uint64_t deadline = NowNs() + static_cast<uint64_t>(timeout.count()) * 1'000'000ull;
  while (true) {
    SPILLWAY_RETURN_IF_ERROR(ReapDead());
    SPILLWAY_ASSIGN_OR_RETURN(auto lock, SegmentLock::Take(segment_, options_.lock_timeout, path_));
    if (!OwnsSlotLocked()) {  // left (the process is exiting) or reaped: the job entry may be
                              // reused
      return Status::FailedPrecondition(StrCat("node admission: local rank ", local_rank(),
                                               " of job '", job(),
                                               "' left the node while waiting; nothing declared"));
    }
    node::JobEntry& e = entry();
    const int job_index = job_.load(std::memory_order_acquire);  // only Rekey moves it, locked
    if (e.verdict_round >= round) return ReadVerdict(e, local_rank(), round);
    const std::vector<int> missing = MissingRanks(segment_, e, job_index, round);
    if (missing.empty()) {  // this rank completes the round: its verdict is every rank's
      const auto [verdict, text] = JudgeRound(segment_, path_, e, job_index, job(), detail);
      WriteVerdict(e, round, verdict, text);
      return ReadVerdict(e, local_rank(), round);
    }
    if (NowNs() > deadline) {
      std::string names;
      for (int r : missing) names += StrCat(names.empty() ? "" : ", ", r);
      WriteVerdict(e, round, Verdict::kAborted,
                   StrCat("node admission: local rank(s) ", names, " of job '", job(),
                          "' did not declare their host memory within ", timeout.count(),
                          " ms; each rank declares at deepspeed.initialize (or spillway.install "
                          "with a declared size). Check that they started, or raise "
                          "SPILLWAY_NODE_ADMIT_TIMEOUT"));
      return ReadVerdict(e, local_rank(), round);
    }
    { auto unlock = std::move(lock); }
    SleepMs(5);
  }
}

}  // namespace spillway::allocator
