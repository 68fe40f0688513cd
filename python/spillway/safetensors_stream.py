"""Sharded safetensors, written one tensor at a time through Spillway's aio_handle (io_uring).

The format (https://huggingface.co/docs/safetensors): 8 bytes of little-endian header length, a
JSON header naming each tensor's dtype, shape and [begin, end) byte offsets into the data that
follows, padded with spaces to a multiple of 8, then the raw little-endian data. Because the header
needs only shapes and dtypes, the whole layout is planned before any tensor exists in full, and
each tensor is then written at its offset as it arrives: nothing is gathered first.

Files follow transformers' names: one model.safetensors when the model fits one shard, else shards
(model-00001-of-00003.safetensors) and their index (model.safetensors.index.json: metadata.total_size
and a weight_map of tensor name -> file), so `safetensors.torch.load_file` reads each file and
`from_pretrained` reads the directory.
"""
import errno
import json
import math
import os
import re
import struct

import torch

from . import _spillway

_DTYPES = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
    torch.bool: "BOOL",
}
INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
_SHARD = re.compile(r"model-\d{5}-of-\d{5}\.safetensors")


_SIZE = re.compile(r"^\s*(\d+)\s*([KMGT]?)(i?)B?\s*$", re.IGNORECASE)


def parse_size(size, what="max_shard_size"):
    """A shard size as transformers, Accelerate and DeepSpeed's tools take it: bytes as an int, or
    text with huggingface_hub's units ('5GB' -> 5 * 10**9, '500MB'), or binary ones ('2GiB')."""
    if isinstance(size, int):
        return size
    m = _SIZE.match(str(size))
    if not m:
        raise ValueError(f"{what} {size}: use a size such as 5GB, 500MB or 2GiB")
    base = 1024 if m.group(3) else 1000
    return int(m.group(1)) * base ** " KMGT".index(m.group(2).upper() or " ")


def nbytes(shape, dtype):
    return math.prod(int(s) for s in shape) * dtype.itemsize


class Plan:
    """The shard layout of a list of (name, shape, dtype), in order, at most `max_shard_size` bytes
    of data per shard (a larger tensor gets a shard of its own, as transformers does)."""

    def __init__(self, entries, max_shard_size):
        if not isinstance(max_shard_size, int) or max_shard_size <= 0:
            raise ValueError(f"max_shard_size = {max_shard_size!r} is invalid; use a positive number of bytes")
        shards, current, size = [], [], 0
        seen = set()
        for name, shape, dtype in entries:
            if name in seen:
                raise ValueError(f"tensor name {name!r} appears twice; names in a checkpoint are unique")
            seen.add(name)
            if dtype not in _DTYPES:
                raise ValueError(f"{name}: dtype {dtype} has no safetensors code; supported: "
                                 f"{', '.join(str(d).replace('torch.', '') for d in _DTYPES)}")
            b = nbytes(shape, dtype)
            if current and size + b > max_shard_size:
                shards.append(current)
                current, size = [], 0
            current.append((name, tuple(int(s) for s in shape), dtype, b))
            size += b
        if current or not shards:
            shards.append(current)
        n = len(shards)
        self.sharded = n > 1
        self.files = [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)] if self.sharded else [SINGLE]
        self.where = {}       # name -> (file index, absolute offset in the file, bytes)
        self.headers = []
        self.total_size = 0
        for i, shard in enumerate(shards):
            header, offset = {"__metadata__": {"format": "pt"}}, 0
            for name, shape, dtype, b in shard:
                header[name] = {"dtype": _DTYPES[dtype], "shape": list(shape), "data_offsets": [offset, offset + b]}
                offset += b
            text = json.dumps(header, separators=(",", ":")).encode()
            text += b" " * (-len(text) % 8)
            self.headers.append(struct.pack("<Q", len(text)) + text)
            for name, shape, dtype, b in shard:
                begin = header[name]["data_offsets"][0]
                self.where[name] = (i, 8 + len(text) + begin, b)
            self.total_size += offset
        self.shapes = {name: (shape, dtype) for shard in shards for name, shape, dtype, _ in shard}


