// The CPU device backend: device memory is a mapping of its own per allocation (MADV_DONTFORK);
// a stream is a worker thread that runs its copies in order; an event completes when the worker
// reaches it.
#include <sys/mman.h>

#include <algorithm>
#include <cerrno>
#include <condition_variable>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <functional>
#include <mutex>
#include <thread>
#include <unordered_map>

#include "spillway/base/bytes.h"
#include "spillway/base/log.h"
#include "spillway/offload/device.h"

namespace spillway::offload {
namespace {

class CpuEvent final : public Event {
 public:
  Status Wait() override {
    std::unique_lock<std::mutex> lock(mu_);
    cv_.wait(lock, [this] { return done_; });
    return Status::Ok();
  }
  void Complete() {
    std::lock_guard<std::mutex> lock(mu_);
    done_ = true;
    cv_.notify_all();
  }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  bool done_ = false;  // guarded by mu_
};

class CpuStream final : public Stream {
 public:
  CpuStream() : worker_([this] { Run(); }) {}
  ~CpuStream() override {
    {
      std::lock_guard<std::mutex> lock(mu_);
      stop_ = true;
    }
    cv_.notify_all();
    worker_.join();
  }
  Status SubmitCopy(void* dst, const void* src, uint64_t bytes) override {
    if (dst == nullptr || src == nullptr)
      return Status::InvalidArgument("SubmitCopy: null pointer");
    Push([dst, src, bytes] { std::memcpy(dst, src, bytes); });
    return Status::Ok();
  }
  Result<std::shared_ptr<Event>> Record() override {
    auto e = std::make_shared<CpuEvent>();
    Push([e] { e->Complete(); });
    return std::shared_ptr<Event>(e);
  }
  Status Synchronize() override {
    auto e = Record();
    return (*e)->Wait();
  }

 private:
  void Push(std::function<void()> task) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      tasks_.push_back(std::move(task));
    }
    cv_.notify_one();
  }
  void Run() {
    for (;;) {
      std::function<void()> task;
      {
        std::unique_lock<std::mutex> lock(mu_);
        cv_.wait(lock, [this] { return stop_ || !tasks_.empty(); });
        if (tasks_.empty()) return;  // stopping, and drained
        task = std::move(tasks_.front());
        tasks_.pop_front();
      }
      task();  // outside the lock
    }
  }
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::function<void()>> tasks_;  // guarded by mu_
  bool stop_ = false;                        // guarded by mu_
  std::thread worker_;
};

class CpuDevice final : public Device {
 public:
  DeviceId id() const override { return {DeviceType::kCpu, 0}; }
  // Device memory is mapped for each allocation and unmapped when freed, never heap: it is not the
  // process's host memory, so it neither lingers in malloc's heap nor goes to a forked child (a
  // GPU's memory does not either: MADV_DONTFORK).
  Result<void*> Allocate(uint64_t bytes) override {
    const uint64_t len = std::max<uint64_t>((bytes + 4095) / 4096 * 4096, 4096);
    void* p = mmap(nullptr, len, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED) {
      return Status::FromErrno(StatusCode::kOutOfMemory, errno,
                               StrCat("CPU device: mapping ", FormatBytes(bytes), " failed"));
    }
    if (madvise(p, len, MADV_DONTFORK) != 0) {
      const int err = errno;
      munmap(p, len);
      return Status::FromErrno(StatusCode::kInternal, err, "CPU device: madvise(MADV_DONTFORK)");
    }
    std::lock_guard<std::mutex> lock(mu_);
    lengths_[p] = len;
    return p;
  }
  Status Free(void* ptr) override {
    uint64_t len = 0;
    {
      std::lock_guard<std::mutex> lock(mu_);
      auto it = lengths_.find(ptr);
      if (it == lengths_.end()) {
        return Status::InvalidArgument(
            StrCat("CPU device: Free(", ptr, ") of memory it did not allocate (or freed twice)"));
      }
      len = it->second;
      lengths_.erase(it);
    }
    if (munmap(ptr, len) != 0)
      return Status::FromErrno(StatusCode::kInternal, errno, "CPU device: munmap");
    return Status::Ok();
  }
  Result<std::unique_ptr<Stream>> NewStream() override {
    return std::unique_ptr<Stream>(new CpuStream());
  }
  Status CopyToHost(void* host, const void* device, uint64_t bytes) override {
    std::memcpy(host, device, bytes);
    return Status::Ok();
  }
  Status CopyFromHost(void* device, const void* host, uint64_t bytes) override {
    std::memcpy(device, host, bytes);
    return Status::Ok();
  }

 private:
  std::mutex mu_;
  std::unordered_map<void*, uint64_t> lengths_;  // guarded by mu_: mapping lengths by address
};

}  // namespace

Result<std::unique_ptr<Device>> Device::OpenCpu() {
  return std::unique_ptr<Device>(new CpuDevice());
}

Result<std::unique_ptr<Device>> Device::OpenDefault(int index) {
  auto cuda = OpenCuda(index);
  if (cuda.ok()) return cuda;
  static std::once_flag once;
  std::call_once(once, [&] {
    Log(LogLevel::kInfo, StrCat("device: no CUDA device (", cuda.status().message(),
                                "); running the same schedule on the CPU backend"));
  });
  return OpenCpu();
}

}  // namespace spillway::offload
