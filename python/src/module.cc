// The `spillway._spillway` extension: Spillway's host arena and io_uring engine for Python, and an
// aio_handle with DeepSpeed's contract (docs/python.md, Note [aio_handle]). Pure-Python parts
// (exceptions, spillway.deepspeed, spillway.metrics) live in python/spillway/.
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <pybind11/pybind11.h>
#include <pybind11/stl.h>
#include <torch/extension.h>

#include <cerrno>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "spillway/allocator/host_arena.h"
#include "spillway/allocator/ledger.h"
#include "spillway/allocator/log.h"
#include "spillway/allocator/uring_engine.h"
#include "spillway/metrics/exporter.h"
#include "errors.h"
#include "py_arena.h"
#include "torch_allocators.h"

namespace py = pybind11;
using namespace spillway;
using allocator::HostArena;
using python::Check;
using python::PyArena;
using python::ExceptionTypes;
using python::Raise;

namespace {

// A contiguous CPU tensor's bytes, or InvalidArgument naming what is wrong with it.
Result<std::pair<void*, uint64_t>> TensorBytes(const torch::Tensor& t, const char* what) {
  if (!t.defined()) return Status::InvalidArgument(StrCat(what, ": an undefined tensor"));
  if (!t.device().is_cpu()) {
    return Status::InvalidArgument(StrCat(what, ": the tensor is on ", t.device().str(),
                                          "; aio transfers need a CPU tensor (copy it with .cpu())"));
  }
  if (!t.is_contiguous()) {
    return Status::InvalidArgument(StrCat(what, ": the tensor is not contiguous; pass t.contiguous()"));
  }
  return std::make_pair(t.data_ptr(), static_cast<uint64_t>(t.numel()) * t.element_size());
}

py::dict ArenaStats(PyArena& a) {
  const allocator::HostArenaStats s = a.get()->Stats();
  py::dict d;
  d["name"] = a.name();
  d["pin_mode"] = allocator::PinModeName(s.pin_mode);
  d["fork_safety"] = allocator::ForkSafetyName(s.fork_safety);
  d["budget_bytes"] = s.budget_bytes;
  d["live_bytes"] = s.live_bytes;
  d["live_allocations"] = s.live_allocations;
  py::dict by_kind;
  for (int k = 0; k < allocator::kKindCount; ++k) {
    by_kind[allocator::KindName(static_cast<allocator::Kind>(k))] = s.live_by_kind[k];
  }
  d["live_by_kind"] = by_kind;
  d["committed_bytes"] = s.committed_bytes;
  d["peak_committed_bytes"] = s.peak_committed_bytes;
  d["retained_bytes"] = s.retained_bytes;
  d["pinned_bytes"] = s.pinned_bytes;
  d["regions"] = s.regions;
  d["over_budget_count"] = s.over_budget_count;
  d["escape_count"] = s.escape_count;
  return d;
}

py::dict ReportToDict(const allocator::BoundaryReport& r) {
  py::dict d;
  d["kind"] = r.kind == allocator::BoundaryKind::kEpoch ? "epoch" : "step";
  d["epoch"] = r.epoch;
  d["step"] = r.step;
  d["live_bytes"] = r.live_bytes();
  d["escape_count"] = r.escape_count();
  d["escaped_bytes"] = r.escaped_bytes();
  d["clean"] = r.clean();
  d["text"] = r.ToString();
  return d;
}

// ---- aio_handle: Note [aio_handle] in docs/python.md ----

class AioHandle {
 public:
  AioHandle(uint64_t block_size, int queue_depth, bool single_submit, bool overlap_events,
            int intra_op_parallelism, std::shared_ptr<PyArena> arena)
      : block_size_(block_size), queue_depth_(queue_depth), single_submit_(single_submit),
        overlap_events_(overlap_events), intra_op_(intra_op_parallelism), arena_(std::move(arena)) {
    if (block_size == 0 || queue_depth <= 0 || intra_op_parallelism <= 0) {
      Raise(Status::InvalidArgument(StrCat("aio_handle(block_size=", block_size, ", queue_depth=", queue_depth,
                                           ", intra_op_parallelism=", intra_op_parallelism,
                                           "): each must be positive")));
    }
    allocator::UringEngineOptions eo;
    eo.arena = arena_->get();
    eo.block_size = block_size;
    eo.queue_depth = static_cast<uint32_t>(queue_depth);
    engine_ = Check(allocator::UringEngine::Create(eo));
  }
  ~AioHandle() { Close(); }

