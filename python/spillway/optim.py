"""spillway.optim.FusedAdamW: Spillway's fused host AdamW step as a torch.optim.Optimizer.

    opt = spillway.optim.FusedAdamW(model.parameters(), lr=1e-4, weight_decay=0.1,
                                    shadow_dtype=torch.bfloat16, max_grad_norm=1.0)
    loss.backward(); opt.step(loss_scale=1.0); opt.zero_grad()
    opt.shadow(p)        # p's 16-bit copy, written in the same pass as the update

One pass per parameter reads the gradient (fp32, bf16 or fp16), applies the combined unscale and
clip factor, updates the fp32 weight and both moments, and writes the optional 16-bit shadow.
Without a 16-bit shadow and with loss_scale 1 and no clipping it computes torch.optim.AdamW's step
(docs/deepspeed.md, Note [Fused step in Python]). Its state dict has torch.optim.AdamW's keys
(step, exp_avg, exp_avg_sq), so either loads the other's.

For CPU parameters: FSDP2's CPUOffloadPolicy, torchao's CPU optimizer offload, or a plain loop over
a model on the CPU. Parameters must be float32 and contiguous; the error says which one is not.
"""
import math

import torch

from . import _spillway

_GROUP_KEYS = frozenset({"params", "lr", "betas", "eps", "weight_decay", "adamw_mode", "bias_correction"})
_SHADOW_DTYPES = (torch.bfloat16, torch.float16)


def _local(t):
    """A DTensor's local shard (FSDP2 shards parameters as DTensors); other tensors as they are."""
    return t.to_local() if hasattr(t, "to_local") else t


def _sum_over_shards(total, params):
    """The global sum of squares when the parameters are DTensor shards (FSDP2): all-reduced over
    the mesh, so every rank clips and skips alike. Only Shard placements are summed (a replicated
    parameter would be counted once per rank)."""
    meshes = {id(p.device_mesh): p for p in params if hasattr(p, "device_mesh")}
    if not meshes:
        return total
    import torch.distributed as dist

    if len(meshes) > 1:
        raise ValueError("FusedAdamW: clipping or loss scaling over parameters on several device meshes is not "
                         "supported; use torch.nn.utils.clip_grad_norm_ and step(loss_scale=1)")
    p = next(iter(meshes.values()))
    from torch.distributed.tensor import Shard

    if p.device_mesh.ndim != 1 or not all(isinstance(pl, Shard) for pl in p.placements):
        raise ValueError(f"FusedAdamW: clipping over DTensor placements {p.placements} on a {p.device_mesh.ndim}-D "
                         "mesh is not supported (FSDP2's Shard(0) on a 1-D mesh is); use "
                         "torch.nn.utils.clip_grad_norm_")
    group = p.device_mesh.get_group()
    device = "cpu" if dist.get_backend(group) == "gloo" else p.device_mesh.device_type
    t = torch.tensor([total], dtype=torch.float64, device=device)
    dist.all_reduce(t, group=group)
    return t.item()


def _check_hyper(lr, betas, eps, weight_decay, where):
    if not (isinstance(lr, (int, float)) and lr >= 0 and math.isfinite(lr)):
        raise ValueError(f"{where}: lr = {lr!r} is invalid; use a finite lr >= 0")
    if not (isinstance(betas, (tuple, list)) and len(betas) == 2 and all(0 <= b < 1 for b in betas)):
        raise ValueError(f"{where}: betas = {betas!r} is invalid; use two values in [0, 1)")
    if not (eps > 0 and math.isfinite(eps)):
        raise ValueError(f"{where}: eps = {eps!r} is invalid; use eps > 0")
    if not (weight_decay >= 0 and math.isfinite(weight_decay)):
        raise ValueError(f"{where}: weight_decay = {weight_decay!r} is invalid; use a value >= 0")


