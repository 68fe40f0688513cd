// IoEngine on real files, on both backends: round trips through fixed buffers and the bounce
// pool, many requests in flight, alignment rules, and every fault the seam can inject.
#include "spillway/allocator/io_engine.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <thread>
#include <vector>

#include "nvme_test_util.h"
#include "spillway/allocator/io_faults.h"
#include "spillway/base/bytes.h"

namespace spillway::allocator {
namespace {

using testing::FillRandom;
using testing::Has;
using testing::IoRig;

class IoEngineTest : public ::testing::TestWithParam<bool> {  // param: thread pool
 protected:
  void SetUp() override {
    rig_ = std::make_unique<IoRig>(GetParam(), &faults_);
    ASSERT_NE(rig_->engine, nullptr);
    fd_ = testing::OpenScratch();
    ASSERT_GE(fd_, 0);
    auto id = rig_->engine->RegisterFile(fd_, "scratch", 4096);
    ASSERT_TRUE(id.ok()) << id.status().ToString();
    file_ = *id;
  }
  void TearDown() override {
    if (rig_ && rig_->engine) {
      EXPECT_TRUE(rig_->engine->UnregisterFile(file_).ok());
    }
    rig_.reset();
    close(fd_);
  }
  // Writes `bytes` of random data from `src` at `offset`, reads into `dst`, compares.
  void RoundTrip(void* src, void* dst, uint64_t bytes, uint64_t offset, uint64_t seed) {
    FillRandom(src, bytes, seed);
    Status w = rig_->engine->Write(file_, offset, src, bytes);
    ASSERT_TRUE(w.ok()) << w.ToString();
    std::memset(dst, 0, bytes);
    Status r = rig_->engine->Read(file_, offset, dst, bytes);
    ASSERT_TRUE(r.ok()) << r.ToString();
    ASSERT_EQ(std::memcmp(src, dst, bytes), 0);
  }
  IoFaults faults_;
  std::unique_ptr<IoRig> rig_;
  int fd_ = -1;
  int file_ = -1;
};

TEST_P(IoEngineTest, ReportsItsBackend) {
  IoEngineStats st = rig_->engine->Stats();
  if (GetParam()) {
    EXPECT_EQ(st.backend, IoBackend::kThreadPool);
    EXPECT_NE(st.fallback_reason.find("forced"), std::string::npos) << st.fallback_reason;
  } else {
    EXPECT_EQ(st.backend, IoBackend::kUring)
        << "io_uring is unavailable here: " << st.fallback_reason;
  }
}

TEST_P(IoEngineTest, ArenaBuffersRoundTripInManyChunks) {
  const uint64_t bytes = 9 * kMiB + 3 * 4096;
  void* src = rig_->HostBuffer(bytes);
  void* dst = rig_->HostBuffer(bytes);
  RoundTrip(src, dst, bytes, 8192, 1);
  IoEngineStats st = rig_->engine->Stats();
  EXPECT_EQ(st.bounce_chunks, 0u);
  EXPECT_EQ(st.write_ops, 10u);  // 9 whole 1 MiB chunks and one of 12 KiB
  EXPECT_EQ(st.read_bytes, bytes);
  EXPECT_EQ(st.write_bytes, bytes);
  if (!GetParam()) {
    EXPECT_EQ(st.fixed_buffer_chunks, 20u);  // every chunk used read/write_fixed
  }
}

TEST_P(IoEngineTest, ForeignAndUnalignedBuffersGoThroughTheBouncePool) {
  const uint64_t bytes = 3 * kMiB + 100;  // a tail that is not a multiple of the alignment
  std::vector<char> src(bytes + 1), dst(bytes + 1);
  RoundTrip(src.data() + 1, dst.data() + 1, bytes, 0, 2);  // misaligned on purpose
  IoEngineStats st = rig_->engine->Stats();
  EXPECT_EQ(st.bounce_chunks, 8u);  // 4 chunks each way
  EXPECT_EQ(st.bounce_bytes, 2 * bytes);
}

TEST_P(IoEngineTest, ManyRequestsInFlightThenOneWaitAll) {
  constexpr int kRequests = 64;
  constexpr uint64_t kBytes = 256 * 1024;
  std::vector<char*> src(kRequests), dst(kRequests);
  for (int i = 0; i < kRequests; ++i) {
    src[i] = static_cast<char*>(rig_->HostBuffer(kBytes));
    dst[i] = static_cast<char*>(rig_->HostBuffer(kBytes));
    FillRandom(src[i], kBytes, 100 + i);
    ASSERT_TRUE(rig_->engine->SubmitWrite(file_, i * kBytes, src[i], kBytes).ok());
  }
  ASSERT_TRUE(rig_->engine->WaitAll().ok());
  for (int i = 0; i < kRequests; ++i) {
    ASSERT_TRUE(rig_->engine->SubmitRead(file_, i * kBytes, dst[i], kBytes).ok());
  }
  ASSERT_TRUE(rig_->engine->WaitAll().ok());
  for (int i = 0; i < kRequests; ++i) ASSERT_EQ(std::memcmp(src[i], dst[i], kBytes), 0) << i;
  EXPECT_EQ(rig_->engine->Stats().queued_requests, 0u);
}

// WaitAll waits for and consumes the calling thread's tickets only: another thread's ticket is
// still there for its own Wait (before, WaitAll took it and that Wait said "unknown ticket").
TEST_P(IoEngineTest, WaitAllLeavesOtherThreadsTicketsToThem) {
  constexpr uint64_t kBytes = 256 * 1024;
  char* mine = static_cast<char*>(rig_->HostBuffer(kBytes));
  char* theirs = static_cast<char*>(rig_->HostBuffer(kBytes));
  FillRandom(mine, kBytes, 1);
  FillRandom(theirs, kBytes, 2);
  Result<Ticket> other = Status::Internal("not run");
  std::thread([&] { other = rig_->engine->SubmitWrite(file_, kBytes, theirs, kBytes); }).join();
  ASSERT_TRUE(other.ok()) << other.status().ToString();
  ASSERT_TRUE(rig_->engine->SubmitWrite(file_, 0, mine, kBytes).ok());
  ASSERT_TRUE(rig_->engine->WaitAll().ok());
  Status waited = Status::Internal("not run");
  std::thread([&] { waited = rig_->engine->Wait(*other); }).join();
  EXPECT_TRUE(waited.ok()) << waited.ToString();
  EXPECT_EQ(rig_->engine->Stats().queued_requests, 0u);
}

TEST_P(IoEngineTest, FourThreadsShareTheEngine) {
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&, t] {
      const uint64_t bytes = 2 * kMiB;
      std::vector<char> src(bytes), dst(bytes);
      for (int round = 0; round < 4; ++round) {
        FillRandom(src.data(), bytes, t * 10 + round);
        const uint64_t off = static_cast<uint64_t>(t) * 4 * kMiB;
        ASSERT_TRUE(rig_->engine->Write(file_, off, src.data(), bytes).ok());
        ASSERT_TRUE(rig_->engine->Read(file_, off, dst.data(), bytes).ok());
        ASSERT_EQ(std::memcmp(src.data(), dst.data(), bytes), 0);
      }
    });
  }
  for (auto& th : threads) th.join();
}

