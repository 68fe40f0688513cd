"""spillway.deepspeed's optimizer step: ZeRO-3's per-sub-group unscale-and-clip, DeepSpeedCPUAdam
update and fp32 to 16-bit copy, run as Spillway's one fused pass, and ZeRO-1/2's per-group
unscale-and-clip and update (Note [DeepSpeed step] in docs/deepspeed.md).
spillway.deepspeed.install(step=True) patches the seam; this module is private.
"""
import functools
import math
import warnings

import torch

from .. import _spillway
from ._common import _defined, _patch
from ._verified import _methods, _self_calls_in_order, _unverified

# DeepSpeedZeroOptimizer_Stage3's per-sub-group sequence in step(), read from DeepSpeed 0.19.8:
#   unscale_and_clip_grads(i, norm)                grad *= 1 / combined_scale        (pass 1)
#   _optimizer_step(i)                             DeepSpeedCPUAdam.step()           (pass 2)
#   _reassign_or_swap_out_partitioned_parameters(i)  fp16_flat[i].copy_(fp32_flat[i])  (pass 3)
# (the norm before them is DeepSpeed's and stays). Spillway records the scale in the first, runs
# one fused pass in the second (unscale and clip folded in, the 16-bit partition written from the
# new master), and skips the copy in the third. Any sub-group Spillway does not take runs the
# original three.
_STEP_SEAM = ("unscale_and_clip_grads", "_optimizer_step", "_reassign_or_swap_out_partitioned_parameters")
_declined = set()   # reasons already warned about (once per process each)


class StepWarning(UserWarning):
    """Spillway's step is not used for (some of) this run's sub-groups; the reason is in the text."""


def _decline_once(reason):
    if reason not in _declined:
        _declined.add(reason)
        warnings.warn(f"spillway.deepspeed: DeepSpeed's own optimizer step runs: {reason}", StepWarning,
                      stacklevel=5)


def _why_not_ours(opt, sub_group_id):
    """None when Spillway's fused pass can run this ZeRO-3 sub-group's step with DeepSpeed's
    semantics; else the reason DeepSpeed's own step runs it."""
    from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3 as Stage3  # noqa: PLC0415

    if not opt.offload_optimizer or opt.subgroup_to_device[sub_group_id] != "cpu":
        return "the sub-group's optimizer state is not on the CPU (offload_optimizer.device is not cpu or nvme)"
    if getattr(opt, "use_muon", False) and opt.sub_groups_using_muon[sub_group_id]:
        return "the sub-group uses Muon"
    return _why_not_adam(opt, Stage3, _STEP_SEAM, opt.fp32_partitioned_groups_flat[sub_group_id])


def _state_dtype(inner, master):
    """The dtype DeepSpeedCPUAdam makes the moments in: float32, or the master's own dtype with
    fp32_optimizer_states off (bf16_optimizer_states turns it off)."""
    return torch.float32 if getattr(inner, "fp32_optimizer_states", True) else master.dtype


def _why_not_adam(opt, base, seam, fp32):
    """What both ZeRO optimizers need of the step: the seam as patched, DeepSpeedCPUAdam stepping
    a master partition on the CPU with its gradient there, the master and the moments both float32
    or both bfloat16 (DeepSpeed's bf16_optimizer_states). None, or the reason."""
    from deepspeed.ops.adam import DeepSpeedCPUAdam  # noqa: PLC0415

    # A subclass that overrides part of the seam (SuperOffload's _optimizer_step, for one) calls
    # the pieces in its own order: they must be the ones patched here, or none is ours.
    overridden = [n for n in seam if getattr(type(opt), n) is not getattr(base, n)]
    if overridden:
        return f"{type(opt).__name__} overrides {', '.join(overridden)}"
    inner = opt.optimizer
    if type(inner) is not DeepSpeedCPUAdam:
        return (f"the optimizer is {type(inner).__name__}; Spillway's fused step implements Adam and AdamW "
                "(DeepSpeedCPUAdam, made by offload_optimizer with optimizer type Adam or AdamW)")
    if getattr(opt, "torch_autocast_gradscaler", None) is not None:
        return "torch autocast's GradScaler steps the optimizer"
    if getattr(opt, "zenflow", False):
        return "ZenFlow steps the optimizer"
    if fp32.dtype not in (torch.float32, torch.bfloat16) or fp32.device.type != "cpu":
        return (f"the master partition is {fp32.dtype} on {fp32.device} (Spillway's step wants float32 or "
                "bfloat16 on the CPU)")
    if _state_dtype(inner, fp32) != fp32.dtype:
        return (f"the master partition is {fp32.dtype} and the moments {_state_dtype(inner, fp32)} "
                "(bf16_master_weights_and_grads without bf16_optimizer_states); Spillway's step keeps the master "
                "and the moments in one dtype")
    if fp32.grad is None or fp32.grad.device.type != "cpu" or fp32.grad.dtype not in (torch.float32, fp32.dtype):
        return "the master partition's gradient is missing, or not on the CPU in float32 or the master's dtype"
    return None