  void Close() {
    if (engine_ == nullptr) return;
    {
      py::gil_scoped_release nogil;
      (void)engine_->WaitAll();
      for (auto& [key, f] : files_) {
        (void)engine_->UnregisterFile(f.id);
        if (f.owned) ::close(f.fd);
      }
      engine_.reset();
    }
    files_.clear();
    pending_.clear();
  }

  uint64_t block_size() const { return block_size_; }
  int queue_depth() const { return queue_depth_; }
  bool single_submit() const { return single_submit_; }
  bool overlap_events() const { return overlap_events_; }
  int intra_op_parallelism() const { return intra_op_; }
  int alignment() const { return intra_op_ * 512; }
  const std::string& last_error() const { return last_error_; }

  // Whole-file transfers (DeepSpeed's read/write): the file's size is the buffer's.
  int Read(const torch::Tensor& buffer, const std::string& filename, bool validate, int64_t offset) {
    return Transfer(buffer, filename, -1, offset, /*write=*/false, /*async=*/false, validate) < 0 ? -1 : 0;
  }
  int Write(const torch::Tensor& buffer, const std::string& filename, bool validate, int64_t offset) {
    return Transfer(buffer, filename, -1, offset, true, false, validate) < 0 ? -1 : 0;
  }
  int Pread(const torch::Tensor& b, const std::string& f, bool validate, bool async, int64_t off) {
    return Transfer(b, f, -1, off, false, async, validate);
  }
  int Pwrite(const torch::Tensor& b, const std::string& f, bool validate, bool async, int64_t off) {
    return Transfer(b, f, -1, off, true, async, validate);
  }
  int PwriteFd(const torch::Tensor& b, int fd, int64_t off) { return Transfer(b, "", fd, off, true, true, false); }
  int PreadFd(const torch::Tensor& b, int fd, int64_t off) { return Transfer(b, "", fd, off, false, true, false); }

  // Waits for every async op of this handle; returns how many completed, -1 if any failed.
  int Wait() {
    if (engine_ == nullptr) Raise(Status::Make(StatusCode::kFailedPrecondition, "aio_handle is closed"));
    std::vector<Pending> ops = std::move(pending_);
    pending_.clear();
    for (const Pending& p : ops) {
      auto it = files_.find(p.file_key);
      if (it != files_.end()) it->second.in_flight = 0;
    }
    std::string first_error;
    {
      py::gil_scoped_release nogil;
      for (Pending& p : ops) {
        const Status st = p.done ? p.status : engine_->Wait(p.ticket);
        if (!st.ok() && first_error.empty()) first_error = StrCat(p.what, ": ", st.ToString());
      }
    }
    if (!first_error.empty()) {
      last_error_ = first_error;
      return -1;
    }
    return static_cast<int>(ops.size());
  }

  torch::Tensor NewLockedTensor(int64_t num_elem, const torch::Tensor& example) {
    if (num_elem < 0) Raise(Status::InvalidArgument(StrCat("new_cpu_locked_tensor: num_elem ", num_elem, " < 0")));
    torch::Tensor t = arena_->Empty({num_elem}, example.scalar_type(), allocator::Kind::kSwapBuffer,
                                    allocator::Lifetime::kPersistent,
                                    locked_.size());
    locked_[t.storage().data()] = t.storage();
    return t;
  }
  bool FreeLockedTensor(const torch::Tensor& t) {
    if (!t.defined() || !t.device().is_cpu()) return false;
    // The memory returns to the arena when the storage's last reference dies; this drops ours.
    return locked_.erase(t.storage().data()) > 0;
  }
  bool IsPinned(const torch::Tensor& t) const { return arena_->Owns(t) || (t.defined() && t.is_pinned()); }

