"""Whole DeepSpeed training iterations (forward, backward, step) plain and with
spillway.deepspeed.install(), each run a process of its own, alternating, so that no per-step gain
hides a loss elsewhere (the forward and backward also run on tensors the arenas hold).

    PYTHONPATH=build/default/python python3 bench/compare_deepspeed_iteration.py [--stages 2 3]
        [--params 16e6] [--pairs 5] [--iters 12] [--warmup 3] [--threads 2]

For each ZeRO stage: --pairs pairs of runs, each pair one plain process and one with the one line
(which goes first alternates by pair), the same model (an MLP of 2048-wide layers), data, seed and
DeepSpeed config (CPU accelerator, bf16, offload_optimizer cpu, and offload_param cpu at stage 3,
DeepSpeed's default gradient clipping 1.0). Each process times --iters iterations after --warmup
and reports their median. Per pair: speed-up = plain / spillway. The A/A spread is plain's pair p
over plain's pair p-1 (and spillway's the same): what the machine alone moves a run by. Last line:
one JSON object."""
import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import time


def one_run(args):
    """In a process of its own: one engine, --warmup then --iters timed iterations."""
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import torch

    if args.with_spillway:
        import spillway

        spillway.deepspeed.install()
    import deepspeed

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", LOCAL_RANK="0", WORLD_SIZE="1")
    torch.set_num_threads(args.threads)
    deepspeed.init_distributed(dist_backend="gloo", auto_mpi_discovery=False)
    width = 2048
    layers = max(1, round(float(args.params) / (width * width)))
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[m for _ in range(layers) for m in (torch.nn.Linear(width, width), torch.nn.GELU())])
    zero = {"stage": args.stage, "offload_optimizer": {"device": "cpu"}}
    if args.stage == 3:
        zero["offload_param"] = {"device": "cpu"}
    config = {"train_micro_batch_size_per_gpu": 8, "gradient_clipping": 1.0,
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "weight_decay": 0.1}},
              "bf16": {"enabled": True}, "zero_optimization": zero}
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    g = torch.Generator().manual_seed(1)
    batches = [torch.randn(8, width, generator=g).to(torch.bfloat16) for _ in range(4)]
    times, losses = [], []
    for i in range(args.warmup + args.iters):
        x = batches[i % len(batches)]
        t0 = time.perf_counter()
        loss = engine(x).float().square().mean()
        engine.backward(loss)
        engine.step()
        if i >= args.warmup:
            times.append(time.perf_counter() - t0)
        losses.append(loss.item())
    n = sum(getattr(p, "ds_numel", 0) or p.numel() for p in model.parameters())
    print(json.dumps({"median_s": statistics.median(times), "min_s": min(times), "max_s": max(times),
                      "params": n, "losses": losses}))


def spread(xs):
    return [round(min(xs), 3), round(max(xs), 3)]


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--stages", type=int, nargs="+", default=[2, 3], choices=(1, 2, 3))
    ap.add_argument("--params", default="16e6")
    ap.add_argument("--pairs", type=int, default=5)
    ap.add_argument("--iters", type=int, default=12)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--_one", dest="one", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--_spillway", dest="with_spillway", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--_stage", dest="stage", type=int, default=3, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.pairs < 2 or args.iters < 1 or args.warmup < 1:
        ap.error("--pairs must be at least 2 (the A/A spread needs two), --iters and --warmup at least 1")
    if args.one:
        one_run(args)
        return 0
    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads), DS_ACCELERATOR="cpu")
    out = {"bench": "deepspeed_iteration", "params": None, "threads": args.threads, "stages": {}}
    for stage in args.stages:
        runs = {"plain": [], "spillway": []}
        for p in range(args.pairs):
            order = ["plain", "spillway"] if p % 2 == 0 else ["spillway", "plain"]
            for which in order:
                cmd = [sys.executable, __file__, "--_one", "--_stage", str(stage), "--params", args.params,
                       "--iters", str(args.iters), "--warmup", str(args.warmup), "--threads", str(args.threads)]
                if which == "spillway":
                    cmd.append("--_spillway")
                r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1800)
                if r.returncode != 0:
                    sys.stderr.write(r.stdout[-3000:] + r.stderr[-6000:])
                    raise SystemExit(f"compare_deepspeed_iteration: the {which} run of ZeRO-{stage} failed "
                                     f"(exit {r.returncode}); its output is above")
                runs[which].append(json.loads(r.stdout.strip().splitlines()[-1]))
        plain = [r["median_s"] for r in runs["plain"]]
        ours = [r["median_s"] for r in runs["spillway"]]
        speedup = [a / b for a, b in zip(plain, ours)]
        aa = [b / a for a, b in zip(plain, plain[1:])] + [b / a for a, b in zip(ours, ours[1:])]
        same = all(runs["plain"][0]["losses"] == r["losses"] for r in runs["plain"])
        out["params"] = runs["plain"][0]["params"]
        print(f"ZeRO-{stage}, {out['params'] / 1e6:.1f}M parameters, {args.threads} threads, {args.pairs} pairs of "
              f"processes, {args.iters} iterations each (median s per iteration [min, max over pairs])")
        print(f"  plain     {statistics.median(plain):.3f} {spread(plain)}")
        print(f"  spillway  {statistics.median(ours):.3f} {spread(ours)}")
        print(f"  speed-up plain/spillway x{statistics.median(speedup):.3f} {spread(speedup)}; "
              f"A/A (run p over run p-1, either side) {spread(aa)}; plain's losses the same every run: {same}")
        out["stages"][str(stage)] = {"plain_s": statistics.median(plain), "spillway_s": statistics.median(ours),
                                     "speedup": statistics.median(speedup), "speedup_spread": spread(speedup),
                                     "aa_spread": spread(aa), "plain_runs": plain, "spillway_runs": ours}
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
