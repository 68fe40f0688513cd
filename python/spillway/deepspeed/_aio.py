"""spillway.deepspeed's async I/O op: DeepSpeed's AsyncIOBuilder loads Spillway's aio_handle
(io_uring) with its locked buffers in the pinned arena, and aio_read / aio_write / deepspeed_memcpy,
DeepSpeed's one-shot calls. With install(nvme_swap="arena") each handle is wrapped so that
ZeRO-Infinity's swap files live in Spillway's NVMe arena (_swap.py). Private: install() patches it.
"""
import functools
import os
import types

import torch

from .. import _spillway, _torch_allocators
from . import _swap

_swap_to_arena = False  # install(nvme_swap="arena"): DeepSpeed's swap files in Spillway's NVMe arena


def pinned_arena():
    """The pinned arena spillway.install() made, for Spillway's handles' locked buffers; None (the
    process's default arena) without install(), or in a process forked after it, where the
    runtime's arenas are the parent's."""
    runtime = _torch_allocators.installed()
    return runtime.pinned if runtime is not None and not _spillway._forked_after_install() else None


def _aio_handle(*args, arena=None, **kwargs):
    """DeepSpeed's `aio_handle(block_size, queue_depth, single_submit, overlap_events,
    intra_op_parallelism)`: Spillway's, with its locked buffers (new_cpu_locked_tensor, DeepSpeed's
    NVMe swap buffers) in the pinned arena spillway.install() made, so they count against its budget,
    in its ledger and in what spillway.metrics.serve() watches. Without install(), or in a process
    forked after it, the process's default arena."""
    handle = _spillway.aio_handle(*args, arena=arena if arena is not None else pinned_arena(), **kwargs)
    # DeepSpeed's swap files go to Spillway's NVMe arena (install(nvme_swap="arena"), the default).
    return _swap.Handle(handle) if _swap_to_arena else handle


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


def _install_op():
    from deepspeed.ops.op_builder import AsyncIOBuilder  # noqa: PLC0415

    saved = (AsyncIOBuilder, AsyncIOBuilder.__dict__.get("load"), AsyncIOBuilder.__dict__.get("is_compatible"))
    AsyncIOBuilder.load = lambda self, verbose=True: _op()
    AsyncIOBuilder.is_compatible = lambda self, verbose=False: True
    return saved
