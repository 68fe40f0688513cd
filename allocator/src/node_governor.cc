// NodeGovernor: booking and giving back bytes, cross-rank trims, the watcher thread, leaving.
// Joining a ledger is in node_join.cc, the segment's mechanics in node_segment.*, admission in
// node_admission.cc, the job from the environment in node_job.cc, the reports in node_report.cc.
// Note [Node governor] in docs/allocator.md.
#include "spillway/allocator/node_governor.h"

#include <linux/futex.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <climits>
#include <new>
#include <sstream>

#include "node_segment.h"
#include "spillway/base/bytes.h"
#include "spillway/base/log.h"

namespace spillway::allocator {

using node::ClearSlot;
using node::DirLock;
using node::kMaxSlots;
using node::NowNs;
using node::Segment;
using node::SegmentLock;
using node::Slot;

namespace {

std::mutex g_current_mu;                  // never taken in a forked child (see Current)
std::shared_ptr<NodeGovernor> g_current;  // guarded by g_current_mu
std::atomic<const ProcessTag*> g_current_process{nullptr};
thread_local bool t_on_watcher = false;

// The publishers and the watcher's acknowledgement write the slot without the lock: only while it
// is still this rank's (a slot reaped meanwhile may already be another job's rank's). A relaxed
// read; the slot changes hands under the lock, so this narrows the window, it does not close it.
bool StillMine(const Slot& slot, pid_t pid, uint64_t generation) {
  return __atomic_load_n(&slot.pid, __ATOMIC_RELAXED) == pid &&
         __atomic_load_n(&slot.generation, __ATOMIC_RELAXED) == generation;
}

}  // namespace

NodeGovernor::NodeGovernor(NodeGovernorOptions options, std::string path, int fd,
                           node::Segment* segment, int slot, int job, int local_rank,
                           uint64_t generation)
    : options_(std::move(options)),
      path_(std::move(path)),
      fd_(fd),
      segment_(segment),
      slot_(slot),
      job_(job),
      local_rank_(local_rank),
      job_name_(options_.job),
      ledger_(options_.ledger),
      generation_(generation),
      pid_(process_.pid()) {
  if (options_.watcher) watcher_ = std::thread([this] { WatchLoop(); });
}

NodeGovernor::~NodeGovernor() {
  if (!process_.InOwner()) {
    // A forked child: the slot, the segment's lock and the watcher are the parent's.
    if (watcher_.joinable()) new (&watcher_) std::thread();  // forget the parent's thread
    return;
  }
  Leave();
  munmap(segment_, sizeof(Segment));
  close(fd_);
}

void NodeGovernor::Leave() {
  if (!process_.InOwner() || left_.exchange(true)) return;
  stop_.store(true, std::memory_order_release);
  node::Futex(&segment_->trim_word, FUTEX_WAKE, INT_MAX, nullptr);
  if (watcher_.joinable()) watcher_.join();
  // Dead peers must not keep the segment alive; a failure here only leaves it to a later Join.
  node::Reap(segment_, slot_, options_.lock_timeout, path_).status().IgnoreError();
  bool last = false;
  uint64_t held = 0;
  {
    auto lock = SegmentLock::Take(segment_, options_.lock_timeout, path_);
    if (!lock.ok()) {
      Log(LogLevel::kError,
          StrCat(lock.status().ToString(), "; local rank ", local_rank(), " of job '", job(),
                 "' leaves its slot to be reaped when this process exits"));
      return;
    }
    if (!OwnsSlotLocked()) return;  // reaped by another process meanwhile
    SettleOwedLocked();
    Slot& mine = segment_->slots[slot_];
    held = mine.bytes[0] + mine.bytes[1] + mine.bytes[2];
    segment_->host_committed -= mine.bytes[0] + mine.bytes[1];
    segment_->nvme_committed -= mine.bytes[2];
    ClearSlot(&mine);
    last = std::none_of(std::begin(segment_->slots), std::end(segment_->slots),
                        [](const Slot& s) { return s.pid != 0; });
    if (last) segment_->closed = 1;
  }
  if (held != 0) {
    Log(LogLevel::kInfo,
        StrCat("node governor: local rank ", local_rank(), " left job '", job(), "' with ",
               FormatBytes(held), " still booked (its arenas outlive it); given back"));
  }
  if (last) {  // the closer removes it; a Join that finds it closed finishes the removal instead
    auto dir_lock = DirLock::Take(options_.dir, options_.lock_timeout);
    if (dir_lock.ok()) node::UnlinkIfSame(path_, fd_);
  }
}

std::shared_ptr<NodeGovernor> NodeGovernor::Current() {
  // In a forked child the governor is the parent's, and g_current_mu may have been held at fork.
  const ProcessTag* owner = g_current_process.load(std::memory_order_acquire);
  if (owner == nullptr || !owner->InOwner()) return nullptr;
  std::lock_guard<std::mutex> lock(g_current_mu);
  return g_current;
}

void NodeGovernor::SetCurrent(std::shared_ptr<NodeGovernor> governor) {
  static const ProcessTag* tags = nullptr;  // one per process that set it (never freed)
  std::lock_guard<std::mutex> lock(g_current_mu);
  g_current = std::move(governor);
  if (tags == nullptr || !tags->InOwner()) tags = new ProcessTag();
  g_current_process.store(g_current != nullptr ? tags : nullptr, std::memory_order_release);
}

uint64_t NodeGovernor::host_budget_bytes() const { return segment_->host_budget; }

node::JobEntry& NodeGovernor::entry() const {
  return segment_->jobs[job_.load(std::memory_order_acquire)];
}

std::string NodeGovernor::job() const {
  std::lock_guard<std::mutex> l(identity_mu_);
  return job_name_;
}

Status NodeGovernor::ReapDead() const {
  return node::Reap(segment_, slot_, options_.lock_timeout, path_).status();
}

Status NodeGovernor::Rekey(const std::string& to_job, int to_rank, int to_size) {
  SPILLWAY_RETURN_IF_ERROR(process_.Check("NodeGovernor", "Rekey"));
  if (!node::ValidJob(to_job)) {
    return Status::InvalidArgument(StrCat("node governor: job '", to_job, "' must be 1 to ",
                                          node::kJobChars,
                                          " characters of A-Z, a-z, 0-9, '.', '_', '-'"));
  }
  if (to_rank < 0 || to_rank >= kMaxSlots || to_size < 0 || to_size > kMaxSlots ||
      (to_size != 0 && to_rank >= to_size)) {
    return Status::InvalidArgument(StrCat("node governor: local rank ", to_rank, " of ", to_size,
                                          " is not a rank of a job of at most ", kMaxSlots,
                                          " local ranks"));
  }
  SPILLWAY_ASSIGN_OR_RETURN(auto lock,
                            node::SegmentLock::Take(segment_, options_.lock_timeout, path_));
  const std::string was = job();
  if (!OwnsSlotLocked()) {
    return Status::FailedPrecondition(
        StrCat("node governor: local rank ", local_rank(), " of job '", was,
               "' left the node; it cannot move to job '", to_job, "'"));
  }
  if (admit_rounds_.load(std::memory_order_acquire) != 0) {
    return Status::FailedPrecondition(StrCat(
        "node governor: local rank ", local_rank(), " of job '", was,
        "' already declared its need for admission there; it cannot move to job '", to_job, "'"));
  }
  int to = node::FindJob(segment_, to_job);
  const bool running = to >= 0 && node::JobHasRanks(segment_, to);
  if (running) {
    const int holder = node::RankSlot(segment_, to, to_rank);
    if (holder >= 0 && holder != slot_) {
      return Status::FailedPrecondition(
          StrCat("node governor: local rank ", to_rank, " of job '", to_job, "' is held by pid ",
                 segment_->slots[holder].pid, ", which is alive; this process (job '", was,
                 "') cannot take it"));
    }
    const int counted = segment_->jobs[to].local_world_size;
    if (to_size != 0 && counted != 0 && counted != to_size) {
      return Status::FailedPrecondition(StrCat("node governor: job '", to_job, "' counts ", counted,
                                               " local ranks, and this process says ", to_size));
    }
  } else {
    to = node::TakeJob(segment_, to_job);
    if (to < 0) {
      return Status::ResourceExhausted(
          StrCat("node governor: the ledger ", path_, " already holds ", node::kMaxJobs,
                 " jobs with live ranks; job '", to_job, "' cannot be made"));
    }
  }
  Slot& mine = segment_->slots[slot_];
  const int from = mine.job;
  segment_->jobs[from].declarations[mine.local_rank] = node::Declaration{};
  mine.job = to;
  mine.local_rank = to_rank;
  node::JobEntry& entry = segment_->jobs[to];
  entry.declarations[to_rank] = node::Declaration{};
  if (entry.local_world_size == 0) entry.local_world_size = to_size;
  {
    std::lock_guard<std::mutex> l(identity_mu_);
    job_name_ = to_job;
    job_.store(to, std::memory_order_release);
    local_rank_.store(to_rank, std::memory_order_release);
  }
  { auto unlock = std::move(lock); }  // no lock held across the log's write
  Log(LogLevel::kInfo, StrCat("node governor: pid ", pid_, " moved from job '", was,
                              "' to local rank ", to_rank, " of job '", to_job, "' in ", path_));
  return Status::Ok();
}

bool NodeGovernor::OwnsSlotLocked() const {
  // Leave and a reap both clear the slot, which bumps its generation.
  const Slot& mine = segment_->slots[slot_];
  return mine.pid == pid_ && mine.generation == generation_;
}

void NodeGovernor::SettleOwedLocked() {
  for (int t = 0; t < kNodeTierCount; ++t) {
    const uint64_t owed = owed_[t].exchange(0, std::memory_order_acq_rel);
    if (owed != 0) ReleaseLocked(static_cast<NodeTier>(t), owed);
  }
}

void NodeGovernor::ReleaseLocked(NodeTier tier, uint64_t bytes) {
  if (!OwnsSlotLocked()) return;  // left, or reaped: the slot's bytes were given back whole
  Slot& mine = segment_->slots[slot_];
  uint64_t& held = mine.bytes[static_cast<int>(tier)];
  uint64_t& committed =
      tier == NodeTier::kNvme ? segment_->nvme_committed : segment_->host_committed;
  // Never below zero: a caller's bug must not wrap the totals (Validate would name it).
  bytes = std::min({bytes, held, committed});
  held -= bytes;
  committed -= bytes;
}

Status NodeGovernor::TryReserve(NodeTier tier, uint64_t bytes) {
  SPILLWAY_RETURN_IF_ERROR(process_.Check("NodeGovernor", "Reserve"));
  auto left = [&] {
    return Status::FailedPrecondition(StrCat("node governor: local rank ", local_rank(),
                                             " already left job '", job(),
                                             "' (the process is exiting, or it was reaped as "
                                             "dead); nothing is booked"));
  };
  if (left_.load(std::memory_order_acquire)) return left();
  if (bytes == 0) return Status::Ok();
  SPILLWAY_ASSIGN_OR_RETURN(auto lock, SegmentLock::Take(segment_, options_.lock_timeout, path_));
  if (!OwnsSlotLocked()) return left();
  SettleOwedLocked();
  Slot& mine = segment_->slots[slot_];
  const bool host = tier != NodeTier::kNvme;
  uint64_t& committed = host ? segment_->host_committed : segment_->nvme_committed;
  const uint64_t budget = host ? segment_->host_budget : segment_->nvme_budget;
  if (budget != 0 && (bytes > budget || committed > budget - bytes)) {
    return Status::OverBudget(StrCat("node ", host ? "host" : "nvme", " budget of ",
                                     FormatBytes(budget), " has ",
                                     FormatBytes(budget > committed ? budget - committed : 0),
                                     " free; ", FormatBytes(bytes), " asked"));
  }
  mine.bytes[static_cast<int>(tier)] += bytes;
  committed += bytes;
  if (host) {
    mine.peak_host = std::max(mine.peak_host, mine.bytes[0] + mine.bytes[1]);
    segment_->peak_host_committed = std::max(segment_->peak_host_committed, committed);
  }
  return Status::Ok();
}

Status NodeGovernor::Reserve(NodeTier tier, uint64_t bytes) {
  Status st = TryReserve(tier, bytes);
  if (st.code() != StatusCode::kOverBudget) return st;
  // Pressure: dead ranks' bytes first, then (host tiers) every rank's retained cache.
  SPILLWAY_RETURN_IF_ERROR(ReapDead());
  st = TryReserve(tier, bytes);
  if (st.code() != StatusCode::kOverBudget) return st;
  std::vector<std::string> silent;
  if (tier != NodeTier::kNvme) {  // trimming host caches frees no disk
    TrimLocal();
    SPILLWAY_ASSIGN_OR_RETURN(silent, RequestTrimAndWait());
    st = TryReserve(tier, bytes);
    if (st.code() != StatusCode::kOverBudget) return st;
  }
  {
    SPILLWAY_ASSIGN_OR_RETURN(auto lock, SegmentLock::Take(segment_, options_.lock_timeout, path_));
    segment_->over_budget++;
  }
  return Status::OverBudget(DescribeOverBudget(tier, bytes, silent));
}

void NodeGovernor::Release(NodeTier tier, uint64_t bytes) {
  if (bytes == 0 || !process_.InOwner() || left_.load(std::memory_order_acquire)) return;
  auto lock = SegmentLock::Take(segment_, options_.release_timeout, path_);
  if (!lock.ok()) {
    // Owed, not lost: given back at this rank's next lock (a free must not wait on a stopped rank).
    owed_[static_cast<int>(tier)].fetch_add(bytes, std::memory_order_acq_rel);
    Log(LogLevel::kWarning, StrCat(lock.status().ToString(), "; ", FormatBytes(bytes), " of ",
                                   NodeTierName(tier), " are owed to the node until then"));
    return;
  }
  SettleOwedLocked();
  ReleaseLocked(tier, bytes);
}

Result<uint64_t> NodeGovernor::OfferNvmeBudget(uint64_t bytes) {
  SPILLWAY_ASSIGN_OR_RETURN(auto lock, SegmentLock::Take(segment_, options_.lock_timeout, path_));
  if (segment_->nvme_budget == 0) segment_->nvme_budget = bytes;
  return segment_->nvme_budget;
}

Slot* NodeGovernor::PublishedSlot() {
  if (!process_.InOwner() || left_.load(std::memory_order_acquire) ||
      !StillMine(segment_->slots[slot_], pid_, generation_)) {
    return nullptr;
  }
  return &segment_->slots[slot_];
}

void NodeGovernor::PublishKinds(NodeTier tier, const KindBytes& live_by_kind) {
  Slot* mine = tier == NodeTier::kNvme ? nullptr : PublishedSlot();
  if (mine == nullptr) return;
  for (int k = 0; k < kKindCount; ++k) {
    mine->kinds[static_cast<int>(tier)][k].store(live_by_kind[k], std::memory_order_relaxed);
  }
}

void NodeGovernor::PublishWorkers(uint64_t private_bytes, uint32_t workers) {
  Slot* mine = PublishedSlot();
  if (mine == nullptr) return;
  mine->workers_private.store(private_bytes, std::memory_order_relaxed);
  mine->workers.store(workers, std::memory_order_relaxed);
}

void NodeGovernor::PublishMemory(const ProcessMemory& memory) {
  Slot* mine = PublishedSlot();
  if (mine == nullptr) return;
  for (int o = 0; o < kMemoryOwnerCount; ++o) {
    mine->memory[o].store(memory.owners[o], std::memory_order_relaxed);
  }
  mine->memory_beyond.store(memory.counted_beyond_resident, std::memory_order_relaxed);
}

void NodeGovernor::AddTrimmer(const void* owner, std::function<uint64_t()> trim) {
  std::lock_guard<std::mutex> lock(trim_mu_);
  trimmers_.push_back(Trimmer{owner, std::move(trim)});
}

void NodeGovernor::RemoveTrimmer(const void* owner) {
  if (!process_.InOwner()) return;
  std::unique_lock<std::mutex> lock(trim_mu_);
  for (Trimmer& t : trimmers_) {
    if (t.owner == owner) t.removed = true;  // calls that start from now on skip it
  }
  trims_idle_.wait(lock, [&] {
    return std::none_of(trimmers_.begin(), trimmers_.end(),
                        [&](const Trimmer& t) { return t.owner == owner && t.in_flight != 0; });
  });
  trimmers_.remove_if([&](const Trimmer& t) { return t.owner == owner; });
}

uint64_t NodeGovernor::TrimLocal() {
  if (!process_.InOwner()) return 0;
  std::vector<Trimmer*> calls;
  {
    std::lock_guard<std::mutex> lock(trim_mu_);
    for (Trimmer& t : trimmers_) {
      if (t.removed) continue;
      ++t.in_flight;
      calls.push_back(&t);
    }
  }
  uint64_t freed = 0;
  for (Trimmer* t : calls) freed += t->trim();  // without trim_mu_: they unmap
  std::lock_guard<std::mutex> lock(trim_mu_);
  for (Trimmer* t : calls) --t->in_flight;
  trims_idle_.notify_all();
  return freed;
}

bool NodeGovernor::OnWatcherThread() { return t_on_watcher; }

Result<std::vector<std::string>> NodeGovernor::RequestTrimAndWait() {
  struct Other {
    int index;
    pid_t pid;
    uint64_t start_ticks, generation;
    std::string name;  // "job 'a' local rank 1"
  };
  std::vector<Other> others;
  {
    SPILLWAY_ASSIGN_OR_RETURN(auto lock, SegmentLock::Take(segment_, options_.lock_timeout, path_));
    segment_->trim_requests++;
    for (int i = 0; i < kMaxSlots; ++i) {
      const Slot& slot = segment_->slots[i];
      if (i != slot_ && slot.pid != 0) {
        others.push_back(
            {i, slot.pid, slot.start_ticks, slot.generation,
             StrCat("job '", node::JobName(segment_, slot.job), "' local rank ", slot.local_rank)});
      }
    }
  }
  std::vector<std::string> silent;
  if (others.empty()) return silent;
  const uint32_t request = segment_->trim_word.fetch_add(1, std::memory_order_acq_rel) + 1;
  node::Futex(&segment_->trim_word, FUTEX_WAKE, INT_MAX, nullptr);
  const uint64_t deadline =
      NowNs() + static_cast<uint64_t>(options_.trim_timeout.count()) * 1'000'000ull;
  for (const Other& o : others) {
    Slot& slot = segment_->slots[o.index];
    int polls = 0;
    while (static_cast<int32_t>(slot.trim_ack.load(std::memory_order_acquire) - request) < 0) {
      // The slot changed hands, or (checked every 16th poll: kill and /proc) its rank died.
      if (__atomic_load_n(&slot.generation, __ATOMIC_RELAXED) != o.generation ||
          (++polls % 16 == 0 && !node::Alive(o.pid, o.start_ticks))) {
        break;
      }
      if (NowNs() > deadline) {
        silent.push_back(o.name);
        break;
      }
      // Woken by the rank's watcher when it acknowledges (at most 1 ms, for the checks above).
      const uint32_t ack = slot.trim_ack.load(std::memory_order_acquire);
      if (static_cast<int32_t>(ack - request) < 0) {
        const timespec one_ms{0, 1'000'000};
        node::Futex(&slot.trim_ack, FUTEX_WAIT, ack, &one_ms);
      }
    }
  }
  if (!silent.empty()) {
    Log(LogLevel::kWarning, StrCat("node governor: ", silent.size(),
                                   " local rank(s) did not answer a trim request "
                                   "within ",
                                   options_.trim_timeout.count(), " ms (no watcher, or stopped)"));
  }
  return silent;
}

void NodeGovernor::WatchLoop() {
  t_on_watcher = true;
  Slot& mine = segment_->slots[slot_];
  uint32_t seen = mine.trim_ack.load(std::memory_order_relaxed);
  const auto interval = options_.watch_interval;
  while (!stop_.load(std::memory_order_acquire)) {
    timespec timeout{static_cast<time_t>(interval.count() / 1000),
                     static_cast<long>((interval.count() % 1000) * 1'000'000)};
    node::Futex(&segment_->trim_word, FUTEX_WAIT, seen, &timeout);
    if (stop_.load(std::memory_order_acquire)) break;
    const uint32_t now = segment_->trim_word.load(std::memory_order_acquire);
    if (now != seen && StillMine(mine, pid_, generation_)) {
      TrimLocal();
      mine.trims.fetch_add(1, std::memory_order_relaxed);
      mine.trim_ack.store(now, std::memory_order_release);
      node::Futex(&mine.trim_ack, FUTEX_WAKE, INT_MAX, nullptr);
      seen = now;
    }
    if (std::any_of(std::begin(owed_), std::end(owed_),
                    [](const std::atomic<uint64_t>& o) { return o.load() != 0; })) {
      auto lock = SegmentLock::Take(segment_, options_.release_timeout, path_);
      if (lock.ok()) SettleOwedLocked();  // else the next tick tries again
    }
    Status st = ReapDead();
    if (!st.ok()) Log(LogLevel::kWarning, st.ToString());
  }
}

NodeStats NodeGovernor::Stats() const {
  Status st = ReapDead();
  if (!st.ok()) Log(LogLevel::kWarning, st.ToString());
  return Snapshot();
}

NodeStats NodeGovernor::Snapshot() const {
  auto lock = SegmentLock::Take(segment_, options_.lock_timeout, path_);
  if (!lock.ok()) {  // a report without numbers rather than a scrape that hangs
    Log(LogLevel::kWarning, lock.status().ToString());
    NodeStats empty;
    empty.job = job();
    empty.ledger = ledger_;
    empty.path = path_;
    return empty;
  }
  return node::ReadStats(segment_, path_, job());
}

Status NodeGovernor::Validate() const {
  SPILLWAY_ASSIGN_OR_RETURN(auto lock, SegmentLock::Take(segment_, options_.lock_timeout, path_));
  uint64_t host = 0, nvme = 0;
  for (const Slot& slot : segment_->slots) {
    if (slot.pid == 0) continue;
    host += slot.bytes[0] + slot.bytes[1];
    nvme += slot.bytes[2];
  }
  if (host != segment_->host_committed || nvme != segment_->nvme_committed) {
    return Status::Internal(StrCat("node segment ", path_, ": totals host ",
                                   segment_->host_committed, " nvme ", segment_->nvme_committed,
                                   " disagree with the slots' ", host, " and ", nvme));
  }
  if (host > segment_->host_budget ||
      (segment_->nvme_budget != 0 && nvme > segment_->nvme_budget)) {
    return Status::Internal(StrCat("node segment ", path_, ": committed is over the budget"));
  }
  return Status::Ok();
}

}  // namespace spillway::allocator
