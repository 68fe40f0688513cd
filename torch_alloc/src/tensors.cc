// Tensors over arena memory (tensors.h).
#include "spillway/torch_alloc/tensors.h"

#include <ATen/ops/empty.h>
#include <ATen/ops/from_blob.h>

#include <algorithm>

#include "spillway/base/log.h"
#include "spillway/torch_alloc/blocks.h"

namespace spillway::torch_alloc {

Result<at::Tensor> EmptyTensor(const std::shared_ptr<SharedArena>& arena, c10::IntArrayRef shape,
                               c10::ScalarType dtype, const allocator::OwnerTag& tag) {
  uint64_t numel = 1;
  for (int64_t d : shape) {
    if (d < 0)
      return Status::InvalidArgument(
          StrCat("arena.empty: negative dimension ", d, " in the shape"));
    if (__builtin_mul_overflow(numel, static_cast<uint64_t>(d), &numel)) {
      return Status::InvalidArgument("arena.empty: the shape's element count overflows 64 bits");
    }
  }
  uint64_t bytes = 0;
  if (__builtin_mul_overflow(numel, static_cast<uint64_t>(c10::elementSize(dtype)), &bytes)) {
    return Status::InvalidArgument("arena.empty: the tensor's size in bytes overflows 64 bits");
  }
  Blocks& blocks = Blocks::ForThisProcess();
  blocks.Poll();  // parked blocks hold budget until their copies end
  SPILLWAY_ASSIGN_OR_RETURN(void* p, arena->get()->Allocate(std::max<uint64_t>(bytes, 1), tag));
  TorchBlock* b = blocks.Make(p, bytes, arena, /*pinned_allocator=*/false, nullptr);
  return at::for_blob(p, shape)
      .context(b, &ReleaseBlock)
      .target_device(c10::Device(c10::DeviceType::CPU))
      .options(at::TensorOptions().dtype(dtype))
      .make_tensor();
}

bool ArenaOwns(const SharedArena& arena, const at::Tensor& t) {
  return t.defined() && t.device().is_cpu() && t.numel() > 0 &&
         arena.Contains(t.data_ptr(), static_cast<uint64_t>(t.numel()) * t.element_size());
}

Result<at::Tensor> TransientTensor(allocator::HostArena* arena, int64_t numel,
                                   const allocator::OwnerTag& tag) {
  uint64_t bytes = 0;
  if (numel < 0 || __builtin_mul_overflow(static_cast<uint64_t>(numel), 4, &bytes)) {
    return Status::InvalidArgument(
        StrCat("a transient tensor of ", numel, " floats: the count must be 0..2^62"));
  }
  SPILLWAY_ASSIGN_OR_RETURN(void* p, arena->Allocate(std::max<uint64_t>(bytes, 1), tag));
  return at::from_blob(
      p, {numel},
      [arena](void* q) {
        const Status st = arena->Free(q);
        if (!st.ok()) Log(LogLevel::kError, StrCat("freeing a transient tensor: ", st.ToString()));
      },
      at::TensorOptions().dtype(at::kFloat));
}

at::Tensor TensorOver(at::DataPtr data, int64_t bytes, c10::Allocator* allocator) {
  c10::Storage storage(c10::Storage::use_byte_size_t(), bytes, std::move(data), allocator, false);
  return at::empty({0}, at::kByte).set_(storage, 0, {bytes}, {1});
}

}  // namespace spillway::torch_alloc
