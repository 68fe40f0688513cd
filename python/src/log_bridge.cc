// The bridge from Spillway's C++ log (allocator/include/spillway/allocator/log.h) to Python's
// `logging`. Lines come from any thread, often with a Spillway lock held (an arena's, the store's,
// the ring thread's), so the sink never takes the GIL: taking it there could deadlock against a
// Python thread that holds the GIL and waits for that lock. It appends the line to a bounded queue
// under a leaf mutex and, when the queue was empty, asks the interpreter to deliver it
// (Py_AddPendingCall, callable from any thread without the GIL). The main thread then runs
// Deliver between two bytecodes, with the GIL and none of Spillway's locks held, and hands each line
// to spillway/_log.py's emit. No thread of its own: a process that imports spillway stays
// single-threaded for fork(). Lines logged while the main thread is inside a long call that released
// the GIL (spillway.engine.train_gpt) arrive when it returns to Python. At exit, and in a forked
// child until its Python side routes it again, lines go to stderr as without the bridge.
#include "log_bridge.h"

#include <Python.h>
#include <pthread.h>

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

// Lines a burst may queue before Python takes them. Beyond it lines are counted, not kept, and the
// count is logged as a warning with the next delivery.
constexpr size_t kMaxQueued = 4096;

struct Queue {
  std::mutex mu;
  std::deque<std::pair<LogLevel, std::string>> lines;  // guarded by mu
  uint64_t dropped = 0;                                 // guarded by mu
  bool scheduled = false;  // guarded by mu: a Deliver is pending with the interpreter
};

Queue& TheQueue() {
  static auto* q = new Queue();  // never destroyed: C++ threads may log during interpreter exit
  return *q;
}

// emit(level_name, message), set by _log_route(True, emit); touched only with the GIL held.
PyObject* g_emit = nullptr;

// With the GIL held: hands everything queued to emit. Never raises: a failing handler's error is
// reported as unraisable, the way Python reports errors nobody can catch.
void Deliver() {
  Queue& q = TheQueue();
  std::deque<std::pair<LogLevel, std::string>> lines;
  uint64_t dropped = 0;
  {
    std::lock_guard<std::mutex> lock(q.mu);
    lines.swap(q.lines);
    std::swap(dropped, q.dropped);
    q.scheduled = false;
  }
  if (dropped != 0) {
    lines.emplace_back(LogLevel::kWarning, std::to_string(dropped) + " log lines were dropped: more than " +
                                               std::to_string(kMaxQueued) +
                                               " were queued before Python's logging took them");
  }
  if (g_emit == nullptr) {  // routed back to stderr since they were queued
    for (auto& [level, text] : lines) Log(level, text);
    return;
  }
  for (auto& [level, text] : lines) {
    PyObject* name = PyUnicode_FromString(LogLevelName(level));
    // A message is bytes from C++ (a path may not be UTF-8): undecodable bytes are replaced.
    PyObject* msg = PyUnicode_DecodeUTF8(text.data(), static_cast<Py_ssize_t>(text.size()), "replace");
    PyObject* r = name != nullptr && msg != nullptr ? PyObject_CallFunctionObjArgs(g_emit, name, msg, nullptr) : nullptr;
    if (r == nullptr) PyErr_WriteUnraisable(g_emit);
    Py_XDECREF(r);
    Py_XDECREF(msg);
    Py_XDECREF(name);
  }
}

int DeliverPending(void*) {
  Deliver();
  return 0;
}

void Sink(LogLevel level, std::string_view message) {
  Queue& q = TheQueue();
  bool schedule = false;
  {
    std::lock_guard<std::mutex> lock(q.mu);
    if (q.lines.size() >= kMaxQueued) {
      ++q.dropped;
      return;
    }
    q.lines.emplace_back(level, std::string(message));
    schedule = !q.scheduled;
    q.scheduled = true;
  }
  // Outside q.mu: the interpreter takes its own pending-calls lock. Its queue is small and shared;
  // when it is full, the next line asks again.
  if (schedule && Py_AddPendingCall(&DeliverPending, nullptr) != 0) {
    std::lock_guard<std::mutex> lock(q.mu);
    q.scheduled = false;
  }
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
  q.scheduled = false;
  q.mu.unlock();
  SetLogSink(nullptr);
}

}  // namespace

void BindLogBridge(py::module_& m) {
  if (LogEnabled(LogLevel::kError)) {
    // Reads SPILLWAY_LOG now, before any line is logged: a value that names no level is said at import.
  }
  static std::once_flag atfork;
  std::call_once(atfork, [] { pthread_atfork(BeforeFork, AfterForkInParent, AfterForkInChild); });
  m.def("_log_route", [](py::object emit) {
    if (emit.is_none()) {
      SetLogSink(nullptr);
      Deliver();  // what was queued, through the emit still set
      Py_CLEAR(g_emit);
      return;
    }
    PyObject* old = g_emit;
    g_emit = emit.release().ptr();
    Py_XDECREF(old);
    SetLogSink(&Sink);
  }, "Sends C++ log lines to emit(level, message) on the main thread (None: back to stderr, after "
     "handing over what is queued).");
  m.def("_log_flush", [] { Deliver(); }, "Hands what is queued to emit now, on this thread.");
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
