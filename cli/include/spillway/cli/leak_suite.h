// The epoch-boundary leak regression suite (`spillway leak-suite`). Each scenario runs a real
// workload the way Spillway runs it and then its negative control, the naive pattern real systems
// ship, under the same detector, sampling bytes at every step and epoch boundary. A scenario passes
// when Spillway stays flat and the control visibly grows. Note [Leak suite] in docs/leak-suite.md.
#pragma once

#include <cstdint>
#include <cstdio>
#include <memory>
#include <string>
#include <vector>

#include "spillway/base/status.h"

namespace spillway::cli {

struct LeakPoint {
  int64_t step = 0;  // global step (x axis)
  int64_t epoch = 0;
  bool boundary = false;  // taken at an epoch boundary
  double bytes = 0;       // the scenario's detector (ledger live bytes, arena committed, tree PSS)
};

struct LeakSeries {
  std::vector<LeakPoint> points;
  uint64_t escapes = 0;  // the ledger's, over all boundaries
  void Add(int64_t step, int64_t epoch, bool boundary, double bytes) {
    points.push_back({step, epoch, boundary, bytes});
  }
  // (last boundary - first boundary) / (boundaries - 1): what accumulates epoch over epoch.
  double BoundaryGrowthPerEpoch() const;
  // Mean over epochs after the first of (highest point in the epoch - the previous boundary): what
  // an epoch costs at its peak, for transient mechanisms such as copy-on-write after a fork.
  double PeakGrowthPerEpoch() const;
};

struct ScenarioOutcome {
  std::string name;
  std::string detector;  // what `bytes` measures
  int64_t epochs = 0;
  LeakSeries spillway, control;
  double spillway_growth = 0, control_growth = 0;  // bytes per epoch, by the scenario's rule
  double tolerance = 0;  // Spillway passes at or below it; the control must exceed 4x it
  bool pass = false;
  std::string failure;             // set by a scenario whose own check failed (e.g. losses differ)
  std::vector<std::string> notes;  // what else was measured (step times, losses, escape sites)
};

struct LeakSuiteOptions {
  std::string out_dir = "leak-suite";  // CSV and PNG per scenario
  std::string scratch_dir;             // swap files and checkpoints; empty: out_dir
  bool plots = true;                   // PNGs through gnuplot
  std::FILE* out = stdout;
};

namespace leak {
class Trial;  // one run of a scenario: its two arms and its verdict (cli/src/leak/scenario.h)
}

// An entry of the registry (cli/src/leak/registry.cc), one scenario per file in cli/src/leak/.
struct Scenario {
  const char* name;
  const char* summary;   // the pattern it reproduces
  const char* detector;  // what its samples measure, for both arms
  // Sets up what the Spillway run and the control share; null: not in this build.
  Result<std::unique_ptr<leak::Trial>> (*start)(const LeakSuiteOptions& options);
  const char* unavailable;  // why start is null
};

// Every scenario, in the order.
const std::vector<Scenario>& LeakScenarios();

// Runs `only` (all when empty), prints the table, writes <out_dir>/<name>.csv and .png. Returns the
// number of scenarios that failed; an unknown name or an unwritable directory is an error.
Result<int> RunLeakSuite(const LeakSuiteOptions& options, const std::vector<std::string>& only);

}  // namespace spillway::cli
