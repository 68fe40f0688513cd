// SwapStore (swap_store.h): DeepSpeed's swap files in one NvmeArena.
#include "spillway/aio/swap_store.h"

#include <fcntl.h>
#include <sys/statvfs.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <utility>

namespace spillway::aio {

Result<std::unique_ptr<SwapStore>> SwapStore::Create(const SwapStoreOptions& options) {
  if (options.engine == nullptr || options.ledger == nullptr) {
    return Status::InvalidArgument("SwapStore: the I/O engine and the ledger must be given");
  }
  std::unique_ptr<SwapStore> s(new SwapStore());
  s->engine_ = options.engine;
  uint64_t budget = options.budget_bytes;
  if (budget == 0) {
    struct statvfs vfs {};
    if (statvfs(options.directory.c_str(), &vfs) != 0) {
      return Status::FromErrno(StatusCode::kIoError, errno,
                               StrCat("DeepSpeed's swap folder ", options.directory));
    }
    budget = static_cast<uint64_t>(vfs.f_bavail) * vfs.f_frsize;  // what the disk has now
  }
  allocator::NvmeArenaOptions no;
  no.name = StrCat("deepspeed-swap:", options.directory);  // one per nvme_path: the metrics' label
  no.directory = options.directory;
  no.budget_bytes = budget;
  no.grow_bytes = 64ull << 20;
  no.ledger = options.ledger;
  SPILLWAY_ASSIGN_OR_RETURN(s->arena_, allocator::NvmeArena::Create(no, s->engine_.get()));
  return s;
}

SwapStore::~SwapStore() {
  arena_.reset();  // before the engine it runs on
  engine_.reset();
}

Status SwapStore::Write(const std::string& path, const void* data, uint64_t bytes,
                        allocator::Kind kind) {
  SPILLWAY_ASSIGN_OR_RETURN(const Transfer t, SubmitWrite(path, data, bytes, kind));
  return Complete(t, path);
}

Status SwapStore::Read(const std::string& path, void* data, uint64_t bytes) {
  SPILLWAY_ASSIGN_OR_RETURN(const Transfer t, SubmitRead(path, data, bytes));
  return Complete(t, path);
}

Result<SwapStore::Transfer> SwapStore::SubmitWrite(const std::string& path, const void* data,
                                                   uint64_t bytes, allocator::Kind kind) {
  SPILLWAY_ASSIGN_OR_RETURN(const uint64_t offset, ExtentFor(path, bytes, kind));
  Result<Transfer> t = arena_->SubmitWrite(offset, data, bytes);
  if (!t.ok()) return t.status().WithContext(StrCat("DeepSpeed swap file ", path));
  return t;
}

Result<SwapStore::Transfer> SwapStore::SubmitRead(const std::string& path, void* data,
                                                  uint64_t bytes) {
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
  }
  if (!found) {
    return Status::FailedPrecondition(StrCat("DeepSpeed swap file ", path,
                                             ": Spillway's swap store holds no such file (it "
                                             "was never written in this process)"));
  }
  if (held != bytes) {
    return Status::InvalidArgument(StrCat(
        "DeepSpeed swap file ", path, ": holds ", held, " bytes and the read asks for ", bytes,
        "; Spillway's swap store reads whole files (DeepSpeed's "
        "offload_optimizer.fast_init reads a prefix: turn it off)"));
  }
  Result<Transfer> t = arena_->SubmitRead(offset, data, bytes);
  if (!t.ok()) return t.status().WithContext(StrCat("DeepSpeed swap file ", path));
  return t;
}

Status SwapStore::Complete(const Transfer& transfer, const std::string& path) {
  return arena_->Complete(transfer).WithContext(StrCat("DeepSpeed swap file ", path));
}

bool SwapStore::Contains(const std::string& path) const {
  std::lock_guard<std::mutex> lock(mu_);
  return paths_.count(path) != 0;
}

int64_t SwapStore::Size(const std::string& path) const {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = paths_.find(path);
  return it == paths_.end() ? -1 : static_cast<int64_t>(it->second.bytes);
}

size_t SwapStore::files() const {
  std::lock_guard<std::mutex> lock(mu_);
  return paths_.size();
}

std::vector<std::string> SwapStore::Paths(const std::string& prefix) const {
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

Result<size_t> SwapStore::Remove(const std::string& prefix) {
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
  Status first;  // every extent is freed; the first failure is returned
  for (uint64_t off : offsets) {
    Status st = arena_->Free(off);
    if (first.ok() && !st.ok()) first = std::move(st);
  }
  SPILLWAY_RETURN_IF_ERROR(first.WithContext(StrCat("removing the swap files under ", prefix)));
  return offsets.size();
}

Result<uint64_t> SwapStore::ExtentFor(const std::string& path, uint64_t bytes,
                                      allocator::Kind kind) {
  const std::string what = StrCat("DeepSpeed swap file ", path);
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
  if (stale != UINT64_MAX) SPILLWAY_RETURN_IF_ERROR(arena_->Free(stale).WithContext(what));
  const allocator::OwnerTag tag{kind, allocator::Lifetime::kPersistent, 0, allocator::kProcessScope,
                                "deepspeed swap file"};
  Result<uint64_t> offset = arena_->Allocate(bytes, tag);
  if (!offset.ok()) {
    return offset.status().WithContext(
        StrCat(what,
               " (give Spillway's swap store more with SPILLWAY_NVME_BUDGET_BYTES, or free "
               "space on the swap folder's disk)"));
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
  if (lost != UINT64_MAX) SPILLWAY_RETURN_IF_ERROR(arena_->Free(lost).WithContext(what));
  return kept;
}

Status SwapStore::CorruptForTesting(const std::string& path, uint64_t byte) {
  uint64_t offset;
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = paths_.find(path);
    if (it == paths_.end() || byte >= it->second.bytes) {
      return Status::InvalidArgument("_corrupt_for_testing: no such file or byte");
    }
    offset = it->second.offset;
  }
  const int fd = arena_->fd_for_testing();
  // The arena's descriptor is O_DIRECT (aligned I/O only): the byte is flipped through a
  // buffered descriptor of the same file, and the page cache dropped after.
  const int buffered = ::open(StrCat("/proc/self/fd/", fd).c_str(), O_RDWR);
  if (buffered < 0) {
    return Status::FromErrno(StatusCode::kIoError, errno, "_corrupt_for_testing: reopen");
  }
  unsigned char c = 0;
  const off_t at = static_cast<off_t>(offset + byte);
  bool ok = ::pread(buffered, &c, 1, at) == 1;
  c ^= 0xFF;
  ok = ok && ::pwrite(buffered, &c, 1, at) == 1 && ::fdatasync(buffered) == 0;
  const int saved = errno;
  ::posix_fadvise(buffered, 0, 0, POSIX_FADV_DONTNEED);
  ::close(buffered);
  if (!ok) return Status::FromErrno(StatusCode::kIoError, saved, "_corrupt_for_testing: flip");
  return Status::Ok();
}

}  // namespace spillway::aio
