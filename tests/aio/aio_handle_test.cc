// AioHandle (aio/): DeepSpeed's aio_handle contract on real files, on both engine backends. Each op
// reaches the file its caller named at the time of the call (a renamed path and a reused fd number
// included); sync, alone and async ops complete when the contract says; a failed op returns -1 with
// a message and leaves every other op and file intact; a closed handle and a forked child are
// refused; threads share one handle. Note [aio_handle] in docs/aio.md.
#include "spillway/aio/aio_handle.h"

#include <fcntl.h>
#include <gtest/gtest.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "../allocator/nvme_test_util.h"
#include "spillway/base/bytes.h"

namespace spillway::aio {
namespace {

using allocator::Kind;
using allocator::Lifetime;
using allocator::testing::FillRandom;
using allocator::testing::Has;
using allocator::testing::MakeArena;
using allocator::testing::NvmeTestDir;
using allocator::testing::PageableOptions;
using allocator::testing::Tag;

// A directory of its own under the test directory, removed (with its files) at the end.
struct Dir {
  Dir() {
    char tmpl[256];
    std::snprintf(tmpl, sizeof(tmpl), "%s/aio-XXXXXX", NvmeTestDir().c_str());
    const char* made = mkdtemp(tmpl);
    EXPECT_NE(made, nullptr) << tmpl << ": " << std::strerror(errno);
    path = made != nullptr ? made : tmpl;
  }
  ~Dir() { (void)std::system(("rm -rf '" + path + "'").c_str()); }
  std::string File(const std::string& name) const { return path + "/" + name; }
  std::string path;
};

std::string ReadAll(const std::string& path) {
  std::string out;
  FILE* f = std::fopen(path.c_str(), "rb");
  if (f == nullptr) return "<missing>";
  char buf[65536];
  size_t n = 0;
  while ((n = std::fread(buf, 1, sizeof(buf), f)) > 0) out.append(buf, n);
  std::fclose(f);
  return out;
}

// A handle on one backend, with the arena its engine's bounce buffers and the tests' buffers
// come from.
class AioHandleTest : public ::testing::TestWithParam<const char*> {
 protected:
  void SetUp() override {
    auto o = PageableOptions(&ledger_);
    o.budget_bytes = 256 * kMiB;
    arena_ = MakeArena(o);
    if (std::string(GetParam()) == "uring") {
      AioHandleOptions probe;
      probe.arena = arena_.get();
      probe.backend = "uring";
      auto h = AioHandle::Create(probe);
      if (!h.ok() && h.status().code() == StatusCode::kUnavailable) {
        GTEST_SKIP() << h.status().ToString();  // io_uring is not available here
      }
    }
    handle_ = Make(AioHandleOptions{});
    ASSERT_NE(handle_, nullptr);
  }
  void TearDown() override {
    handle_.reset();
    arena_.reset();
  }
  std::unique_ptr<AioHandle> Make(AioHandleOptions o) {
    o.arena = arena_.get();
    o.backend = GetParam();
    o.block_size = 64 * 1024;
    auto h = AioHandle::Create(o);
    EXPECT_TRUE(h.ok()) << h.status().ToString();
    return h.ok() ? std::move(*h) : nullptr;
  }
  // `bytes` page-aligned bytes from the arena, filled from `seed`, held by the buffer's keep.
  AioBuffer Buffer(uint64_t bytes, uint64_t seed) {
    auto p = arena_->Allocate(bytes, Tag(Kind::kSwapBuffer, Lifetime::kPersistent));
    EXPECT_TRUE(p.ok()) << p.status().ToString();
    FillRandom(*p, bytes, seed);
    allocator::HostArena* arena = arena_.get();
    return AioBuffer{*p, bytes, std::shared_ptr<const void>(*p, [arena](const void* q) {
                       (void)arena->Free(const_cast<void*>(q));
                     })};
  }
  static std::string Bytes(const AioBuffer& b) {
    return std::string(static_cast<const char*>(b.data), b.bytes);
  }