// Regression: RegisterFile picked a free fixed-file slot, unlocked, updated the ring, then
// inserted, so two threads registering at once could share a slot and write into each other's file;
// and UnregisterFile freed the slot before clearing it. Each thread registers its own file, writes
// a pattern only it uses, unregisters, and checks the file through its own descriptor.
TEST_P(IoEngineTest, ThreadsRegisteringFilesAtOnceNeverShareASlot) {
  std::vector<std::thread> threads;
  std::atomic<int> bad{0};
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&, t] {
      std::vector<char> src(64 * 1024);
      // The scratch files are O_DIRECT: the check's own pread needs an aligned buffer.
      std::unique_ptr<char, decltype(&std::free)> dst(
          static_cast<char*>(std::aligned_alloc(4096, src.size())), &std::free);
      for (int round = 0; round < 200; ++round) {
        const int fd = testing::OpenScratch();
        if (fd < 0) return;
        auto id = rig_->engine->RegisterFile(fd, "mine", 4096);
        if (!id.ok()) {
          ADD_FAILURE() << id.status().ToString();
          close(fd);
          return;
        }
        std::memset(src.data(), 1 + t * 50 + round % 50, src.size());
        const Status w = rig_->engine->Write(*id, 0, src.data(), src.size());
        const Status u = rig_->engine->UnregisterFile(*id);
        if (!w.ok() || !u.ok()) {
          ADD_FAILURE() << w.ToString() << " / " << u.ToString();
        } else if (pread(fd, dst.get(), src.size(), 0) != static_cast<ssize_t>(src.size()) ||
                   std::memcmp(src.data(), dst.get(), src.size()) != 0) {
          bad++;  // the bytes went to another thread's file
        }
        close(fd);
      }
    });
  }
  for (auto& th : threads) th.join();
  EXPECT_EQ(bad.load(), 0);
}

