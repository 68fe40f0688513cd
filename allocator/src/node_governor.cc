// NodeGovernor: the node's shared ledger (a file in /dev/shm, mode 0600), its robust lock, slot
// claims, dead-rank reaping, cross-rank trims and admission. Note [Node governor] in
// docs/allocator.md.
#include "spillway/allocator/node_governor.h"

#include <dirent.h>
#include <fcntl.h>
#include <linux/futex.h>
#include <pthread.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <climits>
#include <cstdio>
#include <cstring>
#include <ctime>
#include <fstream>
#include <new>
#include <sstream>

#include "spillway/allocator/host_arena.h"
#include "spillway/base/bytes.h"
#include "spillway/base/log.h"

namespace spillway::allocator {

namespace {

constexpr uint64_t kMagic = 0x31454430'4e4c5753ull;  // "SWLN0DE1"
constexpr uint32_t kVersion = 1;
constexpr int kMaxSlots = 64;
constexpr size_t kJobChars = 80;
constexpr int kHostTiers = 2;  // pinned, pageable

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

std::string SanitizeJob(std::string_view text) {
  std::string out;
  for (char c : text.substr(0, kJobChars)) out += ValidJobChar(c) ? c : '_';
  return out;
}

// Field 3 (state) and 22 (starttime, clock ticks since boot) of /proc/<pid>/stat. The command
// name (field 2) may hold spaces and parentheses: fields are counted after its last ')'.
bool ReadProcStat(pid_t pid, char* state, uint64_t* start_ticks) {
  std::ifstream in(StrCat("/proc/", pid, "/stat"));
  std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  const size_t close = text.rfind(')');
  if (close == std::string::npos) return false;
  std::istringstream fields(text.substr(close + 1));
  std::string field;
  for (int i = 3; i <= 22; ++i) {
    if (!(fields >> field)) return false;
    if (i == 3) *state = field.empty() ? '?' : field[0];
  }
  *start_ticks = std::strtoull(field.c_str(), nullptr, 10);
  return true;
}

// A rank is alive when its pid exists, is not a zombie (a killed rank its launcher has not yet
// waited for) and started when the slot says (the pid was not reused).
bool Alive(pid_t pid, uint64_t start_ticks) {
  if (kill(pid, 0) != 0 && errno == ESRCH) return false;
  char state = '?';
  uint64_t start = 0;
  if (!ReadProcStat(pid, &state, &start)) return kill(pid, 0) == 0 || errno != ESRCH;
  if (state == 'Z' || state == 'X') return false;
  return start == start_ticks;
}

int Futex(std::atomic<uint32_t>* word, int op, uint32_t value, const timespec* timeout) {
  return static_cast<int>(
      syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), op, value, timeout, nullptr, 0));
}

}  // namespace

const char* NodeTierName(NodeTier tier) {
  static constexpr const char* kNames[kNodeTierCount] = {"pinned", "pageable", "nvme"};
  return kNames[static_cast<int>(tier)];
}

// One rank's place in the segment. Fields marked "mu" change only under Segment::mu; the atomics
// are published without it.
struct Slot {
  int32_t pid;                     // mu; 0: free
  int32_t local_rank;              // mu
  uint64_t start_ticks;            // mu
  uint64_t generation;             // mu; bumped whenever the slot is freed
  uint64_t bytes[kNodeTierCount];  // mu
  uint64_t peak_host;              // mu
  std::atomic<uint64_t> kinds[kHostTiers][kKindCount];
  std::atomic<uint64_t> workers_private;
  std::atomic<uint32_t> workers;
  std::atomic<uint32_t> trim_ack;  // the last trim request this rank served
  std::atomic<uint64_t> trims;
};

struct NodeGovernor::Segment {
  std::atomic<uint64_t> magic;  // set last by the creator (release)
  uint32_t version;
  uint32_t slot_count;
  uint64_t size;
  pthread_mutex_t mu;  // robust, process-shared
  uint32_t closed;     // mu: the last rank left or the segment was found dead; reopen instead
  int32_t local_world_size;
  uint64_t memory_limit;
  uint64_t reserve;
  uint32_t budget_explicit;  // the job set its budget; else the default from the memory limit
  uint64_t host_budget;
  uint64_t nvme_budget;
  uint64_t host_committed;          // mu
  uint64_t nvme_committed;          // mu
  uint64_t peak_host_committed;     // mu
  uint64_t reaped;                  // mu
  uint64_t over_budget;             // mu
  uint64_t trim_requests;           // mu
  std::atomic<uint32_t> trim_word;  // futex: bumped by each trim request
  char job[kJobChars + 1];
  // Admission declarations by local rank (mu). Kept when a rank leaves, so every rank that checks
  // the sum sees the same declarations, however soon a rank that already passed exits.
  struct Declaration {
    uint64_t need;
    uint64_t fork;
    uint32_t made;
  } declarations[kMaxSlots];
  Slot slots[kMaxSlots];
};

