// Handle: a pinned view of one partition, released to its store when it is destroyed or moved
// over. Note [Spill] in docs/offload.md.
#include <cstdlib>

#include "spillway/base/log.h"
#include "spillway/offload/partition_store.h"

namespace spillway::offload {

namespace {

#ifndef NDEBUG
[[noreturn]] void DanglingHandle(PartitionId id) {
  Log(LogLevel::kError, StrCat("a Handle of partition ", id,
                               " outlived its PartitionStore: release "
                               "every handle before destroying the store (fatal in debug builds)"));
  std::abort();
}
#endif

}  // namespace

bool Handle::StoreAlive() const {
  return store_alive_ != nullptr && store_alive_->load(std::memory_order_acquire);
}

void Handle::ReleaseFromDestructor() {
  if (store_ == nullptr) return;
  if (!StoreAlive()) {
#ifndef NDEBUG
    DanglingHandle(id_);
#endif
    store_ = nullptr;  // release builds: the store freed everything; nothing to give back
    store_alive_.reset();
    return;
  }
  if (!store_->process_.InOwner()) {
    // A forked child: the store's mutex may have been held by a parent thread at fork, and its
    // memory and device are the parent's. Leak the handle (Note [Fork]).
    store_ = nullptr;
    store_alive_.reset();
    return;
  }
  bool ok;
  // A destructor cannot return the write-back error; Release() does. Log it here.
  Status st = store_->ReleaseHandle(handle_id_, id_, write_, device_, &ok);
  if (!st.ok()) Log(LogLevel::kError, st.ToString());
  store_ = nullptr;
  store_alive_.reset();
}

Handle& Handle::operator=(Handle&& other) noexcept {
  if (this != &other) {
    ReleaseFromDestructor();
    store_ = std::exchange(other.store_, nullptr);
    store_alive_ = std::move(other.store_alive_);
    device_ = other.device_;
    handle_id_ = other.handle_id_;
    id_ = other.id_;
    data_ = std::exchange(other.data_, nullptr);
    bytes_ = other.bytes_;
    write_ = other.write_;
  }
  return *this;
}

Handle::~Handle() { ReleaseFromDestructor(); }

Result<void*> Handle::Data() const {
  if (store_ == nullptr) {
    return Status::FailedPrecondition(
        StrCat("handle of partition ", id_, " was released (or moved from); Acquire it again"));
  }
  if (!StoreAlive()) {
#ifndef NDEBUG
    DanglingHandle(id_);
#endif
    return Status::FailedPrecondition(
        StrCat("handle of partition ", id_,
               " outlived its "
               "PartitionStore; its memory was freed with the store"));
  }
  // After StoreAlive: the store is read only while it exists.
  SPILLWAY_RETURN_IF_ERROR(store_->process_.Check("Handle", "Data"));  // Note [Fork]
  return data_;
}

}  // namespace spillway::offload
