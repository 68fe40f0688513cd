"""Spillway under DeepSpeed. One line in a training script, before the model is built and before
deepspeed.initialize:

    import spillway; spillway.deepspeed.install()

What it does (docs/deepspeed.md):
- torch's CPU and pinned allocators become Spillway's (spillway.install()), and DeepSpeed's host
  allocation sites run inside spillway.tag() scopes, so the 16-bit parameter partitions, the fp32
  master partitions, the gradient partitions and the Adam moments are exact-size, MADV_DONTFORK
  (a re-forked DataLoader worker copies none of them), budgeted, ledgered by kind and in metrics;
- `engine.step()` marks a step boundary at each gradient-accumulation boundary;
- after deepspeed.initialize and after the first optimizer step, an audit walks DeepSpeed's
  offloaded tensors and reports by name each one whose memory is not Spillway's;
- DeepSpeed's async I/O op becomes Spillway's aio_handle (io_uring), so NVMe swapping runs on it;
- ZeRO-3's host optimizer step runs on Spillway's fused pass (`step=True`, the default): per
  sub-group, the unscale and clip, DeepSpeedCPUAdam's update and the fp32 to 16-bit copy become one
  pass over the data (Note [DeepSpeed step] in docs/deepspeed.md).
- the device guard (`guard=True`, the default) checks every op of ZeRO-3's optimizer step for tensors
  on mixed devices and names them (spillway.DeviceMismatch), and deepspeed.initialize refuses a
  model spread over devices (spillway.guard.audit; Note [Device guard] in docs/deepspeed.md).

`uninstall()` restores DeepSpeed's op and its functions; torch's allocators stay Spillway's for the
rest of the process (memory they handed out must keep freeing through them).
"""
import functools
import math
import os
import types
import warnings

import torch

from . import _spillway

# The DeepSpeed releases whose allocation sites were read and whose runs are tested (tests/python).
TESTED_DEEPSPEED = ("0.19.8",)

# (module, class or None, function, kind): the DeepSpeed functions that allocate host state, and
# what they allocate. Read from DeepSpeed 0.19.8 (docs/deepspeed.md has the table with line refs).
_SITES = (
    ("deepspeed.runtime.zero.partition_parameters", "Init", "_partition_param", "param"),
    ("deepspeed.runtime.zero.stage3", "DeepSpeedZeroOptimizer_Stage3",
     "_create_param_groups_fp16_flat_cpu_memory", "param"),
    ("deepspeed.runtime.zero.stage3", "DeepSpeedZeroOptimizer_Stage3", "_setup_for_real_optimizer", "grad"),
    ("deepspeed.runtime.zero.stage3", "DeepSpeedZeroOptimizer_Stage3", "_create_fp32_partitions",
     "master_weight"),
    ("deepspeed.runtime.zero.stage3", "DeepSpeedZeroOptimizer_Stage3", "initialize_optimizer_states", "grad"),
    # The Adam moments are made lazily by the inner optimizer at the first step.
    ("deepspeed.runtime.zero.stage3", "DeepSpeedZeroOptimizer_Stage3", "_optimizer_step", "optimizer_state"),
)

_OVER_BUDGET_HINT = (
    " DeepSpeed settings that shrink the host state: zero_optimization.offload_optimizer.device: nvme "
    "(fp32 master and moments on NVMe), zero_optimization.offload_param.device: nvme, a smaller "
    "zero_optimization.sub_group_size or reduce_bucket_size; or give Spillway more with "
    "spillway.deepspeed.install(budget_bytes=...).")

_saved = None       # (AsyncIOBuilder, load, is_compatible) while installed
_patched = []       # (owner, name, original) for each function wrapped
_missing = []       # sites this DeepSpeed lacks


class AuditWarning(UserWarning):
    """Some of DeepSpeed's offloaded host state is not in Spillway's arenas."""


def _aio_handle(*args, arena=None, **kwargs):
    """DeepSpeed's `aio_handle(block_size, queue_depth, single_submit, overlap_events,
    intra_op_parallelism)`: Spillway's, with its locked buffers (new_cpu_locked_tensor, DeepSpeed's
    NVMe swap buffers) in the pinned arena spillway.install() made, so they count against its budget,
    in its ledger and in what spillway.metrics.serve() watches. Without install(), the default arena."""
    if arena is None:
        import spillway  # noqa: PLC0415

        runtime = spillway.installed()
        if runtime is not None:
            arena = runtime.pinned
    return _spillway.aio_handle(*args, arena=arena, **kwargs)


