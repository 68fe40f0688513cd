// The node segment's mechanics: clocks, /proc liveness, the robust lock, the directory lock,
// opening a segment, reaping dead ranks, reading the ledger. Note [Node governor] in
// docs/allocator.md.
#include "node_segment.h"

#include <fcntl.h>
#include <linux/futex.h>
#include <signal.h>
#include <sys/file.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstddef>
#include <cstdio>
#include <ctime>
#include <sstream>
#include <vector>

#include "spillway/base/bytes.h"

namespace spillway::allocator::node {

uint64_t NowNs() {
  timespec ts{};
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return static_cast<uint64_t>(ts.tv_sec) * 1'000'000'000ull + static_cast<uint64_t>(ts.tv_nsec);
}

void SleepMs(int ms) {
  timespec ts{ms / 1000, (ms % 1000) * 1'000'000L};
  nanosleep(&ts, nullptr);
}

bool ValidJobChar(char c) {
  return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '.' ||
         c == '_' || c == '-';
}

bool ValidJob(const std::string& job) {
  return !job.empty() && job.size() <= kJobChars &&
         std::all_of(job.begin(), job.end(), ValidJobChar);
}

// The command name (field 2) may hold spaces and parentheses: fields are counted after its last
// ')'. Read with read(2), not a stream: a process that exits between the open and the read makes
// the read fail with ESRCH, which libstdc++'s filebuf throws as an exception (on a watcher thread:
// std::terminate).
bool ReadProcStat(pid_t pid, char* state, uint64_t* start_ticks) {
  const std::string path = StrCat("/proc/", pid, "/stat");
  const int fd = open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return false;
  char buf[1024];  // the command name is at most 64 bytes; 52 numeric fields follow
  ssize_t n;
  do {
    n = read(fd, buf, sizeof(buf) - 1);
  } while (n < 0 && errno == EINTR);
  close(fd);
  if (n <= 0) return false;
  const std::string text(buf, static_cast<size_t>(n));
  const size_t close_paren = text.rfind(')');
  if (close_paren == std::string::npos) return false;
  std::istringstream fields(text.substr(close_paren + 1));
  std::string field;
  for (int i = 3; i <= 22; ++i) {
    if (!(fields >> field)) return false;
    if (i == 3) *state = field.empty() ? '?' : field[0];
  }
  *start_ticks = std::strtoull(field.c_str(), nullptr, 10);
  return true;
}

// A killed rank its launcher has not yet waited for is a zombie: dead. A pid the kernel gave to
// another process since has another start time: not the rank.
bool Alive(pid_t pid, uint64_t start_ticks) {
  if (kill(pid, 0) != 0 && errno == ESRCH) return false;
  char state = '?';
  uint64_t start = 0;
  if (!ReadProcStat(pid, &state, &start)) return kill(pid, 0) == 0 || errno != ESRCH;
  if (state == 'Z' || state == 'X') return false;
  return start == start_ticks;
}

uint64_t OwnPidNamespace() {
  struct stat st {};
  return stat("/proc/self/ns/pid", &st) == 0 ? static_cast<uint64_t>(st.st_ino) : 0;
}

int Futex(std::atomic<uint32_t>* word, int op, uint32_t value, const timespec* timeout) {
  return static_cast<int>(
      syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), op, value, timeout, nullptr, 0));
}

void ClearSlot(Slot* slot) {
  slot->pid = 0;
  slot->job = -1;
  slot->local_rank = -1;
  slot->start_ticks = 0;
  slot->generation++;
  for (uint64_t& b : slot->bytes) b = 0;
  slot->peak_host = 0;
  for (auto& tier : slot->kinds) {
    for (auto& k : tier) k.store(0, std::memory_order_relaxed);
  }
  slot->workers_private.store(0, std::memory_order_relaxed);
  for (auto& m : slot->memory) m.store(0, std::memory_order_relaxed);
  slot->memory_beyond.store(0, std::memory_order_relaxed);
  slot->workers.store(0, std::memory_order_relaxed);
  slot->trims.store(0, std::memory_order_relaxed);
}

bool SlotPlaced(const Slot& slot) {
  return slot.job >= 0 && slot.job < kMaxJobs && slot.local_rank >= 0 &&
         slot.local_rank < kMaxSlots;
}

const char* JobName(const Segment* s, int job) {
  return job >= 0 && job < kMaxJobs ? s->jobs[job].name : "?";
}

