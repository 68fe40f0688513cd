// IoFaults: the I/O engine's fault-injection seam, for tests. Each counter makes that many upcoming
// chunks misbehave. The I/O itself is real; only its reported result or its length is changed.
// Pass one in IoEngineOptions::faults. See docs/nvme.md.
#pragma once

#include <atomic>

namespace spillway::allocator {

struct IoFaults {
  std::atomic<int> read_errno{0};    // the next read chunk completes with -read_errno
  std::atomic<int> write_errno{0};   // the next write chunk completes with -write_errno
  std::atomic<int> short_reads{0};   // the next N read chunks are submitted at half length
  std::atomic<int> short_writes{0};  // likewise for writes
  std::atomic<int> eintr{0};         // the next N chunk completions report -EINTR
  std::atomic<int> eagain{0};        // the next N chunk completions report -EAGAIN
  // Ring only. The next io_uring_submit_and_wait is not made and reports -submit_errno instead
  // (its SQEs stay unsubmitted, as when the call really fails).
  std::atomic<int> submit_errno{0};
  std::atomic<int> null_sqes{0};  // the next N io_uring_get_sqe calls return null
  // Ring only. The next fixed-file slot clear in UnregisterFile fails with -unregister_errno.
  std::atomic<int> unregister_errno{0};
  // Read once at Create: sparse table registration fails with this errno (a kernel before 5.19).
  int sparse_registration_errno = 0;
};

}  // namespace spillway::allocator
