// The process's resident memory by owner. Note [Every byte named] in docs/allocator.md.
#include "spillway/allocator/process_memory.h"

#include <link.h>
#include <malloc.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <sstream>
#include <unordered_set>

#include "spillway/base/bytes.h"

namespace spillway::allocator {

const char* MemoryOwnerName(MemoryOwner owner) {
  static constexpr const char* kNames[kMemoryOwnerCount] = {
      "arenas",      "torch_cpu",    "torch_pinned", "cuda_driver", "python", "malloc",
      "malloc_free", "mapped_files", "shared",       "libraries",   "unowned"};
  return kNames[static_cast<int>(owner)];
}

namespace {

struct Mapping {
  uintptr_t start = 0, end = 0;
  bool exec = false;
  std::string path;
  uint64_t rss = 0;
};

bool StartsWith(const std::string& s, const char* prefix) {
  return s.compare(0, std::strlen(prefix), prefix) == 0;
}

// "7f00-7f10 r-xp 00000000 08:01 1234   /usr/lib/x.so": true and the mapping when it is a header.
bool ParseHeader(const std::string& line, Mapping* m) {
  std::istringstream in(line);
  std::string range, perms, offset, dev, inode;
  if (!(in >> range >> perms >> offset >> dev >> inode)) return false;
  const size_t dash = range.find('-');
  if (dash == std::string::npos || perms.size() != 4 || range.back() == ':') return false;
  char* end = nullptr;
  m->start = std::strtoull(range.c_str(), &end, 16);
  if (end != range.c_str() + dash) return false;
  m->end = std::strtoull(range.c_str() + dash + 1, &end, 16);
  if (*end != '\0' || m->end <= m->start) return false;
  m->exec = perms[2] == 'x';
  std::getline(in, m->path);
  m->path.erase(0, m->path.find_first_not_of(' '));
  m->rss = 0;
  return true;
}

void SortByBase(std::vector<fork_fault::RegionRange>* ranges) {
  std::sort(ranges->begin(), ranges->end(),
            [](const fork_fault::RegionRange& a, const fork_fault::RegionRange& b) {
              return a.base < b.base;
            });
}

// `rss` scaled by the share of [start, end) the ranges cover, in long double (a 64-bit mantissa:
// the product may not fit in 64 bits).
uint64_t CoveredRss(uint64_t rss, uint64_t covered, uintptr_t start, uintptr_t end) {
  return std::min(rss, static_cast<uint64_t>(static_cast<long double>(rss) * covered /
                                             static_cast<long double>(end - start)));
}

// The bytes of [start, end) that lie in the sorted, disjoint `regions`.
uint64_t Covered(const std::vector<fork_fault::RegionRange>& regions, uintptr_t start,
                 uintptr_t end) {
  auto it =
      std::upper_bound(regions.begin(), regions.end(), start,
                       [](uintptr_t a, const fork_fault::RegionRange& r) { return a < r.base; });
  if (it != regions.begin()) --it;
  uint64_t covered = 0;
  for (; it != regions.end() && it->base < end; ++it) {
    const uintptr_t lo = std::max(start, it->base);
    const uintptr_t hi = std::min<uintptr_t>(end, it->base + it->bytes);
    if (hi > lo) covered += hi - lo;
  }
  return covered;
}

bool IsShared(const std::string& path) {
  return StartsWith(path, "/dev/shm/") || StartsWith(path, "/memfd:") ||
         StartsWith(path, "/SYSV") || StartsWith(path, "/dev/zero") ||
         StartsWith(path, "[anon_shmem");
}

}  // namespace

MappedBytes ClassifySmaps(std::istream& smaps, std::vector<fork_fault::RegionRange> regions,
                          std::vector<fork_fault::RegionRange> bss) {
  SortByBase(&regions);
  SortByBase(&bss);
  std::vector<Mapping> maps;
  std::string line;
  while (std::getline(smaps, line)) {
    Mapping m;
    if (ParseHeader(line, &m)) {
      maps.push_back(std::move(m));
    } else if (!maps.empty() && StartsWith(line, "Rss:")) {
      maps.back().rss = std::strtoull(line.c_str() + 4, nullptr, 10) * 1024;
    }
  }
  // A file with an executable mapping is code: its other mappings are its data.
  std::unordered_set<std::string> code;
  for (const Mapping& m : maps) {
    if (m.exec && !m.path.empty() && m.path[0] == '/') code.insert(m.path);
  }
  MappedBytes out;
  for (const Mapping& m : maps) {
    out.total += m.rss;
    ++out.mappings;
    const bool anonymous = m.path.empty() || m.path == "[heap]" || StartsWith(m.path, "[anon:");
    if (anonymous) {
      // Not by adjacency to a library: the kernel places other anonymous mappings (Python's
      // 1 MiB object arenas) right after a library's last mapping too.
      const uint64_t in_arenas =
          CoveredRss(m.rss, Covered(regions, m.start, m.end), m.start, m.end);
      const uint64_t in_bss = std::min(
          m.rss - in_arenas, CoveredRss(m.rss, Covered(bss, m.start, m.end), m.start, m.end));
      out.arenas += in_arenas;
      out.libraries += in_bss;
      out.anonymous += m.rss - in_arenas - in_bss;
    } else if (StartsWith(m.path, "/dev/nvidia")) {
      out.cuda_driver += m.rss;
    } else if (IsShared(m.path)) {
      out.shared += m.rss;
    } else if (m.path[0] == '[' || code.count(m.path) != 0) {
      out.libraries += m.rss;  // [stack], [vdso], [vvar], and code files
    } else {
      out.files += m.rss;
    }
  }
  return out;
}

std::vector<fork_fault::RegionRange> LoadedBss() {
  std::vector<fork_fault::RegionRange> out;
  dl_iterate_phdr(
      [](dl_phdr_info* info, size_t, void* data) {
        auto* ranges = static_cast<std::vector<fork_fault::RegionRange>*>(data);
        const uintptr_t page = static_cast<uintptr_t>(sysconf(_SC_PAGESIZE));
        auto up = [page](uintptr_t a) { return (a + page - 1) & ~(page - 1); };
        for (int i = 0; i < info->dlpi_phnum; ++i) {
          const ElfW(Phdr)& ph = info->dlpi_phdr[i];
          if (ph.p_type != PT_LOAD || ph.p_memsz <= ph.p_filesz) continue;
          const uintptr_t start = up(info->dlpi_addr + ph.p_vaddr + ph.p_filesz);
          const uintptr_t end = up(info->dlpi_addr + ph.p_vaddr + ph.p_memsz);
          if (end > start) ranges->push_back(fork_fault::RegionRange{start, end - start});
        }
        return 0;
      },
      &out);
  return out;
}

namespace {

Result<MappedBytes> ReadSmaps(const std::string& path, std::vector<fork_fault::RegionRange> regions,
                              std::vector<fork_fault::RegionRange> bss) {
  std::ifstream in(path);
  if (!in) {
    return Status::FromErrno(
        StatusCode::kInvalidArgument, errno,
        StrCat("cannot read ", path, ": the process is gone, or /proc is not mounted"));
  }
  return ClassifySmaps(in, std::move(regions), std::move(bss));
}

}  // namespace

Result<MappedBytes> ReadMappedBytes() {
  return ReadSmaps("/proc/self/smaps", fork_fault::Regions(), LoadedBss());
}

Result<MappedBytes> ReadMappedBytes(const std::string& path) { return ReadSmaps(path, {}, {}); }

void ReadMallocCounters(HeapCounters* counters) {
#if defined(__GLIBC__) && (__GLIBC__ > 2 || (__GLIBC__ == 2 && __GLIBC_MINOR__ >= 33))
  const struct mallinfo2 mi = mallinfo2();
  counters->malloc_in_use = mi.uordblks + mi.hblkhd;
  counters->malloc_free = mi.fordblks;
#else
  // No mallinfo2 (glibc before 2.33, musl): malloc's bytes are left to "unowned", in plain sight.
  counters->malloc_in_use = counters->malloc_free = 0;
#endif
}

double ProcessMemory::named_fraction() const {
  if (total == 0) return 1.0;
  const uint64_t unnamed =
      owners[static_cast<int>(MemoryOwner::kUnowned)] + counted_beyond_resident;
  return static_cast<double>(total - std::min(unnamed, total)) / static_cast<double>(total);
}

ProcessMemory AttributeMemory(const MappedBytes& mapped, const HeapCounters& counters) {
  ProcessMemory out;
  auto at = [&](MemoryOwner o) -> uint64_t& { return out.owners[static_cast<int>(o)]; };
  at(MemoryOwner::kArenas) = mapped.arenas;
  at(MemoryOwner::kMappedFiles) = mapped.files;
  at(MemoryOwner::kShared) = mapped.shared;
  at(MemoryOwner::kCudaDriver) = mapped.cuda_driver;
  at(MemoryOwner::kLibraries) = mapped.libraries;
  // The claims on the anonymous bytes. torch's CPU tensors are malloc's: counted once.
  const MemoryOwner kClaimants[] = {MemoryOwner::kTorchCpu, MemoryOwner::kTorchPinned,
                                    MemoryOwner::kPython, MemoryOwner::kMalloc,
                                    MemoryOwner::kMallocFree};
  const uint64_t claims[] = {
      counters.torch_cpu, counters.torch_pinned, counters.python,
      counters.malloc_in_use - std::min(counters.malloc_in_use, counters.torch_cpu),
      counters.malloc_free};
  long double claimed = 0;  // five 64-bit claims may not sum in 64 bits
  for (uint64_t c : claims) claimed += static_cast<long double>(c);
  const uint64_t anon = mapped.anonymous;
  if (claimed <= static_cast<long double>(anon)) {
    for (int i = 0; i < 5; ++i) at(kClaimants[i]) = claims[i];
    at(MemoryOwner::kUnowned) = anon - static_cast<uint64_t>(claimed);
  } else {
    // Scaled to what is resident; the rounding remainder goes to the largest claim.
    out.counted_beyond_resident = static_cast<uint64_t>(claimed - anon);
    uint64_t given = 0;
    int largest = 0;
    for (int i = 0; i < 5; ++i) {
      at(kClaimants[i]) = std::min<uint64_t>(
          anon - given,
          static_cast<uint64_t>(static_cast<long double>(claims[i]) * anon / claimed));
      given += at(kClaimants[i]);
      if (claims[i] > claims[largest]) largest = i;
    }
    at(kClaimants[largest]) += anon - given;
  }
  for (uint64_t b : out.owners) out.total += b;
  return out;
}

std::string DescribeMemory(const ProcessMemory& memory) {
  const OwnerBytes& owners = memory.owners;
  std::string out;
  for (int o = 0; o < kMemoryOwnerCount; ++o) {
    if (owners[o] == 0 || o == static_cast<int>(MemoryOwner::kUnowned)) continue;
    out += StrCat(out.empty() ? "" : ", ", MemoryOwnerName(static_cast<MemoryOwner>(o)), " ",
                  FormatMiB(owners[o]));
  }
  const uint64_t unowned = owners[static_cast<int>(MemoryOwner::kUnowned)];
  char pct[32];
  std::snprintf(pct, sizeof(pct), "%.1f", 100.0 * memory.named_fraction());
  return StrCat(
      out.empty() ? "nothing resident" : out, "; unowned ", FormatMiB(unowned),
      memory.counted_beyond_resident == 0
          ? std::string()
          : StrCat(", counted beyond resident ", FormatMiB(memory.counted_beyond_resident)),
      " (", pct, "% named)");
}

}  // namespace spillway::allocator
