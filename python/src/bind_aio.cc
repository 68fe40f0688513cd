// spillway._spillway's bindings of spillway::aio: spillway.aio_handle (aio::AioHandle, DeepSpeed's
// aio_handle contract on Spillway's I/O engine; Note [aio_handle] in docs/aio.md) and _SwapStore
// (aio::SwapStore, DeepSpeed's swap files in Spillway's NVMe arena; Note [DeepSpeed swap] in
// docs/deepspeed.md). They turn tensors into buffers (checked with the GIL held), release the GIL
// around every transfer and wait, and keep the pinned tensors of new_cpu_locked_tensor.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>
#include <torch/extension.h>

#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <utility>

#include "bindings.h"
#include "errors.h"
#include "spillway/aio/aio_handle.h"
#include "spillway/aio/swap_store.h"
#include "spillway/allocator/io_engine.h"
#include "spillway/allocator/nvme_arena.h"
#include "spillway/metrics/exporter.h"
#include "spillway/torch_alloc/shared_arena.h"
#include "spillway/torch_alloc/tensors.h"

namespace py = pybind11;

namespace spillway::python {
namespace {

// A contiguous CPU tensor's bytes, or InvalidArgument naming what is wrong with it. The buffer
// holds a reference to the tensor until its op has been waited for.
Result<aio::AioBuffer> TensorBuffer(const torch::Tensor& t, const char* what) {
  if (!t.defined()) return Status::InvalidArgument(StrCat(what, ": an undefined tensor"));
  if (!t.device().is_cpu()) {
    return Status::InvalidArgument(
        StrCat(what, ": the tensor is on ", t.device().str(),
               "; aio transfers need a CPU tensor (copy it with .cpu())"));
  }
  if (!t.is_contiguous()) {
    return Status::InvalidArgument(
        StrCat(what, ": the tensor is not contiguous; pass t.contiguous()"));
  }
  return aio::AioBuffer{t.data_ptr(), static_cast<uint64_t>(t.numel()) * t.element_size(),
                        std::make_shared<const torch::Tensor>(t)};
}

std::pair<void*, uint64_t> SwapBytes(const torch::Tensor& t, const std::string& path) {
  if (!t.device().is_cpu() || !t.is_contiguous() || t.nbytes() == 0) {
    Raise(Status::InvalidArgument(StrCat("DeepSpeed swap file ", path,
                                         ": the buffer must be a non-empty contiguous CPU "
                                         "tensor")));
  }
  return {t.data_ptr(), static_cast<uint64_t>(t.nbytes())};
}

// The store and the host arena whose ledger it books on and whose bounce buffers its engine (the
// aio handle's) uses (declared first: outlives the store and the engine it keeps).
struct PySwapStore {
  std::shared_ptr<torch_alloc::SharedArena> host;
  std::shared_ptr<aio::SwapStore> store;
};

// Thread-safe. Entry points validate their tensors with the GIL held, then release it before any
// call into the handle, so a thread holding the handle's lock never waits for the GIL.
class PyAioHandle {
 public:
  PyAioHandle(uint64_t block_size, int queue_depth, bool single_submit, bool overlap_events,
              int intra_op_parallelism, std::shared_ptr<torch_alloc::SharedArena> arena,
              const std::string& backend, uint32_t bounce_buffers)
      : arena_(std::move(arena)) {
    aio::AioHandleOptions o;
    o.block_size = block_size;
    o.queue_depth = queue_depth;
    o.single_submit = single_submit;
    o.overlap_events = overlap_events;
    o.intra_op_parallelism = intra_op_parallelism;
    o.arena = arena_->get();
    o.backend = backend;
    o.bounce_buffers = bounce_buffers;
    handle_ = Check(aio::AioHandle::Create(o));
  }
  ~PyAioHandle() {
    if (!handle_->CheckProcess().ok()) {
      // A forked child: the locked tensors are the parent's arena memory (Note [Fork]); the
      // handle leaves the parent's ring, threads and files alone itself.
      new std::map<const void*, c10::Storage>(std::move(locked_));
      return;
    }
    py::gil_scoped_release nogil;
    handle_.reset();  // waits for the ops in flight
  }

  void Close() {
    Check(handle_->CheckProcess());
    Status st;
    {
      py::gil_scoped_release nogil;
      st = handle_->Close();
    }
    Check(st);  // with the GIL: raising builds a Python exception
  }

  uint64_t block_size() const { return handle_->block_size(); }
  int queue_depth() const { return handle_->queue_depth(); }
  bool single_submit() const { return handle_->single_submit(); }
  bool overlap_events() const { return handle_->overlap_events(); }
  int intra_op_parallelism() const { return handle_->intra_op_parallelism(); }
  int alignment() const { return handle_->alignment(); }
  std::string last_error() {
    Check(handle_->CheckProcess());
    Result<std::string> r = std::string();
    {
      py::gil_scoped_release nogil;
      r = handle_->last_error();
    }
    return Check(std::move(r));
  }

