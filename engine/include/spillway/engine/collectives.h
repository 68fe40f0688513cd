// Collectives for ZeRO-3 across ranks: all-gather of parameter shards, reduce-scatter of
// gradients, all-reduce of the squared-norm partials. c10d's ProcessGroupGloo (from libtorch) on
// CPU, over a TCPStore at MASTER_ADDR:MASTER_PORT, so one binary runs multi-process on one machine
// and multi-node on a cluster with the usual torchrun variables. World size 1 needs no process
// group. No home-made transport. Built with the torch half of the engine (SPILLWAY_WITH_TORCH).
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include "spillway/allocator/status.h"

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
  ~Collectives();
  Collectives(const Collectives&) = delete;
  Collectives& operator=(const Collectives&) = delete;

  int rank() const { return env_.rank; }
  int world_size() const { return env_.world_size; }
  const char* backend() const;  // "single" or "gloo"

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
