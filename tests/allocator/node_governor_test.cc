// NodeGovernor: one budget for a job's local ranks, on real shared-memory segments in /dev/shm,
// with real forked processes as ranks (killed with SIGKILL where the test needs a dead one).
#include "spillway/allocator/node_governor.h"

#include <fcntl.h>
#include <sched.h>
#include <signal.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "nvme_test_util.h"
#include "spillway/allocator/host_arena.h"
#include "spillway/allocator/nvme_arena.h"
#include "spillway/base/bytes.h"
#include "test_util.h"

namespace spillway::allocator {
namespace {

using testing::Has;
using testing::Tag;
using namespace std::chrono_literals;

std::string UniqueJob(const char* what) {
  static int n = 0;
  return StrCat("gtest-", what, "-", getpid(), "-", n++);
}

// Each test's jobs keep a ledger of their own (named after the job), so tests running beside
// each other on this machine do not share one; the tests of the default ledger set none.
NodeGovernorOptions Options(const std::string& job, int rank, uint64_t budget) {
  NodeGovernorOptions o;
  o.job = job;
  o.ledger = StrCat("ledger-", job);
  o.local_rank = rank;
  o.host_budget_bytes = budget;
  o.memory_limit_bytes = budget + (2ull << 30);
  o.watch_interval = 50ms;
  o.trim_timeout = 2000ms;
  return o;
}

std::unique_ptr<NodeGovernor> JoinOrDie(const NodeGovernorOptions& o) {
  auto g = NodeGovernor::Join(o);
  EXPECT_TRUE(g.ok()) << g.status().ToString();
  return g.ok() ? std::move(g.value()) : nullptr;
}

// Both ranks declare `need` in one admission round at once (each waits for the other); their two
// verdicts, which must be the same.
Status AdmitBoth(NodeGovernor& g0, NodeGovernor& g1, uint64_t need, const char* detail) {
  Status st1;
  std::thread other([&] { st1 = g1.Admit(need, 0, 5s, detail); });
  Status st0 = g0.Admit(need, 0, 5s, detail);
  other.join();
  EXPECT_EQ(st0.ToString(), st1.ToString());
  return st0;
}

bool Exists(const std::string& path) {
  struct stat st {};
  return stat(path.c_str(), &st) == 0;
}

// A forked rank: runs `body` in the child, which writes one byte to `ready` when it has done
// what the parent waits for and then sleeps until killed (or returns its exit code).
struct ChildRank {
  pid_t pid = -1;
  int ready_fd = -1;
  template <typename Body>
  static ChildRank Start(Body body) {
    int fds[2];
    EXPECT_EQ(pipe(fds), 0);
    ChildRank c;
    c.pid = fork();
    if (c.pid == 0) {
      close(fds[0]);
      const int rc = body(fds[1]);
      _exit(rc);
    }
    close(fds[1]);
    c.ready_fd = fds[0];
    return c;
  }
  bool WaitReady() const {
    char b = 0;
    return read(ready_fd, &b, 1) == 1;
  }
  int Wait() const {
    int status = 0;
    waitpid(pid, &status, 0);
    close(ready_fd);
    return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
  }
  void Kill() const { kill(pid, SIGKILL); }
};

void SignalReady(int fd) {
  char b = 1;
  if (write(fd, &b, 1) != 1) _exit(90);
}

TEST(NodeJobTest, NamedByTheLauncherEnvironment) {
  std::map<std::string, std::string> env;
  auto getenv = [&](const char* name) -> const char* {
    auto it = env.find(name);
    return it == env.end() ? nullptr : it->second.c_str();
  };
  auto job = NodeJobFromEnvironment(getenv);
  ASSERT_TRUE(job.ok());
  EXPECT_TRUE(job->id.empty()) << "a lone process is no rank of a job";

  env = {{"LOCAL_RANK", "3"}, {"LOCAL_WORLD_SIZE", "8"}, {"TORCHELASTIC_RUN_ID", "abc/1 2"}};
  job = NodeJobFromEnvironment(getenv);
  ASSERT_TRUE(job.ok());
  EXPECT_EQ(job->id, "torchelastic-abc_1_2");
  EXPECT_EQ(job->local_rank, 3);
  EXPECT_EQ(job->local_world_size, 8);

  // torchrun without --rdzv-id says "none" for every job: the launcher process names it instead.
  env = {{"LOCAL_RANK", "0"}, {"LOCAL_SIZE", "4"}, {"TORCHELASTIC_RUN_ID", "none"}};
  job = NodeJobFromEnvironment(getenv);
  ASSERT_TRUE(job.ok());
  EXPECT_EQ(job->id.rfind(StrCat("launcher-", getppid(), "-"), 0), 0u) << job->id;
  EXPECT_EQ(job->local_world_size, 4) << "the deepspeed launcher's LOCAL_SIZE";

  // srun starts the ranks itself: SLURM_LOCALID is the local rank, slurmstepd the launcher (two
  // launches in one allocation are two jobs, so the job id alone does not name it).
  env = {{"SLURM_LOCALID", "1"}, {"SLURM_JOB_ID", "77"}, {"SLURM_NTASKS_PER_NODE", "8"}};
  job = NodeJobFromEnvironment(getenv);
  ASSERT_TRUE(job.ok());
  EXPECT_EQ(job->local_rank, 1);
  EXPECT_EQ(job->local_world_size, 8);
  EXPECT_EQ(job->id.rfind("launcher-", 0), 0u) << job->id;

  env = {{"SPILLWAY_NODE_JOB", "my-run.1"}};
  job = NodeJobFromEnvironment(getenv);
  ASSERT_TRUE(job.ok());
  EXPECT_EQ(job->id, "my-run.1");

  env = {{"SPILLWAY_NODE_JOB", "../etc"}};
  job = NodeJobFromEnvironment(getenv);
  ASSERT_EQ(job.status().code(), StatusCode::kInvalidArgument);
  EXPECT_TRUE(Has(job.status(), "SPILLWAY_NODE_JOB='../etc'")) << job.status().ToString();

  env = {{"LOCAL_RANK", "x"}};
  job = NodeJobFromEnvironment(getenv);
  ASSERT_EQ(job.status().code(), StatusCode::kInvalidArgument);
  EXPECT_TRUE(Has(job.status(), "LOCAL_RANK='x'"));
}

// The launchers that do not export LOCAL_RANK before the script's first line: mpirun (OpenMPI,
// and DeepSpeed's OpenMPI runner, which sets LOCAL_RANK only inside deepspeed.init_distributed),
// MPICH's and Intel MPI's Hydra, MVAPICH2, Cray's PALS, and srun without --ntasks-per-node.
TEST(NodeJobTest, EveryLauncherNamesTheLocalRankAndCount) {
  std::map<std::string, std::string> env;
  auto getenv = [&](const char* name) -> const char* {
    auto it = env.find(name);
    return it == env.end() ? nullptr : it->second.c_str();
  };
  const std::vector<std::pair<std::string, std::string>> launchers = {
      {"OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_SIZE"},
      {"MPI_LOCALRANKID", "MPI_LOCALNRANKS"},
      {"MV2_COMM_WORLD_LOCAL_RANK", "MV2_COMM_WORLD_LOCAL_SIZE"},
      {"PALS_LOCAL_RANKID", "PALS_LOCAL_SIZE"},
  };
  for (const auto& [rank, size] : launchers) {
    env = {{rank, "2"}, {size, "4"}};
    auto job = NodeJobFromEnvironment(getenv);
    ASSERT_TRUE(job.ok()) << rank << ": " << job.status().ToString();
    EXPECT_EQ(job->local_rank, 2) << rank;
    EXPECT_EQ(job->local_world_size, 4) << size;
    EXPECT_EQ(job->id.rfind(StrCat("launcher-", getppid(), "-"), 0), 0u) << rank << ": " << job->id;
    EXPECT_NE(job->source.find(rank), std::string::npos) << job->source;
  }

  // srun without --ntasks-per-node: the step's tasks per node, run-length coded.
  env = {{"SLURM_LOCALID", "1"}, {"SLURM_STEP_TASKS_PER_NODE", "4(x2)"}, {"SLURM_NODEID", "1"}};
  auto job = NodeJobFromEnvironment(getenv);
  ASSERT_TRUE(job.ok()) << job.status().ToString();
  EXPECT_EQ(job->local_world_size, 4);
  // Uneven nodes: this node's entry, by SLURM_NODEID.
  env = {{"SLURM_LOCALID", "0"}, {"SLURM_STEP_TASKS_PER_NODE", "3(x2),2"}, {"SLURM_NODEID", "2"}};
  job = NodeJobFromEnvironment(getenv);
  ASSERT_TRUE(job.ok()) << job.status().ToString();
  EXPECT_EQ(job->local_world_size, 2);
  env = {{"SLURM_LOCALID", "0"}, {"SLURM_STEP_TASKS_PER_NODE", "3(x2),2"}, {"SLURM_NODEID", "1"}};
  job = NodeJobFromEnvironment(getenv);
  ASSERT_TRUE(job.ok()) << job.status().ToString();
  EXPECT_EQ(job->local_world_size, 3);
  EXPECT_EQ(job->rank_variable, "SLURM_LOCALID");
  // A batch script's SLURM_TASKS_PER_NODE is the whole job's, not this process's ranks.
  env = {{"SLURM_LOCALID", "0"}, {"SLURM_TASKS_PER_NODE", "8"}, {"SLURM_NODEID", "0"}};
  job = NodeJobFromEnvironment(getenv);
  ASSERT_TRUE(job.ok());
  EXPECT_EQ(job->local_world_size, 0);
  // --ntasks-per-node still wins when given.
  env = {{"SLURM_LOCALID", "0"}, {"SLURM_NTASKS_PER_NODE", "8"}, {"SLURM_TASKS_PER_NODE", "3"}};
  job = NodeJobFromEnvironment(getenv);
  ASSERT_TRUE(job.ok());
  EXPECT_EQ(job->local_world_size, 8);

  // What cannot be read is named, with what to do.
  for (const char* bad : {"4(x", "4,", "4x", " 4", "+4", "0", "4(x0)", "4(x-1)", "4,,3",
                          "4(x9223372036854775807)", "99999999999"}) {
    env = {{"SLURM_LOCALID", "0"}, {"SLURM_STEP_TASKS_PER_NODE", bad}};
    job = NodeJobFromEnvironment(getenv);
    ASSERT_EQ(job.status().code(), StatusCode::kInvalidArgument) << bad;
    EXPECT_TRUE(Has(job.status(), StrCat("SLURM_STEP_TASKS_PER_NODE='", bad, "'")))
        << job.status().ToString();
    EXPECT_TRUE(Has(job.status(), "LOCAL_WORLD_SIZE")) << job.status().ToString();
  }
  env = {{"SLURM_LOCALID", "0"}, {"SLURM_STEP_TASKS_PER_NODE", "3,2"}, {"SLURM_NODEID", "5"}};
  job = NodeJobFromEnvironment(getenv);
  ASSERT_EQ(job.status().code(), StatusCode::kInvalidArgument);
  EXPECT_TRUE(Has(job.status(), "SLURM_NODEID=5")) << job.status().ToString();
  env = {{"OMPI_COMM_WORLD_LOCAL_RANK", "0"}, {"OMPI_COMM_WORLD_LOCAL_SIZE", "-1"}};
  job = NodeJobFromEnvironment(getenv);
  ASSERT_EQ(job.status().code(), StatusCode::kInvalidArgument);
  EXPECT_TRUE(Has(job.status(), "OMPI_COMM_WORLD_LOCAL_SIZE='-1'")) << job.status().ToString();

  // torchrun's own variables win over an MPI launcher's around it (torchrun under mpirun).
  env = {{"LOCAL_RANK", "1"},
         {"LOCAL_WORLD_SIZE", "2"},
         {"OMPI_COMM_WORLD_LOCAL_RANK", "0"},
         {"OMPI_COMM_WORLD_LOCAL_SIZE", "1"}};
  job = NodeJobFromEnvironment(getenv);
  ASSERT_TRUE(job.ok());
  EXPECT_EQ(job->local_rank, 1);
  EXPECT_EQ(job->local_world_size, 2);
}

TEST(NodeBudgetTest, DefaultLeavesAReserve) {
  EXPECT_EQ(DefaultNodeHostBudget(24ull << 30), 21ull << 30);  // 1/8 kept back
  EXPECT_EQ(DefaultNodeHostBudget(8ull << 30), 6ull << 30);    // at least 2 GiB kept back
  EXPECT_EQ(DefaultNodeHostBudget(2ull << 30), 1ull << 30);    // at most half
  EXPECT_EQ(DefaultNodeHostBudget(2048ull << 30), 1792ull << 30);
}

// The directory of this process's memory cgroup (v2 unified, or v1's memory controller), or "".
std::string OwnMemoryCgroup() {
  std::ifstream in("/proc/self/cgroup");
  std::string line, v2;
  while (std::getline(in, line)) {
    const size_t a = line.find(':'), b = line.find(':', a + 1);
    const std::string controllers = line.substr(a + 1, b - a - 1), path = line.substr(b + 1);
    if (controllers == "memory") return "/sys/fs/cgroup/memory" + path;
    if (controllers.empty()) v2 = "/sys/fs/cgroup" + path;
  }
  std::ifstream ctl(v2 + "/cgroup.controllers");
  std::string word;
  while (ctl >> word) {
    if (word == "memory") return v2;
  }
  return "";
}

bool WriteFile(const std::string& path, const std::string& text) {
  std::ofstream out(path);
  out << text;
  out.close();
  return static_cast<bool>(out);
}

TEST(NodeBudgetTest, TheDefaultFollowsARealChildCgroupsLimit) {
  if (testing::kUnderSanitizer) GTEST_SKIP() << "sanitizers reroute fork";
  const std::string parent = OwnMemoryCgroup();
  if (parent.empty()) GTEST_SKIP() << "no memory cgroup controller is visible";
  const std::string dir = StrCat(parent, "/spillway-node-test-", getpid());
  if (mkdir(dir.c_str(), 0755) != 0) {
    GTEST_SKIP() << "cannot make a child cgroup under " << parent << ": " << strerror(errno)
                 << " (the on-disk tree test covers the reading)";
  }
  const bool v1 = parent.rfind("/sys/fs/cgroup/memory", 0) == 0;
  const uint64_t limit = 6ull << 30;
  ASSERT_TRUE(
      WriteFile(dir + (v1 ? "/memory.limit_in_bytes" : "/memory.max"), std::to_string(limit)));
  const std::string job = UniqueJob("cgroup");
  ChildRank c = ChildRank::Start([&](int) {
    if (!WriteFile(dir + "/cgroup.procs", std::to_string(getpid()))) return 3;
    if (MemoryLimitBytes() != limit) return 4;
    NodeGovernorOptions o;  // no budget, no limit given: both from the cgroup
    o.job = job;
    o.local_rank = 0;
    auto g = NodeGovernor::Join(o);
    if (!g.ok()) return 5;
    const NodeStats s = (*g)->Stats();
    if (s.memory_limit_bytes != limit || s.host_budget_bytes != (4ull << 30) ||
        s.reserve_bytes != (2ull << 30) || s.budget_explicit) {
      return 6;
    }
    // The ledger is the cgroup's limit's: named for it, and said in words.
    if (s.ledger.rfind("limit-", 0) != 0 || s.scope.find(dir) == std::string::npos) {
      return 7;
    }
    return 0;
  });
  const int rc = c.Wait();
  rmdir(dir.c_str());
  EXPECT_EQ(rc, 0)
      << "3: joining the cgroup, 4: its limit not read, 5: Join, 6: budget, 7: not its ledger";
}

TEST(NodeBudgetTest, TheDefaultFollowsACgroupTreeOnDisk) {
  char tmpl[] = "/tmp/spillway-cgroup-XXXXXX";
  ASSERT_NE(mkdtemp(tmpl), nullptr);
  const std::string root = tmpl;
  ASSERT_EQ(mkdir((root + "/kubepods").c_str(), 0755), 0);
  ASSERT_EQ(mkdir((root + "/kubepods/pod1").c_str(), 0755), 0);
  ASSERT_TRUE(WriteFile(root + "/kubepods/memory.max", std::to_string(64ull << 30)));
  ASSERT_TRUE(WriteFile(root + "/kubepods/pod1/memory.max", "max"));
  const uint64_t limit = MemoryLimitBytes("0::/kubepods/pod1\n", root, 1ull << 40);
  EXPECT_EQ(limit, 64ull << 30) << "the smallest limit on the way up";
  const MemoryLimit where = MemoryLimitOf("0::/kubepods/pod1\n", root, 1ull << 40);
  EXPECT_EQ(where.cgroup, root + "/kubepods") << "the cgroup whose limit is in force";
  EXPECT_EQ(MemoryLimitOf("0::/kubepods/pod1\n", root, 32ull << 30).cgroup, "")
      << "a limit above physical memory is the machine's";
  // Slurm sets the same limit on a job and its step: the outer one, so two steps share a ledger.
  ASSERT_TRUE(WriteFile(root + "/kubepods/pod1/memory.max", std::to_string(64ull << 30)));
  EXPECT_EQ(MemoryLimitOf("0::/kubepods/pod1\n", root, 1ull << 40).cgroup, root + "/kubepods");
  ASSERT_TRUE(WriteFile(root + "/kubepods/pod1/memory.max", std::to_string(63ull << 30)));
  EXPECT_EQ(MemoryLimitOf("0::/kubepods/pod1\n", root, 1ull << 40).cgroup, root + "/kubepods/pod1");
  NodeGovernorOptions o = Options(UniqueJob("tree"), 0, 0);
  o.memory_limit_bytes = limit;
  auto g = JoinOrDie(o);
  ASSERT_TRUE(g);
  EXPECT_EQ(g->host_budget_bytes(), 56ull << 30);  // 1/8 kept back
  std::system(StrCat("rm -rf ", root).c_str());
}

TEST(NodeGovernorTest, RanksShareOneBudgetAndOneMayTakeMoreThanItsShare) {
  const std::string job = UniqueJob("share");
  auto r0 = JoinOrDie(Options(job, 0, 400 * kMiB));
  auto r1 = JoinOrDie(Options(job, 1, 0));  // joins with the segment's budget
  ASSERT_TRUE(r0 && r1);
  EXPECT_EQ(r1->host_budget_bytes(), 400 * kMiB);
  // Uneven ranks: rank 0 takes 3/4 of the node while rank 1 holds nothing.
  ASSERT_TRUE(r0->Reserve(NodeTier::kPinned, 200 * kMiB).ok());
  ASSERT_TRUE(r0->Reserve(NodeTier::kPageable, 100 * kMiB).ok());
  Status st = r1->Reserve(NodeTier::kPageable, 150 * kMiB);
  ASSERT_EQ(st.code(), StatusCode::kOverBudget) << st.ToString();
  EXPECT_TRUE(Has(st, "local rank 1")) << st.ToString();
  EXPECT_TRUE(Has(st, "local rank 0 (pid")) << "names who holds what: " << st.ToString();
  EXPECT_TRUE(Has(st, "pinned 200.0 MiB, pageable 100.0 MiB")) << st.ToString();
  EXPECT_TRUE(Has(st, "SPILLWAY_NODE_BUDGET_BYTES")) << st.ToString();
  ASSERT_TRUE(r1->Reserve(NodeTier::kPageable, 100 * kMiB).ok());
  NodeStats s = r1->Stats();
  EXPECT_EQ(s.host_committed_bytes, 400 * kMiB);
  EXPECT_EQ(s.host_headroom_bytes, 0u);
  ASSERT_EQ(s.ranks.size(), 2u);
  EXPECT_EQ(s.ranks[0].host_bytes, 300 * kMiB);
  EXPECT_EQ(s.ranks[1].host_bytes, 100 * kMiB);
  EXPECT_GE(s.over_budget_count, 1u);
  r0->Release(NodeTier::kPinned, 200 * kMiB);
  EXPECT_TRUE(r1->Reserve(NodeTier::kPageable, 150 * kMiB).ok()) << "freed by rank 0";
  EXPECT_TRUE(r0->Validate().ok()) << r0->Validate().ToString();
  // NVMe is counted apart from host memory, and not capped without a budget.
  EXPECT_TRUE(r0->Reserve(NodeTier::kNvme, 10ull << 30).ok());
  EXPECT_EQ(r1->Stats().nvme_committed_bytes, 10ull << 30);
}

TEST(NodeBudgetTest, EachMemoryLimitHasALedgerOfItsOwn) {
  char a[] = "/tmp/spillway-limit-a-XXXXXX";
  char b[] = "/tmp/spillway-limit-b-XXXXXX";
  ASSERT_NE(mkdtemp(a), nullptr);
  ASSERT_NE(mkdtemp(b), nullptr);
  const NodeLedger la = NodeLedgerOf(MemoryLimit{8ull << 30, a});
  EXPECT_EQ(la.name, NodeLedgerOf(MemoryLimit{8ull << 30, a}).name) << "the same limit, one ledger";
  EXPECT_NE(la.name, NodeLedgerOf(MemoryLimit{8ull << 30, b}).name) << "two limits, two ledgers";
  const NodeLedger machine = NodeLedgerOf(MemoryLimit{64ull << 30, ""});
  EXPECT_NE(la.name, machine.name);
  EXPECT_EQ(la.name.rfind("limit-", 0), 0u) << la.name;
  EXPECT_EQ(la.name.size(), 22u) << la.name;
  EXPECT_NE(la.scope.find(a), std::string::npos) << la.scope;
  EXPECT_NE(machine.scope.find("this machine"), std::string::npos) << machine.scope;
  rmdir(a);
  rmdir(b);
}

// A lone process (a notebook, an eval script) makes the ledger with the default budget; a job
// started later with SPILLWAY_NODE_BUDGET_BYTES sets it, where what the ledger holds fits; a
// second explicit budget must agree, and one below what is held is refused; once the job that set
// it is gone, the next may set another.
TEST(NodeGovernorTest, ADefaultBudgetYieldsToTheFirstExplicitOne) {
  const std::string lone = UniqueJob("lone"), job = UniqueJob("explicit");
  NodeGovernorOptions ol = Options(lone, 0, 0);
  ol.memory_limit_bytes = 4ull << 30;  // the default: 4 GiB less a reserve of 2 GiB
  auto l0 = JoinOrDie(ol);
  ASSERT_TRUE(l0);
  ASSERT_EQ(l0->host_budget_bytes(), 2ull << 30);
  ASSERT_TRUE(l0->Reserve(NodeTier::kPageable, 300 * kMiB).ok());

  NodeGovernorOptions below = Options(job, 0, 200 * kMiB);
  below.ledger = ol.ledger;
  auto refused = NodeGovernor::Join(below);
  ASSERT_EQ(refused.status().code(), StatusCode::kInvalidArgument);
  EXPECT_TRUE(Has(refused.status(), "already hold 300.00 MiB")) << refused.status().ToString();
  EXPECT_EQ(l0->host_budget_bytes(), 2ull << 30) << "a refused join changes nothing";

  NodeGovernorOptions oj = below;
  oj.host_budget_bytes = 3ull << 30;  // above the default: the user knows the node
  auto j0 = JoinOrDie(oj);
  ASSERT_TRUE(j0);
  NodeStats s = l0->Stats();
  EXPECT_EQ(s.host_budget_bytes, 3ull << 30);
  EXPECT_TRUE(s.budget_explicit);
  EXPECT_EQ(s.budget_by, job);
  EXPECT_EQ(s.reserve_bytes, 1ull << 30);
  EXPECT_TRUE(l0->Reserve(NodeTier::kPageable, 2ull << 30).ok())
      << "the lone rank books under it too";

  NodeGovernorOptions other = oj;
  other.local_rank = 1;
  other.host_budget_bytes = 4ull << 30;
  refused = NodeGovernor::Join(other);
  ASSERT_EQ(refused.status().code(), StatusCode::kInvalidArgument);
  EXPECT_TRUE(Has(refused.status(), StrCat("set by job '", job, "'")))
      << refused.status().ToString();
  EXPECT_TRUE(l0->Validate().ok());

  // The job that set it is gone; the lone rank (a notebook) stays: the next job may set another.
  j0.reset();
  NodeGovernorOptions later = Options(UniqueJob("later"), 0, (5ull << 30) / 2);
  later.ledger = ol.ledger;
  auto k0 = JoinOrDie(later);
  ASSERT_TRUE(k0);
  s = l0->Stats();
  EXPECT_EQ(s.host_budget_bytes, (5ull << 30) / 2);
  EXPECT_EQ(s.budget_by, later.job);
  EXPECT_TRUE(l0->Validate().ok());
}

// A segment an older Spillway made (its magic, another layout version, smaller) is named as that,
// at once: it is not one being sized, and not this layout's to remove.
TEST(NodeGovernorTest, ASegmentOfAnotherLayoutIsNamedAsSuch) {
  NodeGovernorOptions o = Options(UniqueJob("layout"), 0, 0);
  o.lock_timeout = 3000ms;
  const std::string path = NodeGovernor::SegmentPath(o.dir, o.ledger);
  // Written under another name and renamed into place: an empty segment file is what a sweep of
  // dead segments by any other process's Join (tests beside this one) removes as never initialized.
  const std::string staged = StrCat(o.dir, "/.gtest-layout-", getpid());
  const int fd = open(staged.c_str(), O_RDWR | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
  ASSERT_GE(fd, 0) << staged;
  const uint64_t magic = 0x31454430'4e4c5753ull;  // node::kMagic, "SWLN0DE1"
  const uint32_t version = 4;
  std::vector<char> bytes(121424, 0);
  std::memcpy(bytes.data(), &magic, sizeof(magic));
  std::memcpy(bytes.data() + sizeof(magic), &version, sizeof(version));
  ASSERT_EQ(write(fd, bytes.data(), bytes.size()), static_cast<ssize_t>(bytes.size()));
  close(fd);
  ASSERT_EQ(rename(staged.c_str(), path.c_str()), 0) << path;
  const auto start = std::chrono::steady_clock::now();
  auto refused = NodeGovernor::Join(o);
  const auto took = std::chrono::steady_clock::now() - start;
  EXPECT_EQ(refused.status().code(), StatusCode::kFailedPrecondition);
  EXPECT_TRUE(Has(refused.status(), "has layout version 4")) << refused.status().ToString();
  EXPECT_TRUE(Has(refused.status(), StrCat("rm ", path))) << refused.status().ToString();
  EXPECT_LT(took, 2000ms) << "waited as for a segment being sized";
  struct stat st;
  EXPECT_EQ(stat(path.c_str(), &st), 0) << "another layout's segment is left as it was";
  unlink(path.c_str());
}

// Two jobs under one memory limit (here a ledger named for the test): one budget between them,
// each refused by name with the other's bytes in the message, admission counting what the other
// job holds, one budget setting for both, and each job's ranks told apart by job and local rank.
TEST(NodeGovernorTest, TwoJobsUnderOneLimitShareItsLedger) {
  const std::string a = UniqueJob("first"), b = UniqueJob("second");
  const std::string ledger = StrCat("ledger-", a);
  NodeGovernorOptions oa = Options(a, 0, 400 * kMiB);
  oa.ledger = ledger;
  oa.local_world_size = 1;
  NodeGovernorOptions ob = Options(b, 0, 0);  // local rank 0 of its own job: no clash with a's
  ob.ledger = ledger;
  ob.local_world_size = 1;
  auto a0 = JoinOrDie(oa);
  auto b0 = JoinOrDie(ob);
  ASSERT_TRUE(a0 && b0);
  EXPECT_EQ(a0->path(), b0->path());
  EXPECT_EQ(b0->host_budget_bytes(), 400 * kMiB);
  EXPECT_EQ(b0->local_rank(), 0);
  NodeGovernorOptions other_budget = ob;
  other_budget.local_rank = 1;
  other_budget.host_budget_bytes = 200 * kMiB;
  auto refused = NodeGovernor::Join(other_budget);
  ASSERT_EQ(refused.status().code(), StatusCode::kInvalidArgument);
  EXPECT_TRUE(Has(refused.status(), StrCat("set by job '", a, "'"))) << refused.status().ToString();

  ASSERT_TRUE(a0->Reserve(NodeTier::kPageable, 300 * kMiB).ok());
  Status st = b0->Reserve(NodeTier::kPageable, 150 * kMiB);
  ASSERT_EQ(st.code(), StatusCode::kOverBudget) << st.ToString();
  EXPECT_TRUE(Has(st, StrCat("local rank 0 of job '", b, "'"))) << st.ToString();
  EXPECT_TRUE(Has(st, StrCat("job '", a, "' local rank 0 (pid"))) << st.ToString();
  EXPECT_TRUE(Has(st, "of 2 job(s)")) << st.ToString();
  // Admission of b counts what a holds.
  st = b0->Admit(150 * kMiB, 0, 5s, "");
  ASSERT_EQ(st.code(), StatusCode::kOverBudget) << st.ToString();
  EXPECT_TRUE(Has(st, StrCat("job '", a, "' 300.0 MiB (1 rank(s))"))) << st.ToString();
  EXPECT_TRUE(b0->Admit(100 * kMiB, 0, 5s, "").ok()) << "a smaller need fits beside a's";

  NodeStats s = b0->Stats();
  EXPECT_EQ(s.job, b);
  EXPECT_EQ(s.local_world_size, 1);
  ASSERT_EQ(s.jobs.size(), 2u);
  ASSERT_EQ(s.ranks.size(), 2u);
  const int ia = a < b ? 0 : 1;
  EXPECT_EQ(s.jobs[ia].name, a);
  EXPECT_EQ(s.jobs[ia].host_bytes, 300 * kMiB);
  EXPECT_EQ(s.jobs[1 - ia].declared_bytes, 100 * kMiB);
  EXPECT_EQ(s.ranks[ia].job, a);
  EXPECT_EQ(s.ranks[1 - ia].job, b);
  const std::string table = s.ToString();
  EXPECT_NE(table.find(StrCat("job ", a, ": 1 of 1 ranks")), std::string::npos) << table;
  EXPECT_NE(table.find("(this one)"), std::string::npos) << table;

  // a leaves: its bytes are back for b, and the ledger lives on with b alone.
  a0.reset();
  EXPECT_TRUE(b0->Reserve(NodeTier::kPageable, 150 * kMiB).ok());
  s = b0->Stats();
  ASSERT_EQ(s.jobs.size(), 1u);
  EXPECT_EQ(s.jobs[0].name, b);
  // a comes back (a restart): a fresh entry, admission from the start.
  auto again = JoinOrDie(oa);
  ASSERT_TRUE(again);
  s = again->Stats();
  ASSERT_EQ(s.jobs.size(), 2u);
  EXPECT_EQ(s.jobs[ia].name, a);
  EXPECT_EQ(s.jobs[ia].declared_bytes, 0u);
  EXPECT_EQ(s.jobs[ia].host_bytes, 0u);
  // b holds 150 MiB (more than its 100 MiB declared): a's 300 MiB does not fit beside it.
  st = again->Admit(300 * kMiB, 0, 5s, "");
  ASSERT_EQ(st.code(), StatusCode::kOverBudget) << st.ToString();
  EXPECT_TRUE(Has(st, StrCat("job '", b, "' 150.0 MiB (1 rank(s))"))) << st.ToString();
  // A refused round is taken back: b's admission does not count a's refused 300 MiB.
  EXPECT_TRUE(b0->Admit(50 * kMiB, 0, 5s, "").ok());
  EXPECT_TRUE(again->Validate().ok()) << again->Validate().ToString();
}

TEST(NodeGovernorTest, BadInputIsRefusedByName) {
  const std::string job = UniqueJob("bad");
  auto r0 = JoinOrDie(Options(job, 0, 100 * kMiB));
  ASSERT_TRUE(r0);
  auto other = NodeGovernor::Join(Options(job, 1, 200 * kMiB));
  ASSERT_EQ(other.status().code(), StatusCode::kInvalidArgument);
  EXPECT_TRUE(Has(other.status(), "Give every rank of every job the same"))
      << other.status().ToString();
  EXPECT_TRUE(Has(other.status(), StrCat("set by job '", job, "'"))) << other.status().ToString();
  auto twice = NodeGovernor::Join(Options(job, 0, 0));
  ASSERT_EQ(twice.status().code(), StatusCode::kFailedPrecondition);
  EXPECT_TRUE(Has(twice.status(), "local rank 0")) << twice.status().ToString();
  EXPECT_TRUE(Has(twice.status(), "which is alive")) << twice.status().ToString();
  auto bad_name = NodeGovernor::Join(Options("a/b", 0, 0));
  EXPECT_EQ(bad_name.status().code(), StatusCode::kInvalidArgument);
  auto bad_rank = NodeGovernor::Join(Options(job, 64, 0));
  EXPECT_EQ(bad_rank.status().code(), StatusCode::kInvalidArgument);
  // Nothing of the first rank changed.
  EXPECT_EQ(r0->Stats().ranks.size(), 1u);
  EXPECT_TRUE(r0->Validate().ok());
}

TEST(NodeGovernorTest, SegmentIsTheUsersAloneAndTheLastRankRemovesIt) {
  const std::string job = UniqueJob("perm");
  std::string path;
  {
    auto r0 = JoinOrDie(Options(job, 0, 100 * kMiB));
    ASSERT_TRUE(r0);
    path = r0->path();
    struct stat st {};
    ASSERT_EQ(stat(path.c_str(), &st), 0);
    EXPECT_EQ(st.st_mode & 0777, 0600u);
    EXPECT_EQ(st.st_uid, geteuid());
    auto listed = NodeGovernor::ListSegments();
    EXPECT_NE(std::find(listed.begin(), listed.end(), path), listed.end());
    if (geteuid() == 0) {
      // Another user's process (a forked child that drops to nobody) cannot open it.
      ChildRank c = ChildRank::Start([&](int) {
        if (setgid(65534) != 0 || setuid(65534) != 0) return 3;
        auto seen = NodeGovernor::Inspect(path);
        if (seen.ok()) return 1;
        return seen.status().code() == StatusCode::kFailedPrecondition &&
                       Has(seen.status(), "another user")
                   ? 0
                   : 2;
      });
      EXPECT_EQ(c.Wait(), 0) << "a process of another uid opened the segment";
    }
    auto r1 = JoinOrDie(Options(job, 1, 0));
    r1.reset();
    EXPECT_TRUE(Exists(path)) << "rank 0 still runs";
  }
  EXPECT_FALSE(Exists(path)) << "the last rank out removes the segment";
  if (geteuid() != 0) GTEST_SKIP() << "the other-user check needs root to switch uid";
}

TEST(NodeGovernorTest, ARankLeavingAtExitFreesItsSlotWhileItsArenaLives) {
  auto g = std::shared_ptr<NodeGovernor>(JoinOrDie(Options(UniqueJob("leave"), 0, 256 * kMiB)));
  Ledger ledger;
  HostArenaOptions o = testing::PageableOptions(&ledger);
  o.node = g;
  auto arena = testing::MakeArena(o);
  auto p = arena->Allocate(8 * kMiB, Tag(Kind::kParam, Lifetime::kPersistent));
  ASSERT_TRUE(p.ok());
  const std::string path = g->path();
  g->Leave();  // Python's atexit: the arenas outlive the slot
  EXPECT_FALSE(Exists(path)) << "the last rank out removes the segment";
  auto q = arena->Allocate(64 * kMiB, Tag(Kind::kParam, Lifetime::kPersistent));
  ASSERT_EQ(q.status().code(), StatusCode::kFailedPrecondition) << q.status().ToString();
  EXPECT_TRUE(Has(q.status(), "already left")) << q.status().ToString();
  EXPECT_TRUE(arena->Free(*p).ok());  // its release is a no-op now
  EXPECT_EQ(arena->Stats().committed_bytes, 0u) << "unmapped, though nothing is booked any more";
  g->Leave();  // idempotent
}

TEST(NodeGovernorTest, AKilledRanksBytesComeBackWithinTheWatchInterval) {
  if (testing::kUnderSanitizer) GTEST_SKIP() << "sanitizers reroute fork and signals";
  const std::string job = UniqueJob("kill");
  auto r0 = JoinOrDie(Options(job, 0, 1024 * kMiB));
  ASSERT_TRUE(r0);
  ChildRank c = ChildRank::Start([&](int ready) {
    auto r1 = NodeGovernor::Join(Options(job, 1, 0));
    if (!r1.ok() || !(*r1)->Reserve(NodeTier::kPinned, 600 * kMiB).ok()) return 1;
    SignalReady(ready);
    pause();
    return 0;
  });
  ASSERT_TRUE(c.WaitReady());
  EXPECT_EQ(r0->Stats().host_committed_bytes, 600 * kMiB);
  EXPECT_EQ(r0->Reserve(NodeTier::kPinned, 600 * kMiB).code(), StatusCode::kOverBudget)
      << "a live rank's bytes are held";
  const auto killed = std::chrono::steady_clock::now();
  c.Kill();
  // Rank 0's watcher reaps it (even before the launcher waits for the zombie): TryReserve itself
  // reaps nothing, so its success shows the watcher's work.
  Status st;
  do {
    std::this_thread::sleep_for(1ms);
    st = r0->TryReserve(NodeTier::kPinned, 600 * kMiB);
  } while (!st.ok() && std::chrono::steady_clock::now() - killed < 5s);
  const auto took = std::chrono::steady_clock::now() - killed;
  ASSERT_TRUE(st.ok()) << st.ToString();
  std::printf("lease back %.1f ms after SIGKILL (watch interval 50 ms)\n",
              std::chrono::duration<double, std::milli>(took).count());
  EXPECT_LT(took, 5s);
  r0->Release(NodeTier::kPinned, 600 * kMiB);
  auto seen = NodeGovernor::Inspect(r0->path());  // a look from outside, as `spillway node`
  ASSERT_TRUE(seen.ok()) << seen.status().ToString();
  EXPECT_EQ(seen->host_committed_bytes, 0u);
  EXPECT_EQ(seen->ranks.size(), 1u);
  EXPECT_GE(seen->reaped_ranks, 1u);
  EXPECT_EQ(c.Wait(), 128 + SIGKILL);
  // The rank restarted (torchrun's elastic restart) rejoins in its old slot.
  ChildRank again = ChildRank::Start([&](int) {
    auto r1 = NodeGovernor::Join(Options(job, 1, 0));
    return r1.ok() && (*r1)->Reserve(NodeTier::kPinned, 600 * kMiB).ok() ? 0 : 1;
  });
  EXPECT_EQ(again.Wait(), 0);
  EXPECT_TRUE(r0->Reserve(NodeTier::kPinned, 600 * kMiB).ok()) << "the restarted rank left";
  EXPECT_TRUE(r0->Validate().ok());
}

TEST(NodeGovernorTest, AJobKilledWholeLeavesASegmentTheNextJobRemoves) {
  if (testing::kUnderSanitizer) GTEST_SKIP() << "sanitizers reroute fork and signals";
  // A directory of its own: any other test's Join in /dev/shm (ctest runs them side by side)
  // would remove the dead job's segment before this test looks for it.
  char tmpl[] = "/dev/shm/spillway-gtest-dead-XXXXXX";
  ASSERT_NE(mkdtemp(tmpl), nullptr);
  const std::string dir = tmpl;
  auto in_dir = [&](NodeGovernorOptions o) {
    o.dir = dir;
    return o;
  };
  const std::string job = UniqueJob("dead");
  const std::string path = NodeGovernor::SegmentPath(dir, Options(job, 0, 0).ledger);
  ChildRank c = ChildRank::Start([&](int ready) {
    auto r = NodeGovernor::Join(in_dir(Options(job, 0, 100 * kMiB)));
    if (!r.ok()) return 1;
    SignalReady(ready);
    pause();
    return 0;
  });
  ASSERT_TRUE(c.WaitReady());
  c.Kill();
  EXPECT_EQ(c.Wait(), 128 + SIGKILL);
  EXPECT_TRUE(Exists(path)) << "SIGKILL runs no destructor";
  {
    auto next = JoinOrDie(in_dir(Options(UniqueJob("next"), 0, 100 * kMiB)));
    EXPECT_FALSE(Exists(path)) << "a later job's Join removes a segment whose ranks are all dead";
  }
  std::error_code ignored;
  std::filesystem::remove_all(dir, ignored);
}

TEST(NodeGovernorTest, PressureTrimsTheOtherRanksRetainedCaches) {
  const std::string job = UniqueJob("trim");
  auto g0 = JoinOrDie(Options(job, 0, 64 * kMiB));
  auto g1 = JoinOrDie(Options(job, 1, 0));
  ASSERT_TRUE(g0 && g1);
  Ledger ledger;
  HostArenaOptions o = testing::PageableOptions(&ledger);
  o.region_bytes = 32 * kMiB;  // 16 MiB requests get regions of their own
  o.retain_limit_bytes = 64 * kMiB;
  o.retain_fraction = 1.0;  // keeps up to max(region, live) = 32 MiB of empty regions
  o.node = std::shared_ptr<NodeGovernor>(std::move(g0));
  auto a0 = testing::MakeArena(o);
  o.node = std::shared_ptr<NodeGovernor>(std::move(g1));
  auto a1 = testing::MakeArena(o);
  ASSERT_TRUE(a0 && a1);
  // Rank 0 fills three regions, then frees two: its retained cache keeps them mapped.
  std::vector<void*> held;
  for (int i = 0; i < 3; ++i) {
    auto p = a0->Allocate(16 * kMiB, Tag(Kind::kOptimizerState, Lifetime::kPersistent));
    ASSERT_TRUE(p.ok()) << p.status().ToString();
    held.push_back(*p);
  }
  ASSERT_TRUE(a0->Free(held[1]).ok());
  ASSERT_TRUE(a0->Free(held[2]).ok());
  EXPECT_EQ(a0->Stats().committed_bytes, 48 * kMiB) << "retained, still booked on the node";
  // Rank 1 needs 32 MiB: only rank 0's retained regions can give it.
  auto p1 = a1->Allocate(32 * kMiB, Tag(Kind::kParam, Lifetime::kPersistent));
  ASSERT_TRUE(p1.ok()) << p1.status().ToString();
  EXPECT_EQ(a0->Stats().committed_bytes, 16 * kMiB) << "rank 0 trimmed on request";
  NodeStats s = o.node->Stats();
  EXPECT_GE(s.trim_requests, 1u);
  EXPECT_EQ(s.host_committed_bytes, 48 * kMiB);
  // Past what trimming can give, the refusal names the node and both ranks by kind.
  auto p2 = a1->Allocate(32 * kMiB, Tag(Kind::kParam, Lifetime::kPersistent));
  ASSERT_EQ(p2.status().code(), StatusCode::kOverBudget);
  EXPECT_TRUE(Has(p2.status(), "node budget")) << p2.status().ToString();
  EXPECT_TRUE(Has(p2.status(), "optimizer_state 16.0 MiB")) << p2.status().ToString();
  EXPECT_TRUE(Has(p2.status(), "param 32.0 MiB")) << p2.status().ToString();
  EXPECT_EQ(a1->Stats().node_refusals, 1u);
  EXPECT_TRUE(a0->Validate().ok());
  EXPECT_TRUE(a1->Validate().ok());
  ASSERT_TRUE(a1->Free(*p1).ok());
  ASSERT_TRUE(a0->Free(held[0]).ok());
  a0->Trim();
  a1->Trim();
  EXPECT_EQ(o.node->Stats().host_committed_bytes, 0u) << "every unmapped region was given back";
}

TEST(NodeGovernorTest, AnArenaSpillsWhenTheNodeIsFull) {
  const std::string job = UniqueJob("spill");
  auto g = std::shared_ptr<NodeGovernor>(JoinOrDie(Options(job, 0, 32 * kMiB)));
  Ledger ledger;
  HostArenaOptions o = testing::PageableOptions(&ledger);
  o.budget_bytes = 1024 * kMiB;  // the process's own budget is not what binds
  o.region_bytes = 16 * kMiB;
  o.node = g;
  auto arena = testing::MakeArena(o);
  ASSERT_TRUE(arena);
  auto a = arena->Allocate(16 * kMiB, Tag(Kind::kOptimizerState, Lifetime::kPersistent));
  auto b = arena->Allocate(16 * kMiB, Tag(Kind::kOptimizerState, Lifetime::kPersistent));
  ASSERT_TRUE(a.ok() && b.ok());
  int calls = 0;
  void* victim = *a;
  arena->SetSpillHandler(
      [&](const HostArena::SpillRequest& r) -> uint64_t {
        ++calls;
        if (victim == nullptr) return 0;
        EXPECT_EQ(r.request_bytes, 16 * kMiB);
        EXPECT_TRUE(arena->Free(victim).ok());
        victim = nullptr;
        return 16 * kMiB;
      },
      &calls);
  auto c = arena->Allocate(16 * kMiB, Tag(Kind::kParam, Lifetime::kPersistent));
  ASSERT_TRUE(c.ok()) << c.status().ToString();
  EXPECT_EQ(calls, 1);
  EXPECT_EQ(g->Stats().host_committed_bytes, 32 * kMiB);
  auto d = arena->Allocate(16 * kMiB, Tag(Kind::kParam, Lifetime::kPersistent));
  ASSERT_EQ(d.status().code(), StatusCode::kOverBudget);
  EXPECT_TRUE(Has(d.status(), "spill handler freed nothing")) << d.status().ToString();
  arena->ClearSpillHandler(&calls);
  EXPECT_TRUE(arena->Validate().ok());
}

TEST(NodeGovernorTest, AdmissionFailsEveryRankWithOneMessageOrPassesThemAll) {
  if (testing::kUnderSanitizer) GTEST_SKIP() << "sanitizers reroute fork";
  for (const uint64_t need : {100 * kMiB, 200 * kMiB}) {
    const std::string job = UniqueJob("admit");
    // Three ranks, each a process, each declaring `need` against a 400 MiB node.
    std::vector<ChildRank> ranks;
    std::vector<int> out_fds;
    for (int r = 0; r < 3; ++r) {
      int fds[2];
      ASSERT_EQ(pipe(fds), 0);
      ranks.push_back(ChildRank::Start([&, r, fds](int) {
        close(fds[0]);
        NodeGovernorOptions o = Options(job, r, 400 * kMiB);
        o.local_world_size = 3;
        auto g = NodeGovernor::Join(o);
        if (!g.ok()) return 5;
        Status st = (*g)->Admit(need, need / 10, 10s, "Set offload_optimizer.device to nvme.");
        const std::string text = st.ToString();
        if (write(fds[1], text.data(), text.size()) < 0) return 6;
        return st.ok() ? 0 : 1;
      }));
      close(fds[1]);
      out_fds.push_back(fds[0]);
    }
    std::vector<std::string> texts;
    for (size_t r = 0; r < ranks.size(); ++r) {
      const int rc = ranks[r].Wait();
      std::string text;
      char buf[4096];
      ssize_t n;
      while ((n = read(out_fds[r], buf, sizeof(buf))) > 0) text.append(buf, static_cast<size_t>(n));
      close(out_fds[r]);
      EXPECT_EQ(rc, need * 3 <= 400 * kMiB ? 0 : 1) << text;
      texts.push_back(text);
    }
    if (need * 3 > 400 * kMiB) {
      EXPECT_EQ(texts[0], texts[1]);
      EXPECT_EQ(texts[1], texts[2]);
      EXPECT_TRUE(texts[0].find("600.00 MiB") != std::string::npos) << texts[0];
      EXPECT_TRUE(texts[0].find("local rank 2 200.0 MiB (of which its workers' fork copy 20.0 "
                                "MiB)") != std::string::npos)
          << texts[0];
      EXPECT_TRUE(texts[0].find("offload_optimizer.device") != std::string::npos) << texts[0];
      EXPECT_TRUE(texts[0].find("Nothing was allocated") != std::string::npos) << texts[0];
    }
  }
}

TEST(NodeGovernorTest, AdmissionRoundsAddUpAndEveryRankGetsOneVerdict) {
  const std::string job = UniqueJob("rounds");
  NodeGovernorOptions o = Options(job, 0, 400 * kMiB);
  o.local_world_size = 2;
  auto g0 = JoinOrDie(o);
  auto g1 = JoinOrDie(Options(job, 1, 0));
  ASSERT_TRUE(g0 && g1);
  // Round 1 (one engine each): 300 MiB fits. Round 2 (a second engine each, as DeepSpeed-Chat
  // builds): the needs add up to 500 MiB, over the node for every rank alike.
  for (const uint64_t need : {150 * kMiB, 100 * kMiB}) {
    const Status st0 = AdmitBoth(*g0, *g1, need, "more");
    if (need == 150 * kMiB) {
      EXPECT_TRUE(st0.ok()) << st0.ToString();
    } else {
      ASSERT_EQ(st0.code(), StatusCode::kOverBudget) << st0.ToString();
      EXPECT_TRUE(Has(st0, "local rank 0 250.0 MiB; local rank 1 250.0 MiB")) << st0.ToString();
    }
  }
  // The refused second round was taken back: what stands is the first engine's.
  EXPECT_EQ(g1->Stats().ranks[0].declared_bytes, 150 * kMiB);
}

TEST(NodeGovernorTest, ARefusedRoundIsTakenBackSoASmallerRetryIsJudgedAlone) {
  const std::string job = UniqueJob("retry");
  NodeGovernorOptions o = Options(job, 0, 400 * kMiB);
  o.local_world_size = 2;
  auto g0 = JoinOrDie(o);
  auto g1 = JoinOrDie(Options(job, 1, 0));
  ASSERT_TRUE(g0 && g1);
  for (const uint64_t need : {300 * kMiB, 100 * kMiB}) {  // refused, then a smaller config
    const Status st0 = AdmitBoth(*g0, *g1, need, "");
    EXPECT_EQ(st0.ok(), need == 100 * kMiB) << st0.ToString();
  }
  EXPECT_EQ(g0->Stats().ranks[1].declared_bytes, 100 * kMiB);
}

// A rank's memory by owner as spillway.node.memory() publishes it: `torch_cpu` and `python`
// outside the arenas, and a mapped file the limit does not hold against it.
ProcessMemory Published(uint64_t torch_cpu, uint64_t python, uint64_t mapped_files) {
  ProcessMemory m;
  m.owners[static_cast<int>(MemoryOwner::kTorchCpu)] = torch_cpu;
  m.owners[static_cast<int>(MemoryOwner::kPython)] = python;
  m.owners[static_cast<int>(MemoryOwner::kMappedFiles)] = mapped_files;
  m.total = torch_cpu + python + mapped_files;
  return m;
}

TEST(NodeGovernorTest, AdmissionCountsWhatTheRanksHoldOutsideTheArenasAgainstTheLimit) {
  // 300 MiB of needs fit the 400 MiB budget. Beside them the limit (1 GiB) has room for 724 MiB
  // held outside the arenas: 600 MiB fits (the control), 800 MiB does not, whatever the reserve
  // said, and the message names who holds it. Mapped files (1 GiB here) are never counted.
  for (const uint64_t torch_cpu : {500 * kMiB, 700 * kMiB}) {
    const std::string job = UniqueJob("outside");
    NodeGovernorOptions o = Options(job, 0, 400 * kMiB);
    o.memory_limit_bytes = 1024 * kMiB;
    o.local_world_size = 2;
    auto g0 = JoinOrDie(o);
    auto g1 = JoinOrDie(Options(job, 1, 0));
    ASSERT_TRUE(g0 && g1);
    g0->PublishMemory(Published(torch_cpu, 100 * kMiB, 1024 * kMiB));
    const Status st = AdmitBoth(*g0, *g1, 150 * kMiB, "Set offload_param.device to nvme.");
    if (torch_cpu == 500 * kMiB) {
      EXPECT_TRUE(st.ok()) << st.ToString();
      continue;
    }
    ASSERT_EQ(st.code(), StatusCode::kOverBudget) << st.ToString();
    EXPECT_TRUE(Has(st, "already hold 800.00 MiB")) << st.ToString();
    EXPECT_TRUE(Has(
        st,
        "outside Spillway's arenas, as each last published it (local rank 0 800.0 MiB (torch_cpu "
        "700.0 MiB, python 100.0 MiB))"))
        << st.ToString();
    EXPECT_TRUE(Has(st, "memory limit of 1.00 GiB")) << st.ToString();
    EXPECT_TRUE(Has(st, "Set offload_param.device to nvme.")) << st.ToString();
    // Nothing stands of the refused round, and each rank's line in the ledger's words names its
    // owners too (the allocation-time refusals use the same words).
    EXPECT_EQ(g0->Stats().ranks[0].declared_bytes, 0u);
    const std::string ranks = DescribeNodeRanks(g0->Stats());
    EXPECT_NE(ranks.find("outside the arenas 800.0 MiB (torch_cpu 700.0 MiB, python 100.0 MiB)"),
              std::string::npos)
        << ranks;
  }
}

TEST(NodeGovernorTest, AProcessNoLauncherDescribedMovesIntoTheJobItLearnsWithItsBytes) {
  // Two processes that joined as jobs of their own (what spillway.install() does where the
  // environment names no launcher) learn at their process group's start that they are local
  // ranks 0 and 1 of one job: each moves there with what it booked, and admission then judges
  // them as one job.
  const std::string base = UniqueJob("rekey");
  auto lone = [&](const char* name, uint64_t budget) {
    NodeGovernorOptions o = Options(StrCat(base, name), 0, budget);
    o.ledger = StrCat("ledger-", base);
    o.local_world_size = 1;
    return JoinOrDie(o);
  };
  auto g0 = lone("-a", 400 * kMiB);
  auto g1 = lone("-b", 0);
  auto g2 = lone("-c", 0);
  ASSERT_TRUE(g0 && g1 && g2);
  ASSERT_TRUE(g0->Reserve(NodeTier::kPageable, 30 * kMiB).ok());
  ASSERT_TRUE(g1->Reserve(NodeTier::kPinned, 20 * kMiB).ok());
  EXPECT_EQ(g0->Stats().jobs.size(), 3u);
  const std::string job = StrCat(base, "-dist");
  ASSERT_TRUE(g1->Rekey(job, 1, 2).ok());
  ASSERT_TRUE(g0->Rekey(job, 0, 2).ok());
  EXPECT_EQ(g0->job(), job);
  EXPECT_EQ(g1->local_rank(), 1);
  NodeStats s = g0->Stats();
  ASSERT_EQ(s.jobs.size(), 2u);  // the job and g2's own; the two left behind have no rank
  const auto it = std::find_if(s.jobs.begin(), s.jobs.end(),
                               [&](const NodeJobStats& j) { return j.name == job; });
  ASSERT_NE(it, s.jobs.end());
  EXPECT_EQ(it->ranks, 2);
  EXPECT_EQ(it->local_world_size, 2);
  EXPECT_EQ(it->host_bytes, 50 * kMiB);
  EXPECT_EQ(s.host_committed_bytes, 50 * kMiB);
  // Bad moves are refused by name and change nothing: a local rank a live rank holds, another
  // count of local ranks, a bad name.
  Status st = g2->Rekey(job, 1, 2);
  ASSERT_EQ(st.code(), StatusCode::kFailedPrecondition) << st.ToString();
  EXPECT_TRUE(Has(st, "local rank 1 of job")) << st.ToString();
  EXPECT_TRUE(Has(st, "is held by pid")) << st.ToString();
  st = g2->Rekey(job, 2, 3);
  ASSERT_EQ(st.code(), StatusCode::kFailedPrecondition) << st.ToString();
  EXPECT_TRUE(Has(st, "counts 2 local ranks, and this process says 3")) << st.ToString();
  EXPECT_EQ(g2->Rekey("../x", 0, 1).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(g2->Rekey(job, 2, 2).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(g2->job(), StrCat(base, "-c"));
  // One admission round for the two: 2 x 150 MiB fits the 400 MiB; another 2 x 100 (500 in all)
  // does not.
  ASSERT_TRUE(AdmitBoth(*g0, *g1, 150 * kMiB, "").ok());
  st = AdmitBoth(*g0, *g1, 100 * kMiB, "");
  ASSERT_EQ(st.code(), StatusCode::kOverBudget) << st.ToString();
  EXPECT_TRUE(Has(st, StrCat("the 2 local ranks of job '", job, "'"))) << st.ToString();
  // After a declaration the rank stays where it declared.
  st = g0->Rekey(StrCat(base, "-other"), 0, 1);
  ASSERT_EQ(st.code(), StatusCode::kFailedPrecondition) << st.ToString();
  EXPECT_TRUE(Has(st, "already declared")) << st.ToString();
  g0->Release(NodeTier::kPageable, 30 * kMiB);
  g1->Release(NodeTier::kPinned, 20 * kMiB);
  EXPECT_EQ(g2->Stats().host_committed_bytes, 0u);
  EXPECT_TRUE(g0->Validate().ok()) << g0->Validate().ToString();
}

TEST(NodeGovernorTest, AdmissionWithoutTheNumberOfLocalRanksIsRefusedByName) {
  auto g = JoinOrDie(Options(UniqueJob("no-lws"), 0, 400 * kMiB));  // local_world_size 0
  ASSERT_TRUE(g);
  Status st = g->Admit(kMiB, 0, 1s, "");
  ASSERT_EQ(st.code(), StatusCode::kFailedPrecondition) << st.ToString();
  EXPECT_TRUE(Has(st, "LOCAL_WORLD_SIZE")) << st.ToString();
}

// A process in another PID namespace (a container sharing /dev/shm, a sidecar) cannot judge the
// segment's pids: a look from there reaps nothing and removes nothing.
TEST(NodeGovernorTest, ALookFromAnotherPidNamespaceReapsNothing) {
  if (testing::kUnderSanitizer) GTEST_SKIP() << "sanitizers reroute fork";
  if (geteuid() != 0) GTEST_SKIP() << "unshare(CLONE_NEWPID) needs root";
  auto g = JoinOrDie(Options(UniqueJob("pidns"), 0, 100 * kMiB));
  ASSERT_TRUE(g);
  ASSERT_TRUE(g->Reserve(NodeTier::kPinned, 10 * kMiB).ok());
  ChildRank c = ChildRank::Start([&](int) {
    if (unshare(CLONE_NEWPID) != 0) return 77;
    const pid_t inner = fork();  // the first child of unshare() is in the new namespace
    if (inner == 0) {
      auto seen = NodeGovernor::Inspect(g->path());
      NodeGovernor::RemoveDeadSegments();
      _exit(seen.ok() && seen->ranks.size() == 1 && seen->reaped_ranks == 0 ? 0 : 1);
    }
    int status = 0;
    waitpid(inner, &status, 0);
    return WIFEXITED(status) ? WEXITSTATUS(status) : 2;
  });
  const int rc = c.Wait();
  if (rc == 77) GTEST_SKIP() << "this kernel or container refuses a new PID namespace";
  EXPECT_EQ(rc, 0);
  EXPECT_TRUE(Exists(g->path()));
  EXPECT_EQ(g->Stats().host_committed_bytes, 10 * kMiB);
}

TEST(NodeGovernorTest, ARankLateForAdmissionGetsTheSameTimeout) {
  const std::string job = UniqueJob("late-verdict");
  NodeGovernorOptions o = Options(job, 0, 400 * kMiB);
  o.local_world_size = 3;
  auto g0 = JoinOrDie(o);
  auto g1 = JoinOrDie(Options(job, 1, 0));
  ASSERT_TRUE(g0 && g1);
  Status early = g0->Admit(kMiB, 0, 200ms, "");  // rank 2 never comes
  ASSERT_EQ(early.code(), StatusCode::kUnavailable) << early.ToString();
  EXPECT_TRUE(Has(early, "local rank(s) 1, 2 of job")) << early.ToString();
  // Rank 1 arrives after the verdict: it must not pass alone into a collective with dead peers.
  Status late = g1->Admit(kMiB, 0, 5s, "");
  EXPECT_EQ(late.ToString(), early.ToString());
}

TEST(NodeGovernorTest, ASegmentLeftHalfMadeIsRemovedByTheNextJoin) {
  const std::string job = UniqueJob("half");
  const std::string path = NodeGovernor::SegmentPath("/dev/shm", job);
  const int fd = open(path.c_str(), O_RDWR | O_CREAT | O_EXCL, 0600);  // a creator killed at once
  ASSERT_GE(fd, 0);
  ASSERT_EQ(ftruncate(fd, 100), 0);
  close(fd);
  auto inspected = NodeGovernor::Inspect(path, 50ms);
  ASSERT_EQ(inspected.status().code(), StatusCode::kFailedPrecondition);
  EXPECT_TRUE(Has(inspected.status(), "rm " + path)) << inspected.status().ToString();
  auto g = JoinOrDie(Options(job, 0, 100 * kMiB));
  ASSERT_TRUE(g) << "the abandoned file was removed and the segment made anew";
  EXPECT_TRUE(g->Reserve(NodeTier::kPinned, kMiB).ok());
  EXPECT_TRUE(g->Validate().ok());
}

TEST(NodeGovernorTest, AReleaseAfterLeavingChangesNothingOfTheNextOccupant) {
  const std::string job = UniqueJob("late-release");
  auto keep = JoinOrDie(Options(job, 0, 100 * kMiB));  // keeps the segment alive
  auto first = JoinOrDie(Options(job, 1, 0));
  ASSERT_TRUE(keep && first);
  ASSERT_TRUE(first->Reserve(NodeTier::kPinned, 10 * kMiB).ok());
  first->Leave();
  auto second = JoinOrDie(Options(job, 1, 0));  // the slot's next occupant
  ASSERT_TRUE(second);
  ASSERT_TRUE(second->Reserve(NodeTier::kPinned, 20 * kMiB).ok());
  first->Release(NodeTier::kPinned, 10 * kMiB);  // late: from a thread that outlived Leave
  EXPECT_EQ(first->TryReserve(NodeTier::kPinned, kMiB).code(), StatusCode::kFailedPrecondition);
  const NodeStats s = keep->Stats();
  EXPECT_EQ(s.host_committed_bytes, 20 * kMiB);
  EXPECT_EQ(s.ranks.back().host_bytes, 20 * kMiB);
  EXPECT_TRUE(keep->Validate().ok()) << keep->Validate().ToString();
}

TEST(NodeGovernorTest, AdmissionNamesTheRanksThatNeverCame) {
  const std::string job = UniqueJob("late");
  NodeGovernorOptions o = Options(job, 0, 400 * kMiB);
  o.local_world_size = 3;
  auto g = JoinOrDie(o);
  ASSERT_TRUE(g);
  auto g2 = JoinOrDie(Options(job, 2, 0));
  ASSERT_TRUE(g2);
  std::thread other(
      [&] { EXPECT_EQ(g2->Admit(1, 0, 300ms, "").code(), StatusCode::kUnavailable); });
  Status st = g->Admit(1 * kMiB, 0, 300ms, "");
  other.join();
  ASSERT_EQ(st.code(), StatusCode::kUnavailable) << st.ToString();
  EXPECT_TRUE(Has(st, "local rank(s) 1 of job")) << st.ToString();
}

TEST(NodeGovernorTest, AForkedChildOfARankBooksNothing) {
  if (testing::kUnderSanitizer) GTEST_SKIP() << "sanitizers reroute fork";
  auto g = JoinOrDie(Options(UniqueJob("fork"), 0, 100 * kMiB));
  ASSERT_TRUE(g);
  ASSERT_TRUE(g->Reserve(NodeTier::kPinned, 10 * kMiB).ok());
  ChildRank c = ChildRank::Start([&](int) {
    testing::RefusedInChild refused;
    refused(g->Reserve(NodeTier::kPinned, 1 * kMiB), "Reserve");
    refused(g->Admit(1, 0, 10ms, ""), "Admit");
    g->Release(NodeTier::kPinned, 10 * kMiB);  // a no-op in the child
    g.reset();  // the child does not own the slot: its destructor must not free it
    return refused.bad;
  });
  EXPECT_EQ(c.Wait(), 0);
  EXPECT_EQ(g->Stats().host_committed_bytes, 10 * kMiB);
  EXPECT_EQ(g->Stats().ranks.size(), 1u);
}

TEST(NodeGovernorTest, NvmeArenasShareTheNodesNvmeBudget) {
  const std::string job = UniqueJob("nvme");
  NodeGovernorOptions opt = Options(job, 0, 1024 * kMiB);
  opt.nvme_budget_bytes = 64 * kMiB;
  auto g0 = std::shared_ptr<NodeGovernor>(JoinOrDie(opt));
  auto g1 = std::shared_ptr<NodeGovernor>(JoinOrDie(Options(job, 1, 0)));
  testing::IoRig rig(/*thread_pool=*/false);
  NvmeArenaOptions o;
  o.directory = testing::NvmeTestDir();
  o.budget_bytes = 1024 * kMiB;  // each rank's own budget is not what binds
  o.grow_bytes = 16 * kMiB;
  o.ledger = &rig.ledger;
  o.node = g0;
  auto n0 = NvmeArena::Create(o, rig.engine.get());
  o.node = g1;
  auto n1 = NvmeArena::Create(o, rig.engine.get());
  ASSERT_TRUE(n0.ok() && n1.ok());
  auto a = (*n0)->Allocate(48 * kMiB, Tag(Kind::kOptimizerState, Lifetime::kPersistent));
  ASSERT_TRUE(a.ok()) << a.status().ToString();
  EXPECT_EQ(g1->Stats().nvme_committed_bytes, 48 * kMiB);
  auto b = (*n1)->Allocate(32 * kMiB, Tag(Kind::kOptimizerState, Lifetime::kPersistent));
  ASSERT_EQ(b.status().code(), StatusCode::kOverBudget);
  EXPECT_TRUE(Has(b.status(), "NVMe budget of 64.00 MiB")) << b.status().ToString();
  EXPECT_TRUE(Has(b.status(), "growing the swap file")) << b.status().ToString();
  EXPECT_TRUE((*n1)->Validate().ok());
  n0->reset();  // closing the arena frees its file and its booking
  EXPECT_EQ(g1->Stats().nvme_committed_bytes, 0u);
  auto c = (*n1)->Allocate(32 * kMiB, Tag(Kind::kOptimizerState, Lifetime::kPersistent));
  EXPECT_TRUE(c.ok()) << c.status().ToString();
  EXPECT_TRUE(g1->Validate().ok());
}

TEST(NodeGovernorTest, TheFirstNvmeArenaSetsTheNodesNvmeBudget) {
  auto g = std::shared_ptr<NodeGovernor>(JoinOrDie(Options(UniqueJob("nvme-default"), 0, kMiB)));
  EXPECT_EQ(g->Stats().nvme_budget_bytes, 0u);
  testing::IoRig rig(/*thread_pool=*/true);
  NvmeArenaOptions o;
  o.directory = testing::NvmeTestDir();
  o.budget_bytes = 64 * kMiB;
  o.ledger = &rig.ledger;
  o.node = g;
  auto n = NvmeArena::Create(o, rig.engine.get());
  ASSERT_TRUE(n.ok()) << n.status().ToString();
  const uint64_t offered = g->Stats().nvme_budget_bytes;
  EXPECT_GT(offered, 0u) << "90% of the free space where it swaps";
  EXPECT_EQ(*g->OfferNvmeBudget(1), offered) << "the first offer stands";
}

}  // namespace
}  // namespace spillway::allocator