  // DeepSpeed's read/write: one op, on its own (its pending async ops are left to wait()).
  int Read(const torch::Tensor& b, const std::string& f, bool validate, int64_t off) {
    return Transfer(b, false, f, -1, off, false, aio::AioMode::kAlone, validate) < 0 ? -1 : 0;
  }
  int Write(const torch::Tensor& b, const std::string& f, bool validate, int64_t off) {
    return Transfer(b, false, f, -1, off, true, aio::AioMode::kAlone, validate) < 0 ? -1 : 0;
  }
  // pread/pwrite, and sync_pread/sync_pwrite (async false): as DeepSpeed's, a sync call schedules
  // its op and then waits like wait(), for the async ops before it too, and returns how many ops
  // completed.
  int Pread(const torch::Tensor& b, const std::string& f, bool validate, bool async, int64_t off) {
    return Transfer(b, false, f, -1, off, false, async ? aio::AioMode::kAsync : aio::AioMode::kSync,
                    validate);
  }
  int Pwrite(const torch::Tensor& b, const std::string& f, bool validate, bool async, int64_t off) {
    return Transfer(b, false, f, -1, off, true, async ? aio::AioMode::kAsync : aio::AioMode::kSync,
                    validate);
  }
  int PwriteFd(const torch::Tensor& b, int fd, int64_t off) {
    return Transfer(b, true, "", fd, off, true, aio::AioMode::kAsync, false);
  }
  int PreadFd(const torch::Tensor& b, int fd, int64_t off) {
    return Transfer(b, true, "", fd, off, false, aio::AioMode::kAsync, false);
  }

  // An op on DeepSpeed's swap file `path` in `s` (spillway.deepspeed's swap routing): async, or
  // sync as pread/pwrite with async false. A failed swap raises (it names the file).
  int Swap(const torch::Tensor& b, const std::shared_ptr<PySwapStore>& s, const std::string& path,
           bool write, const std::string& kind, bool async) {
    Check(handle_->CheckProcess());
    const allocator::Kind k = Check(allocator::ParseKind(kind));
    const auto [ptr, bytes] = SwapBytes(b, path);
    // The op keeps the tensor and the store's wrapper (and with it the arena the store books on
    // and its engine bounces through) until it is waited for.
    aio::AioBuffer buffer{
        ptr, bytes,
        std::make_shared<const std::pair<torch::Tensor, std::shared_ptr<PySwapStore>>>(b, s)};
    Result<int> r = 0;
    {
      py::gil_scoped_release nogil;
      r = handle_->SubmitSwap(std::move(buffer), s->store, path, write, k,
                              async ? aio::AioMode::kAsync : aio::AioMode::kSync);
    }
    return Check(std::move(r));
  }

  // A swap store for DeepSpeed's nvme_path `directory` on this handle's engine, booked in its
  // arena's ledger.
  std::shared_ptr<PySwapStore> MakeSwapStore(const std::string& directory, uint64_t budget_bytes) {
    Check(handle_->CheckProcess());
    aio::SwapStoreOptions o;
    o.directory = directory;
    o.budget_bytes = budget_bytes;
    o.engine = Check(handle_->engine());
    o.ledger = &arena_->ledger();  // install()'s ledger: its boundaries see the store
    auto made = std::make_shared<PySwapStore>();
    made->host = arena_;
    Result<std::unique_ptr<aio::SwapStore>> store = [&] {
      py::gil_scoped_release nogil;  // the swap file is made and sized: syscalls
      return aio::SwapStore::Create(o);
    }();
    made->store = Check(std::move(store));
    return made;
  }

  int Wait() {
    Check(handle_->CheckProcess());
    Result<int> r = 0;
    {
      py::gil_scoped_release nogil;
      r = handle_->Wait();
    }
    return Check(std::move(r));
  }

