"""DeepSpeed's ZeRO-3 host optimizer step against Spillway's, side by side, interleaved.

    PYTHONPATH=build/default/python python3 bench/compare_deepspeed_step.py host [--elems 64e6 256e6]
    PYTHONPATH=build/default/python python3 bench/compare_deepspeed_step.py zero3 [--params 33e6]
    PYTHONPATH=build/default/python python3 bench/compare_deepspeed_step.py zero2 [--params 33e6]

`host`: the per-sub-group sequence stage3 runs with offload_optimizer cpu, on the same buffers, the
same threads (OMP_NUM_THREADS and torch's intra-op threads = --threads), rounds interleaved:
  deepspeed   norm (torch.linalg.vector_norm per sub-group, combined), grad.mul_(1/combined_scale),
              DeepSpeedCPUAdam.step on the fp32 partition, fp16_partition.copy_(fp32)
  in-ds       what install() runs inside DeepSpeed: DeepSpeed's norm, then Spillway's fused pass
              (unscale/clip, AdamW, bf16 copy)
  spillway    Spillway's whole step: its norm pass, then the fused pass
Gradients are bf16-sized fp32 (stage3 keeps fp32 gradients for the offloaded optimizer) and are
restored before every timed step, outside the timing.

`zero3`: one DeepSpeed ZeRO-3 engine (CPU accelerator, bf16, offload_optimizer and offload_param
cpu) after spillway.deepspeed.install(); each round times engine.step() with DeepSpeed's own step and
no guard (optimizer.spillway_step = spillway_guard = False: plain DeepSpeed), with Spillway's step
and no guard, with Spillway's step under the default device guard (what install() runs: every op of
the first steps and of steps whose tensors moved, Note [Device guard]), and under guard="always"
(every op of every step), interleaved. `--bf16-moments` runs it with DeepSpeed's
bf16_master_weights_and_grads and bf16_optimizer_states: masters, gradients and Adam moments in bf16.

`zero2`: the same with ZeRO-2 (offload_optimizer cpu; the 16-bit parameters stay on the
accelerator, here the CPU).

`zero3` and `zero2` run on DS_ACCELERATOR's device (default cpu, the stand-in; cuda on a GPU machine:
scripts/gpu-check runs both there, with NCCL, the model on cuda:0 and each step timed between two
device synchronizations). With zero2 the step's copy of the updated 16-bit parameters to the device
is inside the time; zero3 here offloads the parameters too (offload_param cpu), so its 16-bit
partitions stay on the host and its step copies almost nothing to the device.

Last line: one JSON object."""
import argparse
import json
import os
import statistics
import sys
import time


def host(args):
    import torch
    from deepspeed.ops.adam import DeepSpeedCPUAdam

    import spillway

    kernel = spillway._spillway.AdamKernel(args.threads)
    results = {}
    for n in [int(float(e)) for e in args.elems]:
        sub = int(float(args.sub_group))
        sizes = [min(sub, n - k) for k in range(0, n, sub)]
        g = torch.Generator().manual_seed(0)
        groups = []
        for size in sizes:
            grp = {"master": torch.randn(size, generator=g), "grad": torch.empty(size),
                   "m": torch.zeros(size), "v": torch.zeros(size), "p16": torch.empty(size, dtype=torch.bfloat16)}
            grp["saved"] = torch.randn(size, generator=g) * 8.0
            groups.append(grp)
        opt = DeepSpeedCPUAdam([groups[0]["master"]], lr=1e-4, betas=(0.9, 0.95), weight_decay=0.1, adamw_mode=True)
        opt.param_groups[0]["params"] = []
        for grp in groups:
            opt.state[grp["master"]] = {"step": 0, "exp_avg": grp["m"], "exp_avg_sq": grp["v"]}
        loss_scale, clip_grad = 8.0, 1.0
        pg = opt.param_groups[0]

        def restore():
            for grp in groups:
                grp["grad"].copy_(grp["saved"])
                grp["master"].grad = grp["grad"]

        def ds_norm():
            norms = [torch.linalg.vector_norm(grp["grad"], 2) for grp in groups]
            return torch.linalg.vector_norm(torch.stack(norms), 2)

        def combined(total_norm):
            clip = ((total_norm / loss_scale) + 1e-6) / clip_grad
            return torch.clamp(clip, min=1.0) * loss_scale

        def deepspeed():
            cs = combined(ds_norm())
            for grp in groups:
                grp["grad"].mul_(1. / cs)
                pg["params"] = [grp["master"]]
                opt.step()
                pg["params"] = []
                grp["p16"].copy_(grp["master"])

        def fused(scale):
            for grp in groups:
                st = opt.state[grp["master"]]
                st["step"] += 1
                kernel.update("bench", grp["master"], grp["m"], grp["v"], grp["grad"], grp["p16"], st["step"],
                              pg["lr"], 0.9, 0.95, pg["eps"], pg["weight_decay"], True, True, scale)

        def in_ds():
            fused(float(1. / combined(ds_norm())))

        def ours():
            total = sum(kernel.sum_of_squares("bench", grp["grad"]) for grp in groups) ** 0.5
            fused(float(1. / combined(torch.tensor(total, dtype=torch.float32))))

        variants = {"deepspeed": deepspeed, "in-ds": in_ds, "spillway": ours}
        times = {k: [] for k in variants}
        for fn in variants.values():  # warm-up
            restore()
            fn()
        for r in range(args.rounds):
            order = list(variants) if r % 2 == 0 else list(reversed(variants))
            for k in order:
                restore()
                t0 = time.perf_counter()
                variants[k]()
                times[k].append(time.perf_counter() - t0)
        ratio = lambda k: [d / o for d, o in zip(times["deepspeed"], times[k])]
        print(f"{n / 1e6:.0f}M elements in {len(sizes)} sub-groups of <= {sub / 1e6:.0f}M, {args.threads} threads, "
              f"{args.rounds} interleaved rounds (s per step, median [min, max]; speed-up = deepspeed / variant)")
        row = {}
        for k in variants:
            t = times[k]
            sp = ratio(k)
            print(f"  {k:10s} {statistics.median(t):.3f} [{min(t):.3f}, {max(t):.3f}]  "
                  f"{n / statistics.median(t) / 1e9:.2f} Gelem/s  speed-up x{statistics.median(sp):.2f} "
                  f"[{min(sp):.2f}, {max(sp):.2f}]")
            row[k] = {"s": statistics.median(t), "speedup": statistics.median(sp), "min": min(sp), "max": max(sp)}
        results[f"{n / 1e6:.0f}M"] = row
        del groups, opt
    return results


