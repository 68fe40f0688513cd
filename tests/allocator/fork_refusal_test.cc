// In a real fork()ed child, every entry point of HostArena, IoEngine and NvmeArena refuses with
// FAILED_PRECONDITION naming the fork (the child has none of their threads, no MADV_DONTFORK
// memory, and shares the parent's io_uring rings); nothing hangs; destroying them in the child
// touches nothing of the parent's; and the parent's arenas, ring and swap file work as before.
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "nvme_test_util.h"
#include "spillway/allocator/nvme_arena.h"
#include "spillway/allocator/process.h"
#include "spillway/base/bytes.h"

namespace spillway::allocator {
namespace {

using testing::Tag;

class ForkRefusalTest : public ::testing::TestWithParam<bool> {};

TEST_P(ForkRefusalTest, InAForkedChildEveryCallRefusesAndTheParentCarriesOn) {
  testing::IoRig io(/*thread_pool=*/GetParam());
  NvmeArenaOptions no;
  no.directory = testing::NvmeTestDir();
  no.budget_bytes = 64 * kMiB;
  no.ledger = &io.ledger;
  auto nvme = std::move(NvmeArena::Create(no, io.engine.get()).value());
  const uint64_t bytes = 256 * 1024;
  char* buf = static_cast<char*>(io.HostBuffer(bytes));
  ASSERT_NE(buf, nullptr);
  std::memset(buf, 0x3c, bytes);
  const uint64_t off = *nvme->Allocate(bytes, Tag(Kind::kParam, Lifetime::kPersistent));
  ASSERT_TRUE(nvme->Write(off, buf, bytes).ok());
  const ProcessTag tag;
  EXPECT_TRUE(tag.InOwner());

  const pid_t pid = fork();
  ASSERT_GE(pid, 0);
  if (pid == 0) {
    alarm(30);  // a call that hangs in the child ends it by SIGALRM, which the parent reports
    testing::RefusedInChild expect;
    if (tag.InOwner()) {
      std::fprintf(stderr, "child: the tag still says owner\n");
      ++expect.bad;
    }
    expect(io.arena->Allocate(4096, Tag(Kind::kGrad, Lifetime::kStep)).status(),
           "HostArena::Allocate");
    expect(io.arena->Free(buf), "HostArena::Free");
    expect(io.arena->AllocationSize(buf).status(), "HostArena::AllocationSize");
    expect(io.engine->RegisterFile(0, "stdin", 512).status(), "IoEngine::RegisterFile");
    expect(io.engine->SubmitWrite(0, 0, buf, 4096).status(), "IoEngine::SubmitWrite");
    expect(io.engine->SubmitRead(0, 0, buf, 4096).status(), "IoEngine::SubmitRead");
    expect(io.engine->Write(0, 0, buf, 4096), "IoEngine::Write");
    expect(io.engine->Read(0, 0, buf, 4096), "IoEngine::Read");
    expect(io.engine->WaitAll(), "IoEngine::WaitAll");
    expect(io.engine->UnregisterFile(0), "IoEngine::UnregisterFile");
    expect(nvme->Allocate(bytes, Tag(Kind::kParam, Lifetime::kPersistent)).status(),
           "NvmeArena::Allocate");
    expect(nvme->Write(off, buf, bytes), "NvmeArena::Write");
    expect(nvme->Read(off, buf, bytes), "NvmeArena::Read");
    expect(nvme->SubmitReadRange(off, 0, buf, 4096).status(), "NvmeArena::SubmitReadRange");
    expect(nvme->BeginWrite(off, bytes).status(), "NvmeArena::BeginWrite");
    expect(nvme->Free(off), "NvmeArena::Free");
    expect(io.ledger.BeginStep(7), "Ledger::BeginStep");
    expect(io.ledger.CreateScope("child").status(), "Ledger::CreateScope");
    // Destroying them here must neither hang (no ring thread in the child) nor touch the parent's
    // ring, registered buffers or swap file.
    nvme.reset();
    io.engine.reset();
    io.arena.reset();
    _exit(expect.bad == 0 ? 0 : 1);
  }
  int status = 0;
  ASSERT_EQ(waitpid(pid, &status, 0), pid);
  EXPECT_TRUE(WIFEXITED(status)) << "the child ended by signal " << WTERMSIG(status)
                                 << (WTERMSIG(status) == SIGALRM ? " (a call hung)" : "");
  EXPECT_EQ(WIFEXITED(status) ? WEXITSTATUS(status) : -1, 0)
      << "a call did not refuse (see stderr)";
  // The parent carries on: its data is intact, and it reads and writes as before.
  std::vector<char> back(bytes);
  ASSERT_TRUE(nvme->Read(off, back.data(), bytes).ok());
  EXPECT_EQ(back, std::vector<char>(bytes, 0x3c));
  std::memset(buf, 0x7e, bytes);
  ASSERT_TRUE(nvme->Write(off, buf, bytes).ok());
  ASSERT_TRUE(nvme->Read(off, back.data(), bytes).ok());
  EXPECT_EQ(back, std::vector<char>(bytes, 0x7e));
  EXPECT_TRUE(io.arena->Free(buf).ok());
  EXPECT_TRUE(nvme->Free(off).ok());
  EXPECT_TRUE(nvme->Validate().ok());
  EXPECT_TRUE(io.arena->Validate().ok());
}

INSTANTIATE_TEST_SUITE_P(Backends, ForkRefusalTest, ::testing::Values(false, true),
                         [](const ::testing::TestParamInfo<bool>& p) {
                           return p.param ? "ThreadPool" : "IoUring";
                         });

}  // namespace
}  // namespace spillway::allocator
