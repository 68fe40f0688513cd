"""spillway.deepspeed's allocation sites: the DeepSpeed functions (ZeRO-1, 2 and 3) that allocate
host state run inside a spillway.tag() scope of the kind they allocate, so that state is exact-size,
MADV_DONTFORK, budgeted and ledgered by kind. Private: install() tags them (_tag_sites); the step
boundary's scopes reuse _tagged.
"""
import functools

import torch

from .. import _spillway, _torch_allocators
from ._common import _defined, _patch

_ZERO12 = "deepspeed.runtime.zero.stage_1_and_2"

# (module, class or None, function, kind): the DeepSpeed functions that allocate host state, and
# what they allocate. Read from DeepSpeed 0.19.8 (docs/deepspeed.md has the table with line refs).
_SITES = (
    ("deepspeed.runtime.zero.partition_parameters", "Init", "_partition_param", "param"),
    ("deepspeed.runtime.zero.stage3", "DeepSpeedZeroOptimizer_Stage3",
     "_create_param_groups_fp16_flat_cpu_memory", "param"),
    # Without offload_param the 16-bit partitions move into one flat buffer on the device: host
    # memory on the CPU accelerator (on a GPU the scope sees no host allocation of it).
    ("deepspeed.runtime.zero.stage3", "DeepSpeedZeroOptimizer_Stage3",
     "_create_fp16_partitions_with_defragmentation", "param"),
    ("deepspeed.runtime.zero.stage3", "DeepSpeedZeroOptimizer_Stage3", "_setup_for_real_optimizer", "grad"),
    ("deepspeed.runtime.zero.stage3", "DeepSpeedZeroOptimizer_Stage3", "_create_fp32_partitions",
     "master_weight"),
    ("deepspeed.runtime.zero.stage3", "DeepSpeedZeroOptimizer_Stage3", "initialize_optimizer_states", "grad"),
    # The Adam moments are made lazily by the inner optimizer at the first step.
    ("deepspeed.runtime.zero.stage3", "DeepSpeedZeroOptimizer_Stage3", "_optimizer_step", "optimizer_state"),
    # ZeRO-1 and 2. The constructor makes the fp32 master partitions and, inline with no method of
    # their own, the 16-bit staging buffers (moved to their kinds after it: _zero12_init); the flat
    # 16-bit groups it flattens are parameters; the fp32 gradient partitions are made by
    # initialize_optimizer_states, the per-parameter accumulation buffers (gradient accumulation
    # with offload) during backward, the moments at the first step.
    (_ZERO12, "DeepSpeedZeroOptimizer", "__init__", "master_weight"),
    (_ZERO12, "DeepSpeedZeroOptimizer", "flatten_dense_tensors_aligned", "param"),
    (_ZERO12, "DeepSpeedZeroOptimizer", "initialize_optimizer_states", "grad"),
    (_ZERO12, "DeepSpeedZeroOptimizer", "async_accumulate_grad_in_cpu_via_gpu", "grad"),
    (_ZERO12, "DeepSpeedZeroOptimizer", "_optimizer_step", "optimizer_state"),
)

_OVER_BUDGET_HINT = (
    " DeepSpeed settings that shrink the host state: zero_optimization.offload_optimizer.device: nvme "
    "(fp32 master and moments on NVMe), zero_optimization.offload_param.device: nvme, a smaller "
    "zero_optimization.sub_group_size or reduce_bucket_size; or give Spillway more with "
    "spillway.deepspeed.install(budget_bytes=...).")

_missing = []       # sites this DeepSpeed lacks


def _tagged(fn, kind, lifetime="persistent"):
    @functools.wraps(fn)
    def wrapped(*args, **kwargs):
        try:
            with _torch_allocators.tag(kind, lifetime):
                return fn(*args, **kwargs)
        except _spillway.OverBudget as e:
            if _OVER_BUDGET_HINT in str(e):
                raise
            raise _spillway.OverBudget(f"{e} (in DeepSpeed's {fn.__qualname__}, {kind}).{_OVER_BUDGET_HINT}") from e
    wrapped.__spillway_original__ = fn
    return wrapped


def _zero12_init(original):
    """DeepSpeedZeroOptimizer.__init__ (ZeRO-1/2) inside a master_weight scope. The flat 16-bit
    groups it flattens meanwhile are tagged param (_while_initializing), and the two staging
    buffers it makes inline, where no method could be tagged, are then remade in their own kinds:
    the 16-bit copy of each master partition (param) and the gradient staging buffer (grad)."""
    tagged = _tagged(original, "master_weight")

    @functools.wraps(original)
    def __init__(self, *args, **kwargs):
        self.__dict__["_spillway_initializing"] = True
        try:
            tagged(self, *args, **kwargs)
        finally:
            self.__dict__.pop("_spillway_initializing", None)
        _retag_zero12_buffers(self)
    __init__.__spillway_original__ = original
    return __init__


def _while_initializing(fn, kind):
    """`fn` tagged `kind` while its ZeRO-1/2 optimizer's constructor runs, untagged after it (step()
    flattens gradients with it too)."""
    tagged = _tagged(fn, kind)

    @functools.wraps(fn)
    def wrapped(self, *args, **kwargs):
        if self.__dict__.get("_spillway_initializing"):
            return tagged(self, *args, **kwargs)
        return fn(self, *args, **kwargs)
    wrapped.__spillway_original__ = fn
    return wrapped


def _retag_zero12_buffers(opt):
    from deepspeed.accelerator import get_accelerator  # noqa: PLC0415

    if not getattr(opt, "cpu_offload", False):
        return
    pin = getattr(opt, "cpu_offload_pin_memory", False)

    def remade(t, kind):
        if not isinstance(t, torch.Tensor) or t.device.type != "cpu" or t.numel() == 0:
            return t
        with _torch_allocators.tag(kind):
            new = torch.empty_like(t)
            if pin:
                new = get_accelerator().pin_memory(new)
        return new.copy_(t)

    buffers = getattr(opt, "param_buffer_of_bit16_for_cpu_offload_groups", None) or []
    for i, b in enumerate(buffers):
        buffers[i] = remade(b, "param")
    if getattr(opt, "temp_grad_buffer_for_cpu_offload", None) is not None:
        opt.temp_grad_buffer_for_cpu_offload = remade(opt.temp_grad_buffer_for_cpu_offload, "grad")


def _tag_sites():
    """Every allocation site this DeepSpeed has runs inside its spillway.tag; the ones it lacks are
    named in install()'s warning."""
    import importlib  # noqa: PLC0415

    _missing.clear()
    for module_name, cls_name, fn_name, kind in _SITES:
        try:
            owner = importlib.import_module(module_name)
            if cls_name is not None:
                owner = getattr(owner, cls_name)
            fn = _defined(owner, fn_name)
        except (ImportError, AttributeError):
            _missing.append(f"{module_name}.{cls_name + '.' if cls_name else ''}{fn_name} ({kind})")
            continue
        if (module_name, fn_name) == (_ZERO12, "__init__"):
            _patch(owner, fn_name, _zero12_init(fn))
        elif (module_name, fn_name) == (_ZERO12, "flatten_dense_tensors_aligned"):
            _patch(owner, fn_name, _while_initializing(fn, kind))
        else:
            _patch(owner, fn_name, _tagged(fn, kind))
