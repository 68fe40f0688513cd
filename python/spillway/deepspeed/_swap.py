"""spillway.deepspeed's NVMe swap: DeepSpeed's swap files in Spillway's NVMe arena (Note [DeepSpeed
swap] in docs/deepspeed.md). This module is private.

DeepSpeed's swappers (ZeRO-Infinity: the optimizer state with offload_optimizer nvme, the
parameters with offload_param nvme) write each swapped tensor whole to a file of its own under
`<nvme_path>/zero_stage_3/...` and read it back whole, through the aio handle. After install(), the
handles Spillway's op makes route those two calls, for paths under a swapper's folder, to one
SwapStore per nvme_path: extents of one O_TMPFILE swap file (nothing is left on disk after a kill),
a CRC32C per extent verified on every read, a budget (SPILLWAY_NVME_BUDGET_BYTES, else the space the
disk has free at the first swap), Spillway's stats. The store runs on the I/O engine of the aio
handle of the first swapper that names its nvme_path, and a routed call is that handle's op like
any other (aio_handle._swap): queued on the engine, counted and waited for by wait(), no thread of
its own. The folders DeepSpeed names keep existing, and
DeepSpeed's checkpoint save and load, which copy the optimizer's swap folder as files, see files:
save_checkpoint writes the folder's tensors out before DeepSpeed copies it and removes them after,
and while load_checkpoint runs a real file found at a swap path (it copies them in) is taken into
the store on its first read. Swap files an earlier run left in a folder are removed when the
swapper is made.
"""
import functools
import os
import threading

import torch

from .. import _metrics_registry, _spillway
from ._common import _defined
from .._log import logger

_lock = threading.Lock()
_stores = {}    # (pid, nvme_path) -> _SwapStore
_folders = {}   # (pid, folder + os.sep) -> _SwapStore: the swappers' folders
_loading = {}   # pid -> True while DeepSpeedEngine.load_checkpoint runs
_STATE_NAMES = ("exp_avg", "exp_avg_sq", "momentum_buffer", "sum", "square_avg", "acc_delta")


def _kind(path):
    name = os.path.basename(path)
    if f"{os.sep}optimizer{os.sep}" not in path:
        return "param"
    if "_gradient_" in name:
        return "grad"
    return "optimizer_state" if "-" in name and name.split("-", 1)[0] in _STATE_NAMES else "master_weight"


def _budget():
    raw = os.environ.get("SPILLWAY_NVME_BUDGET_BYTES", "")
    if not raw:
        return 0
    try:
        value = int(raw)
    except ValueError:
        value = -1
    if value <= 0:
        raise _spillway.InvalidArgument(f"SPILLWAY_NVME_BUDGET_BYTES={raw!r}: must be a positive number of bytes")
    return value


def _store_for(nvme_path, handle):
    """The store of `nvme_path`, made on the engine of `handle` (Spillway's aio_handle) and booked in its
    arena (install()'s pinned arena, as the handle's locked buffers) when this process has none."""
    key = (os.getpid(), os.path.realpath(nvme_path))
    with _lock:
        store = _stores.get(key)
        made = store is None
        if made:
            store = _stores[key] = handle._swap_store(key[1], _budget())
    if made:
        _metrics_registry.watch_swap_store(store)
    return store


def register(folder, nvme_path, handle, wipe=False):
    """A swapper's folder: its paths go to the store of `nvme_path`. `wipe` forgets what the store
    holds under it (the parameter swapper empties its folder on disk when it is made). Swap files
    already in the folder are an earlier run's (DeepSpeed's optimizer swapper does not empty its
    folder, and rewrites every tensor before it reads one): they are removed, and said so, so that
    none is ever read as this run's state."""
    store = _store_for(nvme_path, handle)
    prefix = os.path.join(os.path.realpath(folder), "")
    stale = [os.path.join(prefix, f) for f in sorted(os.listdir(prefix)) if f.endswith(".tensor.swp")]
    for path in stale:
        os.unlink(path)
    if stale:
        logger.warning("spillway.deepspeed: removed %d swap files an earlier run left in %s (this run's swapped "
                       "tensors live in Spillway's NVMe arena; a checkpoint's are taken in by load_checkpoint)",
                       len(stale), prefix)
    with _lock:
        _folders[(os.getpid(), prefix)] = store
    if wipe:
        store.remove(prefix)


def _managed(path):
    if not isinstance(path, (str, os.PathLike)):
        return None, None
    real = os.path.realpath(path)
    pid = os.getpid()
    with _lock:
        for (owner, prefix), store in _folders.items():
            if owner == pid and real.startswith(prefix):
                return store, real
    return None, None


