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

The disk's rate, beside them in every round: fio (io_uring, O_DIRECT, the aio section's block size
and queue depth) reading and writing one file under --dir at random block offsets, at the first
run's mix of reads and writes, for --fio-seconds. Each run's step is also printed as a multiple of
fio's time for the bytes the run moves per timed step: 1.0 is a step that moves its bytes at fio's
rate with no time left for compute. A reference from the same minute, not a bound: this virtual
disk's rate drifts between fio's seconds and the runs', and a step can come in under it.
--fio-seconds 0 leaves fio out. Last line: one JSON object."""
import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile

import torch

from _fio import fio_job  # bench/ is sys.path[0]
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "python", "workers"))
from _dist import infinity_offload  # noqa: E402  the runs' aio section: fio's block size and depth

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
    # The bytes of the steps timed (after the first three), per step, as the step time is theirs.
    (r0, w0), (r1, w1), n = r["io_steps"][2], r["io_steps"][-1], len(r["step_s"]) - 3
    return statistics.median(r["step_s"][3:]), {"read_bytes": (r1 - r0) / n, "write_bytes": (w1 - w0) / n}


def fio_rate(where, read_share, seconds):
    """Bytes per second fio moves in `where` reading and writing one 256 MiB file at random 1 MiB-block
    offsets, `read_share` of them reads, O_DIRECT through io_uring at the aio section's block size and
    queue depth: the disk's rate at that mix, from fio's own byte counts and runtime."""
    aio = infinity_offload(where)[1]
    directory = where.replace(":", "\\:")  # fio reads ':' in --directory as a separator
    job = fio_job(["--name=disk", f"--directory={directory}", "--size=256M", "--unlink=1", "--rw=randrw",
                   f"--rwmixread={max(1, min(99, round(read_share * 100)))}", f"--bs={aio['block_size']}",
                   f"--iodepth={aio['queue_depth']}", "--ioengine=io_uring", "--direct=1", "--time_based",
                   f"--runtime={seconds}"], f"read and write at random offsets in {where}")
    moved = job["read"]["io_bytes"] + job["write"]["io_bytes"]
    return moved / (job["job_runtime"] / 1e3)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--dir", default=None, help="where the swap folders go (default: a temp dir under $TMPDIR)")
    ap.add_argument("--width", type=int, default=1024,
                    help="the model's width (1024: 2.2M parameters, the test's; 2048: 8.5M, where the swaps "
                         "outweigh the step's compute on 2 cores)")
    ap.add_argument("--fio-seconds", type=int, default=5,
                    help="how long fio measures the disk's rate in each round, between the two runs (0: no fio)")
    a = ap.parse_args()
    if a.steps < 5:
        ap.error("--steps must be at least 5 (the first three are not timed)")
    if a.fio_seconds < 0:
        ap.error("--fio-seconds must be 0 (no fio) or more")
    if a.fio_seconds and shutil.which("fio") is None:
        raise SystemExit("fio is not installed (scripts/install-deps installs it): it measures the disk's rate; "
                         "or pass --fio-seconds 0")
    root = tempfile.mkdtemp(prefix="spillway-infinity-", dir=a.dir)
    times = {"deepspeed": [], "spillway": []}
    ratios, vs_fio = [], {"deepspeed": [], "spillway": []}
    try:
        for rnd in range(a.rounds):
            order = ["deepspeed", "spillway"] if rnd % 2 == 0 else ["spillway", "deepspeed"]
            got, moved, rate = {}, {}, None
            for which in order:
                got[which], io = one(which, a.steps, root, a.width)
                moved[which] = io["read_bytes"] + io["write_bytes"]
                times[which].append(got[which])
                if a.fio_seconds and rate is None:  # between the two runs, at the first one's mix
                    rate = fio_rate(root, io["read_bytes"] / max(1, moved[which]), a.fio_seconds)
            ratios.append(got["deepspeed"] / got["spillway"])
            line = (f"round {rnd}: step {got['deepspeed'] * 1e3:.1f} ms plain, {got['spillway'] * 1e3:.1f} ms Spillway, "
                    f"x{ratios[-1]:.3f}; per step {moved['deepspeed'] / 2**20:.0f} MiB moved plain, "
                    f"{moved['spillway'] / 2**20:.0f} MiB Spillway")
            if rate is not None:
                for which in got:
                    vs_fio[which].append(got[which] / (moved[which] / rate))
                line += (f"; fio {rate / 1e9:.2f} GB/s: plain's step x{vs_fio['deepspeed'][-1]:.2f} of fio's time for "
                         f"its bytes, Spillway's x{vs_fio['spillway'][-1]:.2f}")
            print(line, flush=True)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    result = {"bench": "zero_infinity", "width": a.width, "rounds": a.rounds, "steps": a.steps,
              "step_ms_deepspeed": round(statistics.median(times["deepspeed"]) * 1e3, 2),
              "step_ms_spillway": round(statistics.median(times["spillway"]) * 1e3, 2),
              "ratio_median": round(statistics.median(ratios), 3), "ratio_min": round(min(ratios), 3),
              "ratio_max": round(max(ratios), 3)}
    for which, xs in vs_fio.items():
        if xs:  # each run's step as a multiple of fio's time for the bytes it moves (1.0: at fio's rate)
            result[f"{which}_step_vs_fio_median"] = round(statistics.median(xs), 3)
            result[f"{which}_step_vs_fio_min"] = round(min(xs), 3)
            result[f"{which}_step_vs_fio_max"] = round(max(xs), 3)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
