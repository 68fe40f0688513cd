"""Spillway: host-memory and NVMe offload for large-model training.

    import spillway
    arena = spillway.HostArena(budget_bytes=8 << 30)        # pinned, budgeted, fork-safe
    t = arena.empty((1024, 1024), torch.float32, kind="optimizer_state", lifetime="persistent")
    with arena.epoch(0) as epoch:
        ...
    print(epoch.report["text"])                               # live bytes, escapes

    h = spillway.aio_handle(block_size=1 << 20, queue_depth=32)   # DeepSpeed's aio_handle contract

    spillway.deepspeed.install()      # DeepSpeed: its whole host side in Spillway's arenas, its host step
                                      # on Spillway's fused pass, the device guard (docs/deepspeed.md)
    spillway.install()                # any loop: torch's CPU and pinned allocators become Spillway's
    with spillway.tag("optimizer_state"):
        state = torch.zeros(n)        # pageable, MADV_DONTFORK, budgeted, ledgered

See docs/python.md and docs/deepspeed.md.
"""
import torch  # (loads libtorch and registers torch.Tensor before the extension)

from . import _build_info, _torch_abi

__version__ = _build_info.version


def _check_torch(built, running):
    """The extension links libtorch's C++ API, whose ABI changes between minor versions: loading it
    under another torch can crash in the loader or later. Refuse before loading it."""
    if _torch_abi.series(built) != _torch_abi.series(running):
        raise ImportError(
            f"spillway {__version__} was built against torch {built}, but this environment has torch "
            f"{running}. Rebuild it against this torch: pip install --no-build-isolation <spillway "
            f"checkout> (or rebuild the CMake tree and use its build/<preset>/python)")


_check_torch(_build_info.torch_version, torch.__version__)

from ._spillway import (  # noqa: F401,E402
    ChecksumMismatch,
    Error,
    Escaped,
    ExternalError,
    FailedPrecondition,
    HostArena as _HostArena,
    InternalError,
    InvalidArgument,
    IoError,
    NoSpace,
    OutOfMemory,
    OverBudget,
    ResourceExhausted,
    Unavailable,
    aio_handle,
    default_arena,
    default_host_budget,
    memory_limit_bytes,
)
from . import _spillway  # noqa: E402
from . import _log  # noqa: E402

_log._setup()  # C++ log lines go to logging.getLogger("spillway") from here on


def set_log_level(level):
    """What Spillway's C++ core logs from now on ("error", "warning", "info" or "debug"; default:
    SPILLWAY_LOG, else "warning"), and the level of the "spillway" logger that receives it."""
    _log.set_level(level)

__all__ = [
    "__version__", "HostArena", "aio_handle", "default_arena", "deepspeed", "engine", "metrics", "node", "Error", "InvalidArgument",
    "FailedPrecondition", "OverBudget", "OutOfMemory", "IoError", "NoSpace", "ChecksumMismatch",
    "Unavailable", "Escaped", "InternalError", "ResourceExhausted", "ExternalError", "DeviceMismatch", "guard", "optim", "install", "installed", "tag", "next_epoch", "Runtime", "set_log_level",
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
        # failed scope are in the report. Under policy "fail" the boundary raises Escaped, except
        # while the block's own exception propagates: that one is what the user must see, and the
        # escape becomes a warning.
        try:
            self.report = getattr(self._arena, "_end_" + self._kind)()
        except Escaped as e:
            if exc is None:
                raise
            import warnings  # noqa: PLC0415

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


from ._torch_allocators import (  # noqa: F401,E402
    Runtime,
    check_torch_version,
    install,
    installed,
    next_epoch,
    tag,
)

# Named where users import them from (help(), reprs, pickles), not by the private file.
for _public in (Runtime, check_torch_version, install, installed, next_epoch, tag):
    _public.__module__ = __name__
del _public

from . import deepspeed, engine, guard, metrics, node, optim  # noqa: F401,E402
from .guard import DeviceMismatch  # noqa: F401,E402
