// NodeGovernor: one host budget (and one NVMe budget) for every rank of every job of a user under
// one memory limit (a cgroup's, else the machine's: what the OOM killer enforces), kept in a
// shared-memory segment, the limit's ledger, that every rank maps. Each rank's arenas reserve their
// regions from it and give them back when they unmap; a rank that needs more takes what the others
// leave free. Dead ranks are reaped, pressure trims every rank's retained cache, and admission
// refuses a job that cannot fit beside the others before anything is allocated.
// Note [Node governor] in docs/allocator.md.
#pragma once

#include <sys/types.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <list>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "spillway/allocator/owner.h"
#include "spillway/allocator/process.h"
#include "spillway/allocator/process_memory.h"
#include "spillway/base/status.h"

namespace spillway::allocator {

// The node's ledgers: host bytes (pinned and pageable share the host budget) and NVMe bytes.
enum class NodeTier : uint8_t { kPinned = 0, kPageable, kNvme };
inline constexpr int kNodeTierCount = 3;
const char* NodeTierName(NodeTier tier);

// The job this process is one local rank of, as its launcher described it.
struct NodeJob {
  std::string id;      // empty: not launched as a rank of a multi-process job
  std::string source;  // which variables named it (for messages)
  int local_rank = -1;
  int local_world_size = 0;   // 0: the launcher did not say
  std::string rank_variable;  // the launcher's variable that gave local_rank; empty: none set
};
using GetEnvFn = std::function<const char*(const char*)>;
// In order: SPILLWAY_NODE_JOB (explicit; [A-Za-z0-9._-], at most 80 characters, else an
// INVALID_ARGUMENT naming it); then, for a process a launcher started, TORCHELASTIC_RUN_ID unless
// it is "none", else the parent process (the launcher that started every local rank: torchrun's
// agent, the deepspeed launcher, orted/prted, Hydra's proxy, slurmstepd) and its start time. The
// local rank and count, from the first launcher whose rank variable is set: LOCAL_RANK with
// LOCAL_WORLD_SIZE, LOCAL_SIZE or SLURM_NTASKS_PER_NODE (torchrun, Accelerate, the deepspeed
// launcher and its MPICH/Intel MPI runners); OMPI_COMM_WORLD_LOCAL_RANK/_SIZE (mpirun);
// MPI_LOCALRANKID/MPI_LOCALNRANKS (Hydra); MV2_COMM_WORLD_LOCAL_RANK/_SIZE; PALS_LOCAL_RANKID/
// PALS_LOCAL_SIZE; SLURM_LOCALID with SLURM_NTASKS_PER_NODE, else this node's entry (SLURM_NODEID)
// of SLURM_STEP_TASKS_PER_NODE ("4(x2),3"). A value that cannot be read is an INVALID_ARGUMENT
// naming the variable.
Result<NodeJob> NodeJobFromEnvironment(const GetEnvFn& getenv);
Result<NodeJob> NodeJobFromEnvironment();

// The default node host budget: MemoryLimitBytes() (the cgroup's limit, else physical memory) less
// DefaultNodeReserve() of it, which is left for what no arena counts: the OS, the page cache, the
// ranks' Python heaps and the DataLoader workers' private pages.
uint64_t DefaultNodeReserve(uint64_t limit_bytes);  // max(2 GiB, limit / 8), at most limit / 2
uint64_t DefaultNodeHostBudget(uint64_t limit_bytes);

// The ledger of this process's memory limit: `name` ("limit-" and 16 hex digits of the limiting
// cgroup's identity, or of the machine's, with the PID namespace: containers that share /dev/shm
// but not their pids keep apart) and `scope`, the limit in words.
struct MemoryLimit;  // host_arena.h
struct NodeLedger {
  std::string name;
  std::string scope;
};
NodeLedger DefaultNodeLedger();
NodeLedger NodeLedgerOf(const MemoryLimit& limit);

struct NodeGovernorOptions {
  std::string job;     // required: this rank's job within the ledger
  std::string ledger;  // the segment's name (with the user id); empty: DefaultNodeLedger()
  std::string scope;   // the ledger in words; empty: DefaultNodeLedger()'s, or its name
  std::string dir = "/dev/shm";
  int local_rank = -1;       // this rank's within its job; -1: the first its job has free
  int local_world_size = 0;  // ranks Admit waits for; 0: the ranks that have joined
  // 0: DefaultNodeHostBudget() when this rank creates the segment, the segment's when it joins.
  // A non-zero value replaces a default budget while what the ledger holds fits under it, and
  // must equal an explicit one (every rank of every job under the limit passes the same, or none).
  uint64_t host_budget_bytes = 0;
  uint64_t memory_limit_bytes = 0;  // 0: MemoryLimitBytes(); what the default budget comes from
  uint64_t nvme_budget_bytes = 0;   // 0: set by the first NVMe arena (OfferNvmeBudget)
  std::chrono::milliseconds trim_timeout{2000};    // how long Reserve waits for other ranks' trims
  std::chrono::milliseconds lock_timeout{5000};    // the segment's lock; past it, an error
  std::chrono::milliseconds release_timeout{100};  // a Release past it is owed (settled later)
  std::chrono::milliseconds watch_interval{200};   // the watcher's tick: dead ranks reaped by then
  bool watcher = true;  // a thread that serves other ranks' trim requests and reaps dead ranks
};

struct NodeRankStats {
  std::string job;
  int local_rank = -1;
  pid_t pid = 0;
  bool alive = true;  // false: dead, not yet reaped (Stats reaps first, so only in races)
  uint64_t bytes[kNodeTierCount] = {};  // reserved now, by tier
  uint64_t host_bytes = 0;              // pinned + pageable
  uint64_t peak_host_bytes = 0;
  KindBytes host_by_kind{};  // live bytes by kind as of the rank's last region change or boundary
  uint64_t declared_bytes = 0;         // what the rank declared at admission (0: none)
  uint64_t workers_private_bytes = 0;  // its DataLoader workers' private pages (last published)
  uint32_t workers = 0;
  ProcessMemory memory;  // its resident bytes by owner, last published (total 0: never)
  uint64_t trims = 0;    // trim requests it served
};

struct NodeJobStats {
  std::string name;
  int local_world_size = 0;  // 0: not said
  int ranks = 0;             // live
  uint64_t host_bytes = 0;   // booked by its live ranks
  uint64_t nvme_bytes = 0;
  uint64_t declared_bytes = 0;  // its live ranks' admission declarations
};

struct NodeStats {
  std::string job;        // the job this view is for (a rank's Stats); empty from Inspect
  std::string ledger;     // the segment's name
  std::string scope;      // the memory limit it stands for
  std::string budget_by;  // the job that made the ledger, or the first with an explicit budget
  std::string path;
  uint64_t memory_limit_bytes = 0;
  uint64_t reserve_bytes = 0;    // memory_limit - host_budget
  bool budget_explicit = false;  // the job set its budget (else the default from the limit)
  uint64_t host_budget_bytes = 0;
  uint64_t nvme_budget_bytes = 0;  // 0: not capped
  uint64_t host_committed_bytes = 0;
  uint64_t nvme_committed_bytes = 0;
  uint64_t peak_host_committed_bytes = 0;
  uint64_t host_headroom_bytes = 0;
  uint64_t reaped_ranks = 0;       // dead ranks whose bytes were given back
  uint64_t over_budget_count = 0;  // reservations refused after trimming
  uint64_t trim_requests = 0;
  int local_world_size = 0;          // of `job`
  std::vector<NodeJobStats> jobs;    // with live ranks, by name
  std::vector<NodeRankStats> ranks;  // occupied slots, by job and local rank
  // The table `spillway node` prints.
  std::string ToString() const;
};

// "(the memory limit L less a reserve of R for ...)", or how the job set its budget.
std::string DescribeNodeBudget(const NodeStats& stats);
// A live rank's view of who holds what, used in error messages: "local rank 0 (pid 12) pinned
// 1.0 GiB, pageable 3.0 GiB (optimizer_state 2.5 GiB, ...); ...".
std::string DescribeNodeRanks(const NodeStats& stats);

namespace node {
struct Segment;  // the shared layout (src/node_segment.h)
struct Slot;
struct JobEntry;
}  // namespace node

// Thread-safe. The segment's robust, process-shared mutex guards the slots' byte counts and the
// totals; it is held for bookkeeping only (no system call under it) and taken with a deadline. A
// rank that dies holding it leaves it to the next locker, which recomputes the totals from the
// slots. Every change to this rank's slot is made under the lock only while the slot is still
// this process's (its pid and generation): after Leave, or after another process reaped it, a
// late Reserve refuses and a late Release does nothing.
// Invariants (under the segment lock, checked by Validate):
//   host_committed == sum over occupied slots of (pinned + pageable) <= host_budget
//   nvme_committed == sum over occupied slots of nvme (<= nvme_budget when one is set)
// In a forked child every call refuses (FAILED_PRECONDITION) or does nothing: the slot is the
// parent's.
class NodeGovernor {
 public:
  // Opens the ledger's segment, creating it if no live one exists, and claims a slot for the job's
  // local rank.
  static Result<std::unique_ptr<NodeGovernor>> Join(NodeGovernorOptions options);
  // The ledger of a segment, read from outside without joining it (`spillway node`): reaps dead
  // ranks first, so its totals are the live ranks'.
  static Result<NodeStats> Inspect(
      const std::string& path, std::chrono::milliseconds lock_timeout = std::chrono::seconds(5));
  // Segments of this user in `dir` (paths), live or not.
  static std::vector<std::string> ListSegments(const std::string& dir = "/dev/shm");
  // Removes this user's segments in `dir` whose ranks are all gone, and segments left half made
  // or half removed by a killed process. Returns how many.
  static int RemoveDeadSegments(const std::string& dir = "/dev/shm");
  static std::string SegmentPath(const std::string& dir, const std::string& ledger);

