// Helpers for the io_uring and NVMe tests: a swap directory under the build tree (or
// SPILLWAY_TEST_NVME_DIR), an O_DIRECT scratch file, random bytes.
#pragma once

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "spillway/allocator/io_engine.h"
#include "spillway/allocator/io_faults.h"
#include "spillway/allocator/nvme_arena.h"
#include "spillway/base/bytes.h"
#include "test_util.h"

namespace spillway::allocator::testing {

inline std::string NvmeTestDir() {
  const char* env = std::getenv("SPILLWAY_TEST_NVME_DIR");
  std::string dir = env ? env : "nvme_test_swap";
  mkdir(dir.c_str(), 0700);
  return dir;
}

// An anonymous O_DIRECT file in the test directory.
inline int OpenScratch() {
  int fd = open(NvmeTestDir().c_str(), O_TMPFILE | O_RDWR | O_DIRECT | O_CLOEXEC, 0600);
  EXPECT_GE(fd, 0) << "O_TMPFILE|O_DIRECT in " << NvmeTestDir() << ": " << strerror(errno);
  return fd;
}

inline void FillRandom(void* p, size_t n, uint64_t seed) {
  std::mt19937_64 rng(seed);
  auto* b = static_cast<unsigned char*>(p);
  size_t i = 0;
  for (; i + 8 <= n; i += 8) {
    uint64_t v = rng();
    std::memcpy(b + i, &v, 8);
  }
  for (; i < n; ++i) b[i] = static_cast<unsigned char>(rng());
}

// Overwrites one byte of the swap file through a second, buffered descriptor of the same unlinked
// file; an O_DIRECT read writes dirty page-cache pages back first, so it sees the change.
inline void FlipByteOnDisk(const NvmeArena& nvme, uint64_t offset) {
  const std::string self = "/proc/self/fd/" + std::to_string(nvme.fd_for_testing());
  int fd = open(self.c_str(), O_RDWR);
  ASSERT_GE(fd, 0) << strerror(errno);
  char byte;
  ASSERT_EQ(pread(fd, &byte, 1, static_cast<off_t>(offset)), 1);
  byte ^= 0x40;
  ASSERT_EQ(pwrite(fd, &byte, 1, static_cast<off_t>(offset)), 1);
  ASSERT_EQ(fsync(fd), 0);
  close(fd);
}

// A ledger, a pageable host arena and an engine on one backend.
struct IoRig {
  explicit IoRig(bool thread_pool, IoFaults* faults = nullptr, uint32_t depth = 8,
                 uint64_t block = 1 << 20) {
    HostArenaOptions o = PageableOptions(&ledger);
    o.budget_bytes = 1024 * kMiB;
    arena = MakeArena(o);
    IoEngineOptions e;
    e.arena = arena.get();
    e.force_thread_pool = thread_pool;
    e.faults = faults;
    e.queue_depth = depth;
    e.block_size = block;
    auto r = IoEngine::Create(e);
    EXPECT_TRUE(r.ok()) << r.status().ToString();
    if (r.ok()) engine = std::move(r.value());
  }
  ~IoRig() {
    engine.reset();  // the engine goes before the arena it registered
    arena.reset();
  }
  void* HostBuffer(uint64_t bytes) {
    auto p = arena->Allocate(bytes, Tag(Kind::kSwapBuffer, Lifetime::kPersistent));
    EXPECT_TRUE(p.ok()) << p.status().ToString();
    return p.ok() ? *p : nullptr;
  }
  Ledger ledger;
  std::unique_ptr<HostArena> arena;
  std::unique_ptr<IoEngine> engine;
};

}  // namespace spillway::allocator::testing
