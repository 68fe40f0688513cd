// The checkpoint file writer (FileWriter) and the dtype table: see checkpoint_file.h and
// docs/checkpoint.md. The reader is checkpoint_reader.cc, the durable small files durable_file.cc.
#include "spillway/engine/checkpoint_file.h"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <nlohmann/json.hpp>

#include "checkpoint_common.h"
#include "spillway/allocator/crc32c.h"

namespace spillway::engine::checkpoint {

uint64_t DTypeBytes(std::string_view d) {
  if (d == "F64" || d == "I64" || d == "U64") return 8;
  if (d == "F32" || d == "I32" || d == "U32") return 4;
  if (d == "F16" || d == "BF16" || d == "I16" || d == "U16") return 2;
  if (d == "U8" || d == "I8" || d == "BOOL") return 1;
  return 0;
}

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
  SPILLWAY_ASSIGN_OR_RETURN(w->file_id_, io->RegisterFile(w->fd_, path, 1));
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
    Close().IgnoreError();  // the fsync error is the one to report
    return Errno(err, StrCat("fsync of checkpoint file ", path_));
  }
  SPILLWAY_RETURN_IF_ERROR(Close());
  if (hook_) hook_("file");
  return records_;
}

}  // namespace spillway::engine::checkpoint
