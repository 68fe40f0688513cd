"""spillway.deepspeed.save_16bit_model: a ZeRO-3 engine's consolidated 16-bit weights streamed to
sharded safetensors one parameter at a time (docs/checkpoint.md). Public through spillway.deepspeed;
this module is private.
"""
import math
import os

import torch

from . import _spillway, _torch_allocators
from . import safetensors_stream as st


# DeepSpeed releases on which the weights two ranks gather one parameter at a time were checked
# against DeepSpeed's own engine.save_16bit_model (test_deepspeed_save.py, under scripts/check-deepspeed
# for releases other than the installed one). On 0.18.9 (CPU accelerator, Gloo) some gathered
# parameters held wrong values (zeros, 1e38): with several ranks the save is refused there, before
# any collective, so every rank refuses alike. Not yet found why.
_GATHER_VERIFIED = ("0.19.8",)


def _consolidated_entries(engine, exclude_frozen_parameters):
    """(key, kind, tensor) in DeepSpeed's _zero3_consolidated_16bit_state_dict order: per
    module, its own parameters (a tied parameter under each of its names), then its persistent
    buffers, then its children."""
    out = []

    def walk(module, prefix):
        for name, p in module.named_parameters(recurse=False):
            if p is None or (exclude_frozen_parameters and not p.requires_grad):
                continue
            out.append((prefix + name, "param", p))
        for name, b in module.named_buffers(recurse=False):
            if b is not None and name not in module._non_persistent_buffers_set:
                out.append((prefix + name, "buffer", b))
        for name, child in module.named_children():
            if child is not None:
                walk(child, prefix + name + ".")
    walk(engine.module, "")
    return out


def save_16bit_model(engine, save_dir, max_shard_size=5 << 30, exclude_frozen_parameters=False,
                     block_size=1 << 20, queue_depth=8):
    """Writes a ZeRO-3 engine's 16-bit weights to `save_dir` as transformers-style sharded
    safetensors with model.safetensors.index.json: the tensors DeepSpeed's own
    engine.save_16bit_model would write, under the same names. Every rank must call it (the
    parameters are gathered collectively); rank 0 writes. One parameter is gathered at a time and
    streamed to its place in its shard through Spillway's aio_handle, so rank 0's host memory
    peaks at about one parameter, not the model (DeepSpeed gathers the whole state dict on rank 0
    first). Returns the files written on rank 0, [] elsewhere. Atomicity: see spillway.safetensors_stream.Writer.
    A failure on rank 0 (making the directory, a write, the commit) is raised on every rank once all
    have left the save's collectives: rank 0's own exception there, spillway.IoError elsewhere."""
    import deepspeed  # noqa: PLC0415
    import deepspeed.comm as dist  # noqa: PLC0415

    if not engine.zero_optimization_partition_weights():
        raise _spillway.InvalidArgument(
            "spillway.deepspeed.save_16bit_model: the engine is not ZeRO-3 (its weights are not "
            "partitioned); engine.module.state_dict() already holds them whole")
    if dist.get_world_size() > 1 and deepspeed.__version__ not in _GATHER_VERIFIED:
        raise _spillway.FailedPrecondition(
            f"spillway.deepspeed.save_16bit_model: on DeepSpeed {deepspeed.__version__} with "
            f"{dist.get_world_size()} ranks, gathering one parameter at a time was not verified (on 0.18.9 some "
            f"gathered parameters held wrong values); nothing was written. Use engine.save_16bit_model, or "
            f"DeepSpeed {', '.join(_GATHER_VERIFIED)}")
    entries = _consolidated_entries(engine, exclude_frozen_parameters)
    rank0 = dist.get_rank() == 0
    layout = [(key, tuple(getattr(t, "ds_shape", t.shape)), t.dtype) for key, _, t in entries]
    plan = st.Plan(layout, max_shard_size)
    # Rank 0 alone writes, and every rank gathers every parameter. A failure on rank 0 (the
    # directory, a write, the commit) is kept and raised after the last collective, on every rank:
    # leaving at once would strand the others in the next all-gather, and a caller that went on
    # would pair its next collective with theirs.
    writer, failure = None, None
    if rank0:
        try:
            writer = st.Writer(save_dir, plan, block_size, queue_depth)
        except Exception as e:  # noqa: BLE001 (raised below, once every rank has agreed)
            failure = e

    def write(key, tensor):
        nonlocal failure
        if writer is None or failure is not None:
            return
        try:
            writer.write(key, tensor)
        except Exception as e:  # noqa: BLE001 (raised below, once every rank has agreed)
            failure = e

    try:
        # A tied parameter is gathered again and written under each of its names: DeepSpeed's
        # state dict holds the same tensor under both, and safetensors has no aliases.
        # Under spillway.install(), each gathered parameter is a "checkpoint" allocation of the host
        # arena: exact size, and its pages are reused by the next one, where glibc's heap kept a
        # varying number of freed 2 MiB gathers resident (peaks of 15 to 31 MiB over an 8-step
        # 25M-parameter model, depending on the torch release).
        # Every rank must gather every parameter, so all of them agree first: the arena serves the
        # gathers only if each rank's budget has room for two of the largest (the gather and a
        # host copy of it); else torch's allocator does, on every rank. One rank refusing a gather
        # with OverBudget would leave the others waiting in the all-gather.
        import contextlib  # noqa: PLC0415
        from deepspeed.accelerator import get_accelerator  # noqa: PLC0415

        runtime = _torch_allocators.installed()
        room = 0
        if runtime is not None:
            s = runtime.host.stats()
            # The budget caps bytes held from the OS; empty retained regions are given back on demand.
            room = s["budget_bytes"] - s["committed_bytes"] + s["retained_bytes"]
        page = os.sysconf("SC_PAGE_SIZE")  # the arena's granule: each allocation rounds up to it
        largest = max((-(-math.prod(shape) * torch.empty(0, dtype=dtype).element_size() // page) * page
                       for _, shape, dtype in layout), default=0)
        device = get_accelerator().current_device_name()
        agreed = torch.tensor([1 if runtime is not None and room >= 2 * largest else 0, failure is None],
                              dtype=torch.int32, device=device)
        dist.all_reduce(agreed, op=dist.ReduceOp.MIN)
        in_arena, ok = bool(agreed[0].item()), bool(agreed[1].item())

        def gathering():
            return _torch_allocators.tag("checkpoint") if in_arena else contextlib.nullcontext()

        files = []
        if ok:  # else rank 0 could not open the checkpoint, and every rank knows: nothing to gather
            for key, kind, t in entries:
                if kind == "param" and hasattr(t, "ds_id"):
                    with gathering(), deepspeed.zero.GatheredParameters([t], modifier_rank=None):
                        if rank0:
                            write(key, t.data)
                elif rank0:
                    write(key, t)
            if rank0 and failure is None:
                try:
                    files = writer.commit()
                except Exception as e:  # noqa: BLE001 (raised below, once every rank has agreed)
                    failure = e
            # The last collective: every rank learns whether rank 0 committed.
            done = torch.tensor([failure is None], dtype=torch.int32, device=device)
            dist.all_reduce(done, op=dist.ReduceOp.MIN)
            ok = bool(done.item())
        if failure is not None:
            raise failure
        if not ok:
            raise _spillway.IoError(
                f"spillway.deepspeed.save_16bit_model: rank 0 failed to write the checkpoint to {save_dir} "
                "(rank 0 raised the cause); do not load it from there. Fix what rank 0 reports and save again")
        return files
    except BaseException:
        if writer is not None:
            writer.abort()
        raise

