// NvmeArena: one anonymous, preallocated O_DIRECT swap file, carved into exact extents; owners,
// boundaries and budget as in the host arena; a CRC32C per extent. Note [Swap file] in
// docs/nvme.md.
#include "spillway/allocator/nvme_arena.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cinttypes>
#include <cstdio>
#include <cstdlib>
#include <cstring>

#include "live_table.h"
#include "spillway/allocator/crc32c.h"
#include "spillway/base/bytes.h"
#include "spillway/base/check.h"
#include "spillway/base/log.h"

namespace spillway::allocator {
namespace {

// The error of a write whose extent changed hands (or was written again) while it ran.
std::string StaleWrite(uint64_t offset) {
  return StrCat("the extent at offset ", offset,
                " was freed, re-allocated or written again while "
                "this write ran, so its data is not recorded as the extent's (the caller's copy is "
                "still the good one); one write at a time per extent, and free it only after");
}

std::string FreeSpace(const std::string& dir) {
  struct statvfs vfs {};
  if (statvfs(dir.c_str(), &vfs) != 0) return "unknown";
  return FormatBytes(static_cast<uint64_t>(vfs.f_bavail) * vfs.f_frsize);
}

// Opens an anonymous file in `dir`: O_TMPFILE, or a 0600 file in a private 0700 directory that is
// unlinked at once. Nothing is left on disk if the process dies.
Result<int> OpenSwapFile(const std::string& dir, bool* direct) {
  struct stat st {};
  if (stat(dir.c_str(), &st) != 0) {
    return Status::FromErrno(StatusCode::kInvalidArgument, errno,
                             StrCat("nvme_path '", dir,
                                    "' cannot be used; create it, or point "
                                    "offload_param/offload_optimizer.nvme_path at a directory on "
                                    "the NVMe drive"));
  }
  if (!S_ISDIR(st.st_mode)) {
    return Status::InvalidArgument(StrCat("nvme_path '", dir, "' is not a directory"));
  }
  for (bool try_direct : {true, false}) {
    const int flags = O_RDWR | O_CLOEXEC | (try_direct ? O_DIRECT : 0);
    int fd = open(dir.c_str(), O_TMPFILE | flags, 0600);
    if (fd < 0 && (errno == EOPNOTSUPP || errno == EISDIR)) {
      // No O_TMPFILE here: a private directory, a file in it, both unlinked at once.
      std::string tmpl = dir + "/spillway-XXXXXX";
      std::vector<char> path(tmpl.begin(), tmpl.end());
      path.push_back('\0');
      if (mkdtemp(path.data()) != nullptr) {
        const std::string file = std::string(path.data()) + "/swap";
        fd = open(file.c_str(), O_CREAT | O_EXCL | flags, 0600);
        const int saved = errno;
        unlink(file.c_str());
        rmdir(path.data());
        errno = saved;
      }
    }
    if (fd >= 0) {
      *direct = try_direct;
      return fd;
    }
    if (errno == EINVAL && try_direct) continue;  // no O_DIRECT on this filesystem (tmpfs)
    const int err = errno;
    const bool perm = err == EACCES || err == EPERM || err == EROFS;
    return Status::FromErrno(
        perm ? StatusCode::kInvalidArgument : StatusCode::kIoError, err,
        StrCat("creating the swap file in nvme_path '", dir, "'",
               perm ? " (the directory is not writable by this process; choose a writable "
                      "nvme_path)"
                    : ""));
  }
  return Status::Internal("OpenSwapFile: unreachable");
}

uint32_t DirectIoAlignment(int fd) {
  struct statx sx {};
  if (statx(fd, "", AT_EMPTY_PATH, STATX_DIOALIGN, &sx) == 0 && (sx.stx_mask & STATX_DIOALIGN) &&
      sx.stx_dio_offset_align != 0) {
    return std::max<uint32_t>({sx.stx_dio_offset_align, sx.stx_dio_mem_align, 512u});
  }
  return 4096;  // kernels before 6.1, or filesystems that do not say
}

// NvmeArena::Allocate's checks of the request, before anything is locked.
Status CheckNvmeRequest(uint64_t bytes, const OwnerTag& tag, uint64_t alignment,
                        const Ledger& ledger) {
  if (static_cast<int>(tag.kind) >= kKindCount ||
      static_cast<int>(tag.lifetime) >= kLifetimeCount) {
    return Status::InvalidArgument("NvmeArena::Allocate: owner tag kind or lifetime out of range");
  }
  if (bytes == 0) {
    return Status::InvalidArgument(StrCat("NvmeArena::Allocate: size 0 for ", KindName(tag.kind),
                                          " owner ", tag.owner_id, "; ask for at least 1 byte"));
  }
  if (bytes > UINT64_MAX - alignment) {
    return Status::InvalidArgument(StrCat("NvmeArena::Allocate: size ", bytes, " overflows"));
  }
  if (!ledger.scope_exists(tag.scope)) {
    return Status::InvalidArgument(
        StrCat("NvmeArena::Allocate: scope ", tag.scope, " was never created"));
  }
  return Status::Ok();
}

// Books a growth of the swap file on the node's NVMe ledger (Note [Node governor]), without the
// arena's lock: *grow, or only the request's `just_need` when the node cannot hold a whole step.
Status BookGrowth(NodeGovernor* node, uint64_t just_need, uint64_t* grow) {
  if (node == nullptr) return Status::Ok();
  Status booked = node->Reserve(NodeTier::kNvme, *grow);
  if (booked.code() == StatusCode::kOverBudget && *grow > just_need) {
    *grow = just_need;  // the node cannot hold a whole grow step: grow by the request alone
    booked = node->Reserve(NodeTier::kNvme, *grow);
  }
  return booked;
}

// Extends the swap file `fd` from `capacity` by `grow`, without the arena's lock: fallocate, or
// ftruncate where the filesystem has none (*switched: this call found that out). Returns errno.
int ExtendFile(int fd, uint64_t capacity, uint64_t grow, NvmeArenaFaults* faults,
               std::atomic<bool>* without_fallocate, bool* switched) {
  int err = faults != nullptr ? faults->fallocate_errno.exchange(0) : 0;
  if (err == 0 && !without_fallocate->load()) {
    err = fallocate(fd, 0, static_cast<off_t>(capacity), static_cast<off_t>(grow)) == 0 ? 0 : errno;
  }
  if (err == EOPNOTSUPP || without_fallocate->load()) {
    // No fallocate here (older ZFS, NFSv3, some FUSE): grow with ftruncate. The blocks are then
    // allocated by the writes, so a full device shows up as ENOSPC on a write instead of here.
    *switched = !without_fallocate->exchange(true);
    err = ftruncate(fd, static_cast<off_t>(capacity + grow)) == 0 ? 0 : errno;
  }
  return err;
}

// The error of a growth of the swap file that failed with `err`: what to change for that errno.
Status GrowthError(const NvmeArenaOptions& options, uint64_t capacity, uint64_t grow, int err) {
  const bool fbig = err == EFBIG;
  return Status::FromErrno(
      StatusCode::kNoSpace, err,
      StrCat("nvme arena '", options.name, "': growing the swap file in '", options.directory,
             "' from ", FormatBytes(capacity), " by ", FormatBytes(grow), " failed (",
             FreeSpace(options.directory), " free there); ",
             fbig ? "the file size limit (ulimit -f) or the filesystem's largest file was "
                    "reached; raise the limit or lower spillway.nvme_budget_bytes"
             : err == EOPNOTSUPP || err == ENOSYS
                 ? "the filesystem supports neither fallocate nor growing the file; put nvme_path "
                   "on a local filesystem (ext4, xfs)"
                 : "free space on the device or lower spillway.nvme_budget_bytes",
             ". Nothing was allocated"));
}
}  // namespace

Result<std::unique_ptr<NvmeArena>> NvmeArena::Create(NvmeArenaOptions options, IoEngine* engine) {
  if (engine == nullptr) return Status::InvalidArgument("NvmeArena: an I/O engine is required");
  if (options.budget_bytes == 0) {
    return Status::InvalidArgument(StrCat("nvme arena '", options.name,
                                          "': no NVMe budget; set spillway.nvme_budget_bytes to "
                                          "the most this rank may write to nvme_path"));
  }
  if (options.grow_bytes == 0) {
    return Status::InvalidArgument("nvme arena: grow_bytes must be positive");
  }
  bool direct = false;
  auto fd = OpenSwapFile(options.directory, &direct);
  if (!fd.ok()) return fd.status().WithContext(StrCat("nvme arena '", options.name, "'"));
  const uint32_t alignment = direct ? DirectIoAlignment(*fd) : 4096;
  if (!direct) {
    Log(LogLevel::kWarning, StrCat("nvme arena '", options.name, "': '", options.directory,
                                   "' does not support O_DIRECT; the swap file goes through the "
                                   "page cache (not an NVMe drive?)"));
  }
  auto file_id = engine->RegisterFile(*fd, StrCat("swap file in ", options.directory), alignment);
  if (!file_id.ok()) {
    close(*fd);
    return file_id.status();
  }
  options.budget_bytes = options.budget_bytes / alignment * alignment;
  options.grow_bytes = RoundUp(options.grow_bytes, alignment);
  if (options.node == nullptr) options.node = NodeGovernor::Current();
  if (options.node != nullptr) {
    // The ledger's first NVMe arena (of any job) sets its NVMe budget when none was given: 90% of
    // the free space where it swaps (each rank's own default budget is the same 90%; the node's
    // caps their sum).
    struct statvfs vfs {};
    if (statvfs(options.directory.c_str(), &vfs) != 0) {
      const int err = errno;
      engine->UnregisterFile(*file_id).IgnoreError();  // undoing: the statvfs error is reported
      close(*fd);
      return Status::FromErrno(StatusCode::kUnavailable, err,
                               StrCat("nvme arena '", options.name, "': statvfs of '",
                                      options.directory, "' for the node's NVMe budget"));
    }
    auto offered =
        options.node->OfferNvmeBudget(static_cast<uint64_t>(vfs.f_bavail) * vfs.f_frsize / 10 * 9);
    if (!offered.ok()) {
      engine->UnregisterFile(*file_id).IgnoreError();  // undoing: the lock's error is reported
      close(*fd);
      return offered.status().WithContext(StrCat("nvme arena '", options.name, "'"));
    }
  }
  Ledger* ledger = options.ledger != nullptr ? options.ledger : &Ledger::Default();
  std::unique_ptr<NvmeArena> arena(
      new NvmeArena(std::move(options), engine, ledger, *fd, *file_id, alignment, direct));
  ledger->Attach(arena.get());
  return arena;
}

NvmeArena::NvmeArena(NvmeArenaOptions options, IoEngine* engine, Ledger* ledger, int fd,
                     int file_id, uint32_t alignment, bool direct)
    : options_(std::move(options)),
      engine_(engine),
      ledger_(ledger),
      fd_(fd),
      file_id_(file_id),
      alignment_(alignment),
      direct_(direct),
      live_(std::make_unique<LiveTable>(ledger, StrCat("nvme arena '", options_.name, "'"))) {
  stats_.policy = options_.policy;
  stats_.budget_bytes = options_.budget_bytes;
  stats_.alignment = alignment_;
  stats_.direct_io = direct_;
  stats_.checksum = options_.checksum;
}

NvmeArena::~NvmeArena() {
  ledger_->Detach(this);
  if (process_.InOwner()) {  // a forked child's engine refuses: only its own fd is closed
    Status st = engine_->UnregisterFile(file_id_);
    if (!st.ok()) Log(LogLevel::kError, st.ToString());
  }
  close(fd_);  // the file was never linked: closing it frees the space
  // Given back once the space is free, so another rank's growth cannot meet ENOSPC for it.
  if (process_.InOwner() && options_.node != nullptr) {
    options_.node->Release(NodeTier::kNvme, extents_.span_bytes());
  }
}

Result<uint64_t> NvmeArena::Allocate(uint64_t bytes, const OwnerTag& tag) {
  SPILLWAY_VALIDATE_ON_EXIT(*this);  // first: runs after every lock below is released
  SPILLWAY_RETURN_IF_ERROR(process_.Check("NvmeArena", "Allocate"));
  SPILLWAY_RETURN_IF_ERROR(CheckNvmeRequest(bytes, tag, alignment_, *ledger_));
  const uint64_t rounded = RoundUp(bytes, alignment_);
  std::unique_lock<std::mutex> lock(mu_);
  for (;;) {
    if (!ledger_->scope_live(tag.scope)) {
      return Status::FailedPrecondition(
          StrCat("NvmeArena::Allocate: scope ", tag.scope, " was released"));
    }
    if (auto off = extents_.Allocate(rounded)) {
      live_->Insert(*off, rounded, bytes, tag, nullptr);
      (void)NewGenerationLocked(*off);
      return *off;
    }
    // Grow the file. The free tail of the file merges with the new space, so only the rest counts.
    const uint64_t capacity = extents_.span_bytes();
    const uint64_t tail = capacity == 0 ? 0 : extents_.FreeBytesEndingAt(capacity);
    const uint64_t need = rounded - tail;
    if (capacity + need > options_.budget_bytes) {
      stats_.over_budget_count++;
      return Status::OverBudget(StrCat(
          "nvme arena '", options_.name, "': allocating ", FormatBytes(rounded), " for ",
          KindName(tag.kind), " owner ", tag.owner_id, " would grow the swap file to ",
          FormatBytes(capacity + need), ", over the NVMe budget of ",
          FormatBytes(options_.budget_bytes), " (live ", FormatBytes(live_->stats().live_bytes),
          ", free inside the file ", FormatBytes(extents_.free_bytes()),
          "). Raise spillway.nvme_budget_bytes or free NVMe extents first"));
    }
    if (growing_) {
      grown_cv_.wait(lock);
      continue;
    }
    uint64_t grow = std::min(std::max(options_.grow_bytes, RoundUp(need, alignment_)),
                             options_.budget_bytes - capacity);
    growing_ = true;
    lock.unlock();
    // The node's NVMe ledger first, then the file: both without mu_ (growing_ holds the others).
    const Status booked = BookGrowth(options_.node.get(), RoundUp(need, alignment_), &grow);
    bool switched = false;
    const int err = booked.ok() ? ExtendFile(fd_, capacity, grow, options_.faults,
                                             &without_fallocate_, &switched)
                                : 0;
    lock.lock();
    growing_ = false;
    grown_cv_.notify_all();
    if (!booked.ok()) {
      stats_.over_budget_count++;
      return booked.WithContext(StrCat("nvme arena '", options_.name,
                                       "': growing the swap file by ", FormatBytes(grow), " for ",
                                       KindName(tag.kind), " owner ", tag.owner_id));
    }
    if (switched) {
      stats_.grows_without_fallocate = true;
      Log(LogLevel::kWarning,
          StrCat(
              "nvme arena '", options_.name, "': the filesystem of '", options_.directory,
              "' has no fallocate (EOPNOTSUPP); the swap file grows with ftruncate, so running out "
              "of space is reported by the write that meets it, not when the file grows"));
    }
    if (err != 0 && options_.node != nullptr) options_.node->Release(NodeTier::kNvme, grow);
    if (err != 0) {
      stats_.no_space_count++;
      return GrowthError(options_, capacity, grow, err);
    }
    Status st = capacity == 0 ? extents_.AddSpan(0, grow) : extents_.GrowSpan(0, grow);
    if (!st.ok()) return st;
    stats_.grow_count++;
  }
}

uint64_t NvmeArena::NewGenerationLocked(uint64_t offset) {
  const uint64_t generation = ++next_generation_;
  checks_[offset] = Check{false, 0, generation};
  return generation;
}

Status NvmeArena::Free(uint64_t offset) {
  SPILLWAY_VALIDATE_ON_EXIT(*this);  // first: runs after every lock below is released
  SPILLWAY_RETURN_IF_ERROR(process_.Check("NvmeArena", "Free"));
  std::lock_guard<std::mutex> lock(mu_);
  if (live_->Find(offset) == nullptr) {
    live_->NoteBadFree();
    return Status::InvalidArgument(live_->DescribeBadFree(offset, offset < extents_.span_bytes()));
  }
  extents_.Free(offset, live_->Erase(offset, LiveTable::FreeReason::kFreed).bytes);
  checks_.erase(offset);
  return Status::Ok();
}

Status NvmeArena::CheckExtentLocked(uint64_t offset, uint64_t bytes, const char* verb,
                                    std::string* what) const {
  const LiveTable::Live* live = live_->Find(offset);
  if (live == nullptr) {
    return Status::InvalidArgument(
        StrCat(verb, ": ", live_->DescribeBadFree(offset, offset < extents_.span_bytes())));
  }
  *what = StrCat(KindName(live->tag.kind), " owner ", live->tag.owner_id, " (",
                 FormatBytes(live->requested), " at offset ", offset, " of the swap file in '",
                 options_.directory, "')");
  if (bytes != live->requested) {
    return Status::InvalidArgument(StrCat(verb, " of ", bytes, " bytes into ", *what,
                                          ": the extent holds ", live->requested,
                                          " bytes; transfer exactly that many"));
  }
  return Status::Ok();
}

Status NvmeArena::Write(uint64_t offset, const void* src, uint64_t bytes) {
  SPILLWAY_ASSIGN_OR_RETURN(const Transfer t, SubmitWrite(offset, src, bytes));
  return Complete(t);
}

Status NvmeArena::Read(uint64_t offset, void* dst, uint64_t bytes) {
  SPILLWAY_ASSIGN_OR_RETURN(const Transfer t, SubmitRead(offset, dst, bytes));
  return Complete(t);
}

Result<NvmeArena::Transfer> NvmeArena::SubmitWrite(uint64_t offset, const void* src,
                                                   uint64_t bytes) {
  SPILLWAY_VALIDATE_ON_EXIT(*this);  // first: runs after every lock below is released
  SPILLWAY_RETURN_IF_ERROR(process_.Check("NvmeArena", "Write"));
  if (src == nullptr) return Status::InvalidArgument("NvmeArena::Write: null source");
  Transfer t;
  t.offset = offset;
  t.bytes = bytes;
  t.write = true;
  t.data = src;
  {
    std::lock_guard<std::mutex> lock(mu_);
    SPILLWAY_RETURN_IF_ERROR(CheckExtentLocked(offset, bytes, "NvmeArena::Write", &t.what));
    // Until this write completes, the old contents are gone.
    t.generation = NewGenerationLocked(offset);
  }
  Result<Ticket> ticket = engine_->SubmitWrite(file_id_, offset, src, bytes);
  if (!ticket.ok()) {
    std::lock_guard<std::mutex> lock(mu_);
    stats_.write_failures++;
    return ticket.status().WithContext(
        StrCat("writing ", t.what, "; the host copy is untouched and still valid"));
  }
  t.ticket = *ticket;
  // The checksum, while the transfer is in flight (the source is unmodified until Complete).
  t.crc = options_.checksum ? Crc32c(src, bytes) : 0;
  return t;
}

Result<NvmeArena::Transfer> NvmeArena::SubmitRead(uint64_t offset, void* dst, uint64_t bytes) {
  SPILLWAY_RETURN_IF_ERROR(process_.Check("NvmeArena", "Read"));
  if (dst == nullptr) return Status::InvalidArgument("NvmeArena::Read: null destination");
  Transfer t;
  t.offset = offset;
  t.bytes = bytes;
  t.data = dst;
  {
    std::lock_guard<std::mutex> lock(mu_);
    SPILLWAY_RETURN_IF_ERROR(CheckExtentLocked(offset, bytes, "NvmeArena::Read", &t.what));
    const Check& check = checks_.at(offset);
    if (!check.valid) {
      return Status::FailedPrecondition(StrCat("reading ", t.what,
                                               ": it holds no valid data (never written, or its "
                                               "last write failed)"));
    }
    t.crc = check.crc;
  }
  Result<Ticket> ticket = engine_->SubmitRead(file_id_, offset, dst, bytes);
  if (!ticket.ok()) {
    std::lock_guard<std::mutex> lock(mu_);
    stats_.read_failures++;
    return ticket.status().WithContext(
        StrCat("reading ", t.what, "; the destination is not valid"));
  }
  t.ticket = *ticket;
  return t;
}

Status NvmeArena::Complete(const Transfer& t) {
  SPILLWAY_VALIDATE_ON_EXIT(*this);  // first: runs after every lock below is released
  const Status st = engine_->Wait(t.ticket);
  if (t.write) {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = checks_.find(t.offset);
    if (!st.ok()) {
      stats_.write_failures++;
      return st.WithContext(
          StrCat("writing ", t.what, "; the host copy is untouched and still valid"));
    }
    if (it == checks_.end() || it->second.generation != t.generation) {
      return Status::FailedPrecondition(StrCat("writing ", t.what, ": ", StaleWrite(t.offset)));
    }
    it->second = Check{true, t.crc, t.generation};
    stats_.written_bytes += t.bytes;
    return Status::Ok();
  }
  if (!st.ok()) {
    std::lock_guard<std::mutex> lock(mu_);
    stats_.read_failures++;
    return st.WithContext(StrCat("reading ", t.what, "; the destination is not valid"));
  }
  if (options_.checksum) {
    const uint32_t crc = Crc32c(t.data, t.bytes);
    if (crc != t.crc) {
      std::lock_guard<std::mutex> lock(mu_);
      stats_.checksum_failures++;
      char hex[64];
      std::snprintf(hex, sizeof(hex), "stored crc32c 0x%08x, read back 0x%08x", t.crc, crc);
      return Status::Make(StatusCode::kChecksumMismatch,
                          StrCat("checksum mismatch reading ", t.what, ": ", hex,
                                 ". The data on disk is corrupt; the destination holds the bad "
                                 "bytes and must not be used. Restore from the host copy or a "
                                 "checkpoint"));
    }
  }
  std::lock_guard<std::mutex> lock(mu_);
  stats_.read_bytes += t.bytes;
  return Status::Ok();
}

Status NvmeArena::CheckRangeLocked(uint64_t offset, uint64_t range_offset, uint64_t length,
                                   const char* verb) const {
  const LiveTable::Live* live = live_->Find(offset);
  if (live == nullptr) {
    return Status::InvalidArgument(
        StrCat(verb, ": ", live_->DescribeBadFree(offset, offset < extents_.span_bytes())));
  }
  // Written so that no sum can wrap: range_offset + length <= requested.
  const bool inside = length <= live->requested && range_offset <= live->requested - length;
  if (length == 0 || range_offset % alignment_ != 0 || !inside ||
      (length % alignment_ != 0 && range_offset + length != live->requested)) {
    return Status::InvalidArgument(StrCat(verb, ": range at ", range_offset, " of ", length,
                                          " bytes of the extent at offset ", offset, " (",
                                          live->requested, " bytes) must start on the alignment ",
                                          alignment_, " and end on it or at the extent's end"));
  }
  return Status::Ok();
}

Result<uint32_t> NvmeArena::ExpectedChecksum(uint64_t offset, uint64_t bytes) const {
  SPILLWAY_RETURN_IF_ERROR(process_.Check("NvmeArena", "ExpectedChecksum"));
  std::lock_guard<std::mutex> lock(mu_);
  std::string what;
  SPILLWAY_RETURN_IF_ERROR(CheckExtentLocked(offset, bytes, "NvmeArena::ExpectedChecksum", &what));
  const Check& c = checks_.at(offset);
  if (!c.valid) {
    return Status::FailedPrecondition(StrCat("reading ", what,
                                             ": it holds no valid data (never "
                                             "written, or its last write failed)"));
  }
  return c.crc;
}

Result<Ticket> NvmeArena::SubmitReadRange(uint64_t offset, uint64_t range_offset, void* dst,
                                          uint64_t length) {
  SPILLWAY_RETURN_IF_ERROR(process_.Check("NvmeArena", "SubmitReadRange"));
  {
    std::lock_guard<std::mutex> lock(mu_);
    SPILLWAY_RETURN_IF_ERROR(
        CheckRangeLocked(offset, range_offset, length, "NvmeArena::SubmitReadRange"));
  }
  return engine_->SubmitRead(file_id_, offset + range_offset, dst, length);
}

Result<uint64_t> NvmeArena::BeginWrite(uint64_t offset, uint64_t bytes) {
  SPILLWAY_VALIDATE_ON_EXIT(*this);  // first: runs after every lock below is released
  SPILLWAY_RETURN_IF_ERROR(process_.Check("NvmeArena", "BeginWrite"));
  std::lock_guard<std::mutex> lock(mu_);
  std::string what;
  SPILLWAY_RETURN_IF_ERROR(CheckExtentLocked(offset, bytes, "NvmeArena::BeginWrite", &what));
  return NewGenerationLocked(offset);
}

Result<Ticket> NvmeArena::SubmitWriteRange(uint64_t offset, uint64_t range_offset, const void* src,
                                           uint64_t length) {
  SPILLWAY_RETURN_IF_ERROR(process_.Check("NvmeArena", "SubmitWriteRange"));
  {
    std::lock_guard<std::mutex> lock(mu_);
    SPILLWAY_RETURN_IF_ERROR(
        CheckRangeLocked(offset, range_offset, length, "NvmeArena::SubmitWriteRange"));
  }
  return engine_->SubmitWrite(file_id_, offset + range_offset, src, length);
}

Status NvmeArena::CommitWrite(uint64_t offset, uint64_t bytes, uint32_t crc, uint64_t generation) {
  SPILLWAY_VALIDATE_ON_EXIT(*this);  // first: runs after every lock below is released
  SPILLWAY_RETURN_IF_ERROR(process_.Check("NvmeArena", "CommitWrite"));
  std::lock_guard<std::mutex> lock(mu_);
  std::string what;
  SPILLWAY_RETURN_IF_ERROR(CheckExtentLocked(offset, bytes, "NvmeArena::CommitWrite", &what));
  Check& c = checks_[offset];
  if (c.generation != generation) {
    return Status::FailedPrecondition(
        StrCat("committing a write to ", what, ": ", StaleWrite(offset)));
  }
  c = Check{true, options_.checksum ? crc : 0, generation};
  stats_.written_bytes += bytes;
  return Status::Ok();
}

NvmeArenaStats NvmeArena::Stats() const {
  std::lock_guard<std::mutex> lock(mu_);
  NvmeArenaStats s = stats_;
  static_cast<LiveStats&>(s) = live_->stats();
  s.capacity_bytes = extents_.span_bytes();
  s.free_bytes = extents_.free_bytes();
  return s;
}

Status NvmeArena::Validate() const {
  if (!process_.InOwner()) return Status::Ok();  // as HostArena::Validate: a child walks nothing
  std::lock_guard<std::mutex> lock(mu_);
  SPILLWAY_RETURN_IF_ERROR(live_->Validate());
  const auto allocated = live_->Extents();
  SPILLWAY_RETURN_IF_ERROR(extents_.Validate(allocated));
  for (const auto& [off, bytes] : allocated) {
    if (off % alignment_ != 0 || bytes % alignment_ != 0) {
      return Status::Internal(StrCat("Validate: extent at ", off, " is not aligned"));
    }
  }
  if (extents_.span_bytes() != live_->stats().live_bytes + extents_.free_bytes()) {
    return Status::Internal("Validate: capacity != live + free");
  }
  if (extents_.span_bytes() > options_.budget_bytes) {
    return Status::Internal("Validate: the swap file is larger than the budget");
  }
  if (checks_.size() != allocated.size()) {
    return Status::Internal("Validate: checksum table and live table differ");
  }
  for (const auto& [off, c] : checks_) {
    if (live_->Find(off) == nullptr) {
      return Status::Internal(
          StrCat("Validate: a checksum for offset ", off, ", which is not live"));
    }
    if (c.generation > next_generation_) {
      return Status::Internal(StrCat("Validate: offset ", off, " has generation ", c.generation,
                                     " from the future (next is ", next_generation_, ")"));
    }
  }
  return Status::Ok();
}

Status NvmeArena::CollectBoundary(BoundaryKind kind, int64_t epoch, int64_t step, TierReport* out) {
  SPILLWAY_VALIDATE_ON_EXIT(*this);  // first: runs after every lock below is released
  SPILLWAY_RETURN_IF_ERROR(process_.Check("NvmeArena", "CollectBoundary"));
  LiveTable::Traces traces;
  out->tier = options_.name;
  {
    std::lock_guard<std::mutex> lock(mu_);
    live_->CollectEscapes(kind, epoch, step, options_.policy, out, &traces,
                          [this](uint64_t off, uint64_t bytes) {
                            extents_.Free(off, bytes);
                            checks_.erase(off);
                          });
    out->committed_bytes = extents_.span_bytes();
  }
  LiveTable::FinishEscapes(*ledger_, traces, out);
  return LiveTable::EscapeError(StrCat("nvme arena '", options_.name, "'"), kind, epoch, step,
                                *out);
}

void NvmeArena::ReleaseScope(ScopeId scope, TierReport* out) {
  SPILLWAY_VALIDATE_ON_EXIT(*this);  // first: runs after every lock below is released
  out->tier = options_.name;
  if (!process_.InOwner()) return;  // a forked child frees nothing of the parent's
  std::lock_guard<std::mutex> lock(mu_);
  out->policy = options_.policy;
  live_->ReleaseScope(scope, out, [this](uint64_t off, uint64_t bytes) {
    extents_.Free(off, bytes);
    checks_.erase(off);
  });
  out->committed_bytes = extents_.span_bytes();
}

}  // namespace spillway::allocator
