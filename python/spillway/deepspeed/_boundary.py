"""spillway.deepspeed's hooks on the engine: forward, backward and step run their host scratch in the
arena (a `transient` scope), engine.step() marks the ledger's step boundary at each gradient
accumulation boundary and runs the audit after the first optimizer step, and deepspeed.initialize
names the settings left to DeepSpeed, runs node admission (_admission.py) and the audit after it.
Private: install() patches them (_install_engine_scope).
"""
import functools
import warnings

from .. import _torch_allocators
from . import _checkpoint
from ._admission import _admit, _ds_config, _learn_job
from ._audit import AuditWarning, _audit_and_warn, _name_left_engine_parts, _name_left_settings
from ._common import _defined, _patch
from ._sites import _tagged


def _wrap_step(original):
    @functools.wraps(original)
    def step(self, *args, **kwargs):
        boundary = self.is_gradient_accumulation_boundary()
        out = original(self, *args, **kwargs)
        if not boundary:
            return out
        # The optimizer step has been applied: nothing below may raise out of engine.step() (a
        # caller that retried would apply it twice). Failures become warnings.
        try:
            runtime = _torch_allocators.installed()
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


def _warn_left(args, kwargs):
    """Names, once each, the settings of the DeepSpeed config that leave a part DeepSpeed's."""
    try:
        config = _ds_config(args, kwargs)
    except (OSError, ValueError):
        return  # DeepSpeed reads the config next and names what is wrong with it
    if isinstance(config, dict):
        _name_left_settings(config)


def _wrap_initialize(original):
    @functools.wraps(original)
    def initialize(*args, **kwargs):
        _warn_left(args, kwargs)
        _learn_job(original, args, kwargs)  # every rank, joined or not: the exchange is collective
        _admit(args, kwargs)
        out = original(*args, **kwargs)
        try:
            _name_left_engine_parts(out[0], _checkpoint.engine_class())
            _audit_and_warn(out[0], "after deepspeed.initialize")
        except Exception as e:  # noqa: BLE001 (the engine exists: hand it over, say what failed)
            warnings.warn(f"spillway.deepspeed: the audit after deepspeed.initialize failed: "
                          f"{type(e).__name__}: {e}", AuditWarning, stacklevel=2)
        return out
    initialize.__spillway_original__ = original
    return initialize


def _install_engine_scope():
    import deepspeed  # noqa: PLC0415
    from deepspeed.runtime.engine import DeepSpeedEngine  # noqa: PLC0415

    # The training step's own host scratch (DeepSpeed's temporaries in backward and the optimizer
    # step, and on the CPU accelerator the "device" tensors too) is served from the arena as well:
    # in glibc's heap it would land on pages a forked worker shares and be copied on write.
    for name in ("forward", "backward"):
        _patch(DeepSpeedEngine, name, _tagged(_defined(DeepSpeedEngine, name), "transient", "step"))
    _patch(DeepSpeedEngine, "step", _wrap_step(_tagged(_defined(DeepSpeedEngine, "step"), "transient", "step")))
    _patch(deepspeed, "initialize", _wrap_initialize(_defined(deepspeed, "initialize")))
