// spillway._spillway's binding of spillway::base: the log level, and the bridge from Spillway's C++
// log (base/include/spillway/base/log.h) to Python's `logging`. Lines come from any thread, often
// with a Spillway lock held (an arena's, the store's, the ring thread's), so the sink never takes
// the GIL: taking it there could deadlock against a Python thread that holds the GIL and waits for
// that lock. It appends the line to a bounded queue under a leaf mutex and, when the queue was
// empty, asks the interpreter to deliver it (Py_AddPendingCall, callable from any thread without
// the GIL). The main thread then runs Deliver between two bytecodes, with the GIL and none of
// Spillway's locks held, and hands each line to spillway/_log.py's emit. No thread of its own: a
// process that imports spillway stays single-threaded for fork(). Lines logged while the main
// thread is inside a long call that released the GIL (spillway.trainer.train_gpt) arrive when it
// returns to Python. Error lines are written to stderr at once as well (a process may abort or
// crash before Python runs again); emit is told, so an unconfigured logger does not print them
// twice. At exit, and in a forked child until its Python side routes it again, lines go to stderr
// as without the bridge.
#include <Python.h>
#include <pthread.h>
#include <pybind11/pybind11.h>

#include <cstdint>
#include <deque>
#include <mutex>
#include <string>
#include <thread>
#include <utility>

#include "bindings.h"
#include "errors.h"
#include "spillway/base/log.h"

namespace py = pybind11;

