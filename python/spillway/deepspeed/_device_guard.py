"""spillway.deepspeed's device guard: the ZeRO optimizer's step (stage 1, 2 or 3) checked op by op
for tensors on mixed devices (spillway.guard.devices) on the first steps and on any step whose
tensors moved, torch's own device error from any other step turned into a DeviceMismatch, and
deepspeed.initialize refusing a model spread over devices (Note [Device guard] in docs/deepspeed.md).
Private: install(guard=...) patches it.
"""
import functools

import torch

from .. import _spillway
from .. import guard as _guard
from ._common import _defined, _patch

# The guard's rule (Note [Device guard] in docs/deepspeed.md): every op of the first steps, then every
# op of a step whose tensors changed device or dtype, and torch's own device error out of any other
# step turned into a DeviceMismatch that says how to have the op's tensors named.
_GUARD_FIRST_STEPS = 2
_guard_default = True  # install(guard=...): True or "always"
_TORCH_DEVICE_ERRORS = ("Expected all tensors to be on the same device", "is not on the expected device")


def _check_guard_mode(mode, where, **names):
    """Refuses a guard mode other than True, "always" or False; `where` (formatted with `mode` and
    `names` only then) says where it was set."""
    if mode is not True and mode is not False and mode != "always":
        raise _spillway.InvalidArgument(where.format(mode=mode, **names) + ": True (every op of the first steps "
                                        "and of steps whose tensors moved), 'always' (every op of every step) or False")


def _guard_fingerprint(opt):
    """Where the tensors a ZeRO step works on live: the flat partitions and their gradients, the
    inner optimizer's state, and the tensors the ZeRO optimizer keeps as attributes (scales, norms).
    A few hundred tuples at most; a fraction of a millisecond against a step of tens of ms or more."""
    out = []
    for attr in _guard.ZERO_FLATS:
        for t in getattr(opt, attr, None) or ():
            if isinstance(t, torch.Tensor):
                g = t.grad
                out.append((t.device, t.dtype, None if g is None else (g.device, g.dtype)))
    for name, v in vars(opt).items():
        if isinstance(v, torch.Tensor):
            out.append((name, v.device, v.dtype))
    inner = getattr(opt, "optimizer", None)
    for state in (getattr(inner, "state", None) or {}).values():
        for v in state.values():
            if isinstance(v, torch.Tensor):
                out.append((v.device, v.dtype))
    return tuple(out)


def _guarded_step(original):
    @functools.wraps(original)
    def step(self, *args, **kwargs):
        mode = getattr(self, "spillway_guard", _guard_default)  # `optimizer.spillway_guard = False`: unchecked
        _check_guard_mode(mode, "{cls}.spillway_guard = {mode!r}", cls=type(self).__name__)
        if mode is False:
            return original(self, *args, **kwargs)
        steps = getattr(self, "_spillway_guard_steps", 0)
        self._spillway_guard_steps = steps + 1
        fingerprint = _guard_fingerprint(self)
        moved = fingerprint != getattr(self, "_spillway_guard_fingerprint", None)
        self._spillway_guard_fingerprint = fingerprint
        if mode == "always" or steps < _GUARD_FIRST_STEPS or moved or getattr(self, "_spillway_guard_next", False):
            self._spillway_guard_next = False
            self._spillway_guarded_steps = getattr(self, "_spillway_guarded_steps", 0) + 1
            with _guard.devices(self):
                return original(self, *args, **kwargs)
        try:
            return original(self, *args, **kwargs)
        except RuntimeError as e:
            if not any(m in str(e) for m in _TORCH_DEVICE_ERRORS):
                raise
            self._spillway_guard_next = True
            raise _guard.DeviceMismatch(
                f"{type(self).__name__}.step() at step {steps + 1}: torch found tensors on different devices "
                f"({e}). Spillway's device guard checks every op of the first {_GUARD_FIRST_STEPS} steps and of any "
                f"step whose partitions, gradients or optimizer state moved, and this step was neither: it may "
                f"have taken a path the earlier steps did not (an overflow, clipping, a rarely used option), or "
                f"a tensor outside what the guard fingerprints moved. Run with "
                f"spillway.deepspeed.install(guard='always') (or engine.optimizer.spillway_guard = 'always') to "
                f"have the op and each of its tensors named; the next step of this optimizer is checked op by "
                f"op") from e
    step.__spillway_original__ = original
    return step


def _audited_initialize(original):
    @functools.wraps(original)
    def initialize(*args, **kwargs):
        model = kwargs.get("model", args[1] if len(args) > 1 else None)
        if isinstance(model, torch.nn.Module):
            # DeepSpeed moves a module whose parameters merely sit on several devices to its own;
            # a device map (hf_device_map) is the placement it cannot undo.
            _guard.audit(model, parameters=False)
        return original(*args, **kwargs)
    initialize.__spillway_original__ = original
    return initialize


def _install_guard():
    import deepspeed  # noqa: PLC0415
    from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3 as Stage3  # noqa: PLC0415
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer as Zero12  # noqa: PLC0415

    _patch(Stage3, "step", _guarded_step(_defined(Stage3, "step")))
    _patch(Zero12, "step", _guarded_step(_defined(Zero12, "step")))
    _patch(deepspeed, "initialize", _audited_initialize(_defined(deepspeed, "initialize")))
