"""A DeepSpeed ZeRO-2 or ZeRO-3 checkpoint to consolidated fp32 weights in sharded safetensors, one
tensor in memory at a time.

    python -m spillway.zero_to_fp32 CHECKPOINT_DIR OUTPUT_DIR [-t TAG] [--max_shard_size 5GB]
                                    [--dtype float32] [--exclude_frozen_parameters]

CHECKPOINT_DIR is the one `save_checkpoint` wrote into (holding `latest` and the tag's folder). DeepSpeed's
own zero_to_fp32.py command lines run unchanged (its --safe_serialization and -d are accepted; the
output is always safetensors); --dtype is its Python function's. The tensors are those DeepSpeed's tool
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
import glob
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
    once they are all loaded), and the loaded objects, kept alive while the conversion runs so that
    no range is unmapped and reused. Only pages inside these ranges are ever dropped: MADV_DONTNEED
    on anonymous memory would zero it. A file whose pages torch changed in place (an archive of the
    other byte order, which torch byteswaps in its mapping) turns dropping off: those pages would be
    read back unswapped."""

    def __init__(self):
        self.ranges, self.starts, self.keep, self.enabled = [], [], [], True

    def scan(self, paths, keep):
        import warnings  # noqa: PLC0415
        import zipfile  # noqa: PLC0415

        self.keep = keep
        real = {os.path.realpath(p): p for p in paths}
        found = set()
        with open("/proc/self/maps") as f:
            for line in f:
                fields = line.split(maxsplit=5)
                if len(fields) == 6 and fields[5].strip() in real:
                    lo, hi = (int(x, 16) for x in fields[0].split("-"))
                    self.ranges.append((lo, hi))
                    found.add(fields[5].strip())
        self.ranges.sort()
        self.starts = [lo for lo, _ in self.ranges]
        for path in paths:
            with zipfile.ZipFile(path) as z:
                marks = [n for n in z.namelist() if n.endswith("/byteorder")]
                order = z.read(marks[0]).decode() if marks else "little"  # torch.load's default
            if order != sys.byteorder:
                self.enabled = False
                warnings.warn(f"spillway.zero_to_fp32: {path} is {order}-endian: torch byteswaps it in its mapping, "
                              "so its pages are not dropped and the conversion holds what it reads", stacklevel=3)
        missing = [real[r] for r in real if r not in found]
        if missing:
            warnings.warn(f"spillway.zero_to_fp32: no mapping of {', '.join(missing)} in /proc/self/maps (a file "
                          "replaced or deleted while converting?): its pages are not dropped, and the conversion "
                          "holds what it reads of it", stacklevel=3)

    def drop(self, tensor):
        """Drops the whole pages under `tensor` that lie in a mapping of a checkpoint file: clean
        private file pages, read again from the file if touched."""
        if not self.enabled:
            return
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


def _assemble(mapped, name, pieces, numel, dtype, shape, scratch):
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
        mapped.drop(piece)
        at += n
    if at != numel:
        raise ValueError(f"{name}: the checkpoint holds {at} of its {numel} elements (shape {tuple(shape)})")
    return out.view(shape)


def _load(path):
    try:
        return torch.load(path, map_location="cpu", mmap=True, weights_only=False)
    except ModuleNotFoundError as e:
        raise ValueError(f"{path}: its pickle names the module {e.name!r}, which is not installed here; install "
                         "what the training run had") from e
    except Exception as e:
        raise ValueError(f"{path}: not a readable DeepSpeed checkpoint file ({type(e).__name__}: {e}); "
                         "point CHECKPOINT_DIR at the directory save_checkpoint wrote") from e