def _op():
    return types.SimpleNamespace(aio_handle=_aio_handle, __name__="spillway_async_io")


def _deepspeed_version():
    import deepspeed  # noqa: PLC0415

    return deepspeed.__version__


def _tagged(fn, kind, lifetime="persistent"):
    import spillway  # noqa: PLC0415

    @functools.wraps(fn)
    def wrapped(*args, **kwargs):
        try:
            with spillway.tag(kind, lifetime):
                return fn(*args, **kwargs)
        except spillway.OverBudget as e:
            if _OVER_BUDGET_HINT in str(e):
                raise
            raise spillway.OverBudget(f"{e} (in DeepSpeed's {fn.__qualname__}, {kind}).{_OVER_BUDGET_HINT}") from e
    wrapped.__spillway_original__ = fn
    return wrapped


def _patch(owner, name, replacement):
    _patched.append((owner, name, owner.__dict__[name] if isinstance(owner, type) else getattr(owner, name)))
    setattr(owner, name, replacement)


def _wrap_step(original):
    import spillway  # noqa: PLC0415

    @functools.wraps(original)
    def step(self, *args, **kwargs):
        boundary = self.is_gradient_accumulation_boundary()
        out = original(self, *args, **kwargs)
        if not boundary:
            return out
        # The optimizer step has been applied: nothing below may raise out of engine.step() (a
        # caller that retried would apply it twice). Failures become warnings.
        try:
            runtime = spillway.installed()
            # One ledger step per iteration: the first engine that steps marks them (several engines,
            # as in RLHF's actor and critic, would otherwise count one iteration several times).
            if runtime is not None:
                if getattr(runtime, "_step_engine", None) is None:
                    import weakref  # noqa: PLC0415

                    runtime._step_engine = weakref.ref(self)
                if runtime._step_engine() is self:
                    runtime.mark_step()
            if not getattr(self, "_spillway_audited_step", False):
                self._spillway_audited_step = True
                _audit_and_warn(self, "after the first optimizer step")
        except Exception as e:  # noqa: BLE001
            warnings.warn(f"spillway.deepspeed: the step boundary after engine.step() failed: "
                          f"{type(e).__name__}: {e}. The optimizer step itself was applied",
                          AuditWarning, stacklevel=2)
        return out
    step.__spillway_original__ = original
    return step


def _guarded_step(original):
    from . import guard  # noqa: PLC0415

    @functools.wraps(original)
    def step(self, *args, **kwargs):
        if not getattr(self, "spillway_guard", True):  # `optimizer.spillway_guard = False`: unchecked
            return original(self, *args, **kwargs)
        with guard.devices(self):
            return original(self, *args, **kwargs)
    step.__spillway_original__ = original
    return step


def _audited_initialize(original):
    from . import guard  # noqa: PLC0415

    @functools.wraps(original)
    def initialize(*args, **kwargs):
        model = kwargs.get("model", args[1] if len(args) > 1 else None)
        if isinstance(model, torch.nn.Module):
            # DeepSpeed moves a module whose parameters merely sit on several devices to its own;
            # a device map (hf_device_map) is the placement it cannot undo.
            guard.audit(model, parameters=False)
        return original(*args, **kwargs)
    initialize.__spillway_original__ = original
    return initialize


def _wrap_initialize(original):
    @functools.wraps(original)
    def initialize(*args, **kwargs):
        out = original(*args, **kwargs)
        try:
            _audit_and_warn(out[0], "after deepspeed.initialize")
        except Exception as e:  # noqa: BLE001 (the engine exists: hand it over, say what failed)
            warnings.warn(f"spillway.deepspeed: the audit after deepspeed.initialize failed: "
                          f"{type(e).__name__}: {e}", AuditWarning, stacklevel=2)
        return out
    initialize.__spillway_original__ = original
    return initialize


