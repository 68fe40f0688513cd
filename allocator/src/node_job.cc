// Which job a rank belongs to, read from the launcher's environment (torchrun, the deepspeed
// launcher, SLURM, or SPILLWAY_NODE_JOB), and the node budget's defaults. Note [Node governor] in
// docs/allocator.md.
#include <unistd.h>

#include <algorithm>
#include <cstdlib>

#include "node_segment.h"
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
  // torchrun, Accelerate and the deepspeed launcher set LOCAL_RANK; srun sets SLURM_LOCALID.
  const char* rank_var = !get("LOCAL_RANK").empty() ? "LOCAL_RANK" : "SLURM_LOCALID";
  SPILLWAY_RETURN_IF_ERROR(parse_int(rank_var, &job.local_rank));
  for (const char* name : {"LOCAL_WORLD_SIZE", "LOCAL_SIZE", "SLURM_NTASKS_PER_NODE"}) {
    if (!get(name).empty()) {
      SPILLWAY_RETURN_IF_ERROR(parse_int(name, &job.local_world_size));
      break;
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
    job.source = "the launcher's pid (the parent of every local rank)";
  }
  return job;
}

Result<NodeJob> NodeJobFromEnvironment() {
  return NodeJobFromEnvironment([](const char* name) {
    return std::getenv(name);  // NOLINT(concurrency-mt-unsafe): read-only, Spillway never setenv()s
  });
}

}  // namespace spillway::allocator
