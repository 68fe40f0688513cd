"""spillway.HostArena, the extension's arena with torch-style constructors and epoch/step scopes,
and spillway.Boundary, what those scopes give. Public through the spillway package (which names
them "spillway.HostArena" and "spillway.Boundary"); this module is private, so that the package's
own modules (_torch_allocators' install()) take the class from here rather than from the package
that imports them.
"""
import warnings

from ._spillway import Escaped
from ._spillway import HostArena as _HostArena


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
        # failed scope are in the report. Under policy "fail" the boundary raises Escaped, except
        # while the block's own exception propagates: that one is what the user must see, and the
        # escape becomes a warning.
        try:
            self.report = getattr(self._arena, "_end_" + self._kind)()
        except Escaped as e:
            if exc is None:
                raise
            warnings.warn(f"spillway: the {self._kind} boundary found escapes while "
                          f"{type(exc).__name__} propagated: {e}", RuntimeWarning, stacklevel=2)
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