def install(budget_bytes=None, pinned_budget_bytes=None, allocators=True, step=True, guard=True):
    """Puts DeepSpeed's host side on Spillway (see the module's doc). Call it once, before the model
    is built. `allocators=False` leaves torch's allocators alone (no spillway.install(); the aio op's
    buffers then come from the default arena); the aio op, the step and the guard are still installed
    unless `step=False` / `guard=False`. `step=False` keeps
    DeepSpeed's own optimizer step (bit-for-bit DeepSpeed arithmetic). `guard=False` leaves the
    optimizer step and deepspeed.initialize unchecked.

    Raises FailedPrecondition when already installed. A DeepSpeed outside TESTED_DEEPSPEED, or one
    missing an allocation site, gets one warning that names the version and what still works."""
    import spillway  # noqa: PLC0415
    import deepspeed  # noqa: PLC0415 (deepspeed is optional)
    from deepspeed.ops.op_builder import AsyncIOBuilder  # noqa: PLC0415

    global _saved
    if _saved is not None:
        raise spillway.FailedPrecondition(
            "spillway.deepspeed.install() was already called; call it once per process (uninstall() "
            "first to install again)")
    if allocators:
        if spillway.installed() is None:
            spillway.install(budget_bytes=budget_bytes, pinned_budget_bytes=pinned_budget_bytes)
        elif budget_bytes is not None or pinned_budget_bytes is not None:
            raise spillway.FailedPrecondition(
                "spillway.deepspeed.install(budget_bytes=...) after spillway.install(): the arenas and "
                "their budgets already exist; pass the budgets to spillway.install() instead")
    _saved = (AsyncIOBuilder, AsyncIOBuilder.__dict__.get("load"), AsyncIOBuilder.__dict__.get("is_compatible"))
    AsyncIOBuilder.load = lambda self, verbose=True: _op()
    AsyncIOBuilder.is_compatible = lambda self, verbose=False: True
    if step:
        _install_step()
    if guard:
        from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3 as Stage3  # noqa: PLC0415

        _patch(Stage3, "step", _guarded_step(Stage3.__dict__["step"]))
        _patch(deepspeed, "initialize", _audited_initialize(deepspeed.initialize))
    if not allocators:
        return
    import importlib  # noqa: PLC0415

    _missing.clear()
    for module_name, cls_name, fn_name, kind in _SITES:
        try:
            owner = importlib.import_module(module_name)
            if cls_name is not None:
                owner = getattr(owner, cls_name)
            fn = owner.__dict__[fn_name] if isinstance(owner, type) else getattr(owner, fn_name)
        except (ImportError, AttributeError, KeyError):
            _missing.append(f"{module_name}.{cls_name + '.' if cls_name else ''}{fn_name} ({kind})")
            continue
        _patch(owner, fn_name, _tagged(fn, kind))
    from deepspeed.runtime.engine import DeepSpeedEngine  # noqa: PLC0415

    # The training step's own host scratch (DeepSpeed's temporaries in backward and the optimizer
    # step, and on the CPU accelerator the "device" tensors too) is served from the arena as well:
    # in glibc's heap it would land on pages a forked worker shares and be copied on write.
    for name in ("forward", "backward"):
        _patch(DeepSpeedEngine, name, _tagged(DeepSpeedEngine.__dict__[name], "transient", "step"))
    _patch(DeepSpeedEngine, "step", _wrap_step(_tagged(DeepSpeedEngine.__dict__["step"], "transient", "step")))
    _patch(deepspeed, "initialize", _wrap_initialize(deepspeed.initialize))
    version = _deepspeed_version()
    if version not in TESTED_DEEPSPEED or _missing:
        warnings.warn(
            f"spillway.deepspeed: DeepSpeed {version} is "
            f"{'outside the tested range ' + ', '.join(TESTED_DEEPSPEED) if version not in TESTED_DEEPSPEED else 'tested'}"
            f"{'; these allocation sites are missing: ' + '; '.join(_missing) if _missing else ''}. Still in "
            f"force: torch's CPU and pinned allocators are Spillway's, every site found is tagged, the aio "
            f"op is Spillway's, and the audit after deepspeed.initialize and after the first step names "
            f"each offloaded tensor that is not in Spillway's arenas", AuditWarning, stacklevel=2)


