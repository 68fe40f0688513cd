// A fault-injection seam over the real CPU device backend: once armed, the next SubmitCopy on any
// of its streams blocks until Resume(), so a test can hold one thread inside a transfer while
// another acts. Everything else is the CPU device's own code.
#pragma once

#include <condition_variable>
#include <memory>
#include <mutex>
#include <utility>

#include "spillway/offload/device.h"

namespace spillway::offload::testing {

// Once armed, holds the first thread that reaches Hit() until Resume(); a test waits for that
// with WaitHeld(). For StoreHooks points and for PausingDevice.
class Gate {
 public:
  void Arm() {
    std::lock_guard<std::mutex> lock(mu_);
    armed_ = true;
    held_ = false;
    resumed_ = false;
  }
  void Hit() {
    std::unique_lock<std::mutex> lock(mu_);
    if (!armed_) return;
    armed_ = false;
    held_ = true;
    cv_.notify_all();
    cv_.wait(lock, [this] { return resumed_; });
  }
  void WaitHeld() {
    std::unique_lock<std::mutex> lock(mu_);
    cv_.wait(lock, [this] { return held_; });
  }
  void Resume() {
    std::lock_guard<std::mutex> lock(mu_);
    resumed_ = true;
    cv_.notify_all();
  }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  bool armed_ = false, held_ = false, resumed_ = false;
};

class PausingDevice : public Device {
 public:
  PausingDevice() : cpu_(std::move(Device::OpenCpu().value())) {}

  void Arm() { gate_.Arm(); }
  void WaitPaused() { gate_.WaitHeld(); }  // blocks until an armed copy is paused
  void Resume() { gate_.Resume(); }

  DeviceId id() const override { return cpu_->id(); }
  Result<void*> Allocate(uint64_t bytes) override { return cpu_->Allocate(bytes); }
  Status Free(void* ptr) override { return cpu_->Free(ptr); }
  Result<std::unique_ptr<Stream>> NewStream() override {
    SPILLWAY_ASSIGN_OR_RETURN(auto inner, cpu_->NewStream());
    return std::unique_ptr<Stream>(new PausingStream(this, std::move(inner)));
  }
  Status CopyToHost(void* host, const void* device, uint64_t bytes) override {
    return cpu_->CopyToHost(host, device, bytes);
  }
  Status CopyFromHost(void* device, const void* host, uint64_t bytes) override {
    return cpu_->CopyFromHost(device, host, bytes);
  }

 private:
  class PausingStream : public Stream {
   public:
    PausingStream(PausingDevice* device, std::unique_ptr<Stream> inner)
        : device_(device), inner_(std::move(inner)) {}
    Status SubmitCopy(void* dst, const void* src, uint64_t bytes) override {
      device_->MaybePause();
      return inner_->SubmitCopy(dst, src, bytes);
    }
    Result<std::shared_ptr<Event>> Record() override { return inner_->Record(); }
    Status Synchronize() override { return inner_->Synchronize(); }

   private:
    PausingDevice* const device_;
    std::unique_ptr<Stream> inner_;
  };

  void MaybePause() { gate_.Hit(); }

  std::unique_ptr<Device> cpu_;
  Gate gate_;
};

}  // namespace spillway::offload::testing
