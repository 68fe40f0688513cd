"""spillway.guard: device mix-ups named before torch's bare "Expected all tensors to be on the same
device" (docs/deepspeed.md, Note [Device guard]).

    with spillway.guard.devices(model, optimizer):     # a TorchDispatchMode over every aten op
        loss.backward(); optimizer.step()
    spillway.guard.audit(model)                         # refuses a model spread over devices

`devices` raises spillway.DeviceMismatch when one op's tensor arguments live on more than one device.
The error names the op; each tensor's shape, dtype and device; for parameters, buffers, gradients and
optimizer state their qualified names; the Python frame that called the op; and the fix. Like torch,
it lets a 0-dim CPU tensor (a scalar) meet tensors of any device, and copies between devices pass.
Outside the `with` block it costs nothing: no hook stays installed.
"""
import inspect
import os

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from . import _spillway


class DeviceMismatch(_spillway.Error):
    """One op's tensors are on more than one device (a RuntimeError, as torch's own error is)."""


DeviceMismatch.__module__ = "spillway"


# Ops that move data between devices by design.
_CROSS_DEVICE_OPS = frozenset({
    "aten::copy_", "aten::_to_copy", "aten::_copy_from", "aten::_copy_from_and_resize", "aten::to",
    "aten::set_", "aten::lift_fresh", "aten::lift_fresh_copy", "aten::_local_scalar_dense",
    "aten::_has_same_storage_numel", "aten::is_same_size", "aten::_nested_tensor_from_tensor_list",
})

_CROSS_DEVICE_PACKETS = frozenset(getattr(torch.ops.aten, n.split("::")[1]) for n in _CROSS_DEVICE_OPS
                                   if hasattr(torch.ops.aten, n.split("::")[1]))

_INDEX_PACKETS = frozenset(getattr(torch.ops.aten, n) for n in ("index", "index_put", "index_put_", "_index_put_impl_",
                                                                  "_unsafe_index", "_unsafe_index_put")
                           if hasattr(torch.ops.aten, n))

_HERE = os.path.dirname(os.path.abspath(__file__))
_TORCH = os.path.dirname(os.path.abspath(torch.__file__))


# The flat partitions DeepSpeed's ZeRO optimizers keep (stage 3, then stages 1 and 2): named here,
# fingerprinted by spillway.deepspeed's guarded step.
ZERO_FLATS = ("fp32_partitioned_groups_flat", "fp16_partitioned_groups_flat", "single_partition_of_fp32_groups",
              "bit16_groups_flat")


def _describe(t):
    shape = "x".join(str(s) for s in t.shape) if t.dim() else "scalar"
    return f"{str(t.dtype).replace('torch.', '')}[{shape}] on {t.device}"


def _same(a, b):
    """The same tensor, or a view of the same bytes with the same geometry (`p.data`, `p.grad.data`
    and `p.detach()` are other tensor objects over the parameter's storage)."""
    if a is b:
        return True
    if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)):
        return False
    if a._cdata == b._cdata:
        return True
    if a.device != b.device or a.device.type == "meta" or a.shape != b.shape or a.dtype != b.dtype:
        return False
    try:
        return a.data_ptr() == b.data_ptr() and a.stride() == b.stride() and a.data_ptr() != 0
    except RuntimeError:  # a tensor without storage (a functional or sparse tensor)
        return False


def _local(t):
    return t.to_local() if hasattr(t, "to_local") else t


