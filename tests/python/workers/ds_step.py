"""One DeepSpeed ZeRO-3 run (CPU accelerator, bf16, offload_optimizer cpu, two parameter groups with
different weight decay, a warmup-decay learning-rate schedule, gradient clipping), in a process of
its own, with DeepSpeed's own optimizer step or Spillway's fused one.

    python ds_step.py {deepspeed|torch-adam|spillway} STEPS OUT.pt [OPTIMIZER] [VARIANT]

VARIANT `bf16-cpu` (the default), `bf16-nvme-ga2`: the optimizer state on NVMe (DeepSpeed's
swapper, on Spillway's aio op) and two micro-batches per step, or `bf16-zero2` / `bf16-zero1`:
ZeRO-2 / ZeRO-1 with offload_optimizer cpu (one flat partition per parameter group). (fp16 and its dynamic loss scale are
refused by DeepSpeed's CPU accelerator: GPU only.)

`torch-adam` is DeepSpeed's own step with torch.optim.AdamW in place of DeepSpeedCPUAdam
("torch_adam": true): the control for how far two correct implementations of one step drift apart.

Saves the per-step losses, the fp32 master partitions, the Adam moments, the per-group step counts
and lrs, and the 16-bit parameters to OUT.pt.
"""
import os
import sys
import warnings

os.environ.setdefault("DS_ACCELERATOR", "cpu")
import torch  # noqa: E402
import deepspeed  # noqa: E402
from _dist import world_from_env_or_single  # noqa: E402

which, steps, out = sys.argv[1], int(sys.argv[2]), sys.argv[3]
optimizer = sys.argv[4] if len(sys.argv) > 4 else "AdamW"
variant = sys.argv[5] if len(sys.argv) > 5 else "bf16-cpu"
if which == "spillway":
    import spillway
    spillway.deepspeed.install(step=True)
elif which not in ("deepspeed", "torch-adam"):
    sys.exit(f"unknown step {which!r}: deepspeed, torch-adam or spillway")

world_from_env_or_single()
deepspeed.init_distributed(dist_backend="gloo", auto_mpi_discovery=False)

torch.manual_seed(0)
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
elif variant in ("bf16-zero2", "bf16-zero1"):
    config["zero_optimization"] = {"stage": int(variant[-1]), "offload_optimizer": {"device": "cpu", "pin_memory": False}}
elif variant != "bf16-cpu":
    sys.exit(f"unknown variant {variant!r}: bf16-cpu, bf16-nvme-ga2, bf16-zero2 or bf16-zero1")


def masters_of(opt):
    """The fp32 master partitions, and the 16-bit partitions they are copied to, by ZeRO stage."""
    if hasattr(opt, "fp32_partitioned_groups_flat"):
        return opt.fp32_partitioned_groups_flat, opt.fp16_partitioned_groups_flat
    rank = torch.distributed.get_rank()
    return opt.single_partition_of_fp32_groups, [g[rank] for g in opt.parallel_partitioned_bit16_groups]


dtype = torch.bfloat16
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    engine, *_ = deepspeed.initialize(model=model, model_parameters=groups, config=config)
    g = torch.Generator().manual_seed(1)
    teacher = torch.randn(64, 8, generator=g)
    losses, lrs, first = [], [], None
    for step in range(steps):
        for _ in range(accumulate):
            x = torch.randn(16, 64, generator=g).to(dtype)
            y = (x.float() @ teacher).argmax(dim=1)
            loss = torch.nn.functional.cross_entropy(engine(x).float(), y)
            engine.backward(loss)
            engine.step()
        losses.append(loss.item())
        lrs.append([pg["lr"] for pg in engine.optimizer.optimizer.param_groups])
        if step == 0:
            fp32, p16 = masters_of(engine.optimizer)
            first = {"masters": [t.detach().clone() for t in fp32], "params16": [t.detach().clone() for t in p16]}
opt = engine.optimizer
inner = opt.optimizer
fp32, p16 = masters_of(opt)
masters = [t.detach().clone() for t in fp32]
state = [inner.state.get(t, {}) for t in fp32]
torch.save({
    "losses": losses, "lrs": lrs, "masters": masters, "first": first,
    "exp_avg": [s["exp_avg"].clone() for s in state if "exp_avg" in s],
    "exp_avg_sq": [s["exp_avg_sq"].clone() for s in state if "exp_avg_sq" in s],
    "steps": [s.get("step") for s in state],
    "params16": [t.detach().clone() if t is not None else None for t in p16],
    "sub_groups": len(masters), "group_of": list(range(len(masters))) if not hasattr(opt, "sub_group_to_group_id")
    else list(opt.sub_group_to_group_id.values()) if isinstance(opt.sub_group_to_group_id, dict)
    else list(opt.sub_group_to_group_id),
    "inner": type(inner).__name__,
    "warnings": [str(w.message) for w in caught if "spillway" in str(w.message)],
    "kernel": getattr(opt, "_spillway_kernel", None) is not None,
}, out)
print("done", which, len(losses))
