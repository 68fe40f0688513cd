// ForkingLoader: a data loader that forks its worker processes at the start of every epoch and
// reaps them at its end, the way torch.utils.data.DataLoader does by default (fork start method,
// persistent_workers=False). This is the pattern behind the Yi-34B out-of-memory report: every
// epoch's fresh workers share the trainer's pages copy-on-write, so the first optimizer step after
// the fork copies every page of optimizer state that lives in ordinary memory. Note [Fork loader]
// in docs/cli.md.
//
// Worker w produces the batches b with b % workers == w, in order, into its own Unix socket; the
// parent reads batch b from socket b % workers, so the sequence of batches does not depend on the
// number of workers. Like DataLoader, a worker runs at most prefetch_factor batches ahead (the
// parent returns a one-byte credit per batch it takes) and lives until the epoch ends, so the
// workers are alive during every step of the epoch. Batch contents are fixed by (seed, epoch)
// before the fork. A child calls no allocator and no library that takes locks (the parent is
// multithreaded): it copies tokens into a buffer allocated before the fork, write()s them, and
// _exit()s.
//
// Owned by one thread.
#pragma once

#include <sys/types.h>

#include <cstdint>
#include <memory>
#include <vector>

#include "spillway/base/status.h"
#include "spillway/cli/char_corpus.h"

namespace spillway::cli {

struct ForkingLoaderOptions {
  uint32_t workers = 2;          // processes forked per epoch (>= 1)
  uint32_t batch_size = 8;       // sequences per batch
  uint32_t seq_len = 64;         // tokens per sequence; each row carries seq_len + 1 (the targets)
  uint32_t prefetch_factor = 2;  // batches a worker may run ahead (DataLoader's default)
  uint64_t seed = 1;
  int timeout_seconds = 60;  // a worker silent this long is an error naming it
};

struct ForkingLoaderStats {
  uint64_t forks = 0;    // worker processes started, over all epochs
  uint64_t batches = 0;  // delivered
};

class ForkingLoader {
 public:
  // `corpus` must outlive the loader. INVALID_ARGUMENT for zero workers/batch/seq_len or a corpus
  // shorter than one row.
  static Result<std::unique_ptr<ForkingLoader>> Create(const CharCorpus* corpus,
                                                       ForkingLoaderOptions options);
  ~ForkingLoader();  // kills and reaps workers still running
  ForkingLoader(const ForkingLoader&) = delete;
  ForkingLoader& operator=(const ForkingLoader&) = delete;

  // Forks the workers for `epoch`, which will deliver `batches` batches. FAILED_PRECONDITION when
  // an epoch is already open. On error no worker is left running.
  Status BeginEpoch(int64_t epoch, uint64_t batches);
  // The next batch: batch_size rows of seq_len + 1 token ids, row-major, into `rows`
  // (batch_size * (seq_len + 1) elements). A worker that died or went silent is an error naming it,
  // its pid and how it ended; the epoch is then closed and its workers reaped.
  Status Next(int64_t* rows);
  // Reaps the workers (killing them first if batches are left unread). A worker that exited with a
  // failure is an error naming it.
  Status EndEpoch();

  const std::vector<pid_t>& worker_pids() const { return pids_; }
  bool epoch_open() const { return !pids_.empty(); }
  uint64_t row_elems() const { return static_cast<uint64_t>(options_.seq_len) + 1; }
  const ForkingLoaderOptions& options() const { return options_; }
  ForkingLoaderStats Stats() const { return stats_; }

 private:
  ForkingLoader(const CharCorpus* corpus, ForkingLoaderOptions options);
  [[noreturn]] void WorkerMain(uint32_t worker, int fd);
  Status Reap(bool kill_first);  // closes the sockets, waits for every worker
  Status WorkerFailed(uint32_t worker, const char* what);

  const CharCorpus* const corpus_;
  const ForkingLoaderOptions options_;
  std::vector<uint64_t> starts_;     // row start offsets for this epoch, batch-major
  std::vector<int64_t> child_rows_;  // a child's batch buffer, allocated before the fork
  std::vector<pid_t> pids_;          // this epoch's workers; empty when no epoch is open
  std::vector<int> fds_;             // the parent's socket ends, one per worker
  uint64_t batches_ = 0;
  uint64_t next_ = 0;
  int64_t epoch_ = -1;
  ForkingLoaderStats stats_;
};

}  // namespace spillway::cli
