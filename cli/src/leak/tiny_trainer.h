// The tiny GPT the libtorch scenarios train (engine-rebuild, accum-remainder, step-exception,
// budget-pressure): its shape, its batches, and a reference trainer over a rig's store.
#pragma once

#include <torch/torch.h>

#include <cstdint>
#include <memory>

#include "spillway/base/status.h"
#include "spillway/offload/tiers.h"
#include "spillway/trainer/collectives.h"
#include "spillway/trainer/model.h"
#include "spillway/trainer/trainer.h"

namespace spillway::cli::leak {

// A GPT of `layers` blocks of width `d`, vocabulary 32, sequences of 16, seed 11.
trainer::GptConfig Tiny(int64_t layers = 1, int64_t d = 32);
// Micro-batch `seed`: 4 random sequences of seq_len + 1 tokens, the same for the same seed.
torch::Tensor Batch(const trainer::GptConfig& c, int64_t seed);
// AdamW at lr 1e-2, 2 optimizer threads, gradients clipped at norm 1.
trainer::TrainerOptions TrainerOptionsFor(const trainer::GptConfig& c);

// A trainer whose states live in the rig's store (the process scope) and which reports its steps
// to the rig's ledger. It must be destroyed before the rig.
Result<std::unique_ptr<trainer::Trainer>> MakeTrainer(offload::Tiers& rig,
                                                      trainer::Collectives* collectives,
                                                      const trainer::GptConfig& c);

}  // namespace spillway::cli::leak