TEST_P(IoEngineTest, MisalignedFileOffsetIsRefused) {
  std::vector<char> buf(4096);
  auto t = rig_->engine->SubmitWrite(file_, 100, buf.data(), buf.size());
  EXPECT_EQ(t.status().code(), StatusCode::kInvalidArgument);
  EXPECT_TRUE(Has(t.status(), "multiple of the direct-I/O alignment 4096"))
      << t.status().ToString();
}

TEST_P(IoEngineTest, TicketsAreWaitedForOnce) {
  std::vector<char> buf(4096);
  auto t = rig_->engine->SubmitWrite(file_, 0, buf.data(), buf.size());
  ASSERT_TRUE(t.ok());
  EXPECT_TRUE(rig_->engine->Wait(*t).ok());
  Status again = rig_->engine->Wait(*t);
  EXPECT_EQ(again.code(), StatusCode::kInvalidArgument);
  EXPECT_TRUE(Has(again, "already waited")) << again.ToString();
  EXPECT_EQ(rig_->engine->SubmitWrite(99, 0, buf.data(), 4096).status().code(),
            StatusCode::kInvalidArgument);
}

TEST_P(IoEngineTest, ReadPastTheEndOfTheFileSaysSo) {
  void* src = rig_->HostBuffer(kMiB);
  ASSERT_TRUE(rig_->engine->Write(file_, 0, src, kMiB).ok());
  void* dst = rig_->HostBuffer(2 * kMiB);
  Status st = rig_->engine->Read(file_, 0, dst, 2 * kMiB);
  EXPECT_EQ(st.code(), StatusCode::kIoError);
  EXPECT_TRUE(Has(st, "reached the end of the file")) << st.ToString();
  EXPECT_TRUE(Has(st, "'scratch'")) << st.ToString();
}

TEST_P(IoEngineTest, WriteEioNamesFileOffsetAndErrnoAndTheEngineCarriesOn) {
  void* src = rig_->HostBuffer(3 * kMiB);
  faults_.write_errno = EIO;
  Status st = rig_->engine->Write(file_, 4096, src, 3 * kMiB);
  EXPECT_EQ(st.code(), StatusCode::kIoError);
  EXPECT_EQ(st.sys_error(), EIO);
  // Chunks run concurrently; whichever takes the fault first names its own offset.
  bool names_a_chunk = false;
  for (uint64_t off : {4096ull, 4096ull + kMiB, 4096ull + 2 * kMiB}) {
    names_a_chunk |= Has(st, StrCat("write of 1048576 bytes at offset ", off, " of 'scratch'"));
  }
  EXPECT_TRUE(names_a_chunk) << st.ToString();
  EXPECT_TRUE(Has(st, "Input/output error (errno 5)")) << st.ToString();
  EXPECT_EQ(rig_->engine->Stats().failed_requests, 1u);
  void* dst = rig_->HostBuffer(3 * kMiB);
  RoundTrip(src, dst, 3 * kMiB, 4096, 3);  // usable afterwards
}

