// TransferPipeline on the CPU device backend (the same schedule the CUDA backend runs): round
// trips with odd sizes, the serial baseline, a corrupted chunk, read and write faults.
#include "spillway/offload/transfer_pipeline.h"

#include <gtest/gtest.h>

#include <cstring>
#include <thread>

#include "../allocator/nvme_test_util.h"
#include "pausing_device.h"
#include "spillway/allocator/crc32c.h"
#include "spillway/allocator/io_faults.h"
#include "spillway/base/bytes.h"

namespace spillway::offload {
namespace {

using allocator::testing::FillRandom;

using allocator::testing::Has;

struct PipeRig {
  explicit PipeRig(allocator::IoFaults* faults = nullptr, Device* dev = nullptr)
      : io(false, faults) {
    allocator::NvmeArenaOptions no;
    no.directory = allocator::testing::NvmeTestDir();
    no.budget_bytes = 256 * kMiB;
    no.ledger = &io.ledger;
    nvme = std::move(allocator::NvmeArena::Create(no, io.engine.get()).value());
    if (dev == nullptr) {
      cpu = std::move(Device::OpenCpu().value());
      dev = cpu.get();
    }
    device = dev;
    auto p = TransferPipeline::Create(io.arena.get(), nvme.get(), device, {kMiB, 4});
    EXPECT_TRUE(p.ok()) << p.status().ToString();
    pipe = std::move(p.value());
  }
  ~PipeRig() {
    pipe.reset();
    nvme.reset();
  }
  allocator::testing::IoRig io;
  std::unique_ptr<allocator::NvmeArena> nvme;
  std::unique_ptr<Device> cpu;
  Device* device = nullptr;
  std::unique_ptr<TransferPipeline> pipe;
};

// Writes random data from device memory to a fresh extent and streams it back.
void RoundTrip(PipeRig& rig, uint64_t bytes, uint64_t seed) {
  std::vector<char> host(bytes), back(bytes);
  FillRandom(host.data(), bytes, seed);
  void* dev = *rig.device->Allocate(bytes);
  void* dev2 = *rig.device->Allocate(bytes);
  ASSERT_TRUE(rig.device->CopyFromHost(dev, host.data(), bytes).ok());
  auto off = rig.nvme->Allocate(bytes, {allocator::Kind::kParam, allocator::Lifetime::kPersistent});
  ASSERT_TRUE(off.ok());
  Status w = rig.pipe->DeviceToNvme(dev, *off, bytes);
  ASSERT_TRUE(w.ok()) << w.ToString();
  Status r = rig.pipe->NvmeToDevice(*off, bytes, dev2);
  ASSERT_TRUE(r.ok()) << r.ToString();
  ASSERT_TRUE(rig.device->CopyToHost(back.data(), dev2, bytes).ok());
  EXPECT_EQ(host, back);
  // The checksum built chunk by chunk is the one a whole-extent read verifies.
  std::vector<char> whole(bytes);
  EXPECT_TRUE(rig.nvme->Read(*off, whole.data(), bytes).ok());
  EXPECT_EQ(whole, host);
  (void)rig.device->Free(dev);
  (void)rig.device->Free(dev2);
}

TEST(Crc32cTest, TheStandardCheckValueAndExtension) {
  const char* s = "123456789";
  EXPECT_EQ(allocator::Crc32c(s, 9), 0xE3069283u);
  EXPECT_EQ(allocator::Crc32cExtend(allocator::Crc32c(s, 4), s + 4, 5), 0xE3069283u);
  EXPECT_EQ(allocator::Crc32cExtend(0, s, 9), 0xE3069283u);
}

TEST(TransferPipelineTest, RoundTripsOfOddSizes) {
  PipeRig rig;
  for (uint64_t bytes :
       {uint64_t{4096}, uint64_t{100}, kMiB, 10 * kMiB + kMiB / 2 + 12, 3 * kMiB}) {
    RoundTrip(rig, bytes, bytes);
  }
  EXPECT_EQ(rig.pipe->Stats().failures, 0u);
}

TEST(TransferPipelineTest, TheSerialBaselineMovesTheSameBytes) {
  PipeRig rig;
  const uint64_t bytes = 5 * kMiB + 4096;
  std::vector<char> host(bytes), a(bytes), b(bytes);
  FillRandom(host.data(), bytes, 3);
  auto off = rig.nvme->Allocate(bytes, {allocator::Kind::kParam, allocator::Lifetime::kPersistent});
  ASSERT_TRUE(rig.nvme->Write(*off, host.data(), bytes).ok());
  void* d1 = *rig.device->Allocate(bytes);
  void* d2 = *rig.device->Allocate(bytes);
  std::vector<char> bounce(bytes);
  ASSERT_TRUE(rig.pipe->NvmeToDevice(*off, bytes, d1).ok());
  ASSERT_TRUE(rig.pipe->NvmeToDeviceSerial(*off, bytes, bounce.data(), d2).ok());
  ASSERT_TRUE(rig.device->CopyToHost(a.data(), d1, bytes).ok());
  ASSERT_TRUE(rig.device->CopyToHost(b.data(), d2, bytes).ok());
  EXPECT_EQ(a, host);
  EXPECT_EQ(b, host);
  (void)rig.device->Free(d1);
  (void)rig.device->Free(d2);
}

TEST(TransferPipelineTest, ACorruptedChunkMarksTheDestinationInvalid) {
  PipeRig rig;
  const uint64_t bytes = 6 * kMiB;
  std::vector<char> host(bytes);
  FillRandom(host.data(), bytes, 4);
  auto off = rig.nvme->Allocate(bytes, {allocator::Kind::kParam, allocator::Lifetime::kPersistent});
  ASSERT_TRUE(rig.nvme->Write(*off, host.data(), bytes).ok());
  allocator::testing::FlipByteOnDisk(*rig.nvme, *off + 3 * kMiB + 77);
  void* dev = *rig.device->Allocate(bytes);
  Status st = rig.pipe->NvmeToDevice(*off, bytes, dev);
  EXPECT_EQ(st.code(), StatusCode::kChecksumMismatch);
  EXPECT_TRUE(Has(st, "the device destination is not valid")) << st.ToString();
  EXPECT_EQ(rig.pipe->Stats().checksum_failures, 1u);
  (void)rig.device->Free(dev);
}

TEST(TransferPipelineTest, AReadFaultSurfacesAndThePipelineCarriesOn) {
  allocator::IoFaults faults;
  PipeRig rig(&faults);
  const uint64_t bytes = 4 * kMiB;
  std::vector<char> host(bytes), back(bytes);
  FillRandom(host.data(), bytes, 5);
  auto off = rig.nvme->Allocate(bytes, {allocator::Kind::kParam, allocator::Lifetime::kPersistent});
  ASSERT_TRUE(rig.nvme->Write(*off, host.data(), bytes).ok());
  void* dev = *rig.device->Allocate(bytes);
  faults.read_errno = EIO;
  Status st = rig.pipe->NvmeToDevice(*off, bytes, dev);
  EXPECT_EQ(st.code(), StatusCode::kIoError);
  EXPECT_TRUE(Has(st, "not valid")) << st.ToString();
  ASSERT_TRUE(rig.pipe->NvmeToDevice(*off, bytes, dev).ok());
  ASSERT_TRUE(rig.device->CopyToHost(back.data(), dev, bytes).ok());
  EXPECT_EQ(back, host);
  (void)rig.device->Free(dev);
}

TEST(TransferPipelineTest, AWriteFaultKeepsTheSourceAndInvalidatesTheExtent) {
  allocator::IoFaults faults;
  PipeRig rig(&faults);
  const uint64_t bytes = 4 * kMiB;
  std::vector<char> host(bytes), back(bytes);
  FillRandom(host.data(), bytes, 6);
  void* dev = *rig.device->Allocate(bytes);
  ASSERT_TRUE(rig.device->CopyFromHost(dev, host.data(), bytes).ok());
  auto off = rig.nvme->Allocate(bytes, {allocator::Kind::kParam, allocator::Lifetime::kPersistent});
  faults.write_errno = EIO;
  Status st = rig.pipe->DeviceToNvme(dev, *off, bytes);
  EXPECT_EQ(st.code(), StatusCode::kIoError);
  EXPECT_TRUE(Has(st, "the device source is unchanged")) << st.ToString();
  EXPECT_EQ(rig.nvme->ExpectedChecksum(*off, bytes).status().code(),
            StatusCode::kFailedPrecondition);
  ASSERT_TRUE(rig.device->CopyToHost(back.data(), dev, bytes).ok());
  EXPECT_EQ(back, host);
  ASSERT_TRUE(rig.pipe->DeviceToNvme(dev, *off, bytes).ok());  // and it works again
  (void)rig.device->Free(dev);
}

TEST(TransferPipelineTest, ASecondThreadIsRefusedWhileAnotherDrivesIt) {
  testing::PausingDevice device;
  PipeRig rig(nullptr, &device);
  const uint64_t bytes = 2 * kMiB + 10;
  std::vector<char> a(bytes), b(bytes), back(bytes);
  FillRandom(a.data(), bytes, 1);
  FillRandom(b.data(), bytes, 2);
  void* da = *device.Allocate(bytes);
  void* db = *device.Allocate(bytes);
  device.Arm();
  Status first;
  std::thread driver([&] { first = rig.pipe->HostToDevice(a.data(), da, bytes); });
  device.WaitPaused();  // the driver is inside its first chunk copy
  const Status second = rig.pipe->HostToDevice(b.data(), db, bytes);
  device.Resume();
  driver.join();
  EXPECT_TRUE(first.ok()) << first.ToString();
  EXPECT_EQ(second.code(), StatusCode::kFailedPrecondition) << second.ToString();
  EXPECT_TRUE(Has(second, "another thread is driving this pipeline")) << second.ToString();
  ASSERT_TRUE(device.CopyToHost(back.data(), da, bytes).ok());
  EXPECT_EQ(back, a);
  // Once the first call is done, the pipeline serves the other thread's call.
  ASSERT_TRUE(rig.pipe->HostToDevice(b.data(), db, bytes).ok());
  ASSERT_TRUE(device.CopyToHost(back.data(), db, bytes).ok());
  EXPECT_EQ(back, b);
  (void)device.Free(da);
  (void)device.Free(db);
}

TEST(TransferPipelineTest, BadRangesAndOptionsAreRefused) {
  PipeRig rig;
  auto off = rig.nvme->Allocate(kMiB, {allocator::Kind::kParam, allocator::Lifetime::kPersistent});
  std::vector<char> buf(kMiB);
  EXPECT_TRUE(
      Has(rig.nvme->SubmitReadRange(*off, 100, buf.data(), 4096).status(), "must start on"));
  EXPECT_TRUE(
      Has(rig.nvme->SubmitReadRange(*off, 0, buf.data(), 2 * kMiB).status(), "must start on"));
  EXPECT_EQ(rig.pipe->NvmeToDevice(*off, kMiB, buf.data()).code(),
            StatusCode::kFailedPrecondition);  // never written
  auto bad = TransferPipeline::Create(rig.io.arena.get(), rig.nvme.get(), rig.device, {1000, 4});
  EXPECT_TRUE(Has(bad.status(), "aio.block_size")) << bad.status().ToString();
}

TEST(CudaDeviceTest, ThePipelineRunsOnAGpu) {
  auto cuda = Device::OpenCuda(0);
  if (!cuda.ok()) GTEST_SKIP() << "no CUDA device: " << cuda.status().message();
  PipeRig rig(nullptr, cuda->get());
  EXPECT_EQ(rig.device->id().type, DeviceType::kCuda);
  RoundTrip(rig, 10 * kMiB + 12, 7);
}

}  // namespace
}  // namespace spillway::offload
