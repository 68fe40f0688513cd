// What a leak scenario is: a trial that runs one workload the Spillway way and then as its naive
// control under the same detector, and a verdict that scores both series; each scenario's entry
// point, listed in order by the registry (registry.cc). Note [Leak suite] in docs/leak-suite.md.
#pragma once

#include <cstdio>
#include <memory>
#include <string>

#include "spillway/base/status.h"
#include "spillway/cli/leak_suite.h"

namespace spillway::cli::leak {

// One run of a scenario, holding what its two arms share (a rig, a corpus, the losses both arms
// record). The suite calls Spillway, then Control, then Verdict, once each, on one thread, and
// stops at the first arm that fails; the trial is destroyed before the suite writes the CSV.
class Trial {
 public:
  virtual ~Trial() = default;
  // The workload the Spillway way: samples the detector into out->spillway; may add notes.
  virtual Status Spillway(ScenarioOutcome* out) = 0;
  // The same workload the naive way (the negative control), same detector, into out->control.
  virtual Status Control(ScenarioOutcome* out) = 0;
  // Scores both series by the scenario's rule: out->epochs, tolerance, spillway_growth and
  // control_growth; its own checks go to out->failure, what else it measured to out->notes. The
  // suite then applies the pass rule that every scenario shares (Note [Leak suite]).
  virtual void Verdict(ScenarioOutcome* out) = 0;
};

// The entry points (Scenario::start), in the registry's order.
Result<std::unique_ptr<Trial>> StartForkCow(const LeakSuiteOptions& suite);
Result<std::unique_ptr<Trial>> StartPinnedPow2(const LeakSuiteOptions& suite);
Result<std::unique_ptr<Trial>> StartBounceLeak(const LeakSuiteOptions& suite);
Result<std::unique_ptr<Trial>> StartSwappedAlive(const LeakSuiteOptions& suite);
#if SPILLWAY_WITH_TORCH
Result<std::unique_ptr<Trial>> StartEngineRebuild(const LeakSuiteOptions& suite);
#endif
Result<std::unique_ptr<Trial>> StartEpochCheckpoint(const LeakSuiteOptions& suite);
#if SPILLWAY_WITH_TORCH
Result<std::unique_ptr<Trial>> StartAccumRemainder(const LeakSuiteOptions& suite);
Result<std::unique_ptr<Trial>> StartStepException(const LeakSuiteOptions& suite);
Result<std::unique_ptr<Trial>> StartBudgetPressure(const LeakSuiteOptions& suite);
#endif

// For verdicts: both growths by one rule (LeakSeries::BoundaryGrowthPerEpoch or
// PeakGrowthPerEpoch).
inline void ScoreBy(ScenarioOutcome* out, double (LeakSeries::*rule)() const) {
  out->spillway_growth = (out->spillway.*rule)();
  out->control_growth = (out->control.*rule)();
}

// For notes: printf's formatting of up to four numbers.
inline std::string Fmt(const char* fmt, double a, double b = 0, double c = 0, double d = 0) {
  char buf[256];
  std::snprintf(buf, sizeof(buf), fmt, a, b, c, d);
  return buf;
}

}  // namespace spillway::cli::leak