def plan(checkpoint_dir, tag=None, exclude_frozen_parameters=False):
    """The output of DeepSpeed's zero_to_fp32 for `checkpoint_dir`, unread: (a list of _Tensor in
    DeepSpeed's order: buffers, frozen parameters, trainable parameters, tied aliases; the tag).
    Each _Tensor's read() holds the _Mapped that keeps the files mapped while any can be read.
    Every structural check is made here, before anything is written."""
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
    # DeepSpeed's own file discovery and order (ranks in natural order).
    model_files = ds.get_model_state_files(ds_dir)
    optim_files = ds.get_optim_files(ds_dir)
    other = [os.path.basename(f) for f in model_files + optim_files
             if "mp_rank_" in f and "mp_rank_00" not in os.path.basename(f)]
    experts = [os.path.basename(f) for f in glob.glob(os.path.join(ds_dir, "*expert*_model_states.pt"))]
    if other or experts:
        raise ValueError(f"{ds_dir} holds {'model-parallel' if other else 'expert-parallel'} files "
                         f"({(other or experts)[0]}, ...), which DeepSpeed's zero_to_fp32 does not read either; "
                         "convert it with DeepSpeed's ds_to_universal")
    models = [_load(f) for f in model_files]
    check = getattr(ds, "_raise_if_autoep_zero3_partitioned_state", None)
    for f, m in zip(model_files, models):
        if check is not None:
            check(m)
        for key in (k.BUFFER_NAMES, k.PARAM_SHAPES, "module"):
            if not isinstance(m, dict) or key not in m:
                raise ValueError(f"{f} is not a DeepSpeed model-states file (no {key!r})")
    optims = []
    for f in optim_files:
        loaded = _load(f)
        if not isinstance(loaded, dict) or not isinstance(loaded.get(k.OPTIMIZER_STATE_DICT), dict) or \
                k.ZERO_STAGE not in loaded[k.OPTIMIZER_STATE_DICT]:
            raise ValueError(f"{f} is not a ZeRO optimizer-states file (no {k.OPTIMIZER_STATE_DICT}.{k.ZERO_STAGE})")
        optims.append(loaded[k.OPTIMIZER_STATE_DICT])
    stage, world = optims[0][k.ZERO_STAGE], optims[0][k.PARTITION_COUNT]
    world = max(world) if isinstance(world, list) else world
    if world != len(optim_files):
        raise ValueError(f"expected {world} '*_optim_states.pt' under {ds_dir} but found {len(optim_files)}: an old "
                         "checkpoint overwritten, or a rank that did not save")
    if stage not in (1, 2, 3):
        raise ValueError(f"unknown ZeRO stage {stage} in {optim_files[0]}")
    if stage == 3 and len(model_files) != world:
        raise ValueError(f"expected {world} '*_model_states.pt' under {ds_dir} (one per rank under ZeRO-3) but found "
                         f"{len(model_files)}: a rank that did not save")
    groups_key = k.FP32_FLAT_GROUPS if stage == 3 else k.SINGLE_PARTITION_OF_FP32_GROUPS
    groups = []
    for f, o in zip(optim_files, optims):
        g = o.get(groups_key)
        if not isinstance(g, (list, tuple)) or not all(isinstance(t, torch.Tensor) and t.dim() == 1 for t in g):
            raise ValueError(f"{f}: {groups_key} is not a list of flat tensors")
        groups.append(list(g))
    sizes = [t.numel() for t in groups[0]]
    for f, g in zip(optim_files, groups):
        if [t.numel() for t in g] != sizes:
            raise ValueError(f"{f}: its flat groups hold {[t.numel() for t in g]} elements where rank 0's hold {sizes}; "
                             "the ranks' files are of different saves")

    mapped = _Mapped()
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
            sources = [first] if stage <= 2 else models
            frags = []
            for f, m in zip(model_files, sources):
                frag = (m.get(k.FROZEN_PARAM_FRAGMENTS) or {}).get(name)
                if not isinstance(frag, torch.Tensor):
                    raise ValueError(f"{f}: no fragment of the frozen parameter {name}")
                frags.append(frag.reshape(-1))
            out.append(_Tensor(name, shape, frags[0].dtype,
                               lambda b, f=frags, n=numel, s=shape, x=name: _assemble(mapped, x, f, n, f[0].dtype, s, b)))
    shapes = first[k.PARAM_SHAPES]
    if stage <= 2:
        if len(shapes) > len(sizes):
            raise ValueError(f"{model_files[0]} names {len(shapes)} parameter groups, the optimizer files hold {len(sizes)}")
        out += _zero2(mapped, groups, shapes, world, optims[0].get(k.PARAM_ALIGNMENT_PADDINGS))
    else:
        out += _zero3(mapped, groups, shapes, world)
    # As DeepSpeed's state_dict[alias] = state_dict[source]: an alias that is already a name keeps
    # its place, a new one goes last.
    by_name = {t.name: i for i, t in enumerate(out)}
    for alias, source in (first.get("shared_params") or {}).items():
        if source in by_name:
            t = out[by_name[source]]
            aliased = _Tensor(alias, t.shape, t.dtype, t.read)
            if alias in by_name:
                out[by_name[alias]] = aliased
            else:
                by_name[alias] = len(out)
                out.append(aliased)
    mapped.scan(model_files + optim_files, keep=(models, optims))
    return out, tag


