"""A DeepSpeed ZeRO-2 or ZeRO-3 checkpoint to consolidated fp32 weights in sharded safetensors, one
tensor in memory at a time.

    python -m spillway.zero_to_fp32 CHECKPOINT_DIR OUTPUT_DIR [-t TAG] [--max_shard_size 5GB]
                                    [--dtype float32] [--exclude_frozen_parameters]

CHECKPOINT_DIR is the one `save_checkpoint` wrote into (holding `latest` and the tag's folder); the
arguments are those of DeepSpeed's own zero_to_fp32.py. The tensors are those DeepSpeed's tool
writes, under the same names: the buffers, the frozen parameters (unless excluded), the trainable
parameters rebuilt from every rank's fp32 partitions, and each tied parameter under each of its
names (written twice: safetensors has no aliases; DeepSpeed's own tool fails on tied weights with
--safe_serialization and writes them as one storage in its pickle format).

Memory. DeepSpeed's tool maps the optimizer files and then builds each output shard whole (5 GB by
default) before writing it; for ZeRO-2 it first concatenates each whole fp32 parameter group, and it
loads the model-states file (under ZeRO-2, the whole 16-bit model) into memory. Here every file is
mapped (torch.load(mmap=True)), each tensor is assembled from its ranks' slices into one buffer of
its size, written at its offset through spillway.safetensors_stream, and the mapped pages it read
are dropped from the process (MADV_DONTNEED on the file's private mapping, re-read from the file
if touched again): the process holds about one tensor and the writer's bounce buffers.
"""
import argparse
import bisect
import ctypes
import math
import os
import sys

import torch

from . import safetensors_stream as st

_MADV_DONTNEED = 4
_libc = ctypes.CDLL(None, use_errno=True)
_libc.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
_PAGE = os.sysconf("SC_PAGE_SIZE")