TEST_P(IoEngineTest, ReadEioIsReportedAndARetrySucceeds) {
  void* src = rig_->HostBuffer(kMiB);
  void* dst = rig_->HostBuffer(kMiB);
  FillRandom(src, kMiB, 4);
  ASSERT_TRUE(rig_->engine->Write(file_, 0, src, kMiB).ok());
  faults_.read_errno = EIO;
  Status st = rig_->engine->Read(file_, 0, dst, kMiB);
  EXPECT_EQ(st.code(), StatusCode::kIoError);
  EXPECT_TRUE(Has(st, "read of 1048576 bytes at offset 0")) << st.ToString();
  ASSERT_TRUE(rig_->engine->Read(file_, 0, dst, kMiB).ok());
  EXPECT_EQ(std::memcmp(src, dst, kMiB), 0);
}

TEST_P(IoEngineTest, EnospcIsANoSpaceErrorThatSaysWhatToDo) {
  void* src = rig_->HostBuffer(kMiB);
  faults_.write_errno = ENOSPC;
  Status st = rig_->engine->Write(file_, 0, src, kMiB);
  EXPECT_EQ(st.code(), StatusCode::kNoSpace);
  EXPECT_TRUE(Has(st, "free space on the NVMe path")) << st.ToString();
}

TEST_P(IoEngineTest, ShortReadsAndWritesAreResubmitted) {
  void* src = rig_->HostBuffer(4 * kMiB);
  void* dst = rig_->HostBuffer(4 * kMiB);
  faults_.short_writes = 3;
  faults_.short_reads = 3;
  RoundTrip(src, dst, 4 * kMiB, 0, 5);
  EXPECT_EQ(rig_->engine->Stats().short_resubmits, 6u);
}

TEST_P(IoEngineTest, EintrAndEagainAreRetried) {
  void* src = rig_->HostBuffer(2 * kMiB);
  void* dst = rig_->HostBuffer(2 * kMiB);
  faults_.eintr = 3;
  faults_.eagain = 2;
  RoundTrip(src, dst, 2 * kMiB, 0, 6);
  EXPECT_EQ(rig_->engine->Stats().retries, 5u);
}

INSTANTIATE_TEST_SUITE_P(Backends, IoEngineTest, ::testing::Values(false, true),
                         [](const ::testing::TestParamInfo<bool>& p) {
                           return p.param ? "ThreadPool" : "IoUring";
                         });

TEST(IoEngineOptionsTest, BadOptionsAreRefusedWithTheKeyToChange) {
  Ledger ledger;
  auto arena = testing::MakeArena(testing::PageableOptions(&ledger));
  IoEngineOptions o;
  EXPECT_TRUE(Has(IoEngine::Create(o).status(), "options.arena is required"));
  o.arena = arena.get();
  o.queue_depth = 0;
  EXPECT_TRUE(Has(IoEngine::Create(o).status(), "aio.queue_depth"));
  o.queue_depth = 8;
  o.block_size = 1000;
  EXPECT_TRUE(Has(IoEngine::Create(o).status(), "aio.block_size"));
  o.block_size = 1u << 20;
  // Options set in code skip Config::Parse's ranges: the engine holds the same ones.
  o.bounce_buffers = 0;
  EXPECT_TRUE(Has(IoEngine::Create(o).status(), "spillway.bounce_buffers"));
  o.bounce_buffers = 1025;  // 1 GiB of bounce buffers in this arena
  EXPECT_TRUE(
      Has(IoEngine::Create(o).status(), "bounce_buffers 1025 is out of range; use 1..1024"));
  o.bounce_buffers = 8;
  o.pool_threads = 0;
  EXPECT_TRUE(Has(IoEngine::Create(o).status(), "aio.intra_op_parallelism"));
  o.pool_threads = 1025;
  EXPECT_TRUE(Has(IoEngine::Create(o).status(), "pool_threads 1025 is out of range; use 1..1024"));
  EXPECT_EQ(arena->Stats().live_bytes, 0u);  // nothing was allocated for a refused engine
}

