// Process-tree Rss/Pss from /proc. See proc_memory.h.
#include "spillway/cli/proc_memory.h"

#include <dirent.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <fstream>
#include <string>

namespace spillway::cli {
namespace {

struct Rollup {
  uint64_t rss = 0, pss = 0, pss_anon = 0;
  bool has_anon = false;
};

// One process's rollup; false when it is gone.
bool ReadRollup(pid_t pid, Rollup* r) {
  std::ifstream in(StrCat("/proc/", pid, "/smaps_rollup"));
  if (!in) return false;
  std::string key;
  uint64_t kb = 0;
  bool any = false;
  while (in >> key) {
    if (key == "Rss:" && in >> kb) r->rss = kb * 1024, any = true;
    if (key == "Pss:" && in >> kb) r->pss = kb * 1024, any = true;
    if (key == "Pss_Anon:" && in >> kb) r->pss_anon = kb * 1024, r->has_anon = true;
  }
  return any;
}

}  // namespace

std::vector<pid_t> ChildProcesses(pid_t pid) {
  std::vector<pid_t> out;
  const std::string task_dir = StrCat("/proc/", pid, "/task");
  DIR* d = opendir(task_dir.c_str());
  if (d == nullptr) return out;
  while (dirent* e = readdir(d)) {
    if (e->d_name[0] == '.') continue;
    std::ifstream in(StrCat(task_dir, "/", e->d_name, "/children"));
    long child = 0;
    while (in >> child) out.push_back(static_cast<pid_t>(child));
  }
  closedir(d);
  return out;
}

Result<TreeMemory> ProcessTreeMemory(pid_t pid) {
  TreeMemory m;
  Rollup r;
  if (!ReadRollup(pid, &r)) {
    return Status::InvalidArgument(StrCat("cannot read /proc/", pid, "/smaps_rollup (",
                                          ErrnoText(errno),
                                          "): the process does not exist or this kernel lacks "
                                          "smaps_rollup (Linux >= 4.14)"));
  }
  if (!r.has_anon) {
    return Status::Make(StatusCode::kUnavailable,
                        StrCat("/proc/", pid,
                               "/smaps_rollup has no Pss_Anon line; the leak detectors "
                               "need Linux 5.9 or newer"));
  }
  m.rss_bytes += r.rss;
  m.pss_bytes += r.pss;
  m.pss_anon_bytes += r.pss_anon;
  m.processes = 1;
  std::vector<pid_t> pending = ChildProcesses(pid);
  while (!pending.empty()) {
    const pid_t p = pending.back();
    pending.pop_back();
    r = Rollup{};
    if (!ReadRollup(p, &r)) continue;  // exited meanwhile
    m.rss_bytes += r.rss;
    m.pss_bytes += r.pss;
    m.pss_anon_bytes += r.pss_anon;
    ++m.processes;
    for (pid_t c : ChildProcesses(p)) pending.push_back(c);
  }
  return m;
}

PeakSampler::PeakSampler(pid_t pid, std::chrono::milliseconds interval)
    : pid_(pid), interval_(interval) {
  Sample();
  thread_ = std::thread([this] {
    std::unique_lock<std::mutex> lock(mu_);
    while (!cv_.wait_for(lock, interval_, [this] { return stop_; })) {
      lock.unlock();
      Sample();
      lock.lock();
    }
  });
}

PeakSampler::~PeakSampler() { (void)Stop(); }

void PeakSampler::Sample() {
  auto t = ProcessTreeMemory(pid_);
  if (!t.ok()) {
    if (error_.ok()) error_ = t.status();
    return;
  }
  peak_ = std::max(peak_, t->pss_anon_bytes);
}

Result<uint64_t> PeakSampler::Stop() {
  if (thread_.joinable()) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      stop_ = true;
    }
    cv_.notify_all();
    thread_.join();
    Sample();
  }
  if (!error_.ok()) return error_;
  return peak_;
}

}  // namespace spillway::cli