  // Leave(), then unmaps the segment.
  ~NodeGovernor();
  NodeGovernor(const NodeGovernor&) = delete;
  NodeGovernor& operator=(const NodeGovernor&) = delete;
  // Gives back every byte this rank holds and frees its slot; the last rank out removes the
  // segment. Afterwards Reserve and Admit refuse (FAILED_PRECONDITION) and Release does nothing:
  // for a process that exits while its arenas still exist (Python's atexit). Idempotent.
  void Leave();

  // Books `bytes` of `tier` for this rank. When the node budget would be crossed: reaps dead
  // ranks, then (host tiers) runs this rank's trimmers, asks every other rank to trim and waits
  // for them (at most trim_timeout), then tries once more. Fails with OVER_BUDGET naming the node
  // budget and each rank's bytes by tier and kind; on error nothing is booked.
  Status Reserve(NodeTier tier, uint64_t bytes);
  // Reserve without the pressure steps: OK or OVER_BUDGET at once.
  Status TryReserve(NodeTier tier, uint64_t bytes);
  // Gives bytes back. Waits at most release_timeout for the segment's lock; past it the bytes are
  // owed and given back at this rank's next lock (a release never blocks a free for long).
  void Release(NodeTier tier, uint64_t bytes);
  // Sets the node's NVMe budget when none is set yet (the first NVMe arena of the job offers 90%
  // of its directory's free space). Returns the budget in force, or the error taking the lock.
  Result<uint64_t> OfferNvmeBudget(uint64_t bytes);