namespace {

using Segment = NodeGovernor::Segment;

void RecomputeTotals(Segment* s) {
  s->host_committed = s->nvme_committed = 0;
  for (const Slot& slot : s->slots) {
    if (slot.pid == 0) continue;
    s->host_committed += slot.bytes[0] + slot.bytes[1];
    s->nvme_committed += slot.bytes[2];
  }
}

void ClearSlot(Slot* slot) {
  slot->pid = 0;
  slot->local_rank = -1;
  slot->start_ticks = 0;
  slot->generation++;
  for (uint64_t& b : slot->bytes) b = 0;
  slot->peak_host = 0;
  for (auto& tier : slot->kinds) {
    for (auto& k : tier) k.store(0, std::memory_order_relaxed);
  }
  slot->workers_private.store(0, std::memory_order_relaxed);
  slot->workers.store(0, std::memory_order_relaxed);
}

// The segment's lock, taken with a deadline. A rank that died holding it (EOWNERDEAD) may have
// left a slot's bytes and the totals disagreeing: the totals are recomputed from the slots.
class SegmentLock {
 public:
  static Result<SegmentLock> Take(Segment* s, std::chrono::milliseconds timeout,
                                  const std::string& path) {
    timespec deadline{};
    clock_gettime(CLOCK_REALTIME, &deadline);
    const int64_t ns = deadline.tv_nsec + (timeout.count() % 1000) * 1'000'000;
    deadline.tv_sec += timeout.count() / 1000 + ns / 1'000'000'000;
    deadline.tv_nsec = ns % 1'000'000'000;
    const int rc = pthread_mutex_timedlock(&s->mu, &deadline);
    if (rc == EOWNERDEAD) {
      RecomputeTotals(s);
      pthread_mutex_consistent(&s->mu);
      Log(LogLevel::kWarning,
          StrCat("node segment ", path, ": a rank died holding its lock; totals recomputed"));
    } else if (rc == ETIMEDOUT) {
      return Status::Make(
          StatusCode::kUnavailable,
          StrCat("node segment ", path, ": its lock was held for more than ", timeout.count(),
                 " ms (a rank stopped while holding it?); resume or kill that "
                 "rank, or remove the segment when no rank of the job runs"));
    } else if (rc != 0) {
      return Status::FromErrno(StatusCode::kInternal, rc,
                               StrCat("node segment ", path, ": locking it failed"));
    }
    return SegmentLock(s);
  }
  SegmentLock(SegmentLock&& o) noexcept : s_(o.s_) { o.s_ = nullptr; }
  SegmentLock& operator=(SegmentLock&&) = delete;
  ~SegmentLock() {
    if (s_ != nullptr) pthread_mutex_unlock(&s_->mu);
  }

