// Tensors over arena memory, exact size: for the Python module's HostArena.empty() and libtorch
// programs (the reference trainer's gather buffers).
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/Allocator.h>
#include <c10/core/ScalarType.h>
#include <c10/util/ArrayRef.h>

#include <cstdint>
#include <memory>

#include "spillway/allocator/host_arena.h"
#include "spillway/allocator/owner.h"
#include "spillway/base/status.h"
#include "spillway/torch_alloc/shared_arena.h"

namespace spillway::torch_alloc {

// A CPU tensor of `shape` and `dtype` over exact-size memory of `arena`, booked under `tag`. The
// memory returns to the arena when the storage's last reference dies and every event recorded on
// it through torch's host allocator has completed (a deferred block: Note [Deferred free] in
// docs/deepspeed.md); the tensor keeps the arena alive. INVALID_ARGUMENT for a negative dimension
// or a size that overflows 64 bits; the arena's error (OVER_BUDGET, ...) as it gives it.
Result<at::Tensor> EmptyTensor(const std::shared_ptr<SharedArena>& arena, c10::IntArrayRef shape,
                               c10::ScalarType dtype, const allocator::OwnerTag& tag);

// Whether t's bytes are memory of `arena`.
bool ArenaOwns(const SharedArena& arena, const at::Tensor& t);

// A CPU float tensor of `numel` elements over memory of `arena` that is freed to it when the last
// reference dies (autograd's included), with no events: for work that never hands the memory to
// an asynchronous copy. `arena` must outlive the tensor. A failed free is logged.
Result<at::Tensor> TransientTensor(allocator::HostArena* arena, int64_t numel,
                                   const allocator::OwnerTag& tag);

// A uint8 CPU tensor of `bytes` over `data`, which `allocator` made (tests reach torch's pinned
// allocator this way on machines where pin_memory() cannot run).
at::Tensor TensorOver(at::DataPtr data, int64_t bytes, c10::Allocator* allocator);

}  // namespace spillway::torch_alloc