  torch::Tensor NewLockedTensor(int64_t num_elem, const torch::Tensor& example) {
    Check(handle_->CheckProcess());
    if (num_elem < 0)
      Raise(Status::InvalidArgument(StrCat("new_cpu_locked_tensor: num_elem ", num_elem, " < 0")));
    const allocator::OwnerTag tag{allocator::Kind::kSwapBuffer, allocator::Lifetime::kPersistent, 0,
                                  allocator::kProcessScope, "python"};
    Result<torch::Tensor> made = [&] {
      py::gil_scoped_release nogil;  // mapping and pinning a region are syscalls
      return torch_alloc::EmptyTensor(arena_, {num_elem}, example.scalar_type(), tag);
    }();
    torch::Tensor t = Check(std::move(made));
    py::gil_scoped_release nogil;
    std::lock_guard<std::mutex> lock(mu_);
    locked_[t.storage().data()] = t.storage();
    return t;
  }
  bool FreeLockedTensor(const torch::Tensor& t) {
    Check(handle_->CheckProcess());
    if (!t.defined() || !t.device().is_cpu()) return false;
    py::gil_scoped_release nogil;
    c10::Storage dropped;  // released after the lock (its deleter may free arena memory)
    std::lock_guard<std::mutex> lock(mu_);
    auto it = locked_.find(t.storage().data());
    if (it == locked_.end()) return false;
    dropped = std::move(it->second);
    locked_.erase(it);
    return true;
  }
  // Page-locked: memory of this handle's arena when that arena pins (not a pageable one), or memory
  // torch itself reports as pinned.
  bool IsPinned(const torch::Tensor& t) const {
    Check(handle_->CheckProcess());
    const bool arena_pins = arena_->get()->pin_mode() != allocator::PinMode::kPageable;
    return (arena_pins && torch_alloc::ArenaOwns(*arena_, t)) || (t.defined() && t.is_pinned());
  }

 private:
  // `fd_op`: an op on the caller's descriptor `fd` (always async), else on the file `filename`
  // names.
  int Transfer(const torch::Tensor& buffer, bool fd_op, const std::string& filename, int fd,
               int64_t offset, bool write, aio::AioMode mode, bool validate) {
    (void)validate;  // DeepSpeed's validate re-reads with pread in its tests only
    Check(handle_->CheckProcess());
    aio::AioBuffer b = Check(TensorBuffer(buffer, write ? "aio write" : "aio read"));
    Result<int> r = 0;
    {
      py::gil_scoped_release nogil;
      r = fd_op ? handle_->SubmitFd(std::move(b), fd, offset, write)
                : handle_->Submit(std::move(b), filename, offset, write, mode);
    }
    return Check(std::move(r));
  }

