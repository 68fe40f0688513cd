// One arena region that is both pinned and an io_uring fixed buffer: the state the store and the
// engine rely on when a partition moves between NVMe and a device (docs/nvme.md). On a CPU machine
// the pin is mlock (the kernel's own "Locked" count for the mapping says so); on a lent GPU it is
// cudaHostRegister (the suite whose name starts with Cuda gets the gpu label and is skipped, and
// reported as skipped, without a device). In both, every chunk of a transfer through the region
// uses read/write_fixed and none is bounced.
#include <gtest/gtest.h>

#include <cstdio>
#include <cstring>
#include <fstream>
#include <sstream>
#include <string>

#include "nvme_test_util.h"
#include "spillway/allocator/host_arena.h"
#include "spillway/allocator/io_engine.h"
#include "spillway/base/bytes.h"

namespace spillway::allocator {
namespace {

// The kernel's "Locked:" bytes of the mapping that contains `p` (/proc/self/smaps).
uint64_t LockedBytesOfMappingAt(const void* p) {
  std::ifstream smaps("/proc/self/smaps");
  std::string line;
  bool inside = false;
  const auto addr = reinterpret_cast<uintptr_t>(p);
  while (std::getline(smaps, line)) {
    uintptr_t lo = 0, hi = 0;
    if (std::sscanf(line.c_str(), "%lx-%lx ", &lo, &hi) == 2 && line.find(':') > line.find('-')) {
      inside = addr >= lo && addr < hi;
      continue;
    }
    if (inside && line.rfind("Locked:", 0) == 0) {
      std::istringstream in(line.substr(7));
      uint64_t kb = 0;
      in >> kb;
      return kb * 1024;
    }
  }
  return 0;
}

void ExpectPinnedAndFixed(PinMode mode) {
  Ledger ledger;
  HostArenaOptions o = testing::PageableOptions(&ledger);
  o.pin = mode;
  auto arena = HostArena::Create(o);
  if (!arena.ok() && arena.status().code() == StatusCode::kUnavailable) {
    GTEST_SKIP() << "this pin mode is not available here: " << arena.status().message();
  }
  ASSERT_TRUE(arena.ok()) << arena.status().ToString();
  IoEngineOptions eo;
  eo.arena = arena->get();
  auto engine = IoEngine::Create(eo);
  ASSERT_TRUE(engine.ok()) << engine.status().ToString();
  if ((*engine)->backend() != IoBackend::kUring) {
    GTEST_SKIP() << "io_uring is not allowed here (" << (*engine)->Stats().fallback_reason
                 << "): no fixed buffers to check";
  }
  const uint64_t bytes = 4 * kMiB;
  auto buf = (*arena)->Allocate(bytes, testing::Tag(Kind::kSwapBuffer, Lifetime::kPersistent));
  if (!buf.ok() && mode == PinMode::kMlock && buf.status().code() == StatusCode::kOutOfMemory) {
    GTEST_SKIP() << "mlock is refused here: " << buf.status().message();
  }
  ASSERT_TRUE(buf.ok()) << buf.status().ToString();
  const HostArenaStats hs = (*arena)->Stats();
  if (mode == PinMode::kMlock) {
    EXPECT_GE(hs.mlocked_bytes, bytes);
    EXPECT_GE(LockedBytesOfMappingAt(*buf), bytes)
        << "the kernel does not count the region as locked";
  } else {
    EXPECT_GE(hs.cuda_registered_bytes, bytes);
  }
  EXPECT_GE((*engine)->Stats().registered_regions, 1u) << "the pinned region is not a fixed buffer";

  const int fd = testing::OpenScratch();
  ASSERT_GE(fd, 0);
  auto file = (*engine)->RegisterFile(fd, "scratch", 4096);
  ASSERT_TRUE(file.ok()) << file.status().ToString();
  testing::FillRandom(*buf, bytes, 7);
  ASSERT_TRUE((*engine)->Write(*file, 0, *buf, bytes).ok());
  std::memset(*buf, 0, bytes);
  ASSERT_TRUE((*engine)->Read(*file, 0, *buf, bytes).ok());
  std::string want(bytes, '\0');
  testing::FillRandom(want.data(), bytes, 7);
  EXPECT_EQ(std::memcmp(want.data(), *buf, bytes), 0);
  const IoEngineStats st = (*engine)->Stats();
  EXPECT_EQ(st.fixed_buffer_chunks, 8u)
      << "4 write and 4 read chunks of 1 MiB, each read/write_fixed";
  EXPECT_EQ(st.bounce_chunks, 0u);
  ASSERT_TRUE((*engine)->UnregisterFile(*file).ok());
  close(fd);
  ASSERT_TRUE((*arena)->Free(*buf).ok());
  engine->reset();
}

TEST(PinnedFixedBufferTest, AnMlockedRegionIsAlsoAnIoUringFixedBuffer) {
#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
  // The sanitizers' mlock interceptor (sanitizer_common) returns success without locking: the
  // kernel would count nothing.
  GTEST_SKIP() << "ASan and TSan make mlock a no-op; the default build runs this test";
#endif
  ExpectPinnedAndFixed(PinMode::kMlock);
}

TEST(CudaPinnedFixedBufferTest, ACudaRegisteredRegionIsAlsoAnIoUringFixedBuffer) {
  ExpectPinnedAndFixed(PinMode::kCuda);
}

}  // namespace
}  // namespace spillway::allocator
