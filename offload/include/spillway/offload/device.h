// Device / Stream / Event: the one seam between offload/ (and engine/) and an accelerator. The CUDA
// backend allocates with cudaMalloc and copies on a non-blocking stream with events; the CPU
// backend gives "device memory" as a separate host buffer and runs each stream's copies in order on
// a worker thread, so the same schedule runs, and is tested, on machines without a GPU.
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include "spillway/base/status.h"
#include "spillway/offload/device_guard.h"

namespace spillway::offload {

class Event {
 public:
  virtual ~Event() = default;
  // Blocks until everything the stream held before Record() has completed; returns its status.
  virtual Status Wait() = 0;
};

// An in-order queue of copies. Thread-compatible: one owner enqueues.
class Stream {
 public:
  virtual ~Stream() = default;
  // Queues a copy of `bytes` from src to dst (host<->device or device<->device) and returns at
  // once. The memory must stay valid until an Event recorded after it completes. The verb rule
  // (Note [Vocabulary]): Record() gives the ticket, and Event::Wait or Synchronize collects it.
  virtual Status SubmitCopy(void* dst, const void* src, uint64_t bytes) = 0;
  virtual Result<std::shared_ptr<Event>> Record() = 0;
  virtual Status Synchronize() = 0;
};

class Device {
 public:
  virtual ~Device() = default;
  static Result<std::unique_ptr<Device>> OpenCpu();
  // UNAVAILABLE, with the reason, when there is no such CUDA device (or no CUDA build).
  static Result<std::unique_ptr<Device>> OpenCuda(int index);
  // CUDA device `index` when one is present, else the CPU backend (logged once, shown by id()).
  static Result<std::unique_ptr<Device>> OpenDefault(int index = 0);

  virtual DeviceId id() const = 0;
  virtual Result<void*> Allocate(uint64_t bytes) = 0;
  virtual Status Free(void* ptr) = 0;
  virtual Result<std::unique_ptr<Stream>> NewStream() = 0;
  // Synchronous copies for tests and setup.
  virtual Status CopyToHost(void* host, const void* device, uint64_t bytes) = 0;
  virtual Status CopyFromHost(void* device, const void* host, uint64_t bytes) = 0;
};

}  // namespace spillway::offload
