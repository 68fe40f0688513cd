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
import struct
import threading

import torch
from torch.serialization import get_crc32_options, set_crc32_options

from .. import _spillway
from .._log import logger
from ._aio import pinned_arena

# 32 MiB in flight, as fio's 32 x 1 MiB: with two 8 MiB buffers the disk idled whenever the one
# write in flight finished before the other buffer was full (saves at x0.93 of fio's O_DIRECT
# write rate; eight of 4 MiB: x1.07; docs/benchmarks.md, "Eight staging buffers").
STAGE_BYTES = 4 << 20
_STAGES = 8
_ALIGN = 4096  # O_DIRECT's granule of offsets, lengths and addresses
_buffered_said = set()  # directories without O_DIRECT, said once each
_layout_unknown = []  # why torch.save's archive was not one _ZipCrc knows, once it was not
_ZIP_CRC_LOCK = threading.Lock()
_zip_crc_off = [0, True]  # [writes with torch's CRC-32 off now, the setting before the first]


class _TorchCrcOff:
    """torch.save computes no CRC-32 of its zip records (it leaves 0 where it would write it;
    torch.serialization.set_crc32_options) from entry until release(), which the writer calls at
    the archive's first write (torch reads the setting as it opens its writer), or until exit. The
    setting is process-wide: a torch.save on another thread in that window, or one nested in the
    pickling, writes 0 too. Overlapping windows count in: the last one out restores what was set
    before the first one came in (a set_crc32_options call inside the window is undone). A child
    forked inside a window gets the setting from before it."""

    def __init__(self):
        self._pid = None

    def __enter__(self):
        with _ZIP_CRC_LOCK:
            if _zip_crc_off[0] == 0:
                _zip_crc_off[1] = get_crc32_options()
                set_crc32_options(False)
            _zip_crc_off[0] += 1
            self._pid = os.getpid()
        return self

    def release(self):
        with _ZIP_CRC_LOCK:
            if self._pid != os.getpid():  # released already, or entered in the parent of a fork
                return
            self._pid = None
            _zip_crc_off[0] -= 1
            if _zip_crc_off[0] == 0:
                set_crc32_options(_zip_crc_off[1])

    def __exit__(self, *exc):
        self.release()


def _after_fork_in_child():
    global _ZIP_CRC_LOCK
    _ZIP_CRC_LOCK = threading.Lock()  # another thread of the parent may have held it
    if _zip_crc_off[0]:
        _zip_crc_off[0] = 0
        set_crc32_options(_zip_crc_off[1])


os.register_at_fork(after_in_child=_after_fork_in_child)


class DirectFiles:
    """The staging buffers and their handles (one handle per buffer: a handle's wait() then waits
    for that buffer's write alone), made once per checkpoint engine and process, reused for every
    file it writes. Not thread-safe: one file at a time."""

    def __init__(self):
        arena = pinned_arena()
        # One bounce buffer each: every op's buffer is a staging buffer, in the arena.
        self._handles = [_spillway.aio_handle(block_size=1 << 20, queue_depth=16, arena=arena, bounce_buffers=1)
                         for _ in range(_STAGES)]
        example = torch.empty(0, dtype=torch.uint8)
        self._stages = [h.new_cpu_locked_tensor(STAGE_BYTES, example) for h in self._handles]
        self.pid = os.getpid()

    def write(self, path, save, name):
        """Writes `path` (created or truncated) with save(writer), where the writer takes what
        torch.save writes; returns the writer (its .crc and .bytes). `name` is the file the caller
        renames it to, for messages. On error the file's content is undefined: the caller removes it.
        torch computes no CRC-32 while it saves: the writer does, as the bytes pass (_ZipCrc).
        Where torch's archive is not the layout _ZipCrc knows, the file is written again with
        torch's CRC-32, as is every later file of the process (said once)."""
        if not _layout_unknown:
            try:
                with _TorchCrcOff() as off:
                    return self._write(path, save, name, _ZipCrc(), off.release)
            except ZipLayoutUnexpected as e:
                _layout_unknown.append(str(e))
                logger.warning("spillway.deepspeed: torch.save's zip archive for %s is not in the layout Spillway "
                               "computes its CRC-32 for (%s); it is written again, and checkpoint files from now "
                               "on, with torch's own CRC-32 (slower)", name, e)
        return self._write(path, save, name, None)

    def _write(self, path, save, name, zip_crc, first_write=None):
        fd, direct = self._open(path)
        try:
            writer = _Writer(self._handles, self._stages, fd, name)
            writer.direct, writer.zip, writer.first_write = direct, zip_crc, first_write
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


