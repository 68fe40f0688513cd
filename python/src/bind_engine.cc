// spillway._spillway.AdamKernel: HostOptimizer's fused AdamW pass over torch tensors, for
// spillway.optim.FusedAdamW and the DeepSpeed step (python/spillway/optim.py, deepspeed.py). The
// caller keeps the step counts and hyperparameters per parameter group, as torch.optim and
// DeepSpeed's CPU Adam do; this runs one pass with them, without the GIL.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>
#include <torch/extension.h>

#include <memory>
#include <optional>
#include <string>

#include "bindings.h"
#include "errors.h"
#include "spillway/engine/host_optimizer.h"

namespace py = pybind11;

namespace spillway::python {
namespace {

Result<DType> DTypeOf(const torch::Tensor& t, const std::string& what, const std::string& name) {
  switch (t.scalar_type()) {
    case torch::kFloat32:
      return DType::kFp32;
    case torch::kBFloat16:
      return DType::kBf16;
    case torch::kFloat16:
      return DType::kFp16;
    default:
      return Status::InvalidArgument(
          StrCat(name, ": ", what, " is ", c10::toString(t.scalar_type()),
                 "; Spillway's step takes float32, bfloat16 or float16"));
  }
}

// A CPU, contiguous tensor of `numel` elements, named in the error with the fix.
Status CheckTensor(const torch::Tensor& t, const std::string& what, const std::string& name,
                   int64_t numel) {
  if (!t.defined()) return Status::InvalidArgument(StrCat(name, ": ", what, " is undefined"));
  if (!t.device().is_cpu()) {
    return Status::InvalidArgument(
        StrCat(name, ": ", what, " is on ", t.device().str(),
               "; Spillway's host step runs on CPU tensors (offload the "
               "optimizer to the CPU, or use torch.optim on the device)"));
  }
  if (!t.is_contiguous()) {
    return Status::InvalidArgument(
        StrCat(name, ": ", what, " is not contiguous; pass .contiguous() storage"));
  }
  if (t.numel() != numel) {
    return Status::InvalidArgument(StrCat(name, ": ", what, " has ", t.numel(),
                                          " elements and the "
                                          "master weights ",
                                          numel,
                                          "; the state does not belong to "
                                          "this parameter (a state dict of another model?)"));
  }
  return Status::Ok();
}

class AdamKernel {
 public:
  explicit AdamKernel(uint32_t threads) {
    engine::HostOptimizerOptions o;
    o.threads = threads;
    opt_ = Check(engine::HostOptimizer::Create(o));
  }

