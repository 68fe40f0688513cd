// The reference trainer's model: a small GPT written as a sequence of units (embedding, N
// transformer blocks, head), each unit's parameters one flat fp32 vector. Plain functions, so that
// a plain libtorch training loop (the tests' reference) runs exactly the same math.
// docs/engine.md, Note [Trainer].
#pragma once

#include <torch/torch.h>

#include <cstdint>

namespace spillway::trainer {

struct GptConfig {
  int64_t vocab = 96;
  int64_t d_model = 64;
  int64_t n_layer = 2;
  int64_t n_head = 4;
  int64_t seq_len = 32;
  uint64_t seed = 1234;
};

// Unit 0 is the embedding, 1..n_layer the blocks, n_layer+1 the head.
namespace gpt {
int64_t Units(const GptConfig& c);
int64_t UnitNumel(const GptConfig& c, int64_t unit);
torch::Tensor InitUnit(const GptConfig& c, int64_t unit);  // deterministic from c.seed
// x: token ids [B, T] for unit 0, hidden states [B, T, d_model] otherwise. Returns hidden states,
// or logits [B, T, vocab] from the head.
torch::Tensor Forward(const GptConfig& c, int64_t unit, const torch::Tensor& flat,
                      const torch::Tensor& x);
torch::Tensor Loss(const torch::Tensor& logits, const torch::Tensor& targets);
}  // namespace gpt

}  // namespace spillway::trainer
