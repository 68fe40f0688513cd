// Checkpoint files: see checkpoint_file.h and docs/checkpoint.md.
#include "spillway/engine/checkpoint_file.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <nlohmann/json.hpp>

#include "spillway/allocator/crc32c.h"

namespace spillway::engine::checkpoint {
namespace {

constexpr uint64_t kMaxHeaderBytes = 100ull << 20;  // safetensors' own limit

std::string Parent(const std::string& path) {
  std::string p = std::filesystem::path(path).parent_path().string();
  return p.empty() ? "." : p;
}

Status Errno(int err, std::string what) {
  return Status::FromErrno(
      err == ENOSPC || err == EFBIG || err == EDQUOT ? StatusCode::kNoSpace : StatusCode::kIoError,
      err, std::move(what));
}

// Closes `fd` after unregistering it; the first failure wins.
Status Release(allocator::IoEngine* io, int* file_id, int* fd, const std::string& path) {
  Status st;
  if (*file_id >= 0) {
    st = io->UnregisterFile(*file_id);
    *file_id = -1;
  }
  if (*fd >= 0) {
    if (::close(*fd) != 0 && st.ok()) st = Errno(errno, StrCat("closing ", path));
    *fd = -1;
  }
  return st;
}

Status Damaged(const std::string& path, const std::string& what) {
  return Status::Make(StatusCode::kChecksumMismatch,
                      StrCat("checkpoint file ", path, ": ", what,
                             "; the file is damaged or not a safetensors file: load an older "
                             "checkpoint or restore this one from a copy"));
}

}  // namespace

uint64_t DTypeBytes(std::string_view d) {
  if (d == "F64" || d == "I64" || d == "U64") return 8;
  if (d == "F32" || d == "I32" || d == "U32") return 4;
  if (d == "F16" || d == "BF16" || d == "I16" || d == "U16") return 2;
  if (d == "U8" || d == "I8" || d == "BOOL") return 1;
  return 0;
}

// ---- FileWriter ----

FileWriter::FileWriter(std::string path, std::vector<TensorRecord> records, uint64_t data_start,
                       allocator::IoEngine* io, FaultHook hook)
    : path_(std::move(path)),
      records_(std::move(records)),
      data_start_(data_start),
      io_(io),
      hook_(std::move(hook)) {}

FileWriter::~FileWriter() { (void)Close(); }

Status FileWriter::Close() { return Release(io_, &file_id_, &fd_, path_); }

Result<std::unique_ptr<FileWriter>> FileWriter::Create(const std::string& path,
                                                       std::vector<TensorSpec> specs,
                                                       allocator::IoEngine* io, FaultHook hook) {
  if (io == nullptr) return Status::InvalidArgument("a checkpoint file needs the io_uring engine");
  nlohmann::json header = nlohmann::json::object();
  std::vector<TensorRecord> records;
  uint64_t offset = 0;
  for (TensorSpec& s : specs) {
    uint64_t n = DTypeBytes(s.dtype);
    for (int64_t d : s.shape) n *= static_cast<uint64_t>(std::max<int64_t>(d, 0));
    if (DTypeBytes(s.dtype) == 0 || n != s.bytes || s.name.empty() || s.name == "__metadata__" ||
        header.contains(s.name)) {
      return Status::InvalidArgument(StrCat("checkpoint tensor '", s.name, "' (", s.dtype, ", ",
                                            s.bytes,
                                            " bytes) is not a valid entry: a unique name, a "
                                            "safetensors dtype and bytes = elements x dtype size"));
    }
    header[s.name] = {
        {"dtype", s.dtype}, {"shape", s.shape}, {"data_offsets", {offset, offset + n}}};
    TensorRecord r;
    r.begin = offset;
    r.end = offset + n;
    r.spec = std::move(s);
    records.push_back(std::move(r));
    offset += n;
  }
  std::string text = header.dump();
  text.resize((text.size() + 7) / 8 * 8, ' ');
  std::string bytes(8, '\0');
  const uint64_t len = text.size();
  for (int i = 0; i < 8; ++i) bytes[i] = static_cast<char>((len >> (8 * i)) & 0xff);
  bytes += text;

  std::unique_ptr<FileWriter> w(
      new FileWriter(path, std::move(records), bytes.size(), io, std::move(hook)));
  w->fd_ = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (w->fd_ < 0) return Errno(errno, StrCat("creating checkpoint file ", path));
  // Buffered, not O_DIRECT: safetensors packs tensors back to back, so their offsets are not
  // aligned; the page cache absorbs that and the fsync in Finish makes it durable.
  auto id = io->RegisterFile(w->fd_, path, 1);
  if (!id.ok()) return id.status();
  w->file_id_ = *id;
  SPILLWAY_RETURN_IF_ERROR(io->Write(w->file_id_, 0, bytes.data(), bytes.size())
                               .WithContext(StrCat("writing the header of ", path)));
  if (w->hook_) w->hook_("header");
  return w;
}

Status FileWriter::Write(const void* data) {
  if (fd_ < 0 || next_ >= records_.size()) {
    return Status::FailedPrecondition(StrCat("checkpoint file ", path_, ": ", records_.size(),
                                             " tensors were declared and all are written (or the "
                                             "file is finished)"));
  }
  TensorRecord& r = records_[next_];
  const char* p = static_cast<const char*>(data);
  const uint64_t n = r.spec.bytes, half = n / 2;
  const uint64_t at = data_start_ + r.begin;
  // Two requests, so that the fault seam can stop the process with half a tensor on its way.
  std::vector<allocator::Ticket> tickets;
  Status st;
  for (const auto& [off, len] : {std::pair<uint64_t, uint64_t>{0, half}, {half, n - half}}) {
    if (len == 0) continue;
    auto t = io_->SubmitWrite(file_id_, at + off, p + off, len);
    if (!t.ok()) {
      st = t.status();
      break;
    }
    tickets.push_back(*t);
    if (off == 0 && hook_) hook_("tensor-half");
  }
  r.crc32c = allocator::Crc32c(p, n);  // while the chunks are in flight; the bytes do not change
  for (allocator::Ticket t : tickets) {
    Status w = io_->Wait(t);
    if (st.ok()) st = w;
  }
  if (!st.ok()) return st.WithContext(StrCat("writing tensor '", r.spec.name, "' to ", path_));
  ++next_;
  if (hook_) hook_("tensor");
  return Status::Ok();
}

Result<std::vector<TensorRecord>> FileWriter::Finish() {
  if (next_ != records_.size()) {
    return Status::FailedPrecondition(StrCat("checkpoint file ", path_, ": ", next_, " of ",
                                             records_.size(),
                                             " tensors written; write them all "
                                             "before Finish"));
  }
  if (fd_ < 0)
    return Status::FailedPrecondition(StrCat("checkpoint file ", path_, " is already finished"));
  if (::fsync(fd_) != 0) {
    const int err = errno;
    (void)Close();
    return Errno(err, StrCat("fsync of checkpoint file ", path_));
  }
  SPILLWAY_RETURN_IF_ERROR(Close());
  if (hook_) hook_("file");
  return records_;
}

// ---- FileReader ----

FileReader::~FileReader() { (void)Release(io_, &file_id_, &fd_, path_); }

Result<std::unique_ptr<FileReader>> FileReader::Open(const std::string& path,
                                                     allocator::IoEngine* io) {
  if (io == nullptr) return Status::InvalidArgument("a checkpoint file needs the io_uring engine");
  std::unique_ptr<FileReader> r(new FileReader(path, io));
  r->fd_ = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (r->fd_ < 0) {
    const int err = errno;
    return Status::FromErrno(err == ENOENT ? StatusCode::kInvalidArgument : StatusCode::kIoError,
                             err,
                             StrCat("opening checkpoint file ", path,
                                    err == ENOENT ? " (missing: every rank's file must be in the "
                                                    "checkpoint directory)"
                                                  : ""));
  }
  struct stat sb;
  if (::fstat(r->fd_, &sb) != 0) return Errno(errno, StrCat("fstat of ", path));
  const uint64_t size = static_cast<uint64_t>(sb.st_size);
  auto id = io->RegisterFile(r->fd_, path, 1);
  if (!id.ok()) return id.status();
  r->file_id_ = *id;
  if (size < 8) return Damaged(path, StrCat("it is ", size, " bytes, shorter than a header"));
  unsigned char len8[8];
  SPILLWAY_RETURN_IF_ERROR(io->Read(r->file_id_, 0, len8, 8));
  uint64_t len = 0;
  for (int i = 0; i < 8; ++i) len |= static_cast<uint64_t>(len8[i]) << (8 * i);
  if (len < 2 || len > kMaxHeaderBytes || len > size - 8) {
    return Damaged(path,
                   StrCat("its header length ", len, " does not fit the file's ", size, " bytes"));
  }
  std::string text(len, '\0');
  SPILLWAY_RETURN_IF_ERROR(io->Read(r->file_id_, 8, text.data(), len));
  nlohmann::json h = nlohmann::json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (!h.is_object()) return Damaged(path, "its header is not a JSON object");
  r->data_start_ = 8 + len;
  for (auto it = h.begin(); it != h.end(); ++it) {
    if (it.key() == "__metadata__") continue;
    const nlohmann::json& e = it.value();
    const auto bad = [&](const char* what) {
      return Damaged(path, StrCat("tensor '", it.key(), "': ", what));
    };
    if (!e.is_object() || !e.contains("dtype") || !e["dtype"].is_string() || !e.contains("shape") ||
        !e["shape"].is_array() || !e.contains("data_offsets") || !e["data_offsets"].is_array() ||
        e["data_offsets"].size() != 2 || !e["data_offsets"][0].is_number_unsigned() ||
        !e["data_offsets"][1].is_number_unsigned()) {
      return bad("dtype, shape or data_offsets missing or malformed");
    }
    TensorRecord t;
    t.spec.name = it.key();
    t.spec.dtype = e["dtype"].get<std::string>();
    uint64_t n = DTypeBytes(t.spec.dtype);
    if (n == 0) return bad("unknown dtype");
    for (const auto& d : e["shape"]) {
      if (!d.is_number_unsigned() || d.get<uint64_t>() > static_cast<uint64_t>(INT64_MAX)) {
        return bad("a dimension is not a non-negative 64-bit integer");
      }
      t.spec.shape.push_back(d.get<int64_t>());
      if (__builtin_mul_overflow(n, d.get<uint64_t>(), &n))
        return bad("its size overflows 64 bits");
    }
    t.begin = e["data_offsets"][0].get<uint64_t>();
    t.end = e["data_offsets"][1].get<uint64_t>();
    t.spec.bytes = n;
    if (t.end < t.begin || t.end - t.begin != n)
      return bad("data_offsets disagree with dtype and shape");
    r->records_.push_back(std::move(t));
  }
  std::sort(r->records_.begin(), r->records_.end(),
            [](const TensorRecord& a, const TensorRecord& b) {
              return a.begin != b.begin ? a.begin < b.begin : a.end < b.end;  // empty tensors first
            });
  uint64_t expect = 0;
  for (const TensorRecord& t : r->records_) {
    if (t.begin != expect)
      return Damaged(path, StrCat("tensor '", t.spec.name, "' leaves a hole or overlaps"));
    expect = t.end;
  }
  if (r->data_start_ + expect != size) {
    return Damaged(path, StrCat("the header describes ", r->data_start_ + expect,
                                " bytes, the file has ", size, " (truncated or appended to)"));
  }
  return r;
}

const TensorRecord* FileReader::Find(std::string_view name) const {
  for (const TensorRecord& t : records_) {
    if (t.spec.name == name) return &t;
  }
  return nullptr;
}

Result<uint32_t> FileReader::Read(const TensorRecord& t, void* out) {
  const uint64_t n = t.end - t.begin;
  if (n > 0) {
    SPILLWAY_RETURN_IF_ERROR(
        io_->Read(file_id_, data_start_ + t.begin, out, n)
            .WithContext(StrCat("reading tensor '", t.spec.name, "' from ", path_)));
  }
  return allocator::Crc32c(out, n);
}

Result<uint32_t> FileReader::Checksum(const TensorRecord& t, void* scratch,
                                      uint64_t scratch_bytes) {
  if (scratch_bytes == 0) return Status::InvalidArgument("Checksum needs a scratch buffer");
  uint32_t crc = 0;
  for (uint64_t off = 0; off < t.end - t.begin; off += scratch_bytes) {
    const uint64_t k = std::min(scratch_bytes, t.end - t.begin - off);
    SPILLWAY_RETURN_IF_ERROR(
        io_->Read(file_id_, data_start_ + t.begin + off, scratch, k)
            .WithContext(StrCat("reading tensor '", t.spec.name, "' from ", path_)));
    crc = allocator::Crc32cExtend(crc, scratch, k);
  }
  return crc;
}

// ---- durable small files ----

Status FsyncDirectory(const std::string& dir) {
  const int fd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd < 0) return Errno(errno, StrCat("opening directory ", dir, " to fsync it"));
  Status st;
  if (::fsync(fd) != 0) st = Errno(errno, StrCat("fsync of directory ", dir));
  ::close(fd);
  return st;
}

