// The node governor's shared-memory segment (private to allocator/): one per memory limit (a
// cgroup's, else the machine's), holding every job of the user under it. Its layout, its robust
// lock, the directory lock that orders creating and removing segments, opening and creating a
// segment, reaping dead ranks, and reading the ledger. Note [Node governor] in docs/allocator.md.
#pragma once

#include <pthread.h>
#include <sys/types.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <string>

#include "spillway/allocator/node_governor.h"
#include "spillway/base/log.h"
#include "spillway/base/status.h"

namespace spillway::allocator::node {

inline constexpr uint64_t kMagic = 0x31454430'4e4c5753ull;  // "SWLN0DE1"
inline constexpr uint32_t kVersion = 6;
inline constexpr int kMaxSlots = 64;        // ranks of every job under the limit
inline constexpr int kMaxJobs = kMaxSlots;  // every process may be a job of its own
inline constexpr size_t kJobChars = 80;     // a job's or a ledger's name
inline constexpr size_t kScopeChars = 255;
inline constexpr int kHostTiers = 2;  // pinned, pageable
inline constexpr size_t kVerdictChars = 4096;

// One rank's place. Fields marked "mu" change only under Segment::mu; the atomics are published
// without it.
struct Slot {
  int32_t pid;                     // mu; 0: free
  int32_t job;                     // mu; its entry in Segment::jobs (-1: free)
  int32_t local_rank;              // mu; within its job
  uint64_t start_ticks;            // mu
  uint64_t generation;             // mu; bumped whenever the slot is freed
  uint64_t bytes[kNodeTierCount];  // mu
  uint64_t peak_host;              // mu
  std::atomic<uint64_t> kinds[kHostTiers][kKindCount];
  std::atomic<uint64_t> workers_private;
  std::atomic<uint64_t> memory[kMemoryOwnerCount];  // its resident bytes by owner, last published
  std::atomic<uint64_t> memory_beyond;              // and what the counters claimed beyond them
  std::atomic<uint32_t> workers;
  std::atomic<uint32_t> trim_ack;  // the last trim request this rank served
  std::atomic<uint64_t> trims;
};

// An admission declaration, by local rank (mu). Kept when its rank leaves, so a rank that passed
// and exited does not change what a slower one sees; cleared when a job restarts whole.
struct Declaration {
  uint64_t need;  // summed over the rank's admitted Admit calls (one per engine)
  uint64_t fork;
  uint64_t last_need;  // the last call's, taken back when its round is refused
  uint64_t last_fork;
  uint32_t round;  // the rank's last Admit call, counted from 1
};

enum class Verdict : uint32_t { kNone = 0, kFits, kOverBudget, kAborted };

// One job under the memory limit (mu): its ranks' slots point here. An entry with no live slot is
// free to take; a job whose ranks all left and that comes back (a restart) starts it anew.
struct JobEntry {
  char name[kJobChars + 1];             // empty: never used
  int32_t local_world_size;             // 0: not said
  Declaration declarations[kMaxSlots];  // by local rank
  uint32_t verdict_round;               // the admission round the verdict below is for
  Verdict verdict;
  char verdict_text[kVerdictChars];
};

struct Segment {
  std::atomic<uint64_t> magic;  // set last by the creator (release)
  uint32_t version;
  uint32_t slot_count;
  uint64_t size;
  uint64_t pid_ns;     // the creator's PID namespace (inode of /proc/self/ns/pid): pids mean
                       // something only there
  pthread_mutex_t mu;  // robust, process-shared
  uint32_t closed;     // mu: being removed; a joiner makes a new segment instead
  char ledger[kJobChars + 1];     // the name in the segment's path
  char scope[kScopeChars + 1];    // the memory limit it stands for, in words
  char budget_by[kJobChars + 1];  // mu; the job that made the ledger, or that set the budget
  uint64_t memory_limit;
  uint64_t reserve;              // mu
  uint32_t budget_explicit;      // mu; a job set the budget; else the default from the memory limit
  uint64_t host_budget;          // mu: a job's explicit budget replaces a default one (Join)
  uint64_t nvme_budget;          // mu (the first NVMe arena may set it)
  uint64_t host_committed;       // mu
  uint64_t nvme_committed;       // mu
  uint64_t peak_host_committed;  // mu
  uint64_t reaped;               // mu
  uint64_t over_budget;          // mu
  uint64_t trim_requests;        // mu
  std::atomic<uint32_t> trim_word;  // futex: bumped by each trim request
  JobEntry jobs[kMaxJobs];          // mu
  Slot slots[kMaxSlots];
};

uint64_t NowNs();  // CLOCK_MONOTONIC
void SleepMs(int ms);
bool ValidJobChar(char c);
// 1 to kJobChars characters, each a ValidJobChar.
bool ValidJob(const std::string& job);
// Field 3 (state) and 22 (start time in clock ticks) of /proc/<pid>/stat.
bool ReadProcStat(pid_t pid, char* state, uint64_t* start_ticks);
// The pid exists, is not a zombie, and started at `start_ticks` (not a reused pid).
bool Alive(pid_t pid, uint64_t start_ticks);
// The inode of /proc/self/ns/pid (0 when unreadable): a segment's pids are judged only from its
// creator's PID namespace (Reap does nothing from another).
uint64_t OwnPidNamespace();
int Futex(std::atomic<uint32_t>* word, int op, uint32_t value, const timespec* timeout);
void ClearSlot(Slot* slot);
// Assumes s->mu. After a rank died holding the lock: frees slots it left half claimed (a pid with
// no job or local rank), then sums the totals from the slots.
void RecomputeTotals(Segment* s);
// The following assume s->mu.
int FindJob(const Segment* s, const std::string& name);  // its entry, or -1
// A slot's job name, "?" for an index out of range (a rank killed while claiming its slot).
const char* JobName(const Segment* s, int job);
// The slot's job and local rank are in range (a rank killed while claiming leaves them not).
bool SlotPlaced(const Slot& slot);
bool JobHasRanks(const Segment* s, int job);              // a live slot points at it
int RankSlot(const Segment* s, int job, int local_rank);  // the live slot, or -1
// The entry for `name`: its own when one of its ranks is alive; else a fresh one (its own, reused
// for a restart, else a never-used one, else one whose ranks are all gone). -1: every entry holds
// live ranks.
int TakeJob(Segment* s, const std::string& name);
// The memory a job's live ranks hold or declared, whichever is more for each rank (admission counts
// it for every job but the one being judged); `ranks` gets their number.
uint64_t JobHeldOrDeclared(const Segment* s, int job, int* ranks);

// The segment's lock, taken with a deadline on CLOCK_MONOTONIC. A rank that died holding it
// (EOWNERDEAD) may have left a slot's bytes and the totals disagreeing: they are recomputed from
// the slots, and said (after the unlock) in the log.
class SegmentLock {
 public:
  static Result<SegmentLock> Take(Segment* s, std::chrono::milliseconds timeout,
                                  const std::string& path);
  SegmentLock(SegmentLock&& o) noexcept : s_(o.s_), recovered_(o.recovered_), path_(o.path_) {
    o.s_ = nullptr;
  }
  SegmentLock& operator=(SegmentLock&&) = delete;
  ~SegmentLock();