def _declined_here(opt, pending, key, why_not):
    """True when DeepSpeed's own step runs this sub-group (ZeRO-3) or group (ZeRO-1/2): said once
    per reason, its pending scale dropped. `optimizer.spillway_step = False` on one ZeRO optimizer
    keeps DeepSpeed's step for it, without a word."""
    reason = why_not(opt, key) if getattr(opt, "spillway_step", True) else "off"
    if reason is None:
        return False
    if reason != "off":
        _decline_once(reason)
    pending.pop(key, None)
    return True


def _unscale_factor(opt, total_norm):
    """The factor DeepSpeed's unscale_and_clip_grads multiplies each gradient element by, with its
    arithmetic kept to the op (the same in ZeRO-1/2 and 3)."""
    combined_scale = opt.loss_scale
    if opt.clip_grad > 0.:
        clip = ((total_norm / opt.loss_scale) + 1e-6) / opt.clip_grad
        clip = torch.clamp(clip, min=1.0)
        combined_scale = clip * opt.loss_scale
    factor = 1. / combined_scale
    return float(factor.item() if isinstance(factor, torch.Tensor) else factor)


def _fused_unscale_and_clip_grads(original):
    @functools.wraps(original)
    def unscale_and_clip_grads(self, sub_group_id, total_norm):
        pending = self.__dict__.setdefault("_spillway_scale", {})
        # A mark left by a step that raised between _optimizer_step and _reassign must not make
        # this step skip its copy.
        self.__dict__.get("_spillway_copied", set()).discard(sub_group_id)
        if _declined_here(self, pending, sub_group_id, _why_not_ours):
            return original(self, sub_group_id, total_norm)
        pending[sub_group_id] = _unscale_factor(self, total_norm)
    unscale_and_clip_grads.__spillway_original__ = original
    return unscale_and_clip_grads


def _fused_adam(opt, group_id, fp32, shadow, scale, what):
    """DeepSpeedCPUAdam.step() on one flat fp32 partition as Spillway's one pass: the gradient
    scaled by `scale` (unscale and clip folded in), the moments and the master updated, and the
    16-bit `shadow` (or None) written from the new master. The optimizer's state is DeepSpeed's:
    made as DeepSpeedCPUAdam makes it at the first step, its step count moved once the update is
    made (a refused update leaves it as it was)."""
    inner = opt.optimizer
    if not 0 <= group_id < len(inner.param_groups):
        raise _spillway.InvalidArgument(
            f"spillway.deepspeed: {what} belongs to parameter group {group_id}, and the optimizer has "
            f"{len(inner.param_groups)}; parameter groups were changed after deepspeed.initialize (add them "
            "before it)")
    group = inner.param_groups[group_id]
    state = inner.state[fp32]
    if len(state) == 0:  # as DeepSpeedCPUAdam.step does at the first step
        state["step"] = 0
        state["exp_avg"] = torch.zeros_like(fp32.data, dtype=_state_dtype(inner, fp32), device="cpu")
        state["exp_avg_sq"] = torch.zeros_like(fp32.data, dtype=_state_dtype(inner, fp32), device="cpu")
    for key in ("exp_avg", "exp_avg_sq"):
        if state[key].shape != fp32.shape:
            raise _spillway.InvalidArgument(
                f"spillway.deepspeed: {what}: optimizer state '{key}' has shape {tuple(state[key].shape)} and "
                f"the fp32 partition {tuple(fp32.shape)}; the state was loaded from a checkpoint of another "
                "model, world size or sub_group_size")
    beta1, beta2 = group["betas"]
    kernel = opt.__dict__.get("_spillway_kernel")
    if kernel is None:
        kernel = opt._spillway_kernel = _spillway.AdamKernel(torch.get_num_threads())
    kernel.update(f"DeepSpeed {what} (parameter group {group_id})", fp32.data, state["exp_avg"],
                  state["exp_avg_sq"], fp32.grad.data, shadow, int(state["step"]) + 1, group["lr"], beta1, beta2,
                  group["eps"], group["weight_decay"], inner.adam_w_mode, group.get("bias_correction", True), scale)
    state["step"] += 1