def uninstall():
    """Restores DeepSpeed's own aio op and functions. torch's allocators stay Spillway's."""
    global _saved
    while _patched:
        owner, name, original = _patched.pop()
        setattr(owner, name, original)
    if _saved is None:
        return
    cls, load, compat = _saved
    for name, orig in (("load", load), ("is_compatible", compat)):
        if orig is None:
            delattr(cls, name)
        else:
            setattr(cls, name, orig)
    _saved = None


def installed():
    return _saved is not None


# ---- The optimizer step (Note [DeepSpeed step] in docs/deepspeed.md) ----

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
                      stacklevel=4)


def _why_not_ours(opt, sub_group_id):
    """None when Spillway's fused pass can run this sub-group's step with DeepSpeed's semantics; else
    the reason DeepSpeed's own step runs it."""
    from deepspeed.ops.adam import DeepSpeedCPUAdam  # noqa: PLC0415
    from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3 as Stage3  # noqa: PLC0415

    # A subclass that overrides part of the seam (SuperOffload's _optimizer_step, for one) calls
    # the pieces in its own order: the three must be the ones patched here, or none is ours.
    overridden = [n for n in _STEP_SEAM if getattr(type(opt), n) is not getattr(Stage3, n)]
    if overridden:
        return f"{type(opt).__name__} overrides {', '.join(overridden)}"
    inner = opt.optimizer
    if type(inner) is not DeepSpeedCPUAdam:
        return (f"the optimizer is {type(inner).__name__}; Spillway's fused step implements Adam and AdamW "
                "(DeepSpeedCPUAdam, made by offload_optimizer with optimizer type Adam or AdamW)")
    if not opt.offload_optimizer or opt.subgroup_to_device[sub_group_id] != "cpu":
        return "the sub-group's optimizer state is not on the CPU (offload_optimizer.device is not cpu or nvme)"
    if getattr(opt, "torch_autocast_gradscaler", None) is not None:
        return "torch autocast's GradScaler steps the optimizer"
    if getattr(opt, "zenflow", False):
        return "ZenFlow steps the optimizer"
    if getattr(opt, "use_muon", False) and opt.sub_groups_using_muon[sub_group_id]:
        return "the sub-group uses Muon"
    if not getattr(inner, "fp32_optimizer_states", True):
        return "fp32_optimizer_states is off (Spillway keeps the moments in fp32)"
    fp32 = opt.fp32_partitioned_groups_flat[sub_group_id]
    if fp32.dtype != torch.float32 or fp32.device.type != "cpu":
        return f"the master partition is {fp32.dtype} on {fp32.device} (Spillway's step wants fp32 on the CPU)"
    if fp32.grad is None or fp32.grad.device.type != "cpu":
        return "the master partition's gradient is missing or not on the CPU"
    return None


def _fused_unscale_and_clip_grads(original):
    @functools.wraps(original)
    def unscale_and_clip_grads(self, sub_group_id, total_norm):
        pending = self.__dict__.setdefault("_spillway_scale", {})
        # A mark left by a step that raised between _optimizer_step and _reassign must not make
        # this step skip its copy.
        self.__dict__.get("_spillway_copied", set()).discard(sub_group_id)
        # `optimizer.spillway_step = False` on one ZeRO optimizer keeps DeepSpeed's step for it.
        reason = _why_not_ours(self, sub_group_id) if getattr(self, "spillway_step", True) else "off"
        if reason is not None:
            if reason != "off":
                _decline_once(reason)
            pending.pop(sub_group_id, None)
            return original(self, sub_group_id, total_norm)
        # DeepSpeed's arithmetic, kept to the op: the factor each gradient element is multiplied by.
        combined_scale = self.loss_scale
        if self.clip_grad > 0.:
            clip = ((total_norm / self.loss_scale) + 1e-6) / self.clip_grad
            clip = torch.clamp(clip, min=1.0)
            combined_scale = clip * self.loss_scale
        factor = 1. / combined_scale
        pending[sub_group_id] = float(factor.item() if isinstance(factor, torch.Tensor) else factor)
    unscale_and_clip_grads.__spillway_original__ = original
    return unscale_and_clip_grads


