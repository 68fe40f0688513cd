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
    "__version__", "HostArena", "aio_handle", "default_arena", "deepspeed", "engine", "trainer", "metrics", "node", "Error", "InvalidArgument",
    "FailedPrecondition", "OverBudget", "OutOfMemory", "IoError", "NoSpace", "ChecksumMismatch",
    "Unavailable", "Escaped", "InternalError", "ResourceExhausted", "ExternalError", "DeviceMismatch", "guard", "optim", "install", "installed", "tag", "next_epoch", "Runtime", "set_log_level",
]


from ._arena import Boundary, HostArena  # noqa: E402
from ._torch_allocators import (  # noqa: F401,E402
    Runtime,
    check_torch_version,
    install,
    installed,
    next_epoch,
    tag,
)

# Named where users import them from (help(), reprs, pickles), not by the private files.
for _public in (Boundary, HostArena, Runtime, check_torch_version, install, installed, next_epoch, tag):
    _public.__module__ = __name__
del _public

from . import deepspeed, engine, guard, metrics, node, optim, trainer  # noqa: F401,E402
from .guard import DeviceMismatch  # noqa: F401,E402