class ZipLayoutUnexpected(Exception):
    """What torch.save wrote is not the zip layout _ZipCrc knows: the file is written again with
    torch's own CRC-32."""


_LOCAL, _DESCRIPTOR, _CENTRAL = b"PK\x03\x04", b"PK\x07\x08", b"PK\x01\x02"
_END = (b"PK\x06\x06", b"PK\x05\x06")  # zip64 end of central directory, end of central directory


class _ZipCrc:
    """The CRC-32 of each record of torch.save's zip archive, computed as its bytes pass (ISA-L's,
    overlapping the disk), and written where torch, told not to compute it, left 0: the record's
    data descriptor and its central directory entry, both of which pass after the record's data.

    torch's writer (miniz) marks every record but an empty one "sizes and CRC in a data
    descriptor" and writes a record as its local header, its data in one write, then the
    descriptor in one write (an empty record is its header alone, sizes and CRC-32 0 in it). A write
    in a record's data is taken for its descriptor only where it is one (16 bytes, or 24 in the
    zip64 form) whose sizes are the data's bytes so far, and not 0 (a record's first write is its
    data, whatever its bytes); the central directory, held until the end, must then list
    exactly the records seen, at the offsets and sizes seen. Anything else raises
    ZipLayoutUnexpected (the caller writes the file again with torch's CRC-32): no byte of a
    record's data is ever changed in a file that is kept."""

    def __init__(self):
        self.pos = 0           # bytes of the archive seen
        self.records = []      # (local header offset, data bytes, crc)
        self._head = bytearray()  # the local header being read
        self._start = 0        # its offset
        self._data = None      # (data bytes so far, crc) while in a record's data
        self._tail = None      # the central directory and end records, held
        self.failed = None     # why the archive is not the layout known, once it is not

    def feed(self, view):
        """(what to write in place of `view`: itself or a patched copy, or None while the bytes are
        held; whether all of it is record data, whose CRC-32 the caller adds with data() as it
        copies it)."""
        if self.failed is not None:
            return view, False
        if self._tail is not None:
            self._tail += view
            return None, False
        try:
            return self._feed(view)
        except ZipLayoutUnexpected as e:
            # Not raised through torch.save (its writer would report a position error instead):
            # the bytes pass unchanged, and the writer raises this once torch.save returned.
            self.failed = str(e)
            return view, False

    def _feed(self, view):
        out, whole_data, i, n = view, False, 0, view.nbytes
        while i < n:
            if self._data is not None:
                size, crc = self._data
                part = view[i:]
                if size and part[:4] == _DESCRIPTOR and _descriptor_sizes(part) == (size, size):
                    patched = bytearray(view)
                    struct.pack_into("<I", patched, i + 4, crc)
                    self.records.append((self._start, size, crc))
                    self._data = None
                    out = memoryview(patched)
                elif i == 0:
                    whole_data = True  # the caller's data() adds it, a staging buffer at a time
                else:
                    self.data(part)
                break
            if not self._head:
                self._start = self.pos + i
                if view[i:i + 4] == _CENTRAL:
                    if i:
                        raise ZipLayoutUnexpected("the central directory begins inside a write")
                    self._tail = bytearray(view)
                    return None, False
            take = min(_header_bytes(self._head) - len(self._head), n - i)
            self._head += view[i:i + take]
            i += take
            if len(self._head) >= 4 and self._head[:4] != _LOCAL:
                raise ZipLayoutUnexpected(f"no local header at offset {self._start}")
            if len(self._head) >= 30 and len(self._head) == _header_bytes(self._head):
                if int.from_bytes(self._head[6:8], "little") & 8:
                    self._data = (0, 0)  # sizes and CRC-32 in the descriptor after the data
                elif struct.unpack_from("<III", self._head, 14) == (0, 0, 0):
                    self.records.append((self._start, 0, 0))  # an empty record: all in its header
                else:
                    raise ZipLayoutUnexpected(f"the record at offset {self._start} has its sizes in its header")
                self._head = bytearray()
        self.pos += n
        return out, whole_data

    def data(self, piece):
        size, crc = self._data
        self._data = (size + piece.nbytes, _spillway.crc32(piece, crc))

    def finish(self):
        """The held tail, each central directory entry's CRC-32 written in, after checking that it
        lists the records seen."""
        if self.failed is not None:
            raise ZipLayoutUnexpected(self.failed)
        if self._tail is None or self._data is not None or self._head:
            raise ZipLayoutUnexpected("the archive ended inside a record")
        try:
            return self._patch_central_directory()
        except (struct.error, IndexError) as e:  # an entry or extra field cut short
            raise ZipLayoutUnexpected(f"the central directory does not parse ({e})") from e

    def _patch_central_directory(self):
        t, at = self._tail, 0
        for start, size, crc in self.records:
            if t[at:at + 4] != _CENTRAL or len(t) < at + 46:
                raise ZipLayoutUnexpected(f"central directory entry {at} is not one")
            names, extras, comments = struct.unpack_from("<HHH", t, at + 28)
            comp, uncomp = struct.unpack_from("<II", t, at + 20)
            offset = struct.unpack_from("<I", t, at + 42)[0]
            z64 = _zip64(t[at + 46 + names:at + 46 + names + extras], uncomp, comp, offset)
            if z64 != (size, size, start):
                raise ZipLayoutUnexpected(f"central directory entry {at} lists {z64}, seen {(size, size, start)}")
            struct.pack_into("<I", t, at + 16, crc)
            at += 46 + names + extras + comments
        if t[at:at + 4] not in _END:
            raise ZipLayoutUnexpected(f"{len(self.records)} records, and the central directory lists more")
        return memoryview(t)