def _fused_optimizer_step(original):
    @functools.wraps(original)
    def _optimizer_step(self, sub_group_id):
        scale = self.__dict__.get("_spillway_scale", {}).pop(sub_group_id, None)
        if scale is None:  # unscale_and_clip_grads declined it (or a caller skipped it): DeepSpeed's path
            return original(self, sub_group_id)
        inner = self.optimizer
        group_id = self.sub_group_to_group_id[sub_group_id]
        if not 0 <= group_id < len(inner.param_groups):
            raise _spillway.InvalidArgument(
                f"spillway.deepspeed: sub-group {sub_group_id} belongs to parameter group {group_id}, and the "
                f"optimizer has {len(inner.param_groups)}; parameter groups were changed after "
                "deepspeed.initialize (add them before it)")
        group = inner.param_groups[group_id]
        fp32 = self.fp32_partitioned_groups_flat[sub_group_id]
        state = inner.state[fp32]
        if len(state) == 0:  # as DeepSpeedCPUAdam.step does at the first step
            state["step"] = 0
            state["exp_avg"] = torch.zeros_like(fp32.data, dtype=torch.float, device="cpu")
            state["exp_avg_sq"] = torch.zeros_like(fp32.data, dtype=torch.float, device="cpu")
        for key in ("exp_avg", "exp_avg_sq"):
            if state[key].shape != fp32.shape:
                raise _spillway.InvalidArgument(
                    f"spillway.deepspeed: sub-group {sub_group_id}: optimizer state '{key}' has shape "
                    f"{tuple(state[key].shape)} and the fp32 partition {tuple(fp32.shape)}; the state was "
                    "loaded from a checkpoint of another model, world size or sub_group_size")
        shadow = self.fp16_partitioned_groups_flat[sub_group_id]
        # The 16-bit partition is written in the same pass only where the pass can reach it: on
        # the CPU (with offload_param off it lives on the accelerator; DeepSpeed's own copy in
        # _reassign_or_swap_out_partitioned_parameters moves it there).
        if shadow is not None and (shadow.device.type != "cpu" or shadow.dtype not in (torch.bfloat16, torch.float16)
                                   or shadow.numel() != fp32.numel() or not shadow.is_contiguous()):
            shadow = None
        beta1, beta2 = group["betas"]
        kernel = self.__dict__.get("_spillway_kernel")
        if kernel is None:
            kernel = self._spillway_kernel = _spillway.AdamKernel(torch.get_num_threads())
        # The step count moves only once the update is made: a refused update leaves it as it was.
        kernel.update(f"DeepSpeed sub-group {sub_group_id} (parameter group {group_id})", fp32.data,
                      state["exp_avg"], state["exp_avg_sq"], fp32.grad.data, shadow, int(state["step"]) + 1,
                      group["lr"], beta1, beta2, group["eps"], group["weight_decay"], inner.adam_w_mode,
                      group.get("bias_correction", True), scale)
        state["step"] += 1
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


def _install_step():
    """Patches the seam when this DeepSpeed has it as read; otherwise says once why not."""
    from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3 as Stage3  # noqa: PLC0415

    version = _deepspeed_version()
    missing = [name for name in _STEP_SEAM if name not in Stage3.__dict__]
    if version not in TESTED_DEEPSPEED or missing:
        _decline_once(f"DeepSpeed {version} is {'outside the tested range ' + ', '.join(TESTED_DEEPSPEED) if version not in TESTED_DEEPSPEED else 'tested'}"
                      f"{'; its ZeRO-3 optimizer lacks ' + ', '.join(missing) if missing else ''}: the seam "
                      "Spillway patches (unscale_and_clip_grads, _optimizer_step, "
                      "_reassign_or_swap_out_partitioned_parameters) was read from 0.19.8 only")
        return False
    _patch(Stage3, "unscale_and_clip_grads", _fused_unscale_and_clip_grads(Stage3.__dict__["unscale_and_clip_grads"]))
    _patch(Stage3, "_optimizer_step", _fused_optimizer_step(Stage3.__dict__["_optimizer_step"]))
    _patch(Stage3, "_reassign_or_swap_out_partitioned_parameters",
           _fused_reassign(Stage3.__dict__["_reassign_or_swap_out_partitioned_parameters"]))
    return True


# ---- The audit ----

