// CRC32C (Castagnoli, iSCSI) over a buffer of any size, on Intel ISA-L's vectorised crc32_iscsi.
#pragma once

#include <cstddef>
#include <cstdint>

namespace spillway::allocator {

// Standard CRC32C: Crc32c("123456789", 9) == 0xE3069283.
uint32_t Crc32c(const void* data, size_t bytes);

}  // namespace spillway::allocator
