// The checkpoint file reader (FileReader): see checkpoint_file.h and docs/checkpoint.md.
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <nlohmann/json.hpp>

#include "checkpoint_common.h"
#include "spillway/allocator/crc32c.h"
#include "spillway/engine/checkpoint_file.h"

namespace spillway::engine::checkpoint {

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
  SPILLWAY_ASSIGN_OR_RETURN(r->file_id_, io->RegisterFile(r->fd_, path, 1));
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

}  // namespace spillway::engine::checkpoint
