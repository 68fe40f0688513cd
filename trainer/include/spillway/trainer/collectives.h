// Collectives for ZeRO-3 across ranks: all-gather of parameter shards, reduce-scatter of
// gradients, all-reduce of the squared-norm partials, on c10d's ProcessGroupGloo from libtorch. Two
// ways to get one (Note [Process groups] in docs/engine.md):
//  - Create(env): a ProcessGroupGloo over a TCPStore at MASTER_ADDR:MASTER_PORT, made here. This
//    needs gloo's headers at build time, which the torch wheels do not ship
//    (SPILLWAY_GLOO_INCLUDE_DIR).
//  - FromProcessGroup(pg): the group `torch.distributed.init_process_group("gloo")` made, handed
//  over
//    by the Python module (spillway.engine). Needs only c10d's own headers, so it works with every
//    torch wheel; `torchrun` sets the same variables for it.
// World size 1 needs no process group. No home-made transport. Built with the torch half of the
// engine (SPILLWAY_WITH_TORCH).
//
// Where the collectives run: the pointer forms take host memory and run on the group's CPU backend
// (gloo). The tensor forms run on the backend of the tensors' device, so a group made with
// init_process_group("cpu:gloo,cuda:nccl") all-gathers and reduce-scatters CUDA tensors on NCCL
// (the trainer does this when it computes on a GPU, Note [Device collectives] in docs/engine.md)
// while the host-side sums (the gradient norm, the loss) stay on gloo.
#pragma once

#include <c10/core/DeviceType.h>
#include <c10/util/intrusive_ptr.h>

#include <cstdint>
#include <memory>
#include <string>

#include "spillway/base/status.h"

namespace at {
class Tensor;
}
namespace c10d {
class Backend;
class ProcessGroup;
}  // namespace c10d

namespace spillway::trainer {

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
  // Collectives over the backends of an existing c10d process group (kept alive while these
  // live): its CPU backend, which it must have, and its CUDA backend when it has one of its own
  // (NCCL; a "gloo" group's CPU backend also registers for CUDA and is not counted). A group of
  // size 1 is used as given (its collectives are copies made by the backend), so the device path
  // runs on a single GPU too. A null group, or one without a CPU backend (NCCL alone), is
  // INVALID_ARGUMENT naming it.
  static Result<std::unique_ptr<Collectives>> FromProcessGroup(
      c10::intrusive_ptr<c10d::ProcessGroup> pg);
  ~Collectives();
  Collectives(const Collectives&) = delete;
  Collectives& operator=(const Collectives&) = delete;

  int rank() const { return env_.rank; }
  int world_size() const { return env_.world_size; }
  // "single", the CPU backend's name ("gloo"), or both backends' ("cpu:gloo,cuda:nccl").
  const std::string& backend() const;
  // Whether the tensor forms can run on tensors of this device type (CPU: always; CUDA: when the
  // group has a CUDA backend).
  bool HasBackendFor(c10::DeviceType type) const;

  // full[r * shard_elems, (r + 1) * shard_elems) = rank r's shard.
  Status AllGather(const float* shard, uint64_t shard_elems, float* full);
  // shard = sum over ranks of their full[rank * shard_elems, ...).
  Status ReduceScatterSum(const float* full, uint64_t shard_elems, float* shard);
  // The same on contiguous fp32 tensors of one device; full has world_size * shard.numel()
  // elements. Mismatched sizes, dtypes or devices are INVALID_ARGUMENT; a device the group has
  // no backend for is FAILED_PRECONDITION naming the group to make. Asynchronous backends (NCCL)
  // return once the work is ordered before later work on the current stream, as c10d's wait().
  Status AllGather(const at::Tensor& shard, const at::Tensor& full);
  Status ReduceScatterSum(const at::Tensor& full, const at::Tensor& shard);
  Result<double> AllReduceSum(double value);
  Status Barrier();

 private:
  struct Impl;
  explicit Collectives(const DistEnv& env);
  // Checks full/shard (sizes, dtype, device) and returns the backend of their device; null where
  // the collective is a copy (world size 1, no group).
  Result<c10d::Backend*> BackendFor(const char* what, const at::Tensor& full,
                                    const at::Tensor& shard);
  DistEnv env_;
  std::unique_ptr<Impl> impl_;
};

}  // namespace spillway::trainer
