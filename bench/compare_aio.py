#!/usr/bin/env python3
"""Spillway's aio_handle against DeepSpeed's own aio op (JIT-built from the installed DeepSpeed, on
libaio), side by side in one run: the same locked tensors (each handle's own new_cpu_locked_tensor),
the same files, block size, queue depth and intra_op_parallelism.

  large: one 1 GiB tensor written (sync_pwrite) and read back (sync_pread)
  small: 256 tensors of 4 MiB read (async_pread each, then one wait), one file per tensor, the
         pattern of DeepSpeed's swap_in_tensors (where opening a file per call costs)

Both use O_DIRECT for these page-aligned locked tensors (Spillway falls back to buffered I/O only
for unaligned requests, docs/python.md). Every write is timed until fdatasync returns, for both, and
every file is dropped from the page cache (posix_fadvise DONTNEED) before it is read.
Medians of --reps, the two handles alternating. The ceiling for the small reads is fio (io_uring,
O_DIRECT, the same block size and queue depth) reading the same 256 files right after each handle,
cache dropped the same way, file after file as both handles issue them: a ratio to it near 1 means
the disk, not the handle, sets the pace.
Last line:
{"bench":"aio","write_vs_deepspeed":X,"read_vs_deepspeed":Y,"small_read_vs_deepspeed":Z,
 "small_read_spillway_vs_fio":F,"small_read_deepspeed_vs_fio":G}
(ratios > 1: Spillway faster)."""
import argparse
import json
import os
import shutil
import statistics
import subprocess
import tempfile
import time

import torch

import spillway

GIB, MIB = 1 << 30, 1 << 20


