"""One DeepSpeed ZeRO-3 run (DeepSpeed's CPU accelerator, or CUDA under DS_ACCELERATOR=cuda; bf16, offload_optimizer cpu, two parameter groups with
different weight decay, a warmup-decay learning-rate schedule, gradient clipping), in a process of
its own, with DeepSpeed's own optimizer step or Spillway's fused one.

    python ds_step.py {deepspeed|torch-adam|spillway} STEPS OUT.pt [OPTIMIZER] [VARIANT]

VARIANT `bf16-cpu` (the default), `bf16-nvme-ga2`: the optimizer state on NVMe (DeepSpeed's
swapper, on Spillway's aio op) and two micro-batches per step, `bf16-infinity`: a 2.2M-parameter
model whose optimizer state and parameters DeepSpeed really swaps to NVMe (above its threshold), or
`bf16-params-on-device`: offload_optimizer only, the 16-bit partitions on the accelerator (cuda:0
under DS_ACCELERATOR=cuda: Spillway's pass updates the master, DeepSpeed copies it down), or
`bf16-zero2` / `bf16-zero1`: ZeRO-2 / ZeRO-1 with offload_optimizer cpu (one flat partition per
parameter group), or `fp16-zero3` / `fp16-zero2`: fp16 with DeepSpeed's dynamic loss scale
(initial 2^8, window 4, hysteresis 1) and an infinite loss at steps 3, 7, 8 and 20, whose
overflowing gradients DeepSpeed must skip and halve the scale for (on the CPU accelerator fp16 needs
mkldnn's fp16 support, which AVX-512 FP16 or AMX machines have). Also saved: each step's time, the
bytes this process read and wrote (/proc/self/io), the swap folder's files, and each step's loss
scale and skipped-step count.

`torch-adam` is DeepSpeed's own step with torch.optim.AdamW in place of DeepSpeedCPUAdam
("torch_adam": true): the control for how far two correct implementations of one step drift apart.

Saves the per-step losses, the fp32 master partitions, the Adam moments, the per-group step counts
and lrs, and the 16-bit parameters to OUT.pt.
"""
import os
import sys
import time
import warnings

os.environ.setdefault("DS_ACCELERATOR", "cpu")
import torch  # noqa: E402
import deepspeed  # noqa: E402
from _dist import backend, device, infinity_offload, world_from_env_or_single  # noqa: E402

which, steps, out = sys.argv[1], int(sys.argv[2]), sys.argv[3]
optimizer = sys.argv[4] if len(sys.argv) > 4 else "AdamW"
variant = sys.argv[5] if len(sys.argv) > 5 else "bf16-cpu"
if which == "spillway":
    import spillway
    spillway.deepspeed.install(step=True)
elif which not in ("deepspeed", "torch-adam"):
    sys.exit(f"unknown step {which!r}: deepspeed, torch-adam or spillway")

world_from_env_or_single()
deepspeed.init_distributed(dist_backend=backend(), auto_mpi_discovery=False)

torch.manual_seed(0)
# bf16-infinity's width: 1024 in the tests; bench/compare_zero_infinity.py --width makes the swaps
# outweigh the compute.
WIDTH = int(os.environ.get("SPILLWAY_DS_STEP_WIDTH", "1024"))
if variant == "bf16-infinity":  # sub-groups and partitions above DeepSpeed's 1 MiB swap threshold
    model = torch.nn.Sequential(torch.nn.Linear(64, WIDTH), torch.nn.GELU(), torch.nn.LayerNorm(WIDTH),
                                torch.nn.Linear(WIDTH, WIDTH), torch.nn.GELU(), torch.nn.Linear(WIDTH, WIDTH),
                                torch.nn.GELU(), torch.nn.Linear(WIDTH, 8))
else:
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.LayerNorm(256),
                                torch.nn.Linear(256, 256), torch.nn.GELU(), torch.nn.Linear(256, 8))
decay = [p for n, p in model.named_parameters() if n.endswith("weight") and p.dim() == 2]
no_decay = [p for n, p in model.named_parameters() if not (n.endswith("weight") and p.dim() == 2)]
groups = [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}]
params = {"lr": 3e-3, "betas": [0.9, 0.95], "eps": 1e-8}
if which == "torch-adam":
    params["torch_adam"] = True
if optimizer == "Adagrad":
    del params["betas"]