 private:
  struct OpenFile {
    int fd;
    int id;
    bool owned;
    uint64_t last_use = 0;
    int in_flight = 0;  // async ops not yet waited for
  };
  struct Pending {
    allocator::Ticket ticket;
    std::string what;
    std::string file_key;
    torch::Tensor keep;  // the buffer stays alive until wait()
    bool done = false;   // already waited for (to close its file); `status` holds the result
    Status status;
  };
  // Open descriptors kept at most (half the engine's fixed-file slots): the least recently used
  // one is closed to open another, after its in-flight ops complete (their results are kept
  // for wait()).
  static constexpr size_t kMaxOpenFiles = 128;
  static constexpr uint64_t kDirectAlign = 4096;

  int Fail(const std::string& message) {
    last_error_ = message;
    return -1;
  }

  // Returns 0 (async, submitted), the number of completed ops (sync: 1), or -1 with last_error.
  int Transfer(const torch::Tensor& buffer, const std::string& filename, int fd, int64_t offset,
               bool write, bool async, bool validate) {
    (void)validate;  // DeepSpeed's validate re-reads with pread in its tests only
    if (engine_ == nullptr) Raise(Status::Make(StatusCode::kFailedPrecondition, "aio_handle is closed"));
    auto bytes = TensorBytes(buffer, write ? "aio write" : "aio read");
    if (!bytes.ok()) Raise(bytes.status());
    const char* op = write ? "pwrite" : "pread";
    const std::string name = fd >= 0 ? StrCat("fd ", fd) : filename;
    if (offset < 0) return Fail(StrCat(op, " ", name, ": negative file offset ", offset));
    const uint64_t n = bytes->second;
    if (n % static_cast<uint64_t>(intra_op_) != 0) {
      return Fail(StrCat(op, " ", name, ": ", n, " bytes is not divisible by intra_op_parallelism=",
                         intra_op_, " (DeepSpeed's rule); pad the tensor or use 1"));
    }
    std::string key;
    // Page-aligned requests on a named file go through O_DIRECT (DeepSpeed's mode: no page cache,
    // no double copy); others through the buffered descriptor, so no size or offset is refused.
    const bool direct = fd < 0 && direct_ok_ && offset % kDirectAlign == 0 && n % kDirectAlign == 0 &&
                        reinterpret_cast<uintptr_t>(bytes->first) % kDirectAlign == 0;
    auto file = Open(filename, fd, write, direct, &key);
    if (!file.ok()) return Fail(StrCat(op, " ", name, ": ", file.status().message()));
    if (!write) {
      struct stat sb{};
      if (::fstat(file->fd, &sb) != 0) return Fail(StrCat(op, " ", name, ": fstat: ", std::strerror(errno)));
      if (static_cast<uint64_t>(offset) + n > static_cast<uint64_t>(sb.st_size)) {
        return Fail(StrCat("pread ", name, ": reading ", n, " bytes at offset ", offset,
                           " runs past the end of the file (", sb.st_size, " bytes)"));
      }
    }
    if (n == 0) return async ? 0 : 1;
    Result<allocator::Ticket> t = write ? engine_->Write(file->id, static_cast<uint64_t>(offset), bytes->first, n)
                                        : engine_->Read(file->id, static_cast<uint64_t>(offset), bytes->first, n);
    if (!t.ok()) return Fail(StrCat(op, " ", name, ": ", t.status().ToString()));
    if (async) {
      pending_.push_back({*t, StrCat(op, " ", name), key, buffer});
      files_[key].in_flight++;
      return 0;
    }
    const Status st = [&] {
      py::gil_scoped_release nogil;
      return engine_->Wait(*t);
    }();
    if (!st.ok()) return Fail(StrCat(op, " ", name, ": ", st.ToString()));
    return 1;
  }

