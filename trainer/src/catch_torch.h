// CatchTorch: libtorch's exceptions as statuses, for the trainer's entry points.
#pragma once

#include <torch/torch.h>

#include <exception>

#include "spillway/base/status.h"

namespace spillway::trainer {

// libtorch reports failures (a GPU out of memory, a kernel error) by throwing; the trainer's
// callers get statuses, and the step that threw is abandoned like any failed micro-batch (its
// buffers and views are released as the stack unwinds).
template <typename Fn>
inline Status CatchTorch(const char* what, Fn fn) {
  try {
    return fn();
  } catch (const c10::OutOfMemoryError& e) {
    return Status::Make(StatusCode::kOutOfMemory,
                        StrCat(what, ": libtorch ran out of memory: ", e.what_without_backtrace(),
                               "; use smaller micro-batches (more gradient accumulation steps) or "
                               "a smaller model per device"));
  } catch (const c10::Error& e) {
    return Status::Make(StatusCode::kExternal,
                        StrCat(what, ": libtorch raised: ", e.what_without_backtrace()));
  } catch (const std::exception& e) {
    return Status::Make(StatusCode::kExternal, StrCat(what, ": ", e.what()));
  }
}

}  // namespace spillway::trainer