namespace spillway::python {
namespace {

// Lines a burst may queue before Python takes them. Beyond it lines are counted, not kept, and the
// count is logged as a warning with the next delivery.
constexpr size_t kMaxQueued = 4096;

struct Line {
  LogLevel level;
  std::string text;
  bool on_stderr;  // already written there (error lines)
};

struct Queue {
  std::mutex mu;
  std::deque<Line> lines;  // guarded by mu
  uint64_t dropped = 0;    // guarded by mu
  bool scheduled = false;  // guarded by mu: a Deliver is pending with the interpreter
  bool closed = true;      // guarded by mu: no emit (not routed yet, or routed back at exit)
};

Queue& TheQueue() {
  static auto* q = new Queue();  // never destroyed: C++ threads may log during interpreter exit
  return *q;
}

// emit(level_name, message), set by _log_route(True, emit); touched only with the GIL held.
PyObject* g_emit = nullptr;

int DeliverPending(void*);

// With the GIL held: hands everything queued to emit(level, message, on_stderr). A handler's
// Exception is reported as unraisable, the way Python reports errors nobody can catch. A
// BaseException that is not an Exception (KeyboardInterrupt, SystemExit) is left set, the lines not
// yet handed over go back to the queue, and it returns false: the caller propagates it.
bool Deliver() {
  Queue& q = TheQueue();
  std::deque<Line> lines;
  uint64_t dropped = 0;
  {
    std::lock_guard<std::mutex> lock(q.mu);
    lines.swap(q.lines);
    std::swap(dropped, q.dropped);
    q.scheduled = false;
  }
  if (dropped != 0) {
    lines.push_back(Line{LogLevel::kWarning,
                         std::to_string(dropped) + " log lines were dropped: more than " +
                             std::to_string(kMaxQueued) +
                             " were queued before Python's logging took them",
                         false});
  }
  // A strong reference of our own: a handler may release the GIL, and another thread may route
  // the log back to stderr (and drop g_emit) meanwhile.
  PyObject* emit = g_emit;
  Py_XINCREF(emit);
  while (!lines.empty()) {
    const Line line = std::move(lines.front());
    lines.pop_front();
    if (emit == nullptr) {  // routed back to stderr since it was queued
      if (!line.on_stderr) LogToStderr(line.level, line.text);
      continue;
    }
    PyObject* name = PyUnicode_FromString(LogLevelName(line.level));
    // A message is bytes from C++ (a path may not be UTF-8): undecodable bytes are replaced.
    PyObject* msg = PyUnicode_DecodeUTF8(line.text.data(),
                                         static_cast<Py_ssize_t>(line.text.size()), "replace");
    PyObject* r = name != nullptr && msg != nullptr
                      ? PyObject_CallFunctionObjArgs(emit, name, msg,
                                                     line.on_stderr ? Py_True : Py_False, nullptr)
                      : nullptr;
    Py_XDECREF(msg);
    Py_XDECREF(name);
    if (r != nullptr) {
      Py_DECREF(r);
      continue;
    }
    if (!PyErr_ExceptionMatches(PyExc_Exception)) {
      // The rest goes back to the queue, and a delivery is asked for again (the interpreter does
      // not retry a pending call that failed); once closed, nobody would read the queue: to stderr.
      bool schedule = false;
      {
        std::lock_guard<std::mutex> lock(q.mu);
        if (q.closed) {
          for (const Line& rest : lines) {
            if (!rest.on_stderr) LogToStderr(rest.level, rest.text);
          }
        } else {
          q.lines.insert(q.lines.begin(), std::make_move_iterator(lines.begin()),
                         std::make_move_iterator(lines.end()));
          schedule = !q.scheduled;
          q.scheduled = true;
        }
      }
      if (schedule && Py_AddPendingCall(&DeliverPending, nullptr) != 0) {
        std::lock_guard<std::mutex> lock(q.mu);
        q.scheduled = false;
      }
      Py_DECREF(emit);
      return false;
    }
    PyErr_WriteUnraisable(emit);
  }
  Py_XDECREF(emit);
  return true;
}

int DeliverPending(void*) {
  return Deliver() ? 0 : -1;
}  // -1: the exception is raised in the main thread

void Sink(LogLevel level, std::string_view message) {
  Queue& q = TheQueue();
  const bool on_stderr = level == LogLevel::kError;
  if (on_stderr) LogToStderr(level, message);
  std::unique_lock<std::mutex> lock(q.mu);
  if (q.closed) {  // routed back to stderr after this thread read the sink
    if (!on_stderr) LogToStderr(level, message);
    return;
  }
  if (q.lines.size() >= kMaxQueued) {
    ++q.dropped;
    return;
  }
  q.lines.push_back(Line{level, std::string(message), on_stderr});
  if (q.scheduled) return;
  // Its queue is small and shared; when it is full, the next line asks again. A thread without the
  // GIL asks under q.mu, so that closing (which takes q.mu, with the GIL) cannot pass between the
  // check above and this: after _log_route(None) returns, no such thread asks the interpreter for
  // anything. A thread with the GIL cannot race the close, and must not ask under q.mu: from
  // Python 3.13 the interpreter's lock may release the GIL while it waits, and another thread could
  // then take the GIL and wait for q.mu.
  if (!PyGILState_Check()) {
    q.scheduled = Py_AddPendingCall(&DeliverPending, nullptr) == 0;
    return;
  }
  q.scheduled = true;
  lock.unlock();
  if (Py_AddPendingCall(&DeliverPending, nullptr) != 0) {
    lock.lock();
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
  q.closed = true;
  q.mu.unlock();
  SetLogSink(nullptr);
}

}  // namespace

void BindBase(py::module_& m) {
  m.def(
      "set_log_level",
      [](const std::string& level) {
        const std::optional<LogLevel> l = ParseLogLevel(level);
        if (!l)
          Raise(Status::InvalidArgument(
              StrCat("set_log_level('", level, "'): use error, warning, info or debug")));
        SetLogLevel(*l);
      },
      "What Spillway's C++ core logs from now on (default: SPILLWAY_LOG, else warning).");

  if (LogEnabled(LogLevel::kError)) {
    // Reads SPILLWAY_LOG now, before any line is logged: a value that names no level is said at
    // import.
  }
  static std::once_flag atfork;
  std::call_once(atfork, [] { pthread_atfork(BeforeFork, AfterForkInParent, AfterForkInChild); });
  m.def(
      "_log_route",
      [](py::object emit) {
        // One queue per process: only the main interpreter routes it (a sub-interpreter importing
        // spillway leaves its lines on stderr).
        if (PyInterpreterState_Get() != PyInterpreterState_Main()) return;
        if (emit.is_none()) {
          SetLogSink(nullptr);
          {
            std::lock_guard<std::mutex> lock(TheQueue().mu);
            TheQueue().closed = true;
          }
          const bool ok = Deliver();  // what was queued, through the emit still set
          Py_CLEAR(g_emit);
          if (!ok) throw py::error_already_set();
          return;
        }
        PyObject* old = g_emit;
        g_emit = emit.release().ptr();
        Py_XDECREF(old);
        {
          std::lock_guard<std::mutex> lock(TheQueue().mu);
          TheQueue().closed = false;
        }
        SetLogSink(&Sink);
      },
      "Sends C++ log lines to emit(level, message, on_stderr) on the main thread (None: back to "
      "stderr, after handing over what is queued).");
  m.def(
      "_log_flush",
      [] {
        if (!Deliver()) throw py::error_already_set();
      },
      "Hands what is queued to emit now, on this thread.");
  // A test seam: logs `message` at `level` through the C++ core, from a new C++ thread (as the ring
  // thread or the prefetcher would) or from the caller's.
  // With `lines` > 1, logs "message 0" ... "message N-1" in one call (no delivery can come
  // between).
  m.def(
      "_log_test_line",
      [](const std::string& level, const std::string& message, bool from_thread, int lines) {
        const LogLevel l = ParseLogLevel(level).value_or(LogLevel::kWarning);
        auto log = [&] {
          if (lines <= 1) return Log(l, message);
          for (int i = 0; i < lines; ++i) Log(l, message + " " + std::to_string(i));
        };
        if (!from_thread) return log();
        py::gil_scoped_release nogil;
        std::thread(log).join();
      },
      py::arg("level"), py::arg("message"), py::arg("from_thread"), py::arg("lines") = 1);
}

}  // namespace spillway::python
