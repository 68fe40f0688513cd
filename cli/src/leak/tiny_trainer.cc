// See tiny_trainer.h.
#include "leak/tiny_trainer.h"

namespace spillway::cli::leak {

trainer::GptConfig Tiny(int64_t layers, int64_t d) {
  trainer::GptConfig c;
  c.vocab = 32;
  c.d_model = d;
  c.n_layer = layers;
  c.n_head = 2;
  c.seq_len = 16;
  c.seed = 11;
  return c;
}

torch::Tensor Batch(const trainer::GptConfig& c, int64_t seed) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(static_cast<uint64_t>(1000 + seed));
  return torch::randint(0, c.vocab, {4, c.seq_len + 1}, gen, torch::kInt64);
}

trainer::TrainerOptions TrainerOptionsFor(const trainer::GptConfig& c) {
  trainer::TrainerOptions o;
  o.model = c;
  o.adam.lr = 1e-2;
  o.optimizer_threads = 2;
  o.max_grad_norm = 1.0;
  return o;
}

Result<std::unique_ptr<trainer::Trainer>> MakeTrainer(offload::Tiers& rig,
                                                      trainer::Collectives* collectives,
                                                      const trainer::GptConfig& c) {
  return trainer::Trainer::Create(TrainerOptionsFor(c), collectives, rig.store.get(),
                                  rig.host.get(), &rig.ledger, allocator::kProcessScope);
}

}  // namespace spillway::cli::leak
