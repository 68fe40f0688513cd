// The deferred-block table on fake events (no torch: this test runs under ThreadSanitizer too):
// deferred free under a pending event, several streams, failed and throwing events, graph pools,
// a forked child's table, exact sizes, and concurrent use. Note [Deferred free] in
// docs/deepspeed.md.
#include "spillway/torch_alloc/block_table.h"

#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <memory>
#include <stdexcept>
#include <string>
#include <thread>
#include <utility>
#include <vector>

namespace spillway::torch_alloc {
namespace {

// Events that complete when the test says: an event is the number of the recording; it has
// completed once `completed` reaches it. Record throws while `fail_records` is set, Query while
// `fail_queries` is.
struct FakeEvents {
  using Stream = int;
  using Event = uint64_t;
  using PoolId = std::pair<uint64_t, uint64_t>;
  struct PoolIdHash {
    size_t operator()(const PoolId& id) const { return id.first * 31 + id.second; }
  };
  struct State {
    std::atomic<uint64_t> recorded{0};
    std::atomic<uint64_t> completed{0};
    std::atomic<bool> fail_records{false};
    std::atomic<bool> fail_queries{false};
  };
  std::shared_ptr<State> state = std::make_shared<State>();

  Event Record(const Stream&) {
    if (state->fail_records.load()) throw std::runtime_error("no event today");
    return ++state->recorded;
  }
  bool Query(Event& e) {
    if (state->fail_queries.load()) throw std::runtime_error("the device went away");
    return state->completed.load() >= e;
  }
  static std::string Describe(const std::exception& e) { return e.what(); }
  void CompleteAll() { state->completed.store(state->recorded.load()); }
};

using Table = BlockTable<FakeEvents>;

std::shared_ptr<SharedArena> MakeArena(uint64_t budget = 0) {
  SharedArenaOptions o;
  o.name = "blocks";
  o.budget_bytes = budget;
  o.pin = allocator::PinMode::kPageable;
  auto a = SharedArena::Create(o);
  EXPECT_TRUE(a.ok()) << a.status().ToString();
  return *a;
}

const allocator::OwnerTag kTag{allocator::Kind::kTransient, allocator::Lifetime::kStep, 0,
                               allocator::kProcessScope, "test"};

struct Rig {
  Table table;
  std::shared_ptr<SharedArena> arena = MakeArena();
  FakeEvents& events() { return table.traits(); }
  Block<FakeEvents>* Make(uint64_t bytes, bool pinned = true, const int* stream = nullptr) {
    auto p = arena->get()->Allocate(bytes, kTag);
    EXPECT_TRUE(p.ok()) << p.status().ToString();
    return table.Make(*p, bytes, arena, pinned, stream);
  }
  // What callers asked for, exactly (live_bytes is rounded to the arena's page granule).
  uint64_t ArenaLive() { return arena->get()->Stats().requested_bytes; }
};

TEST(BlockTable, ABlockNoStreamUsedIsFreedAtRelease) {
  Rig r;
  auto* b = r.Make(1000003);  // exact size: no rounding anywhere
  EXPECT_EQ(r.ArenaLive(), 1000003u);
  EXPECT_EQ(r.table.Stats(false).live_bytes, 1000003u);
  r.table.Release(b);
  EXPECT_EQ(r.ArenaLive(), 0u);
  const BlockStats s = r.table.Stats(false);
  EXPECT_EQ(s.live_blocks, 0u);
  EXPECT_EQ(s.deferred_blocks, 0u);
  EXPECT_EQ(s.freed_bytes_total, 1000003u);
  EXPECT_EQ(s.peak_live_bytes, 1000003u);
}

TEST(BlockTable, FreeWaitsForThePendingEvent) {
  Rig r;
  auto* b = r.Make(4096);
  ASSERT_TRUE(r.table.Record(b, 7));
  ASSERT_TRUE(r.table.Record(b, 7));  // the same stream again: one event, not two
  r.table.Release(b);
  BlockStats s = r.table.Stats(false);
  EXPECT_EQ(s.deferred_blocks, 1u);
  EXPECT_EQ(s.deferred_bytes, 4096u);
  EXPECT_EQ(s.events_recorded_total, 1u);
  EXPECT_EQ(r.ArenaLive(), 4096u) << "freed while its copy may still run";
  EXPECT_EQ(r.table.Poll(), 0u);
  EXPECT_EQ(r.ArenaLive(), 4096u);
  r.events().CompleteAll();
  EXPECT_EQ(r.table.Poll(), 1u);
  EXPECT_EQ(r.ArenaLive(), 0u);
  s = r.table.Stats(false);
  EXPECT_EQ(s.deferred_blocks, 0u);
  EXPECT_EQ(s.deferred_frees_total, 1u);
}

TEST(BlockTable, EveryStreamsEventMustComplete) {
  Rig r;
  auto* b = r.Make(4096);
  ASSERT_TRUE(r.table.Record(b, 1));
  ASSERT_TRUE(r.table.Record(b, 2));
  r.table.Release(b);
  EXPECT_EQ(r.table.Stats(false).events_recorded_total, 2u);
  r.events().state->completed.store(1);  // the first stream's work is done, not the second's
  EXPECT_EQ(r.table.Poll(), 0u);
  EXPECT_EQ(r.ArenaLive(), 4096u);
  r.events().CompleteAll();
  EXPECT_EQ(r.table.Poll(), 1u);
  EXPECT_EQ(r.ArenaLive(), 0u);
}

TEST(BlockTable, RecordOnMemoryNotOursIsRefusedAndCounted) {
  Rig r;
  int not_a_block = 0;
  EXPECT_FALSE(r.table.Record(&not_a_block, 1));
  EXPECT_FALSE(r.table.Record(nullptr, 1));
  auto* b = r.Make(64);
  r.table.Release(b);  // freed: a later record on it is foreign too
  EXPECT_FALSE(r.table.Record(b, 1));
  EXPECT_EQ(r.table.Stats(false).foreign_record_events_total, 3u);
  EXPECT_EQ(r.table.Stats(true).foreign_record_events_total, 3u);
}

TEST(BlockTable, AnEventThatCannotBeRecordedHoldsTheBlockForGood) {
  Rig r;
  auto* b = r.Make(8192);
  ASSERT_TRUE(r.table.Record(b, 1));
  r.events().state->fail_records = true;
  r.table.Release(b);  // prints why, keeps the memory: nobody can tell when the copy ends
  const BlockStats s = r.table.Stats(false);
  EXPECT_EQ(s.event_errors_total, 1u);
  EXPECT_EQ(s.deferred_blocks, 0u);
  r.events().state->fail_records = false;
  r.events().CompleteAll();
  EXPECT_EQ(r.table.Poll(), 0u);
  EXPECT_EQ(r.ArenaLive(), 8192u);
}

TEST(BlockTable, AQueryThatThrowsPutsEveryBlockBack) {
  Rig r;
  for (int i = 0; i < 3; ++i) {
    auto* b = r.Make(4096);
    ASSERT_TRUE(r.table.Record(b, i));
    r.table.Release(b);
  }
  r.events().CompleteAll();
  r.events().state->fail_queries = true;
  EXPECT_THROW(r.table.Poll(), std::runtime_error);
  EXPECT_EQ(r.table.Stats(false).deferred_blocks, 3u);
  EXPECT_EQ(r.ArenaLive(), 3u * 4096);
  r.events().state->fail_queries = false;
  EXPECT_EQ(r.table.Poll(), 3u);
  EXPECT_EQ(r.ArenaLive(), 0u);
}

TEST(BlockTable, APoolsUsedBlockIsNeverReused) {
  Rig r;
  const FakeEvents::PoolId pool{1, 1};
  r.table.BeginPool(pool, [](const int& s) { return s == 5; });
  EXPECT_TRUE(r.table.PoolsActive());
  const int capturing = 5, other = 6;
  auto* used = r.Make(4096, true, &capturing);
  auto* elsewhere = r.Make(4096, true, &other);        // the filter refuses its stream
  auto* not_pinned = r.Make(4096, false, &capturing);  // only the pinned allocator's blocks pool
  ASSERT_TRUE(r.table.Record(used, capturing));
  r.table.EndPool(pool);
  EXPECT_FALSE(r.table.PoolsActive());
  r.table.Release(used);
  r.table.Release(elsewhere);
  r.table.Release(not_pinned);
  BlockStats s = r.table.Stats(false);
  EXPECT_EQ(s.graph_held_blocks, 1u);
  EXPECT_EQ(s.graph_held_bytes, 4096u);
  r.table.ReleasePool(pool);
  r.events().CompleteAll();
  r.table.Poll();
  EXPECT_EQ(r.ArenaLive(), 4096u) << "a graph may replay work on a block it used";
}

TEST(BlockTable, APoolsUnusedBlockWaitsForEveryGraphToReleaseThePool) {
  Rig r;
  const FakeEvents::PoolId pool{2, 7};
  const int stream = 1;
  r.table.BeginPool(pool, [](const int&) { return true; });
  auto* b = r.Make(4096, true, &stream);
  EXPECT_EQ(r.table.Poll(), 0u);  // never queries during a capture
  r.table.EndPool(pool);
  r.table.BeginPool(pool, [](const int&) { return true; });  // a second graph shares the pool
  r.table.EndPool(pool);
  r.table.Release(b);
  EXPECT_EQ(r.table.Stats(false).deferred_blocks, 1u);
  r.table.ReleasePool(pool);  // one graph reset: the other still uses it
  EXPECT_EQ(r.ArenaLive(), 4096u);
  r.table.ReleasePool(pool);
  EXPECT_EQ(r.ArenaLive(), 0u);
  EXPECT_EQ(r.table.Stats(false).deferred_blocks, 0u);
}

TEST(BlockTable, NoPollWhileAPoolIsBeingAllocatedTo) {
  Rig r;
  auto* b = r.Make(4096);
  ASSERT_TRUE(r.table.Record(b, 1));
  r.table.Release(b);
  r.events().CompleteAll();
  r.table.BeginPool({3, 3}, [](const int&) { return false; });
  EXPECT_EQ(r.table.Poll(), 0u);
  r.table.EndPool({3, 3});
  EXPECT_EQ(r.table.Poll(), 1u);
}

TEST(BlockTable, StatsSplitThePinnedAllocatorsBlocks) {
  Rig r;
  auto* pinned = r.Make(100, true);
  auto* tensor = r.Make(50, false);
  EXPECT_EQ(r.table.Stats(false).live_bytes, 150u);
  EXPECT_EQ(r.table.Stats(true).live_bytes, 100u);
  r.table.Release(pinned);
  r.table.Release(tensor);
  r.table.ResetAccumulated();
  EXPECT_EQ(r.table.Stats(false).allocated_bytes_total, 0u);
  r.table.ResetPeak();
  EXPECT_EQ(r.table.Stats(false).peak_live_bytes, 0u);
}

// A forked child gets a table of its own, and leaves the parent's blocks (whose memory it does
// not have when the arena is MADV_DONTFORK) alone.
TEST(BlockTable, AForkedChildMakesItsOwnTableAndLeavesTheParentsBlocks) {
  Table& parent = Table::ForThisProcess();
  EXPECT_EQ(&parent, &Table::ForThisProcess());
  auto arena = MakeArena();
  auto p = arena->get()->Allocate(4096, kTag);
  ASSERT_TRUE(p.ok());
  auto* b = parent.Make(*p, 4096, arena, true, nullptr);
  const pid_t pid = fork();
  ASSERT_GE(pid, 0);
  if (pid == 0) {
    Table& mine = Table::ForThisProcess();
    int code = 0;
    if (&mine == &parent) code = 1;                   // the parent's table (its mutex too)
    if (&Table::ForThisProcess() != &mine) code = 2;  // one per process
    mine.Release(b);                                  // the parent's arena: left alone
    if (mine.Stats(false).freed_bytes_total != 0) code = 3;
    _exit(code);
  }
  int status = 0;
  ASSERT_EQ(waitpid(pid, &status, 0), pid);
  ASSERT_TRUE(WIFEXITED(status));
  EXPECT_EQ(WEXITSTATUS(status), 0);
  EXPECT_EQ(arena->get()->Stats().requested_bytes, 4096u);
  parent.Release(b);
  EXPECT_EQ(arena->get()->Stats().requested_bytes, 0u);
}

// Threads make, record, release and poll at once while another completes events: every byte goes
// back, once. Under TSan this is the table's race test.
TEST(BlockTable, ConcurrentUseFreesEveryBlockOnce) {
  Rig r;
  constexpr int kThreads = 4, kBlocks = 300;
  std::atomic<bool> done{false};
  std::thread completer([&] {
    while (!done.load()) {
      r.events().CompleteAll();
      r.table.Poll();
      std::this_thread::yield();
    }
  });
  std::vector<std::thread> workers;
  for (int t = 0; t < kThreads; ++t) {
    workers.emplace_back([&, t] {
      for (int i = 0; i < kBlocks; ++i) {
        auto* b = r.Make(256 + t * 64 + i % 7, (i % 2) == 0);
        if (i % 3 != 0) r.table.Record(b, t);
        if (i % 5 == 0) r.table.Record(b, t + 100);
        r.table.Release(b);
        if (i % 10 == 0) r.table.Poll();
      }
    });
  }
  for (auto& w : workers) w.join();
  done = true;
  completer.join();
  r.events().CompleteAll();
  r.table.Poll();
  const BlockStats s = r.table.Stats(false);
  EXPECT_EQ(s.allocations_total, static_cast<uint64_t>(kThreads * kBlocks));
  EXPECT_EQ(s.live_blocks, 0u);
  EXPECT_EQ(s.deferred_blocks, 0u);
  EXPECT_EQ(s.freed_bytes_total, s.allocated_bytes_total);
  EXPECT_EQ(r.ArenaLive(), 0u);
}

}  // namespace
}  // namespace spillway::torch_alloc