// A chunk is cut where a region's 1 GiB fixed-buffer piece ends (one registered buffer holds at
// most 1 GiB). A buffer not aligned to the file's alignment goes through the bounce pool, which
// needs no such cut; cutting it anyway made a chunk whose length was not a multiple of the
// alignment: its bounce write was padded with zeros over the next chunk's file bytes, and the next
// chunk started at an unaligned offset. A buffered file shows the damage (O_DIRECT refuses the
// second chunk instead). The thread-pool backend: the core cuts the chunks for both, and it pins
// nothing.
TEST(IoEngineChunkTest, AnUnalignedBufferAcrossAOneGibPieceWritesItsBytesAndNoOthers) {
  Ledger ledger;
  HostArenaOptions o = testing::PageableOptions(&ledger);
  o.budget_bytes = 1280 * kMiB;
  auto arena = testing::MakeArena(o);
  ASSERT_NE(arena, nullptr);
  IoEngineOptions e;
  e.arena = arena.get();
  e.force_thread_pool = true;
  e.bounce_buffers = 2;
  auto engine = IoEngine::Create(e);
  ASSERT_TRUE(engine.ok()) << engine.status().ToString();
  // A region of its own, a little over 1 GiB; only the pages written below are ever touched.
  auto region =
      arena->Allocate((1ull << 30) + kMiB, testing::Tag(Kind::kSwapBuffer, Lifetime::kStep));
  ASSERT_TRUE(region.ok()) << region.status().ToString();
  char* buf = static_cast<char*>(*region) + (1ull << 30) - 100;  // 100 bytes before the piece ends
  constexpr size_t kFile = 12288;
  const int fd = open(testing::NvmeTestDir().c_str(), O_TMPFILE | O_RDWR | O_CLOEXEC, 0600);
  ASSERT_GE(fd, 0) << strerror(errno);
  std::vector<char> before(kFile, '\xAA');
  ASSERT_EQ(pwrite(fd, before.data(), kFile, 0), static_cast<ssize_t>(kFile));
  auto id = (*engine)->RegisterFile(fd, "buffered", 4096);
  ASSERT_TRUE(id.ok()) << id.status().ToString();
  std::memset(buf, 0x5B, 4096);
  const Status w = (*engine)->Write(*id, 0, buf, 4096);
  EXPECT_TRUE(w.ok()) << w.ToString();
  std::vector<char> after(kFile);
  ASSERT_EQ(pread(fd, after.data(), kFile, 0), static_cast<ssize_t>(kFile));
  int wrong_inside = 0, wrong_outside = 0;
  for (size_t i = 0; i < kFile; ++i) {
    if (i < 4096 && after[i] != 0x5B) ++wrong_inside;
    if (i >= 4096 && after[i] != '\xAA') ++wrong_outside;
  }
  EXPECT_EQ(wrong_inside, 0) << "bytes of the write that did not land";
  EXPECT_EQ(wrong_outside, 0) << "bytes past the write that it overwrote";
  std::memset(buf, 0, 4096);
  const Status r = (*engine)->Read(*id, 0, buf, 4096);
  EXPECT_TRUE(r.ok()) << r.ToString();
  EXPECT_EQ(std::count(buf, buf + 4096, 0x5B), 4096);
  // An aligned buffer across the same boundary is cut there: two direct chunks, no bounce.
  char* aligned = static_cast<char*>(*region) + (1ull << 30) - 4096;
  std::memset(aligned, 0x3C, 8192);
  const uint64_t bounced = (*engine)->Stats().bounce_chunks;
  ASSERT_TRUE((*engine)->Write(*id, 4096, aligned, 8192).ok());
  EXPECT_EQ((*engine)->Stats().bounce_chunks, bounced);
  ASSERT_EQ(pread(fd, after.data(), kFile, 0), static_cast<ssize_t>(kFile));
  EXPECT_EQ(std::count(after.begin(), after.begin() + 4096, 0x5B), 4096);
  EXPECT_EQ(std::count(after.begin() + 4096, after.end(), 0x3C), 8192);
  EXPECT_TRUE((*engine)->UnregisterFile(*id).ok());
  close(fd);
  EXPECT_TRUE(arena->Free(*region).ok());
  engine->reset();
}

