// The bridge from Spillway's C++ log (allocator/include/spillway/allocator/log.h) to Python's
// `logging`. Lines come from any thread, often with a Spillway lock held (an arena's, the store's,
// the ring thread's), so the sink never takes the GIL: taking it there could deadlock against a
// Python thread that holds the GIL and waits for that lock. It appends the line to a bounded queue
// under a leaf mutex and returns. A Python thread (spillway/_log.py) waits on the queue with the GIL
// released and hands each line to the logger. At exit, and in a forked child until the child's
// pump starts, lines go to stderr as without the bridge.
#include "log_bridge.h"

#include <pthread.h>

#include <condition_variable>
#include <cstdint>
#include <deque>
#include <mutex>
#include <string>
#include <thread>
#include <utility>

#include "spillway/allocator/log.h"

namespace py = pybind11;

namespace spillway::python {
namespace {

// A line a burst may queue before the pump drains it. Beyond it lines are counted, not kept, and
// the count is logged as a warning once the pump catches up.
constexpr size_t kMaxQueued = 4096;

struct Queue {
  std::mutex mu;
  std::condition_variable ready;     // the pump waits: a line, a drop or a stop
  std::condition_variable progress;  // Flush waits: `delivered` moved
  std::deque<std::pair<LogLevel, std::string>> lines;  // guarded by mu
  uint64_t dropped = 0;                                 // guarded by mu
  uint64_t logged = 0;     // guarded by mu: lines the sink took (queued or dropped)
  uint64_t delivered = 0;  // guarded by mu: of those, lines emitted or reported dropped
  bool stop = false;                                    // guarded by mu: the pump returns
};

Queue& TheQueue() {
  static auto* q = new Queue();  // never destroyed: C++ threads may log during interpreter exit
  return *q;
}

void Sink(LogLevel level, std::string_view message) {
  Queue& q = TheQueue();
  {
    std::lock_guard<std::mutex> lock(q.mu);
    ++q.logged;
    if (q.lines.size() >= kMaxQueued) {
      ++q.dropped;
      return;
    }
    q.lines.emplace_back(level, std::string(message));
  }
  q.ready.notify_one();
}

// A fork while another thread holds q.mu would leave the child's mutex locked forever. The forking
// thread takes it across the fork; the child starts with an empty queue (the parent delivers what
// was queued) and logs to stderr until its Python side routes it again (os.register_at_fork).
void BeforeFork() { TheQueue().mu.lock(); }
void AfterForkInParent() { TheQueue().mu.unlock(); }
void AfterForkInChild() {
  Queue& q = TheQueue();
  q.lines.clear();
  q.dropped = 0;
  q.delivered = q.logged;
  q.stop = false;
  q.mu.unlock();
  SetLogSink(nullptr);
}

// Hands the queued lines to `emit(level_name, message)` with the GIL held; returns false once
// stopped and empty. With `block`, first waits (GIL released) until there is a line or a stop.
bool Deliver(const py::function& emit, bool block) {
  Queue& q = TheQueue();
  std::deque<std::pair<LogLevel, std::string>> lines;
  uint64_t dropped = 0;
  bool stopped = false;
  {
    py::gil_scoped_release nogil;
    std::unique_lock<std::mutex> lock(q.mu);
    if (block) q.ready.wait(lock, [&] { return q.stop || !q.lines.empty() || q.dropped != 0; });
    lines.swap(q.lines);
    std::swap(dropped, q.dropped);
    stopped = q.stop;
  }
  for (auto& [level, text] : lines) emit(LogLevelName(level), text);
  if (dropped != 0) {
    emit(LogLevelName(LogLevel::kWarning),
         std::to_string(dropped) + " log lines were dropped: more than " + std::to_string(kMaxQueued) +
             " were queued before Python's logging took them");
  }
  if (!lines.empty() || dropped != 0) {
    {
      std::lock_guard<std::mutex> lock(q.mu);
      q.delivered += lines.size() + dropped;
    }
    q.progress.notify_all();
  }
  return !(stopped && lines.empty() && dropped == 0);
}

// Returns once every line logged before the call has been emitted, by this thread or the pump.
void Flush(const py::function& emit) {
  Queue& q = TheQueue();
  uint64_t target = 0;
  {
    std::lock_guard<std::mutex> lock(q.mu);
    target = q.logged;
  }
  Deliver(emit, /*block=*/false);
  py::gil_scoped_release nogil;  // the pump needs the GIL to finish what it took
  std::unique_lock<std::mutex> lock(q.mu);
  q.progress.wait(lock, [&] { return q.delivered >= target; });
}

}  // namespace

void BindLogBridge(py::module_& m) {
  (void)LogEnabled(LogLevel::kError);  // reads SPILLWAY_LOG now: a bad value is said at import
  static std::once_flag atfork;
  std::call_once(atfork, [] { pthread_atfork(BeforeFork, AfterForkInParent, AfterForkInChild); });
  m.def("_log_route", [](bool to_python) {
    if (to_python) {
      std::lock_guard<std::mutex> lock(TheQueue().mu);
      TheQueue().stop = false;
    }
    SetLogSink(to_python ? &Sink : nullptr);
  }, "Sends C++ log lines to the queue that _log_pump drains (True) or to stderr (False).");
  m.def("_log_pump", [](const py::function& emit) {
    while (Deliver(emit, /*block=*/true)) {
    }
  }, "Runs until _log_stop: hands each queued line to emit(level, message). spillway/_log.py's thread.");
  m.def("_log_stop", [] {
    {
      std::lock_guard<std::mutex> lock(TheQueue().mu);
      TheQueue().stop = true;
    }
    TheQueue().ready.notify_all();
  }, "Makes _log_pump return once the queue is empty.");
  m.def("_log_flush", &Flush,
        "Returns once every line logged before the call was handed to emit(level, message) here or "
        "to the pump's.");
  // A test seam: logs `message` at `level` through the C++ core, from a new C++ thread (as the ring
  // thread or the prefetcher would) or from the caller's.
  m.def("_log_test_line", [](const std::string& level, const std::string& message, bool from_thread) {
    LogLevel l = LogLevel::kWarning;
    for (LogLevel c : {LogLevel::kError, LogLevel::kWarning, LogLevel::kInfo, LogLevel::kDebug}) {
      if (level == LogLevelName(c)) l = c;
    }
    if (!from_thread) return Log(l, message);
    py::gil_scoped_release nogil;
    std::thread([&] { Log(l, message); }).join();
  });
}

}  // namespace spillway::python
