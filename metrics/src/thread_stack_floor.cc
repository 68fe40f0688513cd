// Note [Thread stack floor]
//
// CivetWeb (under prometheus-cpp's exposer) starts its threads with a fixed stack size chosen at
// compile time (Debian builds it with CIVETWEB_THREAD_STACK_SIZE = 100 KiB). glibc carves a
// thread's static TLS out of its stack, so a process that has loaded a library with a large static
// TLS block, such as libtorch_cuda (seen on an H100 machine with torch 2.11+cu130), cannot create
// such a thread: pthread_create fails, CivetWeb reports "Cannot create first worker thread", and the
// exporter never listens. Threads that ask for no size are unaffected: glibc adds the TLS to the
// default size.
//
// The fix: this definition of pthread_attr_setstacksize, exported from the executable (see
// metrics/CMakeLists.txt), interposes glibc's and raises a request below the process's default
// thread stack size (pthread_getattr_default_np: RLIMIT_STACK, 8 MiB on most systems) to that
// default. It never lowers a request and otherwise calls glibc's function. The cost is virtual
// address space only; stack pages are committed when touched.
// Tested by ThreadStackFloorTest (tests/metrics), which loads a library with 1 MiB of static TLS.
#include "thread_stack_floor.h"

#include <dlfcn.h>
#include <pthread.h>

#include <algorithm>
#include <cerrno>

namespace {

using SetStackSize = int (*)(pthread_attr_t*, size_t);

SetStackSize Real() {
  static const auto real = reinterpret_cast<SetStackSize>(dlsym(RTLD_NEXT, "pthread_attr_setstacksize"));
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

}  // namespace spillway::metrics

extern "C" int pthread_attr_setstacksize(pthread_attr_t* attr, size_t size) {
  const SetStackSize real = Real();
  if (real == nullptr) return ENOSYS;  // dlsym failed: cannot happen with a dynamic glibc
  return real(attr, std::max(size, spillway::metrics::ThreadStackFloor()));
}
