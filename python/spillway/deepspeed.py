"""Spillway under DeepSpeed. One line in a training script, before the model is built and before
deepspeed.initialize:

    import spillway; spillway.deepspeed.install()

What it does (docs/deepspeed.md):
- torch's CPU and pinned allocators become Spillway's (spillway.install()), and DeepSpeed's host
  allocation sites (ZeRO-1, 2 and 3) run inside spillway.tag() scopes, so the 16-bit parameter
  partitions, the fp32 master partitions, the gradient partitions and the Adam moments are exact-size, MADV_DONTFORK
  (a re-forked DataLoader worker copies none of them), budgeted, ledgered by kind and in metrics;
- `engine.step()` marks a step boundary at each gradient-accumulation boundary;
- after deepspeed.initialize and after the first optimizer step, an audit walks DeepSpeed's
  offloaded tensors and reports by name each one whose memory is not Spillway's;
- DeepSpeed's async I/O op becomes Spillway's aio_handle (io_uring), so NVMe swapping runs on it,
  and ZeRO-Infinity's swapped tensors live in Spillway's NVMe arena instead of a file each
  (`nvme_swap="arena"`, the default: one O_TMPFILE swap file per nvme_path, CRC-checked on every
  read, budgeted; _deepspeed_swap.py, Note [DeepSpeed swap] in docs/deepspeed.md);
- the host optimizer step runs on Spillway's fused pass (`step=True`, the default): in ZeRO-3, per
  sub-group, the unscale and clip, DeepSpeedCPUAdam's update and the fp32 to 16-bit copy become one
  pass over the data; in ZeRO-1/2 with offload_optimizer, per parameter group, the unscale and clip
  and the update (Note [DeepSpeed step] in docs/deepspeed.md).
- the device guard (`guard=True`, the default) checks the ops of the ZeRO optimizer's step (stage
  1, 2 or 3) for tensors on mixed devices and names them (spillway.DeviceMismatch): every op of the
  first two steps and of any step whose partitions, gradients or optimizer state changed device,
  and torch's own device error from any other step is a DeviceMismatch too; `guard="always"`
  checks every op of every step. deepspeed.initialize refuses a model spread over devices
  (spillway.guard.audit; Note [Device guard] in docs/deepspeed.md).
- DeepSpeed's own engine.save_checkpoint / load_checkpoint (`checkpoints=True`, the default), in
  DeepSpeed's format: each file written durably under a temporary name with its CRC32C in a
  manifest, `latest` replaced atomically once every rank committed; a load checks the manifest
  before it changes anything, maps the files instead of reading them into memory, and copies the
  Adam moments into the arena's (_deepspeed_checkpoint.py, Note [DeepSpeed checkpoints]).

`uninstall()` restores DeepSpeed's op and its functions; torch's allocators stay Spillway's for the
rest of the process (memory they handed out must keep freeing through them).

This module is the install: the allocation sites, the aio op, the step boundary and the guard's
wrappers. The fused step is in _deepspeed_step.py, the audit in _deepspeed_audit.py and
save_16bit_model in _deepspeed_save.py; audit, offloaded_tensors, AuditWarning, StepWarning and
save_16bit_model are spillway.deepspeed's names for them. What this module and those parts share
(_patch and the record of patched functions uninstall() restores, DeepSpeed's version) is in
_deepspeed_common.py, which they all import.
"""
import functools
import inspect
import json
import math
import os
import types
import warnings

import torch

from . import _deepspeed_checkpoint, _deepspeed_save, _deepspeed_swap, _spillway, _torch_allocators
from . import guard as _guard
from . import node as _node
from ._deepspeed_audit import AuditWarning, _audit_and_warn, audit, offloaded_tensors  # noqa: F401
from ._deepspeed_audit import _name_left_engine_parts, _name_left_settings
from ._deepspeed_common import _deepspeed_version, _defined, _Missing, _patch, _patched, _unpatch_to
from ._deepspeed_save import SaveWarning, save_16bit_model  # noqa: F401
from ._deepspeed_step import StepWarning, _install_step, _why_not_ours  # noqa: F401

