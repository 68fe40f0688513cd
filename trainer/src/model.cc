// The reference trainer's GPT: parameter layout, initialisation, forward and loss (model.h).
#include "spillway/trainer/model.h"

#include <cmath>
#include <limits>
#include <vector>

namespace spillway::trainer {

namespace gpt {
namespace {

struct Shape {
  const char* name;
  std::vector<int64_t> dims;
  enum Init { kNormal, kOnes, kZeros } init;
};

std::vector<Shape> Layout(const GptConfig& c, int64_t unit) {
  const int64_t d = c.d_model, h = 4 * c.d_model;
  if (unit == 0)
    return {{"wte", {c.vocab, d}, Shape::kNormal}, {"wpe", {c.seq_len, d}, Shape::kNormal}};
  if (unit == c.n_layer + 1) {
    return {{"lnf_w", {d}, Shape::kOnes},
            {"lnf_b", {d}, Shape::kZeros},
            {"lm_w", {c.vocab, d}, Shape::kNormal}};
  }
  return {{"ln1_w", {d}, Shape::kOnes},          {"ln1_b", {d}, Shape::kZeros},
          {"qkv_w", {3 * d, d}, Shape::kNormal}, {"qkv_b", {3 * d}, Shape::kZeros},
          {"proj_w", {d, d}, Shape::kNormal},    {"proj_b", {d}, Shape::kZeros},
          {"ln2_w", {d}, Shape::kOnes},          {"ln2_b", {d}, Shape::kZeros},
          {"fc_w", {h, d}, Shape::kNormal},      {"fc_b", {h}, Shape::kZeros},
          {"fc2_w", {d, h}, Shape::kNormal},     {"fc2_b", {d}, Shape::kZeros}};
}

int64_t Numel(const std::vector<int64_t>& dims) {
  int64_t n = 1;
  for (int64_t x : dims) n *= x;
  return n;
}

std::vector<torch::Tensor> Views(const GptConfig& c, int64_t unit, const torch::Tensor& flat) {
  std::vector<torch::Tensor> out;
  int64_t off = 0;
  for (const Shape& s : Layout(c, unit)) {
    const int64_t n = Numel(s.dims);
    out.push_back(flat.narrow(0, off, n).view(s.dims));
    off += n;
  }
  return out;
}

}  // namespace

int64_t Units(const GptConfig& c) { return c.n_layer + 2; }

int64_t UnitNumel(const GptConfig& c, int64_t unit) {
  int64_t n = 0;
  for (const Shape& s : Layout(c, unit)) n += Numel(s.dims);
  return n;
}

torch::Tensor InitUnit(const GptConfig& c, int64_t unit) {
  torch::NoGradGuard no_grad;
  auto gen = at::make_generator<at::CPUGeneratorImpl>(c.seed * 1000 + static_cast<uint64_t>(unit));
  std::vector<torch::Tensor> parts;
  for (const Shape& s : Layout(c, unit)) {
    const int64_t n = Numel(s.dims);
    if (s.init == Shape::kNormal) {
      parts.push_back(at::normal(0.0, 0.02, {n}, gen));
    } else {
      parts.push_back(s.init == Shape::kOnes ? torch::ones({n}) : torch::zeros({n}));
    }
  }
  return torch::cat(parts);
}

torch::Tensor Forward(const GptConfig& c, int64_t unit, const torch::Tensor& flat,
                      const torch::Tensor& x) {
  const std::vector<torch::Tensor> p = Views(c, unit, flat);
  if (unit == 0) {
    const int64_t t = x.size(1);
    return torch::embedding(p[0], x) + p[1].narrow(0, 0, t);
  }
  const int64_t d = c.d_model;
  if (unit == c.n_layer + 1) {
    return torch::linear(torch::layer_norm(x, {d}, p[0], p[1]), p[2]);
  }
  const int64_t b = x.size(0), t = x.size(1), nh = c.n_head, hd = d / nh;
  const torch::Tensor qkv = torch::linear(torch::layer_norm(x, {d}, p[0], p[1]), p[2], p[3]);
  auto heads = [&](const torch::Tensor& z) { return z.view({b, t, nh, hd}).transpose(1, 2); };
  const std::vector<torch::Tensor> qkv3 = qkv.split(d, -1);
  const torch::Tensor q = heads(qkv3[0]), k = heads(qkv3[1]), v = heads(qkv3[2]);
  torch::Tensor att = torch::matmul(q, k.transpose(-2, -1)) / std::sqrt(static_cast<double>(hd));
  const torch::Tensor mask = torch::ones({t, t}, x.options().dtype(torch::kBool)).triu(1);
  att = torch::softmax(att.masked_fill(mask, -std::numeric_limits<float>::infinity()), -1);
  const torch::Tensor y = torch::matmul(att, v).transpose(1, 2).contiguous().view({b, t, d});
  const torch::Tensor h = x + torch::linear(y, p[4], p[5]);
  const torch::Tensor m = torch::linear(
      torch::gelu(torch::linear(torch::layer_norm(h, {d}, p[6], p[7]), p[8], p[9])), p[10], p[11]);
  return h + m;
}

torch::Tensor Loss(const torch::Tensor& logits, const torch::Tensor& targets) {
  return torch::cross_entropy_loss(logits.reshape({-1, logits.size(-1)}), targets.reshape({-1}));
}

}  // namespace gpt

}  // namespace spillway::trainer