  void Update(const std::string& name, torch::Tensor master, torch::Tensor exp_avg,
              torch::Tensor exp_avg_sq, torch::Tensor grad, std::optional<torch::Tensor> param,
              uint64_t step, double lr, double beta1, double beta2, double eps, double weight_decay,
              bool adamw_mode, bool bias_correction, double grad_scale) {
    const int64_t n = master.numel();
    Check(CheckTensor(master, "the master weights", name, n));
    if (n == 0) return;
    for (auto [what, t] : {std::pair{"exp_avg", &exp_avg}, std::pair{"exp_avg_sq", &exp_avg_sq}}) {
      Check(CheckTensor(*t, what, name, n));
    }
    // The state: all float32, or all bfloat16 (DeepSpeed's bf16_optimizer_states).
    const auto state = master.scalar_type();
    for (auto [what, t] : {std::pair{"the master weights", &master}, std::pair{"exp_avg", &exp_avg},
                           std::pair{"exp_avg_sq", &exp_avg_sq}}) {
      if (state != torch::kFloat32 && state != torch::kBFloat16) {
        Raise(Status::InvalidArgument(
            StrCat(name, ": the master weights are ", c10::toString(state),
                   "; Spillway's step takes float32 or bfloat16 master weights")));
      }
      if (t->scalar_type() != state) {
        Raise(Status::InvalidArgument(
            StrCat(name, ": ", what, " is ", c10::toString(t->scalar_type()),
                   " and the master weights ", c10::toString(state),
                   "; Spillway's step keeps master weights and moments all in float32 "
                   "(fp32_optimizer_states) or all in bfloat16 (bf16_optimizer_states)")));
      }
    }
    Check(CheckTensor(grad, "the gradient", name, n));
    engine::SubGroup g;
    g.name = name;
    g.numel = static_cast<uint64_t>(n);
    g.master = master.data_ptr();
    g.exp_avg = exp_avg.data_ptr();
    g.exp_avg_sq = exp_avg_sq.data_ptr();
    g.state_dtype = state == torch::kBFloat16 ? DType::kBf16 : DType::kFp32;
    g.grad = grad.data_ptr();
    g.grad_dtype = Check(DTypeOf(grad, "the gradient", name));
    if (param.has_value() && param->defined()) {
      Check(CheckTensor(*param, "the 16-bit copy", name, n));
      g.param = param->data_ptr();
      g.param_dtype = Check(DTypeOf(*param, "the 16-bit copy", name));
      if (g.param_dtype == DType::kFp32) {
        Raise(Status::InvalidArgument(StrCat(name,
                                             ": the 16-bit copy is float32; pass a bfloat16 or "
                                             "float16 tensor, or None")));
      }
    }
    engine::AdamWConfig c;
    c.lr = lr;
    c.beta1 = beta1;
    c.beta2 = beta2;
    c.eps = eps;
    c.weight_decay = weight_decay;
    c.adamw_mode = adamw_mode;
    c.bias_correction = bias_correction;
    Status st;
    {
      py::gil_scoped_release release;
      st = opt_->UpdateWith(g, c, step, grad_scale);
    }
    Check(st);
    // Written through raw pointers: tell autograd, as an in-place op would, so a graph that saved
    // one of these tensors refuses to use the stale value.
    // (Inference tensors keep no version counter.)
    for (torch::Tensor* t : {&master, &exp_avg, &exp_avg_sq}) {
      if (!t->is_inference()) t->unsafeGetTensorImpl()->bump_version();
    }
    if (g.param != nullptr && !param->is_inference()) param->unsafeGetTensorImpl()->bump_version();
  }

  double SumOfSquares(const std::string& name, torch::Tensor grad) {
    Check(CheckTensor(grad, "the gradient", name, grad.numel()));
    if (grad.numel() == 0) return 0.0;
    engine::SubGroup g;
    g.name = name;
    g.numel = static_cast<uint64_t>(grad.numel());
    g.grad = grad.data_ptr();
    g.grad_dtype = Check(DTypeOf(grad, "the gradient", name));
    Result<double> r = [&] {
      py::gil_scoped_release release;
      return opt_->SumOfSquares(g);
    }();
    return Check(std::move(r));
  }

  uint32_t threads() const { return opt_->threads(); }
  std::string isa() const { return engine::IsaName(opt_->isa()); }

 private:
  std::unique_ptr<engine::HostOptimizer> opt_;
};

}  // namespace

void BindEngine(py::module_& m) {
  py::class_<AdamKernel>(m, "AdamKernel")
      .def(py::init<uint32_t>(), py::arg("threads") = 0)
      .def("update", &AdamKernel::Update, py::arg("name"), py::arg("master"), py::arg("exp_avg"),
           py::arg("exp_avg_sq"), py::arg("grad"), py::arg("param"), py::arg("step"), py::arg("lr"),
           py::arg("beta1"), py::arg("beta2"), py::arg("eps"), py::arg("weight_decay"),
           py::arg("adamw_mode"), py::arg("bias_correction"), py::arg("grad_scale") = 1.0,
           "One fused AdamW pass: the gradient times grad_scale, the fp32 master and moments "
           "updated, "
           "the 16-bit copy (param, or None) written from the new master. step counts from 1.")
      .def("sum_of_squares", &AdamKernel::SumOfSquares, py::arg("name"), py::arg("grad"))
      .def_property_readonly("threads", &AdamKernel::threads)
      .def_property_readonly("isa", &AdamKernel::isa);
}

}  // namespace spillway::python