  allocator::Ledger ledger_;
  std::unique_ptr<allocator::HostArena> arena_;
  std::unique_ptr<AioHandle> handle_;
};

TEST_P(AioHandleTest, WrittenBytesReadBackFromTheSameFile) {
  Dir dir;
  const std::string path = dir.File("a");
  AioBuffer out = Buffer(256 * 1024, 1);
  EXPECT_EQ(*handle_->Submit(out, path, 0, /*write=*/true, AioMode::kAlone), 1);
  EXPECT_EQ(ReadAll(path), Bytes(out));
  AioBuffer in = Buffer(256 * 1024, 2);
  EXPECT_EQ(*handle_->Submit(in, path, 0, /*write=*/false, AioMode::kSync), 1);
  EXPECT_EQ(Bytes(in), Bytes(out));
  // Unaligned sizes and offsets go through a buffered descriptor: refused by none.
  AioBuffer odd{static_cast<char*>(out.data) + 1, 1000, out.keep};
  EXPECT_EQ(*handle_->Submit(odd, path, 7, true, AioMode::kAlone), 1);
  EXPECT_EQ(ReadAll(path).substr(7, 1000), Bytes(odd));
}

TEST_P(AioHandleTest, AsyncOpsFinishAtWaitAndTheBufferIsHeldUntilThen) {
  Dir dir;
  std::vector<AioBuffer> bufs;
  for (int i = 0; i < 8; ++i) {
    bufs.push_back(Buffer(128 * 1024, 10 + i));
    EXPECT_EQ(
        *handle_->Submit(bufs.back(), dir.File("f" + std::to_string(i)), 0, true, AioMode::kAsync),
        0);
  }
  EXPECT_GE(bufs[0].keep.use_count(), 2) << "the op holds its buffer until it is waited for";
  EXPECT_EQ(*handle_->Wait(), 8);
  EXPECT_EQ(bufs[0].keep.use_count(), 1) << "waited for: the op let its buffer go";
  for (int i = 0; i < 8; ++i) EXPECT_EQ(ReadAll(dir.File("f" + std::to_string(i))), Bytes(bufs[i]));
  EXPECT_EQ(*handle_->Wait(), 0);
}

TEST_P(AioHandleTest, ASyncOpWaitsForTheAsyncOpsBeforeItAndAnAloneOpDoesNot) {
  Dir dir;
  AioBuffer a = Buffer(64 * 1024, 3), b = Buffer(64 * 1024, 4);
  EXPECT_EQ(*handle_->Submit(a, dir.File("a"), 0, true, AioMode::kAsync), 0);
  EXPECT_EQ(*handle_->Submit(b, dir.File("b"), 0, true, AioMode::kSync), 2);
  EXPECT_EQ(*handle_->Wait(), 0) << "the sync op took the async one before it";
  EXPECT_EQ(*handle_->Submit(a, dir.File("c"), 0, true, AioMode::kAsync), 0);
  EXPECT_EQ(*handle_->Submit(b, dir.File("d"), 0, true, AioMode::kAlone), 1);
  EXPECT_EQ(*handle_->Wait(), 1) << "the alone op left the async one to wait()";
  EXPECT_EQ(ReadAll(dir.File("c")), Bytes(a));
  EXPECT_EQ(ReadAll(dir.File("d")), Bytes(b));
}

TEST_P(AioHandleTest, APathThatNamesAnotherFileSinceItWasOpenedIsOpenedAgain) {
  Dir dir;
  const std::string path = dir.File("p");
  AioBuffer first = Buffer(64 * 1024, 5), second = Buffer(64 * 1024, 6);
  EXPECT_EQ(*handle_->Submit(first, path, 0, true, AioMode::kAlone), 1);  // kept open
  ASSERT_EQ(::rename(path.c_str(), dir.File("moved").c_str()), 0);
  const int fresh = ::open(path.c_str(), O_WRONLY | O_CREAT | O_CLOEXEC, 0600);  // the old name
  ASSERT_GE(fresh, 0);
  ::close(fresh);
  EXPECT_EQ(*handle_->Submit(second, path, 0, true, AioMode::kAlone), 1);
  EXPECT_EQ(ReadAll(dir.File("moved")), Bytes(first)) << "the old file got a byte of the new op";
  EXPECT_EQ(ReadAll(path), Bytes(second));
}

TEST_P(AioHandleTest, AnFdOpWritesTheFileTheNumberNamedAtTheCall) {
  Dir dir;
  const int fd = ::open(dir.File("x").c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0600);
  ASSERT_GE(fd, 0);
  AioBuffer b = Buffer(64 * 1024, 7);
  EXPECT_EQ(*handle_->SubmitFd(b, fd, 0, true), 0);
  ::close(fd);  // the number is the caller's again; the op holds a dup
  const int reused = ::open(dir.File("y").c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0600);
  ASSERT_EQ(reused, fd) << "the lowest free number: the one the op was given";
  EXPECT_EQ(*handle_->Wait(), 1);
  EXPECT_EQ(ReadAll(dir.File("x")), Bytes(b));
  EXPECT_EQ(ReadAll(dir.File("y")), "");
  ::close(reused);
  // A negative number is the op's failure, not the handle's.
  EXPECT_EQ(*handle_->SubmitFd(b, -1, 0, true), -1);
  EXPECT_TRUE(
      Has(Status::InvalidArgument(*handle_->last_error()), "pwrite fd -1: not a descriptor"));
  // On a closed handle the call cannot run at all: a Status, whatever its arguments.
  ASSERT_TRUE(handle_->Close().ok());
  EXPECT_EQ(handle_->SubmitFd(b, -1, 0, true).status().code(), StatusCode::kFailedPrecondition);
}

TEST_P(AioHandleTest, MoreFilesThanTheTableKeepsWithOpsPendingAllLand) {
  Dir dir;
  constexpr int kFiles = 200;  // over the table's 128: the least recently used leave it
  std::vector<AioBuffer> bufs;
  for (int i = 0; i < kFiles; ++i) {
    bufs.push_back(Buffer(4096, 100 + i));
    ASSERT_EQ(*handle_->Submit(bufs.back(), dir.File(std::to_string(i)), 0, true, AioMode::kAsync),
              0);
  }
  EXPECT_EQ(*handle_->Wait(), kFiles);
  for (int i = 0; i < kFiles; ++i) {
    ASSERT_EQ(ReadAll(dir.File(std::to_string(i))), Bytes(bufs[i])) << "file " << i;
  }
}

TEST_P(AioHandleTest, AFailedOpSaysWhyAndLosesNothingElse) {
  Dir dir;
  AioBuffer ok = Buffer(64 * 1024, 8);
  EXPECT_EQ(*handle_->Submit(ok, dir.File("ok"), 0, true, AioMode::kAsync), 0);
  AioBuffer b = Buffer(8192, 9);
  EXPECT_EQ(*handle_->Submit(b, dir.File("neg"), -4096, true, AioMode::kAlone), -1);
  EXPECT_NE(handle_->last_error()->find("negative file offset -4096"), std::string::npos)
      << *handle_->last_error();
  EXPECT_EQ(*handle_->Submit(b, dir.File("ok"), 65536, false, AioMode::kAlone), -1);
  EXPECT_NE(handle_->last_error()->find("runs past the end of the file"), std::string::npos)
      << *handle_->last_error();
  EXPECT_EQ(*handle_->Submit(b, dir.File("no/such/dir"), 0, true, AioMode::kAlone), -1);
  EXPECT_NE(handle_->last_error()->find("cannot open"), std::string::npos)
      << *handle_->last_error();
  auto three = Make(AioHandleOptions{.intra_op_parallelism = 3});
  EXPECT_EQ(*three->Submit(b, dir.File("three"), 0, true, AioMode::kAlone), -1);
  EXPECT_NE(three->last_error()->find("not divisible by intra_op_parallelism=3"), std::string::npos)
      << *three->last_error();
  EXPECT_EQ(*handle_->Wait(), 1) << "the async op before the failures still completes";
  EXPECT_EQ(ReadAll(dir.File("ok")), Bytes(ok));
}

TEST_P(AioHandleTest, BadSettingsAreRefusedByName) {
  auto bad = [&](AioHandleOptions o, const char* text) {
    o.arena = arena_.get();
    if (o.backend == "auto") o.backend = GetParam();
    auto h = AioHandle::Create(o);
    ASSERT_FALSE(h.ok()) << text;
    EXPECT_EQ(h.status().code(), StatusCode::kInvalidArgument);
    EXPECT_TRUE(Has(h.status(), text)) << h.status().ToString();
  };
  bad(AioHandleOptions{.block_size = 0}, "each must be positive");
  bad(AioHandleOptions{.queue_depth = 0}, "each must be positive");
  bad(AioHandleOptions{.intra_op_parallelism = -1}, "each must be positive");
  bad(AioHandleOptions{.backend = "libaio"}, "one of 'auto', 'uring', 'thread_pool'");
  bad(AioHandleOptions{.bounce_buffers = 0}, "aio_handle(bounce_buffers=0): use 1..1024");
  bad(AioHandleOptions{.bounce_buffers = 1025}, "aio_handle(bounce_buffers=1025): use 1..1024");
  auto h = AioHandle::Create(AioHandleOptions{});  // no arena
  ASSERT_FALSE(h.ok());
  EXPECT_TRUE(Has(h.status(), "no arena")) << h.status().ToString();
}

TEST_P(AioHandleTest, TheBouncePoolIsAsManyBlocksAsAskedFor) {
  // A handle whose buffers are all in the arena (the checkpoint writer's staging buffers) needs
  // no bounce pool of DeepSpeed's size: each bounce buffer is one block of the arena.
  for (uint32_t n : {1u, 3u}) {
    const uint64_t before = arena_->Stats().live_bytes;
    AioHandleOptions o;
    o.bounce_buffers = n;
    auto h = Make(o);
    ASSERT_NE(h, nullptr);
    EXPECT_EQ(arena_->Stats().live_bytes - before, n * 64 * 1024) << n;
    Dir dir;
    AioBuffer b = Buffer(256 * 1024, 5);
    EXPECT_EQ(*h->Submit(b, dir.File("a"), 0, true, AioMode::kAlone), 1);
    EXPECT_EQ(ReadAll(dir.File("a")), Bytes(b));
  }
}

TEST_P(AioHandleTest, AClosedHandleRefusesEveryCall) {
  Dir dir;
  AioBuffer b = Buffer(64 * 1024, 11);
  EXPECT_EQ(*handle_->Submit(b, dir.File("a"), 0, true, AioMode::kAsync), 0);
  EXPECT_TRUE(handle_->Close().ok());
  EXPECT_EQ(ReadAll(dir.File("a")), Bytes(b)) << "close() waits for the ops in flight";
  auto r = handle_->Submit(b, dir.File("a"), 0, true, AioMode::kAlone);
  ASSERT_FALSE(r.ok());
  EXPECT_TRUE(Has(r.status(), "aio_handle is closed; make a new one"));
  EXPECT_FALSE(handle_->Wait().ok());
  EXPECT_TRUE(handle_->Close().ok()) << "a second close is a no-op";
}

TEST_P(AioHandleTest, AForkedChildIsRefusedAndTheParentCarriesOn) {
  Dir dir;
  AioBuffer b = Buffer(64 * 1024, 12);
  EXPECT_EQ(*handle_->Submit(b, dir.File("before"), 0, true, AioMode::kAlone), 1);
  // In flight at the fork: the child's handle holds it, and must leave it alone.
  AioBuffer pending = Buffer(1 << 20, 14);
  EXPECT_EQ(*handle_->Submit(pending, dir.File("pending"), 0, true, AioMode::kAsync), 0);
  const pid_t pid = fork();
  ASSERT_GE(pid, 0);
  if (pid == 0) {
    alarm(30);  // a call that hangs ends the child by SIGALRM, which the parent reports
    int bad = 0;
    for (const Status& st :
         {handle_->Submit(b, dir.File("child"), 0, true, AioMode::kAlone).status(),
          handle_->Wait().status(), handle_->Close(), handle_->last_error().status()}) {
      if (st.code() != StatusCode::kFailedPrecondition || !Has(st, "forked child")) {
        std::fprintf(stderr, "child: %s\n", st.ToString().c_str());
        ++bad;
      }
    }
    handle_.reset();  // touches nothing of the parent's
    _exit(bad);
  }
  int status = 0;
  ASSERT_EQ(waitpid(pid, &status, 0), pid);
  ASSERT_TRUE(WIFEXITED(status)) << "the child died of signal " << WTERMSIG(status);
  EXPECT_EQ(WEXITSTATUS(status), 0);
  EXPECT_EQ(ReadAll(dir.File("child")), "<missing>");
  EXPECT_EQ(*handle_->Wait(), 1) << "the op in flight at the fork is the parent's to wait for";
  EXPECT_EQ(ReadAll(dir.File("pending")), Bytes(pending));
  AioBuffer after = Buffer(64 * 1024, 13);
  EXPECT_EQ(*handle_->Submit(after, dir.File("after"), 0, true, AioMode::kSync), 1);
  EXPECT_EQ(ReadAll(dir.File("after")), Bytes(after));
}

TEST_P(AioHandleTest, ThreadsShareOneHandle) {
  Dir dir;
  constexpr int kThreads = 4, kOps = 24;
  std::vector<std::vector<AioBuffer>> bufs(kThreads);
  for (int t = 0; t < kThreads; ++t) {
    for (int i = 0; i < kOps; ++i) bufs[t].push_back(Buffer(8192, 1000 * t + i));
  }
  std::atomic<int> completed{0}, failed{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      for (int i = 0; i < kOps; ++i) {
        const std::string f = dir.File(std::to_string(t) + "-" + std::to_string(i % 5));
        const AioMode mode = i % 3 == 0 ? AioMode::kSync : AioMode::kAsync;
        auto r = handle_->Submit(bufs[t][i], f, 8192 * (i / 5), true, mode);
        if (!r.ok() || *r < 0) ++failed;
        if (r.ok() && *r > 0) completed += *r;
        if (i % 7 == 6) {
          auto w = handle_->Wait();
          if (!w.ok() || *w < 0) ++failed;
          if (w.ok() && *w > 0) completed += *w;
        }
      }
    });
  }
  for (auto& th : threads) th.join();
  completed += *handle_->Wait();
  EXPECT_EQ(failed.load(), 0);
  EXPECT_EQ(completed.load(), kThreads * kOps) << "every op is counted by exactly one call";
  for (int t = 0; t < kThreads; ++t) {
    for (int i = 0; i < kOps; ++i) {
      const std::string got = ReadAll(dir.File(std::to_string(t) + "-" + std::to_string(i % 5)))
                                  .substr(8192 * (i / 5), 8192);
      ASSERT_EQ(got, Bytes(bufs[t][i])) << "thread " << t << " op " << i;
    }
  }
}