# Named where users import them from (help(), reprs, pickles), not by the private files.
for _public in (AuditWarning, audit, offloaded_tensors, save_16bit_model, SaveWarning, StepWarning):
    _public.__module__ = __name__
del _public

# The DeepSpeed releases whose runs are tested: 0.19.8 by CI (tests/python), the others by
# scripts/check-deepspeed (docs/deepspeed.md, "Versions"; on the CPU accelerator).
TESTED_DEEPSPEED = ("0.17.6", "0.18.9", "0.19.0", "0.19.8")

_ZERO12 = "deepspeed.runtime.zero.stage_1_and_2"

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

_NODE_HINT = (
    "zero_optimization.offload_optimizer.device: nvme and offload_param.device: nvme, a smaller "
    "zero_optimization.reduce_bucket_size or sub_group_size, fewer ranks per node, or a larger node "
    "budget (SPILLWAY_NODE_BUDGET_BYTES, SPILLWAY_NODE_RESERVE_BYTES) where the node has the memory.")

_saved = None       # (AsyncIOBuilder, load, is_compatible) while installed
_swap_to_arena = False  # install(nvme_swap="arena"): DeepSpeed's swap files in Spillway's NVMe arena
# _patched, in _deepspeed_common: (owner, name, original) for each function wrapped
_missing = []       # sites this DeepSpeed lacks
_left = []          # the parts of install() left to DeepSpeed: "<part> (<why>)"
_parts = {}         # the parts of install() in force: name -> [(owner, function name), ...] patched


def _part(name, install_part, *args, needs=None):
    """Applies one part of install() (a group of DeepSpeed functions patched together) whole, or
    none of it: where this DeepSpeed lacks one of its functions or modules (a release moved or
    renamed it: _Missing from _defined, or an ImportError of a deepspeed module), the part's
    patches are undone, it stays DeepSpeed's, and install()'s one warning names it and why. Any
    other exception is Spillway's own bug and propagates. A part that `needs` another is left when
    that one was. Returns what `install_part` returned (True for None), or None when it was left;
    a part that returns False (it declined, and said why) is not in force either."""
    if needs is not None and needs not in _parts:
        _left.append(f"{name} (it needs {needs})")
        return None
    mark = len(_patched)
    try:
        result = install_part(*args)
    except (_Missing, ImportError) as e:
        if isinstance(e, ImportError) and not (e.name or "").startswith("deepspeed"):
            raise
        _unpatch_to(mark)
        _left.append(f"{name} ({e})")
        return None
    if result is not False:
        _parts[name] = [(owner, fn) for owner, fn, _ in _patched[mark:]]
    return True if result is None else result


def _aio_handle(*args, arena=None, **kwargs):
    """DeepSpeed's `aio_handle(block_size, queue_depth, single_submit, overlap_events,
    intra_op_parallelism)`: Spillway's, with its locked buffers (new_cpu_locked_tensor, DeepSpeed's
    NVMe swap buffers) in the pinned arena spillway.install() made, so they count against its budget,
    in its ledger and in what spillway.metrics.serve() watches. Without install(), or in a process
    forked after it, the process's default arena."""
    if arena is None:
        runtime = _torch_allocators.installed()
        # In a process forked after install() the runtime's arenas are the parent's: a handle the
        # child makes draws on a default arena of the child's own instead.
        if runtime is not None and not _spillway._forked_after_install():
            arena = runtime.pinned
    handle = _spillway.aio_handle(*args, arena=arena, **kwargs)
    # DeepSpeed's swap files go to Spillway's NVMe arena (install(nvme_swap="arena"), the default).
    return _deepspeed_swap.Handle(handle) if _swap_to_arena else handle