def drop_cache(path):
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fdatasync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def fio_read_seconds(paths, block_size, queue_depth):
    """fio reading `paths` whole, O_DIRECT through io_uring, `queue_depth` blocks in flight across
    the files: the device's own rate for this pattern. Seconds, from fio's own runtime. fio takes
    at most 4096 characters of file names, so it reads them through short hard links (same inodes)."""
    links = tempfile.mkdtemp(prefix="fio-", dir=os.path.dirname(paths[0]))
    try:
        for i, p in enumerate(paths):
            os.link(p, os.path.join(links, str(i)))
        out = subprocess.run(["fio", "--name=ceiling", f"--directory={links}",
                              "--filename=" + ":".join(str(i) for i in range(len(paths))), "--rw=read",
                              f"--bs={block_size}", "--direct=1", "--ioengine=io_uring",
                              f"--iodepth={queue_depth}", "--file_service_type=sequential",
                              "--output-format=json"],
                             capture_output=True, text=True)
    finally:
        shutil.rmtree(links)
    if out.returncode != 0:
        raise SystemExit(f"fio failed (exit {out.returncode}) reading {len(paths)} files:\n{out.stderr[:2000]}")
    job = json.loads(out.stdout)["jobs"][0]["read"]
    return job["io_bytes"] / job["bw_bytes"]


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dir", default=None, help="where the files go (default: a temp dir under $TMPDIR)")
    ap.add_argument("--large-mib", type=int, default=1024)
    ap.add_argument("--small-count", type=int, default=256)
    ap.add_argument("--small-mib", type=int, default=4)
    ap.add_argument("--block-size", type=int, default=1 << 20)
    ap.add_argument("--queue-depth", type=int, default=32)
    ap.add_argument("--reps", type=int, default=3)
    a = ap.parse_args()

    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    from deepspeed.ops.op_builder import AsyncIOBuilder

    spillway.deepspeed.uninstall()  # make sure the builder is DeepSpeed's own
    t0 = time.perf_counter()
    ds_op = AsyncIOBuilder().load(verbose=False)
    print(f"DeepSpeed aio op built/loaded in {time.perf_counter() - t0:.1f} s")
    handles = {
        "deepspeed": ds_op.aio_handle(a.block_size, a.queue_depth, False, True, 1),
        "spillway": spillway.aio_handle(a.block_size, a.queue_depth, False, True, 1),
    }
    root = tempfile.mkdtemp(prefix="spillway-aio-", dir=a.dir)
    large_n = a.large_mib * MIB // 4
    small_n = a.small_mib * MIB // 4
    data = {}
    for name, h in handles.items():
        big = h.new_cpu_locked_tensor(large_n, torch.empty(0, dtype=torch.float32))
        big.copy_(torch.randn(large_n))
        small = [h.new_cpu_locked_tensor(small_n, torch.empty(0, dtype=torch.float32)) for _ in range(a.small_count)]
        for s in small:
            s.copy_(torch.randn(small_n))
        data[name] = (big, small)
    if shutil.which("fio") is None:
        raise SystemExit("fio is not installed (scripts/install-deps installs it): it is the ceiling")
    times = {name: {"write": [], "read": [], "small_read": [], "fio_small_read": []} for name in handles}
    try:
        for rep in range(a.reps):
            order = list(handles) if rep % 2 == 0 else list(reversed(handles))
            for name in order:
                h, (big, small) = handles[name], data[name]
                path = os.path.join(root, f"{name}.large.swp")
                t = time.perf_counter()
                assert h.sync_pwrite(big, path) >= 0, name
                fd = os.open(path, os.O_RDONLY)  # both: time until the data is durable
                os.fdatasync(fd)
                os.close(fd)
                times[name]["write"].append(time.perf_counter() - t)
                drop_cache(path)
                # The first repetition reads into a fresh locked tensor and checks the data.
                target = h.new_cpu_locked_tensor(large_n, big) if rep == 0 else big
                t = time.perf_counter()
                assert h.sync_pread(target, path) >= 0, name
                times[name]["read"].append(time.perf_counter() - t)
                if rep == 0:
                    assert torch.equal(target, big), f"{name}: large read-back differs"
                    h.free_cpu_locked_tensor(target)
                    del target
                paths = [os.path.join(root, f"{name}.small{i}.swp") for i in range(len(small))]
                for s, p in zip(small, paths):
                    assert h.async_pwrite(s, p) == 0
                assert h.wait() == len(small)
                for p in paths:
                    drop_cache(p)
                t = time.perf_counter()
                for s, p in zip(small, paths):
                    assert h.async_pread(s, p) == 0
                assert h.wait() == len(small)
                times[name]["small_read"].append(time.perf_counter() - t)
                for p in paths:
                    drop_cache(p)
                times[name]["fio_small_read"].append(fio_read_seconds(paths, a.block_size, a.queue_depth))
    finally:
        for f in os.listdir(root):
            os.unlink(os.path.join(root, f))
        os.rmdir(root)
    med = {n: {k: statistics.median(v) for k, v in t.items()} for n, t in times.items()}
    large_bytes, small_bytes = large_n * 4, small_n * 4 * a.small_count
    print(f"\n{'':12}{'write 1 GiB':>14}{'read 1 GiB':>14}{'read 256 x 4 MiB':>20}{'fio, same files':>18}"
          f"   (GB/s, median of {a.reps})")
    for n in handles:
        print(f"{n:12}{large_bytes / med[n]['write'] / 1e9:14.2f}{large_bytes / med[n]['read'] / 1e9:14.2f}"
              f"{small_bytes / med[n]['small_read'] / 1e9:20.2f}{small_bytes / med[n]['fio_small_read'] / 1e9:18.2f}")
    r = {"bench": "aio",
         "write_vs_deepspeed": round(med["deepspeed"]["write"] / med["spillway"]["write"], 3),
         "read_vs_deepspeed": round(med["deepspeed"]["read"] / med["spillway"]["read"], 3),
         "small_read_vs_deepspeed": round(med["deepspeed"]["small_read"] / med["spillway"]["small_read"], 3),
         "small_read_spillway_vs_fio": round(med["spillway"]["fio_small_read"] / med["spillway"]["small_read"], 3),
         "small_read_deepspeed_vs_fio": round(med["deepspeed"]["fio_small_read"] / med["deepspeed"]["small_read"], 3)}
    print(json.dumps(r))


if __name__ == "__main__":
    main()
