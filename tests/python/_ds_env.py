"""What the installed DeepSpeed can run on its CPU accelerator, for tests that need it (and for
scripts/check-deepspeed, which runs them against other releases). Imported by the test files, not
collected (no test_ prefix)."""
import inspect


def infinity_skip_reason():
    """None where DeepSpeed's NVMe swappers (ZeRO-Infinity) run on its CPU accelerator; else why not.
    Read from the code: the swappers that ask the accelerator whether a buffer is pinned get
    tensor.is_pinned(), false for every tensor on a CPU-only torch (DeepSpeed 0.18.9's own aio op's
    locked buffers too, checked), so they refuse every buffer; those that ask the aio handle run."""
    import deepspeed
    from deepspeed.runtime.swap_tensor.async_swapper import AsyncTensorSwapper

    if "aio_handle.is_pinned" in inspect.getsource(AsyncTensorSwapper.add_buffers):
        return None
    return (f"DeepSpeed {deepspeed.__version__}'s NVMe swappers ask its accelerator whether a buffer is pinned "
            "(tensor.is_pinned(), false for every tensor on a CPU-only torch, DeepSpeed's own aio op's locked "
            "buffers too): ZeRO-Infinity cannot run on its CPU accelerator (0.19.4 and later ask the aio handle)")


def needs_infinity():
    """A pytest mark: skip, saying why, where infinity_skip_reason() names a reason."""
    import pytest

    why = infinity_skip_reason()
    return pytest.mark.skipif(why is not None, reason=why or "")
