// The process's memory by owner: the smaps classifier on a text of known mappings, the claims of
// the counters on the anonymous rest, and the real /proc/self/smaps with a real arena in it.
#include "spillway/allocator/process_memory.h"

#include <gtest/gtest.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cstdlib>
#include <cstring>
#include <sstream>
#include <string>
#include <vector>

#include "spillway/allocator/fork_fault.h"
#include "spillway/allocator/host_arena.h"
#include "spillway/allocator/node_governor.h"
#include "spillway/base/bytes.h"
#include "test_util.h"

namespace spillway::allocator {
namespace {

using testing::Tag;

uint64_t At(const ProcessMemory& m, MemoryOwner o) { return m.owners[static_cast<int>(o)]; }

// One mapping of an smaps text, `rss_kb` resident.
std::string Mapping(const char* range, const char* perms, const char* path, uint64_t rss_kb) {
  return StrCat(range, " ", perms, " 00000000 08:01 1234                       ", path,
                "\nSize:            9999 kB\nKernelPageSize:     4 kB\nRss:   ", rss_kb,
                " kB\nPss:  1 kB\nVmFlags: rd wr mr mw me ac\n");
}

TEST(ProcessMemoryTest, EachMappingGoesToWhatItsAddressAndPathSay) {
  std::istringstream smaps(
      Mapping("400000-500000", "r-xp", "/usr/bin/python3.11", 100) +
      Mapping("500000-600000", "rw-p", "/usr/bin/python3.11", 10) +
      Mapping("600000-700000", "rw-p", "", 5) +  // python's bss, by its address
      Mapping("700000-800000", "rw-p", "", 6) +  // right after it, and nobody's: not bss
      Mapping("1000000-2000000", "rw-p", "[heap]", 1000) +
      Mapping("10000000-10400000", "rw-p", "", 4096) +  // wholly an arena region
      Mapping("20000000-20400000", "rw-p", "", 2048) +  // half in a region
      Mapping("30000000-30100000", "r--s", "/dev/shm/torch_123_456 (deleted)", 300) +
      Mapping("31000000-31100000", "rw-s", "/memfd:spillway (deleted)", 7) +
      Mapping("32000000-32100000", "r--p", "/data/ckpt/model.safetensors", 400) +
      Mapping("33000000-33100000", "rw-s", "/dev/nvidiactl", 3) +
      Mapping("7f0000000000-7f0000100000", "r-xp", "/usr/lib/libtorch_cpu.so", 2000) +
      Mapping("7f0000100000-7f0000200000", "r--p", "/usr/lib/libtorch_cpu.so", 50) +
      Mapping("7ffd00000000-7ffd00021000", "rw-p", "[stack]", 40) +
      "a line the kernel may add one day\n");
  const std::vector<fork_fault::RegionRange> regions = {{0x20000000, 0x200000},
                                                        {0x10000000, 0x400000}};
  const MappedBytes m = ClassifySmaps(smaps, regions, {{0x600000, 0x100000}});
  EXPECT_EQ(m.mappings, 14u);
  EXPECT_EQ(m.arenas, (4096 + 1024) * 1024u);
  EXPECT_EQ(m.anonymous, (6 + 1000 + 1024) * 1024u);
  EXPECT_EQ(m.libraries, (100 + 10 + 5 + 2000 + 50 + 40) * 1024u);
  EXPECT_EQ(m.shared, (300 + 7) * 1024u);
  EXPECT_EQ(m.files, 400 * 1024u);
  EXPECT_EQ(m.cuda_driver, 3 * 1024u);
  EXPECT_EQ(m.total, m.arenas + m.anonymous + m.libraries + m.shared + m.files + m.cuda_driver);
}

TEST(ProcessMemoryTest, TheCountersSplitTheAnonymousBytesAndTheRestIsUnowned) {
  MappedBytes mapped;
  mapped.arenas = 500 * kMiB;
  mapped.anonymous = 300 * kMiB;
  mapped.libraries = 200 * kMiB;
  HeapCounters c;
  c.torch_cpu = 100 * kMiB;
  c.python = 50 * kMiB;
  c.malloc_in_use = 180 * kMiB;  // torch's 100 among them
  c.malloc_free = 20 * kMiB;
  const ProcessMemory p = AttributeMemory(mapped, c);
  EXPECT_EQ(At(p, MemoryOwner::kTorchCpu), 100 * kMiB);
  EXPECT_EQ(At(p, MemoryOwner::kMalloc), 80 * kMiB) << "torch's CPU tensors are counted once";
  EXPECT_EQ(At(p, MemoryOwner::kPython), 50 * kMiB);
  EXPECT_EQ(At(p, MemoryOwner::kMallocFree), 20 * kMiB);
  EXPECT_EQ(At(p, MemoryOwner::kUnowned), 50 * kMiB);
  EXPECT_EQ(p.total, 1000 * kMiB);
  EXPECT_EQ(p.counted_beyond_resident, 0u);
  EXPECT_DOUBLE_EQ(p.named_fraction(), 0.95);
  EXPECT_NE(DescribeMemory(p).find("unowned 50.0 MiB (95.0% named)"), std::string::npos)
      << DescribeMemory(p);
}

// Counters count bytes handed out, resident or not: past the anonymous bytes they are scaled down,
// the excess is said, and the owners still sum to what is resident.
TEST(ProcessMemoryTest, ClaimsPastWhatIsResidentAreScaledAndSaid) {
  MappedBytes mapped;
  mapped.anonymous = 100 * kMiB;
  HeapCounters c;
  c.torch_cpu = 150 * kMiB;
  c.malloc_in_use = 150 * kMiB;
  c.python = 50 * kMiB;
  const ProcessMemory p = AttributeMemory(mapped, c);
  EXPECT_EQ(p.counted_beyond_resident, 100 * kMiB);
  EXPECT_EQ(At(p, MemoryOwner::kUnowned), 0u);
  EXPECT_EQ(At(p, MemoryOwner::kTorchCpu) + At(p, MemoryOwner::kPython), 100 * kMiB);
  EXPECT_EQ(At(p, MemoryOwner::kTorchCpu), 75 * kMiB);
  EXPECT_EQ(p.total, 100 * kMiB);
  EXPECT_DOUBLE_EQ(p.named_fraction(), 0.0) << "what is claimed twice over may all be nobody's";
  EXPECT_NE(DescribeMemory(p).find("counted beyond resident 100.0 MiB (0.0% named)"),
            std::string::npos)
      << DescribeMemory(p);
}

// The real map: an arena's touched region is the arenas' and leaves the anonymous bytes; an
// anonymous mapping of nobody's is unowned once the counters are read.
TEST(ProcessMemoryTest, AnArenaRegionInThisProcessIsTheArenas) {
  Ledger ledger;
  HostArenaOptions o = testing::PageableOptions(&ledger);
  o.name = "process-memory-test";
  auto arena = testing::MakeArena(o);
  auto before = ReadMappedBytes();
  ASSERT_TRUE(before.ok()) << before.status().ToString();
  auto p = arena->Allocate(32 * kMiB, Tag(Kind::kOptimizerState, Lifetime::kPersistent));
  ASSERT_TRUE(p.ok()) << p.status().ToString();
  std::memset(*p, 1, 32 * kMiB);
  // The negative control: 24 MiB of nobody's, outside every counter.
  void* stray =
      mmap(nullptr, 24 * kMiB, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  ASSERT_NE(stray, MAP_FAILED);
  std::memset(stray, 1, 24 * kMiB);
  auto after = ReadMappedBytes();
  ASSERT_TRUE(after.ok()) << after.status().ToString();
  EXPECT_GE(after->arenas - before->arenas, 32 * kMiB);
  EXPECT_LT(after->arenas - before->arenas, 34 * kMiB);
  EXPECT_GE(after->anonymous, before->anonymous + 24 * kMiB - kMiB);
  HeapCounters c;
  ReadMallocCounters(&c);
  // glibc's count; a sanitizer's allocator replaces glibc's malloc, which then serves nothing.
  if (!testing::kUnderSanitizer) {
    EXPECT_GT(c.malloc_in_use, 0u);
  }
  const ProcessMemory m = AttributeMemory(*after, c);
  EXPECT_GE(At(m, MemoryOwner::kUnowned), 23 * kMiB) << DescribeMemory(m);
  munmap(stray, 24 * kMiB);
  ASSERT_TRUE(arena->Free(*p).ok());
}

// What a rank publishes is in its ledger's row, and the table says it by owner with the share
// named.
TEST(ProcessMemoryTest, ARanksPublishedMemoryIsInItsLedger) {
  NodeGovernorOptions o;
  o.job = StrCat("gtest-memory-", getpid());
  o.ledger = StrCat("ledger-", o.job);
  o.local_rank = 0;
  o.host_budget_bytes = 100 * kMiB;
  o.memory_limit_bytes = 2ull << 30;
  auto g = NodeGovernor::Join(o);
  ASSERT_TRUE(g.ok()) << g.status().ToString();
  EXPECT_EQ((*g)->Stats().ToString().find(" resident "), std::string::npos)
      << "nothing published yet, nothing said";
  MappedBytes mapped;
  mapped.arenas = 60 * kMiB;
  mapped.anonymous = 40 * kMiB;
  HeapCounters c;
  c.torch_cpu = 30 * kMiB;
  c.malloc_in_use = 30 * kMiB;
  (*g)->PublishMemory(AttributeMemory(mapped, c));
  const NodeStats s = (*g)->Stats();
  ASSERT_EQ(s.ranks.size(), 1u);
  EXPECT_EQ(At(s.ranks[0].memory, MemoryOwner::kArenas), 60 * kMiB);
  EXPECT_EQ(At(s.ranks[0].memory, MemoryOwner::kUnowned), 10 * kMiB);
  EXPECT_NE(s.ToString().find("rank 0 resident 100.0 MiB: arenas 60.0 MiB, torch_cpu 30.0 MiB; "
                              "unowned 10.0 MiB (90.0% named)"),
            std::string::npos)
      << s.ToString();
}

// The bss of this test's own executable: a zero-filled array, touched, is the libraries'.
char g_zeroes[8 << 20];

TEST(ProcessMemoryTest, ALoadedObjectsBssIsTheLibrariesByItsAddress) {
  const std::vector<fork_fault::RegionRange> bss = LoadedBss();
  // Its whole pages: the first may share a page with the file-backed data before it.
  const uintptr_t at = (reinterpret_cast<uintptr_t>(g_zeroes) + 4095) & ~uintptr_t{4095};
  const uintptr_t end =
      (reinterpret_cast<uintptr_t>(g_zeroes) + sizeof(g_zeroes)) & ~uintptr_t{4095};
  bool found = false;
  for (const auto& r : bss) found |= at >= r.base && end <= r.base + r.bytes;
  ASSERT_TRUE(found) << "g_zeroes lies in no bss range of " << bss.size();
  auto before = ReadMappedBytes();
  ASSERT_TRUE(before.ok());
  std::memset(g_zeroes, 1, sizeof(g_zeroes));
  auto after = ReadMappedBytes();
  ASSERT_TRUE(after.ok());
  EXPECT_GE(after->libraries, before->libraries + sizeof(g_zeroes) - kMiB);
  if (!testing::kUnderSanitizer) {  // a sanitizer's shadow of the written pages is anonymous
    EXPECT_LT(after->anonymous, before->anonymous + kMiB) << "not the anonymous bytes";
  }
}

TEST(ProcessMemoryTest, AProcessThatIsGoneIsNamed) {
  auto r = ReadMappedBytes("/proc/2147483632/smaps");
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find("cannot read /proc/2147483632/smaps"), std::string::npos)
      << r.status().ToString();
}

}  // namespace
}  // namespace spillway::allocator
