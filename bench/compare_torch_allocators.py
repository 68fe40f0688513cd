"""Side by side, interleaved: torch's default CPU allocator against Spillway's router outside a tag
scope (the fast path every untagged allocation takes after spillway.install()), and inside one.

    PYTHONPATH=build/default/python python3 bench/compare_torch_allocators.py [--rounds 9]
    python3 bench/compare_torch_allocators.py --before OLD/python --after build/ci/python

With --before and --after (two builds' python folders, for a change that moves code but must not
slow it): the router and the tagged path of each build, alternating, and the ratio after/before.

Each round runs one fresh interpreter per variant, alternating which goes first (install() is once
per process and cannot be undone). Each interpreter times N allocate + free pairs of a few sizes
through torch's current CPU allocator, in C++ (the interpreter's ~1 us per torch.empty would hide
the allocator), and prints ns per pair. Reported: the median per variant and the ratio router/torch with its
spread (min..max over rounds). The router's budget in the ticket: at most 2% over torch's outside a
scope."""
import argparse
import os
import statistics
import subprocess
import sys

CHILD = r"""
import sys, contextlib, torch, spillway
mode = sys.argv[1]
if mode not in ("torch", "torch-aa"):
    spillway.install()
scope = spillway.tag("transient", "step") if mode == "tagged" else contextlib.nullcontext()
n = int(sys.argv[2])
res = []
with scope:
    for size in (64, 4096, 1 << 16):
        spillway._spillway._time_cpu_allocator(size, n // 10)    # warm up
        res.append(min(spillway._spillway._time_cpu_allocator(size, n) for _ in range(3)))
print(" ".join(f"{r:.2f}" for r in res))
"""


def child(mode, n, pythonpath=None):
    env = None
    if pythonpath is not None:
        env = dict(os.environ, PYTHONPATH=pythonpath)
    out = subprocess.run([sys.executable, "-c", CHILD, mode, str(n)], capture_output=True, text=True,
                         check=True, env=env).stdout.split()
    return [float(x) for x in out]


def compare_builds(args):
    builds = {"before": args.before, "after": args.after}
    runs = {(b, m): [] for b in builds for m in ("router", "tagged")}
    for r in range(args.rounds):
        order = ("before", "after") if r % 2 == 0 else ("after", "before")
        for m in ("router", "tagged"):
            for b in order:
                runs[(b, m)].append(child(m, args.n, builds[b]))
    print(f"allocate + free through Spillway's router, ns per pair, median of {args.rounds} interleaved rounds")
    print(f"{'size':>7} {'path':>7} {'before':>8} {'after':>8}  after/before (min..max)")
    for i, s in enumerate(("64 B", "4 KiB", "64 KiB")):
        for m in ("router", "tagged"):
            before = [x[i] for x in runs[("before", m)]]
            after = [x[i] for x in runs[("after", m)]]
            ratios = [a / b for a, b in zip(after, before)]
            print(f"{s:>7} {m:>7} {statistics.median(before):8.2f} {statistics.median(after):8.2f}  "
                  f"x{statistics.median(ratios):.3f} ({min(ratios):.3f}..{max(ratios):.3f})")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--n", type=int, default=2000000)
    ap.add_argument("--before", help="an older build's python folder (with --after)")
    ap.add_argument("--after", help="a newer build's python folder (with --before)")
    args = ap.parse_args()
    if (args.before is None) != (args.after is None):
        ap.error("--before and --after go together: two builds' python folders")
    if args.before is not None:
        compare_builds(args)
        return
    modes = ("torch", "torch-aa", "router", "tagged")  # torch-aa: torch again, the A/A noise band
    runs = {m: [] for m in modes}
    for r in range(args.rounds):
        order = modes if r % 2 == 0 else tuple(reversed(modes))
        for m in order:
            runs[m].append(child(m, args.n))
    sizes = ("64 B", "4 KiB", "64 KiB")
    print(f"allocate + free through torch's CPU allocator, ns per pair, median of {args.rounds} interleaved rounds")
    print(f"{'size':>7} {'torch':>8} {'router':>8} {'tagged':>8}  router/torch (min..max)  "
          f"A/A torch/torch (min..max)  tagged/torch")
    for i, s in enumerate(sizes):
        med = {m: statistics.median(x[i] for x in runs[m]) for m in modes}
        ratios = [a[i] / b[i] for a, b in zip(runs["router"], runs["torch"])]
        aa = [a[i] / b[i] for a, b in zip(runs["torch-aa"], runs["torch"])]
        print(f"{s:>7} {med['torch']:8.2f} {med['router']:8.2f} {med['tagged']:8.2f}  "
              f"x{statistics.median(ratios):.3f} ({min(ratios):.3f}..{max(ratios):.3f})  "
              f"x{statistics.median(aa):.3f} ({min(aa):.3f}..{max(aa):.3f})      x{med['tagged'] / med['torch']:.2f}")


if __name__ == "__main__":
    main()