Status WriteFileDurably(const std::string& path, const std::string& contents) {
  const std::string tmp = path + ".tmp";
  const int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) return Errno(errno, StrCat("creating ", tmp));
  size_t done = 0;
  while (done < contents.size()) {
    const ssize_t n = ::write(fd, contents.data() + done, contents.size() - done);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) {
      const int err = errno;
      ::close(fd);
      ::unlink(tmp.c_str());
      return Errno(err, StrCat("writing ", tmp));
    }
    done += static_cast<size_t>(n);
  }
  if (::fsync(fd) != 0) {
    const int err = errno;
    ::close(fd);
    ::unlink(tmp.c_str());
    return Errno(err, StrCat("fsync of ", tmp));
  }
  if (::close(fd) != 0) {
    const int err = errno;
    ::unlink(tmp.c_str());
    return Errno(err, StrCat("closing ", tmp));
  }
  if (::rename(tmp.c_str(), path.c_str()) != 0) {
    const int err = errno;
    ::unlink(tmp.c_str());
    return Errno(err, StrCat("renaming ", tmp, " to ", path));
  }
  return FsyncDirectory(Parent(path));
}

Result<std::string> ReadSmallFile(const std::string& path, uint64_t max_bytes) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) {
    const int err = errno;
    return Status::FromErrno(err == ENOENT ? StatusCode::kInvalidArgument : StatusCode::kIoError,
                             err, StrCat("opening ", path));
  }
  std::string out;
  char buf[1 << 16];
  for (;;) {
    const ssize_t n = ::read(fd, buf, sizeof(buf));
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) {
      const int err = errno;
      ::close(fd);
      return Errno(err, StrCat("reading ", path));
    }
    if (n == 0) break;
    out.append(buf, static_cast<size_t>(n));
    if (out.size() > max_bytes) {
      ::close(fd);
      return Status::InvalidArgument(
          StrCat(path, " is larger than ", max_bytes, " bytes; it is not a checkpoint's file"));
    }
  }
  ::close(fd);
  return out;
}

}  // namespace spillway::engine::checkpoint