def engine_step(args, stage):
    import socket

    import torch
    import deepspeed

    from deepspeed.accelerator import get_accelerator

    import spillway

    spillway.deepspeed.install()
    accelerator = get_accelerator()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", LOCAL_RANK="0", WORLD_SIZE="1")
    deepspeed.init_distributed(dist_backend="nccl" if accelerator.device_name() == "cuda" else "gloo",
                               auto_mpi_discovery=False)
    width = 2048
    layers = max(1, int(float(args.params) / (width * width)))
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(layers)])
    config = {"train_micro_batch_size_per_gpu": 4, "gradient_clipping": 1.0,
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "weight_decay": 0.1}},
              "bf16": {"enabled": True, **({"bf16_master_weights_and_grads": True, "bf16_optimizer_states": True}
                                           if args.bf16_moments else {})},
              "zero_optimization": {"stage": stage, "offload_optimizer": {"device": "cpu"}}}
    if stage == 3:
        config["zero_optimization"].update(offload_param={"device": "cpu"}, sub_group_size=int(float(args.sub_group)))
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    opt = engine.optimizer
    variants = {"deepspeed": (False, False), "spillway": (True, False), "spillway+guard": (True, True),
                "spillway+guard-always": (True, "always")}
    times = {k: [] for k in variants}
    x = torch.randn(4, width).to(torch.bfloat16).to(engine.device)
    for r in range(args.rounds + 1):
        order = list(variants) if r % 2 == 0 else list(reversed(variants))
        for k in order:
            opt.spillway_step, opt.spillway_guard = variants[k]
            loss = engine(x).float().square().mean()
            engine.backward(loss)
            accelerator.synchronize()  # a no-op on the CPU accelerator
            t0 = time.perf_counter()
            engine.step()
            accelerator.synchronize()
            if r > 0:  # round 0 warms up
                times[k].append(time.perf_counter() - t0)
    n = sum(getattr(p, "ds_numel", p.numel()) for p in model.parameters())
    print(f"DeepSpeed ZeRO-{stage} engine.step(){' with bf16 masters and moments' if args.bf16_moments else ''}, "
          f"{n / 1e6:.1f}M parameters, {args.rounds} interleaved rounds "
          "(s, median [min, max]; speed-up = deepspeed / variant)")
    out = {}
    for k in variants:
        t = times[k]
        sp = [d / o for d, o in zip(times["deepspeed"], t)]
        print(f"  {k:17s} {statistics.median(t):.3f} [{min(t):.3f}, {max(t):.3f}]  x{statistics.median(sp):.2f} "
              f"[{min(sp):.2f}, {max(sp):.2f}]")
        out[k] = {"s": statistics.median(t), "speedup": statistics.median(sp), "min": min(sp), "max": max(sp)}
    for k in ("spillway+guard", "spillway+guard-always"):
        g = [a / b for a, b in zip(times[k], times["spillway"])]
        print(f"  guard cost: ({k}) / spillway x{statistics.median(g):.3f} [{min(g):.3f}, {max(g):.3f}]")
        out[f"{k.replace('spillway+', '').replace('-', '_')}_cost"] = statistics.median(g)
    a = [x / y for x, y in zip(times["spillway"][1:], times["spillway"][:-1])]  # A/A: one variant against itself
    print(f"  A/A: spillway round r / round r-1 x{statistics.median(a):.3f} [{min(a):.3f}, {max(a):.3f}]")
    out["aa_spread"] = [min(a), max(a)]
    torch.distributed.destroy_process_group()  # NCCL warns at exit about a group left alive
    return {"stage": stage, "params": n, "bf16_moments": args.bf16_moments, "device": str(engine.device), **out}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("part", choices=("host", "zero3", "zero2"))
    ap.add_argument("--elems", nargs="+", default=["64e6", "256e6"])
    ap.add_argument("--sub-group", default="32e6", help="elements per sub-group (DeepSpeed's sub_group_size)")
    ap.add_argument("--params", default="33e6")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--bf16-moments", action="store_true",
                    help="zero3, zero2: bf16 masters, gradients and Adam moments (DeepSpeed's bf16_optimizer_states)")
    args = ap.parse_args()
    if os.environ.get("OMP_NUM_THREADS") != str(args.threads):  # DeepSpeedCPUAdam's OpenMP reads it at load
        os.environ["OMP_NUM_THREADS"] = str(args.threads)
        os.execv(sys.executable, [sys.executable] + sys.argv)
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import torch
    torch.set_num_threads(args.threads)
    out = host(args) if args.part == "host" else engine_step(args, int(args.part[-1]))
    print(json.dumps({"bench": f"deepspeed_step_{args.part}", **out}))


if __name__ == "__main__":
    main()
