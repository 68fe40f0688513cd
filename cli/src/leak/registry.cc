// The registry: every leak scenario in the order, with the pattern it reproduces and its
// detector; one file per scenario in this folder. The libtorch ones are listed without an entry
// point in a build without libtorch. Note [Leak suite] in docs/leak-suite.md.
#include "leak/scenario.h"
#include "spillway/cli/leak_suite.h"

namespace spillway::cli {

const std::vector<Scenario>& LeakScenarios() {
#if SPILLWAY_WITH_TORCH
#define SPILLWAY_TORCH_SCENARIO(start) &leak::start, nullptr
#else
#define SPILLWAY_TORCH_SCENARIO(start) \
  nullptr, "this build has no libtorch (run scripts/install-deps and rebuild)"
#endif
  static const std::vector<Scenario> kAll = {
      {"fork-cow",
       "data-loader workers re-forked every epoch; the first step writes all optimizer state",
       "process-tree anonymous PSS", &leak::StartForkCow, nullptr},
      {"pinned-pow2",
       "buffer sizes vary across epochs; a power-of-two cache never gives memory back",
       "host bytes held from the OS", &leak::StartPinnedPow2, nullptr},
      {"bounce-leak", "I/O from pageable buffers through bounce buffers, epoch after epoch",
       "ledger live host bytes", &leak::StartBounceLeak, nullptr},
      {"swapped-alive", "parameters swapped to NVMe and back every step", "ledger live host bytes",
       &leak::StartSwappedAlive, nullptr},
      {"engine-rebuild", "the trainer created and destroyed 10 times in one process (RLHF)",
       "ledger live host bytes", SPILLWAY_TORCH_SCENARIO(StartEngineRebuild)},
      {"epoch-checkpoint", "a checkpoint saved at every epoch end", "host bytes held from the OS",
       &leak::StartEpochCheckpoint, nullptr},
      {"accum-remainder", "10 micro-batches per epoch, accumulation over 4",
       "ledger live host bytes", SPILLWAY_TORCH_SCENARIO(StartAccumRemainder)},
      {"step-exception", "a layer fails in the middle of a step", "ledger live host bytes",
       SPILLWAY_TORCH_SCENARIO(StartStepException)},
      {"budget-pressure", "host budget at a quarter of the states", "host bytes over the budget",
       SPILLWAY_TORCH_SCENARIO(StartBudgetPressure)},
  };
#undef SPILLWAY_TORCH_SCENARIO
  return kAll;
}

}  // namespace spillway::cli
