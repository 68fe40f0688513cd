// Durable small files (the manifest, `latest`): written to a temporary name, fsynced, renamed,
// the directory fsynced. See checkpoint_file.h and docs/checkpoint.md.
#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <filesystem>

#include "checkpoint_common.h"
#include "spillway/engine/checkpoint_file.h"

namespace spillway::engine::checkpoint {

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