def _aio_transfer(write, buffer, filename, block_size, queue_depth, single_submit, overlap_events, validate):
    """DeepSpeed's one-shot `aio_read` / `aio_write` (ds_nvme_tune's aio_basic engine): the whole
    tensor to or from the file, through a handle made for the call (as DeepSpeed makes an aio
    context per call). Returns 0. Where DeepSpeed returns -1 or asserts (a file that cannot be
    opened, a read whose buffer is not the file's size), these raise, naming the file."""
    what = f"spillway aio_{'write' if write else 'read'}({filename!r})"
    if not isinstance(buffer, torch.Tensor) or buffer.device.type != "cpu" or not buffer.is_contiguous():
        raise _spillway.InvalidArgument(f"{what}: the buffer must be a contiguous CPU tensor")
    if not write:
        size = os.path.getsize(filename)  # FileNotFoundError names the file
        if size != buffer.nbytes:
            raise _spillway.InvalidArgument(
                f"{what}: the file holds {size} bytes and the buffer {buffer.nbytes}; DeepSpeed's aio_read "
                "reads a whole file into a buffer of its size")
    h = _aio_handle(block_size, queue_depth, single_submit, overlap_events, 1)
    done = h.sync_pwrite(buffer, filename) if write else h.sync_pread(buffer, filename)
    if done != 1:
        raise _spillway.IoError(f"{what}: the transfer completed {done} of 1 requests")
    if validate:
        with open(filename, "rb") as f:
            on_disk = f.read()
        if on_disk != buffer.view(torch.uint8).numpy().tobytes():
            raise _spillway.ChecksumMismatch(f"{what}: validation failed: the file's bytes are not the buffer's")
    return 0


def _memcpy(dest, src):
    """DeepSpeed's `deepspeed_memcpy(dest, src)`: the bytes of `src` into `dest`. DeepSpeed's copies
    dest.size(0) floats whatever the dtypes; this one copies bytes and refuses tensors whose sizes
    differ or that are not contiguous CPU tensors (DeepSpeed's would read or write past them).
    Returns 0."""
    for name, t in (("dest", dest), ("src", src)):
        if not isinstance(t, torch.Tensor) or t.device.type != "cpu" or not t.is_contiguous():
            raise _spillway.InvalidArgument(f"spillway deepspeed_memcpy: {name} must be a contiguous CPU tensor")
    if dest.nbytes != src.nbytes:
        raise _spillway.InvalidArgument(
            f"spillway deepspeed_memcpy: dest holds {dest.nbytes} bytes and src {src.nbytes}; they must match")
    dest.view(-1).view(torch.uint8).copy_(src.view(-1).view(torch.uint8))
    return 0


def _op():
    return types.SimpleNamespace(
        aio_handle=_aio_handle, __name__="spillway_async_io",
        aio_read=functools.partial(_aio_transfer, False), aio_write=functools.partial(_aio_transfer, True),
        deepspeed_memcpy=_memcpy)


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


def _ds_config(args, kwargs):
    config = kwargs.get("config", kwargs.get("config_params"))
    if config is None:
        ds_args = kwargs.get("args", args[0] if args else None)
        config = getattr(ds_args, "deepspeed_config", None)
    if isinstance(config, (str, os.PathLike)):
        with open(config) as f:
            config = json.load(f)
    return config


def _plannable_json(config):
    """The DeepSpeed config as strict JSON for the planner. Clients put Python values in it that
    json.dumps writes as no JSON parser reads them: Accelerate sets steps_per_print to float('inf')
    (written "Infinity"). Non-finite numbers become null; the planner reads none of those keys."""
    def finite(v):
        if isinstance(v, float) and not math.isfinite(v):
            return None
        if isinstance(v, dict):
            return {k: finite(x) for k, x in v.items()}
        if isinstance(v, (list, tuple)):
            return [finite(x) for x in v]
        return v

    return json.dumps(finite(config), allow_nan=False)


