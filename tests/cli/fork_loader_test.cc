// The forking data loader with real fork()ed workers and real socket pairs: batches are the corpus
// rows the (seed, epoch) picked, in the same order for any number of workers; workers are new
// processes every epoch; a worker that dies is an error naming it; bad options are refused.
#include "spillway/cli/fork_loader.h"

#include <gtest/gtest.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <fstream>
#include <set>
#include <string>
#include <vector>

namespace spillway::cli {
namespace {

CharCorpus Corpus(const std::string& text) {
  const std::string path = ::testing::TempDir() + "/corpus-" + std::to_string(getpid()) + ".txt";
  std::ofstream(path) << text;
  auto c = CharCorpus::Load(path, 4);
  std::remove(path.c_str());
  EXPECT_TRUE(c.ok()) << c.status().ToString();
  return *c;
}

std::string Text() {
  std::string t;
  for (int i = 0; i < 2000; ++i) t += static_cast<char>(32 + (i * 7919) % 95);
  return t;
}

// What a Unix stream socket's sender may queue: net.core.wmem_default (SO_SNDBUF is never set).
uint64_t SocketSendBufferBytes() {
  uint64_t bytes = 212992;
  std::ifstream("/proc/sys/net/core/wmem_default") >> bytes;
  return bytes;
}

std::vector<std::vector<int64_t>> Epoch(ForkingLoader& l, int64_t epoch, uint64_t batches) {
  std::vector<std::vector<int64_t>> out;
  EXPECT_TRUE(l.BeginEpoch(epoch, batches).ok());
  for (uint64_t b = 0; b < batches; ++b) {
    std::vector<int64_t> rows(l.options().batch_size * l.row_elems());
    const Status st = l.Next(rows.data());
    EXPECT_TRUE(st.ok()) << st.ToString();
    out.push_back(rows);
  }
  EXPECT_TRUE(l.EndEpoch().ok());
  return out;
}

TEST(ForkLoaderTest, BatchesAreCorpusRowsInTheSameOrderForAnyWorkerCount) {
  const CharCorpus corpus = Corpus(Text());
  ForkingLoaderOptions o;
  o.batch_size = 3;
  o.seq_len = 10;
  o.seed = 5;
  std::vector<std::vector<std::vector<int64_t>>> by_workers;
  for (uint32_t workers : {1u, 2u, 5u}) {
    o.workers = workers;
    auto l = std::move(ForkingLoader::Create(&corpus, o).value());
    by_workers.push_back(Epoch(*l, 0, 12));
  }
  EXPECT_EQ(by_workers[0], by_workers[1]);
  EXPECT_EQ(by_workers[0], by_workers[2]);
  // Every row is a contiguous window of the corpus.
  const auto& toks = corpus.tokens();
  for (const auto& batch : by_workers[0]) {
    for (int r = 0; r < 3; ++r) {
      const int64_t* row = batch.data() + r * 11;
      bool found = false;
      for (size_t s = 0; s + 11 <= toks.size() && !found; ++s) {
        found = std::equal(row, row + 11, toks.begin() + s,
                           [](int64_t a, uint8_t b) { return a == static_cast<int64_t>(b); });
      }
      EXPECT_TRUE(found);
    }
  }
}

TEST(ForkLoaderTest, EveryEpochForksNewWorkersAndDrawsNewBatches) {
  const CharCorpus corpus = Corpus(Text());
  ForkingLoaderOptions o;
  o.workers = 3;
  auto l = std::move(ForkingLoader::Create(&corpus, o).value());
  std::set<pid_t> seen;
  std::vector<std::vector<int64_t>> first;
  for (int64_t e = 0; e < 3; ++e) {
    ASSERT_TRUE(l->BeginEpoch(e, 4).ok());
    ASSERT_EQ(l->worker_pids().size(), 3u);
    for (pid_t p : l->worker_pids()) {
      EXPECT_TRUE(seen.insert(p).second) << "pid " << p << " reused: workers must be forked anew";
      EXPECT_EQ(kill(p, 0), 0) << "worker " << p << " is not running";
    }
    std::vector<int64_t> rows(o.batch_size * l->row_elems());
    ASSERT_TRUE(l->Next(rows.data()).ok());
    if (e == 0)
      first.push_back(rows);
    else
      EXPECT_NE(rows, first[0]) << "epoch " << e << " drew epoch 0's batch";
    ASSERT_TRUE(
        l->EndEpoch().ok());  // three batches left unread: the workers are killed and reaped
    for (pid_t p : seen) EXPECT_NE(kill(p, 0), 0) << "worker " << p << " outlived its epoch";
  }
  EXPECT_EQ(l->Stats().forks, 9u);
}

TEST(ForkLoaderTest, AWorkerThatDiesIsNamedAndTheEpochIsClosed) {
  const CharCorpus corpus = Corpus(Text());
  ForkingLoaderOptions o;
  o.workers = 2;
  o.seq_len = 1000;
  // A batch four times what a worker's socket holds, so the victim cannot have sent all of it.
  // (With 100 KiB batches in a 208 KiB socket, batch 1 sometimes arrived whole.)
  o.batch_size =
      std::max<uint32_t>(64, static_cast<uint32_t>(4 * SocketSendBufferBytes() / (1001 * 8)) + 1);
  auto l = std::move(ForkingLoader::Create(&corpus, o).value());
  ASSERT_TRUE(l->BeginEpoch(0, 6).ok());
  const pid_t victim = l->worker_pids()[1];
  ASSERT_EQ(kill(victim, SIGKILL), 0);
  // Wait until it is dead, without reaping it (the loader reaps it and says how it ended). A
  // SIGKILL does not stop a write already copying in the kernel while the reader drains the
  // socket: reading batch 1 before the victim was dead let it send all of it now and then.
  siginfo_t info{};
  ASSERT_EQ(waitid(P_PID, static_cast<id_t>(victim), &info, WEXITED | WNOWAIT), 0);
  std::vector<int64_t> rows(o.batch_size * l->row_elems());
  ASSERT_TRUE(l->Next(rows.data()).ok());  // batch 0 belongs to worker 0
  const Status st = l->Next(rows.data());  // batch 1 belongs to the dead worker
  ASSERT_FALSE(st.ok());
  EXPECT_EQ(st.code(), StatusCode::kUnavailable);
  EXPECT_NE(st.message().find("worker 1 (pid " + std::to_string(victim) + ")"), std::string::npos)
      << st.message();
  EXPECT_NE(st.message().find("killed by signal 9"), std::string::npos) << st.message();
  EXPECT_FALSE(l->epoch_open());
  // The loader is usable again.
  auto again = Epoch(*l, 1, 3);
  EXPECT_EQ(again.size(), 3u);
}

TEST(ForkLoaderTest, OutOfOrderCallsAndBadOptionsAreRefused) {
  const CharCorpus corpus = Corpus(Text());
  ForkingLoaderOptions o;
  auto l = std::move(ForkingLoader::Create(&corpus, o).value());
  std::vector<int64_t> rows(o.batch_size * l->row_elems());
  EXPECT_EQ(l->Next(rows.data()).code(), StatusCode::kFailedPrecondition);
  EXPECT_EQ(l->EndEpoch().code(), StatusCode::kFailedPrecondition);
  ASSERT_TRUE(l->BeginEpoch(0, 1).ok());
  EXPECT_EQ(l->BeginEpoch(1, 1).code(), StatusCode::kFailedPrecondition);
  ASSERT_TRUE(l->Next(rows.data()).ok());
  const Status past = l->Next(rows.data());
  EXPECT_EQ(past.code(), StatusCode::kFailedPrecondition);
  EXPECT_NE(past.message().find("has only 1 batches"), std::string::npos);
  EXPECT_TRUE(l->EndEpoch().ok());
  EXPECT_EQ(l->BeginEpoch(2, 0).code(), StatusCode::kInvalidArgument);

  ForkingLoaderOptions zero;
  zero.workers = 0;
  auto bad = ForkingLoader::Create(&corpus, zero);
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.status().message().find("must all be at least 1"), std::string::npos);
  ForkingLoaderOptions long_rows;
  long_rows.seq_len = 5000;
  bad = ForkingLoader::Create(&corpus, long_rows);
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.status().message().find("fewer than one row"), std::string::npos);
}

TEST(CharCorpusTest, MissingAndShortFilesAreNamed) {
  auto missing = CharCorpus::Load("/nonexistent/text.txt", 10);
  ASSERT_FALSE(missing.ok());
  EXPECT_NE(missing.status().message().find("--data /nonexistent/text.txt: cannot open"),
            std::string::npos);
  const std::string path = ::testing::TempDir() + "/short-" + std::to_string(getpid()) + ".txt";
  std::ofstream(path) << "tiny";
  auto short_text = CharCorpus::Load(path, 66);
  std::remove(path.c_str());
  ASSERT_FALSE(short_text.ok());
  EXPECT_NE(short_text.status().message().find("holds 4 characters; the model needs at least 66"),
            std::string::npos);
  // The mapping: printable ASCII and newline round-trip, anything else becomes a space.
  for (int c = 32; c < 127; ++c) {
    EXPECT_EQ(CharCorpus::Decode(CharCorpus::Encode(static_cast<unsigned char>(c))), c);
  }
  EXPECT_EQ(CharCorpus::Decode(CharCorpus::Encode('\n')), '\n');
  EXPECT_EQ(CharCorpus::Decode(CharCorpus::Encode('\t')), ' ');
}

}  // namespace
}  // namespace spillway::cli
