// Note [Thread stack floor]
//
// CivetWeb (under prometheus-cpp's exposer) starts its threads with a fixed stack size chosen at
// compile time (Debian builds it with CIVETWEB_THREAD_STACK_SIZE = 100 KiB). glibc carves a
// thread's static TLS out of its stack, so a process that has loaded a library with a large static
// TLS block, such as libtorch_cuda (seen on an H100 machine with torch 2.11+cu130), cannot create
// such a thread: pthread_create fails, CivetWeb reports "Cannot create first worker thread", and
// the exporter never listens. Threads that ask for no size are unaffected: glibc adds the TLS to
// the default size.
//
// The fix: this definition of pthread_attr_setstacksize, exported from the executable (see
// metrics/CMakeLists.txt), interposes glibc's and raises a request below the process's default
// thread stack size (pthread_getattr_default_np: RLIMIT_STACK, 8 MiB on most systems) to that
// default. It never lowers a request and otherwise calls glibc's function. The cost is virtual
// address space only; stack pages are committed when touched.
// Tested by ThreadStackFloorTest (tests/metrics), which loads a library with 1 MiB of static TLS.
//
// Inside Python the definition is in the extension, loaded RTLD_LOCAL, and the process's lookup
// finds glibc's first: the floor is not in force (ThreadStackFloorActive). That is harmless for
// libraries Python loads later (import torch with CUDA): glibc gives a library dlopen'd after start
// dynamic TLS, allocated per thread on first use, not carved from the stack. Only libraries loaded
// at start (LD_PRELOAD, the interpreter's own dependencies) put their TLS in every stack; then the
// exporter's error says so instead of blaming the port (tests/python/test_metrics.py has both).
#include "thread_stack_floor.h"

#include <dlfcn.h>
#include <pthread.h>

#include <algorithm>
#include <cerrno>

namespace {

using SetStackSize = int (*)(pthread_attr_t*, size_t);

void* Nothing(void*) { return nullptr; }

SetStackSize Real() {
  static const auto real =
      reinterpret_cast<SetStackSize>(dlsym(RTLD_NEXT, "pthread_attr_setstacksize"));
  return real;
}

}  // namespace

namespace spillway::metrics {

size_t ThreadStackFloor() {
  static const size_t floor = [] {
    size_t bytes = 8u << 20;
    pthread_attr_t attr;
    if (pthread_getattr_default_np(&attr) == 0) {
      size_t s = 0;
      if (pthread_attr_getstacksize(&attr, &s) == 0 && s > 0) bytes = s;
      pthread_attr_destroy(&attr);
    }
    return bytes;
  }();
  return floor;
}

bool ThreadStackFloorActive() {
  // Compare modules, not addresses: inside a shared library `&pthread_attr_setstacksize` is itself
  // resolved through the process's lookup. ThreadStackFloor cannot be interposed by name here.
  void* bound = dlsym(RTLD_DEFAULT, "pthread_attr_setstacksize");
  Dl_info theirs{}, ours{};
  if (bound == nullptr || dladdr(bound, &theirs) == 0 ||
      dladdr(reinterpret_cast<void*>(&ThreadStackFloor), &ours) == 0) {
    return false;
  }
  return theirs.dli_fbase == ours.dli_fbase;
}

bool ThreadWithStackStarts(size_t bytes) {
  const SetStackSize real = Real();
  if (real == nullptr) return false;
  pthread_attr_t attr;
  if (pthread_attr_init(&attr) != 0) return false;
  pthread_t t;
  const bool started = real(&attr, bytes) == 0 && pthread_create(&t, &attr, Nothing, nullptr) == 0;
  pthread_attr_destroy(&attr);
  if (started) pthread_join(t, nullptr);
  return started;
}

}  // namespace spillway::metrics

extern "C" int pthread_attr_setstacksize(pthread_attr_t* attr, size_t size) {
  const SetStackSize real = Real();
  if (real == nullptr) return ENOSYS;  // dlsym failed: cannot happen with a dynamic glibc
  return real(attr, std::max(size, spillway::metrics::ThreadStackFloor()));
}
