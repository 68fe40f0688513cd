// compare_metrics: what the live exporter costs the allocation hot path. Host-arena alloc+free
// throughput with the exporter off, then on while a client scrapes /metrics every 100 ms (the
// phases interleaved and repeated, with an off-again phase as the A/A noise band), and the time
// one scrape takes. Last line: one JSON object, hot_path_overhead = off/on throughput - 1.
#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <string>
#include <thread>
#include <vector>

#include "spillway/metrics/exporter.h"

namespace {

using namespace spillway;
using Clock = std::chrono::steady_clock;

std::string Get(int port) {
  int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_port = htons(static_cast<uint16_t>(port));
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  std::string out;
  const std::string req = "GET /metrics HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n";
  if (connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)) == 0 &&
      send(fd, req.data(), req.size(), MSG_NOSIGNAL) > 0) {
    char buf[65536];
    ssize_t n;
    while ((n = recv(fd, buf, sizeof(buf), 0)) > 0) out.append(buf, static_cast<size_t>(n));
  }
  close(fd);
  return out;
}

// alloc+free pairs per second of this thread's CPU time, over a fixed number of pairs (64 KiB
// each, cycling 16 live buffers). Thread CPU time leaves out time the thread was not running, which
// on a shared 2-core machine is most of the noise.
double Throughput(allocator::HostArena& arena, uint64_t pairs_total) {
  std::vector<void*> live(16, nullptr);
  timespec a{}, b{};
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &a);
  for (uint64_t pairs = 0; pairs < pairs_total; ++pairs) {
    void*& slot = live[pairs % live.size()];
    if (slot != nullptr) (void)arena.Free(slot);
    slot = *arena.Allocate(
        64 * 1024, {allocator::Kind::kTransient, allocator::Lifetime::kStep, pairs, 0, nullptr});
  }
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &b);
  for (void* p : live) {
    if (p != nullptr) (void)arena.Free(p);
  }
  const double s = static_cast<double>(b.tv_sec - a.tv_sec) + (b.tv_nsec - a.tv_nsec) * 1e-9;
  return static_cast<double>(pairs_total) / s;
}

}  // namespace

int main() {
  allocator::Ledger ledger;
  allocator::HostArenaOptions o;
  o.pin = allocator::PinMode::kPageable;
  o.ledger = &ledger;
  auto arena = allocator::HostArena::Create(o).value();
  auto exporter = metrics::Exporter::Start({"127.0.0.1:0", true});
  if (!exporter.ok()) {
    std::fprintf(stderr, "%s\n", exporter.status().ToString().c_str());
    return 1;
  }
  (*exporter)->Watch(arena.get());
  (*exporter)->Watch(&ledger);
  const int port = (*exporter)->port();
  constexpr uint64_t kPairs = 3'000'000;

  std::vector<double> off, off_again, on, scrape_ms;
  for (int rep = 0; rep < 7; ++rep) {
    off.push_back(Throughput(*arena, kPairs));
    std::atomic<bool> stop{false};
    std::thread scraper([&] {
      while (!stop) {
        const auto t0 = Clock::now();
        const std::string body = Get(port);
        if (body.find("spillway_host_bytes") == std::string::npos) std::abort();
        scrape_ms.push_back(std::chrono::duration<double, std::milli>(Clock::now() - t0).count());
        std::this_thread::sleep_for(std::chrono::milliseconds(100));
      }
    });
    on.push_back(Throughput(*arena, kPairs));
    stop = true;
    scraper.join();
    off_again.push_back(Throughput(*arena, kPairs));  // A/A: the noise band of this machine
  }
  auto median = [](std::vector<double> v) {
    std::sort(v.begin(), v.end());
    return v[v.size() / 2];
  };
  const double m_off = median(off), m_on = median(on), m_scrape = median(scrape_ms);
  const double m_off2 = median(off_again);
  // The only contact a scrape has with the hot path: one Stats() copy under the arena's lock.
  constexpr int kSnapshots = 200000;
  const auto s0 = Clock::now();
  uint64_t sink = 0;
  for (int i = 0; i < kSnapshots; ++i) sink += arena->Stats().live_bytes;
  const double snapshot_ns =
      std::chrono::duration<double, std::nano>(Clock::now() - s0).count() / kSnapshots;
  const double duty = snapshot_ns / 100e6;  // lock held per 100 ms scrape interval
  if (sink == 1) std::puts("");
  std::printf("exporter off: %.0f alloc+free/s (median of 7, thread CPU time)\n", m_off);
  std::printf("exporter on, scraped every 100 ms: %.0f alloc+free/s\n", m_on);
  std::printf("exporter off again (A/A): %.0f alloc+free/s, off/off - 1 = %+.4f\n", m_off2,
              m_off / m_off2 - 1.0);
  std::printf(
      "Stats() snapshot under the arena lock: %.0f ns; at one scrape per 100 ms the lock is "
      "held for a scrape %.2e of the time (upper bound on the hot-path overhead)\n",
      snapshot_ns, duty);
  std::printf("one scrape: %.2f ms median over %zu scrapes, %zu bytes\n", m_scrape,
              scrape_ms.size(), (*exporter)->Render().size());
  std::printf(
      "{\"bench\":\"metrics\",\"hot_path_overhead\":%.4f,\"aa_overhead\":%.4f,"
      "\"scrape_ms\":%.3f,\"snapshot_ns\":%.0f,\"lock_duty_cycle\":%.2e,"
      "\"allocs_per_s_off\":%.0f,\"allocs_per_s_on\":%.0f}\n",
      m_off / m_on - 1.0, m_off / m_off2 - 1.0, m_scrape, snapshot_ns, duty, m_off, m_on);
  return 0;
}
