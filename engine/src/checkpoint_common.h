// What the checkpoint file writer, reader and durable small files share (private to engine/):
// errno mapping, the parent directory, releasing a registered file, the damaged-file error.
#pragma once

#include <unistd.h>

#include <cerrno>
#include <filesystem>
#include <string>

#include "spillway/allocator/io_engine.h"
#include "spillway/base/status.h"

namespace spillway::engine::checkpoint {

inline constexpr uint64_t kMaxHeaderBytes = 100ull << 20;  // safetensors' own limit

inline std::string Parent(const std::string& path) {
  std::string p = std::filesystem::path(path).parent_path().string();
  return p.empty() ? "." : p;
}

inline Status Errno(int err, std::string what) {
  return Status::FromErrno(
      err == ENOSPC || err == EFBIG || err == EDQUOT ? StatusCode::kNoSpace : StatusCode::kIoError,
      err, std::move(what));
}

// Closes `fd` after unregistering it; the first failure wins.
inline Status Release(allocator::IoEngine* io, int* file_id, int* fd, const std::string& path) {
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

inline Status Damaged(const std::string& path, const std::string& what) {
  return Status::Make(StatusCode::kChecksumMismatch,
                      StrCat("checkpoint file ", path, ": ", what,
                             "; the file is damaged or not a safetensors file: load an older "
                             "checkpoint or restore this one from a copy"));
}

}  // namespace spillway::engine::checkpoint