def _folder_store(folder):
    """(the store, the folder's real path) for a registered swapper folder; (None, None) else."""
    real = os.path.realpath(folder)
    with _lock:
        return _folders.get((os.getpid(), os.path.join(real, "")), None), real


def _buffer(t):
    # DeepSpeed's buffers are often narrow() views of a pool: their own bytes, not the storage's.
    return t if t.is_contiguous() else t.contiguous()


def _import(store, path, t):
    size = os.path.getsize(path)
    if size != t.nbytes:
        raise _spillway.InvalidArgument(
            f"DeepSpeed swap file {path}: the file on disk holds {size} bytes and the read asks for {t.nbytes}; "
            "it was not written by this run's configuration (another sub_group_size, world size or model)")
    with open(path, "rb") as f:
        if f.readinto(memoryview(t.view(-1).view(torch.uint8).numpy())) != size:
            raise _spillway.IoError(f"DeepSpeed swap file {path}: short read while taking it into Spillway's store")
    store.write(path, t, _kind(path))
    os.unlink(path)  # the store holds it now: one copy, CRC-checked


class Handle:
    """Spillway's aio handle with DeepSpeed's swap paths routed to the swap store. Every other call
    is the wrapped handle's. A routed call is the handle's own op on the store (aio_handle._swap), so
    wait() counts it with the rest, as DeepSpeed's op does; a failed one raises its error (a checksum
    mismatch names the swap file) once every op the wait takes has finished."""

    def __init__(self, inner):
        self._inner = inner

    def __getattr__(self, name):
        return getattr(self._inner, name)

    def _route(self, method, args, kwargs):
        """A call naming a swap path (positionally or as filename=) goes to the store; every other
        one (a descriptor, fd=, a path outside the swap folders) to the handle, as it was made."""
        filename = args[1] if len(args) > 1 else kwargs.get("filename")
        store, path = _managed(filename)
        if store is None:
            return getattr(self._inner, method)(*args, **kwargs)
        buffer = args[0] if args else kwargs["buffer"]
        offset = args[2] if len(args) > 2 else kwargs.get("file_offset", 0)
        if offset != 0:
            raise _spillway.InvalidArgument(
                f"DeepSpeed swap file {path}: a transfer at file offset {offset}; Spillway's swap store holds "
                "whole files (DeepSpeed's swappers write and read them at offset 0)")
        write = method.endswith("pwrite")
        if write:
            buffer = _buffer(buffer)  # the copy is held by the op until it is waited for
        elif not buffer.is_contiguous():
            raise _spillway.InvalidArgument(f"DeepSpeed swap file {path}: the read buffer is not contiguous")
        elif _loading.get(os.getpid()) and os.path.lexists(path):
            # While load_checkpoint runs, a real file at a swap path is the checkpoint's (DeepSpeed
            # copies them into the folder, then reads every sub-group): the newer copy, taken into the
            # store first. Outside it the store's is.
            _import(store, path, buffer)
        return self._inner._swap(buffer, store, path, write, _kind(path), method.startswith("async_"))

    def async_pwrite(self, *args, **kwargs):
        return self._route("async_pwrite", args, kwargs)

    def async_pread(self, *args, **kwargs):
        return self._route("async_pread", args, kwargs)

    def sync_pwrite(self, *args, **kwargs):
        return self._route("sync_pwrite", args, kwargs)

    def sync_pread(self, *args, **kwargs):
        return self._route("sync_pread", args, kwargs)


def _registering(original, folder_of, wipe):
    @functools.wraps(original)
    def __init__(self, *args, **kwargs):
        original(self, *args, **kwargs)
        if getattr(self, "use_gds", False):  # GPUDirect Storage: DeepSpeed's gds_handle, its own files
            return
        folder, nvme_path, handle = folder_of(self)
        if not isinstance(handle, Handle):  # not Spillway's op: its swaps go to DeepSpeed's files
            logger.warning("spillway.deepspeed: %s's aio handle is not Spillway's (%s); its swap files stay "
                           "DeepSpeed's files in %s (call spillway.deepspeed.install() before deepspeed.initialize, "
                           "so that DeepSpeed's aio op is Spillway's)", type(self).__name__, type(handle).__name__,
                           folder)
            return
        register(folder, nvme_path, handle._inner, wipe=wipe)
    __init__.__spillway_original__ = original
    return __init__