// DeepSpeed's swaps (AioHandle::SubmitSwap): a SwapStore on the handle's own engine, its
// transfers the handle's ops. Note [DeepSpeed swap] in docs/deepspeed.md.
class AioHandleSwapTest : public AioHandleTest {
 protected:
  void SetUp() override {
    AioHandleTest::SetUp();
    if (IsSkipped() || handle_ == nullptr) return;
    SwapStoreOptions o;
    o.directory = NvmeTestDir();
    o.budget_bytes = 64 * kMiB;
    o.engine = *handle_->engine();
    o.ledger = &ledger_;
    auto s = SwapStore::Create(o);
    ASSERT_TRUE(s.ok()) << s.status().ToString();
    store_ = std::move(*s);
  }
  void TearDown() override {
    store_.reset();  // it keeps the handle's engine: before the arena of its bounce buffers
    AioHandleTest::TearDown();
  }
  Result<int> Swap(AioBuffer b, const std::string& path, bool write, AioMode mode) {
    return handle_->SubmitSwap(std::move(b), store_, path, write, Kind::kOptimizerState, mode);
  }
  std::shared_ptr<SwapStore> store_;
};

TEST_P(AioHandleSwapTest, SwapsAreTheHandlesOpsOnItsOneEngine) {
  Dir dir;
  const uint64_t engine_writes = (*handle_->engine())->Stats().write_bytes;
  std::vector<AioBuffer> out;
  for (int i = 0; i < 3; ++i) out.push_back(Buffer(65536 * (i + 1) + 512 * i, 40 + i));
  for (int i = 0; i < 3; ++i) {
    EXPECT_EQ(*Swap(out[i], "/swap/f" + std::to_string(i), true, AioMode::kAsync), 0);
  }
  AioBuffer file = Buffer(65536, 49);
  EXPECT_EQ(*handle_->Submit(file, dir.File("plain"), 0, true, AioMode::kAsync), 0);
  EXPECT_EQ(*handle_->Wait(), 4) << "wait() counts the swaps with the handle's other ops";
  EXPECT_EQ(store_->files(), 3u);
  EXPECT_GE((*handle_->engine())->Stats().write_bytes - engine_writes,
            out[0].bytes + out[1].bytes + out[2].bytes + file.bytes)
      << "the swaps ran on the handle's engine";
  std::vector<AioBuffer> in;
  for (int i = 0; i < 3; ++i) in.push_back(Buffer(out[i].bytes, 90 + i));
  EXPECT_EQ(*Swap(in[0], "/swap/f0", false, AioMode::kAsync), 0);
  EXPECT_EQ(*Swap(in[1], "/swap/f1", false, AioMode::kAsync), 0);
  EXPECT_EQ(*Swap(in[2], "/swap/f2", false, AioMode::kSync), 3)
      << "a sync swap waits for the async ops before it, as a sync file op does";
  for (int i = 0; i < 3; ++i) EXPECT_EQ(Bytes(in[i]), Bytes(out[i])) << i;
  EXPECT_EQ(*handle_->Wait(), 0);
}