config = {
    "train_micro_batch_size_per_gpu": 16,
    "gradient_accumulation_steps": 1,
    "gradient_clipping": 0.5,
    "optimizer": {"type": optimizer, "params": params},
    "scheduler": {"type": "WarmupDecayLR",
                  "params": {"warmup_min_lr": 1e-4, "warmup_max_lr": 3e-3, "warmup_num_steps": 10,
                             "total_num_steps": steps + 10}},
    "bf16": {"enabled": True},
    "zero_optimization": {
        "stage": 3,
        "offload_optimizer": {"device": "cpu", "pin_memory": False},
        "offload_param": {"device": "cpu", "pin_memory": False},
        "stage3_param_persistence_threshold": 0,
        "sub_group_size": 40000,  # several sub-groups per parameter group
    },
}
accumulate = 1
if variant == "bf16-nvme-ga2":
    accumulate = config["gradient_accumulation_steps"] = 2
    swap = out + ".swap"
    os.makedirs(swap, exist_ok=True)
    config["zero_optimization"]["offload_optimizer"] = {"device": "nvme", "nvme_path": swap, "pin_memory": False}
    config["aio"] = {"block_size": 1 << 18, "queue_depth": 8}
elif variant == "bf16-infinity":
    zero, config["aio"] = infinity_offload(out + ".swap")  # ZeRO-Infinity, really swapping (_dist.py)
    # A parameter swap buffer holds the largest weight.
    zero["offload_param"]["buffer_size"] = max(zero["offload_param"]["buffer_size"], WIDTH * WIDTH + 1024)
    config["zero_optimization"].update(zero)
elif variant == "bf16-params-on-device":  # offload_optimizer only: the 16-bit partitions stay on the accelerator
    del config["zero_optimization"]["offload_param"]
elif variant in ("bf16-zero2", "bf16-zero1"):
    config["zero_optimization"] = {"stage": int(variant[-1]), "offload_optimizer": {"device": "cpu", "pin_memory": False}}
elif variant in ("bf16-moments", "bf16-moments-zero2"):  # DeepSpeed's bf16 masters and Adam moments
    config["bf16"].update({"bf16_master_weights_and_grads": True, "bf16_optimizer_states": True})
    if variant == "bf16-moments-zero2":
        config["zero_optimization"] = {"stage": 2, "offload_optimizer": {"device": "cpu", "pin_memory": False}}
elif variant in ("fp16-zero3", "fp16-zero2"):
    del config["bf16"]
    config["fp16"] = {"enabled": True, "loss_scale": 0, "initial_scale_power": 8, "loss_scale_window": 4,
                      "hysteresis": 1, "min_loss_scale": 1}
    if variant == "fp16-zero2":
        config["zero_optimization"] = {"stage": 2, "offload_optimizer": {"device": "cpu", "pin_memory": False}}
elif variant != "bf16-cpu":
    sys.exit(f"unknown variant {variant!r}: bf16-cpu, bf16-params-on-device, bf16-nvme-ga2, bf16-infinity, "
             "bf16-zero2, bf16-zero1, fp16-zero3 or fp16-zero2")
OVERFLOW_STEPS = {3, 7, 8, 20} if variant.startswith("fp16") else set()


def masters_of(opt):
    """The fp32 master partitions, and the 16-bit partitions they are copied to, by ZeRO stage."""
    if hasattr(opt, "fp32_partitioned_groups_flat"):
        return opt.fp32_partitioned_groups_flat, opt.fp16_partitioned_groups_flat
    rank = torch.distributed.get_rank()
    return opt.single_partition_of_fp32_groups, [g[rank] for g in opt.parallel_partitioned_bit16_groups]


dtype = torch.float16 if variant.startswith("fp16") else torch.bfloat16


def io_bytes():
    """This process's bytes read from and written to storage (/proc/self/io: O_DIRECT I/O counts)."""
    with open("/proc/self/io") as f:
        fields = dict(line.split(": ") for line in f.read().splitlines())
    return int(fields["read_bytes"]), int(fields["write_bytes"])