  // One descriptor per file and direction, opened on first use and kept (DeepSpeed opens the file
  // on every call). Buffered I/O: sizes and offsets need no alignment.
  Result<OpenFile> Open(const std::string& filename, int fd, bool write, bool direct, std::string* key_out) {
    const std::string key = fd >= 0 ? StrCat("#fd", fd)
                                    : StrCat(write ? "w" : "r", direct ? "d:" : ":", filename);
    *key_out = key;
    auto it = files_.find(key);
    if (it != files_.end()) {
      it->second.last_use = ++use_clock_;
      return it->second;
    }
    while (files_.size() >= kMaxOpenFiles) SPILLWAY_RETURN_IF_ERROR(EvictLeastRecentlyUsed());
    OpenFile f{fd, -1, false};
    if (fd < 0) {
      const int mode = (write ? O_WRONLY | O_CREAT : O_RDONLY) | O_CLOEXEC | (direct ? O_DIRECT : 0);
      f.fd = ::open(filename.c_str(), mode, 0600);
      if (f.fd < 0 && direct && errno == EINVAL) {
        // The filesystem has no O_DIRECT (tmpfs, some overlays): buffered from now on, said once.
        direct_ok_ = false;
        Log(LogLevel::kInfo, StrCat("aio_handle: ", filename, " does not support O_DIRECT; this handle "
                                    "uses buffered I/O from now on"));
        return Open(filename, fd, write, false, key_out);
      }
      if (f.fd < 0) {
        return Status::Make(StatusCode::kIoError, StrCat("cannot open: ", std::strerror(errno)), errno);
      }
      f.owned = true;
    }
    auto id = engine_->RegisterFile(f.fd, fd >= 0 ? StrCat("fd ", fd) : filename, direct ? kDirectAlign : 1);
    if (!id.ok()) {
      if (f.owned) ::close(f.fd);
      return id.status();
    }
    f.id = *id;
    f.last_use = ++use_clock_;
    files_[key] = f;
    return f;
  }

  // Closes the least recently used file, first completing its in-flight ops (their results wait in
  // pending_ for wait()).
  Status EvictLeastRecentlyUsed() {
    auto lru = files_.begin();
    for (auto it = files_.begin(); it != files_.end(); ++it) {
      if (it->second.last_use < lru->second.last_use) lru = it;
    }
    if (lru->second.in_flight > 0) {
      py::gil_scoped_release nogil;
      for (Pending& p : pending_) {
        if (!p.done && p.file_key == lru->first) {
          p.status = engine_->Wait(p.ticket);
          p.done = true;
        }
      }
    }
    Status st = engine_->UnregisterFile(lru->second.id);
    if (lru->second.owned) ::close(lru->second.fd);
    files_.erase(lru);
    return st;
  }

  const uint64_t block_size_;
  const int queue_depth_;
  const bool single_submit_, overlap_events_;
  const int intra_op_;
  std::shared_ptr<PyArena> arena_;
  std::unique_ptr<allocator::UringEngine> engine_;
  std::map<std::string, OpenFile> files_;
  uint64_t use_clock_ = 0;
  bool direct_ok_ = true;
  std::vector<Pending> pending_;
  std::map<const void*, c10::Storage> locked_;
  std::string last_error_;
};

std::shared_ptr<PyArena>& DefaultArena() {
  static auto* arena = new std::shared_ptr<PyArena>();
  return *arena;
}

std::shared_ptr<PyArena> ArenaOrDefault(std::shared_ptr<PyArena> arena) {
  if (arena) return arena;
  auto& d = DefaultArena();
  if (!d) d = std::make_shared<PyArena>(0, allocator::PinMode::kAuto, allocator::EscapePolicy::kReport, "python", nullptr);
  return d;
}

}  // namespace

