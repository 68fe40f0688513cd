"""Spillway as DeepSpeed's async I/O op. One line in a training script, before deepspeed.initialize:

    import spillway; spillway.deepspeed.install()

From then on `AsyncIOBuilder().load()` returns Spillway's op, so DeepSpeed's swap_tensor code
(parameter and optimizer swapping to NVMe) runs on Spillway's io_uring engine, and the locked
tensors it asks aio_handle for are exact-size memory in Spillway's pinned arena. The `aio` config
keys (block_size, queue_depth, intra_op_parallelism, single_submit, overlap_events) reach
spillway.aio_handle unchanged. `uninstall()` restores DeepSpeed's own op.
"""
import types

from . import _spillway

_saved = None


def _op():
    return types.SimpleNamespace(aio_handle=_spillway.aio_handle, __name__="spillway_async_io")


def install():
    """Makes DeepSpeed's AsyncIOBuilder return Spillway's aio op. Idempotent."""
    global _saved
    from deepspeed.ops.op_builder import AsyncIOBuilder  # noqa: PLC0415 (deepspeed is optional)

    if _saved is not None:
        return
    _saved = (AsyncIOBuilder, AsyncIOBuilder.__dict__.get("load"), AsyncIOBuilder.__dict__.get("is_compatible"))
    AsyncIOBuilder.load = lambda self, verbose=True: _op()
    AsyncIOBuilder.is_compatible = lambda self, verbose=False: True


def uninstall():
    """Restores DeepSpeed's own aio op."""
    global _saved
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
