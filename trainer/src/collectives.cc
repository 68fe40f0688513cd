// Collectives over c10d ProcessGroupGloo. See collectives.h.
#include "spillway/trainer/collectives.h"

#include <torch/torch.h>

#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include "torch_compat.h"

// The CPU wheel of torch ships ProcessGroupGloo.hpp but not the gloo headers it includes, so the
// Gloo path builds only where they are given (SPILLWAY_GLOO_INCLUDE_DIR, matching the gloo commit
// bundled in libtorch). Without them a world size above 1 is UNAVAILABLE and says so.
#if defined(SPILLWAY_HAVE_GLOO_HEADERS)
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>
#define SPILLWAY_GLOO 1
#else
#define SPILLWAY_GLOO 0
#endif

#include <cstdlib>

namespace spillway::trainer {
namespace {

Result<int> IntFromEnv(const char* name, int fallback, int lo, int hi) {
  const char* v = std::getenv(name);
  if (v == nullptr || *v == '\0') return fallback;
  char* end = nullptr;
  const long x = std::strtol(v, &end, 10);
  if (*end != '\0' || x < lo || x > hi) {
    return Status::InvalidArgument(StrCat("environment variable ", name, "='", v,
                                          "' is not an integer in [", lo, ", ", hi, "]"));
  }
  return static_cast<int>(x);
}

// c10d reports failures by throwing c10::Error; this is the boundary where they become statuses.
template <typename Fn>
Status Guard(const char* what, Fn fn) {
  try {
    fn();
    return Status::Ok();
  } catch (const std::exception& e) {
    return Status::Make(StatusCode::kUnavailable, StrCat(what, " failed: ", e.what()));
  }
}

}  // namespace

Result<DistEnv> DistEnvFromEnvironment() {
  DistEnv env;
  SPILLWAY_ASSIGN_OR_RETURN(auto world, IntFromEnv("WORLD_SIZE", 1, 1, 1 << 20));
  SPILLWAY_ASSIGN_OR_RETURN(auto rank, IntFromEnv("RANK", 0, 0, 1 << 20));
  SPILLWAY_ASSIGN_OR_RETURN(auto local, IntFromEnv("LOCAL_RANK", rank, 0, 1 << 20));
  SPILLWAY_ASSIGN_OR_RETURN(auto port, IntFromEnv("MASTER_PORT", 29500, 1, 65535));
  if (rank >= world) {
    return Status::InvalidArgument(
        StrCat("RANK=", rank, " is not below WORLD_SIZE=", world, "; ranks are 0 .. WORLD_SIZE-1"));
  }
  env.world_size = world;
  env.rank = rank;
  env.local_rank = local;
  env.master_port = port;
  if (const char* a = std::getenv("MASTER_ADDR"); a != nullptr && *a != '\0') env.master_addr = a;
  return env;
}

struct Collectives::Impl {
  c10::intrusive_ptr<c10d::Store> store;         // Create(env) only
  c10::intrusive_ptr<c10d::ProcessGroup> group;  // FromProcessGroup only
  c10::intrusive_ptr<c10d::Backend> cpu;         // null at world size 1 without a group
  c10::intrusive_ptr<c10d::Backend> cuda;        // FromProcessGroup, when the group has one
  std::string name = "single";
};

Collectives::Collectives(const DistEnv& env) : env_(env), impl_(std::make_unique<Impl>()) {}
Collectives::~Collectives() = default;

const std::string& Collectives::backend() const { return impl_->name; }

bool Collectives::HasBackendFor(c10::DeviceType type) const {
  if (type == c10::DeviceType::CPU) return true;
  return type == c10::DeviceType::CUDA && impl_->cuda;
}

Result<std::unique_ptr<Collectives>> Collectives::FromProcessGroup(
    c10::intrusive_ptr<c10d::ProcessGroup> pg) {
  if (!pg) return Status::InvalidArgument("FromProcessGroup: a null process group");
  DistEnv env;
  c10::intrusive_ptr<c10d::Backend> cpu, cuda;
  std::string name;
  Status st = Guard("reading the process group", [&] {
    env.rank = pg->getRank();
    env.world_size = pg->getSize();
    cpu = pg->getBackend(c10::DeviceType::CPU);
    cuda = torch_compat::BackendFor(*pg, c10::DeviceType::CUDA);
    // init_process_group("gloo") registers its one Gloo backend for CUDA as well; Gloo stages CUDA
    // tensors through the host, which the trainer's host path does better (into pinned memory), so
    // only a backend of the CUDA device's own (NCCL) counts as one.
    if (cuda && cuda.get() == cpu.get()) cuda.reset();
    // A backend that does not implement getBackendName throws: inside the boundary too.
    name = cuda ? StrCat("cpu:", cpu->getBackendName(), ",cuda:", cuda->getBackendName())
                : cpu->getBackendName();
  });
  if (!st.ok()) {
    return Status::InvalidArgument(StrCat(
        st.message(), "; the trainer's shards are host memory, so the group needs a CPU backend: ",
        "init_process_group(\"gloo\") or (\"cpu:gloo,cuda:nccl\")"));
  }
  std::unique_ptr<Collectives> c(new Collectives(env));
  c->impl_->group = std::move(pg);
  c->impl_->name = std::move(name);
  c->impl_->cpu = std::move(cpu);
  c->impl_->cuda = std::move(cuda);
  return c;
}

Result<std::unique_ptr<Collectives>> Collectives::Create(const DistEnv& env) {
  if (env.world_size < 1 || env.rank < 0 || env.rank >= env.world_size) {
    return Status::InvalidArgument(StrCat("rank ", env.rank, " of world size ", env.world_size,
                                          " is impossible; ranks are 0 .. world_size-1"));
  }
  std::unique_ptr<Collectives> c(new Collectives(env));
  if (env.world_size == 1) return c;
#if !SPILLWAY_GLOO
  return Status::Make(
      StatusCode::kUnavailable,
      StrCat("world size ", env.world_size,
             " needs c10d's ProcessGroupGloo, but this build has no ",
             "gloo headers (the torch CPU wheel does not ship them); configure with ",
             "-DSPILLWAY_GLOO_INCLUDE_DIR=<gloo headers of the commit bundled in libtorch>, run ",
             "the trainer on torch.distributed's Gloo group through Python (torchrun -m "
             "spillway.engine), ",
             "or run with WORLD_SIZE=1"));
#else
  Status st = Guard("creating the Gloo process group", [&] {
    c10d::TCPStoreOptions so;
    so.port = static_cast<uint16_t>(env.master_port);
    so.isServer = env.rank == 0;
    so.numWorkers = static_cast<size_t>(env.world_size);
    so.timeout = std::chrono::seconds(env.timeout_seconds);
    c->impl_->store = c10::make_intrusive<c10d::TCPStore>(env.master_addr, so);
    auto opts = c10d::ProcessGroupGloo::Options::create();
    opts->timeout = std::chrono::seconds(env.timeout_seconds);
    opts->devices.push_back(c10d::ProcessGroupGloo::createDeviceForHostname(env.master_addr));
    c->impl_->cpu = c10::make_intrusive<c10d::ProcessGroupGloo>(c->impl_->store, env.rank,
                                                                env.world_size, opts);
    c->impl_->name = "gloo";
  });
  if (!st.ok()) {
    return Status::Make(
        st.code(), StrCat(st.message(), " (rank ", env.rank, " of ", env.world_size, ", store ",
                          env.master_addr, ":", env.master_port,
                          "; check MASTER_ADDR/MASTER_PORT and that every rank started)"));
  }
  return c;
#endif
}

namespace {
torch::Tensor View(const float* p, uint64_t n) {
  return torch::from_blob(const_cast<float*>(p), {static_cast<int64_t>(n)}, torch::kFloat32);
}

// The shapes every collective here needs: contiguous fp32 on one device, big == world * small.
Status CheckPair(const char* what, const char* big_name, const torch::Tensor& big,
                 const char* small_name, const torch::Tensor& small, int64_t world) {
  for (const torch::Tensor* t : {&big, &small}) {
    if (!t->defined() || t->scalar_type() != torch::kFloat32 || !t->is_contiguous()) {
      return Status::InvalidArgument(StrCat(what, ": ", t == &big ? big_name : small_name,
                                            " must be a defined, contiguous float32 tensor"));
    }
  }
  if (big.device() != small.device()) {
    return Status::InvalidArgument(StrCat(what, ": ", big_name, " is on ", big.device().str(),
                                          " and ", small_name, " on ", small.device().str(),
                                          "; both must be on the same device"));
  }
  if (big.numel() != small.numel() * world) {
    return Status::InvalidArgument(StrCat(what, ": ", big_name, " has ", big.numel(), " elements, ",
                                          small_name, " ", small.numel(), "; ", big_name,
                                          " must be world size (", world, ") times ", small_name));
  }
  return Status::Ok();
}
}  // namespace

Result<c10d::Backend*> Collectives::BackendFor(const char* what, const torch::Tensor& full,
                                               const torch::Tensor& shard) {
  SPILLWAY_RETURN_IF_ERROR(CheckPair(what, "full", full, "shard", shard, env_.world_size));
  const c10::Device device = shard.device();
  if (device.is_cpu()) return impl_->cpu.get();  // null: world size 1 without a group
  if (device.is_cuda() && impl_->cuda) return impl_->cuda.get();
  return Status::FailedPrecondition(
      StrCat(what, " on ", device.str(), " tensors, but the process group (", impl_->name,
             ") has no backend for ", c10::DeviceTypeName(device.type()), "; make it with ",
             "init_process_group(\"cpu:gloo,cuda:nccl\") to run collectives on the GPU, or pass "
             "host tensors"));
}

Status Collectives::AllGather(const torch::Tensor& shard, const torch::Tensor& full) {
  SPILLWAY_ASSIGN_OR_RETURN(auto b, BackendFor("all-gather", full, shard));
  if (b == nullptr) {
    if (full.data_ptr() != shard.data_ptr()) full.copy_(shard);
    return Status::Ok();
  }
  return Guard("all-gather", [&] {
    torch::Tensor out = full, in = shard;  // the c10d API takes non-const references
    b->_allgather_base(out, in)->wait();
  });
}

Status Collectives::ReduceScatterSum(const torch::Tensor& full, const torch::Tensor& shard) {
  SPILLWAY_ASSIGN_OR_RETURN(auto b, BackendFor("reduce-scatter", full, shard));
  if (b == nullptr) {
    if (full.data_ptr() != shard.data_ptr()) shard.copy_(full);
    return Status::Ok();
  }
  return Guard("reduce-scatter", [&] {
    torch::Tensor out = shard, in = full;
    c10d::ReduceScatterOptions o;
    o.reduceOp = c10d::ReduceOp::SUM;
    b->_reduce_scatter_base(out, in, o)->wait();
  });
}

Status Collectives::AllGather(const float* shard, uint64_t shard_elems, float* full) {
  return AllGather(View(shard, shard_elems), View(full, shard_elems * env_.world_size));
}

Status Collectives::ReduceScatterSum(const float* full, uint64_t shard_elems, float* shard) {
  return ReduceScatterSum(View(full, shard_elems * env_.world_size), View(shard, shard_elems));
}

Result<double> Collectives::AllReduceSum(double value) {
  if (!impl_->cpu) return value;
  double v = value;
  Status st = Guard("all-reduce", [&] {
    std::vector<torch::Tensor> t = {torch::from_blob(&v, {1}, torch::kFloat64)};
    impl_->cpu->allreduce(t)->wait();
  });
  if (!st.ok()) return st;
  return v;
}

Status Collectives::Barrier() {
  if (!impl_->cpu) return Status::Ok();
  return Guard("barrier", [&] { impl_->cpu->barrier()->wait(); });
}

}  // namespace spillway::trainer