def offloaded_tensors(engine):
    """(name, kind, tensor) for each host tensor of DeepSpeed's ZeRO-3 offloaded state that exists
    now: 16-bit partitions, fp32 master partitions and their gradients, the flat gradient
    partitions and the Adam moments. Storages shared by several names are listed once."""
    opt = getattr(engine, "optimizer", None)
    found, seen = [], set()

    def add(name, kind, t):
        if not isinstance(t, torch.Tensor) or t.device.type != "cpu" or t.numel() == 0:
            return
        key = t.untyped_storage().data_ptr()
        if key in seen:
            return
        seen.add(key)
        found.append((name, kind, t))

    for g, buf in enumerate(getattr(opt, "param_groups_fp16_flat_cpu_memory", None) or ()):
        add(f"optimizer.param_groups_fp16_flat_cpu_memory[{g}]", "param", buf)
    module = getattr(engine, "module", None)
    for pname, p in (module.named_parameters() if module is not None else ()):
        add(f"{pname}.ds_tensor", "param", getattr(p, "ds_tensor", None))
    for i, fp32 in enumerate(getattr(opt, "fp32_partitioned_groups_flat", None) or ()):
        add(f"optimizer.fp32_partitioned_groups_flat[{i}]", "master_weight", fp32)
        add(f"optimizer.fp32_partitioned_groups_flat[{i}].grad", "grad", fp32.grad)
        inner = getattr(opt, "optimizer", None)
        state = getattr(inner, "state", {}).get(fp32, {}) if inner is not None else {}
        for key in ("exp_avg", "exp_avg_sq"):
            add(f"optimizer.optimizer.state[fp32[{i}]]['{key}']", "optimizer_state", state.get(key))
    add("optimizer.grad_partitions_flat_buffer", "grad", getattr(opt, "grad_partitions_flat_buffer", None))
    return found


def audit(engine):
    """Which of DeepSpeed's offloaded host tensors live in Spillway's arenas. Returns a dict:
    deepspeed (version), total_bytes, covered_bytes, by_kind ({kind: bytes}), missed (a list of
    {name, kind, bytes}), tensors (how many were looked at)."""
    import spillway  # noqa: PLC0415

    runtime = spillway.installed()
    arenas = runtime.arenas if runtime is not None else ()
    report = {"deepspeed": _deepspeed_version(), "total_bytes": 0, "covered_bytes": 0, "by_kind": {},
              "missed": [], "tensors": 0}
    for name, kind, t in offloaded_tensors(engine):
        storage = t.untyped_storage()
        nbytes = storage.nbytes()
        report["tensors"] += 1
        report["total_bytes"] += nbytes
        if any(a.contains(storage.data_ptr(), nbytes) for a in arenas):
            report["covered_bytes"] += nbytes
            report["by_kind"][kind] = report["by_kind"].get(kind, 0) + nbytes
        else:
            report["missed"].append({"name": name, "kind": kind, "bytes": nbytes})
    return report


def _audit_and_warn(engine, when):
    report = audit(engine)
    try:
        engine._spillway_audits = getattr(engine, "_spillway_audits", []) + [(when, report)]
    except AttributeError:
        pass
    if report["missed"]:
        names = "; ".join(f"{m['name']} ({m['kind']}, {m['bytes']} bytes)" for m in report["missed"][:16])
        more = len(report["missed"]) - 16
        warnings.warn(
            f"spillway.deepspeed audit {when}, DeepSpeed {report['deepspeed']}: "
            f"{report['total_bytes'] - report['covered_bytes']} of {report['total_bytes']} bytes of offloaded "
            f"state are not in Spillway's arenas: {names}{f' and {more} more' if more > 0 else ''}. Call "
            f"spillway.deepspeed.install() before the model is built and before deepspeed.initialize",
            AuditWarning, stacklevel=3)
    return report


# ---- Streaming the consolidated 16-bit weights (docs/checkpoint.md) ----

def _consolidated_entries(engine, exclude_frozen_parameters):
    """(key, kind, tensor) in DeepSpeed's _zero3_consolidated_16bit_state_dict order: per
    module, its own parameters (a tied parameter under each of its names), then its persistent
    buffers, then its children."""
    out = []

    def walk(module, prefix):
        for name, p in module.named_parameters(recurse=False):
            if p is None or (exclude_frozen_parameters and not p.requires_grad):
                continue
            out.append((prefix + name, "param", p))
        for name, b in module.named_buffers(recurse=False):
            if b is not None and name not in module._non_persistent_buffers_set:
                out.append((prefix + name, "buffer", b))
        for name, child in module.named_children():
            if child is not None:
                walk(child, prefix + name + ".")
    walk(engine.module, "")
    return out