void RecomputeTotals(Segment* s) {
  s->host_committed = s->nvme_committed = 0;
  for (Slot& slot : s->slots) {
    if (slot.pid != 0 && !SlotPlaced(slot)) ClearSlot(&slot);  // its claimer died midway
    if (slot.pid == 0) continue;
    s->host_committed += slot.bytes[0] + slot.bytes[1];
    s->nvme_committed += slot.bytes[2];
  }
}

int FindJob(const Segment* s, const std::string& name) {
  for (int j = 0; j < kMaxJobs; ++j) {
    if (name == s->jobs[j].name) return j;
  }
  return -1;
}

bool JobHasRanks(const Segment* s, int job) {
  return std::any_of(std::begin(s->slots), std::end(s->slots),
                     [&](const Slot& o) { return o.pid != 0 && o.job == job; });
}

int RankSlot(const Segment* s, int job, int local_rank) {
  for (int i = 0; i < kMaxSlots; ++i) {
    const Slot& o = s->slots[i];
    if (o.pid != 0 && o.job == job && o.local_rank == local_rank) return i;
  }
  return -1;
}

int TakeJob(Segment* s, const std::string& name) {
  int j = FindJob(s, name);
  if (j >= 0 && JobHasRanks(s, j)) return j;
  if (j < 0) {
    for (int k = 0; k < kMaxJobs && j < 0; ++k) {
      if (s->jobs[k].name[0] == '\0') j = k;
    }
    for (int k = 0; k < kMaxJobs && j < 0; ++k) {
      if (!JobHasRanks(s, k)) j = k;
    }
    if (j < 0) return -1;
  }
  // A new job, or one whose ranks are all gone (a restart of the whole job): admission starts
  // over, and nothing of an earlier job stays.
  JobEntry& e = s->jobs[j];
  std::snprintf(e.name, sizeof(e.name), "%s", name.c_str());
  e.local_world_size = 0;
  std::fill(std::begin(e.declarations), std::end(e.declarations), Declaration{});
  e.verdict_round = 0;
  e.verdict = Verdict::kNone;
  e.verdict_text[0] = '\0';
  return j;
}

uint64_t JobHeldOrDeclared(const Segment* s, int job, int* ranks) {
  uint64_t total = 0;
  *ranks = 0;
  for (const Slot& o : s->slots) {
    if (o.pid == 0 || o.job != job || !SlotPlaced(o)) continue;
    ++*ranks;
    total += std::max(o.bytes[0] + o.bytes[1], s->jobs[job].declarations[o.local_rank].need);
  }
  return total;
}

Result<SegmentLock> SegmentLock::Take(Segment* s, std::chrono::milliseconds timeout,
                                      const std::string& path) {
#if defined(__SANITIZE_THREAD__)
  // TSan intercepts pthread_mutex_timedlock but not pthread_mutex_clocklock (it would see every
  // unlock as one of an unlocked mutex): the wall clock's deadline under TSan only.
  constexpr clockid_t kClock = CLOCK_REALTIME;
#else
  constexpr clockid_t kClock = CLOCK_MONOTONIC;  // a wall-clock step cannot stretch the wait
#endif
  timespec deadline{};
  clock_gettime(kClock, &deadline);
  const int64_t ns = deadline.tv_nsec + (timeout.count() % 1000) * 1'000'000;
  deadline.tv_sec += timeout.count() / 1000 + ns / 1'000'000'000;
  deadline.tv_nsec = ns % 1'000'000'000;
#if defined(__SANITIZE_THREAD__)
  const int rc = pthread_mutex_timedlock(&s->mu, &deadline);
#else
  const int rc = pthread_mutex_clocklock(&s->mu, kClock, &deadline);
#endif
  if (rc == 0) return SegmentLock(s, false, &path);
  if (rc == EOWNERDEAD) {
    RecomputeTotals(s);
    const int consistent = pthread_mutex_consistent(&s->mu);
    if (consistent != 0) {
      pthread_mutex_unlock(&s->mu);
      return Status::FromErrno(
          StatusCode::kInternal, consistent,
          StrCat("node segment ", path,
                 ": marking its lock consistent after a rank died holding it"));
    }
    return SegmentLock(s, true, &path);
  }
  if (rc == ETIMEDOUT) {
    return Status::Make(
        StatusCode::kUnavailable,
        StrCat("node segment ", path, ": its lock was held for more than ", timeout.count(),
               " ms (a rank stopped while holding it, e.g. under a debugger or "
               "SIGSTOP); resume or kill that rank"));
  }
  if (rc == ENOTRECOVERABLE) {
    return Status::FromErrno(
        StatusCode::kFailedPrecondition, rc,
        StrCat("node segment ", path,
               ": its lock is unrecoverable (a rank died holding it and the next holder could not "
               "repair it); stop the job and remove the segment (rm ",
               path, ")"));
  }
  return Status::FromErrno(StatusCode::kInternal, rc,
                           StrCat("node segment ", path, ": locking it failed"));
}