def _shadow_or_none(shadow, fp32):
    """`shadow` where the fused pass can write it as DeepSpeed's copy_ from `fp32` would: a
    contiguous 16-bit tensor on the CPU of the same length; else None."""
    if shadow is None or shadow.device.type != "cpu" or shadow.dtype not in (torch.bfloat16, torch.float16) \
            or shadow.numel() != fp32.numel() or not shadow.is_contiguous():
        return None
    return shadow


def _fused_optimizer_step(original):
    @functools.wraps(original)
    def _optimizer_step(self, sub_group_id):
        scale = self.__dict__.get("_spillway_scale", {}).pop(sub_group_id, None)
        if scale is None:  # unscale_and_clip_grads declined it (or a caller skipped it): DeepSpeed's path
            return original(self, sub_group_id)
        group_id = self.sub_group_to_group_id[sub_group_id]
        fp32 = self.fp32_partitioned_groups_flat[sub_group_id]
        shadow = self.fp16_partitioned_groups_flat[sub_group_id]
        # The 16-bit partition is written in the same pass only where the pass can reach it: on
        # the CPU (with offload_param off it lives on the accelerator; DeepSpeed's own copy in
        # _reassign_or_swap_out_partitioned_parameters moves it there).
        shadow = _shadow_or_none(shadow, fp32)
        _fused_adam(self, group_id, fp32, shadow, scale, f"sub-group {sub_group_id}")
        if shadow is not None:
            self.__dict__.setdefault("_spillway_copied", set()).add(sub_group_id)
    _optimizer_step.__spillway_original__ = original
    return _optimizer_step


def _fused_reassign(original):
    @functools.wraps(original)
    def _reassign_or_swap_out_partitioned_parameters(self, sub_group_id):
        copied = self.__dict__.get("_spillway_copied")
        if copied is None or sub_group_id not in copied:
            return original(self, sub_group_id)
        copied.discard(sub_group_id)
        self._unflatten_partitioned_parameters(sub_group_id)  # what the original does after its copy
    _reassign_or_swap_out_partitioned_parameters.__spillway_original__ = original
    return _reassign_or_swap_out_partitioned_parameters


# DeepSpeedZeroOptimizer's (ZeRO-1 and 2) per-group sequence in step() with offload_optimizer,
# read from DeepSpeed 0.19.8:
#   unscale_and_clip_grads([fp32[i].grad], norm)  grad *= 1 / combined_scale         (pass 1)
#   _optimizer_step(i)                            DeepSpeedCPUAdam.step()            (pass 2)
#   buffer[i].data.copy_(fp32[i].data)            inline in step()                   (pass 3)
#   bit16[i].data.copy_(buffer[i].data)           the offload buffer to the accelerator
# Spillway records the scale in the first and runs one fused pass in the second, which also writes
# the 16-bit copy of the new master: the partition itself where it is on the CPU (the CPU
# accelerator), else the offload buffer. The copies are inline in step(), with no method to patch:
# step() runs under _WrittenCopies, which makes a copy_ a no-op where the fused pass wrote its
# destination in this step (matched by both tensors' addresses; any other op runs). What is left is
# DeepSpeed's copy of the buffer to the accelerator, where the partition is there. step() is
# verified (_ALSO), so the two copies are the ones above, in that order.
_STEP_SEAM_ZERO12 = ("unscale_and_clip_grads", "_optimizer_step")


def _why_not_ours_zero12(opt, group_no):
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer as Zero12  # noqa: PLC0415

    if not getattr(opt, "cpu_offload", False):
        return "the optimizer state is not offloaded (offload_optimizer.device is not cpu)"
    return _why_not_adam(opt, Zero12, _STEP_SEAM_ZERO12, opt.single_partition_of_fp32_groups[group_no])


def _zero12_group_of(opt, grad_groups_flat):
    """The parameter group whose fp32 gradient step() passes alone to unscale_and_clip_grads."""
    if not getattr(opt, "cpu_offload", False) or len(grad_groups_flat) != 1:
        return None
    grad = grad_groups_flat[0]
    for i, fp32 in enumerate(opt.single_partition_of_fp32_groups):
        if fp32.grad is grad:
            return i
    return None


