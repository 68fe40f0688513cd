#!/usr/bin/env python3
"""spillway.aio_handle's per-call cost in two builds of the package, side by side: for a change that
moves code but must not slow it (the aio library split out of the binding, issue 40), the build
before and the build after, each in its own interpreter, alternating.

Each run times N small ops through one handle on page-cache files (buffered: 4 KiB at odd offsets
never take O_DIRECT), so the device is out of the measurement and what is left is the call path:
the binding's tensor checks, the GIL release, the handle's table lookup and the engine's submit and
wait. Two shapes: sync_pwrite of 4 KiB (one call, one op, one wait), and 64 async_pread of 4 KiB then
one wait(). Prints each round's ops/s for both builds, then the median ratio (after / before) with
its range over the rounds.

--swap times DeepSpeed's swap pattern instead, through spillway.deepspeed's routed handle (for a
change to how a swap reaches the NVMe arena): a swap folder registered as a swapper registers it,
then per round 32 async_pwrite of 1 MiB swap files and one wait(), and 32 async_pread of them and one
wait() (O_DIRECT on the swap folder's disk, CRC32C on both sides). Reported as MB/s of writes and
of reads; the swap folder is --dir (default: $TMPDIR).

  python3 bench/compare_builds_aio.py --before /path/to/old/build/python --after build/default/python
Last line: {"bench":"aio_builds","sync_ratio":X,"async_ratio":Y,...} (ratio > 1: after is faster)."""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

CHILD = r"""
import os, sys, time, torch, spillway
d, n = sys.argv[1], int(sys.argv[2])
h = spillway.aio_handle(block_size=1 << 20, queue_depth=32)
buf = torch.zeros(4096, dtype=torch.uint8)
path = os.path.join(d, "f")
with open(path, "wb") as f:
    f.write(b"\0" * (4096 * 80))
h.sync_pwrite(buf, path, 1)                  # the file enters the handle's table
t = time.perf_counter()
for i in range(n):
    assert h.sync_pwrite(buf, path, 1 + 4096 * (i % 64)) == 1
sync = n / (time.perf_counter() - t)
bufs = [torch.zeros(4096, dtype=torch.uint8) for _ in range(64)]
t = time.perf_counter()
for _ in range(n // 64):
    for j, b in enumerate(bufs):
        assert h.async_pread(b, path, 1 + 4096 * j) == 0
    assert h.wait() == 64
asyn = (n // 64) * 64 / (time.perf_counter() - t)
print(f"{sync} {asyn}")
"""


# Both builds' spellings of a swapper's registration: the folder's store on the swapper's handle's
# engine (after), or a store with an engine of its own (before).
SWAP_CHILD = r"""
import inspect, os, sys, time, torch, spillway
from spillway.deepspeed import _swap
d, n = sys.argv[1], int(sys.argv[2])
folder = os.path.join(d, "zero_stage_3", "optimizer", "rank0")
os.makedirs(folder, exist_ok=True)
inner = spillway.aio_handle(block_size=1 << 20, queue_depth=32)
if "handle" in inspect.signature(_swap.register).parameters:
    _swap.register(folder, d, inner)
else:
    _swap.register(folder, d, 1 << 20, 32)
h = _swap.Handle(inner)
bufs = [torch.randn(1 << 18) for _ in range(32)]  # 1 MiB each
paths = [os.path.join(folder, f"exp_avg-{i}.tensor.swp") for i in range(32)]
for b, p in zip(bufs, paths):
    h.async_pwrite(b, p)
assert h.wait() == 32
wt = rt = 0.0
for _ in range(n):
    t = time.perf_counter()
    for b, p in zip(bufs, paths):
        assert h.async_pwrite(b, p) == 0
    assert h.wait() == 32
    wt += time.perf_counter() - t
    t = time.perf_counter()
    for b, p in zip(bufs, paths):
        assert h.async_pread(b, p) == 0
    assert h.wait() == 32
    rt += time.perf_counter() - t
mb = n * 32 * (1 << 20) / 1e6
print(f"{mb / wt} {mb / rt}")
"""


def run(pythonpath, d, n, child=CHILD):
    env = dict(os.environ, PYTHONPATH=pythonpath)
    out = subprocess.run([sys.executable, "-c", child, d, str(n)], env=env, capture_output=True,
                         text=True)
    if out.returncode != 0:
        sys.exit(f"compare_builds_aio: the build at {pythonpath} failed:\n{out.stderr}")
    return [float(x) for x in out.stdout.split()[-2:]]


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--before", required=True, help="PYTHONPATH of the build before the change")
    ap.add_argument("--after", required=True, help="PYTHONPATH of the build after the change")
    ap.add_argument("--ops", type=int, default=20000, help="ops per run (--swap: write+read rounds per run)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--swap", action="store_true", help="DeepSpeed's swap pattern through the routed handle")
    ap.add_argument("--dir", default=None, help="where the files go (default: $TMPDIR)")
    a = ap.parse_args()
    for p in (a.before, a.after):
        if not os.path.isdir(os.path.join(p, "spillway")):
            sys.exit(f"compare_builds_aio: {p} has no spillway package; pass a build's python directory")
    names, unit, child = (("swap_write", "swap_read"), "MB/s", SWAP_CHILD) if a.swap else \
        (("sync", "async"), "ops/s", CHILD)
    ratios, rows = ([], []), []
    with tempfile.TemporaryDirectory(dir=a.dir) as d:
        print(f"round  {names[0]:>12} before  after  {names[1]:>12} before  after   ({unit})")
        for r in range(a.rounds):
            first, second = (a.before, a.after) if r % 2 == 0 else (a.after, a.before)
            x = run(first, d, a.ops, child)
            y = run(second, d, a.ops, child)
            before, after = (x, y) if r % 2 == 0 else (y, x)
            rows.append(before + after)
            for i in range(2):
                ratios[i].append(after[i] / before[i])
            print(f"{r:5d}  {before[0]:19.0f}  {after[0]:5.0f}  {before[1]:19.0f}  {after[1]:5.0f}")
    med = [statistics.median(r[i] for r in rows) for i in range(4)]
    print(f"  med  {med[0]:19.0f}  {med[2]:5.0f}  {med[1]:19.0f}  {med[3]:5.0f}")
    out = {"bench": "aio_builds_swap" if a.swap else "aio_builds"}
    for name, v in zip(names, ratios):
        print(f"{name}: after / before x{statistics.median(v):.3f} (range {min(v):.3f}-{max(v):.3f}), "
              "the median of the rounds' ratios")
        out[f"{name}_ratio"] = round(statistics.median(v), 3)
        out[f"{name}_range"] = [round(min(v), 3), round(max(v), 3)]
    print(json.dumps(out))


if __name__ == "__main__":
    main()
