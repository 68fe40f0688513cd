// See Note [Thread stack floor] in thread_stack_floor.cc.
#pragma once

#include <cstddef>

namespace spillway::metrics {

// The smallest stack a thread of this process gets from pthread_attr_setstacksize: the process's
// default thread stack size.
size_t ThreadStackFloor();

// CivetWeb's compile-time thread stack size (Debian's CIVETWEB_THREAD_STACK_SIZE).
inline constexpr size_t kCivetWebThreadStack = 102400;

// Whether the floor is in force: this process's pthread_attr_setstacksize is the one in
// thread_stack_floor.cc. It is when it is linked into the executable; it is not when it is linked
// into a library loaded RTLD_LOCAL (the Python extension), where the process's own lookup finds
// glibc's first.
bool ThreadStackFloorActive();

// Whether a thread asking glibc's own pthread_attr_setstacksize for `bytes` of stack can start in
// this process (it cannot when libraries loaded at start hold more static TLS than that).
bool ThreadWithStackStarts(size_t bytes);

}  // namespace spillway::metrics