PYBIND11_MODULE(_spillway, m) {
  m.doc() = "Spillway: host-memory and NVMe offload for large-model training (C++ core)";
  py::module_ builtins = py::module_::import("builtins");
  py::object base = py::reinterpret_borrow<py::object>(PyExc_RuntimeError);
  py::object error = py::reinterpret_steal<py::object>(PyErr_NewException("spillway.Error", base.ptr(), nullptr));
  m.attr("Error") = error;
  auto make = [&](const char* name, StatusCode code, PyObject* extra) {
    py::tuple bases = extra != nullptr ? py::tuple(py::make_tuple(error, py::handle(extra)))
                                       : py::tuple(py::make_tuple(error));
    py::object cls = py::reinterpret_steal<py::object>(
        PyErr_NewException(StrCat("spillway.", name).c_str(), bases.ptr(), nullptr));
    m.attr(name) = cls;
    ExceptionTypes()[code] = cls;
  };
  make("InvalidArgument", StatusCode::kInvalidArgument, PyExc_ValueError);
  make("FailedPrecondition", StatusCode::kFailedPrecondition, nullptr);
  {
    // Also a torch.OutOfMemoryError: code that catches torch's OOM around an allocation that
    // spillway.install() now serves keeps catching it (docs/deepspeed.md).
    py::object torch_oom = py::module_::import("torch").attr("OutOfMemoryError");
    py::tuple bases = py::make_tuple(error, torch_oom, py::handle(PyExc_MemoryError));
    py::object cls = py::reinterpret_steal<py::object>(PyErr_NewException("spillway.OverBudget", bases.ptr(), nullptr));
    m.attr("OverBudget") = cls;
    ExceptionTypes()[StatusCode::kOverBudget] = cls;
  }
  make("OutOfMemory", StatusCode::kOutOfMemory, PyExc_MemoryError);
  make("IoError", StatusCode::kIoError, PyExc_OSError);
  make("NoSpace", StatusCode::kNoSpace, PyExc_OSError);
  make("ChecksumMismatch", StatusCode::kChecksumMismatch, nullptr);
  make("Unavailable", StatusCode::kUnavailable, nullptr);
  make("Escaped", StatusCode::kEscaped, nullptr);
  make("InternalError", StatusCode::kInternal, nullptr);

  py::class_<PyArena, std::shared_ptr<PyArena>>(m, "HostArena")
      .def(py::init([](uint64_t budget_bytes, bool pinned, const std::string& policy, const std::string& name,
                       std::shared_ptr<PyArena> share_ledger_with) {
             return std::make_shared<PyArena>(budget_bytes,
                                              pinned ? allocator::PinMode::kAuto : allocator::PinMode::kPageable,
                                              Check(allocator::ParseEscapePolicy(policy)), name, share_ledger_with);
           }),
           py::arg("budget_bytes") = 0, py::arg("pinned") = true, py::arg("policy") = "report",
           py::arg("name") = "python", py::arg("share_ledger_with") = nullptr)
      .def("empty", [](PyArena& a, std::vector<int64_t> shape, py::object dtype, const std::string& kind,
                       const std::string& lifetime, uint64_t owner) {
             const c10::ScalarType st = dtype.is_none() ? c10::ScalarType::Float
                                                        : torch::python::detail::py_object_to_dtype(dtype);
             return a.Empty(shape, st, Check(allocator::ParseKind(kind)), Check(allocator::ParseLifetime(lifetime)),
                            owner);
           }, py::arg("shape"), py::arg("dtype") = py::none(), py::arg("kind") = "transient",
           py::arg("lifetime") = "step", py::arg("owner") = 0)
      .def("owns", &PyArena::Owns)
      .def("contains", [](const PyArena& a, uint64_t ptr, uint64_t bytes) {
             return a.Contains(reinterpret_cast<const void*>(ptr), bytes);
           }, py::arg("ptr"), py::arg("nbytes"))
      .def_property_readonly("name", &PyArena::name)
      .def("stats", &ArenaStats)
      .def("trim", [](PyArena& a) {
             py::gil_scoped_release nogil;
             return a.get()->Trim();
           })
      .def("_begin_epoch", [](PyArena& a, int64_t e) { Check(a.ledger().BeginEpoch(e)); })
      .def("_end_epoch", [](PyArena& a) {
        allocator::BoundaryReport r;
        Check(a.ledger().EndEpoch(&r));
        return ReportToDict(r);
      })
      .def("_begin_step", [](PyArena& a, int64_t s) { Check(a.ledger().BeginStep(s)); })
      .def("_end_step", [](PyArena& a) {
        allocator::BoundaryReport r;
        Check(a.ledger().EndStep(&r));
        return ReportToDict(r);
      });
  m.def("default_arena", [] { return ArenaOrDefault(nullptr); });
  m.def("memory_limit_bytes", [] { return allocator::MemoryLimitBytes(); },
        "Physical memory, lowered by this process's cgroup limit (memory.max) where one is set.");
  m.def("default_host_budget", [] { return allocator::DefaultHostBudget(); },
        "3/4 of memory_limit_bytes(): what spillway.install()'s two arenas share by default.");

  py::class_<AioHandle>(m, "aio_handle")
      .def(py::init([](uint64_t bs, int qd, bool ss, bool oe, int iop, std::shared_ptr<PyArena> arena) {
             return std::make_unique<AioHandle>(bs, qd, ss, oe, iop, ArenaOrDefault(std::move(arena)));
           }),
           py::arg("block_size") = 1048576, py::arg("queue_depth") = 128, py::arg("single_submit") = false,
           py::arg("overlap_events") = false, py::arg("intra_op_parallelism") = 1, py::arg("arena") = nullptr)
      .def("get_block_size", &AioHandle::block_size)
      .def("get_queue_depth", &AioHandle::queue_depth)
      .def("get_single_submit", &AioHandle::single_submit)
      .def("get_overlap_events", &AioHandle::overlap_events)
      .def("get_intra_op_parallelism", &AioHandle::intra_op_parallelism)
      .def("get_alignment", &AioHandle::alignment)
      .def("get_last_error", &AioHandle::last_error)
      .def("read", &AioHandle::Read, py::arg("buffer"), py::arg("filename"), py::arg("validate"),
           py::arg("file_offset") = 0)
      .def("write", &AioHandle::Write, py::arg("buffer"), py::arg("filename"), py::arg("validate"),
           py::arg("file_offset") = 0)
      .def("pread", &AioHandle::Pread, py::arg("buffer"), py::arg("filename"), py::arg("validate"),
           py::arg("async"), py::arg("file_offset") = 0)
      .def("pwrite", &AioHandle::Pwrite, py::arg("buffer"), py::arg("filename"), py::arg("validate"),
           py::arg("async"), py::arg("file_offset") = 0)
      .def("sync_pread", [](AioHandle& h, const torch::Tensor& b, const std::string& f, int64_t o) {
             return h.Pread(b, f, false, false, o);
           }, py::arg("buffer"), py::arg("filename"), py::arg("file_offset") = 0)
      .def("sync_pwrite", [](AioHandle& h, const torch::Tensor& b, const std::string& f, int64_t o) {
             return h.Pwrite(b, f, false, false, o);
           }, py::arg("buffer"), py::arg("filename"), py::arg("file_offset") = 0)
      .def("async_pread", [](AioHandle& h, const torch::Tensor& b, const std::string& f, int64_t o) {
             return h.Pread(b, f, false, true, o);
           }, py::arg("buffer"), py::arg("filename"), py::arg("file_offset") = 0)
      .def("async_pwrite", [](AioHandle& h, const torch::Tensor& b, const std::string& f, int64_t o) {
             return h.Pwrite(b, f, false, true, o);
           }, py::arg("buffer"), py::arg("filename"), py::arg("file_offset") = 0)
      .def("async_pwrite", &AioHandle::PwriteFd, py::arg("buffer"), py::arg("fd"), py::arg("file_offset") = 0)
      .def("async_pread", &AioHandle::PreadFd, py::arg("buffer"), py::arg("fd"), py::arg("file_offset") = 0)
      .def("wait", &AioHandle::Wait)
      .def("new_cpu_locked_tensor", &AioHandle::NewLockedTensor, py::arg("num_elem"), py::arg("example_tensor"))
      .def("free_cpu_locked_tensor", &AioHandle::FreeLockedTensor)
      .def("is_pinned", &AioHandle::IsPinned)
      .def("close", &AioHandle::Close);

  py::class_<metrics::Exporter>(m, "Exporter")
      .def_property_readonly("port", &metrics::Exporter::port)
      .def_property_readonly("address", &metrics::Exporter::address)
      .def("render", &metrics::Exporter::Render)
      .def("watch", [](metrics::Exporter& e, std::shared_ptr<PyArena> a) {
             e.Watch(a->get());
             e.Watch(&a->ledger());
           }, py::keep_alive<1, 2>());
  python::BindEngine(m);
  python::BindTorchAllocators(m);
  m.def("_serve", [](const std::string& address, const std::map<std::string, std::string>& labels) {
    metrics::ExporterOptions o;
    o.address = address;
    o.const_labels.assign(labels.begin(), labels.end());
    return std::unique_ptr<metrics::Exporter>(Check(metrics::Exporter::Start(o)).release());
  }, py::arg("address"), py::arg("labels") = std::map<std::string, std::string>{});
}
