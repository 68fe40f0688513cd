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
  read, budgeted; deepspeed/_swap.py, Note [DeepSpeed swap] in docs/deepspeed.md);
- the host optimizer step runs on Spillway's fused pass (`step=True`, the default): in ZeRO-3, per
  sub-group, the unscale and clip, DeepSpeedCPUAdam's update and the fp32 to 16-bit copy become one
  pass over the data; in ZeRO-1/2 with offload_optimizer, per parameter group, the unscale and clip,
  the update and the 16-bit copy step() makes of it (Note [DeepSpeed step] in docs/deepspeed.md).
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
  Adam moments into the arena's (deepspeed/_checkpoint.py, Note [DeepSpeed checkpoints]).

`uninstall()` restores DeepSpeed's op and its functions; torch's allocators stay Spillway's for the
rest of the process (memory they handed out must keep freeing through them).

This file is install(), uninstall() and the public names; each concern is a private module of
the package: _sites (the allocation sites' tags), _aio (the aio op), _swap (the swap files in the
NVMe arena), _step (the fused step), _device_guard (the guard's wrappers), _boundary (the step
boundary and the hook at deepspeed.initialize), _admission (node admission), _audit (the audit and
the warnings about what stays DeepSpeed's), _checkpoint (save_checkpoint / load_checkpoint) and
_save (save_16bit_model). audit, offloaded_tensors, AuditWarning, StepWarning, SaveWarning and
save_16bit_model are spillway.deepspeed's names for theirs. What they share (_patch and the record
of patched functions uninstall() restores, DeepSpeed's version) is in _common, which imports none
of them.
"""
import os
import warnings

from .. import _spillway, _torch_allocators
from . import _aio, _checkpoint, _device_guard, _save, _sites, _swap
from ._aio import _aio_handle  # noqa: F401 (the tests compare DeepSpeed's loaded op with it)
from ._audit import AuditWarning, _name_left_engine_parts, audit, offloaded_tensors  # noqa: F401
from ._boundary import _install_engine_scope, _warn_left  # noqa: F401
from ._common import _deepspeed_version, _Missing, _patch, _patched, _unpatch_to
from ._save import SaveWarning, save_16bit_model  # noqa: F401
from ._sites import _SITES  # noqa: F401
from ._step import StepWarning, _install_step, _why_not_ours  # noqa: F401
from ._verified import TESTED_DEEPSPEED  # the releases of the verified bodies (_verified.py)

# Named where users import them from (help(), reprs, pickles), not by the private files.
for _public in (AuditWarning, audit, offloaded_tensors, save_16bit_model, SaveWarning, StepWarning):
    _public.__module__ = __name__
del _public

_saved = None       # (AsyncIOBuilder, load, is_compatible) while installed
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


def swap_stats():
    """{nvme_path: stats} of the NVMe arenas that hold DeepSpeed's swap files in this process
    (install(nvme_swap="arena")): arena (the name spillway.metrics.serve() labels it with), files,
    live_bytes and live_by_kind, capacity_bytes, budget_bytes, written_bytes, read_bytes,
    checksum_failures."""
    return _swap.stats()


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

    global _saved
    _check_arguments(budget_bytes, pinned_budget_bytes, allocators, guard, nvme_swap)
    if allocators and _torch_allocators.installed() is None:
        _torch_allocators.install(budget_bytes=budget_bytes, pinned_budget_bytes=pinned_budget_bytes)
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
    _sites._missing.clear()
    op = "Spillway's aio op"
    _saved = _part(op, _aio._install_op) or (None, None, None)
    _aio._swap_to_arena = nvme_swap == "arena" and _part(
        "ZeRO-Infinity's swap files in Spillway's NVMe arena", _swap.install, _patch, needs=op) is not None
    if step:
        _part("the fused optimizer step", _install_step)
    if checkpoints:
        _part("Spillway's checkpoint engine", _checkpoint.install, _patch)
        _part("the streamed save_16bit_model", _save.install, _patch)
    _device_guard._guard_default = guard
    if guard:
        _part("the device guard at deepspeed.initialize and the optimizer step", _device_guard._install_guard)
    if allocators:
        _sites._tag_sites()
        _part("the step's scratch in the arena, node admission and the audit at deepspeed.initialize",
              _install_engine_scope)
    said = _what_is_left(allocators)
    if said:
        warnings.warn(said, AuditWarning, stacklevel=2)


def _check_arguments(budget_bytes, pinned_budget_bytes, allocators, guard, nvme_swap):
    """install()'s refusals, before it changes anything."""
    _device_guard._check_guard_mode(guard, "spillway.deepspeed.install(guard={mode!r})")
    if nvme_swap not in ("arena", "files"):
        raise _spillway.InvalidArgument(f"spillway.deepspeed.install(nvme_swap={nvme_swap!r}): 'arena' (DeepSpeed's "
                                        "swap files in Spillway's NVMe arena) or 'files' (DeepSpeed's own files)")
    if _saved is not None:
        raise _spillway.FailedPrecondition(
            "spillway.deepspeed.install() was already called; call it once per process (uninstall() "
            "first to install again)")
    if allocators and _torch_allocators.installed() is not None and (
            budget_bytes is not None or pinned_budget_bytes is not None):
        raise _spillway.FailedPrecondition(
            "spillway.deepspeed.install(budget_bytes=...) after spillway.install(): the arenas and "
            "their budgets already exist; pass the budgets to spillway.install() instead")


def _what_is_left(allocators):
    """install()'s one warning (None when there is nothing to say): a DeepSpeed outside the tested
    releases, the allocation sites it lacks, the parts left to it, and what is still in force."""
    version = _deepspeed_version()
    missing = _sites._missing
    if version in TESTED_DEEPSPEED and not missing and not _left:
        return None
    kept = (["torch's CPU and pinned allocators are Spillway's, every allocation site found is tagged"]
            if allocators else []) + list(_parts)
    return (
        f"spillway.deepspeed: DeepSpeed {version} is "
        f"{'outside the tested range ' + ', '.join(TESTED_DEEPSPEED) if version not in TESTED_DEEPSPEED else 'tested'}"
        f"{'; these allocation sites are missing: ' + '; '.join(missing) if missing else ''}"
        f"{'; left to DeepSpeed, as this release lacks what they patch: ' + '; '.join(_left) if _left else ''}. "
        f"Still in force: {'; '.join(kept) or 'nothing of install()'} (the fused step only where this "
        f"DeepSpeed's step functions are ones it was verified against: a StepWarning names any that is not)")


def uninstall():
    """Restores DeepSpeed's own aio op and functions. torch's allocators stay Spillway's."""
    global _saved
    _aio._swap_to_arena = False
    _device_guard._guard_default = True
    _unpatch_to(0)
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
