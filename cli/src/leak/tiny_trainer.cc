// See tiny_trainer.h.
#include "leak/tiny_trainer.h"

namespace spillway::cli::leak {

engine::GptConfig Tiny(int64_t layers, int64_t d) {
  engine::GptConfig c;
  c.vocab = 32;
  c.d_model = d;
  c.n_layer = layers;
  c.n_head = 2;
  c.seq_len = 16;
  c.seed = 11;
  return c;
}

torch::Tensor Batch(const engine::GptConfig& c, int64_t seed) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(static_cast<uint64_t>(1000 + seed));
  return torch::randint(0, c.vocab, {4, c.seq_len + 1}, gen, torch::kInt64);
}

engine::TrainerOptions TrainerOptionsFor(const engine::GptConfig& c) {
  engine::TrainerOptions o;
  o.model = c;
  o.adam.lr = 1e-2;
  o.optimizer_threads = 2;
  o.max_grad_norm = 1.0;
  return o;
}

Result<std::unique_ptr<engine::Trainer>> MakeTrainer(offload::Tiers& rig,
                                                     engine::Collectives* collectives,
                                                     const engine::GptConfig& c) {
  return engine::Trainer::Create(TrainerOptionsFor(c), collectives, rig.store.get(), rig.host.get(),
                                 &rig.ledger, allocator::kProcessScope);
}

}  // namespace spillway::cli::leak
