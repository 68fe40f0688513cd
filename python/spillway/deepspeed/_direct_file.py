"""A checkpoint file written through Spillway's aio op with O_DIRECT (Note [DeepSpeed checkpoints]
in docs/deepspeed.md). What torch.save writes is copied into page-aligned staging buffers in the
pinned arena; each full buffer is one async write at its offset, on a handle of its own, while the
next buffer fills, so the disk writes one buffer while torch.save fills the other. The last partial
block goes out zero-padded and the file is then cut to its length and fsynced. No page cache holds
the file afterwards (the buffered writer left every byte of it dirty in the page cache, which the
kernel's writeback then throttled). The CRC32C and length of what went in are kept, as the
buffered writer kept them. Where the filesystem refuses O_DIRECT (at open, as tmpfs does, or at the
first write, as some FUSE and NFS mounts do) the file is written buffered, said once per directory;
SPILLWAY_CHECKPOINT_DIRECT=0 asks for buffered writes everywhere. Private: _checkpoint.py writes
every checkpoint file through it.
"""
import errno
import os

import torch

from .. import _spillway
from .._log import logger
from ._aio import pinned_arena

STAGE_BYTES = 8 << 20  # per staging buffer: 8 MiB holds the disk busy as 16 did (measured)
_STAGES = 2
_ALIGN = 4096  # O_DIRECT's granule of offsets, lengths and addresses
_buffered_said = set()  # directories without O_DIRECT, said once each


class DirectFiles:
    """The staging buffers and their handles (one handle per buffer: a handle's wait() then waits
    for that buffer's write alone), made once per checkpoint engine and process, reused for every
    file it writes. Not thread-safe: one file at a time."""

    def __init__(self):
        arena = pinned_arena()
        self._handles = [_spillway.aio_handle(block_size=1 << 20, queue_depth=16, arena=arena)
                         for _ in range(_STAGES)]
        example = torch.empty(0, dtype=torch.uint8)
        self._stages = [h.new_cpu_locked_tensor(STAGE_BYTES, example) for h in self._handles]
        self.pid = os.getpid()

    def write(self, path, save, name):
        """Writes `path` (created or truncated) with save(writer), where the writer takes what
        torch.save writes; returns the writer (its .crc and .bytes). `name` is the file the caller
        renames it to, for messages. On error the file's content is undefined: the caller removes it."""
        fd, direct = self._open(path)
        try:
            writer = _Writer(self._handles, self._stages, fd, name)
            writer.direct = direct
            try:
                save(writer)
                writer.finish()
            finally:
                writer.drain()  # no write may still read a staging buffer the next file fills
        finally:
            os.close(fd)
        return writer

    def _open(self, path):
        """(fd, True) for `path` opened for writing with O_DIRECT where the filesystem takes it,
        else (fd, False), buffered."""
        flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC
        if os.environ.get("SPILLWAY_CHECKPOINT_DIRECT", "1") == "0":
            return os.open(path, flags, 0o644), False
        try:
            fd = os.open(path, flags | os.O_DIRECT, 0o644)
        except OSError as e:
            if e.errno != errno.EINVAL:
                raise
            return self._buffered(path, flags, "refuses O_DIRECT at open")
        # Some filesystems (FUSE, some NFS mounts) take the flag and refuse the first aligned write.
        probe = self._handles[0]
        if probe.async_pwrite(self._stages[0][:_ALIGN], fd, 0) != 0 or probe.wait() != 1:
            why = probe.get_last_error()
            os.close(fd)
            if "Invalid argument" not in why:
                raise _spillway.IoError(f"writing a checkpoint file at {path}: {why}")
            return self._buffered(path, flags, "refuses O_DIRECT writes")
        return fd, True

    @staticmethod
    def _buffered(path, flags, why):
        directory = os.path.dirname(os.path.abspath(path))
        if directory not in _buffered_said:
            _buffered_said.add(directory)
            logger.info("spillway.deepspeed: %s %s; checkpoint files there are written buffered", directory, why)
        return os.open(path, flags, 0o644), False


class _Writer:
    """torch.save's file: write() copies into the staging buffer being filled and hands it to
    its handle when full."""

    def __init__(self, handles, stages, fd, name):
        self._handles, self._fd, self._path = handles, fd, name
        self._stages = stages
        self._views = [memoryview(t.numpy()) for t in stages]
        self._at = 0       # the staging buffer being filled
        self._fill = 0     # bytes in it
        self._offset = 0   # its offset in the file
        self._pending = [False] * len(stages)
        self.direct = False  # set by DirectFiles.write: written with O_DIRECT
        self.crc = 0
        self.bytes = 0

    def write(self, data):
        view = memoryview(data).cast("B")
        self.crc = _spillway.crc32c(view, self.crc)
        n, done = view.nbytes, 0
        while done < n:
            stage = self._views[self._at]
            take = min(n - done, STAGE_BYTES - self._fill)
            stage[self._fill:self._fill + take] = view[done:done + take]
            self._fill += take
            done += take
            if self._fill == STAGE_BYTES:
                self._submit(STAGE_BYTES)
        self.bytes += n
        return n

    def flush(self):
        pass

    def _submit(self, length):
        """The filled buffer goes to the disk at its offset; the next one is made free to fill."""
        i = self._at
        if self._handles[i].async_pwrite(self._stages[i][:length], self._fd, self._offset) != 0:
            raise _spillway.IoError(f"writing checkpoint file {self._path} at offset {self._offset}: "
                                    f"{self._handles[i].get_last_error()}")
        self._pending[i] = True
        self._offset += length
        self._fill = 0
        self._at = (i + 1) % len(self._stages)
        self._wait(self._at)

    def _wait(self, i):
        if self._pending[i]:
            self._pending[i] = False
            if self._handles[i].wait() != 1:
                raise _spillway.IoError(f"writing checkpoint file {self._path}: {self._handles[i].get_last_error()}")

    def finish(self):
        """The last partial block (zero-padded to the O_DIRECT granule), every write waited for,
        the file cut to its length and fsynced."""
        if self._fill > 0:
            padded = -(-self._fill // _ALIGN) * _ALIGN
            self._views[self._at][self._fill:padded] = bytes(padded - self._fill)
            self._submit(padded)
        self.drain(raise_errors=True)
        os.ftruncate(self._fd, self.bytes)
        os.fsync(self._fd)

    def drain(self, raise_errors=False):
        """Waits for every staging buffer's write, whatever fails on the way; with `raise_errors`
        the first failure is raised once all are waited for."""
        first = None
        for i in range(len(self._stages)):
            try:
                self._wait(i)
            except BaseException as e:  # noqa: BLE001 (every buffer is waited for first)
                first = first or e
        if first is not None and raise_errors:
            raise first
