// NodeGovernor: joining the ledger of a memory limit (creating its segment, or opening it and
// claiming a slot for a job's local rank), reading a ledger from outside, and removing the segments
// whose ranks are all gone. Note [Node governor] in docs/allocator.md.
#include <dirent.h>
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <new>

#include "node_segment.h"
#include "spillway/allocator/host_arena.h"
#include "spillway/allocator/node_governor.h"
#include "spillway/base/bytes.h"
#include "spillway/base/log.h"

namespace spillway::allocator {

using node::ClearSlot;
using node::Declaration;
using node::DirLock;
using node::kMaxSlots;
using node::Mapped;
using node::NowNs;
using node::Segment;
using node::SegmentLock;
using node::SleepMs;
using node::Slot;

namespace {

// Under the DirLock: removes the segment at `path` when it was left half made (never initialized),
// half removed (closed), or holds no live rank. Returns true when it was removed.
bool RemoveIfDead(const std::string& path, LogLevel level) {
  auto opened = node::OpenExisting(path, std::chrono::milliseconds(0));
  if (!opened.ok()) {
    // EBADF: never initialized, and no creator holds the DirLock: abandoned.
    if (opened.status().sys_error() != EBADF) return false;
    const int fd = open(path.c_str(), O_RDONLY | O_NOFOLLOW | O_CLOEXEC);
    if (fd < 0) return false;
    // A segment of another Spillway layout, in use, has its magic: not ours to remove.
    uint64_t magic = 0;
    if (pread(fd, &magic, sizeof(magic), 0) == static_cast<ssize_t>(sizeof(magic)) &&
        magic == node::kMagic) {
      close(fd);
      return false;
    }
    const bool removed = node::UnlinkIfSame(path, fd);
    close(fd);
    if (removed) Log(level, StrCat("node governor: removed ", path, ": it was never initialized"));
    return removed;
  }
  Mapped m = *opened;
  bool remove = false;
  if (m.segment->pid_ns != node::OwnPidNamespace()) {  // its pids cannot be judged from here
    Unmap(m);
    return false;
  }
  if (node::Reap(m.segment, -1, std::chrono::milliseconds(200), path, LogLevel::kInfo).ok()) {
    auto lock = SegmentLock::Take(m.segment, std::chrono::milliseconds(200), path);
    if (lock.ok()) {
      remove = m.segment->closed != 0 ||
               std::none_of(std::begin(m.segment->slots), std::end(m.segment->slots),
                            [](const Slot& s) { return s.pid != 0; });
      if (remove) m.segment->closed = 1;
    }
  }
  const bool removed = remove && node::UnlinkIfSame(path, m.fd);
  Unmap(m);
  if (removed) Log(level, StrCat("node governor: removed ", path, ": every rank of it is gone"));
  return removed;
}

// The ledger's host budget, the reserve it leaves of the memory limit, and who set it: by the
// rank that makes the segment, and again by the first job with an explicit budget (ClaimLocked).
void SetHostBudget(Segment* s, uint64_t budget, bool is_explicit, const std::string& job) {
  s->host_budget = budget;
  s->reserve = s->memory_limit > budget ? s->memory_limit - budget : 0;
  s->budget_explicit = is_explicit ? 1 : 0;
  std::snprintf(s->budget_by, sizeof(s->budget_by), "%s", job.c_str());
}

// posix_fallocate returns its error (errno is untouched); a signal that interrupts it is retried.
int FallocateRetrying(int fd, off_t bytes) {
  int err;
  do {
    err = posix_fallocate(fd, 0, bytes);
  } while (err == EINTR);
  return err;
}

// Names another ledger only for jobs that truly share no memory limit: under one, two ledgers
// promise its memory twice.
constexpr const char* kOwnLedger =
    "; or, for a job that shares no memory limit with the others, a ledger of its own "
    "(SPILLWAY_NODE_LEDGER)";

// Assumes s->mu. Whether the job's explicit host budget is adopted as the ledger's. A default
// budget (from the memory limit) yields to the first explicit one while what is booked fits under
// it: a lone process that made the ledger must not refuse a job started with
// SPILLWAY_NODE_BUDGET_BYTES. Two explicit budgets must agree. So may one set by a job whose ranks
// are all gone (a notebook outliving the jobs beside it).
bool AdoptsBudget(const Segment* s, const NodeGovernorOptions& o) {
  const int setter = s->budget_explicit != 0 ? node::FindJob(s, s->budget_by) : -1;
  return o.host_budget_bytes != 0 &&
         (s->budget_explicit == 0 || setter < 0 || !node::JobHasRanks(s, setter));
}

// Assumes s->mu. The job's host and NVMe budgets against the ledger's: an adopted host budget must
// hold what is booked, one not adopted must equal the ledger's, and NVMe budgets must agree.
Status CheckClaimBudgets(const Segment* s, const NodeGovernorOptions& o, bool adopt) {
  if (adopt && s->host_committed > o.host_budget_bytes) {
    return Status::InvalidArgument(StrCat(
        "node governor: job '", o.job, "' asks for a node budget of ",
        FormatBytes(o.host_budget_bytes), ", but the ranks in the ledger for ", s->scope,
        " already hold ", FormatBytes(s->host_committed),
        " under its default budget; raise SPILLWAY_NODE_BUDGET_BYTES, or start the job when they "
        "hold less",
        kOwnLedger));
  }
  if (!adopt && o.host_budget_bytes != 0 && o.host_budget_bytes != s->host_budget) {
    return Status::InvalidArgument(StrCat(
        "node governor: the ledger for ", s->scope, " has a node budget of ",
        FormatBytes(s->host_budget),
        s->budget_explicit != 0 ? StrCat(", set by job '", s->budget_by, "'")
                                : std::string(", the default from its memory limit"),
        "; job '", o.job, "' asks for ", FormatBytes(o.host_budget_bytes),
        ". Every job under one memory limit shares its budget. Give every rank of every job the "
        "same SPILLWAY_NODE_BUDGET_BYTES (or none)",
        kOwnLedger));
  }
  if (o.nvme_budget_bytes != 0 && s->nvme_budget != 0 && o.nvme_budget_bytes != s->nvme_budget) {
    return Status::InvalidArgument(StrCat(
        "node governor: the ledger for ", s->scope, " has an NVMe budget of ",
        FormatBytes(s->nvme_budget), "; job '", o.job, "' asks for ",
        FormatBytes(o.nvme_budget_bytes),
        ". Every job under one memory limit shares one NVMe budget: give every rank the same "
        "SPILLWAY_NODE_NVME_BUDGET_BYTES (or none)",
        kOwnLedger));
  }
  return Status::Ok();
}

// Assumes s->mu. The first free slot of the ledger, or the error that live ranks hold them all.
Result<int> FreeSlot(const Segment* s, const std::string& path) {
  for (int i = 0; i < kMaxSlots; ++i) {
    if (s->slots[i].pid == 0) return i;
  }
  return Status::ResourceExhausted(
      StrCat("node governor: all ", kMaxSlots, " slots of the ledger ", path, " (", s->scope,
             ") are held by live ranks; a memory limit's ledger holds at most ", kMaxSlots,
             " ranks. Run fewer", kOwnLedger));
}

// Assumes s->mu. Makes `slot` this process's, for the job's local rank; nothing of an earlier
// occupant stays, and the pid is written last.
void FillSlot(Segment* s, int slot, int job, int local_rank, uint64_t start_ticks) {
  Slot& mine = s->slots[slot];
  const uint64_t generation = mine.generation;
  ClearSlot(&mine);  // nothing of an earlier occupant stays
  mine.generation = generation;
  // The pid last: a rank killed midway leaves a free slot, or one that the lock's recovery frees.
  mine.job = job;
  mine.local_rank = local_rank;
  mine.start_ticks = start_ticks;
  mine.trim_ack.store(s->trim_word.load(std::memory_order_relaxed), std::memory_order_relaxed);
  mine.pid = getpid();
}

// Assumes s->mu. Claims a slot of the ledger for the job's local rank (the job's entry found or
// made): every check is made before anything changes. Returns the slot, the job's entry and the
// local rank.
struct Claim {
  int slot, job, local_rank;
};
Result<Claim> ClaimLocked(Segment* s, const NodeGovernorOptions& o, const std::string& path,
                          uint64_t start_ticks) {
  const bool adopt = AdoptsBudget(s, o);
  SPILLWAY_RETURN_IF_ERROR(CheckClaimBudgets(s, o, adopt));
  int job = node::FindJob(s, o.job);
  const bool running = job >= 0 && node::JobHasRanks(s, job);
  int local_rank = o.local_rank;
  if (running && local_rank >= 0) {
    const int holder = node::RankSlot(s, job, local_rank);
    if (holder >= 0) {
      return Status::FailedPrecondition(StrCat(
          "node governor: local rank ", local_rank, " of job '", o.job, "' is held by pid ",
          s->slots[holder].pid,
          ", which is alive. Two processes claim one local rank: check LOCAL_RANK, or give the "
          "second job its own SPILLWAY_NODE_JOB"));
    }
  }
  SPILLWAY_ASSIGN_OR_RETURN(const int slot, FreeSlot(s, path));
  if (!running) {
    job = node::TakeJob(s, o.job);
    if (job < 0) {
      return Status::ResourceExhausted(StrCat("node governor: the ledger ", path, " (", s->scope,
                                              ") already holds ", node::kMaxJobs,
                                              " jobs with live ranks; stop one", kOwnLedger));
    }
  }
  if (local_rank < 0) {  // the first local rank the job has free
    local_rank = 0;
    while (node::RankSlot(s, job, local_rank) >= 0) ++local_rank;
  }
  FillSlot(s, slot, job, local_rank, start_ticks);
  node::JobEntry& entry = s->jobs[job];
  entry.declarations[local_rank] = Declaration{};
  if (entry.local_world_size == 0) entry.local_world_size = o.local_world_size;
  if (s->nvme_budget == 0) s->nvme_budget = o.nvme_budget_bytes;  // 0: the first NVMe arena sets it
  if (adopt) SetHostBudget(s, o.host_budget_bytes, /*is_explicit=*/true, o.job);
  return Claim{slot, job, local_rank};
}

// Checks the job and ledger names and the rank numbers, and fills in the default ledger and the
// ledger's scope in words.
Status CompleteJoinOptions(NodeGovernorOptions* options) {
  auto bad_name = [](const char* what, const std::string& name) {
    return Status::InvalidArgument(StrCat("node governor: ", what, " '", name, "' must be 1 to ",
                                          node::kJobChars,
                                          " characters of A-Z, a-z, 0-9, '.', '_', '-'"));
  };
  if (!node::ValidJob(options->job)) return bad_name("job", options->job);
  if (options->ledger.empty()) {
    NodeLedger ledger = DefaultNodeLedger();
    options->ledger = std::move(ledger.name);
    if (options->scope.empty()) options->scope = std::move(ledger.scope);
  } else if (!node::ValidJob(options->ledger)) {
    return bad_name("ledger", options->ledger);
  }
  if (options->scope.empty()) {
    options->scope =
        StrCat("the jobs that name the ledger '", options->ledger, "' (SPILLWAY_NODE_LEDGER)");
  }
  if (options->local_rank >= kMaxSlots || options->local_world_size > kMaxSlots ||
      options->local_world_size < 0) {
    return Status::InvalidArgument(StrCat(
        "node governor: local rank ", options->local_rank, " or local world size ",
        options->local_world_size, " is beyond the ", kMaxSlots, " ranks a node segment holds"));
  }
  return Status::Ok();
}

// This process's start time (/proc/self/stat), by which the other ranks tell it from a process
// that reused its pid.
Result<uint64_t> OwnStartTicks() {
  char state = '?';
  uint64_t start = 0;
  if (!node::ReadProcStat(getpid(), &state, &start)) {
    // Without its start time every other rank would judge this one dead (a reused pid).
    return Status::Make(StatusCode::kUnavailable,
                        StrCat("node governor: /proc/", getpid(),
                               "/stat is unreadable, so this rank cannot be told apart from a "
                               "process that reused its pid; mount /proc, or set SPILLWAY_NODE=0"));
  }
  return start;
}

// Sizes the new segment file `fd` at `path` and maps it, with its process-shared robust mutex
// made; the rest is zero. On error the file is unlinked and closed.
Result<Segment*> MapNewSegment(int fd, const std::string& path) {
  Mapped m;
  m.fd = fd;
  void* p = MAP_FAILED;
  int err = 0;
  // posix_fallocate, not ftruncate alone: a tmpfs that is full then refuses here (ENOSPC)
  // instead of the first write to a page it cannot back raising SIGBUS.
  if (fchmod(fd, 0600) != 0 || ftruncate(fd, sizeof(Segment)) != 0) {
    err = errno;
  } else if ((err = FallocateRetrying(fd, sizeof(Segment))) != 0) {
    // err is set (posix_fallocate returns it, errno untouched)
  } else {
    p = mmap(nullptr, sizeof(Segment), PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (p == MAP_FAILED) err = errno;
  }
  if (err != 0) {
    unlink(path.c_str());
    Unmap(m);
    return Status::FromErrno(StatusCode::kOutOfMemory, err,
                             StrCat("node governor: sizing and mapping segment ", path,
                                    " (is /dev/shm full or too small?)"));
  }
  auto* s = new (p) Segment();
  m.segment = s;
  pthread_mutexattr_t attr;
  pthread_mutexattr_init(&attr);
  pthread_mutexattr_setpshared(&attr, PTHREAD_PROCESS_SHARED);
  pthread_mutexattr_setrobust(&attr, PTHREAD_MUTEX_ROBUST);
  const int rc = pthread_mutex_init(&s->mu, &attr);
  pthread_mutexattr_destroy(&attr);
  if (rc != 0) {
    unlink(path.c_str());
    Unmap(m);
    return Status::FromErrno(StatusCode::kInternal, rc, "node governor: pthread_mutex_init");
  }
  return s;
}

// The new segment's header: its layout, PID namespace, names, memory limit and host budget
// (the NVMe budget: ClaimLocked), and every slot free.
void InitSegment(Segment* s, const NodeGovernorOptions& options) {
  s->version = node::kVersion;
  s->pid_ns = node::OwnPidNamespace();
  s->slot_count = kMaxSlots;
  s->size = sizeof(Segment);
  std::snprintf(s->ledger, sizeof(s->ledger), "%s", options.ledger.c_str());
  std::snprintf(s->scope, sizeof(s->scope), "%s", options.scope.c_str());
  s->memory_limit =
      options.memory_limit_bytes != 0 ? options.memory_limit_bytes : MemoryLimitBytes();
  SetHostBudget(s,
                options.host_budget_bytes != 0 ? options.host_budget_bytes
                                               : DefaultNodeHostBudget(s->memory_limit),
                options.host_budget_bytes != 0, options.job);  // NVMe's: ClaimLocked
  for (Slot& slot : s->slots) {
    slot.job = -1;
    slot.local_rank = -1;
  }
}

// The segment this rank made, mapped, with its slot claimed (a null segment: one was there).
struct Made {
  Mapped m;
  Claim claim{};
};

// Under the DirLock: makes the segment at `path` when there is none, initialized whole and with
// this rank's slot claimed before its magic is published. Made::m.segment is null when the file
// exists (EEXIST). On error nothing is left behind.
Result<Made> MakeSegment(const std::string& path, const NodeGovernorOptions& options,
                         uint64_t start_ticks) {
  const int fd = open(path.c_str(), O_RDWR | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0600);
  if (fd < 0) {
    if (errno == EEXIST) return Made{};
    return Status::FromErrno(StatusCode::kUnavailable, errno,
                             StrCat("node governor: creating segment ", path,
                                    " (is the directory there and writable?)"));
  }
  SPILLWAY_ASSIGN_OR_RETURN(Segment* const s, MapNewSegment(fd, path));
  InitSegment(s, options);
  const Mapped m{fd, s};
  // Uncontended (nobody can open it before magic), and it cannot fail the budget check.
  auto claim = ClaimLocked(s, options, path, start_ticks);
  if (!claim.ok()) {
    unlink(path.c_str());
    Unmap(m);
    return claim.status();
  }
  s->magic.store(node::kMagic, std::memory_order_release);
  return Made{m, *claim};
}

// Under the DirLock: opens the segment at `path` that is there. Null segment: it was dead and is
// removed, or vanished: go round and make it anew.
Result<Mapped> OpenSegment(const std::string& path) {
  // It exists. Under the DirLock no creator is midway, so an uninitialized one is abandoned,
  // and a closed one is a removal its remover did not finish: finish it, then make anew.
  if (RemoveIfDead(path, LogLevel::kInfo)) return Mapped{};
  auto opened = node::OpenExisting(path, std::chrono::milliseconds(0));
  if (!opened.ok()) {
    if (opened.status().sys_error() == ENOENT) return Mapped{};
    return opened.status().WithContext("node governor");
  }
  return *opened;
}

// What joining an opened segment found: this rank's claim, its slot's generation and the
// admission rounds its job had done; or that the segment is closing (unmapped: make it anew).
struct Joined {
  bool closing = false;
  Claim claim{};
  uint64_t generation = 0;
  uint32_t rounds_done = 0;
};

// Claims this rank's slot in the opened segment `m` under its lock, after reaping dead ranks.
// On error, and when it is closing, `m` is unmapped.
Result<Joined> ClaimInSegment(const Mapped& m, const NodeGovernorOptions& options,
                              const std::string& path, uint64_t start_ticks) {
  Segment* s = m.segment;
  // A dead occupant of the slot this rank wants (an elastic restart's predecessor) goes first.
  auto reaped = node::Reap(s, -1, options.lock_timeout, path);
  if (!reaped.ok()) {
    Unmap(m);
    return reaped.status();
  }
  auto lock = SegmentLock::Take(s, options.lock_timeout, path);
  if (!lock.ok()) {
    Unmap(m);
    return lock.status();
  }
  auto refuse = [&](Status st) {
    { auto unlock = std::move(*lock); }
    Unmap(m);
    return st;
  };
  if (s->pid_ns != node::OwnPidNamespace()) {
    return refuse(Status::FailedPrecondition(StrCat(
        "node governor: the ledger ", path, " was made in another PID namespace (another ",
        "container sharing /dev/shm?); the ranks under one ledger must see each other's pids. "
        "Run them in one container, or give this job a ledger of its own "
        "(SPILLWAY_NODE_LEDGER)")));
  }
  if (s->closed != 0) {  // its last rank is leaving: wait until it is gone, then make anew
    { auto unlock = std::move(*lock); }
    Unmap(m);
    return Joined{.closing = true};
  }
  auto claim = ClaimLocked(s, options, path, start_ticks);
  if (!claim.ok()) return refuse(claim.status());
  Joined joined;
  joined.claim = *claim;
  joined.generation = s->slots[claim->slot].generation;
  // A rank that joins a job whose ranks already passed admission rounds starts after them: it
  // must not return an old round's verdict for a need nobody checked.
  joined.rounds_done = s->jobs[claim->job].verdict_round;
  return joined;
}

}  // namespace

std::string NodeGovernor::SegmentPath(const std::string& dir, const std::string& ledger) {
  return StrCat(dir, "/spillway-node-", geteuid(), "-", ledger);
}

Result<std::unique_ptr<NodeGovernor>> NodeGovernor::Join(NodeGovernorOptions options) {
  SPILLWAY_RETURN_IF_ERROR(CompleteJoinOptions(&options));
  SPILLWAY_RETURN_IF_ERROR(ForkTracking());
  const std::string path = SegmentPath(options.dir, options.ledger);
  RemoveDeadSegments(options.dir);  // other ledgers' litter (a job killed whole leaves its segment)
  const uint64_t deadline =
      NowNs() + static_cast<uint64_t>(options.lock_timeout.count()) * 1'000'000ull;
  SPILLWAY_ASSIGN_OR_RETURN(const uint64_t my_start, OwnStartTicks());
  while (true) {
    if (NowNs() > deadline) {
      return Status::Make(StatusCode::kUnavailable,
                          StrCat("node governor: segment ", path, " stayed closed for ",
                                 options.lock_timeout.count(), " ms while its last rank left; rm ",
                                 path, " if no rank under its memory limit runs"));
    }
    Mapped m;
    {
      SPILLWAY_ASSIGN_OR_RETURN(DirLock dir_lock, DirLock::Take(options.dir, options.lock_timeout));
      SPILLWAY_ASSIGN_OR_RETURN(Made made, MakeSegment(path, options, my_start));
      if (made.m.segment != nullptr) {  // this rank made it: its governor, still under the DirLock
        const Claim& c = made.claim;
        return std::unique_ptr<NodeGovernor>(
            new NodeGovernor(std::move(options), path, made.m.fd, made.m.segment, c.slot, c.job,
                             c.local_rank, made.m.segment->slots[c.slot].generation));
      }
      SPILLWAY_ASSIGN_OR_RETURN(m, OpenSegment(path));
      if (m.segment == nullptr) continue;
    }
    SPILLWAY_ASSIGN_OR_RETURN(Joined joined, ClaimInSegment(m, options, path, my_start));
    if (joined.closing) {
      SleepMs(1);
      continue;
    }
    const Claim& c = joined.claim;
    auto g = std::unique_ptr<NodeGovernor>(new NodeGovernor(
        std::move(options), path, m.fd, m.segment, c.slot, c.job, c.local_rank, joined.generation));
    g->admit_rounds_.store(joined.rounds_done, std::memory_order_relaxed);
    return g;
  }
}

Result<NodeStats> NodeGovernor::Inspect(const std::string& path,
                                        std::chrono::milliseconds lock_timeout) {
  SPILLWAY_ASSIGN_OR_RETURN(Mapped m, node::OpenExisting(path, lock_timeout));
  auto reaped = node::Reap(m.segment, -1, lock_timeout, path);
  if (!reaped.ok()) {
    Unmap(m);
    return reaped.status();
  }
  NodeStats out;
  {
    auto lock = SegmentLock::Take(m.segment, lock_timeout, path);
    if (!lock.ok()) {
      Unmap(m);
      return lock.status();
    }
    out = node::ReadStats(m.segment, path, "");
  }
  Unmap(m);
  return out;
}

std::vector<std::string> NodeGovernor::ListSegments(const std::string& dir) {
  std::vector<std::string> out;
  const std::string prefix = StrCat("spillway-node-", geteuid(), "-");
  DIR* d = opendir(dir.c_str());
  if (d == nullptr) return out;
  // NOLINTNEXTLINE(concurrency-mt-unsafe): the stream is this call's own (glibc locks per DIR)
  while (dirent* e = readdir(d)) {
    if (std::strncmp(e->d_name, prefix.c_str(), prefix.size()) == 0) {
      out.push_back(StrCat(dir, "/", e->d_name));
    }
  }
  closedir(d);
  std::sort(out.begin(), out.end());
  return out;
}

int NodeGovernor::RemoveDeadSegments(const std::string& dir) {
  int removed = 0;
  for (const std::string& path : ListSegments(dir)) {
    auto dir_lock = DirLock::Take(dir, std::chrono::milliseconds(1000));
    if (!dir_lock.ok()) break;  // another process is making or removing one: leave it the rest
    if (RemoveIfDead(path, LogLevel::kInfo)) ++removed;
  }
  return removed;
}

}  // namespace spillway::allocator
