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


def run(pythonpath, d, n):
    env = dict(os.environ, PYTHONPATH=pythonpath)
    out = subprocess.run([sys.executable, "-c", CHILD, d, str(n)], env=env, capture_output=True,
                         text=True)
    if out.returncode != 0:
        sys.exit(f"compare_builds_aio: the build at {pythonpath} failed:\n{out.stderr}")
    return [float(x) for x in out.stdout.split()[-2:]]


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--before", required=True, help="PYTHONPATH of the build before the change")
    ap.add_argument("--after", required=True, help="PYTHONPATH of the build after the change")
    ap.add_argument("--ops", type=int, default=20000)
    ap.add_argument("--rounds", type=int, default=5)
    a = ap.parse_args()
    for p in (a.before, a.after):
        if not os.path.isdir(os.path.join(p, "spillway")):
            sys.exit(f"compare_builds_aio: {p} has no spillway package; pass a build's python directory")
    sync_r, async_r, rows = [], [], []
    with tempfile.TemporaryDirectory() as d:
        print("round  sync before  sync after  async before  async after   (ops/s)")
        for r in range(a.rounds):
            first, second = (a.before, a.after) if r % 2 == 0 else (a.after, a.before)
            x = run(first, d, a.ops)
            y = run(second, d, a.ops)
            before, after = (x, y) if r % 2 == 0 else (y, x)
            rows.append(before + after)
            sync_r.append(after[0] / before[0])
            async_r.append(after[1] / before[1])
            print(f"{r:5d}  {before[0]:11.0f}  {after[0]:10.0f}  {before[1]:12.0f}  {after[1]:11.0f}")
    med = [statistics.median(r[i] for r in rows) for i in range(4)]
    print(f"  med  {med[0]:11.0f}  {med[2]:10.0f}  {med[1]:12.0f}  {med[3]:11.0f}")
    for name, v in (("sync", sync_r), ("async", async_r)):
        print(f"{name}: after / before x{statistics.median(v):.3f} (range {min(v):.3f}-{max(v):.3f}), "
              "the median of the rounds' ratios")
    print(json.dumps({"bench": "aio_builds", "sync_ratio": round(statistics.median(sync_r), 3),
                      "sync_range": [round(min(sync_r), 3), round(max(sync_r), 3)],
                      "async_ratio": round(statistics.median(async_r), 3),
                      "async_range": [round(min(async_r), 3), round(max(async_r), 3)]}))


if __name__ == "__main__":
    main()
