#!/usr/bin/env python3
"""A ZeRO-Infinity training step, plain DeepSpeed against DeepSpeed after spillway.deepspeed.install(),
interleaved, each run a process of its own.

    PYTHONPATH=build/default/python python3 bench/compare_zero_infinity.py [--rounds 5] [--steps 20]

The run is tests/python/workers/ds_step.py's `bf16-infinity` variant (the equivalence test's): the
real DeepSpeed 0.19.8 on its CPU accelerator, bf16, optimizer state and parameters on NVMe with
every sub-group and weight above DeepSpeed's swap threshold, the optimizer state pipelined, the swap
folder under --dir. Plain DeepSpeed swaps through its own aio op (libaio, JIT-built and cached) and
steps with DeepSpeedCPUAdam; Spillway's run swaps through Spillway's aio op (io_uring) and steps
with the fused pass. Per run, the median time of a whole step (forward, backward, engine.step) over
the steps after the first three; per round, the ratio plain / Spillway (> 1: Spillway faster).
Last line: one JSON object."""
import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile

import torch

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "python", "workers", "ds_step.py")


def one(which, steps, where, width):
    out = os.path.join(where, f"{which}.pt")
    p = subprocess.run([sys.executable, WORKER, which, str(steps), out, "AdamW", "bf16-infinity"],
                       capture_output=True, text=True, timeout=1800,
                       env=dict(os.environ, SPILLWAY_DS_STEP_WIDTH=str(width)))
    if p.returncode != 0:
        raise SystemExit(f"the {which} run failed:\n{p.stdout[-2000:]}\n{p.stderr[-4000:]}")
    r = torch.load(out)
    shutil.rmtree(out + ".swap", ignore_errors=True)
    os.unlink(out)
    return statistics.median(r["step_s"][3:]), r["io"]


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--dir", default=None, help="where the swap folders go (default: a temp dir under $TMPDIR)")
    ap.add_argument("--width", type=int, default=1024,
                    help="the model's width (1024: 3.2M parameters, the test's; 2048: 12.7M, where the swaps "
                         "outweigh the step's compute on 2 cores)")
    a = ap.parse_args()
    if a.steps < 5:
        ap.error("--steps must be at least 5 (the first three are not timed)")
    root = tempfile.mkdtemp(prefix="spillway-infinity-", dir=a.dir)
    times = {"deepspeed": [], "spillway": []}
    ratios = []
    try:
        for rnd in range(a.rounds):
            order = ["deepspeed", "spillway"] if rnd % 2 == 0 else ["spillway", "deepspeed"]
            got = {}
            for which in order:
                got[which], io = one(which, a.steps, root, a.width)
                times[which].append(got[which])
            ratios.append(got["deepspeed"] / got["spillway"])
            print(f"round {rnd}: step {got['deepspeed'] * 1e3:.1f} ms plain, {got['spillway'] * 1e3:.1f} ms Spillway, "
                  f"x{ratios[-1]:.3f}; last run moved {io['read_bytes'] / 2**20:.0f} MiB in, "
                  f"{io['write_bytes'] / 2**20:.0f} MiB out", flush=True)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print(json.dumps({"bench": "zero_infinity", "width": a.width, "rounds": a.rounds, "steps": a.steps,
                      "step_ms_deepspeed": round(statistics.median(times["deepspeed"]) * 1e3, 2),
                      "step_ms_spillway": round(statistics.median(times["spillway"]) * 1e3, 2),
                      "ratio_median": round(statistics.median(ratios), 3), "ratio_min": round(min(ratios), 3),
                      "ratio_max": round(max(ratios), 3)}))


if __name__ == "__main__":
    main()