def _optimizer_folder(swapper):
    # OptimizerSwapper: swap_folder = <base_folder>/optimizer/rank<R>, base_folder = <nvme_path>/zero_stage_3
    folder = swapper.swap_folder
    return folder, os.path.dirname(os.path.dirname(os.path.dirname(folder))), swapper.aio_handle


def _param_folder(swapper):
    folder = swapper.swap_folder  # <nvme_path>/zero_stage_3/<dtype>params/rank<R>
    return folder, swapper.swap_config.nvme_path, swapper.aio_read_handle


def _saving(original):
    """DeepSpeedEngine.save_checkpoint: DeepSpeed copies the optimizer's swap folder as files into
    the checkpoint; the store's tensors of that folder are written out as files first and removed
    once DeepSpeed has copied them (the store keeps its copy)."""
    @functools.wraps(original)
    def save_checkpoint(self, *args, **kwargs):
        written = []
        try:
            if self.zero_nvme_offload_optimizer():
                written = export(self.optimizer.optimizer_swapper.swap_folder)
            return original(self, *args, **kwargs)
        finally:
            for path in written:
                try:
                    os.unlink(path)
                except FileNotFoundError:
                    pass
    save_checkpoint.__spillway_original__ = original
    return save_checkpoint


def _loading_checkpoint(original):
    """DeepSpeedEngine.load_checkpoint: the swap files it copies into the optimizer's folder are
    taken into the store as DeepSpeed reads them back (reset_swap_buffers)."""
    @functools.wraps(original)
    def load_checkpoint(self, *args, **kwargs):
        pid = os.getpid()
        _loading[pid] = True
        try:
            out = original(self, *args, **kwargs)
            if self.zero_nvme_offload_optimizer():  # what reset_swap_buffers did not read yet
                take_in(self.optimizer.optimizer_swapper.swap_folder)
            return out
        finally:
            _loading.pop(pid, None)
    load_checkpoint.__spillway_original__ = original
    return load_checkpoint


def take_in(folder):
    """Takes the real swap files in `folder` (a checkpoint's, copied in by load_checkpoint) into the
    store, each removed once the store holds it. Returns their paths."""
    store, folder = _folder_store(folder)
    if store is None:
        return []
    taken = []
    for name in sorted(os.listdir(folder)):
        path = os.path.join(folder, name)
        if name.endswith(".tensor.swp") and os.path.isfile(path):
            _import(store, path, torch.empty(os.path.getsize(path), dtype=torch.uint8))
            taken.append(path)
    return taken


def export(folder):
    """Writes the store's tensors under `folder` (gradients excepted, as DeepSpeed's checkpoint
    excludes them) out as the files DeepSpeed would have there. Returns their paths."""
    store, folder = _folder_store(folder)
    if store is None:
        return []
    written = []
    try:
        for path in store.paths(os.path.join(folder, "")):
            if "gradient" in os.path.basename(path):
                continue
            t = torch.empty(store.size(path), dtype=torch.uint8)
            store.read(path, t)
            written.append(path)  # before the write: a partial file is removed too
            with open(path, "wb") as f:
                f.write(memoryview(t.numpy()))
    except BaseException:
        for path in written:  # no half-written checkpoint source is left in the folder
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass
        raise
    return written


def stores():
    """This process's swap stores."""
    pid = os.getpid()
    with _lock:
        return [store for (owner, _), store in _stores.items() if owner == pid]


def stats():
    """{nvme_path: the store's stats} for this process's swap stores."""
    pid = os.getpid()
    with _lock:
        return {root: store.stats() for (owner, root), store in _stores.items() if owner == pid}


def install(patch):
    """Routes DeepSpeed's swappers to the store (`patch` is spillway.deepspeed's _patch)."""
    from deepspeed.runtime.engine import DeepSpeedEngine  # noqa: PLC0415
    from deepspeed.runtime.swap_tensor.optimizer_utils import OptimizerSwapper  # noqa: PLC0415
    from deepspeed.runtime.swap_tensor.partitioned_param_swapper import (  # noqa: PLC0415
        AsyncPartitionedParameterSwapper,
    )

    patch(OptimizerSwapper, "__init__", _registering(_defined(OptimizerSwapper, "__init__"), _optimizer_folder, False))
    patch(AsyncPartitionedParameterSwapper, "__init__",
          _registering(_defined(AsyncPartitionedParameterSwapper, "__init__"), _param_folder, True))
    patch(DeepSpeedEngine, "save_checkpoint", _saving(_defined(DeepSpeedEngine, "save_checkpoint")))
    patch(DeepSpeedEngine, "load_checkpoint", _loading_checkpoint(_defined(DeepSpeedEngine, "load_checkpoint")))