// A file whose direct-I/O alignment does not divide block_size would get chunks that start off
// its alignment (O_DIRECT refuses them with EINVAL mid-request): refused at registration instead.
TEST(IoEngineOptionsTest, AFileWhoseAlignmentDoesNotDivideTheBlockSizeIsRefused) {
  Ledger ledger;
  auto arena = testing::MakeArena(testing::PageableOptions(&ledger));
  IoEngineOptions o;
  o.arena = arena.get();
  o.block_size = 3 * 4096;
  auto engine = IoEngine::Create(o);
  ASSERT_TRUE(engine.ok()) << engine.status().ToString();
  const int fd = testing::OpenScratch();
  auto bad = (*engine)->RegisterFile(fd, "wide", 8192);
  EXPECT_EQ(bad.status().code(), StatusCode::kInvalidArgument);
  EXPECT_TRUE(Has(bad.status(), "block_size 12.00 KiB")) << bad.status().ToString();
  EXPECT_TRUE(Has(bad.status(), "multiple of 8.00 KiB")) << bad.status().ToString();
  auto good = (*engine)->RegisterFile(fd, "narrow", 4096);
  ASSERT_TRUE(good.ok()) << good.status().ToString();
  EXPECT_TRUE((*engine)->UnregisterFile(*good).ok());
  close(fd);
}

}  // namespace
}  // namespace spillway::allocator

namespace spillway::allocator {
namespace {

TEST(IoEngineSqpollTest, ASubmissionThreadRingMovesDataToo) {
  Ledger ledger;
  auto arena = testing::MakeArena(testing::PageableOptions(&ledger));
  IoEngineOptions o;
  o.arena = arena.get();
  o.sqpoll = true;
  auto engine = IoEngine::Create(o);
  ASSERT_TRUE(engine.ok()) << engine.status().ToString();
  if ((*engine)->backend() != IoBackend::kUring) {
    GTEST_SKIP() << "SQPOLL ring refused here: " << (*engine)->Stats().fallback_reason;
  }
  const int fd = testing::OpenScratch();
  auto file = (*engine)->RegisterFile(fd, "sqpoll", 4096);
  ASSERT_TRUE(file.ok());
  auto src = arena->Allocate(4 * kMiB, testing::Tag(Kind::kSwapBuffer, Lifetime::kPersistent));
  auto dst = arena->Allocate(4 * kMiB, testing::Tag(Kind::kSwapBuffer, Lifetime::kPersistent));
  ASSERT_TRUE(src.ok() && dst.ok());
  // Several rounds with idle gaps, so the kernel thread goes to sleep and must be woken
  // (IORING_SQ_NEED_WAKEUP, handled in liburing's submit).
  for (int round = 0; round < 3; ++round) {
    testing::FillRandom(*src, 4 * kMiB, 50 + round);
    ASSERT_TRUE((*engine)->Write(*file, 0, *src, 4 * kMiB).ok());
    ASSERT_TRUE((*engine)->Read(*file, 0, *dst, 4 * kMiB).ok());
    ASSERT_EQ(std::memcmp(*src, *dst, 4 * kMiB), 0);
    std::this_thread::sleep_for(std::chrono::milliseconds(120));  // > sq_thread_idle (50 ms)
  }
  EXPECT_TRUE((*engine)->UnregisterFile(*file).ok());
  engine->reset();
  close(fd);
}

}  // namespace
}  // namespace spillway::allocator

