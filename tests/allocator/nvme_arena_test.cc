// NvmeArena on a real swap file: round trips with checksums, growth under the budget, owners and
// boundaries across tiers, and the faults that matter: EIO, ENOSPC, a file size limit, a missing or
// read-only directory, and a corrupted byte on disk. In every case: a clear status, the host data
// intact, and the arena usable afterwards.
#include "spillway/allocator/nvme_arena.h"

#include <dirent.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/mount.h>
#include <sys/resource.h>

#include <cstring>

#include "nvme_test_util.h"
#include "spillway/allocator/crc32c.h"
#include "spillway/allocator/io_faults.h"
#include "spillway/base/bytes.h"

namespace spillway::allocator {
namespace {

using testing::FillRandom;
using testing::Has;
using testing::IoRig;
using testing::Tag;

class NvmeArenaTest : public ::testing::TestWithParam<bool> {  // param: thread pool backend
 protected:
  void SetUp() override {
    rig_ = std::make_unique<IoRig>(GetParam(), &faults_);
    ASSERT_NE(rig_->engine, nullptr);
  }
  void TearDown() override {
    nvme_.reset();
    rig_.reset();
  }
  NvmeArenaOptions Options() {
    NvmeArenaOptions o;
    o.directory = testing::NvmeTestDir();
    o.budget_bytes = 64 * kMiB;
    o.grow_bytes = 8 * kMiB;
    o.ledger = &rig_->ledger;
    return o;
  }
  void Make(const NvmeArenaOptions& o) {
    auto r = NvmeArena::Create(o, rig_->engine.get());
    ASSERT_TRUE(r.ok()) << r.status().ToString();
    nvme_ = std::move(r.value());
  }
  IoFaults faults_;
  std::unique_ptr<IoRig> rig_;
  std::unique_ptr<NvmeArena> nvme_;
};

TEST_P(NvmeArenaTest, OddSizesRoundTripWithChecksums) {
  Make(Options());
  for (uint64_t bytes : {uint64_t{1}, uint64_t{4097}, 3 * kMiB + 5, 5 * kMiB}) {
    std::vector<char> src(bytes), dst(bytes);
    FillRandom(src.data(), bytes, bytes);
    auto off = nvme_->Allocate(bytes, Tag(Kind::kOptimizerState, Lifetime::kPersistent, bytes));
    ASSERT_TRUE(off.ok()) << off.status().ToString();
    EXPECT_EQ(*off % nvme_->alignment(), 0u);
    ASSERT_TRUE(nvme_->Write(*off, src.data(), bytes).ok());
    Status st = nvme_->Read(*off, dst.data(), bytes);
    ASSERT_TRUE(st.ok()) << st.ToString();
    EXPECT_EQ(std::memcmp(src.data(), dst.data(), bytes), 0) << bytes;
  }
  NvmeArenaStats s = nvme_->Stats();
  EXPECT_TRUE(s.direct_io);
  EXPECT_TRUE(s.checksum);
  EXPECT_EQ(s.checksum_failures, 0u);
  EXPECT_EQ(s.capacity_bytes, s.live_bytes + s.free_bytes);
  EXPECT_TRUE(nvme_->Validate().ok()) << nvme_->Validate().ToString();
}

TEST_P(NvmeArenaTest, ArenaBuffersUseFixedBuffers) {
  Make(Options());
  void* src = rig_->HostBuffer(4 * kMiB);
  void* dst = rig_->HostBuffer(4 * kMiB);
  FillRandom(src, 4 * kMiB, 9);
  auto off = nvme_->Allocate(4 * kMiB, Tag(Kind::kParam, Lifetime::kPersistent));
  ASSERT_TRUE(off.ok());
  ASSERT_TRUE(nvme_->Write(*off, src, 4 * kMiB).ok());
  ASSERT_TRUE(nvme_->Read(*off, dst, 4 * kMiB).ok());
  EXPECT_EQ(std::memcmp(src, dst, 4 * kMiB), 0);
  if (!GetParam()) {
    EXPECT_EQ(rig_->engine->Stats().fixed_buffer_chunks, 8u);
  }
  EXPECT_EQ(rig_->engine->Stats().bounce_chunks, 0u);
}

TEST_P(NvmeArenaTest, TheSwapFileIsAnonymousAndGrowsInStepsUpToTheBudget) {
  const std::string dir = testing::NvmeTestDir();
  auto entries = [&] {
    int n = 0;
    DIR* d = opendir(dir.c_str());
    while (dirent* e = readdir(d)) n += e->d_name[0] != '.';
    closedir(d);
    return n;
  };
  const int before = entries();
  Make(Options());
  EXPECT_EQ(entries(), before);  // O_TMPFILE: nothing to find, nothing left after a crash
  std::vector<uint64_t> offs;
  for (int i = 0; i < 7; ++i) {
    auto off = nvme_->Allocate(9 * kMiB, Tag(Kind::kMasterWeight, Lifetime::kPersistent, i));
    ASSERT_TRUE(off.ok()) << i << ": " << off.status().ToString();
    offs.push_back(*off);
  }
  NvmeArenaStats s = nvme_->Stats();
  EXPECT_EQ(s.capacity_bytes, 63 * kMiB);  // each step at least grow_bytes (8), here 9 MiB
  EXPECT_EQ(s.grow_count, 7u);
  auto over = nvme_->Allocate(2 * kMiB, Tag(Kind::kMasterWeight, Lifetime::kPersistent, 99));
  EXPECT_EQ(over.status().code(), StatusCode::kOverBudget);
  EXPECT_TRUE(Has(over.status(), "over the NVMe budget of 64.00 MiB")) << over.status().ToString();
  EXPECT_TRUE(Has(over.status(), "spillway.nvme_budget_bytes")) << over.status().ToString();
  ASSERT_TRUE(nvme_->Free(offs[3]).ok());
  EXPECT_TRUE(nvme_->Allocate(2 * kMiB, Tag(Kind::kMasterWeight, Lifetime::kPersistent)).ok());
  EXPECT_TRUE(nvme_->Validate().ok());
}

TEST_P(NvmeArenaTest, BadFreesAndWrongSizesAreRefusedAndChangeNothing) {
  Make(Options());
  auto off = nvme_->Allocate(kMiB, Tag(Kind::kGrad, Lifetime::kPersistent, 5));
  ASSERT_TRUE(off.ok());
  std::vector<char> buf(2 * kMiB);
  Status wrong = nvme_->Write(*off, buf.data(), 2 * kMiB);
  EXPECT_EQ(wrong.code(), StatusCode::kInvalidArgument);
  EXPECT_TRUE(Has(wrong, "the extent holds 1048576 bytes")) << wrong.ToString();
  Status unwritten = nvme_->Read(*off, buf.data(), kMiB);
  EXPECT_EQ(unwritten.code(), StatusCode::kFailedPrecondition);
  EXPECT_TRUE(Has(unwritten, "holds no valid data")) << unwritten.ToString();
  Status foreign = nvme_->Free(*off + 4096);
  EXPECT_TRUE(Has(foreign, "interior pointer")) << foreign.ToString();
  Status beyond = nvme_->Free(1ull << 40);
  EXPECT_TRUE(Has(beyond, "foreign pointer")) << beyond.ToString();
  ASSERT_TRUE(nvme_->Free(*off).ok());
  Status twice = nvme_->Free(*off);
  EXPECT_TRUE(Has(twice, "double free")) << twice.ToString();
  EXPECT_EQ(nvme_->Allocate(0, Tag(Kind::kGrad, Lifetime::kStep)).status().code(),
            StatusCode::kInvalidArgument);
  EXPECT_EQ(nvme_->Stats().bad_free_count, 3u);
  EXPECT_TRUE(nvme_->Validate().ok());
}

// Regression: range_offset + length wrapped past 2^64, so a huge length passed the range check.
// A write whose extent was freed and re-allocated under it never validates the new owner's
// extent: before, its commit recorded the old data's checksum there, and the new owner's next
// read failed with a checksum mismatch on data that was fine.
TEST_P(NvmeArenaTest, AWriteWhoseExtentChangedHandsIsNotCommitted) {
  Make(Options());
  const uint64_t bytes = kMiB;
  std::vector<char> old_data(bytes, 0x11), new_data(bytes, 0x22), back(bytes);
  const uint64_t off = *nvme_->Allocate(bytes, Tag(Kind::kGrad, Lifetime::kPersistent, 1));
  auto generation = nvme_->BeginWrite(off, bytes);  // a chunked write starts...
  ASSERT_TRUE(generation.ok()) << generation.status().ToString();
  auto t = nvme_->SubmitWriteRange(off, 0, old_data.data(), bytes);
  ASSERT_TRUE(t.ok());
  ASSERT_TRUE(nvme_->Wait(*t).ok());
  ASSERT_TRUE(nvme_->Free(off).ok());  // ...its extent is freed and handed to a new owner...
  const uint64_t again = *nvme_->Allocate(bytes, Tag(Kind::kParam, Lifetime::kPersistent, 2));
  ASSERT_EQ(again, off);
  ASSERT_TRUE(nvme_->Write(again, new_data.data(), bytes).ok());
  // ...and then the old write commits.
  const Status commit = nvme_->CommitWrite(off, bytes, Crc32c(old_data.data(), bytes), *generation);
  EXPECT_EQ(commit.code(), StatusCode::kFailedPrecondition) << commit.ToString();
  EXPECT_TRUE(Has(commit, "was freed, re-allocated or written again")) << commit.ToString();
  const Status read = nvme_->Read(again, back.data(), bytes);
  ASSERT_TRUE(read.ok()) << read.ToString();
  EXPECT_EQ(back, new_data);
}

TEST_P(NvmeArenaTest, ARangeWhoseEndWrapsIsRefusedByName) {
  Make(Options());
  auto off = nvme_->Allocate(kMiB, Tag(Kind::kGrad, Lifetime::kPersistent, 5));
  ASSERT_TRUE(off.ok());
  std::vector<char> buf(kMiB);
  ASSERT_TRUE(nvme_->Write(*off, buf.data(), kMiB).ok());
  const uint64_t wrap = UINT64_MAX - 4095;  // 4096 + wrap == 0 (mod 2^64), a multiple of 4096
  auto r = nvme_->SubmitReadRange(*off, 4096, buf.data(), wrap);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument);
  EXPECT_TRUE(Has(r.status(), "of the extent at offset")) << r.status().ToString();
  auto w = nvme_->SubmitWriteRange(*off, 4096, buf.data(), wrap);
  ASSERT_FALSE(w.ok());
  EXPECT_TRUE(Has(w.status(), "of the extent at offset")) << w.status().ToString();
  EXPECT_TRUE(nvme_->Read(*off, buf.data(), kMiB).ok());  // the extent is intact
  EXPECT_TRUE(nvme_->Validate().ok());
}

// Filesystems without fallocate (older ZFS, NFSv3, some FUSE) answer EOPNOTSUPP: the swap file
// grows with ftruncate instead, and the arena says so in its stats.
TEST_P(NvmeArenaTest, WithoutFallocateTheSwapFileGrowsWithFtruncate) {
  NvmeArenaFaults faults;
  faults.fallocate_errno.store(EOPNOTSUPP);
  NvmeArenaOptions o = Options();
  o.faults = &faults;
  Make(o);
  auto off = nvme_->Allocate(kMiB, Tag(Kind::kGrad, Lifetime::kPersistent, 5));
  ASSERT_TRUE(off.ok()) << off.status().ToString();
  std::vector<char> src(kMiB), dst(kMiB);
  FillRandom(src.data(), kMiB, 3);
  ASSERT_TRUE(nvme_->Write(*off, src.data(), kMiB).ok());
  ASSERT_TRUE(nvme_->Read(*off, dst.data(), kMiB).ok());
  EXPECT_EQ(std::memcmp(src.data(), dst.data(), kMiB), 0);
  EXPECT_TRUE(nvme_->Stats().grows_without_fallocate);
  EXPECT_TRUE(nvme_->Validate().ok());
}

TEST_P(NvmeArenaTest, OneBoundaryReportCoversHostAndNvme) {
  NvmeArenaOptions o = Options();
  o.policy = EscapePolicy::kReclaim;
  Make(o);
  ASSERT_TRUE(rig_->ledger.BeginEpoch(0).ok());
  ASSERT_TRUE(rig_->ledger.BeginStep(0).ok());
  ASSERT_TRUE(nvme_->Allocate(kMiB, Tag(Kind::kSwapBuffer, Lifetime::kStep, 77)).ok());
  BoundaryReport report;
  ASSERT_TRUE(rig_->ledger.EndStep(&report).ok());
  const TierReport* nvme = nullptr;
  for (const auto& t : report.tiers) nvme = t.tier == "nvme" ? &t : nvme;
  ASSERT_NE(nvme, nullptr) << report.ToString();
  EXPECT_EQ(nvme->escape_count, 1u);
  EXPECT_EQ(nvme->reclaimed_bytes, kMiB);
  EXPECT_EQ(nvme->escapes[0].owner_id, 77u);
  EXPECT_EQ(nvme_->Stats().live_bytes, 0u);
  EXPECT_TRUE(nvme_->Validate().ok());
}

TEST_P(NvmeArenaTest, AFailedWriteLeavesTheHostCopyAndMarksTheExtentInvalid) {
  Make(Options());
  const uint64_t bytes = 3 * kMiB;
  std::vector<char> host(bytes), copy(bytes), back(bytes);
  FillRandom(host.data(), bytes, 11);
  copy = host;
  auto off = nvme_->Allocate(bytes, Tag(Kind::kParam, Lifetime::kPersistent, 3));
  ASSERT_TRUE(off.ok());
  ASSERT_TRUE(nvme_->Write(*off, host.data(), bytes).ok());
  faults_.write_errno = EIO;
  Status st = nvme_->Write(*off, host.data(), bytes);
  EXPECT_EQ(st.code(), StatusCode::kIoError);
  EXPECT_TRUE(Has(st, "param owner 3")) << st.ToString();
  EXPECT_TRUE(Has(st, "the host copy is untouched")) << st.ToString();
  EXPECT_EQ(host, copy);
  EXPECT_EQ(nvme_->Read(*off, back.data(), bytes).code(), StatusCode::kFailedPrecondition);
  ASSERT_TRUE(nvme_->Write(*off, host.data(), bytes).ok());  // usable again
  ASSERT_TRUE(nvme_->Read(*off, back.data(), bytes).ok());
  EXPECT_EQ(back, copy);
  EXPECT_EQ(nvme_->Stats().write_failures, 1u);
}

TEST_P(NvmeArenaTest, AFailedReadIsReportedAndTheDataIsStillThere) {
  Make(Options());
  std::vector<char> src(kMiB), dst(kMiB);
  FillRandom(src.data(), kMiB, 12);
  auto off = nvme_->Allocate(kMiB, Tag(Kind::kParam, Lifetime::kPersistent, 4));
  ASSERT_TRUE(off.ok());
  ASSERT_TRUE(nvme_->Write(*off, src.data(), kMiB).ok());
  faults_.read_errno = EIO;
  Status st = nvme_->Read(*off, dst.data(), kMiB);
  EXPECT_EQ(st.code(), StatusCode::kIoError);
  EXPECT_TRUE(Has(st, "the destination is not valid")) << st.ToString();
  ASSERT_TRUE(nvme_->Read(*off, dst.data(), kMiB).ok());
  EXPECT_EQ(src, dst);
}

TEST_P(NvmeArenaTest, ACorruptedByteOnDiskIsCaughtByTheChecksum) {
  Make(Options());
  const uint64_t bytes = 2 * kMiB;
  std::vector<char> src(bytes), dst(bytes);
  FillRandom(src.data(), bytes, 13);
  auto off = nvme_->Allocate(bytes, Tag(Kind::kOptimizerState, Lifetime::kPersistent, 21));
  ASSERT_TRUE(off.ok());
  ASSERT_TRUE(nvme_->Write(*off, src.data(), bytes).ok());
  testing::FlipByteOnDisk(*nvme_, *off + 12345);
  Status st = nvme_->Read(*off, dst.data(), bytes);
  EXPECT_EQ(st.code(), StatusCode::kChecksumMismatch);
  EXPECT_TRUE(Has(st, "optimizer_state owner 21")) << st.ToString();
  EXPECT_TRUE(Has(st, "The data on disk is corrupt")) << st.ToString();
  EXPECT_EQ(nvme_->Stats().checksum_failures, 1u);
  ASSERT_TRUE(nvme_->Write(*off, src.data(), bytes).ok());  // rewriting heals the extent
  ASSERT_TRUE(nvme_->Read(*off, dst.data(), bytes).ok());
  EXPECT_EQ(src, dst);
}

TEST_P(NvmeArenaTest, WithoutChecksumsTheSameCorruptionGoesUnnoticed) {
  // The negative control for the test above: the detector is what catches it.
  NvmeArenaOptions o = Options();
  o.checksum = false;
  Make(o);
  std::vector<char> src(kMiB), dst(kMiB);
  FillRandom(src.data(), kMiB, 14);
  auto off = nvme_->Allocate(kMiB, Tag(Kind::kParam, Lifetime::kPersistent));
  ASSERT_TRUE(off.ok());
  ASSERT_TRUE(nvme_->Write(*off, src.data(), kMiB).ok());
  testing::FlipByteOnDisk(*nvme_, *off + 100);
  ASSERT_TRUE(nvme_->Read(*off, dst.data(), kMiB).ok());
  EXPECT_NE(src, dst);
}

TEST_P(NvmeArenaTest, AFileSizeLimitIsANoSpaceErrorNotADeadProcess) {
  rlimit old{};
  ASSERT_EQ(getrlimit(RLIMIT_FSIZE, &old), 0);
  auto previous = signal(SIGXFSZ, SIG_IGN);  // EFBIG instead of being killed
  rlimit small = old;
  small.rlim_cur = 12 * kMiB;
  ASSERT_EQ(setrlimit(RLIMIT_FSIZE, &small), 0);
  Make(Options());
  auto a = nvme_->Allocate(8 * kMiB, Tag(Kind::kParam, Lifetime::kPersistent, 1));
  auto b = nvme_->Allocate(8 * kMiB, Tag(Kind::kParam, Lifetime::kPersistent, 2));
  ASSERT_EQ(setrlimit(RLIMIT_FSIZE, &old), 0);
  signal(SIGXFSZ, previous);
  ASSERT_TRUE(a.ok()) << a.status().ToString();
  EXPECT_EQ(b.status().code(), StatusCode::kNoSpace);
  EXPECT_EQ(b.status().sys_error(), EFBIG);
  EXPECT_TRUE(Has(b.status(), "ulimit -f")) << b.status().ToString();
  EXPECT_TRUE(Has(b.status(), "Nothing was allocated")) << b.status().ToString();
  std::vector<char> src(8 * kMiB, 7), dst(8 * kMiB);
  ASSERT_TRUE(nvme_->Write(*a, src.data(), src.size()).ok());  // what was there still works
  ASSERT_TRUE(nvme_->Read(*a, dst.data(), dst.size()).ok());
  EXPECT_EQ(src, dst);
  EXPECT_TRUE(nvme_->Validate().ok());
}

TEST_P(NvmeArenaTest, AMissingDirectoryIsAClearError) {
  NvmeArenaOptions o = Options();
  o.directory = testing::NvmeTestDir() + "/does/not/exist";
  auto r = NvmeArena::Create(o, rig_->engine.get());
  EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument);
  EXPECT_TRUE(Has(r.status(), "does/not/exist")) << r.status().ToString();
  EXPECT_TRUE(Has(r.status(), "create it")) << r.status().ToString();
}