def save_16bit_model(engine, save_dir, max_shard_size=5 << 30, exclude_frozen_parameters=False,
                     block_size=1 << 20, queue_depth=8):
    """Writes a ZeRO-3 engine's 16-bit weights to `save_dir` as transformers-style sharded
    safetensors with model.safetensors.index.json: the tensors DeepSpeed's own
    engine.save_16bit_model would write, under the same names. Every rank must call it (the
    parameters are gathered collectively); rank 0 writes. One parameter is gathered at a time and
    streamed to its place in its shard through Spillway's aio_handle, so rank 0's host memory
    peaks at about one parameter, not the model (DeepSpeed gathers the whole state dict on rank 0
    first). Returns the files written on rank 0, [] elsewhere. Atomicity: see spillway.safetensors_stream.Writer."""
    import deepspeed  # noqa: PLC0415
    import deepspeed.comm as dist  # noqa: PLC0415

    from . import safetensors_stream as st  # noqa: PLC0415

    if not engine.zero_optimization_partition_weights():
        raise _spillway.InvalidArgument(
            "spillway.deepspeed.save_16bit_model: the engine is not ZeRO-3 (its weights are not "
            "partitioned); engine.module.state_dict() already holds them whole")
    entries = _consolidated_entries(engine, exclude_frozen_parameters)
    rank0 = dist.get_rank() == 0
    layout = [(key, tuple(getattr(t, "ds_shape", t.shape)), t.dtype) for key, _, t in entries]
    plan = st.Plan(layout, max_shard_size)
    writer = st.Writer(save_dir, plan, block_size, queue_depth) if rank0 else None
    try:
        # A tied parameter is gathered again and written under each of its names: DeepSpeed's
        # state dict holds the same tensor under both, and safetensors has no aliases.
        # Under spillway.install(), each gathered parameter is a "checkpoint" allocation of the host
        # arena: exact size, and its pages are reused by the next one, where glibc's heap kept a
        # varying number of freed 2 MiB gathers resident (peaks of 15 to 31 MiB over an 8-step
        # 25M-parameter model, depending on the torch release).
        # Every rank must gather every parameter, so all of them agree first: the arena serves the
        # gathers only if each rank's budget has room for two of the largest (the gather and a
        # host copy of it); else torch's allocator does, on every rank. One rank refusing a gather
        # with OverBudget would leave the others waiting in the all-gather.
        import contextlib  # noqa: PLC0415
        import spillway  # noqa: PLC0415
        from deepspeed.accelerator import get_accelerator  # noqa: PLC0415

        runtime = spillway.installed()
        room = 0
        if runtime is not None:
            s = runtime.host.stats()
            # The budget caps bytes held from the OS; empty retained regions are given back on demand.
            room = s["budget_bytes"] - s["committed_bytes"] + s["retained_bytes"]
        page = os.sysconf("SC_PAGE_SIZE")  # the arena's granule: each allocation rounds up to it
        largest = max((-(-math.prod(shape) * torch.empty(0, dtype=dtype).element_size() // page) * page
                       for _, shape, dtype in layout), default=0)
        fits = torch.tensor([1 if runtime is not None and room >= 2 * largest else 0], dtype=torch.int32,
                            device=get_accelerator().current_device_name())
        dist.all_reduce(fits, op=dist.ReduceOp.MIN)
        in_arena = bool(fits.item())

        def gathering():
            return spillway.tag("checkpoint") if in_arena else contextlib.nullcontext()

        for key, kind, t in entries:
            if kind == "param" and hasattr(t, "ds_id"):
                with gathering(), deepspeed.zero.GatheredParameters([t], modifier_rank=None):
                    if rank0:
                        writer.write(key, t.data)
            elif rank0:
                writer.write(key, t)
        if not rank0:
            return []
        return writer.commit()
    except BaseException:
        if writer is not None:
            writer.abort()
        raise
