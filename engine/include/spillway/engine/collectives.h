// Collectives for ZeRO-3 across ranks: all-gather of parameter shards, reduce-scatter of
// gradients, all-reduce of the squared-norm partials, on c10d's ProcessGroupGloo from libtorch. Two
// ways to get one (Note [Process groups] in docs/engine.md):
//  - Create(env): a ProcessGroupGloo over a TCPStore at MASTER_ADDR:MASTER_PORT, made here. This
//    needs gloo's headers at build time, which the torch wheels do not ship (SPILLWAY_GLOO_INCLUDE_DIR).
//  - FromProcessGroup(pg): the group `torch.distributed.init_process_group("gloo")` made, handed over
//    by the Python module (spillway.engine). Needs only c10d's own headers, so it works with every
//    torch wheel; `torchrun` sets the same variables for it.
// World size 1 needs no process group. No home-made transport. Built with the torch half of the
// engine (SPILLWAY_WITH_TORCH).
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include <c10/util/intrusive_ptr.h>

#include "spillway/allocator/status.h"

namespace c10d {
class ProcessGroup;
}

namespace spillway::engine {

struct DistEnv {
  int rank = 0;
  int world_size = 1;
  int local_rank = 0;
  std::string master_addr = "127.0.0.1";
  int master_port = 29500;
  int timeout_seconds = 120;
};

// RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT (torchrun's names). None set: a single
// process. A malformed or inconsistent value is INVALID_ARGUMENT naming the variable.
Result<DistEnv> DistEnvFromEnvironment();

// Thread-compatible: one thread issues collectives, in the same order on every rank.
class Collectives {
 public:
  static Result<std::unique_ptr<Collectives>> Create(const DistEnv& env);
  // Collectives over the CPU backend of an existing c10d process group (kept alive while these
  // live). A null group, or one without a CPU backend (NCCL alone), is INVALID_ARGUMENT naming it.
  static Result<std::unique_ptr<Collectives>> FromProcessGroup(c10::intrusive_ptr<c10d::ProcessGroup> pg);
  ~Collectives();
  Collectives(const Collectives&) = delete;
  Collectives& operator=(const Collectives&) = delete;

  int rank() const { return env_.rank; }
  int world_size() const { return env_.world_size; }
  const std::string& backend() const;  // "single", or the c10d backend's name ("gloo")

  // full[r * shard_elems, (r + 1) * shard_elems) = rank r's shard.
  Status AllGather(const float* shard, uint64_t shard_elems, float* full);
  // shard = sum over ranks of their full[rank * shard_elems, ...).
  Status ReduceScatterSum(const float* full, uint64_t shard_elems, float* shard);
  Result<double> AllReduceSum(double value);
  Status Barrier();

 private:
  struct Impl;
  explicit Collectives(const DistEnv& env);
  DistEnv env_;
  std::unique_ptr<Impl> impl_;
};

}  // namespace spillway::engine