class Writer:
    """Writes a Plan into `directory`: shards under temporary names, each tensor with `write(name,
    tensor)` in any order, then `commit()` fsyncs and renames the shards, writes the index last (a
    sharded plan) and fsyncs the directory. A writer that is not committed (an exception, a kill)
    leaves only `*.tmp-<pid>` files behind and no index naming them; `abort()` removes them. The
    commit first removes what an earlier export left that would be read instead of its files (its
    index; its model.safetensors, which from_pretrained reads before an index), so one broken during
    the renames leaves a directory that fails to load by name rather than a mix of two exports.
    Once committed, an earlier export's shards that this one did not replace are removed."""

    def __init__(self, directory, plan, block_size=1 << 20, queue_depth=8, arena=None):
        if arena is None:
            # A private pageable arena just large enough for the engine's bounce buffers (8 of
            # block_size): the default arena maps 32 MiB regions, and a large arena would have all
            # its regions registered (pinned) as io_uring fixed buffers.
            arena = _spillway.HostArena(budget_bytes=(8 + 2) * block_size + (4 << 20), pinned=False,
                                        name="checkpoint-writer")
        self.directory, self.plan = directory, plan
        os.makedirs(directory, exist_ok=True)
        self._tmp = [os.path.join(directory, f"{f}.tmp-{os.getpid()}") for f in plan.files]
        self._fds = []
        self._written = set()
        self._handle = _spillway.aio_handle(block_size, queue_depth, False, True, 1, arena)
        try:
            for path, header in zip(self._tmp, plan.headers):
                fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o644)
                self._fds.append(fd)
                os.pwrite(fd, header, 0)
        except BaseException:
            self.abort()
            raise

    def write(self, name, tensor):
        if name not in self.plan.where:
            raise KeyError(f"{name!r} is not in the planned checkpoint")
        if name in self._written:
            raise ValueError(f"{name!r} was already written")
        shape, dtype = self.plan.shapes[name]
        if tuple(tensor.shape) != shape or tensor.dtype != dtype:
            raise ValueError(f"{name}: got {tensor.dtype} {tuple(tensor.shape)}, the plan says {dtype} {shape}")
        i, offset, b = self.plan.where[name]
        if b:
            data = tensor.detach()
            if data.device.type != "cpu":
                data = data.to("cpu")
            data = data.contiguous().reshape(-1).view(torch.uint8)
            if self._handle.async_pwrite(data, self._fds[i], offset) < 0 or self._handle.wait() < 0:
                raise OSError(f"writing {name} ({b} bytes) at offset {offset} of {self._tmp[i]}: "
                              f"{self._handle.get_last_error()}")
        self._written.add(name)

    def commit(self):
        missing = [n for n in self.plan.where if n not in self._written]
        if missing:
            raise ValueError(f"{len(missing)} planned tensors were never written, e.g. {missing[:3]}")
        for fd in self._fds:
            os.fsync(fd)
        self._close()
        # An index already here names the shards of an earlier export, which the renames below
        # replace one by one; an earlier single model.safetensors would be read before this
        # export's index. They go first, and durably: a commit broken between two renames then
        # leaves a directory that fails to load by name, never one that loads as a mix of the two.
        removed = False
        for stale in (INDEX, SINGLE) if self.plan.sharded else (INDEX,):
            try:
                os.unlink(os.path.join(self.directory, stale))
                removed = True
            except FileNotFoundError:
                pass
        if removed:
            _fsync_directory(self.directory)
        finals = [os.path.join(self.directory, f) for f in self.plan.files]
        for tmp, final in zip(self._tmp, finals):
            os.replace(tmp, final)
        if not self.plan.sharded:
            self._remove_orphans()
            return finals
        index = {"metadata": {"total_size": self.plan.total_size},
                 "weight_map": {name: self.plan.files[w[0]] for name, w in self.plan.where.items()}}
        tmp_index = os.path.join(self.directory, f"{INDEX}.tmp-{os.getpid()}")
        with open(tmp_index, "w") as f:
            json.dump(index, f, indent=2)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp_index, os.path.join(self.directory, INDEX))
        self._remove_orphans()
        return finals + [os.path.join(self.directory, INDEX)]

    def _remove_orphans(self):
        """Once this export is in place: the shards of an earlier one that no file of this one
        replaced (model-0000k-of-0000n names this plan does not use) are removed, as transformers'
        and Accelerate's saves remove them, then the directory is fsynced."""
        for name in os.listdir(self.directory):
            if _SHARD.fullmatch(name) and name not in self.plan.files:
                os.unlink(os.path.join(self.directory, name))
        _fsync_directory(self.directory)

    def abort(self):
        self._close()
        for tmp in self._tmp:
            try:
                os.unlink(tmp)
            except FileNotFoundError:
                pass

    def _close(self):
        if self._handle is not None:
            self._handle.close()
            self._handle = None
        while self._fds:
            os.close(self._fds.pop())


def _fsync_directory(directory):
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def load(directory):
    """{name: tensor} of a directory written by Writer (or by transformers): its model.safetensors,
    else every shard the index names (from_pretrained's order), read with safetensors' own loader."""
    from safetensors.torch import load_file

    if os.path.isfile(os.path.join(directory, SINGLE)):
        return load_file(os.path.join(directory, SINGLE))
    path = os.path.join(directory, INDEX)
    try:
        f = open(path)
    except FileNotFoundError:
        raise FileNotFoundError(errno.ENOENT, f"no {INDEX} or {SINGLE} in {directory}: not a whole export (a commit "
                                "broken during its renames removes it); export into it again", path) from None
    with f:
        weight_map = json.load(f)["weight_map"]
    out = {}
    for file in sorted(set(weight_map.values())):
        out.update(load_file(os.path.join(directory, file)))
    return out