def named_tensors(*objects):
    """(qualified name, tensor) for what `objects` hold: modules (parameters, their .grad, buffers),
    torch optimizers (their state, named after the module's parameter where one of `objects` has
    it), DeepSpeed engines and ZeRO optimizers (the flat fp32 and 16-bit partitions and their
    gradients), and dicts of name -> tensor."""
    def module_of(obj):
        module = obj if isinstance(obj, torch.nn.Module) else getattr(obj, "module", None)
        return module if isinstance(module, torch.nn.Module) else None

    out, param_names = [], {}
    for module in filter(None, map(module_of, objects)):
        for name, p in module.named_parameters():
            param_names[p._cdata] = name
    seen_opts = set()

    def add_optimizer(opt, prefix):
        if id(opt) in seen_opts:
            return
        seen_opts.add(id(opt))
        flats = [(f"{prefix}{attr}[{i}]", t) for attr in ZERO_FLATS
                 for i, t in enumerate(getattr(opt, attr, None) or ()) if isinstance(t, torch.Tensor)]
        for name, t in flats:  # the inner optimizer's parameters are these partitions
            param_names.setdefault(t._cdata, name)
        for gi, group in enumerate(getattr(opt, "param_groups", ()) or ()):
            for pi, p in enumerate(group.get("params", ())):
                if not isinstance(p, torch.Tensor):
                    continue
                name = param_names.get(p._cdata, f"{prefix}param_groups[{gi}].params[{pi}]")
                out.append((name, p))
                if p.grad is not None:
                    out.append((f"{name}.grad", p.grad))
                for key, value in getattr(opt, "state", {}).get(p, {}).items():
                    if isinstance(value, torch.Tensor):
                        out.append((f"{name} optimizer state['{key}']", value))
        for name, t in flats:
            out.append((name, t))
            if t.grad is not None:
                out.append((f"{name}.grad", t.grad))
        inner = getattr(opt, "optimizer", None)
        if inner is not None and hasattr(inner, "param_groups"):
            add_optimizer(inner, f"{prefix}optimizer.")

    for obj in objects:
        if isinstance(obj, dict):
            out.extend((str(k), v) for k, v in obj.items() if isinstance(v, torch.Tensor))
            continue
        module = module_of(obj)
        if module is not None:
            for name, p in module.named_parameters():
                out.append((name, p))
                if p.grad is not None:
                    out.append((f"{name}.grad", p.grad))
                if isinstance(getattr(p, "ds_tensor", None), torch.Tensor):
                    out.append((f"{name}.ds_tensor", p.ds_tensor))
            out.extend((name, b) for name, b in module.named_buffers())
        if hasattr(obj, "param_groups"):
            # A ZeRO optimizer's flat partitions read best with its class: Stage3.fp32_..._flat[0]
            zero = hasattr(obj, "fp32_partitioned_groups_flat") or hasattr(obj, "single_partition_of_fp32_groups")
            add_optimizer(obj, f"{type(obj).__name__}." if zero else "")
        elif hasattr(getattr(obj, "optimizer", None), "param_groups"):  # a DeepSpeed engine
            add_optimizer(obj.optimizer, "optimizer.")
    return out


def _caller():
    """The innermost frame outside torch and this module: where the op was called from."""
    frame = inspect.currentframe()
    while frame is not None:
        path = os.path.abspath(frame.f_code.co_filename)
        if not (path.startswith(_HERE) or path.startswith(_TORCH)):
            info = inspect.getframeinfo(frame, context=1)
            line = info.code_context[0].strip() if info.code_context else ""
            return f'File "{info.filename}", line {info.lineno}, in {info.function}: {line}'
        frame = frame.f_back
    return "(no Python frame outside torch)"


class devices(TorchDispatchMode):  # noqa: N801 (used as a context manager, like torch's modes)
    """Checks every aten op's tensor arguments for mixed devices while active (see the module doc).
    `objects` (modules, optimizers, DeepSpeed engines, dicts of name -> tensor) give the names."""

    def __init__(self, *objects):
        super().__init__()
        self._objects = objects
        self.ops_checked = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        self.ops_checked += 1
        packet = func.overloadpacket
        if packet in _CROSS_DEVICE_PACKETS:
            return func(*args, **kwargs)
        if packet in _INDEX_PACKETS:
            # Indices may live on the CPU whatever the device of the tensor they index (torch
            # moves them): only self and the values must agree.
            groups = [[a for i, a in enumerate(args) if i != 1] + [v for k, v in kwargs.items() if k != "indices"]]
        elif packet.__name__.startswith("_foreach_"):
            # One op over lists: element i of every list (and any tensor outside the lists) must
            # agree; different elements may be on different devices.
            lists = [a for a in (*args, *kwargs.values()) if isinstance(a, (list, tuple))]
            single = [a for a in (*args, *kwargs.values()) if not isinstance(a, (list, tuple))]
            n = max((len(x) for x in lists), default=0)
            groups = [[x[i] for x in lists if i < len(x)] + single for i in range(n)]
        else:
            groups = [[*args, *kwargs.values()]]
        for group in groups:
            seen = None
            # Tensors and lists of tensors, one level deep, are all aten's schemas pass.
            for a in group:
                for t in (a if isinstance(a, (list, tuple)) else (a,)):
                    # A 0-dim CPU tensor meets any device, as torch allows for scalars.
                    if isinstance(t, torch.Tensor) and (t.dim() != 0 or t.device.type != "cpu"):
                        if seen is None:
                            seen = t.device
                        elif t.device != seen:
                            self._raise(func, [x for a2 in group
                                               for x in (a2 if isinstance(a2, (list, tuple)) else (a2,))])
        return func(*args, **kwargs)

    def _raise(self, func, flat):
        names = named_tensors(*self._objects)
        lines, found = [], []
        for i, t in enumerate(x for x in flat if isinstance(x, torch.Tensor)):
            name = next((n for n, v in names if _same(v, t) or _same(_local(v), t)), None)
            found.append(t.device)
            lines.append(f"  tensor {i}: {name or '(a temporary: not a parameter, buffer, gradient or optimizer state)'}"
                         f" {_describe(t)}")
        where = sorted({str(d) for d in found})
        counts = {d: sum(1 for f in found if str(f) == d) for d in where}
        # An in-place op's result stays where `self` is: that is the device to move the rest to.
        inplace = func._schema.name.endswith("_") and found
        majority = str(found[0]) if inplace else max(where, key=lambda d: counts[d])
        raise DeviceMismatch(
            f"{func._schema.name.replace('aten::', 'aten.')} gets tensors on {' and '.join(where)}:\n"
            + "\n".join(lines)
            + f"\n  called from {_caller()}\n"
            f"  fix: put them on one device before the op (.to('{majority}') on the odd one out, or create it "
            f"there); a scalar factor that enters host math belongs on the CPU (a Python float or a 0-dim CPU "
            f"tensor); a model spread over devices by device_map needs spillway.guard.audit(model)")


