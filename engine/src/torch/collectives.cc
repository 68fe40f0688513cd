// Collectives over c10d ProcessGroupGloo. See collectives.h.
#include "spillway/engine/collectives.h"

#include <torch/torch.h>

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
#include <cstring>

namespace spillway::engine {
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
  auto world = IntFromEnv("WORLD_SIZE", 1, 1, 1 << 20);
  if (!world.ok()) return world.status();
  auto rank = IntFromEnv("RANK", 0, 0, 1 << 20);
  if (!rank.ok()) return rank.status();
  auto local = IntFromEnv("LOCAL_RANK", *rank, 0, 1 << 20);
  if (!local.ok()) return local.status();
  auto port = IntFromEnv("MASTER_PORT", 29500, 1, 65535);
  if (!port.ok()) return port.status();
  if (*rank >= *world) {
    return Status::InvalidArgument(StrCat("RANK=", *rank, " is not below WORLD_SIZE=", *world,
                                          "; ranks are 0 .. WORLD_SIZE-1"));
  }
  env.world_size = *world;
  env.rank = *rank;
  env.local_rank = *local;
  env.master_port = *port;
  if (const char* a = std::getenv("MASTER_ADDR"); a != nullptr && *a != '\0') env.master_addr = a;
  return env;
}

struct Collectives::Impl {
#if SPILLWAY_GLOO
  c10::intrusive_ptr<c10d::Store> store;
  c10::intrusive_ptr<c10d::ProcessGroupGloo> pg;
#else
  bool pg = false;
#endif
};

Collectives::Collectives(const DistEnv& env) : env_(env), impl_(std::make_unique<Impl>()) {}
Collectives::~Collectives() = default;

const char* Collectives::backend() const { return impl_->pg ? "gloo" : "single"; }

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
      StrCat("world size ", env.world_size, " needs c10d's ProcessGroupGloo, but this build has no ",
             "gloo headers (the torch CPU wheel does not ship them); configure with ",
             "-DSPILLWAY_GLOO_INCLUDE_DIR=<gloo headers of the commit bundled in libtorch>, or run ",
             "with WORLD_SIZE=1"));
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
    c->impl_->pg = c10::make_intrusive<c10d::ProcessGroupGloo>(c->impl_->store, env.rank,
                                                               env.world_size, opts);
  });
  if (!st.ok()) {
    return Status::Make(st.code(), StrCat(st.message(), " (rank ", env.rank, " of ", env.world_size,
                                          ", store ", env.master_addr, ":", env.master_port,
                                          "; check MASTER_ADDR/MASTER_PORT and that every rank started)"));
  }
  return c;
#endif
}

#if SPILLWAY_GLOO
namespace {
torch::Tensor View(const float* p, uint64_t n) {
  return torch::from_blob(const_cast<float*>(p), {static_cast<int64_t>(n)}, torch::kFloat32);
}
}  // namespace
#endif

Status Collectives::AllGather(const float* shard, uint64_t shard_elems, float* full) {
  if (!impl_->pg) {
    if (full != shard) std::memcpy(full, shard, shard_elems * 4);
    return Status::Ok();
  }
#if SPILLWAY_GLOO
  return Guard("all-gather", [&] {
    torch::Tensor out = View(full, shard_elems * env_.world_size);
    torch::Tensor in = View(shard, shard_elems);
    impl_->pg->_allgather_base(out, in)->wait();
  });
#else
  return Status::Internal("unreachable: no process group without gloo");
#endif
}

Status Collectives::ReduceScatterSum(const float* full, uint64_t shard_elems, float* shard) {
  if (!impl_->pg) {
    if (full != shard) std::memcpy(shard, full, shard_elems * 4);
    return Status::Ok();
  }
#if SPILLWAY_GLOO
  return Guard("reduce-scatter", [&] {
    torch::Tensor out = View(shard, shard_elems);
    torch::Tensor in = View(full, shard_elems * env_.world_size);
    c10d::ReduceScatterOptions o;
    o.reduceOp = c10d::ReduceOp::SUM;
    impl_->pg->_reduce_scatter_base(out, in, o)->wait();
  });
#else
  return Status::Internal("unreachable: no process group without gloo");
#endif
}

Result<double> Collectives::AllReduceSum(double value) {
  if (!impl_->pg) return value;
#if SPILLWAY_GLOO
  double v = value;
  Status st = Guard("all-reduce", [&] {
    std::vector<torch::Tensor> t = {torch::from_blob(&v, {1}, torch::kFloat64)};
    impl_->pg->allreduce(t)->wait();
  });
  if (!st.ok()) return st;
  return v;
#else
  return Status::Internal("unreachable: no process group without gloo");
#endif
}

Status Collectives::Barrier() {
  if (!impl_->pg) return Status::Ok();
#if SPILLWAY_GLOO
  return Guard("barrier", [&] { impl_->pg->barrier()->wait(); });
#else
  return Status::Internal("unreachable: no process group without gloo");
#endif
}

}  // namespace spillway::engine