TEST_P(AioHandleSwapTest, AFailedSwapRaisesOnceEveryOpItWaitsForHasFinished) {
  Dir dir;
  AioBuffer good = Buffer(65536, 50), bad = Buffer(65536, 51);
  EXPECT_EQ(*Swap(good, "/swap/good", true, AioMode::kSync), 1);
  EXPECT_EQ(*Swap(bad, "/swap/bad", true, AioMode::kSync), 1);
  ASSERT_TRUE(store_->CorruptForTesting("/swap/bad", 4097).ok());
  AioBuffer good_in = Buffer(65536, 52), bad_in = Buffer(65536, 53), file = Buffer(65536, 54);
  EXPECT_EQ(*Swap(bad_in, "/swap/bad", false, AioMode::kAsync), 0);
  EXPECT_EQ(*Swap(good_in, "/swap/good", false, AioMode::kAsync), 0);
  EXPECT_EQ(*handle_->Submit(file, dir.File("plain"), 0, true, AioMode::kAsync), 0);
  auto w = handle_->Wait();
  ASSERT_FALSE(w.ok());
  EXPECT_EQ(w.status().code(), StatusCode::kChecksumMismatch);
  EXPECT_TRUE(Has(w.status(), "DeepSpeed swap file /swap/bad")) << w.status().ToString();
  EXPECT_NE(handle_->last_error()->find("pread /swap/bad"), std::string::npos)
      << *handle_->last_error();
  EXPECT_EQ(Bytes(good_in), Bytes(good)) << "the other ops of the wait finished and landed";
  EXPECT_EQ(ReadAll(dir.File("plain")), Bytes(file));
  EXPECT_EQ(*handle_->Wait(), 0) << "nothing is left in flight";
  // Refused at the call, naming the file, with nothing submitted.
  auto missing = Swap(good_in, "/swap/never", false, AioMode::kAsync);
  ASSERT_FALSE(missing.ok());
  EXPECT_TRUE(Has(missing.status(), "DeepSpeed swap file /swap/never"))
      << missing.status().ToString();
  AioBuffer small = Buffer(4096, 55);
  auto prefix = Swap(small, "/swap/good", false, AioMode::kAsync);
  ASSERT_FALSE(prefix.ok());
  EXPECT_EQ(prefix.status().code(), StatusCode::kInvalidArgument);
  EXPECT_TRUE(Has(prefix.status(), "fast_init")) << prefix.status().ToString();
  EXPECT_EQ(*handle_->Wait(), 0);
  AioBuffer again = Buffer(65536, 56);
  EXPECT_EQ(*Swap(again, "/swap/good", false, AioMode::kSync), 1) << "the store is intact";
  EXPECT_EQ(Bytes(again), Bytes(good));
}

