// SwapStore: DeepSpeed's swap files as extents of one NvmeArena (an O_TMPFILE swap file in the
// swap folder's filesystem, CRC32C per extent, a budget), keyed by the path DeepSpeed names.
// spillway.deepspeed routes its swappers' async_pwrite/async_pread of those paths here
// (Note [DeepSpeed swap] in docs/deepspeed.md).
#include <fcntl.h>
#include <pybind11/stl.h>
#include <sys/statvfs.h>
#include <torch/extension.h>
#include <unistd.h>

#include <algorithm>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

#include "bindings.h"
#include "errors.h"
#include "spillway/allocator/io_engine.h"
#include "spillway/allocator/ledger.h"
#include "spillway/allocator/nvme_arena.h"
#include "spillway/metrics/exporter.h"
#include "spillway/torch_alloc/shared_arena.h"

namespace py = pybind11;

namespace spillway::python {
namespace {

// Thread-safe. mu_ guards the path table only: no I/O and no arena call runs under it. DeepSpeed
// never has two transfers of one path in flight; two here would be serialized by the arena's
// generation check (a write that lost the race is refused, never recorded as valid).
class SwapStore {
 public:
  SwapStore(const std::string& directory, uint64_t budget_bytes, uint64_t block_size,
            uint32_t queue_depth, std::shared_ptr<torch_alloc::SharedArena> host)
      : host_(std::move(host)) {
    allocator::IoEngineOptions eo;
    eo.arena = host_->get();
    eo.block_size = block_size;
    eo.queue_depth = queue_depth;
    engine_ = Check(allocator::IoEngine::Create(eo));
    if (budget_bytes == 0) {
      struct statvfs vfs {};
      if (statvfs(directory.c_str(), &vfs) != 0) {
        Raise(Status::FromErrno(StatusCode::kIoError, errno,
                                StrCat("DeepSpeed's swap folder ", directory)));
      }
      budget_bytes = static_cast<uint64_t>(vfs.f_bavail) * vfs.f_frsize;  // what the disk has now
    }
    allocator::NvmeArenaOptions no;
    no.name = StrCat("deepspeed-swap:", directory);  // one store per nvme_path: the metrics' label
    no.directory = directory;
    no.budget_bytes = budget_bytes;
    no.grow_bytes = 64ull << 20;
    no.ledger = &host_->ledger();  // install()'s ledger: its boundaries and scopes see the store
    arena_ = Check(allocator::NvmeArena::Create(no, engine_.get()));
  }
  ~SwapStore() {
    arena_.reset();  // before the engine it runs on
    engine_.reset();
  }

  // The whole tensor into the path's extent (made, or remade when the size changed).
  void Write(const std::string& path, const torch::Tensor& t, const std::string& kind) {
    const auto [ptr, bytes] = Bytes(t, path);
    uint64_t offset;
    {
      py::gil_scoped_release nogil;
      offset = ExtentFor(path, bytes, kind);
      const Status st = arena_->Write(offset, ptr, bytes);
      if (!st.ok()) RaiseWithGil(st.WithContext(StrCat("DeepSpeed swap file ", path)));
    }
  }

  // The path's extent into the tensor, its checksum verified. The tensor must be the extent's
  // size: DeepSpeed writes and reads whole files.
  void Read(const std::string& path, torch::Tensor& t) {
    const auto [ptr, bytes] = Bytes(t, path);
    py::gil_scoped_release nogil;
    uint64_t offset = 0, held = 0;
    bool found = false;
    {
      std::lock_guard<std::mutex> lock(mu_);
      auto it = paths_.find(path);
      if (it != paths_.end()) {
        found = true;
        offset = it->second.offset;
        held = it->second.bytes;
      }
    }  // raised after the lock: the GIL is never waited for while holding it
    if (!found) {
      RaiseWithGil(
          Status::FailedPrecondition(StrCat("DeepSpeed swap file ", path,
                                            ": Spillway's swap store holds no such file (it "
                                            "was never written in this process)")));
    }
    if (held != bytes) {
      RaiseWithGil(Status::InvalidArgument(StrCat(
          "DeepSpeed swap file ", path, ": holds ", held, " bytes and the read asks for ", bytes,
          "; Spillway's swap store reads whole files (DeepSpeed's "
          "offload_optimizer.fast_init reads a prefix: turn it off)")));
    }
    const Status st = arena_->Read(offset, ptr, bytes);
    if (!st.ok()) RaiseWithGil(st.WithContext(StrCat("DeepSpeed swap file ", path)));
  }

