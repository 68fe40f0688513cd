// What the trainer's tests share: a small model, its optimizer settings, deterministic
// micro-batches, and a DeepSpeed config placing every state on one device.
#pragma once

#include <torch/torch.h>

#include <string>

#include "../allocator/nvme_test_util.h"
#include "spillway/trainer/trainer.h"

namespace spillway::trainer::testing {

inline GptConfig SmallGpt() {
  GptConfig c;
  c.vocab = 32;
  c.d_model = 32;
  c.n_layer = 2;
  c.n_head = 2;
  c.seq_len = 16;
  c.seed = 7;
  return c;
}

inline engine::AdamWConfig Adam() {
  engine::AdamWConfig a;
  a.lr = 3e-3;
  a.beta1 = 0.9;
  a.beta2 = 0.99;
  a.eps = 1e-8;
  a.weight_decay = 0.01;
  return a;
}

// Deterministic micro-batches: step s, micro-batch k.
inline torch::Tensor Batch(const GptConfig& c, int step, int k) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(10'000 + step * 100 + k);
  return torch::randint(0, c.vocab, {4, c.seq_len + 1}, gen, torch::kInt64);
}

inline std::string Json(const char* param, const char* opt) {
  const std::string dir = allocator::testing::NvmeTestDir();
  return StrCat(R"({"zero_optimization": {"stage": 3, "offload_param": {"device": ")", param,
                R"(", "nvme_path": ")", dir, R"("}, "offload_optimizer": {"device": ")", opt,
                R"(", "nvme_path": ")", dir, R"("}}})");
}

}  // namespace spillway::trainer::testing
