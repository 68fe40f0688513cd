// Fork safety with real fork(): after 4 children are forked, the parent writes every byte of its
// state. Arena memory (MADV_DONTFORK) must not grow the summed PSS of the process tree; the same
// write on malloc memory, and on an arena with fork_safety=inherit, must (the negative controls).
// PSS comes from /proc/<pid>/smaps_rollup: MemFree does not show copy-on-write on these VMs.
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <functional>
#include <string>
#include <utility>
#include <vector>

#include "spillway/allocator/fork_fault.h"
#include "spillway/allocator/host_arena.h"
#include "spillway/base/bytes.h"
#include "test_util.h"

namespace spillway::allocator {
namespace {

using testing::Tag;

constexpr uint64_t kStateBytes = 128 * kMiB;
constexpr int kChildren = 4;

uint64_t PssBytes(pid_t pid) {
  std::ifstream in("/proc/" + std::to_string(pid) + "/smaps_rollup");
  std::string key;
  uint64_t kb = 0;
  while (in >> key) {
    if (key == "Pss:") {
      in >> kb;
      return kb * 1024;
    }
  }
  ADD_FAILURE() << "no Pss line in /proc/" << pid << "/smaps_rollup";
  return 0;
}

struct ForkResult {
  int64_t pss_growth;  // summed PSS after the write minus before
  double write_seconds;
};

// Forks children that block on a pipe, measures summed PSS, writes all state, measures again.
ForkResult WriteAfterFork(unsigned char* state, uint64_t bytes) {
  std::memset(state, 1, bytes);  // the state exists and is resident before the fork
  int pipefd[2];
  EXPECT_EQ(pipe(pipefd), 0);
  std::vector<pid_t> kids;
  for (int i = 0; i < kChildren; ++i) {
    pid_t pid = fork();
    if (pid == 0) {
      close(pipefd[1]);
      char c;
      ssize_t n = read(pipefd[0], &c, 1);  // returns 0 when the parent closes the write end
      _exit(n == 0 ? 0 : 1);
    }
    kids.push_back(pid);
  }
  close(pipefd[0]);
  auto sum = [&] {
    uint64_t s = PssBytes(getpid());
    for (pid_t k : kids) s += PssBytes(k);
    return s;
  };
  const uint64_t before = sum();
  auto t0 = std::chrono::steady_clock::now();
  std::memset(state, 2, bytes);  // the first optimizer step of the next epoch
  const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  const uint64_t after = sum();
  close(pipefd[1]);
  for (pid_t k : kids) {
    int status = 0;
    waitpid(k, &status, 0);
    EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0);
  }
  return {static_cast<int64_t>(after) - static_cast<int64_t>(before), secs};
}

HostArenaOptions ForkOptions(Ledger* ledger, ForkSafety mode) {
  HostArenaOptions o = testing::PageableOptions(ledger);
  o.fork_safety = mode;
  o.budget_bytes = 1024 * kMiB;
  return o;
}

TEST(ForkSafetyTest, ArenaStateIsNotCopiedWhenTheParentWritesAfterFork) {
  Ledger ledger;
  auto arena = testing::MakeArena(ForkOptions(&ledger, ForkSafety::kDontFork));
  auto p = arena->Allocate(kStateBytes, Tag(Kind::kOptimizerState, Lifetime::kPersistent));
  ASSERT_TRUE(p.ok());
  ForkResult r = WriteAfterFork(static_cast<unsigned char*>(*p), kStateBytes);
  std::printf("arena (dontfork): PSS growth %.1f MiB, write %.3f s\n", r.pss_growth / double(kMiB),
              r.write_seconds);
  EXPECT_LT(r.pss_growth, static_cast<int64_t>(kStateBytes / 16));
  EXPECT_EQ(static_cast<unsigned char*>(*p)[kStateBytes - 1], 2);
}

TEST(ForkSafetyTest, NegativeControlMallocStateIsCopied) {
  auto* state = static_cast<unsigned char*>(std::malloc(kStateBytes));
  ASSERT_NE(state, nullptr);
  ForkResult r = WriteAfterFork(state, kStateBytes);
  std::printf("malloc (control): PSS growth %.1f MiB, write %.3f s\n", r.pss_growth / double(kMiB),
              r.write_seconds);
  EXPECT_GT(r.pss_growth, static_cast<int64_t>(kStateBytes * 3 / 4));
  std::free(state);
}

TEST(ForkSafetyTest, NegativeControlArenaWithForkSafetyOffIsCopied) {
  // Same allocator, same detector, one flag different: the flag is what prevents the copy.
  Ledger ledger;
  auto arena = testing::MakeArena(ForkOptions(&ledger, ForkSafety::kInherit));
  auto p = arena->Allocate(kStateBytes, Tag(Kind::kOptimizerState, Lifetime::kPersistent));
  ASSERT_TRUE(p.ok());
  ForkResult r = WriteAfterFork(static_cast<unsigned char*>(*p), kStateBytes);
  std::printf("arena (inherit, control): PSS growth %.1f MiB, write %.3f s\n",
              r.pss_growth / double(kMiB), r.write_seconds);
  EXPECT_GT(r.pss_growth, static_cast<int64_t>(kStateBytes * 3 / 4));
}

TEST(ForkSafetyTest, WipeOnForkArenaIsNotCopiedEither) {
  Ledger ledger;
  auto arena = testing::MakeArena(ForkOptions(&ledger, ForkSafety::kWipeOnFork));
  auto p = arena->Allocate(kStateBytes, Tag(Kind::kOptimizerState, Lifetime::kPersistent));
  ASSERT_TRUE(p.ok());
  ForkResult r = WriteAfterFork(static_cast<unsigned char*>(*p), kStateBytes);
  EXPECT_LT(r.pss_growth, static_cast<int64_t>(kStateBytes / 16));
}

// Runs `body` in a forked child and returns its wait status.
int RunInChild(const std::function<int()>& body) {
  pid_t pid = fork();
  if (pid == 0) _exit(body());
  int status = 0;
  waitpid(pid, &status, 0);
  return status;
}

TEST(ForkSafetyTest, ChildTouchingDontForkMemoryFaultsLoudly) {
  // MADV_DONTFORK: the child has no mapping there. A worker that reads optimizer state crashes
  // instead of silently reading stale or zero data.
  if (testing::kUnderTsan) GTEST_SKIP() << "TSan reroutes fork and SIGSEGV in the child";
  Ledger ledger;
  auto arena = testing::MakeArena(ForkOptions(&ledger, ForkSafety::kDontFork));
  auto p = arena->Allocate(kMiB, Tag(Kind::kOptimizerState, Lifetime::kPersistent));
  ASSERT_TRUE(p.ok());
  auto* bytes = static_cast<volatile unsigned char*>(*p);
  bytes[0] = 9;
  int status = RunInChild([&] {
    signal(SIGSEGV, SIG_DFL);  // sanitizers install their own handler; we want the plain fault
    return static_cast<int>(bytes[0]);
  });
  ASSERT_TRUE(WIFSIGNALED(status)) << "child exited normally with " << WEXITSTATUS(status);
  EXPECT_EQ(WTERMSIG(status), SIGSEGV);
  EXPECT_EQ(bytes[0], 9);
}

// Runs `body` in a forked child with its stderr into a pipe; returns the wait status and the text.
std::pair<int, std::string> RunInChildSaying(const std::function<int()>& body) {
  int fds[2];
  EXPECT_EQ(pipe(fds), 0);
  const pid_t pid = fork();
  if (pid == 0) {
    close(fds[0]);
    dup2(fds[1], STDERR_FILENO);
    _exit(body());
  }
  close(fds[1]);
  std::string text;
  char buf[4096];
  ssize_t n;
  while ((n = read(fds[0], buf, sizeof(buf))) > 0) text.append(buf, static_cast<size_t>(n));
  close(fds[0]);
  int status = 0;
  waitpid(pid, &status, 0);
  return {status, text};
}

// The child that touches a page kept out of it says why on stderr, then dies with the SIGSEGV it
// always did; a fault anywhere else is left as it was (no word, the same signal). Under ASan its
// own handler takes the fault after the message (a report and exit 1, not the signal).
TEST(ForkSafetyTest, AChildTouchingDontForkMemoryIsToldWhyAndDiesAsBefore) {
  if (testing::kUnderTsan) GTEST_SKIP() << "TSan reroutes fork and SIGSEGV in the child";
  Ledger ledger;
  HostArenaOptions o = ForkOptions(&ledger, ForkSafety::kDontFork);
  o.name = "fork-fault-test";
  const int recorded = fork_fault::Snapshot().regions;
  auto arena = testing::MakeArena(o);
  auto p = arena->Allocate(kMiB, Tag(Kind::kOptimizerState, Lifetime::kPersistent));
  ASSERT_TRUE(p.ok());
  EXPECT_EQ(fork_fault::Snapshot().regions, recorded + 1) << "the arena's one region, recorded";
  EXPECT_TRUE(fork_fault::Snapshot().armed);
  auto* bytes = static_cast<volatile unsigned char*>(*p);
  bytes[0] = 9;
  auto [status, text] = RunInChildSaying([&] { return static_cast<int>(bytes[4096]); });
  EXPECT_NE(text.find("in a region of host arena 'fork-fault-test'"), std::string::npos) << text;
  EXPECT_NE(text.find("first mapped for optimizer_state"), std::string::npos) << text;
  EXPECT_NE(text.find("MADV_DONTFORK"), std::string::npos) << text;
  EXPECT_NE(text.find("Note [Fork fault]"), std::string::npos) << text;
  if (!testing::kUnderSanitizer) {
    ASSERT_TRUE(WIFSIGNALED(status)) << "child exited normally with " << WEXITSTATUS(status);
    EXPECT_EQ(WTERMSIG(status), SIGSEGV);
  }
  // A fault outside every region: no word from Spillway, and the plain SIGSEGV.
  auto [other_status, other_text] = RunInChildSaying([] {
    volatile uintptr_t nowhere = 16;  // opaque to the compiler: a plain null-page read
    return static_cast<int>(*reinterpret_cast<volatile unsigned char*>(nowhere));
  });
  EXPECT_EQ(other_text.find("spillway: process"), std::string::npos) << other_text;
  if (!testing::kUnderSanitizer) {
    ASSERT_TRUE(WIFSIGNALED(other_status));
    EXPECT_EQ(WTERMSIG(other_status), SIGSEGV);
  }
  // Once the arena unmaps the region it is named no more: the same touch faults without a word
  // (or, where the address was mapped again since, does not fault).
  ASSERT_TRUE(arena->Free(*p).ok());
  arena.reset();
  EXPECT_EQ(fork_fault::Snapshot().regions, recorded) << "forgotten before it was unmapped";
  auto [gone_status, gone_text] = RunInChildSaying([&] { return static_cast<int>(bytes[4096]); });
  EXPECT_EQ(gone_text.find("spillway: process"), std::string::npos) << gone_text;
  (void)gone_status;
}

TEST(ForkSafetyTest, ChildSeesZerosUnderWipeOnFork) {
  Ledger ledger;
  auto arena = testing::MakeArena(ForkOptions(&ledger, ForkSafety::kWipeOnFork));
  auto p = arena->Allocate(kMiB, Tag(Kind::kOptimizerState, Lifetime::kPersistent));
  ASSERT_TRUE(p.ok());
  auto* bytes = static_cast<volatile unsigned char*>(*p);
  bytes[0] = 9;
  int status = RunInChild([&] { return bytes[0] == 0 ? 0 : 1; });
  ASSERT_TRUE(WIFEXITED(status));
  EXPECT_EQ(WEXITSTATUS(status), 0);
  EXPECT_EQ(bytes[0], 9);
}

}  // namespace
}  // namespace spillway::allocator