  bool Contains(const std::string& path) {
    std::lock_guard<std::mutex> lock(mu_);
    return paths_.count(path) != 0;
  }
  int64_t Size(const std::string& path) {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = paths_.find(path);
    return it == paths_.end() ? -1 : static_cast<int64_t>(it->second.bytes);
  }
  // Paths that start with `prefix`, sorted.
  std::vector<std::string> Paths(const std::string& prefix) {
    std::vector<std::string> out;
    {
      std::lock_guard<std::mutex> lock(mu_);
      for (const auto& [p, e] : paths_) {
        if (p.compare(0, prefix.size(), prefix) == 0) out.push_back(p);
      }
    }
    std::sort(out.begin(), out.end());
    return out;
  }
  // Forgets the files under `prefix` and frees their extents (DeepSpeed's rmtree of a folder).
  size_t Remove(const std::string& prefix) {
    std::vector<uint64_t> offsets;
    {
      std::lock_guard<std::mutex> lock(mu_);
      for (auto it = paths_.begin(); it != paths_.end();) {
        if (it->first.compare(0, prefix.size(), prefix) == 0) {
          offsets.push_back(it->second.offset);
          it = paths_.erase(it);
        } else {
          ++it;
        }
      }
    }
    for (uint64_t off : offsets) Check(arena_->Free(off));
    return offsets.size();
  }

  // The exporter renders the arena's stats at each scrape (live bytes by kind, capacity, budget,
  // checksum failures) under arena="deepspeed-swap:<nvme_path>".
  void WatchedBy(metrics::Exporter& exporter) const { exporter.Watch(arena_.get()); }

  py::dict Stats() {
    const allocator::NvmeArenaStats s = arena_->Stats();
    py::dict d;
    d["arena"] = arena_->tier_name();
    {
      std::lock_guard<std::mutex> lock(mu_);
      d["files"] = paths_.size();
    }
    d["live_bytes"] = s.live_bytes;
    d["capacity_bytes"] = s.capacity_bytes;
    d["budget_bytes"] = s.budget_bytes;
    d["written_bytes"] = s.written_bytes;
    d["read_bytes"] = s.read_bytes;
    d["checksum"] = s.checksum;
    d["checksum_failures"] = s.checksum_failures;
    d["direct_io"] = s.direct_io;
    d["live_by_kind"] = KindBytesDict(s.live_by_kind);
    return d;
  }

  // Test seam: flips one byte of the path's extent on disk (behind the arena's back).
  void CorruptForTesting(const std::string& path, uint64_t byte) {
    uint64_t offset;
    {
      std::lock_guard<std::mutex> lock(mu_);
      auto it = paths_.find(path);
      if (it == paths_.end() || byte >= it->second.bytes) {
        Raise(Status::InvalidArgument("_corrupt_for_testing: no such file or byte"));
      }
      offset = it->second.offset;
    }
    const int fd = arena_->fd_for_testing();
    // The arena's descriptor is O_DIRECT (aligned I/O only): the byte is flipped through a
    // buffered descriptor of the same file, and the page cache dropped after.
    const int buffered = ::open(StrCat("/proc/self/fd/", fd).c_str(), O_RDWR);
    if (buffered < 0)
      Raise(Status::FromErrno(StatusCode::kIoError, errno, "_corrupt_for_testing: reopen"));
    unsigned char c = 0;
    const off_t at = static_cast<off_t>(offset + byte);
    bool ok = ::pread(buffered, &c, 1, at) == 1;
    c ^= 0xFF;
    ok = ok && ::pwrite(buffered, &c, 1, at) == 1 && ::fdatasync(buffered) == 0;
    ::posix_fadvise(buffered, 0, 0, POSIX_FADV_DONTNEED);
    ::close(buffered);
    if (!ok) Raise(Status::FromErrno(StatusCode::kIoError, errno, "_corrupt_for_testing: flip"));
  }

 private:
  struct Entry {
    uint64_t offset = 0;
    uint64_t bytes = 0;
  };

