// The leak detector's ground truth checked against a mechanism with a known answer: after fork(),
// a parent that rewrites N MiB of ordinary memory grows the tree's summed PSS by N MiB (the
// copies), and the same memory under MADV_DONTFORK does not. Real processes, real /proc.
#include "spillway/cli/proc_memory.h"

#include <gtest/gtest.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstring>

namespace spillway::cli {
namespace {

constexpr size_t kBytes = 64ull << 20;

// Tree anonymous-PSS growth when the parent rewrites a touched region while a forked child holds
// it.
int64_t CowGrowth(bool dontfork) {
  void* p = mmap(nullptr, kBytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  EXPECT_NE(p, MAP_FAILED);
  if (dontfork) {
    EXPECT_EQ(madvise(p, kBytes, MADV_DONTFORK), 0);
  }
  std::memset(p, 1, kBytes);
  int gate[2];
  EXPECT_EQ(pipe(gate), 0);
  const pid_t child = fork();
  if (child == 0) {
    char c;
    close(gate[1]);
    (void)!read(gate[0], &c, 1);  // waits until the parent closes its end
    _exit(0);
  }
  close(gate[0]);
  const auto before = ProcessTreeMemory(getpid());
  EXPECT_TRUE(before.ok());
  EXPECT_EQ(before->processes, 2u);
  std::memset(p, 2, kBytes);  // the "first optimizer step after the fork"
  const auto after = ProcessTreeMemory(getpid());
  EXPECT_TRUE(after.ok());
  close(gate[1]);
  int st = 0;
  waitpid(child, &st, 0);
  munmap(p, kBytes);
  return static_cast<int64_t>(after->pss_anon_bytes) - static_cast<int64_t>(before->pss_anon_bytes);
}

TEST(ProcMemoryTest, CopyOnWriteAfterForkShowsAsTreePssGrowth) {
  const int64_t grown = CowGrowth(/*dontfork=*/false);
  std::printf("ordinary memory: tree anonymous PSS grew %.1f MiB after rewriting %zu MiB\n",
              grown / 1048576.0, kBytes >> 20);
  EXPECT_GT(grown, static_cast<int64_t>(kBytes) * 9 / 10);
  EXPECT_LT(grown, static_cast<int64_t>(kBytes) * 11 / 10);
}

TEST(ProcMemoryTest, DontForkMemoryIsNotCopied) {
  const int64_t grown = CowGrowth(/*dontfork=*/true);
  std::printf("MADV_DONTFORK memory: tree anonymous PSS grew %.1f MiB\n", grown / 1048576.0);
  EXPECT_LT(grown, 4 << 20);
}

TEST(ProcMemoryTest, AMissingProcessIsAnError) {
  auto m = ProcessTreeMemory(0x3fffffff);
  ASSERT_FALSE(m.ok());
  EXPECT_NE(m.status().message().find("smaps_rollup"), std::string::npos);
}

}  // namespace
}  // namespace spillway::cli
