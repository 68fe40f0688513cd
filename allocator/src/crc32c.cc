// CRC32C through ISA-L. crc32_iscsi takes an int length, so large buffers go in 1 GiB pieces;
// the running value is kept un-inverted between pieces and inverted once at the end.
#include "spillway/allocator/crc32c.h"

#include <isa-l/crc.h>

#include <algorithm>

namespace spillway::allocator {

uint32_t Crc32c(const void* data, size_t bytes) { return Crc32cExtend(0, data, bytes); }

uint32_t Crc32cExtend(uint32_t previous, const void* data, size_t bytes) {
  auto* p = static_cast<unsigned char*>(const_cast<void*>(data));
  uint32_t crc = ~previous;  // ISA-L works on the un-inverted register
  constexpr size_t kPiece = size_t{1} << 30;
  while (bytes > 0) {
    const size_t n = std::min(bytes, kPiece);
    crc = crc32_iscsi(p, static_cast<int>(n), crc);
    p += n;
    bytes -= n;
  }
  return ~crc;
}

uint32_t Crc32ZipExtend(uint32_t crc, const void* data, size_t bytes) {
  // crc32_gzip_refl inverts on entry and exit itself, as zlib's crc32 does, and takes a 64-bit
  // length.
  return crc32_gzip_refl(crc, static_cast<const unsigned char*>(data), bytes);
}

}  // namespace spillway::allocator
