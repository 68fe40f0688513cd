// Checkpoint files: safetensors written and read through the io_uring engine, tensor by tensor,
// with a CRC32C per tensor, and the durable small-file and directory operations an atomic
// checkpoint is built from. Torch-free; the trainer's Save/Load (trainer.h) lay checkpoints out
// with these. See docs/checkpoint.md.
//
// safetensors (https://huggingface.co/docs/safetensors): 8 bytes of little-endian header length,
// a JSON header naming each tensor's dtype, shape and [begin, end) offsets into the data that
// follows (padded with spaces to a multiple of 8), then the tensors' bytes back to back. The header
// needs only names, dtypes and shapes, so it is written first and each tensor is then streamed in
// from wherever it lives: nothing is gathered.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "spillway/allocator/io_engine.h"
#include "spillway/base/status.h"

namespace spillway::engine::checkpoint {

struct TensorSpec {
  std::string name;
  std::string dtype;  // safetensors code: F32, U8, ...
  std::vector<int64_t> shape;
  uint64_t bytes = 0;
};

struct TensorRecord {
  TensorSpec spec;
  uint64_t begin = 0, end = 0;  // into the data section, as the header says
  uint32_t crc32c = 0;          // of the tensor's bytes (written: computed; read: 0 until checked)
};

// Bytes per element of a safetensors dtype code; 0 for a code this file does not know.
uint64_t DTypeBytes(std::string_view dtype);

// Fault-injection seam (tests): called with a point name at each step of a save, so that a test can
// SIGKILL the process exactly there. Points: "header", "tensor-half" (half of a tensor's bytes are
// queued), "tensor" (a tensor is written), "file" (fsync'd and closed), and the trainer's own.
using FaultHook = std::function<void(std::string_view point)>;

// Writes one safetensors file through `io`, which must outlive the writer. Owned by one thread.
class FileWriter {
 public:
  // Creates `path` (replacing a file of that name) and writes the header for `specs`, in order.
  static Result<std::unique_ptr<FileWriter>> Create(const std::string& path,
                                                    std::vector<TensorSpec> specs,
                                                    allocator::IoEngine* io, FaultHook hook = {});
  ~FileWriter();  // closes the file; one not finished is left for the caller's directory cleanup
  FileWriter(const FileWriter&) = delete;
  FileWriter& operator=(const FileWriter&) = delete;

  // The next tensor in order: `data` holds its bytes and must not change until this returns. The
  // bytes are queued in the engine's block_size chunks, queue_depth deep; the CRC32C is computed
  // while they are in flight.
  Status Write(const void* data);
  // After every tensor: fsyncs and closes the file; returns each tensor's record with its CRC32C.
  Result<std::vector<TensorRecord>> Finish();

 private:
  FileWriter(std::string path, std::vector<TensorRecord> records, uint64_t data_start,
             allocator::IoEngine* io, FaultHook hook);
  Status Close();

  const std::string path_;
  std::vector<TensorRecord> records_;
  const uint64_t data_start_;
  allocator::IoEngine* const io_;
  const FaultHook hook_;
  int fd_ = -1;
  int file_id_ = -1;
  size_t next_ = 0;
};

// Reads one safetensors file through `io`. The header is checked when the file is opened: a
// truncated file, a header that is not safetensors, an offset out of the file or a hole between
// tensors is an error naming the file.
class FileReader {
 public:
  static Result<std::unique_ptr<FileReader>> Open(const std::string& path, allocator::IoEngine* io);
  ~FileReader();
  FileReader(const FileReader&) = delete;
  FileReader& operator=(const FileReader&) = delete;

  const std::vector<TensorRecord>& tensors() const { return records_; }
  const TensorRecord* Find(std::string_view name) const;  // null when absent
  const std::string& path() const { return path_; }
  // Reads the tensor's bytes into `out` (end - begin bytes); returns their CRC32C.
  Result<uint32_t> Read(const TensorRecord& t, void* out);
  // The CRC32C of the tensor's bytes, read through `scratch` (at least one byte) in pieces.
  Result<uint32_t> Checksum(const TensorRecord& t, void* scratch, uint64_t scratch_bytes);

 private:
  FileReader(std::string path, allocator::IoEngine* io) : path_(std::move(path)), io_(io) {}
  const std::string path_;
  allocator::IoEngine* const io_;
  std::vector<TensorRecord> records_;
  uint64_t data_start_ = 0;
  int fd_ = -1;
  int file_id_ = -1;
};

// fsync of a directory, so that the names created, renamed or removed in it are durable.
Status FsyncDirectory(const std::string& dir);
// Writes `contents` to `path` atomically and durably: a temporary name in the same directory,
// fsync, rename over `path`, fsync of the directory. A crash leaves the old file or the new one.
Status WriteFileDurably(const std::string& path, const std::string& contents);
// The whole file, refusing one larger than `max_bytes`.
Result<std::string> ReadSmallFile(const std::string& path, uint64_t max_bytes = 64ull << 20);

}  // namespace spillway::engine::checkpoint
