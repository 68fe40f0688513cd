// A partition acquired in host memory together with its data pointer: the Acquire-then-Data pair
// every engine caller needs, with both results checked in one place.
#pragma once

#include "spillway/base/status.h"
#include "spillway/offload/partition_store.h"

namespace spillway::engine {

struct HostView {
  offload::Handle handle;  // releases the partition when destroyed
  void* data = nullptr;
};

inline Result<HostView> AcquireView(offload::PartitionStore& store, offload::PartitionId id,
                                    offload::Access access) {
  auto h = store.Acquire(id, access);
  if (!h.ok()) return h.status();
  auto data = h->Data();
  if (!data.ok()) return data.status();
  return HostView{std::move(*h), *data};
}

}  // namespace spillway::engine
