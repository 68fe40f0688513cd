// compare_nvme: moves the same data between host memory and a file on the NVMe path with
//   spillway   Spillway's IoEngine: io_uring, arena regions as fixed buffers, fixed file
//   libaio     a libaio engine (what DeepSpeed's aio op is built on) at the same block size and
//   depth pool       Spillway's pread/pwrite thread pool (the fallback backend) fio        fio
//   --ioengine=io_uring --direct=1 at the same block size, depth and size (yardstick)
// Sizes: 16 partitions of 64 MiB, and one 1 GiB transfer; block 1 and 8 MiB; depth 8 and 32.
// The disk here is virtual and noisy, so the engines run interleaved in rotated order for --reps
// repetitions and the table shows medians with min..max. The last line is one JSON object.
#include <fcntl.h>
#include <libaio.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "spillway/allocator/host_arena.h"
#include "spillway/allocator/io_engine.h"
#include "spillway/base/bytes.h"

namespace {

using namespace spillway::allocator;
using spillway::kMiB;
using Clock = std::chrono::steady_clock;
constexpr uint64_t kTotal = 1024 * kMiB;

struct Transfer {
  char* buf;
  uint64_t offset;
  uint64_t bytes;
};

double Seconds(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

[[noreturn]] void Die(const std::string& what) {
  std::fprintf(stderr, "compare_nvme: %s\n", what.c_str());
  std::exit(1);
}

// libaio at a fixed depth: chunks of block_size, queue_depth in flight, completions reaped as
// they come (DeepSpeed's aio op does the same with one file open per call; here it is opened once).
double LibaioRun(int fd, const std::vector<Transfer>& xfers, bool write, uint64_t block,
                 unsigned depth) {
  io_context_t ctx = nullptr;
  if (int rc = io_setup(depth, &ctx); rc < 0) Die(std::string("io_setup: ") + strerror(-rc));
  std::vector<iocb> cbs(depth);
  std::vector<iocb*> free_cbs;
  for (auto& cb : cbs) free_cbs.push_back(&cb);
  std::vector<io_event> events(depth);
  size_t xi = 0;
  uint64_t xoff = 0;
  unsigned in_flight = 0;
  auto t0 = Clock::now();
  while (xi < xfers.size() || in_flight > 0) {
    std::vector<iocb*> batch;
    while (!free_cbs.empty() && xi < xfers.size()) {
      const Transfer& x = xfers[xi];
      const uint64_t len = std::min(block, x.bytes - xoff);
      iocb* cb = free_cbs.back();
      free_cbs.pop_back();
      if (write) {
        io_prep_pwrite(cb, fd, x.buf + xoff, len, x.offset + xoff);
      } else {
        io_prep_pread(cb, fd, x.buf + xoff, len, x.offset + xoff);
      }
      cb->data = reinterpret_cast<void*>(len);
      batch.push_back(cb);
      xoff += len;
      if (xoff == x.bytes) {
        ++xi;
        xoff = 0;
      }
    }
    if (!batch.empty()) {
      int rc = io_submit(ctx, static_cast<long>(batch.size()), batch.data());
      if (rc != static_cast<int>(batch.size())) Die("io_submit: short submit");
      in_flight += batch.size();
    }
    int n = io_getevents(ctx, 1, depth, events.data(), nullptr);
    if (n < 0) Die(std::string("io_getevents: ") + strerror(-n));
    for (int i = 0; i < n; ++i) {
      if (events[i].res != reinterpret_cast<uint64_t>(events[i].obj->data))
        Die("libaio: short I/O");
      free_cbs.push_back(events[i].obj);
      --in_flight;
    }
  }
  const double s = Seconds(t0);
  io_destroy(ctx);
  return s;
}

double SpillwayRun(IoEngine& engine, int file, const std::vector<Transfer>& xfers, bool write) {
  auto t0 = Clock::now();
  for (const Transfer& x : xfers) {
    auto t = write ? engine.SubmitWrite(file, x.offset, x.buf, x.bytes)
                   : engine.SubmitRead(file, x.offset, x.buf, x.bytes);
    if (!t.ok()) Die(t.status().ToString());
  }
  if (spillway::Status st = engine.WaitAll(); !st.ok()) Die(st.ToString());
  return Seconds(t0);
}

// fio at the same block size and depth over the same file; returns seconds for kTotal bytes.
double FioRun(const std::string& path, bool write, uint64_t block, unsigned depth) {
  const std::string cmd = "fio --name=yardstick --filename=" + path +
                          " --rw=" + (write ? "write" : "read") + " --bs=" + std::to_string(block) +
                          " --iodepth=" + std::to_string(depth) +
                          " --ioengine=io_uring --direct=1 --size=" + std::to_string(kTotal) +
                          " --output-format=json 2>/dev/null";
  FILE* p = popen(cmd.c_str(), "r");
  if (p == nullptr) Die("popen fio");
  std::string out;
  char buf[4096];
  while (size_t n = fread(buf, 1, sizeof(buf), p)) out.append(buf, n);
  if (pclose(p) != 0) Die("fio failed: " + cmd);
  auto j = nlohmann::json::parse(out.substr(out.find('{')));
  const double bw = j["jobs"][0][write ? "write" : "read"]["bw_bytes"].get<double>();
  return kTotal / bw;
}

double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0 : v[v.size() / 2];
}

}  // namespace