  static std::pair<void*, uint64_t> Bytes(const torch::Tensor& t, const std::string& path) {
    if (!t.device().is_cpu() || !t.is_contiguous() || t.nbytes() == 0) {
      Raise(Status::InvalidArgument(StrCat("DeepSpeed swap file ", path,
                                           ": the buffer must be a non-empty contiguous CPU "
                                           "tensor")));
    }
    return {t.data_ptr(), static_cast<uint64_t>(t.nbytes())};
  }

  [[noreturn]] static void RaiseWithGil(const Status& st) {
    py::gil_scoped_acquire gil;
    Raise(st);
  }

  // Without the GIL. The path's extent of exactly `bytes`, made or remade.
  uint64_t ExtentFor(const std::string& path, uint64_t bytes, const std::string& kind) {
    uint64_t stale = UINT64_MAX;
    {
      std::lock_guard<std::mutex> lock(mu_);
      auto it = paths_.find(path);
      if (it != paths_.end()) {
        if (it->second.bytes == bytes) return it->second.offset;
        stale = it->second.offset;  // DeepSpeed rewrote it with another size: a new extent
        paths_.erase(it);
      }
    }
    if (stale != UINT64_MAX) {
      const Status st = arena_->Free(stale);
      if (!st.ok()) RaiseWithGil(st.WithContext(StrCat("DeepSpeed swap file ", path)));
    }
    Result<allocator::Kind> k = allocator::ParseKind(kind);
    if (!k.ok()) RaiseWithGil(k.status());
    const allocator::OwnerTag tag{*k, allocator::Lifetime::kPersistent, 0, allocator::kProcessScope,
                                  "deepspeed swap file"};
    Result<uint64_t> offset = arena_->Allocate(bytes, tag);
    if (!offset.ok()) {
      RaiseWithGil(offset.status().WithContext(
          StrCat("DeepSpeed swap file ", path,
                 " (give Spillway's swap store more with SPILLWAY_NVME_BUDGET_BYTES, or free "
                 "space on the swap folder's disk)")));
    }
    uint64_t lost = UINT64_MAX;  // an extent a concurrent first write of the path made too
    uint64_t kept;
    {
      std::lock_guard<std::mutex> lock(mu_);
      auto [it, made] = paths_.emplace(path, Entry{*offset, bytes});
      if (!made && it->second.bytes == bytes) {
        lost = *offset;  // theirs stays
      } else if (!made) {
        lost = it->second.offset;  // another size: the path is ours now
        it->second = Entry{*offset, bytes};
      }
      kept = it->second.offset;
    }
    if (lost != UINT64_MAX) {
      const Status st = arena_->Free(lost);
      if (!st.ok()) RaiseWithGil(st.WithContext(StrCat("DeepSpeed swap file ", path)));
    }
    return kept;
  }

  // The engine's bounce pool and fixed buffers, and the ledger the arena is booked in: declared
  // first, so both outlive the arena.
  const std::shared_ptr<torch_alloc::SharedArena> host_;
  std::unique_ptr<allocator::IoEngine> engine_;
  std::unique_ptr<allocator::NvmeArena> arena_;
  std::mutex mu_;
  std::unordered_map<std::string, Entry> paths_;  // guarded by mu_
};

}  // namespace

void BindSwapStore(py::module_& m) {
  py::class_<SwapStore, std::shared_ptr<SwapStore>>(m, "_SwapStore")
      .def(py::init<const std::string&, uint64_t, uint64_t, uint32_t,
                    std::shared_ptr<torch_alloc::SharedArena>>(),
           py::arg("directory"), py::arg("budget_bytes"), py::arg("block_size"),
           py::arg("queue_depth"), py::arg("host"))
      .def("write", &SwapStore::Write)
      .def("read", &SwapStore::Read)
      .def("contains", &SwapStore::Contains)
      .def("size", &SwapStore::Size)
      .def("paths", &SwapStore::Paths)
      .def("remove", &SwapStore::Remove)
      .def("stats", &SwapStore::Stats)
      // The exporter keeps the store alive: it holds the arena's address until it is destroyed.
      .def("_watched_by", &SwapStore::WatchedBy, py::keep_alive<2, 1>())
      .def("_corrupt_for_testing", &SwapStore::CorruptForTesting);
}

}  // namespace spillway::python