namespace spillway::allocator {
namespace {

// An engine on a real ring with the fault seam; null when io_uring is unavailable here.
struct RingRig {
  explicit RingRig(IoFaults* faults) {
    arena = testing::MakeArena(testing::PageableOptions(&ledger));
    IoEngineOptions o;
    o.arena = arena.get();
    o.faults = faults;
    auto e = IoEngine::Create(o);
    EXPECT_TRUE(e.ok()) << e.status().ToString();
    if (e.ok()) engine = std::move(e.value());
    fd = testing::OpenScratch();
    if (engine) file = *engine->RegisterFile(fd, "scratch", 4096);
  }
  ~RingRig() {
    engine.reset();
    arena.reset();
    close(fd);
  }
  bool uring() const { return engine && engine->backend() == IoBackend::kUring; }
  void* Buffer(uint64_t bytes) {
    return *arena->Allocate(bytes, testing::Tag(Kind::kSwapBuffer, Lifetime::kPersistent));
  }
  Ledger ledger;
  std::unique_ptr<HostArena> arena;
  std::unique_ptr<IoEngine> engine;
  int fd = -1;
  int file = -1;
};

// io_uring_submit_and_wait failing (EFAULT here) fails the requests whose SQEs it held, names the
// call, and the engine refuses new requests saying why; before, it logged and looped.
TEST(IoEngineRingTest, ASubmitFailureFailsTheQueuedRequestsAndTheEngineSaysSo) {
  IoFaults faults;
  RingRig rig(&faults);
  if (!rig.uring()) GTEST_SKIP() << "no io_uring here: " << rig.engine->Stats().fallback_reason;
  void* buf = rig.Buffer(kMiB);
  faults.submit_errno = EFAULT;
  const Status st = rig.engine->Write(rig.file, 0, buf, kMiB);
  EXPECT_FALSE(st.ok());
  EXPECT_TRUE(Has(st, "io_uring_submit_and_wait")) << st.ToString();
  EXPECT_TRUE(Has(st, "Bad address")) << st.ToString();
  const auto again = rig.engine->SubmitWrite(rig.file, 0, buf, kMiB);
  EXPECT_EQ(again.status().code(), StatusCode::kFailedPrecondition) << again.status().ToString();
  EXPECT_TRUE(Has(again.status(), "ring failed")) << again.status().ToString();
  const IoEngineStats s = rig.engine->Stats();
  EXPECT_EQ(s.ring_failures, 1u);
  EXPECT_TRUE(Has(Status::Internal(s.ring_error), "Bad address")) << s.ring_error;
  EXPECT_EQ(s.queued_requests, 0u);
}

// A null SQE (the submission queue full) defers the chunk instead of dereferencing it.
TEST(IoEngineRingTest, ANullSqeDefersTheChunk) {
  IoFaults faults;
  RingRig rig(&faults);
  if (!rig.uring()) GTEST_SKIP() << "no io_uring here: " << rig.engine->Stats().fallback_reason;
  char* src = static_cast<char*>(rig.Buffer(4 * kMiB));
  char* dst = static_cast<char*>(rig.Buffer(4 * kMiB));
  testing::FillRandom(src, 4 * kMiB, 7);
  faults.null_sqes = 3;
  ASSERT_TRUE(rig.engine->Write(rig.file, 0, src, 4 * kMiB).ok());
  ASSERT_TRUE(rig.engine->Read(rig.file, 0, dst, 4 * kMiB).ok());
  EXPECT_EQ(std::memcmp(src, dst, 4 * kMiB), 0);
  EXPECT_EQ(faults.null_sqes.load(), 0);
  EXPECT_GE(rig.engine->Stats().sqe_shortages, 1u);
}

// Without sparse registration (kernels before 5.19) the ring still runs, with plainly registered
// files and no fixed buffers, and Stats() says so; before, the engine fell back to the thread pool.
// A failed fixed-slot clear retires the slot. Closing the descriptor afterwards is safe: the table
// holds the open file, not the fd, so a new file that gets the same fd number gets its own slot
// and its own bytes, and the old file keeps its bytes.
TEST(IoEngineRingTest, AFailedUnregisterRetiresTheSlotAndTheFdMayBeClosed) {
  IoFaults faults;
  RingRig rig(&faults);
  if (!rig.uring()) GTEST_SKIP() << "no io_uring here: " << rig.engine->Stats().fallback_reason;
  char* a_bytes = static_cast<char*>(rig.Buffer(kMiB));
  char* b_bytes = static_cast<char*>(rig.Buffer(kMiB));
  char* back = static_cast<char*>(rig.Buffer(kMiB));
  testing::FillRandom(a_bytes, kMiB, 21);
  testing::FillRandom(b_bytes, kMiB, 22);
  const int a_fd = testing::OpenScratch();
  const int a_witness = dup(a_fd);  // to read A's bytes after its fd is closed
  ASSERT_GE(a_witness, 0);
  auto a = rig.engine->RegisterFile(a_fd, "A", 4096);
  ASSERT_TRUE(a.ok()) << a.status().ToString();
  ASSERT_TRUE(rig.engine->Write(*a, 0, a_bytes, kMiB).ok());

  faults.unregister_errno = EBUSY;
  const Status st = rig.engine->UnregisterFile(*a);
  ASSERT_FALSE(st.ok());
  EXPECT_TRUE(Has(st, "retired")) << st.ToString();
  EXPECT_TRUE(Has(st, "may be closed")) << st.ToString();
  EXPECT_EQ(rig.engine->SubmitWrite(*a, 0, a_bytes, kMiB).status().code(),
            StatusCode::kInvalidArgument)
      << "the unregistered id must name nothing";
  ASSERT_EQ(close(a_fd), 0);

  const int b_fd = testing::OpenScratch();
  EXPECT_EQ(b_fd, a_fd) << "the test wants the fd number reused";
  auto b = rig.engine->RegisterFile(b_fd, "B", 4096);
  ASSERT_TRUE(b.ok()) << b.status().ToString();
  ASSERT_TRUE(rig.engine->Write(*b, 0, b_bytes, kMiB).ok());
  ASSERT_TRUE(rig.engine->Read(*b, 0, back, kMiB).ok());
  EXPECT_EQ(std::memcmp(back, b_bytes, kMiB), 0);
  ASSERT_EQ(pread(b_fd, back, kMiB, 0), static_cast<ssize_t>(kMiB));
  EXPECT_EQ(std::memcmp(back, b_bytes, kMiB), 0) << "B's bytes are not in B";
  ASSERT_EQ(pread(a_witness, back, kMiB, 0), static_cast<ssize_t>(kMiB));
  EXPECT_EQ(std::memcmp(back, a_bytes, kMiB), 0) << "A's bytes changed";
  EXPECT_TRUE(rig.engine->UnregisterFile(*b).ok());
  close(b_fd);
  close(a_witness);
}

TEST(IoEngineRingTest, WithoutSparseRegistrationTheRingRunsWithPlainFiles) {
  {
    RingRig probe(nullptr);
    if (!probe.uring())
      GTEST_SKIP() << "no io_uring here: " << probe.engine->Stats().fallback_reason;
  }
  IoFaults faults;
  faults.sparse_registration_errno = EINVAL;
  RingRig rig(&faults);
  ASSERT_NE(rig.engine, nullptr);
  EXPECT_EQ(rig.engine->backend(), IoBackend::kUring) << rig.engine->Stats().fallback_reason;
  char* src = static_cast<char*>(rig.Buffer(2 * kMiB));
  char* dst = static_cast<char*>(rig.Buffer(2 * kMiB));
  testing::FillRandom(src, 2 * kMiB, 8);
  ASSERT_TRUE(rig.engine->Write(rig.file, 0, src, 2 * kMiB).ok());
  ASSERT_TRUE(rig.engine->Read(rig.file, 0, dst, 2 * kMiB).ok());
  EXPECT_EQ(std::memcmp(src, dst, 2 * kMiB), 0);
  const IoEngineStats s = rig.engine->Stats();
  EXPECT_EQ(s.fixed_buffer_chunks, 0u);
  EXPECT_TRUE(Has(Status::Internal(s.registration), "plain")) << s.registration;
}

}  // namespace
}  // namespace spillway::allocator
