// CRC32C (Castagnoli, iSCSI) over a buffer of any size, on Intel ISA-L's vectorised crc32_iscsi;
// and zip's CRC-32 on its crc32_gzip_refl.
#pragma once

#include <cstddef>
#include <cstdint>

namespace spillway::allocator {

// Standard CRC32C: Crc32c("123456789", 9) == 0xE3069283.
uint32_t Crc32c(const void* data, size_t bytes);
// The CRC32C of (what `crc` covered) followed by `data`: Crc32cExtend(Crc32c(a), b) == Crc32c(ab),
// and Crc32cExtend(0, b) == Crc32c(b). For checking data that arrives in chunks.
uint32_t Crc32cExtend(uint32_t crc, const void* data, size_t bytes);
// The zip (and gzip, zlib) CRC-32, continuing `crc` as zlib's crc32(crc, data, bytes) does:
// Crc32ZipExtend(0, "123456789", 9) == 0xCBF43926. ISA-L's crc32_gzip_refl.
uint32_t Crc32ZipExtend(uint32_t crc, const void* data, size_t bytes);

}  // namespace spillway::allocator