class _Mapped:
    """The address ranges where this process maps the checkpoint's files (/proc/self/maps, read
    once they are all loaded). Only pages inside them are ever dropped: MADV_DONTNEED on anonymous
    memory would zero it."""

    def __init__(self, paths):
        real = {os.path.realpath(p) for p in paths}
        self.ranges = []
        with open("/proc/self/maps") as f:
            for line in f:
                fields = line.split(maxsplit=5)
                if len(fields) == 6 and fields[5].strip() in real:
                    lo, hi = (int(x, 16) for x in fields[0].split("-"))
                    self.ranges.append((lo, hi))
        self.ranges.sort()
        self.starts = [lo for lo, _ in self.ranges]

    def drop(self, tensor):
        """Drops the whole pages under `tensor` that lie in a mapping of a checkpoint file: clean
        private file pages, read again from the file if touched."""
        begin = tensor.data_ptr()
        end = begin + tensor.numel() * tensor.element_size()
        i = bisect.bisect_right(self.starts, begin) - 1
        if i < 0 or begin >= self.ranges[i][1]:
            return
        begin = -(-begin // _PAGE) * _PAGE
        end = min(end, self.ranges[i][1]) // _PAGE * _PAGE
        if end > begin and _libc.madvise(begin, end - begin, _MADV_DONTNEED) != 0:
            e = ctypes.get_errno()
            raise OSError(e, f"madvise(MADV_DONTNEED) of a mapped checkpoint range: {os.strerror(e)}")


_mapped = None  # the _Mapped of the checkpoint being converted


class _Tensor:
    """One output tensor: its name, shape and source dtype, and `read(scratch)` building it (in
    `scratch`, a byte buffer as large as the largest tensor, where it is assembled from pieces)."""

    def __init__(self, name, shape, dtype, read):
        self.name, self.shape, self.dtype, self.read = name, tuple(int(s) for s in shape), dtype, read


def _slices(flat_groups, bounds, start, length):
    """The pieces of [start, start+length) of the concatenation of `flat_groups` (one rank's flat
    tensors; bounds[i] is where group i begins, bounds[-1] the total)."""
    out, end = [], start + length
    for g, flat in enumerate(flat_groups):
        lo, hi = max(start, bounds[g]), min(end, bounds[g + 1])
        if lo < hi:
            out.append(flat.narrow(0, lo - bounds[g], hi - lo))
    return out


def _assemble(pieces, numel, dtype, shape, scratch):
    """The first `numel` elements of the concatenation of `pieces`, in `scratch`. One buffer for
    every tensor: freed tensors of up to 32 MiB would stay in glibc's heap (its mmap threshold
    rises to the largest freed mapping), and the process would keep the sum of a few."""
    out = scratch.narrow(0, 0, numel * dtype.itemsize).view(dtype)
    at = 0
    for piece in pieces:
        n = min(piece.numel(), numel - at)
        if n <= 0:
            break
        out.narrow(0, at, n).copy_(piece.narrow(0, 0, n))
        if _mapped is not None:
            _mapped.drop(piece)
        at += n
    if at != numel:
        raise ValueError(f"the checkpoint holds {at} of the {numel} elements of a tensor of shape {tuple(shape)}")
    return out.view(shape)


def _load(path):
    try:
        return torch.load(path, map_location="cpu", mmap=True, weights_only=False)
    except Exception as e:
        raise ValueError(f"{path}: not a readable DeepSpeed checkpoint file ({type(e).__name__}: {e}); "
                         "point CHECKPOINT_DIR at the directory save_checkpoint wrote") from e


def plan(checkpoint_dir, tag=None, exclude_frozen_parameters=False):
    """The output of DeepSpeed's zero_to_fp32 for `checkpoint_dir`, unread: a list of _Tensor in
    DeepSpeed's order (buffers, frozen parameters, trainable parameters, tied aliases), and the tag."""
    from deepspeed.checkpoint import constants as k  # noqa: PLC0415
    from deepspeed.utils import zero_to_fp32 as ds  # noqa: PLC0415

    if tag is None:
        latest = os.path.join(checkpoint_dir, "latest")
        if not os.path.isfile(latest):
            raise FileNotFoundError(f"no 'latest' file in {checkpoint_dir}: pass the tag (-t global_stepN) or the "
                                    "directory save_checkpoint wrote")
        with open(latest) as f:
            tag = f.read().strip()
    ds_dir = os.path.join(checkpoint_dir, tag)
    if not os.path.isdir(ds_dir):
        raise FileNotFoundError(f"no directory {ds_dir} for the tag {tag!r}")
    # DeepSpeed's own file discovery, order and checks (ranks in natural order, the count of
    # optimizer files against the world size).
    model_files = ds.get_model_state_files(ds_dir)
    optim_files = ds.get_optim_files(ds_dir)
    models = [_load(f) for f in model_files]
    check = getattr(ds, "_raise_if_autoep_zero3_partitioned_state", None)
    for f, m in zip(model_files, models):
        if check is not None:
            check(m)
        if k.BUFFER_NAMES not in m:
            raise ValueError(f"{f} is not a model state checkpoint (no {k.BUFFER_NAMES})")
    optims = [_load(f)[k.OPTIMIZER_STATE_DICT] for f in optim_files]
    if k.ZERO_STAGE not in optims[0]:
        raise ValueError(f"{optim_files[0]} is not a ZeRO checkpoint (no {k.ZERO_STAGE})")
    stage, world = optims[0][k.ZERO_STAGE], optims[0][k.PARTITION_COUNT]
    world = max(world) if isinstance(world, list) else world
    if world != len(optim_files):
        raise ValueError(f"expected {world} '*_optim_states.pt' under {ds_dir} but found {len(optim_files)}: an old "
                         "checkpoint overwritten, or a rank that did not save")
    if stage not in (1, 2, 3):
        raise ValueError(f"unknown ZeRO stage {stage} in {optim_files[0]}")

    first = models[0]
    out = []
    for name, value in first["module"].items():
        if name in first[k.BUFFER_NAMES]:
            out.append(_Tensor(name, value.shape, torch.float32 if value.is_floating_point() else value.dtype,
                               lambda _, v=value: v.float() if v.is_floating_point() else v.clone()))
    frozen = first.get(k.FROZEN_PARAM_SHAPES) or {}
    if not exclude_frozen_parameters:
        for name, shape in frozen.items():
            numel = math.prod(shape)
            if stage <= 2:
                frag = first[k.FROZEN_PARAM_FRAGMENTS][name]
                read = (lambda b, f=frag, n=numel, s=shape: _assemble([f.reshape(-1)], n, f.dtype, s, b))
                out.append(_Tensor(name, shape, frag.dtype, read))
            else:
                frags = [m[k.FROZEN_PARAM_FRAGMENTS][name].reshape(-1) for m in models]
                out.append(_Tensor(name, shape, frags[0].dtype,
                                   lambda b, f=frags, n=numel, s=shape: _assemble(f, n, f[0].dtype, s, b)))
    shapes = first[k.PARAM_SHAPES]
    if stage <= 2:
        out += _zero2(optims, shapes, world, optims[0].get(k.PARAM_ALIGNMENT_PADDINGS), k)
    else:
        out += _zero3(optims, shapes, world, k)
    by_name = {t.name: t for t in out}
    for alias, source in first["shared_params"].items():
        if source in by_name:
            t = by_name[source]
            out = [x for x in out if x.name != alias] + [_Tensor(alias, t.shape, t.dtype, t.read)]
    global _mapped
    _mapped = _Mapped(model_files + optim_files)
    return out, tag


def _zero2(optims, shapes, world, paddings, k):
    groups = [o[k.SINGLE_PARTITION_OF_FP32_GROUPS] for o in optims]
    out = []
    for g, group_shapes in enumerate(shapes):
        parts = [groups[r][g] for r in range(world)]
        bounds = [0]
        for p in parts:
            bounds.append(bounds[-1] + p.numel())
        pads = paddings[g] if paddings is not None else None
        if pads is not None and len(pads) != len(group_shapes):
            raise ValueError(f"expected {len(group_shapes)} parameter alignment paddings for group {g}, found {len(pads)}")
        offset = 0
        for i, (name, shape) in enumerate(group_shapes.items()):
            numel = math.prod(shape)
            out.append(_Tensor(name, shape, parts[0].dtype,
                               lambda buf, p=parts, b=bounds, o=offset, n=numel, s=shape:
                               _assemble(_slices(p, b, o, n), n, p[0].dtype, s, buf)))
            offset += numel + (pads[i] if pads is not None else 0)
        # As DeepSpeed's tool: both sides aligned to 2 x world size before they are compared.
        align = 2 * world
        if -(-offset // align) * align != -(-bounds[-1] // align) * align:
            raise ValueError(f"parameter group {g}: the shapes consume {offset} elements of the {bounds[-1]} "
                             "the ranks hold; the checkpoint does not match its own shapes")
    return out


def _zero3(optims, shapes, world, k):
    groups = [o[k.FP32_FLAT_GROUPS] for o in optims]
    bounds = [0]
    for flat in groups[0]:
        bounds.append(bounds[-1] + flat.numel())
    out, offset = [], 0
    for group_shapes in shapes:
        for name, shape in group_shapes.items():
            numel = math.prod(shape)
            part = -(-numel // world)
            out.append(_Tensor(name, shape, groups[0][0].dtype,
                               lambda buf, o=offset, p=part, n=numel, s=shape:
                               _assemble([x for r in range(world) for x in _slices(groups[r], bounds, o, p)],
                                         n, groups[0][0].dtype, s, buf)))
            offset += part
    if offset != bounds[-1]:
        raise ValueError(f"the shapes consume {offset} elements of each rank's partition of {bounds[-1]}; the "
                         "checkpoint does not match its own shapes")
    return out


_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "float16": torch.float16, "fp16": torch.float16,
           "bfloat16": torch.bfloat16, "bf16": torch.bfloat16}


def convert(checkpoint_dir, output_dir, max_shard_size="5GB", dtype="float32", tag=None,
            exclude_frozen_parameters=False):
    """Writes the consolidated weights of a ZeRO-2/3 checkpoint to `output_dir` as safetensors
    (model.safetensors, or shards and model.safetensors.index.json), floating-point tensors in
    `dtype`, others as they are. Returns the files written."""
    if isinstance(dtype, str):
        if dtype.lower() not in _DTYPES:
            raise ValueError(f"--dtype {dtype}: use one of float32, float16, bfloat16")
        dtype = _DTYPES[dtype.lower()]
    if isinstance(max_shard_size, str):
        from huggingface_hub.serialization._base import parse_size_to_int  # noqa: PLC0415

        max_shard_size = parse_size_to_int(max_shard_size)
    tensors, _ = plan(checkpoint_dir, tag, exclude_frozen_parameters)
    out_dtype = {t.name: (dtype if t.dtype.is_floating_point else t.dtype) for t in tensors}
    layout = st.Plan([(t.name, t.shape, out_dtype[t.name]) for t in tensors], max_shard_size)
    scratch = torch.empty(max((math.prod(t.shape) * t.dtype.itemsize for t in tensors), default=0), dtype=torch.uint8)
    writer = st.Writer(output_dir, layout)
    try:
        for t in tensors:
            value = t.read(scratch)
            writer.write(t.name, value.to(out_dtype[t.name]))
            del value
        return writer.commit()
    except BaseException:
        writer.abort()
        raise


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m spillway.zero_to_fp32", description=__doc__.split("\n\n")[0])
    p.add_argument("checkpoint_dir", help="the directory save_checkpoint wrote (holding `latest`)")
    p.add_argument("output_dir", help="where the safetensors files go")
    p.add_argument("--max_shard_size", default="5GB", help="largest shard (default 5GB, as DeepSpeed's tool)")
    p.add_argument("--dtype", default="float32", help="floating-point output dtype: float32 (default), float16, bfloat16")
    p.add_argument("-t", "--tag", default=None, help="the tag to convert (default: the one `latest` names)")
    p.add_argument("--exclude_frozen_parameters", action="store_true", help="leave out frozen parameters")
    a = p.parse_args(argv)
    try:
        files = convert(a.checkpoint_dir, a.output_dir, a.max_shard_size, a.dtype, a.tag, a.exclude_frozen_parameters)
    except (OSError, ValueError) as e:
        print(f"spillway.zero_to_fp32: {e}", file=sys.stderr)
        return 1
    for f in files:
        print(f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