SegmentLock::~SegmentLock() {
  if (s_ == nullptr) return;
  pthread_mutex_unlock(&s_->mu);
  if (recovered_) {
    Log(LogLevel::kWarning, StrCat("node segment ", *path_,
                                   ": a rank died holding its lock; the totals were recomputed "
                                   "from the slots"));
  }
}

Result<DirLock> DirLock::Take(const std::string& dir, std::chrono::milliseconds timeout) {
  const std::string path = StrCat(dir, "/.spillway-node-", geteuid(), ".lock");
  const int fd = open(path.c_str(), O_RDWR | O_CREAT | O_NOFOLLOW | O_CLOEXEC, 0600);
  if (fd < 0) {
    return Status::FromErrno(
        StatusCode::kUnavailable, errno,
        StrCat("node governor: opening ", path, " (is the directory there and writable?)"));
  }
  const uint64_t deadline = NowNs() + static_cast<uint64_t>(timeout.count()) * 1'000'000ull;
  while (flock(fd, LOCK_EX | LOCK_NB) != 0) {
    const int err = errno;
    if (err != EWOULDBLOCK && err != EINTR) {
      close(fd);
      return Status::FromErrno(StatusCode::kInternal, err,
                               StrCat("node governor: flock of ", path));
    }
    if (NowNs() > deadline) {
      close(fd);
      return Status::Make(StatusCode::kUnavailable,
                          StrCat("node governor: ", path, " stayed locked for ", timeout.count(),
                                 " ms (a process stopped while making or removing a segment?)"));
    }
    SleepMs(1);
  }
  return DirLock(fd);
}

DirLock::~DirLock() {
  if (fd_ >= 0) close(fd_);  // closing the only descriptor releases the flock
}

void Unmap(const Mapped& m) {
  if (m.segment != nullptr) munmap(m.segment, sizeof(Segment));
  if (m.fd >= 0) close(m.fd);
}

namespace {

// A segment file that cannot be used as one: its creator died while making it, or another
// Spillway version made it.
Status AbandonedSegment(const std::string& path, const std::string& why) {
  return Status::FromErrno(
      StatusCode::kFailedPrecondition, EBADF,
      StrCat("node segment ", path, " ", why,
             ": its creator died while making it, or another Spillway version made it. The next "
             "Join on this node removes it; or rm ",
             path, " when no rank of the job runs"));
}

// A segment of another layout version, made by another Spillway.
Status OtherLayout(const std::string& path, uint32_t version) {
  return Status::FailedPrecondition(StrCat(
      "node segment ", path, " has layout version ", version, "; this Spillway uses ", kVersion,
      ". Every process under one memory limit must run the same Spillway (or name its own "
      "ledger: SPILLWAY_NODE_LEDGER); rm ",
      path, " when no process of the other one runs"));
}

// Opens the segment file at `path` and checks it is this user's, mode 0600 and regular; *st: its
// stat. Returns the fd; on error nothing is left open.
Result<int> OpenOwnSegmentFile(const std::string& path, struct stat* st) {
  const int fd = open(path.c_str(), O_RDWR | O_NOFOLLOW | O_CLOEXEC);
  if (fd < 0) {
    const int err = errno;
    if (err == EACCES || err == EPERM) {
      return Status::FromErrno(StatusCode::kFailedPrecondition, err,
                               StrCat("node segment ", path,
                                      " belongs to another user; a ledger's segment is its "
                                      "own user's (mode 0600): name this ledger differently "
                                      "(SPILLWAY_NODE_LEDGER)"));
    }
    return Status::FromErrno(StatusCode::kUnavailable, err, StrCat("opening node segment ", path));
  }
  if (fstat(fd, st) != 0) {
    const int err = errno;
    close(fd);
    return Status::FromErrno(StatusCode::kInternal, err, StrCat("fstat of ", path));
  }
  if (st->st_uid != geteuid() || (st->st_mode & 0777) != 0600 || !S_ISREG(st->st_mode)) {
    close(fd);
    return Status::FailedPrecondition(StrCat("node segment ", path, " is owned by uid ", st->st_uid,
                                             " with mode 0", std::oct, (st->st_mode & 0777),
                                             std::dec, "; Spillway makes its segments mode 0600 ",
                                             "for their own user (uid ", geteuid(),
                                             ") and uses no other. Remove it, or name "
                                             "this ledger differently (SPILLWAY_NODE_LEDGER)"));
  }
  return fd;
}

// Waits until the segment file `fd` is a whole Segment long (its creator is sizing it), until
// `deadline`; a published segment of another layout fails at once.
Status WaitUntilSized(int fd, const std::string& path, uint64_t deadline, struct stat* st) {
  while (static_cast<uint64_t>(st->st_size) < sizeof(Segment)) {
    // A published segment of another layout (a smaller one of an older Spillway): not being
    // sized, and not ours to remove, since its ranks cannot be read with this layout.
    uint64_t magic = 0;
    uint32_t version = 0;
    if (pread(fd, &magic, sizeof(magic), 0) == static_cast<ssize_t>(sizeof(magic)) &&
        magic == kMagic &&
        pread(fd, &version, sizeof(version), offsetof(Segment, version)) ==
            static_cast<ssize_t>(sizeof(version)) &&
        version != kVersion) {
      return OtherLayout(path, version);
    }
    if (NowNs() >= deadline) {
      return AbandonedSegment(
          path, StrCat("is ", st->st_size, " bytes, not the ", sizeof(Segment), " of this layout"));
    }
    SleepMs(1);
    if (fstat(fd, st) != 0) st->st_size = 0;
  }
  return Status::Ok();
}

}  // namespace

