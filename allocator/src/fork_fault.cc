// A forked child that touches a page Spillway keeps out of it dies with SIGSEGV, as it always
// did, but first says why. Note [Fork fault] in docs/allocator.md.
#include "spillway/allocator/fork_fault.h"

#include <pthread.h>
#include <signal.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstring>

namespace spillway::allocator::fork_fault {
namespace {

// A region's entry. `bytes` is published last (release) and cleared first: an entry with bytes 0
// is being filled or removed and matches nothing. Only the parent writes; a child reads its own
// copy, made at fork, where no other thread runs.
struct Entry {
  std::atomic<uintptr_t> base{0};  // 0: free (claimed by a CAS from 0)
  std::atomic<uint64_t> bytes{0};
  char arena[48];
  const char* kind;
  bool kept_out;  // MADV_DONTFORK: a child's fault on it is named
};

Entry g_regions[kMaxRegions];
std::atomic<int> g_count{0};
std::atomic<int> g_kept_out{0};  // entries with kept_out: the handler is installed only for them
std::atomic<uint64_t> g_unnamed{0};
std::atomic<bool> g_armed{false};
struct sigaction g_previous;  // the child's SIGSEGV disposition before the handler

// Async-signal-safe appends: no allocation, no locale, no stdio.
struct Out {
  char* p;
  int left;  // room, keeping one byte for the NUL
  int n = 0;
  void Text(const char* s) {
    for (; *s != '\0' && left > 0; ++s, --left) p[n++] = *s;
  }
  void Number(uint64_t v, unsigned base) {  // base 10 or 16, no prefix
    char d[24];
    int k = 0;
    do {
      d[k++] = "0123456789abcdef"[v % base];
      v /= base;
    } while (v != 0);
    while (k > 0 && left > 0) p[n++] = d[--k], --left;
  }
  void Dec(uint64_t v) { Number(v, 10); }
  void Hex(uint64_t v) {
    Text("0x");
    Number(v, 16);
  }
};

const Entry* Find(uintptr_t addr) {
  for (const Entry& e : g_regions) {
    const uint64_t bytes = e.bytes.load(std::memory_order_acquire);
    const uintptr_t base = e.base.load(std::memory_order_relaxed);
    if (bytes != 0 && e.kept_out && addr >= base && addr - base < bytes) return &e;
  }
  return nullptr;
}

// The line the handler writes for a fault at `addr`, formatted into `out` (NUL-terminated), or
// nothing when the address is in no recorded region. Returns its length.
int Describe(uintptr_t addr, int pid, int parent, char* out, int size) {
  if (size <= 0) return 0;
  out[0] = '\0';
  const Entry* e = Find(addr);
  if (e == nullptr) return 0;
  const uintptr_t base = e->base.load(std::memory_order_relaxed);
  Out o{out, size - 1};
  o.Text("spillway: process ");
  o.Dec(static_cast<uint64_t>(pid));
  o.Text(" (forked from ");
  o.Dec(static_cast<uint64_t>(parent));
  o.Text(") touched ");
  o.Hex(addr);
  o.Text(", in a region of host arena '");
  o.Text(e->arena);
  o.Text("' (");
  o.Hex(base);
  o.Text(" + ");
  o.Dec(e->bytes.load(std::memory_order_relaxed));
  o.Text(" bytes, first mapped for ");
  o.Text(e->kind != nullptr ? e->kind : "?");
  o.Text(
      "). Spillway keeps its regions out of forked children by design (MADV_DONTFORK): a fork "
      "copies none of their pages, so the page is not mapped here and the child dies with "
      "SIGSEGV. Read this state in the parent, or hand the child a copy made before the fork "
      "(a tensor made outside spillway.tag(), or t.share_memory_()). Note [Fork fault] in "
      "docs/allocator.md.\n");
  out[o.n] = '\0';
  return o.n;
}

void OnFault(int sig, siginfo_t* info, void* /*context*/) {
  const int saved_errno = errno;
  char text[1024];
  const int n =
      Describe(reinterpret_cast<uintptr_t>(info->si_addr), getpid(), getppid(), text, sizeof(text));
  for (int off = 0; off < n;) {
    const ssize_t w = write(STDERR_FILENO, text + off, static_cast<size_t>(n - off));
    if (w <= 0) break;
    off += static_cast<int>(w);
  }
  // The disposition that was there before (SIG_DFL, Python's faulthandler, another library's)
  // takes the fault when the instruction runs again on return: the process ends as it would have.
  sigaction(sig, &g_previous, nullptr);
  errno = saved_errno;
}

// In a forked child (the atfork child handler, between fork() and its return: only this thread
// exists), and on Rearm.
void Install() {
  if (g_kept_out.load(std::memory_order_relaxed) == 0) return;
  struct sigaction sa {};
  sa.sa_sigaction = OnFault;
  sa.sa_flags = SA_SIGINFO | SA_ONSTACK;  // the alternate stack, where one is set (faulthandler)
  sigemptyset(&sa.sa_mask);
  struct sigaction now {};
  if (sigaction(SIGSEGV, nullptr, &now) != 0 || now.sa_sigaction == OnFault) return;  // in front
  sigaction(SIGSEGV, &sa, &g_previous);
}

void Arm() {
  static const bool armed = [] {
    const bool ok = pthread_atfork(nullptr, nullptr, Install) == 0;
    g_armed.store(ok, std::memory_order_release);
    return ok;
  }();
  (void)armed;
}

}  // namespace

void Register(const void* base, uint64_t bytes, const char* arena, const char* kind,
              bool kept_out) {
  if (kept_out) Arm();
  const auto b = reinterpret_cast<uintptr_t>(base);
  for (Entry& e : g_regions) {
    uintptr_t expected = 0;
    if (!e.base.compare_exchange_strong(expected, b, std::memory_order_acq_rel)) continue;
    std::strncpy(e.arena, arena, sizeof(e.arena) - 1);
    e.arena[sizeof(e.arena) - 1] = '\0';
    e.kind = kind;
    e.kept_out = kept_out;
    e.bytes.store(bytes, std::memory_order_release);
    g_count.fetch_add(1, std::memory_order_relaxed);
    if (kept_out) g_kept_out.fetch_add(1, std::memory_order_relaxed);
    return;
  }
  g_unnamed.fetch_add(1, std::memory_order_relaxed);
}

void Unregister(const void* base) {
  const auto b = reinterpret_cast<uintptr_t>(base);
  for (Entry& e : g_regions) {
    if (e.base.load(std::memory_order_relaxed) != b ||
        e.bytes.load(std::memory_order_relaxed) == 0) {
      continue;
    }
    e.bytes.store(0, std::memory_order_release);
    if (e.kept_out) g_kept_out.fetch_sub(1, std::memory_order_relaxed);
    e.base.store(0, std::memory_order_release);
    g_count.fetch_sub(1, std::memory_order_relaxed);
    return;
  }
}

void Rearm() { Install(); }

std::vector<RegionRange> Regions() {
  std::vector<RegionRange> out;
  out.reserve(static_cast<size_t>(g_count.load(std::memory_order_relaxed)) + 8);
  for (const Entry& e : g_regions) {
    const uint64_t bytes = e.bytes.load(std::memory_order_acquire);
    const uintptr_t base = e.base.load(std::memory_order_relaxed);
    if (bytes != 0 && base != 0) out.push_back(RegionRange{base, bytes});
  }
  return out;
}

Stats Snapshot() {
  return Stats{g_count.load(std::memory_order_relaxed), g_unnamed.load(std::memory_order_relaxed),
               g_armed.load(std::memory_order_acquire)};
}

}  // namespace spillway::allocator::fork_fault