with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    engine, *_ = deepspeed.initialize(model=model, model_parameters=groups, config=config)
    g = torch.Generator().manual_seed(1)
    teacher = torch.randn(64, 8, generator=g)
    losses, lrs, first, scales, skipped = [], [], None, [], []
    io_before = io_bytes()
    step_s, io_steps = [], []
    for step in range(steps):
        t0 = time.perf_counter()
        for _ in range(accumulate):
            x = torch.randn(16, 64, generator=g).to(dtype)
            y = (x.float() @ teacher).argmax(dim=1)
            loss = torch.nn.functional.cross_entropy(engine(x.to(device())).float(), y.to(device()))
            if step in OVERFLOW_STEPS:  # every gradient inf or nan: DeepSpeed's overflow check must skip it
                loss = loss * float("inf")
            engine.backward(loss)
            engine.step()
        losses.append(loss.item())
        scales.append(float(getattr(engine.optimizer, "loss_scale", 1.0)))
        skipped.append(int(engine.skipped_steps))
        step_s.append(time.perf_counter() - t0)
        io_steps.append(io_bytes())  # (read, write) so far: a bench takes the steps it times
        lrs.append([pg["lr"] for pg in engine.optimizer.optimizer.param_groups])
        if step == 0 and variant != "bf16-infinity":  # swapped masters are on NVMe between steps
            fp32, p16 = masters_of(engine.optimizer)
            first = {"masters": [t.detach().clone() for t in fp32], "params16": [t.detach().clone() for t in p16]}
io_after = io_bytes()
opt = engine.optimizer
inner = opt.optimizer
fp32, p16 = masters_of(opt)
swapper = getattr(opt, "optimizer_swapper", None)
if swapper is not None:  # a swapped sub-group's master is on NVMe between steps: read from its swap file
    from deepspeed.runtime.swap_tensor.optimizer_utils import OptimizerSwapper
    fp32 = list(fp32)
    for i, t in enumerate(fp32):
        info = swapper.swap_params_info.get(OptimizerSwapper.parameter_id(t))
        if info is not None and t.numel() == 0:
            path = info.get_swap_paths()[0]
            if os.path.exists(path):  # DeepSpeed's own file
                with open(path, "rb") as f:
                    data = bytearray(f.read(info.tensor_numel * 4))
                fp32[i] = torch.frombuffer(data, dtype=torch.float32).clone()
            else:  # in Spillway's NVMe arena (install(nvme_swap="arena"))
                from spillway.deepspeed import _swap as _deepspeed_swap
                store, real = _deepspeed_swap._managed(path)
                whole = torch.empty(store.size(real) // 4, dtype=torch.float32)
                store.read(real, whole)
                fp32[i] = whole[:info.tensor_numel].clone()
masters = [t.detach().clone() for t in fp32]
state = [inner.state.get(t, {}) for t in fp32]
torch.save({
    "losses": losses, "lrs": lrs, "masters": masters, "first": first, "scales": scales, "skipped": skipped,
    "exp_avg": [s["exp_avg"].clone() for s in state if "exp_avg" in s],
    "exp_avg_sq": [s["exp_avg_sq"].clone() for s in state if "exp_avg_sq" in s],
    "steps": [s.get("step") for s in state],
    "params16": [t.detach().clone() if t is not None else None for t in p16],
    "sub_groups": len(masters), "group_of": list(range(len(masters))) if not hasattr(opt, "sub_group_to_group_id")
    else list(opt.sub_group_to_group_id.values()) if isinstance(opt.sub_group_to_group_id, dict)
    else list(opt.sub_group_to_group_id),
    "inner": type(inner).__name__,
    "engine_device": str(engine.device),
    "params16_device": str(p16[0].device) if p16 and p16[0] is not None else None,
    "warnings": [str(w.message) for w in caught if "spillway" in str(w.message)],
    "kernel": getattr(opt, "_spillway_kernel", None) is not None,
    "copies_skipped": opt.__dict__.get("_spillway_copies_skipped", 0),
    "step_s": step_s,
    "io": {"read_bytes": io_after[0] - io_before[0], "write_bytes": io_after[1] - io_before[1]},
    "io_steps": [(r - io_before[0], w - io_before[1]) for r, w in io_steps],
    "swap_stats": __import__("spillway").deepspeed.swap_stats() if which == "spillway" else {},
    "swap_files": sorted((os.path.relpath(os.path.join(d, f), out + ".swap"), os.path.getsize(os.path.join(d, f)))
                         for d, _, fs in os.walk(out + ".swap") for f in fs),
}, out)
print("done", which, len(losses))
