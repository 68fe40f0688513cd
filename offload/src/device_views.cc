// Device views: filling one from the newest copy and writing a dirty one back.
#include "device_views.h"

#include <algorithm>
#include <cstdint>

#include "spillway/base/log.h"

namespace spillway::offload {

Result<void*> DeviceViews::Fill(const Copies& from) {
  SPILLWAY_ASSIGN_OR_RETURN(void* view, pipeline_->device()->Allocate(from.bytes));
  Status st;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (from.host != nullptr) {
      st = pipeline_->HostToDevice(from.host, view, from.bytes);
    } else if (from.nvme_valid) {
      st = pipeline_->NvmeToDevice(from.nvme_off, from.bytes, view);
    } else {
      // Never written: zeros, copied from one static zero block (a partition-sized zero buffer
      // on the heap would be host memory outside the budget and the ledger).
      static const char kZeros[1 << 16] = {};
      for (uint64_t done = 0; done < from.bytes && st.ok(); done += sizeof(kZeros)) {
        st = pipeline_->device()->CopyFromHost(
            static_cast<char*>(view) + done, kZeros,
            std::min<uint64_t>(sizeof(kZeros), from.bytes - done));
      }
    }
  }
  if (!st.ok()) {
    // The copy's error is the one to return; a failed free only loses device memory: log it.
    if (Status f = Free(view); !f.ok()) {
      Log(LogLevel::kError, StrCat("freeing a device view whose fill failed: ", f.ToString()));
    }
    return st;
  }
  return view;
}

Status DeviceViews::WriteBack(const void* view, void* host, uint64_t nvme_off, uint64_t bytes) {
  std::lock_guard<std::mutex> lock(mu_);
  if (host != nullptr) return pipeline_->device()->CopyToHost(host, view, bytes);
  return pipeline_->DeviceToNvme(view, nvme_off, bytes);
}

}  // namespace spillway::offload
