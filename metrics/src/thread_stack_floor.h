// See Note [Thread stack floor] in thread_stack_floor.cc.
#pragma once

#include <cstddef>

namespace spillway::metrics {

// The smallest stack a thread of this process gets from pthread_attr_setstacksize: the process's
// default thread stack size.
size_t ThreadStackFloor();

}  // namespace spillway::metrics