def _zero2(mapped, groups, shapes, world, paddings):
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
                               lambda buf, p=parts, b=bounds, o=offset, n=numel, s=shape, x=name:
                               _assemble(mapped, x, _slices(p, b, o, n), n, p[0].dtype, s, buf)))
            offset += numel + (pads[i] if pads is not None else 0)
        # As DeepSpeed's tool: both sides aligned to 2 x world size before they are compared.
        align = 2 * world
        if -(-offset // align) * align != -(-bounds[-1] // align) * align:
            raise ValueError(f"parameter group {g}: the shapes consume {offset} elements of the {bounds[-1]} "
                             "the ranks hold; the checkpoint does not match its own shapes")
    return out


def _zero3(mapped, groups, shapes, world):
    bounds = [0]
    for flat in groups[0]:
        bounds.append(bounds[-1] + flat.numel())
    out, offset = [], 0
    for group_shapes in shapes:
        for name, shape in group_shapes.items():
            numel = math.prod(shape)
            part = -(-numel // world)
            out.append(_Tensor(name, shape, groups[0][0].dtype,
                               lambda buf, o=offset, p=part, n=numel, s=shape, x=name:
                               _assemble(mapped, x, [y for r in range(world) for y in _slices(groups[r], bounds, o, p)],
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
    """Writes the consolidated weights of a ZeRO-1/2/3 checkpoint to `output_dir` as safetensors
    (model.safetensors, or shards and model.safetensors.index.json), floating-point tensors in
    `dtype`, others as they are. Returns the files written. Every check of the checkpoint is made
    before the first file is opened; a failure before the commit leaves no file of this export."""
    if isinstance(dtype, str):
        if dtype.lower() not in _DTYPES:
            raise ValueError(f"--dtype {dtype}: use one of float32, float16, bfloat16")
        dtype = _DTYPES[dtype.lower()]
    max_shard_size = st.parse_size(max_shard_size, "--max_shard_size")
    tensors, _ = plan(checkpoint_dir, tag, exclude_frozen_parameters)
    out_dtype = {t.name: (dtype if t.dtype.is_floating_point else t.dtype) for t in tensors}
    layout = st.Plan([(t.name, t.shape, out_dtype[t.name]) for t in tensors], max_shard_size)
    # Two buffers for every tensor, as large as the largest: where it is assembled, and where it is
    # converted to `dtype` (a fresh tensor each would leave freed ones in glibc's heap).
    largest = max((math.prod(t.shape) for t in tensors), default=0)
    scratch = torch.empty(largest * max((t.dtype.itemsize for t in tensors), default=1), dtype=torch.uint8)
    converted = torch.empty(largest * dtype.itemsize, dtype=torch.uint8)
    writer = st.Writer(output_dir, layout)
    try:
        for t in tensors:
            value = t.read(scratch)
            if value.dtype != out_dtype[t.name]:
                target = converted.narrow(0, 0, value.numel() * dtype.itemsize).view(dtype).view(value.shape)
                value = target.copy_(value)
            writer.write(t.name, value)
            del value
        files = writer.commit()
    except BaseException:
        writer.abort()
        raise
    return files


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m spillway.zero_to_fp32", description=__doc__.split("\n\n")[0])
    p.add_argument("checkpoint_dir", help="the directory save_checkpoint wrote (holding `latest`)")
    p.add_argument("output_dir", help="where the safetensors files go")
    p.add_argument("--max_shard_size", default="5GB", help="largest shard (default 5GB, as DeepSpeed's tool)")
    p.add_argument("--dtype", default="float32", help="floating-point output dtype: float32 (default), float16, bfloat16")
    p.add_argument("-t", "--tag", default=None, help="the tag to convert (default: the one `latest` names)")
    p.add_argument("--exclude_frozen_parameters", action="store_true", help="leave out frozen parameters")
    # DeepSpeed's tool's other flags, taken so that its command lines run here unchanged: the
    # output is always safetensors, and there is no debug output.
    p.add_argument("--safe_serialization", action="store_true", help="accepted; the output is always safetensors")
    p.add_argument("-d", "--debug", action="store_true", help="accepted; no effect")
    a = p.parse_args(argv)
    try:
        files = convert(a.checkpoint_dir, a.output_dir, a.max_shard_size, a.dtype, a.tag, a.exclude_frozen_parameters)
    except (OSError, ValueError) as e:
        print(f"spillway.zero_to_fp32: {e}", file=sys.stderr)
        return 1
    except (KeyError, IndexError, TypeError, AttributeError, RuntimeError, NotImplementedError) as e:
        print(f"spillway.zero_to_fp32: {a.checkpoint_dir} is not a checkpoint this tool reads "
              f"({type(e).__name__}: {e}); nothing was written", file=sys.stderr)
        return 1
    for f in files:
        print(f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