def _header_bytes(head):
    """A local header's length, name and extra field included, as far as `head` (its first bytes)
    tells: 30 until its fixed part is there."""
    if len(head) < 30:
        return 30
    return 30 + int.from_bytes(head[26:28], "little") + int.from_bytes(head[28:30], "little")


def _descriptor_sizes(part):
    """(compressed, uncompressed) of a write that is a whole data descriptor (16 bytes, or 24 in
    the zip64 form), else None."""
    if part.nbytes == 16:
        return struct.unpack_from("<II", part, 8)
    if part.nbytes == 24:
        return struct.unpack_from("<QQ", part, 8)
    return None


def _zip64(extra, uncomp, comp, offset):
    """(uncompressed, compressed, local header offset) of a central directory entry, the fields
    at 0xFFFFFFFF read from its zip64 extra field."""
    fields = [uncomp, comp, offset]
    at = 0
    while at + 4 <= len(extra):
        tag, size = struct.unpack_from("<HH", extra, at)
        if tag == 1:
            k = at + 4
            for j in range(3):
                if fields[j] == 0xFFFFFFFF:
                    fields[j] = struct.unpack_from("<Q", extra, k)[0]
                    k += 8
        at += 4 + size
    return tuple(fields)


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
        self.zip = None  # a _ZipCrc where torch.save computes no CRC-32 (DirectFiles.write)
        self.first_write = None  # called at the first write (_TorchCrcOff.release)
        self.crc = 0
        self.bytes = 0

    def write(self, data):
        if self.first_write is not None:
            self.first_write, release = None, self.first_write
            release()
        view = memoryview(data).cast("B")
        n = view.nbytes
        whole_data = False
        if self.zip is not None:
            view, whole_data = self.zip.feed(view)
        if view is not None:  # None: the archive's tail, held until finish()
            self._put(view, whole_data)
        self.bytes += n
        return n

    def _put(self, view, whole_data=False):
        """Copies `view` into the staging buffers, its CRC32C (and its zip CRC-32 where it is a
        record's data) taken a buffer's worth at a time, so that they overlap the disk."""
        n, done = view.nbytes, 0
        while done < n:
            stage = self._views[self._at]
            take = min(n - done, STAGE_BYTES - self._fill)
            piece = view[done:done + take]
            self.crc = _spillway.crc32c(piece, self.crc)
            if whole_data:
                self.zip.data(piece)
            stage[self._fill:self._fill + take] = piece
            self._fill += take
            done += take
            if self._fill == STAGE_BYTES:
                self._submit(STAGE_BYTES)

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
        if self.zip is not None:
            self._put(self.zip.finish())
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