TEST_P(NvmeArenaTest, AReadOnlyDirectoryIsAClearError) {
  std::string dir = testing::NvmeTestDir() + "/readonly";
  mkdir(dir.c_str(), 0700);
  bool mounted = false;
  if (geteuid() == 0) {
    // Root writes through permission bits; only a read-only filesystem stops it.
    mounted = mount("tmpfs", dir.c_str(), "tmpfs", MS_RDONLY, "size=1m") == 0;
    if (!mounted) GTEST_SKIP() << "root, and cannot mount a read-only tmpfs: " << strerror(errno);
  } else {
    ASSERT_EQ(chmod(dir.c_str(), 0500), 0);
  }
  NvmeArenaOptions o = Options();
  o.directory = dir;
  auto r = NvmeArena::Create(o, rig_->engine.get());
  if (mounted) umount(dir.c_str());
  EXPECT_FALSE(r.ok());
  EXPECT_TRUE(Has(r.status(), "not writable")) << r.status().ToString();
  EXPECT_TRUE(Has(r.status(), dir)) << r.status().ToString();
}

TEST_P(NvmeArenaTest, NoBudgetIsRefused) {
  NvmeArenaOptions o = Options();
  o.budget_bytes = 0;
  EXPECT_TRUE(Has(NvmeArena::Create(o, rig_->engine.get()).status(), "spillway.nvme_budget_bytes"));
}

INSTANTIATE_TEST_SUITE_P(Backends, NvmeArenaTest, ::testing::Values(false, true),
                         [](const ::testing::TestParamInfo<bool>& p) {
                           return p.param ? "ThreadPool" : "IoUring";
                         });

}  // namespace
}  // namespace spillway::allocator
