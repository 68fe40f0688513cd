// Process-tree Rss/Pss from /proc. See proc_memory.h.
#include "spillway/cli/proc_memory.h"

#include <dirent.h>

#include <cerrno>
#include <cstring>
#include <fstream>
#include <string>

namespace spillway::cli {
namespace {

// Rss and Pss of one process; false when it is gone.
bool ReadRollup(pid_t pid, uint64_t* rss, uint64_t* pss) {
  std::ifstream in(StrCat("/proc/", pid, "/smaps_rollup"));
  if (!in) return false;
  std::string key;
  uint64_t kb = 0;
  bool any = false;
  while (in >> key) {
    if (key == "Rss:" && in >> kb) *rss = kb * 1024, any = true;
    if (key == "Pss:" && in >> kb) *pss = kb * 1024, any = true;
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
  uint64_t rss = 0, pss = 0;
  if (!ReadRollup(pid, &rss, &pss)) {
    return Status::InvalidArgument(StrCat("cannot read /proc/", pid, "/smaps_rollup (", std::strerror(errno),
                                          "): the process does not exist or this kernel lacks "
                                          "smaps_rollup (Linux >= 4.14)"));
  }
  m.rss_bytes += rss;
  m.pss_bytes += pss;
  m.processes = 1;
  std::vector<pid_t> pending = ChildProcesses(pid);
  while (!pending.empty()) {
    const pid_t p = pending.back();
    pending.pop_back();
    rss = pss = 0;
    if (!ReadRollup(p, &rss, &pss)) continue;  // exited meanwhile
    m.rss_bytes += rss;
    m.pss_bytes += pss;
    ++m.processes;
    for (pid_t c : ChildProcesses(p)) pending.push_back(c);
  }
  return m;
}

}  // namespace spillway::cli