def _invalid_norm(norm):
    """deepspeed.runtime.utils.is_invalid_grad_norm of 0.19.8 (older releases lack it): not finite,
    or negative."""
    if isinstance(norm, torch.Tensor):
        return bool((~torch.isfinite(norm) | (norm < 0)).any())
    return not math.isfinite(float(norm)) or norm < 0


def _fused_unscale_and_clip_grads_zero12(original):
    @functools.wraps(original)
    def unscale_and_clip_grads(self, grad_groups_flat, total_norm):
        pending = self.__dict__.setdefault("_spillway_scale", {})
        group_no = _zero12_group_of(self, grad_groups_flat)
        if group_no is None:  # not step()'s offload path (a direct caller, or no offload)
            return original(self, grad_groups_flat, total_norm)
        if _declined_here(self, pending, group_no, _why_not_ours_zero12):
            return original(self, grad_groups_flat, total_norm)
        if self.clip_grad == 0.0 and self.loss_scale == 1.0:  # DeepSpeed returns without a pass
            pending[group_no] = 1.0
            return None
        # As 0.19.8 reads it; before 0.19.8 an invalid norm that reached here made every gradient
        # NaN (the overflow check skips such steps first in every release).
        if self.clip_grad > 0. and _invalid_norm(total_norm):
            total_norm = torch.tensor(float("inf"), dtype=torch.float)
        pending[group_no] = _unscale_factor(self, total_norm)
        return None
    unscale_and_clip_grads.__spillway_original__ = original
    return unscale_and_clip_grads


def _fused_optimizer_step_zero12(original):
    @functools.wraps(original)
    def _optimizer_step(self, group_no):
        scale = self.__dict__.get("_spillway_scale", {}).pop(group_no, None)
        if scale is None:  # unscale_and_clip_grads declined it (or a caller skipped it): DeepSpeed's path
            return original(self, group_no)
        fp32 = self.single_partition_of_fp32_groups[group_no]
        buffer, partition = _zero12_copies_of(self, group_no)
        # Where the 16-bit partition itself is on the CPU (the CPU accelerator), the pass writes it
        # and both of step()'s copies are no-ops (the buffer, read by nothing else, is left as it
        # was); else it writes the offload buffer and the copy to the accelerator stays.
        # `written`: the (destination, source) pairs of step()'s copies that the pass makes no-ops.
        if _shadow_or_none(partition, fp32) is not None:
            shadow, written = partition, [(partition, buffer), (buffer, fp32)]
        elif _shadow_or_none(buffer, fp32) is not None:
            shadow, written = buffer, [(buffer, fp32)]
        else:
            shadow, written = None, []
        _fused_adam(self, group_no, fp32, shadow, scale,
                    f"ZeRO-{2 if self.partition_gradients else 1} partition {group_no}")
        self.__dict__.setdefault("_spillway_written", set()).update((d.data_ptr(), s.data_ptr()) for d, s in written)
        self._lazy_init_hp_params_optimizer_state()  # what the original does after the step
    _optimizer_step.__spillway_original__ = original
    return _optimizer_step


def _zero12_copies_of(opt, group_no):
    """(the 16-bit offload buffer, this rank's 16-bit partition) of a parameter group, each None
    where this optimizer has no such tensor: what step() copies the new master through."""
    from deepspeed import comm as dist  # noqa: PLC0415

    buffers = getattr(opt, "param_buffer_of_bit16_for_cpu_offload_groups", None)
    buffer = buffers[group_no] if buffers is not None and group_no < len(buffers) else None
    try:
        partition = opt.parallel_partitioned_bit16_groups[group_no][
            dist.get_rank(group=opt.real_dp_process_group[group_no])]
    except (AttributeError, IndexError, TypeError):
        partition = None
    return (buffer, partition) if buffer is not None else (None, None)


_COPY = torch.Tensor.copy_


class _WrittenCopies(torch.overrides.TorchFunctionMode):
    """Active while a ZeRO-1/2 step() runs: a Tensor.copy_(src) whose destination and source are
    a pair the fused pass wrote in this step (the 16-bit offload buffer from the master, the
    partition from the buffer) returns the destination as it is (counted in
    _spillway_copies_skipped); every other op runs unchanged."""

    def __init__(self, opt):
        super().__init__()
        self._opt = opt

    def __torch_function__(self, func, types, args=(), kwargs=None):
        written = self._opt.__dict__.get("_spillway_written")
        if written and func is _COPY:  # Tensor.copy_(self, src, non_blocking=False)
            src = args[1] if len(args) > 1 else (kwargs or {}).get("src")
            key = (args[0].data_ptr(), src.data_ptr()) if isinstance(src, torch.Tensor) else None
            if key in written:
                written.discard(key)
                self._opt._spillway_copies_skipped = self._opt.__dict__.get("_spillway_copies_skipped", 0) + 1
                return args[0]
        return func(*args, **(kwargs or {}))