 private:
  SegmentLock(Segment* s, bool recovered, const std::string* path)
      : s_(s), recovered_(recovered), path_(path) {}
  Segment* s_;
  bool recovered_;
  const std::string* path_;
};

// flock(2) on `<dir>/.spillway-node-<uid>.lock`, polled until a deadline: held while a segment is
// created and initialized, and while one is checked and unlinked, so no segment is ever created
// between another process's check of a path and its unlink. Rare and short; never taken with a
// segment's lock held.
class DirLock {
 public:
  static Result<DirLock> Take(const std::string& dir, std::chrono::milliseconds timeout);
  DirLock(DirLock&& o) noexcept : fd_(o.fd_) { o.fd_ = -1; }
  DirLock& operator=(DirLock&&) = delete;
  ~DirLock();

 private:
  explicit DirLock(int fd) : fd_(fd) {}
  int fd_;
};

struct Mapped {
  int fd = -1;
  Segment* segment = nullptr;
};
void Unmap(const Mapped& m);

// Opens an existing segment: this user's, mode 0600, regular, of this layout, initialized. A
// missing file is kUnavailable with errno ENOENT. `wait` bounds how long an opener waits for a
// creator still initializing it; with it 0, an uninitialized segment is kFailedPrecondition with
// errno EBADF (abandoned, when the caller holds the DirLock).
Result<Mapped> OpenExisting(const std::string& path, std::chrono::milliseconds wait);

// Unlinks `path` if it is still the file `fd` refers to. Assumes the DirLock.
bool UnlinkIfSame(const std::string& path, int fd);

// Frees the slots of ranks that are gone, giving their bytes back: liveness is checked without the
// lock (kill and /proc are system calls), and a slot is freed only if it still holds the same
// occupant (its generation) when the lock is taken again. Returns the ranks reaped.
Result<int> Reap(Segment* s, int own_slot, std::chrono::milliseconds timeout,
                 const std::string& path, LogLevel level = LogLevel::kWarning);

// Assumes s->mu. `job`: the job the view is for (NodeStats::job, local_world_size); empty: none.
NodeStats ReadStats(const Segment* s, const std::string& path, const std::string& job);

// What a rank holds outside Spillway's arenas that its memory limit charges and no reclaim gives
// back, from the memory by owner it published (0 when it published none): torch's CPU and pinned
// bytes, the CUDA driver's, the interpreter's, malloc's (in use and kept free) and the unowned
// rest. Not the arenas (booked in the ledger), mapped files and libraries (file pages the kernel
// can drop and read again), nor shared memory (charged once, however many ranks map it and count
// it in their resident bytes).
uint64_t HeldOutsideArenas(const ProcessMemory& memory);
// "torch_cpu 300.0 MiB, python 120.0 MiB, malloc 80.0 MiB": the `most` largest owners of it.
std::string DescribeHeldOutsideArenas(const ProcessMemory& memory, int most);

}  // namespace spillway::allocator::node