int main(int argc, char** argv) {
  std::string dir = ".";
  int reps = 5;
  bool quick = false;
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    if (a == "--dir" && i + 1 < argc) {
      dir = argv[++i];
    } else if (a == "--reps" && i + 1 < argc) {
      reps = std::max(1, std::atoi(argv[++i]));
    } else if (a == "--quick") {
      quick = true;  // one configuration, one repetition: a smoke run
      reps = 1;
    } else {
      std::fprintf(stderr, "usage: compare_nvme [--dir DIR] [--reps N] [--quick]\n");
      return 2;
    }
  }
  const std::string path = dir + "/spillway-compare-nvme.dat";
  int fd = open(path.c_str(), O_RDWR | O_CREAT | O_DIRECT | O_CLOEXEC, 0600);
  if (fd < 0) Die("open " + path + ": " + strerror(errno));
  if (fallocate(fd, 0, 0, kTotal) != 0) Die(std::string("fallocate: ") + strerror(errno));
  const bool have_fio = std::system("command -v fio >/dev/null 2>&1") == 0;

  Ledger ledger;
  HostArenaOptions ho;
  ho.ledger = &ledger;
  ho.pin = PinMode::kAuto;  // pinned, as offload buffers are
  ho.budget_bytes = 2 * kTotal;
  auto arena = HostArena::Create(ho);
  if (!arena.ok()) Die(arena.status().ToString());
  auto mem = (*arena)->Allocate(kTotal, {Kind::kSwapBuffer, Lifetime::kPersistent, 0, 0, nullptr});
  if (!mem.ok()) Die(mem.status().ToString());
  char* host = static_cast<char*>(*mem);
  for (uint64_t i = 0; i < kTotal; i += 4096) host[i] = static_cast<char>(i >> 12);

  const std::vector<Transfer> one = {{host, 0, kTotal}};
  std::vector<Transfer> parts;
  for (int i = 0; i < 16; ++i) parts.push_back({host + i * 64 * kMiB, i * 64 * kMiB, 64 * kMiB});
  struct Config {
    uint64_t block;
    unsigned depth;
  };
  std::vector<Config> configs = {{kMiB, 8}, {kMiB, 32}, {8 * kMiB, 8}, {8 * kMiB, 32}};
  if (quick) configs = {{kMiB, 32}};

  // results[engine][config][pattern][dir] -> seconds per repetition
  std::map<std::string, std::map<std::string, std::vector<double>>> secs;
  const std::vector<std::string> engines = {"spillway", "libaio", "pool", "fio"};
  for (const Config& c : configs) {
    IoEngineOptions eo;
    eo.arena = arena->get();
    eo.block_size = c.block;
    eo.queue_depth = c.depth;
    auto uring = IoEngine::Create(eo);
    eo.force_thread_pool = true;
    eo.pool_threads = std::min(c.depth, 8u);
    auto pool = IoEngine::Create(eo);
    if (!uring.ok() || !pool.ok()) Die("engine: " + uring.status().ToString());
    if ((*uring)->backend() != IoBackend::kUring) Die("io_uring is not available here");
    auto ufile = (*uring)->RegisterFile(fd, path, 4096);
    auto pfile = (*pool)->RegisterFile(fd, path, 4096);
    const std::string cfg = std::to_string(c.block / kMiB) + "MiB/qd" + std::to_string(c.depth);
    for (int r = 0; r < reps; ++r) {
      for (size_t k = 0; k < engines.size(); ++k) {
        const std::string& e = engines[(k + r) % engines.size()];  // rotate the order
        if (e == "fio" && !have_fio) continue;
        for (int pat = 0; pat < 2; ++pat) {
          if (e == "fio" && pat == 1) continue;  // fio runs the 1 GiB sequential pattern
          const auto& x = pat == 0 ? one : parts;
          const std::string key = cfg + (pat == 0 ? " 1x1GiB" : " 16x64MiB");
          for (bool write : {true, false}) {
            double s = 0;
            if (e == "spillway") s = SpillwayRun(**uring, *ufile, x, write);
            if (e == "pool") s = SpillwayRun(**pool, *pfile, x, write);
            if (e == "libaio") s = LibaioRun(fd, x, write, c.block, c.depth);
            if (e == "fio") s = FioRun(path, write, c.block, c.depth);
            secs[e][key + (write ? " write" : " read")].push_back(s);
          }
        }
      }
    }
    (void)(*uring)->UnregisterFile(*ufile);
    (void)(*pool)->UnregisterFile(*pfile);
  }
  close(fd);
  unlink(path.c_str());
  (void)(*arena)->Free(host);

  std::printf("%-9s %-22s %-6s %10s %18s\n", "engine", "config", "dir", "GB/s med", "min..max");
  std::map<std::string, double> best;  // engine + dir -> best median GB/s
  double fio_spread = 1;
  for (const auto& [e, by_key] : secs) {
    for (const auto& [key, v] : by_key) {
      std::vector<double> gbps;
      for (double s : v) gbps.push_back(kTotal / s / 1e9);
      const double med = Median(gbps);
      const auto [lo, hi] = std::minmax_element(gbps.begin(), gbps.end());
      const std::string dirn = key.substr(key.rfind(' ') + 1);
      std::printf("%-9s %-22s %-6s %10.3f %8.3f..%.3f\n", e.c_str(),
                  key.substr(0, key.rfind(' ')).c_str(), dirn.c_str(), med, *lo, *hi);
      best[e + " " + dirn] = std::max(best[e + " " + dirn], med);
      if (e == "fio" && *lo > 0) fio_spread = std::max(fio_spread, *hi / *lo);
    }
  }
  auto b = [&](const std::string& k) { return best.count(k) ? best[k] : 0.0; };
  const double fw = b("fio write"), fr = b("fio read");
  std::printf(
      "{\"bench\":\"nvme\",\"reps\":%d,\"spillway_write_gbps\":%.3f,\"spillway_read_gbps\":%.3f,"
      "\"fio_write_gbps\":%.3f,\"fio_read_gbps\":%.3f,\"libaio_write_gbps\":%.3f,"
      "\"libaio_read_gbps\":%.3f,\"pool_write_gbps\":%.3f,\"pool_read_gbps\":%.3f,"
      "\"write_vs_fio\":%.3f,\"read_vs_fio\":%.3f,\"write_vs_libaio\":%.3f,"
      "\"read_vs_libaio\":%.3f,\"fio_aa_spread\":%.3f}\n",
      reps, b("spillway write"), b("spillway read"), fw, fr, b("libaio write"), b("libaio read"),
      b("pool write"), b("pool read"), fw > 0 ? b("spillway write") / fw : 0,
      fr > 0 ? b("spillway read") / fr : 0, b("spillway write") / b("libaio write"),
      b("spillway read") / b("libaio read"), fio_spread);
  return 0;
}