def _device_key(v):
    """One name per device, for hf_device_map values and parameter devices alike: accelerate writes
    a CUDA device as its index (0), users write "cuda" or "cuda:0", and a parameter there says
    cuda:0. Counting the spellings instead of the devices refused a model on one GPU."""
    if isinstance(v, int) and not isinstance(v, bool):
        try:  # torch >= 2.6 reads an index as the current accelerator's (cuda, xpu, ...)
            return str(torch.device(v))
        except (RuntimeError, TypeError):
            return f"cuda:{v}"  # no accelerator here: accelerate's indices are CUDA's then
    s = str(v)
    try:
        d = torch.device(s)
    except (RuntimeError, TypeError, ValueError):
        return s  # "disk", or a name torch does not know: as written
    if d.type in ("cpu", "meta"):
        return d.type
    if d.index is None:  # the current device; asking torch for it must not initialise CUDA
        current = torch.cuda.current_device() if d.type == "cuda" and torch.cuda.is_initialized() else 0
        return f"{d.type}:{current}"
    return str(d)


def audit(model, parameters=True):
    """Refuses a model spread over devices (seed 003: device_map='auto' and then training it): by
    its `hf_device_map`, and (with `parameters`) by where its parameters are. Raises DeviceMismatch
    naming the layers on each device and the fix; returns the device otherwise."""
    by_device = {}
    for name, p in model.named_parameters():
        by_device.setdefault(str(p.device), []).append(name)
    hf_map = getattr(model, "hf_device_map", None)
    mapped = sorted({str(v) for v in hf_map.values()}) if isinstance(hf_map, dict) else []
    map_devices = {_device_key(v) for v in hf_map.values()} if isinstance(hf_map, dict) else set()
    param_devices = {_device_key(d) for d in by_device}
    # Refused when the map spans devices, or the parameters do: a stale one-device map on a model
    # moved whole to another device is still one device.
    spread_map, spread_params = len(map_devices) > 1, parameters and len(param_devices) > 1
    if not (spread_map or spread_params):
        return next(iter(by_device), None) if len(by_device) <= 1 else None
    devices = (map_devices if spread_map else set()) | (param_devices if spread_params else set())
    parts = []
    if spread_map:
        for d in mapped:
            layers = [k for k, v in hf_map.items() if str(v) == d]
            parts.append(f"  device_map {d}: {', '.join(layers[:6])}{f' and {len(layers) - 6} more' if len(layers) > 6 else ''}")
    for d, params in sorted(by_device.items()):
        layers = sorted({n.rsplit('.', 1)[0] for n in params})
        parts.append(f"  {d}: {len(params)} parameters in {', '.join(layers[:6])}"
                     f"{f' and {len(layers) - 6} more layers' if len(layers) > 6 else ''}")
    raise DeviceMismatch(
        f"{type(model).__name__} is spread over {len(devices)} devices "
        f"({'hf_device_map from device_map=...' if spread_map else 'its parameters'}):\n"
        + "\n".join(parts)
        + "\n  fix: load the model without device_map (from_pretrained(..., device_map=None), or on one "
        "device) and let ZeRO-3 or FSDP place it; device_map='auto' is for inference")