  const std::shared_ptr<torch_alloc::SharedArena>
      arena_;  // declared first: the engine's arena outlives the handle
  std::unique_ptr<aio::AioHandle> handle_;
  std::mutex mu_;
  std::map<const void*, c10::Storage> locked_;  // guarded by mu_
};

}  // namespace

static void BindAioHandle(py::module_& m) {
  py::class_<PyAioHandle>(m, "aio_handle")
      .def(py::init([](uint64_t bs, int qd, bool ss, bool oe, int iop,
                       std::shared_ptr<torch_alloc::SharedArena> arena, const std::string& backend,
                       int64_t bounce_buffers) {
             // Taken as int64 so that a negative count is refused by name, as Create refuses 0.
             if (bounce_buffers < 1 || bounce_buffers > allocator::kMaxBounceBuffers) {
               Raise(Status::InvalidArgument(StrCat("aio_handle(bounce_buffers=", bounce_buffers,
                                                    "): use 1..", allocator::kMaxBounceBuffers)));
             }
             return std::make_unique<PyAioHandle>(bs, qd, ss, oe, iop,
                                                  ArenaOrDefault(std::move(arena)), backend,
                                                  static_cast<uint32_t>(bounce_buffers));
           }),
           py::arg("block_size") = 1048576, py::arg("queue_depth") = 128,
           py::arg("single_submit") = false, py::arg("overlap_events") = false,
           py::arg("intra_op_parallelism") = 1, py::arg("arena") = nullptr,
           py::arg("backend") = "auto", py::arg("bounce_buffers") = 8)
      .def("get_block_size", &PyAioHandle::block_size)
      .def("get_queue_depth", &PyAioHandle::queue_depth)
      .def("get_single_submit", &PyAioHandle::single_submit)
      .def("get_overlap_events", &PyAioHandle::overlap_events)
      .def("get_intra_op_parallelism", &PyAioHandle::intra_op_parallelism)
      .def("get_alignment", &PyAioHandle::alignment)
      .def("get_last_error", &PyAioHandle::last_error)
      .def("read", &PyAioHandle::Read, py::arg("buffer"), py::arg("filename"), py::arg("validate"),
           py::arg("file_offset") = 0)
      .def("write", &PyAioHandle::Write, py::arg("buffer"), py::arg("filename"),
           py::arg("validate"), py::arg("file_offset") = 0)
      // DeepSpeed names the flag "async", which Python source cannot pass by keyword and which
      // makes a stub a syntax error for type checkers: "async_", passed by position as DeepSpeed
      // passes it.
      .def("pread", &PyAioHandle::Pread, py::arg("buffer"), py::arg("filename"),
           py::arg("validate"), py::arg("async_"), py::arg("file_offset") = 0)
      .def("pwrite", &PyAioHandle::Pwrite, py::arg("buffer"), py::arg("filename"),
           py::arg("validate"), py::arg("async_"), py::arg("file_offset") = 0)
      .def(
          "sync_pread",
          [](PyAioHandle& h, const torch::Tensor& b, const std::string& f, int64_t o) {
            return h.Pread(b, f, false, false, o);
          },
          py::arg("buffer"), py::arg("filename"), py::arg("file_offset") = 0)
      .def(
          "sync_pwrite",
          [](PyAioHandle& h, const torch::Tensor& b, const std::string& f, int64_t o) {
            return h.Pwrite(b, f, false, false, o);
          },
          py::arg("buffer"), py::arg("filename"), py::arg("file_offset") = 0)
      .def(
          "async_pread",
          [](PyAioHandle& h, const torch::Tensor& b, const std::string& f, int64_t o) {
            return h.Pread(b, f, false, true, o);
          },
          py::arg("buffer"), py::arg("filename"), py::arg("file_offset") = 0)
      .def(
          "async_pwrite",
          [](PyAioHandle& h, const torch::Tensor& b, const std::string& f, int64_t o) {
            return h.Pwrite(b, f, false, true, o);
          },
          py::arg("buffer"), py::arg("filename"), py::arg("file_offset") = 0)
      .def("async_pwrite", &PyAioHandle::PwriteFd, py::arg("buffer"), py::arg("fd"),
           py::arg("file_offset") = 0)
      .def("async_pread", &PyAioHandle::PreadFd, py::arg("buffer"), py::arg("fd"),
           py::arg("file_offset") = 0)
      .def("wait", &PyAioHandle::Wait)
      .def("_swap", &PyAioHandle::Swap, py::arg("buffer"), py::arg("store"), py::arg("path"),
           py::arg("write"), py::arg("kind"), py::arg("async_"))
      .def("_swap_store", &PyAioHandle::MakeSwapStore, py::arg("directory"),
           py::arg("budget_bytes"))
      .def("new_cpu_locked_tensor", &PyAioHandle::NewLockedTensor, py::arg("num_elem"),
           py::arg("example_tensor"))
      .def("free_cpu_locked_tensor", &PyAioHandle::FreeLockedTensor)
      .def("is_pinned", &PyAioHandle::IsPinned)
      .def("close", &PyAioHandle::Close);
}

namespace {

py::dict SwapStats(const PySwapStore& s) {
  const allocator::NvmeArenaStats st = s.store->arena().Stats();
  py::dict d;
  d["arena"] = s.store->arena().tier_name();
  d["files"] = s.store->files();
  d["live_bytes"] = st.live_bytes;
  d["capacity_bytes"] = st.capacity_bytes;
  d["budget_bytes"] = st.budget_bytes;
  d["written_bytes"] = st.written_bytes;
  d["read_bytes"] = st.read_bytes;
  d["checksum"] = st.checksum;
  d["checksum_failures"] = st.checksum_failures;
  d["direct_io"] = st.direct_io;
  d["live_by_kind"] = KindBytesDict(st.live_by_kind);
  return d;
}

}  // namespace

static void BindSwapStore(py::module_& m) {
  py::class_<PySwapStore, std::shared_ptr<PySwapStore>>(m, "_SwapStore")
      .def("write",
           [](PySwapStore& s, const std::string& path, const torch::Tensor& t,
              const std::string& kind) {
             const allocator::Kind k = Check(allocator::ParseKind(kind));
             const auto [ptr, bytes] = SwapBytes(t, path);
             Status st;
             {
               py::gil_scoped_release nogil;
               st = s.store->Write(path, ptr, bytes, k);
             }
             Check(st);
           })
      .def("read",
           [](PySwapStore& s, const std::string& path, torch::Tensor& t) {
             const auto [ptr, bytes] = SwapBytes(t, path);
             Status st;
             {
               py::gil_scoped_release nogil;
               st = s.store->Read(path, ptr, bytes);
             }
             Check(st);
           })
      .def("contains",
           [](const PySwapStore& s, const std::string& p) { return s.store->Contains(p); })
      .def("size", [](const PySwapStore& s, const std::string& p) { return s.store->Size(p); })
      .def("paths", [](const PySwapStore& s, const std::string& p) { return s.store->Paths(p); })
      .def("remove", [](PySwapStore& s, const std::string& p) { return Check(s.store->Remove(p)); })
      .def("stats", &SwapStats)
      // The exporter keeps the store alive: it holds the arena's address until it is destroyed.
      .def(
          "_watched_by",
          [](const PySwapStore& s, metrics::Exporter& e) { e.Watch(&s.store->arena()); },
          py::keep_alive<2, 1>())
      .def("_corrupt_for_testing", [](PySwapStore& s, const std::string& path, uint64_t byte) {
        Check(s.store->CorruptForTesting(path, byte));
      });
}

void BindAio(py::module_& m) {
  BindAioHandle(m);
  BindSwapStore(m);
}

}  // namespace spillway::python