TEST_P(AioHandleSwapTest, TheStoreKeepsTheEngineOfAClosedHandle) {
  AioBuffer b = Buffer(65536, 60);
  EXPECT_EQ(*Swap(b, "/swap/kept", true, AioMode::kAsync), 0);
  EXPECT_TRUE(handle_->Close().ok()) << "close() completes the swap in flight";
  auto r = Swap(b, "/swap/kept", false, AioMode::kAsync);
  ASSERT_FALSE(r.ok());
  EXPECT_TRUE(Has(r.status(), "aio_handle is closed")) << r.status().ToString();
  EXPECT_FALSE(handle_->engine().ok());
  std::string in(b.bytes, '\0');
  ASSERT_TRUE(store_->Read("/swap/kept", in.data(), in.size()).ok())
      << "the store still runs on the engine it shares";
  EXPECT_EQ(in, Bytes(b));
}

// DeepSpeed's pipelined swapper reads on one handle and writes on another, and the store runs
// on the engine of whichever handle its swapper named first: swaps of handle B on A's engine,
// with A closed (and gone) while B's swaps are in flight.
TEST_P(AioHandleSwapTest, AnotherHandlesSwapsRunOnTheStoresEngineAfterItsHandleIsGone) {
  std::unique_ptr<AioHandle> other = Make(AioHandleOptions{});
  ASSERT_NE(other, nullptr);
  std::vector<AioBuffer> out;
  for (int i = 0; i < 4; ++i) out.push_back(Buffer(65536 * (i + 1), 70 + i));
  for (int i = 0; i < 2; ++i) {
    auto r = other->SubmitSwap(out[i], store_, "/swap/b" + std::to_string(i), true,
                               Kind::kOptimizerState, AioMode::kAsync);
    ASSERT_TRUE(r.ok() && *r == 0) << r.status().ToString();
  }
  EXPECT_TRUE(handle_->Close().ok());
  handle_.reset();  // the store keeps its engine
  for (int i = 2; i < 4; ++i) {
    auto r = other->SubmitSwap(out[i], store_, "/swap/b" + std::to_string(i), true,
                               Kind::kOptimizerState, AioMode::kAsync);
    ASSERT_TRUE(r.ok() && *r == 0) << r.status().ToString();
  }
  EXPECT_EQ(*other->Wait(), 4);
  for (int i = 0; i < 4; ++i) {
    AioBuffer in = Buffer(out[i].bytes, 80 + i);
    EXPECT_EQ(*other->SubmitSwap(in, store_, "/swap/b" + std::to_string(i), false,
                                 Kind::kOptimizerState, AioMode::kSync),
              1);
    EXPECT_EQ(Bytes(in), Bytes(out[i])) << i;
  }
  store_.reset();  // before `other`'s arena (the fixture's) goes
}

std::string BackendName(const ::testing::TestParamInfo<const char*>& param) {
  return std::string(param.param) == "uring" ? "Uring" : "ThreadPool";
}

INSTANTIATE_TEST_SUITE_P(Backends, AioHandleTest, ::testing::Values("uring", "thread_pool"),
                         BackendName);
INSTANTIATE_TEST_SUITE_P(Backends, AioHandleSwapTest, ::testing::Values("uring", "thread_pool"),
                         BackendName);

}  // namespace
}  // namespace spillway::aio
