"""A fuzzer of aio_handle call sequences (issue "No byte lands in the wrong place", Also): random
sequences of async and sync writes and reads by fd and by path, interleaved with opening, dup'ing
and closing descriptors and with renaming, unlinking and re-creating paths, between waits. A model
follows every inode (a write goes to the inode the fd or path names at the time of the call), and
after each wait() every inode's bytes (read through a witness descriptor, so unlinked ones too) must
equal the model's. Seeded; both backends."""
import os
import random

import pytest
import torch

import spillway

NAMES = ["a", "b", "c", "d"]


class Model:
    def __init__(self, root):
        self.root = root
        self.inodes = {}   # inode key -> bytearray (the expected contents)
        self.witness = {}  # inode key -> an O_RDONLY fd kept open to read it back
        self.paths = {}    # name -> inode key
        self.fds = {}      # fd -> inode key (the caller's descriptors)
        self.pending = {}  # inode key -> [(start, end)] of async writes not yet waited for

    def path(self, name):
        return os.path.join(self.root, name)

    def key(self, fd):
        st = os.fstat(fd)
        return (st.st_dev, st.st_ino)

    def create(self, name):
        # A new inode at the path (truncating the old one under in-flight writes would make the
        # outcome depend on timing): the old inode lives on through its descriptors.
        if name in self.paths:
            os.unlink(self.path(name))
            del self.paths[name]
        fd = os.open(self.path(name), os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        k = self.key(fd)
        self.inodes[k] = bytearray()
        self.witness[k] = os.open(self.path(name), os.O_RDONLY)
        self.paths[name] = k
        os.close(fd)

    def write(self, k, offset, data):
        buf = self.inodes[k]
        if len(buf) < offset + len(data):
            buf.extend(bytes(offset + len(data) - len(buf)))
        buf[offset:offset + len(data)] = data

    def check_all(self, log):
        for k, want in self.inodes.items():
            got = os.pread(self.witness[k], len(want) + 1, 0)
            if got != bytes(want):
                bad = next((i for i in range(min(len(got), len(want))) if got[i] != want[i]), None)
                ops = [o for o in log if o[-1] == k][-6:]
                raise AssertionError(f"inode {k}: {len(got)} bytes on disk, the model has {len(want)}; "
                                     f"first differing byte {bad}; its last writes: {ops}")

    def close(self):
        for fd in list(self.fds) + list(self.witness.values()):
            os.close(fd)


def run(seed, backend, root, steps=800):
    rng = random.Random(seed)
    h = spillway.aio_handle(block_size=rng.choice([1024, 4096, 1 << 14]), queue_depth=8,
                            backend=backend)
    m = Model(root)
    for name in NAMES[:2]:
        m.create(name)
    keep = []  # tensors of async writes, alive until the wait
    log = []   # the writes, for the failure message
    try:
        for step in range(steps):
            op = rng.random()
            live = [n for n in NAMES if n in m.paths]
            if op < 0.08:                                  # create or re-create a path
                m.create(rng.choice(NAMES))
            elif op < 0.14 and live:                       # open a descriptor on a path
                name = rng.choice(live)
                fd = os.open(m.path(name), os.O_RDWR)
                m.fds[fd] = m.paths[name]
            elif op < 0.18 and m.fds:                      # dup one
                fd = rng.choice(list(m.fds))
                m.fds[os.dup(fd)] = m.fds[fd]
            elif op < 0.26 and m.fds:                      # close one (its number is reused later)
                fd = rng.choice(list(m.fds))
                os.close(fd)
                del m.fds[fd]
            elif op < 0.32 and live:                       # rename over another name (or a free one)
                src, dst = rng.choice(live), rng.choice(NAMES)
                if src != dst:
                    os.replace(m.path(src), m.path(dst))
                    m.paths[dst] = m.paths.pop(src)
            elif op < 0.36 and live:                       # unlink
                name = rng.choice(live)
                os.unlink(m.path(name))
                del m.paths[name]
            elif op < 0.80 and (live or m.fds):            # a write, by fd or by path
                sync = rng.random() < 0.4 and live          # DeepSpeed's sync ops take a path
                by_fd = not sync and m.fds and (not live or rng.random() < 0.5)
                target = rng.choice(list(m.fds)) if by_fd else m.path(rng.choice(live))
                k = m.fds[target] if by_fd else m.paths[os.path.basename(target)]
                offset = rng.choice([0, 4096, 8192, 65536])
                n = rng.choice([4096, 12288, 65536, 3000, 777])
                if any(s < offset + n and offset < e for s, e in m.pending.get(k, [])):
                    continue                               # overlapping async writes: order undefined
                src = torch.randint(0, 256, (n,), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed * 100000 + step))
                log.append(("sync_pwrite" if sync else "async_pwrite", target, offset, n, k))
                if not sync:
                    assert h.async_pwrite(src, target, offset) == 0, h.get_last_error()
                    keep.append(src)
                    m.pending.setdefault(k, []).append((offset, offset + n))
                else:
                    # As DeepSpeed's: it completes the async ops pending before it too, and counts them.
                    pending = sum(len(v) for v in m.pending.values())
                    assert h.sync_pwrite(src, target, offset) == 1 + pending, h.get_last_error()
                    keep.clear()
                    m.pending.clear()
                m.write(k, offset, bytes(src.numpy()))
            elif op < 0.90 and (live or m.fds):            # a sync read, checked against the model
                assert h.wait() >= 0, h.get_last_error()
                keep.clear()
                m.pending.clear()
                if not live:
                    continue
                target = m.path(rng.choice(live))           # sync ops take a path
                k = m.paths[os.path.basename(target)]
                want = m.inodes[k]
                if len(want) == 0:
                    continue
                offset = rng.choice([0, 4096]) if len(want) > 4096 else 0
                n = min(len(want) - offset, rng.choice([4096, 8192, 65536]))
                if n <= 0:
                    continue
                dst = torch.zeros(n, dtype=torch.uint8)
                assert h.sync_pread(dst, target, offset) == 1, h.get_last_error()
                assert bytes(dst.numpy()) == bytes(want[offset:offset + n]), (seed, step, "read back", target)
            else:                                          # wait, then every inode must match
                assert h.wait() >= 0, h.get_last_error()
                keep.clear()
                m.pending.clear()
                m.check_all(log)
        assert h.wait() >= 0, h.get_last_error()
        m.check_all(log)
    finally:
        h.close()
        m.close()


@pytest.mark.parametrize("backend", ["uring", "thread_pool"])
@pytest.mark.parametrize("seed", [1, 2, 3, 4])
def test_every_inode_holds_what_the_call_sequence_wrote(tmp_path, seed, backend):
    run(seed, backend, str(tmp_path))