class FusedAdamW(torch.optim.Optimizer):
    """AdamW (adamw_mode=True, decoupled decay) or Adam with L2 (adamw_mode=False) on Spillway's
    fused host pass. `max_grad_norm` > 0 clips the global norm as torch's clip_grad_norm_ does;
    `step(loss_scale=s)` divides the gradients by s inside the same pass; a non-finite norm skips
    the step (`last_step_skipped`). `threads` defaults to torch.get_num_threads()."""

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2, *,
                 adamw_mode=True, bias_correction=True, shadow_dtype=None, max_grad_norm=0.0,
                 threads=None):
        _check_hyper(lr, betas, eps, weight_decay, "FusedAdamW")
        if shadow_dtype is not None and shadow_dtype not in _SHADOW_DTYPES:
            raise ValueError(f"FusedAdamW: shadow_dtype = {shadow_dtype} is invalid; use torch.bfloat16, "
                             "torch.float16 or None")
        if not (max_grad_norm >= 0 and math.isfinite(max_grad_norm)):
            raise ValueError(f"FusedAdamW: max_grad_norm = {max_grad_norm!r} is invalid; use a value > 0, "
                             "or 0 for no clipping")
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay, adamw_mode=adamw_mode,
                        bias_correction=bias_correction)
        self.shadow_dtype = shadow_dtype
        self.max_grad_norm = float(max_grad_norm)
        self.last_grad_norm = None
        self.last_step_skipped = False
        self._kernel = _spillway.AdamKernel(threads if threads is not None else torch.get_num_threads())
        super().__init__(params, defaults)

    def add_param_group(self, param_group):
        unknown = sorted(set(param_group) - _GROUP_KEYS)
        if unknown:
            raise ValueError(f"FusedAdamW: parameter group keys {unknown} are not supported (it takes "
                             f"{sorted(_GROUP_KEYS)}); amsgrad, maximize, capturable and differentiable have "
                             "no fused host pass: use torch.optim.AdamW for them")
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        index = len(self.param_groups) - 1
        _check_hyper(group["lr"], group["betas"], group["eps"], group["weight_decay"],
                     f"FusedAdamW param_groups[{index}]")
        for i, p in enumerate(group["params"]):
            self._check_param(p, f"param_groups[{index}].params[{i}]")

    @staticmethod
    def _check_param(p, where):
        p = _local(p)
        if p.device.type != "cpu":
            raise ValueError(f"FusedAdamW: {where} {tuple(p.shape)} is on {p.device}; Spillway's step runs "
                             "on CPU parameters (offload them to the CPU, or use torch.optim.AdamW on the "
                             "device)")
        if p.dtype != torch.float32:
            raise ValueError(f"FusedAdamW: {where} {tuple(p.shape)} is {p.dtype}; it keeps float32 weights "
                             "(keep an fp32 master copy and ask for a 16-bit shadow with shadow_dtype)")
        if not p.is_contiguous():
            raise ValueError(f"FusedAdamW: {where} {tuple(p.shape)} is not contiguous")

    def shadow(self, p):
        """p's 16-bit copy (None before the first step or without shadow_dtype)."""
        return self.state[p].get("shadow") if p in self.state else None

    def _state(self, p, where):
        state = self.state[p]
        p = _local(p)
        if not state:
            state["step"] = torch.tensor(0.0)
            state["exp_avg"] = torch.zeros_like(p, memory_format=torch.contiguous_format)
            state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.contiguous_format)
        for key in ("exp_avg", "exp_avg_sq"):
            t = state.get(key)
            t = _local(t) if isinstance(t, torch.Tensor) else t
            if not isinstance(t, torch.Tensor) or t.shape != p.shape:
                raise ValueError(
                    f"FusedAdamW: {where}: state['{key}'] has shape "
                    f"{tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__} and the "
                    f"parameter {tuple(p.shape)}; the state dict was saved for another model or another "
                    "parameter order")
            if t.dtype != torch.float32 or t.device.type != "cpu" or not t.is_contiguous():
                t = t.to(device="cpu", dtype=torch.float32).contiguous()
            state[key] = t
        if self.shadow_dtype is not None and "shadow" not in state:
            state["shadow"] = torch.empty_like(p, dtype=self.shadow_dtype)
        return state

    @torch.no_grad()
    def step(self, closure=None, *, loss_scale=1.0):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if not (loss_scale > 0 and math.isfinite(loss_scale)):
            raise ValueError(f"FusedAdamW.step: loss_scale = {loss_scale!r} is invalid; use a finite value > 0")
        work = []
        for gi, group in enumerate(self.param_groups):
            for pi, p in enumerate(group["params"]):
                if p.grad is None:
                    continue
                where = f"param_groups[{gi}].params[{pi}] {tuple(p.shape)}"
                self._check_param(p, where)
                if _local(p.grad).is_sparse:
                    raise ValueError(f"FusedAdamW: {where} has a sparse gradient; use torch.optim.SparseAdam")
                work.append((group, p, where, _local(p.grad).contiguous()))
        # Every state is checked (and made) before anything is updated: a refusal changes nothing.
        states = [self._state(p, where) for _, p, where, _ in work]
        scale = 1.0 / loss_scale
        self.last_step_skipped = False
        if self.max_grad_norm > 0 or loss_scale != 1.0:
            total = sum(self._kernel.sum_of_squares(where, grad) for _, _, where, grad in work)
            total = _sum_over_shards(total, [p for _, p, _, _ in work])
            norm = math.sqrt(total) / loss_scale
            self.last_grad_norm = norm
            if not math.isfinite(norm):
                self.last_step_skipped = True
                return loss
            if self.max_grad_norm > 0:
                scale *= min(1.0, self.max_grad_norm / (norm + 1e-6))  # torch's clip_grad_norm_
        for (group, p, where, grad), state in zip(work, states):
            beta1, beta2 = group["betas"]
            self._kernel.update(where, _local(p), state["exp_avg"], state["exp_avg_sq"], grad,
                                state.get("shadow"), int(state["step"].item()) + 1, group["lr"], beta1, beta2,
                                group["eps"], group["weight_decay"], group["adamw_mode"],
                                group["bias_correction"], scale)
            state["step"] += 1
        return loss

    def load_state_dict(self, state_dict):
        # torch casts every floating state entry to its parameter's dtype: the 16-bit shadow comes
        # back float32. It is a copy of the weight, so it is remade from the loaded weight.
        super().load_state_dict(state_dict)
        for p, state in self.state.items():
            if "shadow" in state:
                if self.shadow_dtype is None:
                    del state["shadow"]
                else:
                    state["shadow"] = _local(p).detach().to(self.shadow_dtype)
