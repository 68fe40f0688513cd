// PyArena (py_arena.h): spillway.HostArena, a host arena whose tensors are deferred blocks.
#include "py_arena.h"

#include <ATen/ops/from_blob.h>
#include <pybind11/pybind11.h>
#include <torch/extension.h>

#include <algorithm>

#include "deferred_blocks.h"
#include "errors.h"

namespace py = pybind11;

namespace spillway::python {

using allocator::Kind;
using allocator::Lifetime;
using allocator::OwnerTag;
using torch_alloc::Block;
using torch_alloc::Blocks;
using torch_alloc::ReleaseBlock;

PyArena::PyArena(uint64_t budget_bytes, allocator::PinMode pin, allocator::EscapePolicy policy,
                 const std::string& name, const std::shared_ptr<PyArena>& share_ledger_with)
    : ledger_(share_ledger_with ? share_ledger_with->ledger_
                                : std::make_shared<allocator::Ledger>()) {
  allocator::HostArenaOptions o;
  o.name = name;
  o.budget_bytes = budget_bytes;
  o.pin = pin;
  o.policy = policy;
  o.ledger = ledger_.get();
  arena_ = Check(allocator::HostArena::Create(o));
}

torch::Tensor PyArena::Empty(const std::vector<int64_t>& shape, c10::ScalarType dtype, Kind kind,
                             Lifetime lifetime, uint64_t owner) {
  uint64_t numel = 1;
  for (int64_t d : shape) {
    if (d < 0)
      Raise(
          Status::InvalidArgument(StrCat("arena.empty: negative dimension ", d, " in the shape")));
    if (__builtin_mul_overflow(numel, static_cast<uint64_t>(d), &numel)) {
      Raise(Status::InvalidArgument("arena.empty: the shape's element count overflows 64 bits"));
    }
  }
  uint64_t bytes = 0;
  if (__builtin_mul_overflow(numel, static_cast<uint64_t>(c10::elementSize(dtype)), &bytes)) {
    Raise(Status::InvalidArgument("arena.empty: the tensor's size in bytes overflows 64 bits"));
  }
  const OwnerTag tag{kind, lifetime, owner, allocator::kProcessScope, "python"};
  Blocks::Get().Poll();  // parked blocks hold budget until their copies end
  auto r = [&] {
    py::gil_scoped_release nogil;  // mapping and pinning a region are syscalls
    return arena_->Allocate(std::max<uint64_t>(bytes, 1), tag);
  }();
  void* p = Check(std::move(r));
  Block* b = Blocks::Get().Make(p, bytes, shared_from_this(), /*pinned_allocator=*/false, nullptr);
  return at::for_blob(p, shape)
      .context(b, &ReleaseBlock)
      .target_device(c10::Device(c10::DeviceType::CPU))
      .options(torch::TensorOptions().dtype(dtype))
      .make_tensor();
}

bool PyArena::Owns(const torch::Tensor& t) const {
  return t.defined() && t.device().is_cpu() && t.numel() > 0 &&
         arena_->Contains(t.data_ptr(), static_cast<uint64_t>(t.numel()) * t.element_size());
}

}  // namespace spillway::python