  // Published for reports, without the lock (relaxed stores into the slot).
  void PublishKinds(NodeTier tier, const KindBytes& live_by_kind);
  void PublishWorkers(uint64_t private_bytes, uint32_t workers);
  // This rank's resident memory by owner (AttributeMemory), for `spillway node` and Prometheus.
  void PublishMemory(const ProcessMemory& memory);

  // Admission, in rounds (one per call in each rank, e.g. one per DeepSpeed engine): declares
  // that this rank will hold `need_bytes` more host memory (of which `workers_fork_bytes` is its
  // workers' expected copy-on-write), waits until every expected local rank has declared this
  // round (local_world_size; at most `timeout`), and checks the sum of every rank's declarations
  // so far against the node budget. The first rank to see the round complete writes its verdict
  // into the segment and every rank returns that verdict: all pass, or all fail with the same
  // OVER_BUDGET text, without a collective. A rank that times out writes an UNAVAILABLE verdict
  // naming the ranks that never declared, which a late rank then returns too. `detail` (the plan,
  // the keys that would make it fit) is added to the message.
  Status Admit(uint64_t need_bytes, uint64_t workers_fork_bytes, std::chrono::milliseconds timeout,
               const std::string& detail);

  // A trimmer gives memory back to the OS on request (an arena's Trim) and returns the bytes.
  // RemoveTrimmer returns after every call of it in flight has returned; calls that start after
  // it began skip it.
  void AddTrimmer(const void* owner, std::function<uint64_t()> trim);
  void RemoveTrimmer(const void* owner);
  // Runs this process's trimmers now. Returns the bytes they gave back.
  uint64_t TrimLocal();
  // True on a governor's watcher thread (a trimmer there runs on a thread Spillway made: a CUDA
  // arena binds it to its device first).
  static bool OnWatcherThread();