Result<Mapped> OpenExisting(const std::string& path, std::chrono::milliseconds wait) {
  Mapped m;
  struct stat st {};
  SPILLWAY_ASSIGN_OR_RETURN(m.fd, OpenOwnSegmentFile(path, &st));
  const uint64_t deadline = NowNs() + static_cast<uint64_t>(wait.count()) * 1'000'000ull;
  if (Status sized = WaitUntilSized(m.fd, path, deadline, &st); !sized.ok()) {
    Unmap(m);
    return sized;
  }
  void* p = mmap(nullptr, sizeof(Segment), PROT_READ | PROT_WRITE, MAP_SHARED, m.fd, 0);
  if (p == MAP_FAILED) {
    const int err = errno;
    Unmap(m);
    return Status::FromErrno(StatusCode::kOutOfMemory, err, StrCat("mapping node segment ", path));
  }
  m.segment = static_cast<Segment*>(p);
  while (m.segment->magic.load(std::memory_order_acquire) != kMagic) {
    if (NowNs() >= deadline) {
      Unmap(m);
      return AbandonedSegment(path, "was never initialized");
    }
    SleepMs(1);
  }
  if (m.segment->version != kVersion || m.segment->size != sizeof(Segment)) {
    const uint32_t version = m.segment->version;  // read before the unmap
    Unmap(m);
    return OtherLayout(path, version);
  }
  return m;
}

bool UnlinkIfSame(const std::string& path, int fd) {
  struct stat by_path {
  }, by_fd{};
  if (stat(path.c_str(), &by_path) != 0 || fstat(fd, &by_fd) != 0) return false;
  if (by_path.st_dev != by_fd.st_dev || by_path.st_ino != by_fd.st_ino) return false;
  return unlink(path.c_str()) == 0;
}

namespace {

struct SlotSnapshot {
  int index;
  pid_t pid;
  uint64_t start_ticks;
  uint64_t generation;
};

}  // namespace

Result<int> Reap(Segment* s, int own_slot, std::chrono::milliseconds timeout,
                 const std::string& path, LogLevel level) {
  // From another PID namespace (another container sharing /dev/shm, a sidecar) the slots' pids
  // name other processes or none: nothing there can be judged dead.
  if (s->pid_ns != OwnPidNamespace()) return 0;
  std::vector<SlotSnapshot> occupied;
  {
    SPILLWAY_ASSIGN_OR_RETURN(auto lock, SegmentLock::Take(s, timeout, path));
    for (int i = 0; i < kMaxSlots; ++i) {
      const Slot& slot = s->slots[i];
      if (i != own_slot && slot.pid != 0) {
        occupied.push_back({i, slot.pid, slot.start_ticks, slot.generation});
      }
    }
  }
  std::vector<SlotSnapshot> dead;
  for (const SlotSnapshot& o : occupied) {
    if (!Alive(o.pid, o.start_ticks)) dead.push_back(o);
  }
  if (dead.empty()) return 0;
  int reaped = 0;
  std::string what;
  {
    SPILLWAY_ASSIGN_OR_RETURN(auto lock, SegmentLock::Take(s, timeout, path));
    for (const SlotSnapshot& d : dead) {
      Slot& slot = s->slots[d.index];
      if (slot.pid != d.pid || slot.generation != d.generation) continue;
      what += StrCat(reaped ? "; " : "", "job '", JobName(s, slot.job), "' local rank ",
                     slot.local_rank, " (pid ", d.pid, "): host ",
                     FormatMiB(slot.bytes[0] + slot.bytes[1]), ", nvme ", FormatMiB(slot.bytes[2]));
      s->host_committed -= slot.bytes[0] + slot.bytes[1];
      s->nvme_committed -= slot.bytes[2];
      ClearSlot(&slot);
      s->reaped++;
      ++reaped;
    }
  }
  if (reaped > 0) {
    Log(level, StrCat("node segment ", path, ": reaped ", reaped,
                      " dead rank(s), their bytes are back: ", what));
  }
  return reaped;
}

