"""spillway.deepspeed.save_16bit_model: a ZeRO-3 engine's consolidated 16-bit weights streamed to
sharded safetensors one parameter at a time (docs/checkpoint.md). Public through spillway.deepspeed;
this module is private.
"""
import math
import os

import torch

from . import _spillway

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
    first). Returns the files written on rank 0, [] elsewhere. Atomicity: see spillway.safetensors_stream.Writer."""
    import deepspeed  # noqa: PLC0415
    import deepspeed.comm as dist  # noqa: PLC0415

    from . import safetensors_stream as st  # noqa: PLC0415

    if not engine.zero_optimization_partition_weights():
        raise _spillway.InvalidArgument(
            "spillway.deepspeed.save_16bit_model: the engine is not ZeRO-3 (its weights are not "
            "partitioned); engine.module.state_dict() already holds them whole")
    entries = _consolidated_entries(engine, exclude_frozen_parameters)
    rank0 = dist.get_rank() == 0
    layout = [(key, tuple(getattr(t, "ds_shape", t.shape)), t.dtype) for key, _, t in entries]
    plan = st.Plan(layout, max_shard_size)
    writer = st.Writer(save_dir, plan, block_size, queue_depth) if rank0 else None
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
        import spillway  # noqa: PLC0415
        from deepspeed.accelerator import get_accelerator  # noqa: PLC0415

        runtime = spillway.installed()
        room = 0
        if runtime is not None:
            s = runtime.host.stats()
            # The budget caps bytes held from the OS; empty retained regions are given back on demand.
            room = s["budget_bytes"] - s["committed_bytes"] + s["retained_bytes"]
        page = os.sysconf("SC_PAGE_SIZE")  # the arena's granule: each allocation rounds up to it
        largest = max((-(-math.prod(shape) * torch.empty(0, dtype=dtype).element_size() // page) * page
                       for _, shape, dtype in layout), default=0)
        fits = torch.tensor([1 if runtime is not None and room >= 2 * largest else 0], dtype=torch.int32,
                            device=get_accelerator().current_device_name())
        dist.all_reduce(fits, op=dist.ReduceOp.MIN)
        in_arena = bool(fits.item())

        def gathering():
            return spillway.tag("checkpoint") if in_arena else contextlib.nullcontext()

        for key, kind, t in entries:
            if kind == "param" and hasattr(t, "ds_id"):
                with gathering(), deepspeed.zero.GatheredParameters([t], modifier_rank=None):
                    if rank0:
                        writer.write(key, t.data)
            elif rank0:
                writer.write(key, t)
        if not rank0:
            return []
        return writer.commit()
    except BaseException:
        if writer is not None:
            writer.abort()
        raise