def _learn_job(original, args, kwargs):
    """Before admission: makes the process group as deepspeed.initialize would a few lines later
    (same backend, port and dist_init_required), so that a rank no launcher described learns its
    job and local rank from the group (spillway.node.learn_job; every rank does this, so it is
    collective like initialize itself). Where that fails, initialize meets the same error itself."""
    from deepspeed import comm as ds_comm  # noqa: PLC0415
    from deepspeed.accelerator import get_accelerator  # noqa: PLC0415

    signature = inspect.signature(original)
    params = signature.parameters
    try:
        bound = signature.bind_partial(*args, **kwargs).arguments
    except TypeError:
        return  # initialize raises it again, with DeepSpeed's words
    if "distributed_port" not in params or "dist_init_required" not in params:
        warnings.warn("spillway.deepspeed: this DeepSpeed's initialize takes no distributed_port or "
                      "dist_init_required, so a rank no launcher described does not learn its job before "
                      "admission here (spillway.node.learn_job() after init_process_group does)",
                      AuditWarning, stacklevel=3)
        return
    try:
        ds_comm.init_distributed(dist_backend=get_accelerator().communication_backend_name(),
                                 distributed_port=bound.get("distributed_port", params["distributed_port"].default),
                                 dist_init_required=bound.get("dist_init_required"))
    except Exception:  # noqa: BLE001 (initialize makes the same call a few lines later and raises it there)
        return
    _node.learn_job()


