// Which job a rank belongs to, read from the launcher's environment (torchrun, the deepspeed
// launcher, mpirun, srun, or SPILLWAY_NODE_JOB), which ledger its memory limit keeps, and the node
// budget's defaults.
// Note [Node governor] in docs/allocator.md.
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <climits>
#include <cstdio>
#include <cstdlib>
#include <string_view>

#include "node_segment.h"
#include "spillway/allocator/host_arena.h"
#include "spillway/allocator/node_governor.h"
#include "spillway/base/bytes.h"

namespace spillway::allocator {

namespace {

std::string SanitizeJob(std::string_view text) {
  std::string out;
  for (char c : text.substr(0, node::kJobChars)) out += node::ValidJobChar(c) ? c : '_';
  return out;
}

}  // namespace

uint64_t DefaultNodeReserve(uint64_t limit_bytes) {
  return std::min(std::max(uint64_t{2} << 30, limit_bytes / 8), limit_bytes / 2);
}

uint64_t DefaultNodeHostBudget(uint64_t limit_bytes) {
  return limit_bytes - DefaultNodeReserve(limit_bytes);
}

// The limit is named by the identity of its cgroup directory (device and inode: the same cgroup
// seen from a cgroup namespace has another path), and the PID namespace: a ledger judges its
// ranks by pid, so two containers that share /dev/shm but not their pids keep two ledgers.
NodeLedger NodeLedgerOf(const MemoryLimit& limit) {
  std::string identity = "machine";
  struct stat st {};
  if (!limit.cgroup.empty()) {
    identity = stat(limit.cgroup.c_str(), &st) == 0 ? StrCat("cgroup ", st.st_dev, ":", st.st_ino)
                                                    : StrCat("cgroup ", limit.cgroup);
  }
  identity += StrCat(" pidns ", node::OwnPidNamespace());
  uint64_t h = 1469598103934665603ull;  // FNV-1a
  for (const char c : identity) h = (h ^ static_cast<unsigned char>(c)) * 1099511628211ull;
  char hex[17];
  std::snprintf(hex, sizeof(hex), "%016llx", static_cast<unsigned long long>(h));
  NodeLedger out;
  out.name = StrCat("limit-", hex);
  out.scope = limit.cgroup.empty()
                  ? StrCat("this machine's ", FormatBytes(limit.bytes),
                           " (no cgroup memory limit below it)")
                  : StrCat("the cgroup ", limit.cgroup, ", limit ", FormatBytes(limit.bytes));
  return out;
}

NodeLedger DefaultNodeLedger() { return NodeLedgerOf(MemoryLimitOf()); }

namespace {

// Each launcher's local rank and local rank count, in the order they are believed: torchrun,
// Accelerate and the deepspeed launcher (and DeepSpeed's MPICH and Intel MPI runners, which pass
// LOCAL_RANK and LOCAL_SIZE themselves) first, since they may run under an MPI launcher or srun
// whose variables describe the launcher's own processes; then OpenMPI's mpirun (DeepSpeed's OpenMPI
// runner sets LOCAL_RANK only inside deepspeed.init_distributed, after install()), MPICH's and
// Intel MPI's Hydra, MVAPICH2, Cray's PALS, and srun.
struct LauncherVars {
  const char* rank;
  const char* sizes[3];
};
constexpr LauncherVars kLaunchers[] = {
    {"LOCAL_RANK", {"LOCAL_WORLD_SIZE", "LOCAL_SIZE", "SLURM_NTASKS_PER_NODE"}},
    {"OMPI_COMM_WORLD_LOCAL_RANK", {"OMPI_COMM_WORLD_LOCAL_SIZE", nullptr, nullptr}},
    {"MPI_LOCALRANKID", {"MPI_LOCALNRANKS", nullptr, nullptr}},
    {"MV2_COMM_WORLD_LOCAL_RANK", {"MV2_COMM_WORLD_LOCAL_SIZE", nullptr, nullptr}},
    {"PALS_LOCAL_RANKID", {"PALS_LOCAL_SIZE", nullptr, nullptr}},
    {"SLURM_LOCALID", {"SLURM_NTASKS_PER_NODE", nullptr, nullptr}},
};

// A count of Slurm's: digits only (no sign, no space), 1 to INT_MAX.
bool SlurmCount(const char** p, long* out) {
  const char* q = *p;
  long n = 0;
  while (*q >= '0' && *q <= '9') {
    n = n * 10 + (*q - '0');
    if (n > INT_MAX) return false;
    ++q;
  }
  if (q == *p || n == 0) return false;
  *p = q;
  *out = n;
  return true;
}

// Slurm's tasks per node, run-length coded ("4(x2),3": 4, 4, 3): the count of node `node_id`.
// The whole text must parse.
bool SlurmTasksOnNode(const std::string& text, long node_id, int* out) {
  const char* p = text.c_str();
  long first = 0;  // the first node of the entry being read
  bool found = false;
  while (true) {
    long tasks = 0;
    long repeat = 1;
    if (!SlurmCount(&p, &tasks)) return false;
    if (*p == '(') {
      if (p[1] != 'x') return false;
      p += 2;
      if (!SlurmCount(&p, &repeat) || *p != ')') return false;
      ++p;
    }
    if (!found && node_id - first < repeat) {
      *out = static_cast<int>(tasks);
      found = true;
    }
    first += repeat;  // repeat <= INT_MAX, and at most strlen(text) entries: no overflow
    if (*p == '\0') return found;
    if (*p != ',') return false;
    ++p;
  }
}

}  // namespace

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
  const LauncherVars* launcher = &kLaunchers[0];
  for (const LauncherVars& l : kLaunchers) {
    if (!get(l.rank).empty()) {
      launcher = &l;
      break;
    }
  }
  const char* rank_var = launcher->rank;
  SPILLWAY_RETURN_IF_ERROR(parse_int(rank_var, &job.local_rank));
  if (!get(rank_var).empty()) job.rank_variable = rank_var;
  for (const char* name : launcher->sizes) {
    if (name != nullptr && !get(name).empty()) {
      SPILLWAY_RETURN_IF_ERROR(parse_int(name, &job.local_world_size));
      break;
    }
  }
  const std::string step_tasks = get("SLURM_STEP_TASKS_PER_NODE");
  if (job.local_world_size == 0 && std::string_view(rank_var) == "SLURM_LOCALID" &&
      !step_tasks.empty()) {
    // srun without --ntasks-per-node: the step's tasks per node, at this node (SLURM_NODEID is
    // relative to the step). Not SLURM_TASKS_PER_NODE: a batch script's is the whole job's.
    int node_id = 0;
    SPILLWAY_RETURN_IF_ERROR(parse_int("SLURM_NODEID", &node_id));
    if (!SlurmTasksOnNode(step_tasks, node_id, &job.local_world_size)) {
      return Status::InvalidArgument(
          StrCat("SLURM_STEP_TASKS_PER_NODE='", step_tasks, "' at SLURM_NODEID=", node_id,
                 " does not give this node's task count (Slurm writes counts like '4(x2),3'); "
                 "set LOCAL_WORLD_SIZE to the number of ranks on this node"));
    }
  }
  const std::string explicit_job = get("SPILLWAY_NODE_JOB");
  if (!explicit_job.empty()) {
    if (!node::ValidJob(explicit_job)) {
      return Status::InvalidArgument(StrCat("SPILLWAY_NODE_JOB='", explicit_job, "': use at most ",
                                            node::kJobChars,
                                            " characters of A-Z, a-z, 0-9, '.', '_' and '-'"));
    }
    job.id = explicit_job;
    job.source = "SPILLWAY_NODE_JOB";
    return job;
  }
  if (get(rank_var).empty()) return job;  // not one rank of a launched job
  const std::string run_id = get("TORCHELASTIC_RUN_ID");
  if (!run_id.empty() && run_id != "none") {
    job.id = SanitizeJob(StrCat("torchelastic-", run_id));
    job.source = "TORCHELASTIC_RUN_ID";
  } else {
    // The launcher that started every local rank (torchrun's agent, the deepspeed launcher,
    // slurmstepd): two launches in one Slurm allocation are two jobs.
    const pid_t parent = getppid();
    char state = '?';
    uint64_t start = 0;
    node::ReadProcStat(parent, &state, &start);
    job.id = StrCat("launcher-", parent, "-", start);
    job.source = StrCat("the launcher's pid (the parent of every local rank; ", rank_var, " set)");
  }
  return job;
}

Result<NodeJob> NodeJobFromEnvironment() {
  return NodeJobFromEnvironment([](const char* name) {
    return std::getenv(name);  // NOLINT(concurrency-mt-unsafe): read-only, Spillway never setenv()s
  });
}

}  // namespace spillway::allocator