def _written_copies_step_zero12(original):
    @functools.wraps(original)
    def step(self, *args, **kwargs):
        if not getattr(self, "cpu_offload", False) or not getattr(self, "spillway_step", True):
            return original(self, *args, **kwargs)  # no fused pass can run: DeepSpeed's step alone
        self.__dict__.pop("_spillway_written", None)  # only what this step's fused passes write
        try:
            with _WrittenCopies(self):
                return original(self, *args, **kwargs)
        finally:  # a pair not met (step() raised) is forgotten: its destination holds the new master
            self.__dict__.pop("_spillway_written", None)
    step.__spillway_original__ = original
    return step


# What each ZeRO optimizer's step() must call, in this order, and what else must be as verified.
_STEP_ORDER = {"stage3": _STEP_SEAM, "zero12": _STEP_SEAM_ZERO12}
_ALSO = {"stage3": ("step", "_unflatten_partitioned_parameters"), "zero12": ("step",)}


def _seam_mismatch(which, cls, seam):
    """None when `cls` (this DeepSpeed's ZeRO optimizer) and DeepSpeedCPUAdam have the functions the
    fused step was verified against; else what differs, for the warning."""
    from deepspeed.ops.adam import DeepSpeedCPUAdam  # noqa: PLC0415

    try:
        checks = [(which, cls, _methods(cls), seam + _ALSO[which]),
                  ("cpu_adam", DeepSpeedCPUAdam, _methods(DeepSpeedCPUAdam), ("step",))]
    except (OSError, TypeError, SyntaxError, KeyError) as e:  # a DeepSpeed installed without its .py sources
        return f"its source cannot be read to check the functions Spillway's step replaces ({e})"
    for key, owner, defs, names in checks:
        why = _unverified(key, owner, defs, names, "Spillway's fused step")
        if why is not None:
            return why
    calls = [c for c in _self_calls_in_order(checks[0][2]["step"]) if c in _STEP_ORDER[which]]
    order = list(_STEP_ORDER[which])
    if not calls or calls != order * (len(calls) // len(order)):  # each branch runs the whole seam, in order
        return (f"its {cls.__name__}.step() calls [{', '.join(calls)}], not {', '.join(order)} in that order "
                "(once per branch)")
    return None


def _install_step():
    """Patches the seam where this DeepSpeed has it as verified (by what its functions are, not by
    its version string); otherwise says once why not."""
    from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3 as Stage3  # noqa: PLC0415
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer as Zero12  # noqa: PLC0415

    import deepspeed  # noqa: PLC0415

    installed = False
    why = _seam_mismatch("stage3", Stage3, _STEP_SEAM)
    if why is None:
        _patch(Stage3, "unscale_and_clip_grads",
               _fused_unscale_and_clip_grads(_defined(Stage3, "unscale_and_clip_grads")))
        _patch(Stage3, "_optimizer_step", _fused_optimizer_step(_defined(Stage3, "_optimizer_step")))
        _patch(Stage3, "_reassign_or_swap_out_partitioned_parameters",
               _fused_reassign(_defined(Stage3, "_reassign_or_swap_out_partitioned_parameters")))
        installed = True
    else:
        _decline_once(f"ZeRO-3 on DeepSpeed {deepspeed.__version__}: {why}")
    why = _seam_mismatch("zero12", Zero12, _STEP_SEAM_ZERO12)
    if why is None:
        _patch(Zero12, "unscale_and_clip_grads",
               _fused_unscale_and_clip_grads_zero12(_defined(Zero12, "unscale_and_clip_grads")))
        _patch(Zero12, "_optimizer_step", _fused_optimizer_step_zero12(_defined(Zero12, "_optimizer_step")))
        _patch(Zero12, "step", _written_copies_step_zero12(_defined(Zero12, "step")))
        installed = True
    else:
        _decline_once(f"ZeRO-1/2 on DeepSpeed {deepspeed.__version__}: {why}")
    return installed