NodeStats ReadStats(const Segment* s, const std::string& path, const std::string& job) {
  NodeStats out;
  out.job = job;
  out.ledger = s->ledger;
  out.scope = s->scope;
  out.budget_by = s->budget_by;
  out.path = path;
  out.memory_limit_bytes = s->memory_limit;
  out.reserve_bytes = s->reserve;
  out.budget_explicit = s->budget_explicit != 0;
  out.host_budget_bytes = s->host_budget;
  out.nvme_budget_bytes = s->nvme_budget;
  out.host_committed_bytes = s->host_committed;
  out.nvme_committed_bytes = s->nvme_committed;
  out.peak_host_committed_bytes = s->peak_host_committed;
  out.host_headroom_bytes =
      s->host_budget > s->host_committed ? s->host_budget - s->host_committed : 0;
  out.reaped_ranks = s->reaped;
  out.over_budget_count = s->over_budget;
  out.trim_requests = s->trim_requests;
  const int own = job.empty() ? -1 : FindJob(s, job);
  out.local_world_size = own >= 0 ? s->jobs[own].local_world_size : 0;
  for (int j = 0; j < kMaxJobs; ++j) {
    if (!JobHasRanks(s, j)) continue;
    NodeJobStats js;
    js.name = s->jobs[j].name;
    js.local_world_size = s->jobs[j].local_world_size;
    out.jobs.push_back(js);
  }
  for (const Slot& slot : s->slots) {
    if (slot.pid == 0 || !SlotPlaced(slot)) continue;  // a half claim: the next recovery frees it
    NodeRankStats r;
    r.job = s->jobs[slot.job].name;
    r.local_rank = slot.local_rank;
    r.pid = slot.pid;
    for (int t = 0; t < kNodeTierCount; ++t) r.bytes[t] = slot.bytes[t];
    r.host_bytes = slot.bytes[0] + slot.bytes[1];
    r.peak_host_bytes = slot.peak_host;
    for (int t = 0; t < kHostTiers; ++t) {
      for (int k = 0; k < kKindCount; ++k) {
        r.host_by_kind[k] += slot.kinds[t][k].load(std::memory_order_relaxed);
      }
    }
    r.declared_bytes = s->jobs[slot.job].declarations[slot.local_rank].need;
    r.workers_private_bytes = slot.workers_private.load(std::memory_order_relaxed);
    r.workers = slot.workers.load(std::memory_order_relaxed);
    for (int o = 0; o < kMemoryOwnerCount; ++o) {
      r.memory.owners[o] = slot.memory[o].load(std::memory_order_relaxed);
      r.memory.total += r.memory.owners[o];
    }
    r.memory.counted_beyond_resident = slot.memory_beyond.load(std::memory_order_relaxed);
    r.trims = slot.trims.load(std::memory_order_relaxed);
    for (NodeJobStats& js : out.jobs) {
      if (js.name != r.job) continue;
      ++js.ranks;
      js.host_bytes += r.host_bytes;
      js.nvme_bytes += r.bytes[2];
      js.declared_bytes += r.declared_bytes;
    }
    out.ranks.push_back(r);
  }
  std::sort(out.ranks.begin(), out.ranks.end(), [](const NodeRankStats& a, const NodeRankStats& b) {
    return a.job != b.job ? a.job < b.job : a.local_rank < b.local_rank;
  });
  std::sort(out.jobs.begin(), out.jobs.end(),
            [](const NodeJobStats& a, const NodeJobStats& b) { return a.name < b.name; });
  return out;
}

}  // namespace spillway::allocator::node
