"""A DeepSpeed ZeRO-3 step with and without Spillway, side by side, interleaved.

    PYTHONPATH=build/default/python python3 bench/compare_deepspeed_step.py \\
        [--config tests/python/configs/zero3_cpu_offload.json] [--params 8.5e6] [--rounds 5] [--steps 12]

Each round runs one `python -m spillway.leak_suite` worker per variant (plain DeepSpeed, then
spillway.deepspeed.install(), order alternating by round), with no DataLoader workers (no fork: this
measures the steady step, not the first one after a fork). Reported: each run's median step time,
and the ratio spillway/plain per round with its median and spread."""
import argparse
import json
import statistics
import subprocess
import sys


def run(which, args):
    cmd = [sys.executable, "-m", "spillway.leak_suite", "--_worker", which, "--deepspeed", args.config,
           "--params", str(args.params), "--epochs", "1", "--workers", "0", "--steps", str(args.steps),
           "--settle", "0"]
    p = subprocess.run(cmd, capture_output=True, text=True, check=True)
    return json.loads(p.stdout.strip().splitlines()[-1])["epochs"][0]["median_step_s"]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default="tests/python/configs/zero3_cpu_offload.json")
    ap.add_argument("--params", type=float, default=8.5e6)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=12)
    args = ap.parse_args()
    plain, ours = [], []
    for r in range(args.rounds):
        for which in (("plain", "spillway") if r % 2 == 0 else ("spillway", "plain")):
            (plain if which == "plain" else ours).append(run(which, args))
    ratios = [o / p for o, p in zip(ours, plain)]
    print(f"DeepSpeed ZeRO-3 median step, {args.rounds} interleaved rounds, {args.params:.3g} parameters")
    print(f"  plain    {statistics.median(plain) * 1e3:7.1f} ms  ({', '.join(f'{x * 1e3:.1f}' for x in plain)})")
    print(f"  spillway {statistics.median(ours) * 1e3:7.1f} ms  ({', '.join(f'{x * 1e3:.1f}' for x in ours)})")
    print(f"  spillway/plain x{statistics.median(ratios):.3f} (min {min(ratios):.3f}, max {max(ratios):.3f})")


if __name__ == "__main__":
    main()