def _admit(args, kwargs):
    """Node admission (spillway.node.admit) at deepspeed.initialize, before DeepSpeed allocates the
    offloaded state: this rank's host need comes from the planner (offload/planner.h) for the
    model's parameter count and the DeepSpeed config. Every rank of the node fails here with one
    message when their needs together pass the node budget."""
    if not _node.joined() or os.environ.get("SPILLWAY_NODE_ADMIT", "1") == "0":
        return
    ledger = _node.stats()
    if not ledger["local_world_size"]:
        warnings.warn("spillway.deepspeed: node admission skipped: the number of local ranks is not "
                      "known (set LOCAL_WORLD_SIZE, or start the ranks with torchrun, accelerate or "
                      "the deepspeed launcher)", AuditWarning, stacklevel=3)
        return
    model = kwargs.get("model", args[1] if len(args) > 1 else None)
    try:
        config = _ds_config(args, kwargs)
    except (OSError, ValueError) as e:  # hjson, base64: DeepSpeed reads it next and names what is wrong
        warnings.warn(f"spillway.deepspeed: node admission skipped: the DeepSpeed config cannot be read as "
                      f"JSON for the planner: {e}", AuditWarning, stacklevel=3)
        return
    if not isinstance(model, torch.nn.Module) or not isinstance(config, dict):
        warnings.warn("spillway.deepspeed: node admission skipped: deepspeed.initialize got no model "
                      "or no config dict to plan from", AuditWarning, stacklevel=3)
        return
    from deepspeed.accelerator import get_accelerator  # noqa: PLC0415

    tensors = list(model.parameters())
    numels = [getattr(p, "ds_numel", 0) or p.numel() for p in tensors]
    params = sum(numels)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    try:
        config_json = _plannable_json(config)
    except (TypeError, ValueError) as e:  # a value json cannot write (a client's object in the config)
        warnings.warn(f"spillway.deepspeed: node admission skipped: the DeepSpeed config cannot be written as "
                      f"JSON for the planner: {e}", AuditWarning, stacklevel=3)
        return
    # The room this job has: the budget less what the other jobs under the memory limit hold or
    # declared (admission counts them too), so the planner's suggestions are for what is left.
    others = sum(max(j["host_bytes"], j["declared_bytes"]) for j in ledger["jobs"] if j["name"] != ledger["job"])
    room = max(ledger["host_budget_bytes"] - others, 1 << 20)
    try:
        plan = _spillway._plan_deepspeed(float(params), world, max(world // ledger["local_world_size"], 1),
                                         room, config_json,
                                         get_accelerator().device_name() == "cpu",
                                         _node.anon_shared_bytes(), max(numels, default=0),
                                         any(hasattr(p, "ds_numel") for p in tensors))
    except _spillway.Error as e:
        warnings.warn(f"spillway.deepspeed: node admission skipped: the planner cannot read this run: {e}",
                      AuditWarning, stacklevel=3)
        return
    _node._planned["phases"] = plan["phases"]
    hint = "; ".join(plan["suggestions"])
    _node.admit(plan["host_per_rank"] + plan["fork_copy_per_rank"], plan["fork_copy_per_rank"],
               detail=f"Settings that would make it fit: {hint + '; ' if hint else ''}{_NODE_HINT}")


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
            _name_left_engine_parts(out[0], _deepspeed_checkpoint.engine_class())
            _audit_and_warn(out[0], "after deepspeed.initialize")
        except Exception as e:  # noqa: BLE001 (the engine exists: hand it over, say what failed)
            warnings.warn(f"spillway.deepspeed: the audit after deepspeed.initialize failed: "
                          f"{type(e).__name__}: {e}", AuditWarning, stacklevel=2)
        return out
    initialize.__spillway_original__ = original
    return initialize


def swap_stats():
    """{nvme_path: stats} of the NVMe arenas that hold DeepSpeed's swap files in this process
    (install(nvme_swap="arena")): arena (the name spillway.metrics.serve() labels it with), files,
    live_bytes and live_by_kind, capacity_bytes, budget_bytes, written_bytes, read_bytes,
    checksum_failures."""
    return _deepspeed_swap.stats()


def install(budget_bytes=None, pinned_budget_bytes=None, allocators=True, step=True, guard=True,
            nvme_swap="arena", checkpoints=True):
    """Puts DeepSpeed's host side on Spillway (see the module's doc). Call it once, before the model
    is built. `allocators=False` leaves torch's allocators alone (no spillway.install(); the aio op's
    buffers then come from the default arena); the aio op, the step and the guard are still installed
    unless `step=False` / `guard=False`. `nvme_swap="arena"` (the default) keeps ZeRO-Infinity's
    swapped tensors in Spillway's NVMe arena (Note [DeepSpeed swap] in docs/deepspeed.md);
    `nvme_swap="files"` leaves them in DeepSpeed's files, one per tensor. `step=False` keeps
    DeepSpeed's own optimizer step (bit-for-bit DeepSpeed arithmetic). `guard=False` leaves the
    optimizer step and deepspeed.initialize unchecked; `guard="always"` checks every op of every
    step (the default, True, every op of the first steps and of steps whose tensors moved).
    `checkpoints=False` leaves DeepSpeed's save_checkpoint / load_checkpoint as they are.
    `engine.optimizer.spillway_guard` (True, "always" or False) sets it per optimizer.

    Raises FailedPrecondition when already installed. A DeepSpeed outside TESTED_DEEPSPEED, one
    missing an allocation site, or one that lacks a function or module a part of install() patches
    (a release moved or renamed it: that part stays DeepSpeed's, whole) gets one warning that names
    the version, each part left and why, and what still works."""
    import deepspeed  # noqa: F401, PLC0415 (deepspeed is optional: without it, ImportError here)

    global _saved, _swap_to_arena, _guard_default
    _check_guard_mode(guard, "spillway.deepspeed.install(guard={mode!r})")
    if nvme_swap not in ("arena", "files"):
        raise _spillway.InvalidArgument(f"spillway.deepspeed.install(nvme_swap={nvme_swap!r}): 'arena' (DeepSpeed's "
                                        "swap files in Spillway's NVMe arena) or 'files' (DeepSpeed's own files)")
    if _saved is not None:
        raise _spillway.FailedPrecondition(
            "spillway.deepspeed.install() was already called; call it once per process (uninstall() "
            "first to install again)")
    if allocators:
        if _torch_allocators.installed() is None:
            _torch_allocators.install(budget_bytes=budget_bytes, pinned_budget_bytes=pinned_budget_bytes)
        elif budget_bytes is not None or pinned_budget_bytes is not None:
            raise _spillway.FailedPrecondition(
                "spillway.deepspeed.install(budget_bytes=...) after spillway.install(): the arenas and "
                "their budgets already exist; pass the budgets to spillway.install() instead")
    if os.environ.get("DS_PIN_MEMORY_BACKEND", "torch").strip().lower() == "native":
        warnings.warn(
            "spillway.deepspeed: DS_PIN_MEMORY_BACKEND=native: DeepSpeed pins its offload buffers with its own "
            "page-locked allocator (deepspeed.utils.pin_memory: posix_memalign and mlock), outside Spillway's "
            "pinned arena, so those bytes are not budgeted, not MADV_DONTFORK (a forked DataLoader worker copies "
            "what it touches), and not in the ledger or metrics; the audit names each one. Unset "
            "DS_PIN_MEMORY_BACKEND (DeepSpeed's torch backend pins through torch, which is Spillway's)",
            AuditWarning, stacklevel=2)
    _left.clear()
    _parts.clear()
    _missing.clear()
    op = "Spillway's aio op"
    _saved = _part(op, _install_op) or (None, None, None)
    _swap_to_arena = nvme_swap == "arena" and _part(
        "ZeRO-Infinity's swap files in Spillway's NVMe arena", _deepspeed_swap.install, _patch, needs=op) is not None
    if step:
        _part("the fused optimizer step", _install_step)
    if checkpoints:
        _part("Spillway's checkpoint engine", _deepspeed_checkpoint.install, _patch)
        _part("the streamed save_16bit_model", _deepspeed_save.install, _patch)
    _guard_default = guard
    if guard:
        _part("the device guard at deepspeed.initialize and the optimizer step", _install_guard)
    if allocators:
        _tag_sites()
        _part("the step's scratch in the arena, node admission and the audit at deepspeed.initialize",
              _install_engine_scope)
    version = _deepspeed_version()
    if version in TESTED_DEEPSPEED and not _missing and not _left:
        return
    kept = (["torch's CPU and pinned allocators are Spillway's, every allocation site found is tagged"]
            if allocators else []) + list(_parts)
    warnings.warn(
        f"spillway.deepspeed: DeepSpeed {version} is "
        f"{'outside the tested range ' + ', '.join(TESTED_DEEPSPEED) if version not in TESTED_DEEPSPEED else 'tested'}"
        f"{'; these allocation sites are missing: ' + '; '.join(_missing) if _missing else ''}"
        f"{'; left to DeepSpeed, as this release lacks what they patch: ' + '; '.join(_left) if _left else ''}. "
        f"Still in force: {'; '.join(kept) or 'nothing of install()'} (the fused step only where this "
        f"DeepSpeed's step functions are ones it was verified against: a StepWarning names any that is not)",
        AuditWarning, stacklevel=2)


def _install_op():
    from deepspeed.ops.op_builder import AsyncIOBuilder  # noqa: PLC0415

    saved = (AsyncIOBuilder, AsyncIOBuilder.__dict__.get("load"), AsyncIOBuilder.__dict__.get("is_compatible"))
    AsyncIOBuilder.load = lambda self, verbose=True: _op()
    AsyncIOBuilder.is_compatible = lambda self, verbose=False: True
    return saved


def _install_guard():
    import deepspeed  # noqa: PLC0415
    from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3 as Stage3  # noqa: PLC0415
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer as Zero12  # noqa: PLC0415

    _patch(Stage3, "step", _guarded_step(_defined(Stage3, "step")))
    _patch(Zero12, "step", _guarded_step(_defined(Zero12, "step")))
    _patch(deepspeed, "initialize", _audited_initialize(_defined(deepspeed, "initialize")))


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


def uninstall():
    """Restores DeepSpeed's own aio op and functions. torch's allocators stay Spillway's."""
    global _saved, _swap_to_arena, _guard_default
    _swap_to_arena = False
    _guard_default = True
    while _patched:
        owner, name, original = _patched.pop()
        setattr(owner, name, original)
    if _saved is None:
        return
    cls, load, compat = _saved
    _saved = None
    _parts.clear()
    if cls is None:  # the aio op was left to DeepSpeed
        return
    for name, orig in (("load", load), ("is_compatible", compat)):
        if orig is None:
            delattr(cls, name)
        else:
            setattr(cls, name, orig)


def installed():
    return _saved is not None