  NodeStats Stats() const;     // reaps dead ranks first (system calls: kill, /proc)
  NodeStats Snapshot() const;  // as the segment is now: its lock only (for metrics scrapes)
  Status Validate() const;
  // Moves this rank, with every byte it booked, into job `job` as its local rank `local_rank` of
  // `local_world_size` (0: keep what the job has): for a process no launcher described at Join,
  // which learns its job once its process group exists. Only before its first Admit. Refused by
  // name when that local rank of the job is held by a live rank, or the job already counts a
  // different number of local ranks.
  Status Rekey(const std::string& job, int local_rank, int local_world_size);

  int local_rank() const { return local_rank_.load(std::memory_order_acquire); }
  const std::string& path() const { return path_; }
  const std::string& ledger() const { return ledger_; }
  std::string job() const;  // its name (Rekey may change it)
  uint64_t host_budget_bytes() const;

  // The process's governor, set by the one that joins for the process (spillway.install()):
  // arenas made with HostArenaOptions::node unset use it. Null when none, and in a forked child.
  static std::shared_ptr<NodeGovernor> Current();
  static void SetCurrent(std::shared_ptr<NodeGovernor> governor);

 private:
  NodeGovernor(NodeGovernorOptions options, std::string path, int fd, node::Segment* segment,
               int slot, int job, int local_rank, uint64_t generation);
  Status ReapDead() const;
  void WatchLoop();
  // Asks every other rank to trim and waits; returns the ranks that did not answer in time.
  Result<std::vector<std::string>> RequestTrimAndWait();
  std::string DescribeOverBudget(NodeTier tier, uint64_t bytes,
                                 const std::vector<std::string>& silent) const;
  node::JobEntry& entry() const;  // this rank's job in the segment (its fields assume the lock)
  // Private methods that end in Locked assume the segment's lock.
  bool OwnsSlotLocked() const;
  void SettleOwedLocked();
  void ReleaseLocked(NodeTier tier, uint64_t bytes);

  const NodeGovernorOptions options_;
  const std::string path_;
  const int fd_;
  node::Segment* const segment_;
  // This rank's slot, or null once it left (or was reaped) or in a forked child: what the Publish
  // calls write to.
  node::Slot* PublishedSlot();
  const int slot_;
  // Who this rank is: its job's entry in the segment, its local rank there and the job's name.
  // Set at Join and changed only by Rekey, which holds the segment's lock and then identity_mu_.
  std::atomic<int> job_;
  std::atomic<int> local_rank_;
  mutable std::mutex identity_mu_;
  std::string job_name_;  // guarded by identity_mu_
  const std::string ledger_;
  const uint64_t generation_;  // the slot's generation when this rank claimed it
  const ProcessTag process_;
  const pid_t pid_;

  std::atomic<bool> left_{false};
  std::atomic<uint64_t> owed_[kNodeTierCount] = {};  // releases that could not take the lock
  std::atomic<uint32_t> admit_rounds_{0};            // Admit calls so far

  std::mutex trim_mu_;
  struct Trimmer {
    const void* owner;
    std::function<uint64_t()> trim;
    int in_flight = 0;     // guarded by trim_mu_
    bool removed = false;  // guarded by trim_mu_
  };
  std::list<Trimmer> trimmers_;  // guarded by trim_mu_ (a list: entries stay put while called)
  ForkSafeCondition trims_idle_;

  std::atomic<bool> stop_{false};
  std::thread watcher_;
};

}  // namespace spillway::allocator