 private:
  explicit SegmentLock(Segment* s) : s_(s) {}
  Segment* s_;
};

// A lock that release paths cannot do without: retried (and logged) until it is taken.
SegmentLock TakeForRelease(Segment* s, std::chrono::milliseconds timeout, const std::string& path) {
  while (true) {
    auto lock = SegmentLock::Take(s, timeout, path);
    if (lock.ok()) return std::move(lock.value());
    Log(LogLevel::kError, StrCat(lock.status().ToString(), "; retrying to give bytes back"));
  }
}

struct Mapped {
  int fd = -1;
  Segment* segment = nullptr;
};

void Unmap(const Mapped& m) {
  if (m.segment != nullptr) munmap(m.segment, sizeof(Segment));
  if (m.fd >= 0) close(m.fd);
}

// Opens an existing segment: this user's, mode 0600, of this layout, initialized (waits for its
// creator at most `timeout`). NOT_FOUND-like errors come back as kUnavailable with errno ENOENT.
Result<Mapped> OpenExisting(const std::string& path, std::chrono::milliseconds timeout) {
  Mapped m;
  m.fd = open(path.c_str(), O_RDWR | O_NOFOLLOW | O_CLOEXEC);
  if (m.fd < 0) {
    const int err = errno;
    if (err == EACCES || err == EPERM) {
      return Status::FromErrno(StatusCode::kFailedPrecondition, err,
                               StrCat("node segment ", path,
                                      " belongs to another user; a job's segment is its own "
                                      "user's (mode 0600): name this job differently "
                                      "(SPILLWAY_NODE_JOB)"));
    }
    return Status::FromErrno(StatusCode::kUnavailable, err, StrCat("opening node segment ", path));
  }
  struct stat st {};
  if (fstat(m.fd, &st) != 0) {
    const int err = errno;
    Unmap(m);
    return Status::FromErrno(StatusCode::kInternal, err, StrCat("fstat of ", path));
  }
  if (st.st_uid != geteuid() || (st.st_mode & 0777) != 0600 || !S_ISREG(st.st_mode)) {
    Unmap(m);
    return Status::FailedPrecondition(StrCat("node segment ", path, " is owned by uid ", st.st_uid,
                                             " with mode 0", std::oct, (st.st_mode & 0777),
                                             std::dec, "; Spillway makes its segments mode 0600 ",
                                             "for their own user (uid ", geteuid(),
                                             ") and uses no other. Remove it, or name "
                                             "this job differently (SPILLWAY_NODE_JOB)"));
  }
  const uint64_t deadline = NowNs() + static_cast<uint64_t>(timeout.count()) * 1'000'000ull;
  while (static_cast<uint64_t>(st.st_size) < sizeof(Segment)) {  // its creator is sizing it
    if (NowNs() > deadline) {
      Unmap(m);
      return Status::FailedPrecondition(
          StrCat("node segment ", path, " is ", st.st_size, " bytes, not the ", sizeof(Segment),
                 " of this Spillway's layout, and did not grow: its creator died while making it "
                 "or another Spillway version made it. Remove it when no rank of the job runs"));
    }
    SleepMs(1);
    if (fstat(m.fd, &st) != 0) st.st_size = 0;
  }
  void* p = mmap(nullptr, sizeof(Segment), PROT_READ | PROT_WRITE, MAP_SHARED, m.fd, 0);
  if (p == MAP_FAILED) {
    const int err = errno;
    Unmap(m);
    return Status::FromErrno(StatusCode::kOutOfMemory, err, StrCat("mapping node segment ", path));
  }
  m.segment = static_cast<Segment*>(p);
  while (m.segment->magic.load(std::memory_order_acquire) != kMagic) {
    if (NowNs() > deadline) {
      Unmap(m);
      return Status::FailedPrecondition(
          StrCat("node segment ", path, " was never initialized (its creator died while making ",
                 "it); remove it when no rank of the job runs"));
    }
    SleepMs(1);
  }
  if (m.segment->version != kVersion || m.segment->size != sizeof(Segment)) {
    const uint32_t version = m.segment->version;
    Unmap(m);
    return Status::FailedPrecondition(StrCat("node segment ", path, " has layout version ", version,
                                             "; this Spillway uses ", kVersion,
                                             ". Every rank of a job must run the same Spillway"));
  }
  return m;
}

struct SlotSnapshot {
  int index;
  pid_t pid;
  uint64_t start_ticks;
  uint64_t generation;
};

// Frees the slots of ranks that are gone, giving their bytes back. Liveness is checked without
// the lock (kill and /proc are system calls); a slot is freed only if it still holds the same
// occupant (its generation) when the lock is taken again. Returns the ranks reaped.
Result<int> Reap(Segment* s, int own_slot, std::chrono::milliseconds timeout,
                 const std::string& path, LogLevel level = LogLevel::kWarning) {
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
      what +=
          StrCat(reaped ? "; " : "", "local rank ", slot.local_rank, " (pid ", d.pid, "): host ",
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

NodeStats ReadStats(const Segment* s, const std::string& path) {  // assumes s->mu
  NodeStats out;
  out.job = s->job;
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
  out.local_world_size = s->local_world_size;
  for (const Slot& slot : s->slots) {
    if (slot.pid == 0) continue;
    NodeRankStats r;
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
    r.declared_bytes = s->declarations[slot.local_rank].need;
    r.workers_private_bytes = slot.workers_private.load(std::memory_order_relaxed);
    r.workers = slot.workers.load(std::memory_order_relaxed);
    r.trims = slot.trims.load(std::memory_order_relaxed);
    out.ranks.push_back(r);
  }
  std::sort(out.ranks.begin(), out.ranks.end(), [](const NodeRankStats& a, const NodeRankStats& b) {
    return a.local_rank < b.local_rank;
  });
  return out;
}

std::mutex g_current_mu;
std::shared_ptr<NodeGovernor> g_current;  // guarded by g_current_mu

}  // namespace

uint64_t DefaultNodeReserve(uint64_t limit_bytes) {
  return std::min(std::max(uint64_t{2} << 30, limit_bytes / 8), limit_bytes / 2);
}

uint64_t DefaultNodeHostBudget(uint64_t limit_bytes) {
  return limit_bytes - DefaultNodeReserve(limit_bytes);
}

Result<NodeJob> NodeJobFromEnvironment(const GetEnvFn& getenv) {
  auto get = [&](const char* name) -> std::string {
    const char* v = getenv(name);
    return v == nullptr ? std::string() : std::string(v);
  };
  auto parse_int = [&](const char* name, int* out) -> Status {
    const std::string v = get(name);
    if (v.empty()) return Status::Ok();
    char* end = nullptr;
    const long n = std::strtol(v.c_str(), &end, 10);
    if (end == v.c_str() || *end != '\0' || n < 0 || n > INT_MAX) {
      return Status::InvalidArgument(StrCat(
          name, "='", v, "' is not a non-negative integer; the launcher sets it, fix or unset it"));
    }
    *out = static_cast<int>(n);
    return Status::Ok();
  };
  NodeJob job;
  SPILLWAY_RETURN_IF_ERROR(parse_int("LOCAL_RANK", &job.local_rank));
  for (const char* name : {"LOCAL_WORLD_SIZE", "LOCAL_SIZE", "SLURM_NTASKS_PER_NODE"}) {
    if (!get(name).empty()) {
      SPILLWAY_RETURN_IF_ERROR(parse_int(name, &job.local_world_size));
      break;
    }
  }
  const std::string explicit_job = get("SPILLWAY_NODE_JOB");
  if (!explicit_job.empty()) {
    if (explicit_job.size() > kJobChars ||
        !std::all_of(explicit_job.begin(), explicit_job.end(), ValidJobChar)) {
      return Status::InvalidArgument(StrCat("SPILLWAY_NODE_JOB='", explicit_job, "': use at most ",
                                            kJobChars,
                                            " characters of A-Z, a-z, 0-9, '.', '_' and '-'"));
    }
    job.id = explicit_job;
    job.source = "SPILLWAY_NODE_JOB";
    return job;
  }
  if (get("LOCAL_RANK").empty()) return job;  // not one rank of a launched job
  const std::string run_id = get("TORCHELASTIC_RUN_ID");
  if (!run_id.empty() && run_id != "none") {
    job.id = SanitizeJob(StrCat("torchelastic-", run_id));
    job.source = "TORCHELASTIC_RUN_ID";
  } else if (!get("SLURM_JOB_ID").empty()) {
    job.id = SanitizeJob(StrCat("slurm-", get("SLURM_JOB_ID"), ".", get("SLURM_STEP_ID")));
    job.source = "SLURM_JOB_ID";
  } else {
    const pid_t parent = getppid();
    char state = '?';
    uint64_t start = 0;
    ReadProcStat(parent, &state, &start);
    job.id = StrCat("launcher-", parent, "-", start);
    job.source = "the launcher's pid (the parent of every local rank)";
  }
  return job;
}

Result<NodeJob> NodeJobFromEnvironment() {
  return NodeJobFromEnvironment([](const char* name) { return std::getenv(name); });
}

std::string NodeGovernor::SegmentPath(const std::string& dir, const std::string& job) {
  return StrCat(dir, "/spillway-node-", geteuid(), "-", job);
}

Result<std::unique_ptr<NodeGovernor>> NodeGovernor::Join(NodeGovernorOptions options) {
  if (options.job.empty() || options.job.size() > kJobChars ||
      !std::all_of(options.job.begin(), options.job.end(), ValidJobChar)) {
    return Status::InvalidArgument(StrCat("node governor: job '", options.job, "' must be 1 to ",
                                          kJobChars,
                                          " characters of A-Z, a-z, 0-9, '.', '_', '-'"));
  }
  if (options.local_rank >= kMaxSlots || options.local_world_size > kMaxSlots ||
      options.local_world_size < 0) {
    return Status::InvalidArgument(StrCat(
        "node governor: local rank ", options.local_rank, " or local world size ",
        options.local_world_size, " is beyond the ", kMaxSlots, " ranks a node segment holds"));
  }
  SPILLWAY_RETURN_IF_ERROR(ForkTracking());
  const std::string path = SegmentPath(options.dir, options.job);
  RemoveDeadSegments(options.dir);  // other jobs' litter (a job killed whole leaves its segment)
  const uint64_t deadline =
      NowNs() + static_cast<uint64_t>(options.lock_timeout.count()) * 1'000'000ull;
  char state = '?';
  uint64_t my_start = 0;
  ReadProcStat(getpid(), &state, &my_start);
  while (true) {
    if (NowNs() > deadline) {
      return Status::Make(StatusCode::kUnavailable,
                          StrCat("node governor: segment ", path, " stayed closed for ",
                                 options.lock_timeout.count(), " ms while its last rank left"));
    }
    int fd = open(path.c_str(), O_RDWR | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0600);
    if (fd >= 0) {  // this rank makes the segment: initialized whole before magic is published
      Mapped m;
      m.fd = fd;
      if (fchmod(fd, 0600) != 0 || ftruncate(fd, sizeof(Segment)) != 0) {
        const int err = errno;
        Unmap(m);
        unlink(path.c_str());
        return Status::FromErrno(
            StatusCode::kOutOfMemory, err,
            StrCat("node governor: sizing segment ", path, " (is /dev/shm full or too small?)"));
      }
      void* p = mmap(nullptr, sizeof(Segment), PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
      if (p == MAP_FAILED) {
        const int err = errno;
        Unmap(m);
        unlink(path.c_str());
        return Status::FromErrno(StatusCode::kOutOfMemory, err,
                                 StrCat("node governor: mapping segment ", path));
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
        Unmap(m);
        unlink(path.c_str());
        return Status::FromErrno(StatusCode::kInternal, rc, "node governor: pthread_mutex_init");
      }
      s->version = kVersion;
      s->slot_count = kMaxSlots;
      s->size = sizeof(Segment);
      s->local_world_size = options.local_world_size;
      s->memory_limit =
          options.memory_limit_bytes != 0 ? options.memory_limit_bytes : MemoryLimitBytes();
      s->host_budget = options.host_budget_bytes != 0 ? options.host_budget_bytes
                                                      : DefaultNodeHostBudget(s->memory_limit);
      s->reserve = s->memory_limit > s->host_budget ? s->memory_limit - s->host_budget : 0;
      s->budget_explicit = options.host_budget_bytes != 0 ? 1 : 0;
      s->nvme_budget = options.nvme_budget_bytes;
      std::snprintf(s->job, sizeof(s->job), "%s", options.job.c_str());
      for (Slot& slot : s->slots) slot.local_rank = -1;
      const int slot = options.local_rank >= 0 ? options.local_rank : 0;
      s->slots[slot].pid = getpid();
      s->slots[slot].local_rank = slot;
      s->slots[slot].start_ticks = my_start;
      s->slots[slot].trim_ack.store(0, std::memory_order_relaxed);
      s->magic.store(kMagic, std::memory_order_release);
      return std::unique_ptr<NodeGovernor>(new NodeGovernor(std::move(options), path, fd, s, slot));
    }
    if (errno != EEXIST) {
      return Status::FromErrno(
          StatusCode::kUnavailable, errno,
          StrCat("node governor: creating segment ", path, " (is /dev/shm mounted and writable?)"));
    }
    auto opened = OpenExisting(path, options.lock_timeout);
    if (!opened.ok()) {
      if (opened.status().sys_error() == ENOENT) continue;  // unlinked meanwhile: create it
      return opened.status().WithContext("node governor");
    }
    Mapped m = *opened;
    Segment* s = m.segment;
    // A dead occupant of the slot this rank wants (an elastic restart's predecessor) goes first.
    auto reaped = Reap(s, -1, options.lock_timeout, path);
    if (!reaped.ok()) {
      Unmap(m);
      return reaped.status();
    }
    auto lock = SegmentLock::Take(s, options.lock_timeout, path);
    if (!lock.ok()) {
      Unmap(m);
      return lock.status();
    }
    if (s->closed != 0) {  // its last rank is leaving: wait until it is gone, then make anew
      { auto unlock = std::move(*lock); }
      Unmap(m);
      SleepMs(1);
      continue;
    }
    if (options.host_budget_bytes != 0 && options.host_budget_bytes != s->host_budget) {
      const uint64_t have = s->host_budget;
      { auto unlock = std::move(*lock); }
      Unmap(m);
      return Status::InvalidArgument(StrCat(
          "node governor: job '", options.job, "' has a node budget of ", FormatBytes(have),
          ", set by its first rank; this rank asks for ", FormatBytes(options.host_budget_bytes),
          ". Give every rank the same SPILLWAY_NODE_BUDGET_BYTES"));
    }
    int slot = options.local_rank;
    if (slot < 0) {
      for (int i = 0; i < kMaxSlots && slot < 0; ++i) {
        if (s->slots[i].pid == 0) slot = i;
      }
      if (slot < 0) {
        { auto unlock = std::move(*lock); }
        Unmap(m);
        return Status::ResourceExhausted(StrCat("node governor: all ", kMaxSlots, " slots of ",
                                                path, " are held by live ranks"));
      }
    } else if (s->slots[slot].pid != 0) {
      const pid_t holder = s->slots[slot].pid;
      { auto unlock = std::move(*lock); }
      Unmap(m);
      return Status::FailedPrecondition(
          StrCat("node governor: local rank ", slot, " of job '", options.job, "' is held by pid ",
                 holder, ", which is alive. Two processes claim one local ",
                 "rank: check LOCAL_RANK, or give the second job its own SPILLWAY_NODE_JOB"));
    }
    Slot& mine = s->slots[slot];
    mine.pid = getpid();
    mine.local_rank = slot;
    mine.start_ticks = my_start;
    mine.trim_ack.store(s->trim_word.load(std::memory_order_relaxed), std::memory_order_relaxed);
    if (s->local_world_size == 0) s->local_world_size = options.local_world_size;
    return std::unique_ptr<NodeGovernor>(new NodeGovernor(std::move(options), path, m.fd, s, slot));
  }
}

NodeGovernor::NodeGovernor(NodeGovernorOptions options, std::string path, int fd, Segment* segment,
                           int slot)
    : options_(std::move(options)),
      path_(std::move(path)),
      fd_(fd),
      segment_(segment),
      slot_(slot) {
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
  Futex(&segment_->trim_word, FUTEX_WAKE, INT_MAX, nullptr);
  if (watcher_.joinable()) watcher_.join();
  // Dead peers must not keep the segment alive; a failure here only leaves it to a later Join.
  Reap(segment_, slot_, options_.lock_timeout, path_).status().IgnoreError();
  bool last = false;
  {
    SegmentLock lock = TakeForRelease(segment_, options_.lock_timeout, path_);
    Slot& mine = segment_->slots[slot_];
    const uint64_t held = mine.bytes[0] + mine.bytes[1] + mine.bytes[2];
    if (held != 0) {
      Log(LogLevel::kInfo,
          StrCat("node governor: local rank ", slot_, " leaves job '", options_.job, "' with ",
                 FormatBytes(held), " still booked (its arenas outlive it); given back"));
    }
    segment_->host_committed -= mine.bytes[0] + mine.bytes[1];
    segment_->nvme_committed -= mine.bytes[2];
    ClearSlot(&mine);
    last = std::none_of(std::begin(segment_->slots), std::end(segment_->slots),
                        [](const Slot& s) { return s.pid != 0; });
    if (last) segment_->closed = 1;
  }
  if (last) unlink(path_.c_str());  // only the rank that closed it: no newer segment is there yet
}

uint64_t NodeGovernor::host_budget_bytes() const { return segment_->host_budget; }

std::shared_ptr<NodeGovernor> NodeGovernor::Current() {
  std::lock_guard<std::mutex> lock(g_current_mu);
  return g_current;
}

void NodeGovernor::SetCurrent(std::shared_ptr<NodeGovernor> governor) {
  std::lock_guard<std::mutex> lock(g_current_mu);
  g_current = std::move(governor);
}

Status NodeGovernor::ReapDead() const {
  return Reap(segment_, slot_, options_.lock_timeout, path_).status();
}

Status NodeGovernor::TryReserve(NodeTier tier, uint64_t bytes) {
  SPILLWAY_RETURN_IF_ERROR(process_.Check("NodeGovernor", "Reserve"));
  if (left_.load(std::memory_order_acquire)) {
    return Status::FailedPrecondition(StrCat("node governor: local rank ", slot_,
                                             " already left job '", options_.job,
                                             "' (the process is exiting); nothing is booked"));
  }
  if (bytes == 0) return Status::Ok();
  SPILLWAY_ASSIGN_OR_RETURN(auto lock, SegmentLock::Take(segment_, options_.lock_timeout, path_));
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
  if (tier != NodeTier::kNvme) {  // trimming host caches frees no disk
    TrimLocal();
    SPILLWAY_RETURN_IF_ERROR(RequestTrimAndWait());
    st = TryReserve(tier, bytes);
    if (st.code() != StatusCode::kOverBudget) return st;
  }
  {
    SPILLWAY_ASSIGN_OR_RETURN(auto lock, SegmentLock::Take(segment_, options_.lock_timeout, path_));
    segment_->over_budget++;
  }
  return Status::OverBudget(DescribeOverBudget(tier, bytes));
}

void NodeGovernor::Release(NodeTier tier, uint64_t bytes) {
  if (bytes == 0 || !process_.InOwner() || left_.load(std::memory_order_acquire)) return;
  SegmentLock lock = TakeForRelease(segment_, options_.lock_timeout, path_);
  Slot& mine = segment_->slots[slot_];
  uint64_t& held = mine.bytes[static_cast<int>(tier)];
  uint64_t& committed =
      tier == NodeTier::kNvme ? segment_->nvme_committed : segment_->host_committed;
  if (bytes > held || bytes > committed) {  // a bug in the caller: never let the totals wrap
    Log(LogLevel::kError,
        StrCat("node governor: local rank ", slot_, " releases ", FormatBytes(bytes), " of ",
               NodeTierName(tier), " but holds ", FormatBytes(held), "; releasing what it holds"));
    bytes = std::min(held, committed);
  }
  held -= bytes;
  committed -= bytes;
}

uint64_t NodeGovernor::OfferNvmeBudget(uint64_t bytes) {
  auto lock = SegmentLock::Take(segment_, options_.lock_timeout, path_);
  if (!lock.ok())
    return segment_->nvme_budget;  // a racy read beats none; the lock's error is logged
  if (segment_->nvme_budget == 0) segment_->nvme_budget = bytes;
  return segment_->nvme_budget;
}

void NodeGovernor::PublishKinds(NodeTier tier, const KindBytes& live_by_kind) {
  if (tier == NodeTier::kNvme || !process_.InOwner()) return;
  Slot& mine = segment_->slots[slot_];
  for (int k = 0; k < kKindCount; ++k) {
    mine.kinds[static_cast<int>(tier)][k].store(live_by_kind[k], std::memory_order_relaxed);
  }
}

void NodeGovernor::PublishWorkers(uint64_t private_bytes, uint32_t workers) {
  if (!process_.InOwner()) return;
  Slot& mine = segment_->slots[slot_];
  mine.workers_private.store(private_bytes, std::memory_order_relaxed);
  mine.workers.store(workers, std::memory_order_relaxed);
}

void NodeGovernor::AddTrimmer(const void* owner, std::function<uint64_t()> trim) {
  std::lock_guard<std::mutex> lock(trim_mu_);
  trimmers_.push_back({owner, std::move(trim)});
}

void NodeGovernor::RemoveTrimmer(const void* owner) {
  if (!process_.InOwner()) return;
  std::unique_lock<std::mutex> lock(trim_mu_);
  trimmers_.erase(std::remove_if(trimmers_.begin(), trimmers_.end(),
                                 [owner](const Trimmer& t) { return t.owner == owner; }),
                  trimmers_.end());
  trims_idle_.wait(lock, [this] { return trims_in_flight_ == 0; });
}

uint64_t NodeGovernor::TrimLocal() {
  if (!process_.InOwner()) return 0;
  std::vector<std::function<uint64_t()>> calls;
  {
    std::lock_guard<std::mutex> lock(trim_mu_);
    for (const Trimmer& t : trimmers_) calls.push_back(t.trim);
    ++trims_in_flight_;
  }
  uint64_t freed = 0;
  for (auto& call : calls) freed += call();  // without trim_mu_: they unmap
  std::lock_guard<std::mutex> lock(trim_mu_);
  if (--trims_in_flight_ == 0) trims_idle_.notify_all();
  return freed;
}

Status NodeGovernor::RequestTrimAndWait() {
  std::vector<SlotSnapshot> others;
  {
    SPILLWAY_ASSIGN_OR_RETURN(auto lock, SegmentLock::Take(segment_, options_.lock_timeout, path_));
    segment_->trim_requests++;
    for (int i = 0; i < kMaxSlots; ++i) {
      const Slot& slot = segment_->slots[i];
      if (i != slot_ && slot.pid != 0) {
        others.push_back({i, slot.pid, slot.start_ticks, slot.generation});
      }
    }
  }
  if (others.empty()) return Status::Ok();
  const uint32_t request = segment_->trim_word.fetch_add(1, std::memory_order_acq_rel) + 1;
  Futex(&segment_->trim_word, FUTEX_WAKE, INT_MAX, nullptr);
  const uint64_t deadline =
      NowNs() + static_cast<uint64_t>(options_.trim_timeout.count()) * 1'000'000ull;
  for (const SlotSnapshot& o : others) {
    const Slot& slot = segment_->slots[o.index];
    while (static_cast<int32_t>(slot.trim_ack.load(std::memory_order_acquire) - request) < 0) {
      // The slot changed hands or its rank died: nothing to wait for.
      if (__atomic_load_n(&slot.generation, __ATOMIC_RELAXED) != o.generation ||
          !Alive(o.pid, o.start_ticks)) {
        break;
      }
      if (NowNs() > deadline) {
        Log(LogLevel::kWarning,
            StrCat("node governor: local rank ", o.index, " (pid ", o.pid,
                   ") did not answer a trim request within ", options_.trim_timeout.count(),
                   " ms (it runs no watcher, or is stopped)"));
        break;
      }
      SleepMs(1);
    }
  }
  return Status::Ok();
}

void NodeGovernor::WatchLoop() {
  Slot& mine = segment_->slots[slot_];
  uint32_t seen = mine.trim_ack.load(std::memory_order_relaxed);
  const auto interval = options_.watch_interval;
  while (!stop_.load(std::memory_order_acquire)) {
    timespec timeout{static_cast<time_t>(interval.count() / 1000),
                     static_cast<long>((interval.count() % 1000) * 1'000'000)};
    Futex(&segment_->trim_word, FUTEX_WAIT, seen, &timeout);
    if (stop_.load(std::memory_order_acquire)) break;
    const uint32_t now = segment_->trim_word.load(std::memory_order_acquire);
    if (now != seen) {
      TrimLocal();
      mine.trims.fetch_add(1, std::memory_order_relaxed);
      mine.trim_ack.store(now, std::memory_order_release);
      seen = now;
    }
    Status st = ReapDead();
    if (!st.ok()) Log(LogLevel::kWarning, st.ToString());
  }
}

std::string DescribeNodeBudget(const NodeStats& s) {
  if (s.budget_explicit) {
    return StrCat(
        "(set for this job by SPILLWAY_NODE_BUDGET_BYTES or SPILLWAY_NODE_RESERVE_BYTES; "
        "the memory limit is ",
        FormatBytes(s.memory_limit_bytes), ")");
  }
  return StrCat("(the memory limit ", FormatBytes(s.memory_limit_bytes), " less a reserve of ",
                FormatBytes(s.reserve_bytes),
                " for the OS, the page cache and what no arena counts)");
}

std::string DescribeNodeRanks(const NodeStats& stats) {
  std::string out;
  for (const NodeRankStats& r : stats.ranks) {
    out += StrCat(out.empty() ? "" : "; ", "local rank ", r.local_rank, " (pid ", r.pid,
                  ") pinned ", FormatMiB(r.bytes[0]), ", pageable ", FormatMiB(r.bytes[1]));
    std::string kinds;
    for (int k = 0; k < kKindCount; ++k) {
      if (r.host_by_kind[k] == 0) continue;
      kinds += StrCat(kinds.empty() ? "" : ", ", KindName(static_cast<Kind>(k)), " ",
                      FormatMiB(r.host_by_kind[k]));
    }
    if (!kinds.empty()) out += StrCat(" [", kinds, "]");
    if (r.workers != 0) {
      out += StrCat(", ", r.workers, " workers' private ", FormatMiB(r.workers_private_bytes));
    }
  }
  return out.empty() ? "no rank holds anything" : out;
}

std::string NodeGovernor::DescribeOverBudget(NodeTier tier, uint64_t bytes) const {
  const NodeStats s = Stats();
  const bool host = tier != NodeTier::kNvme;
  const uint64_t budget = host ? s.host_budget_bytes : s.nvme_budget_bytes;
  const uint64_t committed = host ? s.host_committed_bytes : s.nvme_committed_bytes;
  return StrCat(
      "node budget: local rank ", slot_, " of job '", options_.job, "' needs ", FormatBytes(bytes),
      " more ", NodeTierName(tier), " memory, but the node's ", host ? "host" : "NVMe",
      " budget of ", FormatBytes(budget), host ? StrCat(" ", DescribeNodeBudget(s)) : std::string(),
      " has ", FormatBytes(committed), " booked by ", s.ranks.size(),
      " rank(s) after every rank trimmed its retained cache: ", DescribeNodeRanks(s),
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
  {
    SPILLWAY_ASSIGN_OR_RETURN(auto lock, SegmentLock::Take(segment_, options_.lock_timeout, path_));
    auto& mine = segment_->declarations[slot_];
    mine.need = need_bytes;
    mine.fork = workers_fork_bytes;
    mine.made = 1;
  }
  const uint64_t deadline = NowNs() + static_cast<uint64_t>(timeout.count()) * 1'000'000ull;
  struct Declared {
    int local_rank;
    uint64_t need, fork;
  };
  std::vector<Declared> declared;
  NodeStats snap;
  while (true) {
    std::vector<int> missing;
    {
      SPILLWAY_ASSIGN_OR_RETURN(auto lock,
                                SegmentLock::Take(segment_, options_.lock_timeout, path_));
      declared.clear();
      for (int r = 0; r < kMaxSlots; ++r) {
        const auto& d = segment_->declarations[r];
        if (d.made != 0) {
          declared.push_back({r, d.need, d.fork});
        } else if (r < segment_->local_world_size || segment_->slots[r].pid != 0) {
          missing.push_back(r);  // expected by the launcher, or joined and not yet declared
        }
      }
      snap = ReadStats(segment_, path_);
    }
    if (missing.empty()) break;
    if (NowNs() > deadline) {
      std::string names;
      for (int r : missing) names += StrCat(names.empty() ? "" : ", ", r);
      return Status::Make(
          StatusCode::kUnavailable,
          StrCat("node admission: local rank(s) ", names, " of job '", options_.job,
                 "' did not declare their host memory within ", timeout.count(),
                 " ms; each rank declares at deepspeed.initialize (or spillway.install with a "
                 "declared size). Check that they started, or raise the timeout"));
    }
    SleepMs(5);
  }
  std::sort(declared.begin(), declared.end(),
            [](const Declared& a, const Declared& b) { return a.local_rank < b.local_rank; });
  uint64_t total = 0;
  std::string each;
  for (const Declared& d : declared) {
    total += d.need;
    each +=
        StrCat(each.empty() ? "" : "; ", "local rank ", d.local_rank, " ", FormatMiB(d.need),
               d.fork != 0 ? StrCat(" (of which its workers' fork copy ", FormatMiB(d.fork), ")")
                           : std::string());
  }
  if (total <= snap.host_budget_bytes) return Status::Ok();
  return Status::OverBudget(StrCat(
      "node admission: the ", declared.size(), " local ranks of job '", options_.job, "' need ",
      FormatBytes(total), " of host memory together, more than the node budget of ",
      FormatBytes(snap.host_budget_bytes), " ", DescribeNodeBudget(snap),
      ". Each rank's need: ", each, ". Nothing was allocated.", detail.empty() ? "" : " ", detail));
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
    empty.job = options_.job;
    empty.path = path_;
    return empty;
  }
  return ReadStats(segment_, path_);
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

Result<NodeStats> NodeGovernor::Inspect(const std::string& path,
                                        std::chrono::milliseconds lock_timeout) {
  SPILLWAY_ASSIGN_OR_RETURN(Mapped m, OpenExisting(path, lock_timeout));
  auto reaped = Reap(m.segment, -1, lock_timeout, path);
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
    out = ReadStats(m.segment, path);
  }
  Unmap(m);
  return out;
}

std::vector<std::string> NodeGovernor::ListSegments(const std::string& dir) {
  std::vector<std::string> out;
  const std::string prefix = StrCat("spillway-node-", geteuid(), "-");
  DIR* d = opendir(dir.c_str());
  if (d == nullptr) return out;
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
    auto opened = OpenExisting(path, std::chrono::milliseconds(50));
    if (!opened.ok()) continue;  // being made, or not ours to judge: left alone
    Mapped m = *opened;
    bool close_it = false;
    if (Reap(m.segment, -1, std::chrono::milliseconds(200), path, LogLevel::kInfo).ok()) {
      auto lock = SegmentLock::Take(m.segment, std::chrono::milliseconds(200), path);
      if (lock.ok() && m.segment->closed == 0 &&
          std::none_of(std::begin(m.segment->slots), std::end(m.segment->slots),
                       [](const Slot& s) { return s.pid != 0; })) {
        m.segment->closed = 1;  // this process closed it, so this process unlinks it
        close_it = true;
      }
    }
    Unmap(m);
    if (close_it && unlink(path.c_str()) == 0) {
      ++removed;
      Log(LogLevel::kInfo, StrCat("node governor: removed ", path, ": every rank of it is gone"));
    }
  }
  return removed;
}

namespace {

std::string Cell(uint64_t bytes) { return bytes == 0 ? "-" : FormatMiB(bytes); }

}  // namespace

std::string NodeStats::ToString() const {
  std::ostringstream out;
  out << "job " << job << "  (segment " << path << ")\n";
  out << "host budget " << FormatBytes(host_budget_bytes) << " " << DescribeNodeBudget(*this)
      << "\n";
  out << "host committed " << FormatBytes(host_committed_bytes) << " (peak "
      << FormatBytes(peak_host_committed_bytes) << "), headroom "
      << FormatBytes(host_headroom_bytes) << "\n";
  out << "nvme committed " << FormatBytes(nvme_committed_bytes) << ", budget "
      << (nvme_budget_bytes == 0 ? std::string("not capped") : FormatBytes(nvme_budget_bytes))
      << "\n";
  out << "ranks " << ranks.size() << " of " << local_world_size << " expected; reaped "
      << reaped_ranks << ", trim requests " << trim_requests << ", refusals " << over_budget_count
      << "\n\n";
  char line[256];
  std::snprintf(line, sizeof(line), "%-5s %-8s %12s %12s %12s %12s %12s %16s  %s\n", "rank", "pid",
                "pinned", "pageable", "nvme", "peak host", "declared", "workers", "by kind");
  out << line;
  for (const NodeRankStats& r : ranks) {
    std::string kinds;
    for (int k = 0; k < kKindCount; ++k) {
      if (r.host_by_kind[k] == 0) continue;
      kinds += StrCat(kinds.empty() ? "" : ", ", KindName(static_cast<Kind>(k)), " ",
                      FormatMiB(r.host_by_kind[k]));
    }
    const std::string workers =
        r.workers == 0 ? "-" : StrCat(r.workers, " / ", FormatMiB(r.workers_private_bytes));
    std::snprintf(line, sizeof(line), "%-5d %-8d %12s %12s %12s %12s %12s %16s  %s\n", r.local_rank,
                  static_cast<int>(r.pid), Cell(r.bytes[0]).c_str(), Cell(r.bytes[1]).c_str(),
                  Cell(r.bytes[2]).c_str(), Cell(r.peak_host_bytes).c_str(),
                  Cell(r.declared_bytes).c_str(), workers.c_str(),
                  kinds.empty() ? "-" : kinds.c_str());
    out << line;
  }
  return out.str();
}

}  // namespace spillway::allocator
