"""Spillway: host-memory and NVMe offload for large-model training.

    import spillway
    arena = spillway.HostArena(budget_bytes=8 << 30)        # pinned, budgeted, fork-safe
    t = arena.empty((1024, 1024), torch.float32, kind="optimizer_state", lifetime="persistent")
    with arena.epoch(0) as epoch:
        ...
    print(epoch.report["text"])                               # live bytes, escapes

    h = spillway.aio_handle(block_size=1 << 20, queue_depth=32)   # DeepSpeed's aio_handle contract
    spillway.deepspeed.install()                                  # DeepSpeed's aio op becomes this

See docs/python.md.
"""
import torch  # noqa: F401  (loads libtorch and registers torch.Tensor before the extension)

from ._spillway import (  # noqa: F401
    ChecksumMismatch,
    Error,
    Escaped,
    FailedPrecondition,
    HostArena as _HostArena,
    InternalError,
    InvalidArgument,
    IoError,
    NoSpace,
    OutOfMemory,
    OverBudget,
    Unavailable,
    aio_handle,
    default_arena,
)
from . import deepspeed, engine, metrics  # noqa: F401,E402

__all__ = [
    "HostArena", "aio_handle", "default_arena", "deepspeed", "engine", "metrics", "Error", "InvalidArgument",
    "FailedPrecondition", "OverBudget", "OutOfMemory", "IoError", "NoSpace", "ChecksumMismatch",
    "Unavailable", "Escaped", "InternalError",
]


class Boundary:
    """What `with arena.epoch(n)` / `with arena.step(k)` gives: `report` is filled on exit with the
    ledger's boundary report (live_bytes, escape_count, escaped_bytes, clean, text)."""

    def __init__(self, arena, kind, number):
        self._arena, self._kind, self.number, self.report = arena, kind, number, None

    def __enter__(self):
        getattr(self._arena, "_begin_" + self._kind)(self.number)
        return self

    def __exit__(self, exc_type, exc, tb):
        # The boundary closes on an exception too, so the ledger stays in order; escapes of the
        # failed scope are in the report.
        self.report = getattr(self._arena, "_end_" + self._kind)()
        return False


class HostArena(_HostArena):
    """A page-locked (pinned=True) or pageable host arena with exact-size allocations, a hard
    budget and MADV_DONTFORK regions (a forked DataLoader worker does not share them, so the first
    optimizer step after a fork copies nothing). `empty()` returns torch tensors over its memory."""

    def epoch(self, n):
        return Boundary(self, "epoch", n)

    def step(self, k):
        return Boundary(self, "step", k)

    def empty_like(self, t, kind="transient", lifetime="step", owner=0):
        return self.empty(tuple(t.shape), t.dtype, kind=kind, lifetime=lifetime, owner=owner)

    def zeros(self, shape, dtype=None, kind="transient", lifetime="step", owner=0):
        t = self.empty(shape, dtype, kind=kind, lifetime=lifetime, owner=owner)
        t.zero_()
        return t
