// StreamedStep. Note [Streamed step] in docs/engine.md.
#include "spillway/engine/streamed_step.h"

#include <atomic>
#include <future>
#include <system_error>
#include <vector>

#include "clock.h"

namespace spillway::engine {
namespace {

using offload::Access;
using offload::PartitionId;
using offload::PartitionStore;
using offload::Placement;

std::atomic<int> g_failing_launches{0};  // FailThreadLaunchesForTesting

// Starts `f` on its own thread. std::async throws std::system_error when no thread can be
// started (the process's thread limit): that becomes a status, never an exception.
template <typename F>
Status Launch(std::future<Status>* out, const char* what, F f) {
  try {
    if (g_failing_launches.load(std::memory_order_relaxed) > 0 &&
        g_failing_launches.fetch_sub(1, std::memory_order_relaxed) > 0) {
      throw std::system_error(std::make_error_code(std::errc::resource_unavailable_try_again),
                              "injected");
    }
    *out = std::async(std::launch::async, std::move(f));
    return Status::Ok();
  } catch (const std::system_error& e) {
    return Status::Make(StatusCode::kUnavailable,
                        StrCat("cannot start the streamed step's ", what, " thread (", e.what(),
                               "); raise the process's thread limit (ulimit -u, pids.max)"));
  }
}

std::vector<PartitionId> StateOf(const StreamedGroup& g) {
  return {g.master, g.exp_avg, g.exp_avg_sq};
}

// Writes an NVMe-homed group back and drops its host copies (host-homed ones stay).
Status WriteBack(PartitionStore& store, const StreamedGroup& g, uint64_t* evicted) {
  for (PartitionId id : StateOf(g)) {
    if (store.home(id) != Placement::kNvme) continue;
    Status st = store.Evict(id);
    if (!st.ok())
      return Status::Make(st.code(), StrCat("writing back ", g.name, ": ", st.message()),
                          st.sys_error());
    ++*evicted;
  }
  return Status::Ok();
}

Status Annotate(const Status& st, const StreamedGroup& g, size_t index, uint64_t step) {
  return Status::Make(
      st.code(),
      StrCat("streamed step ", step, " stopped at ", g.name, " (group ", index, "): ", st.message(),
             "; groups before it have step ", step, " applied, this one and those after it do not"),
      st.sys_error());
}

// Every group's three state partitions must hold its numel fp32 elements.
Status CheckGroups(const PartitionStore& store, std::span<const StreamedGroup> groups) {
  for (size_t i = 0; i < groups.size(); ++i) {
    const StreamedGroup& g = groups[i];
    for (PartitionId id : StateOf(g)) {
      const uint64_t bytes = store.bytes(id);
      if (bytes != g.numel * 4) {
        return Status::InvalidArgument(StrCat(
            g.name, " (group ", i, "): partition ", id,
            bytes == 0 ? std::string(" is not registered") : StrCat(" holds ", bytes, " bytes"),
            " but ", g.numel, " fp32 elements need ", g.numel * 4,
            "; register each state partition with numel * 4 bytes"));
      }
    }
  }
  return Status::Ok();
}

// The gradients' sum of squares over every group (they are host buffers, read once here), summed
// over the ranks by `reduce_sum` when there is one.
Result<double> GradSumOfSquares(HostOptimizer& optimizer, std::span<const StreamedGroup> groups,
                                const NormReducer& reduce_sum) {
  double sum = 0.0;
  for (const StreamedGroup& g : groups) {
    SubGroup view;
    view.name = g.name;
    view.numel = g.numel;
    view.grad = g.grad;
    view.grad_dtype = g.grad_dtype;
    SPILLWAY_ASSIGN_OR_RETURN(auto part, optimizer.SumOfSquares(view));
    sum += part;
  }
  if (reduce_sum) {
    SPILLWAY_ASSIGN_OR_RETURN(sum, reduce_sum(sum));
  }
  return sum;
}

// Applies the step to group `g` through its acquired state handles `h` (master, exp_avg,
// exp_avg_sq), then releases them. Returns the update's error, else the first release's.
Status UpdateGroup(HostOptimizer& optimizer, PartitionStore& store, const StreamedGroup& g,
                   const StepReport& plan, std::vector<offload::Handle>* h, StreamedStepStats* s) {
  SubGroup view;
  view.name = g.name;
  view.numel = g.numel;
  view.master = static_cast<float*>((*h)[0].data());
  view.exp_avg = static_cast<float*>((*h)[1].data());
  view.exp_avg_sq = static_cast<float*>((*h)[2].data());
  view.grad = g.grad;
  view.grad_dtype = g.grad_dtype;
  view.param = g.param;
  view.param_dtype = g.param_dtype;
  const uint64_t t0 = NowNs();
  Status st = optimizer.Update(view, plan);
  s->update_ns += NowNs() - t0;
  for (offload::Handle& v : *h) {
    Status rs = store.Release(v);
    if (st.ok() && !rs.ok()) st = rs;
  }
  return st;
}

// A failed write-back of group `failed`, found after group `last` was updated: groups up to
// `last` have the step; `failed` (and `last`) are still in host memory.
Status WriteBackFailed(const Status& st, uint64_t step, size_t failed, size_t last, size_t groups) {
  return Status::Make(
      st.code(),
      StrCat("streamed step ", step, ": ", st.message(), "; groups 0..", last,
             " have the step applied and group ", failed,
             "'s state is still in host memory (nothing lost): PartitionStore::Flush() retries",
             " the write",
             last + 1 < groups ? StrCat("; groups ", last + 1, ".. do not have the step")
                               : std::string()),
      st.sys_error());
}

}  // namespace

void FailThreadLaunchesForTesting(int n) { g_failing_launches.store(n, std::memory_order_relaxed); }

Result<StepReport> StreamedStep(HostOptimizer& optimizer, PartitionStore& store,
                                std::span<const StreamedGroup> groups, const StepOptions& options,
                                StreamedStepStats* stats, const NormReducer& reduce_sum) {
  StreamedStepStats local;
  StreamedStepStats& s = stats ? *stats : local;
  s = StreamedStepStats{};
  const uint64_t t_start = NowNs();
  SPILLWAY_RETURN_IF_ERROR(CheckGroups(store, groups));  // before anything moves
  SPILLWAY_ASSIGN_OR_RETURN(const double sum, GradSumOfSquares(optimizer, groups, reduce_sum));
  auto plan = optimizer.Plan(sum, options);
  if (!plan.ok() || plan->skipped) return plan;

  std::future<Status> reading;  // swap-in of group i + 1
  std::future<Status> writing;  // write-back of group i - 1
  uint64_t evicted = 0;         // written by the writer thread, read after it is joined
  auto finish_writes = [&]() -> Status {
    if (!writing.valid()) return Status::Ok();
    const uint64_t t0 = NowNs();
    Status st = writing.get();
    s.wait_write_ns += NowNs() - t0;
    return st;
  };
  // A failed read or update of group i: let the in-flight work finish, then report.
  auto fail = [&](const Status& st, size_t i) -> Status {
    if (reading.valid())
      reading.get().IgnoreError();  // a prefetch error resurfaces on the next Acquire
    Status w = finish_writes();
    Status out = Annotate(st, groups[i], i, plan->step);
    if (w.ok()) return out;
    return Status::Make(out.code(), StrCat(out.message(), "; also: ", w.message()),
                        out.sys_error());
  };
  // A failed write-back of group `failed`, found after group `last` was updated: groups up to
  // `last` have the step; `failed` (and `last`) are still in host memory.
  auto write_failed = [&](const Status& st, size_t failed, size_t last) -> Status {
    if (reading.valid()) reading.get().IgnoreError();
    return WriteBackFailed(st, plan->step, failed, last, groups.size());
  };

  for (size_t i = 0; i < groups.size(); ++i) {
    const StreamedGroup& g = groups[i];
    if (reading.valid()) {
      const uint64_t t0 = NowNs();
      Status st = reading.get();
      s.wait_read_ns += NowNs() - t0;
      if (!st.ok()) return fail(st, i);
    }
    if (i + 1 < groups.size()) {
      Status st = Launch(&reading, "reader",
                         [&store, ids = StateOf(groups[i + 1])] { return store.Prefetch(ids); });
      if (!st.ok()) return fail(st, i);
    }
    // Acquire group i (resident by now, or swapped in here) and update it.
    std::vector<offload::Handle> h;
    for (PartitionId id : StateOf(g)) {
      auto v = store.Acquire(id, Access::kReadWrite);
      if (!v.ok()) return fail(v.status(), i);
      h.push_back(std::move(*v));
    }
    Status st = UpdateGroup(optimizer, store, g, *plan, &h, &s);
    if (!st.ok()) return fail(st, i);
    ++s.groups;  // group i has the step (counted before its write-back, which may still fail)
    // Keep one write-back in flight: group i - 1 must be out before group i goes.
    Status ws = finish_writes();
    if (!ws.ok()) return write_failed(ws, i - 1, i);
    ws = Launch(&writing, "writer",
                [&store, &g, &evicted] { return WriteBack(store, g, &evicted); });
    if (!ws.ok()) return write_failed(ws, i, i);
  }
  Status ws = finish_writes();
  if (!ws.ok()) return write_failed(ws, groups.size() - 1, groups.size() - 1);
  s.evictions = evicted;
  s.total_ns = NowNs() - t_start;
  return plan;
}

}  // namespace spillway::engine
