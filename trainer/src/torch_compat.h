// The libtorch C++ API differences between the torch versions Spillway builds against (2.11, the
// GPU image's, through 2.15), in one place: code elsewhere calls these and has no version #ifs.
// docs/python.md, "Torch versions".
#pragma once

#include <string>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include "spillway/base/log.h"
#include "spillway/base/status.h"

namespace spillway::trainer::torch_compat {

// The group's backend for `type`, or null when it has none. ProcessGroup::hasBackendForDeviceType
// is not in torch 2.11; getBackend, in every version, throws c10::Error for a device type without
// a backend, and that answer is the one wanted here, so it is the one exception taken as "none".
inline c10::intrusive_ptr<c10d::Backend> BackendFor(c10d::ProcessGroup& pg, c10::DeviceType type) {
  try {
    return pg.getBackend(type);
  } catch (const c10::Error& e) {
    const std::string what = e.what_without_backtrace();
    if (what.find("No backend type associated with device type") == std::string::npos) {
      // Not the "none" answer: a backend that exists and failed. The trainer then runs its
      // collectives on the host, and says why.
      Log(LogLevel::kWarning,
          StrCat("the process group's ", c10::DeviceTypeName(type), " backend is unusable (", what,
                 "): collectives run on the host"));
    }
    return {};
  }
}

}  // namespace spillway::trainer::torch_compat
