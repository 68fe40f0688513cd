"""One rank of a DeepSpeed ZeRO-3 job under torchrun (CPU accelerator, Gloo, bf16, offload_optimizer
and offload_param cpu), with a DataLoader that forks 2 workers every epoch, for the node-budget tests
(tests/python/test_node.py).

    torchrun --nproc-per-node N ds_node.py {spillway|plain} OUT_DIR EPOCHS STEPS_PER_EPOCH HIDDEN [EXTRA_MIB]

`spillway` runs `spillway.deepspeed.install()` first (the one line; it joins the node budget named
by SPILLWAY_NODE_JOB / the launcher); `plain` is DeepSpeed alone. Local rank 0 holds EXTRA_MIB more
host memory in a tagged tensor (uneven ranks). Each rank writes OUT_DIR/rank<R>.json when done
(losses, its pid) and OUT_DIR/rank<R>.progress as it goes ("epoch step" lines), so a test can watch
it from outside.
"""
import json
import os
import sys

os.environ.setdefault("DS_ACCELERATOR", "cpu")
import torch  # noqa: E402

mode, out_dir, epochs, steps, hidden = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
extra_mib = int(sys.argv[6]) if len(sys.argv) > 6 else 0
if mode == "spillway":
    import spillway
    spillway.deepspeed.install()
elif mode != "plain":
    sys.exit(f"unknown mode {mode!r}: spillway or plain")
import deepspeed  # noqa: E402

rank, local_rank = int(os.environ["RANK"]), int(os.environ["LOCAL_RANK"])
deepspeed.init_distributed(dist_backend="gloo", auto_mpi_discovery=False)
progress = open(os.path.join(out_dir, f"rank{rank}.progress"), "a", buffering=1)
progress.write(f"pid {os.getpid()}\n")

extra = None
if mode == "spillway" and local_rank == 0 and extra_mib:
    with spillway.tag("checkpoint"):  # rank 0 holds more than the others (uneven ranks)
        extra = torch.ones(extra_mib << 18)

config = {
    "train_micro_batch_size_per_gpu": 8,
    "gradient_accumulation_steps": 1,
    "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.01}},
    "bf16": {"enabled": True},
    "zero_optimization": {
        "stage": 3,
        # DeepSpeed's defaults make each rank hold a 953 MiB reduce bucket on the host (CPU
        # accelerator); small buckets keep four ranks within this machine.
        "reduce_bucket_size": 2_000_000,
        "stage3_prefetch_bucket_size": 2_000_000,
        "offload_optimizer": {"device": "cpu", "pin_memory": True},
        "offload_param": {"device": "cpu", "pin_memory": True},
    },
}
torch.manual_seed(0)
with deepspeed.zero.Init(config_dict_or_path=config):
    model = torch.nn.Sequential(torch.nn.Linear(64, hidden), torch.nn.GELU(), torch.nn.Linear(hidden, hidden),
                                torch.nn.GELU(), torch.nn.Linear(hidden, 8))
engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
progress.write("initialized\n")


class Data(torch.utils.data.Dataset):
    def __len__(self):
        return 8 * steps * engine.world_size

    def __getitem__(self, i):
        g = torch.Generator().manual_seed(i)
        x = torch.randn(64, generator=g)
        return x, (x[:8] * 2).tanh()


sampler = torch.utils.data.distributed.DistributedSampler(Data(), shuffle=False)
loader = torch.utils.data.DataLoader(Data(), batch_size=8, sampler=sampler, num_workers=2,
                                     persistent_workers=False, multiprocessing_context="fork")
losses = []
for epoch in range(epochs):
    if mode == "spillway":
        spillway.next_epoch()
    for step, (x, y) in enumerate(loader):
        loss = torch.nn.functional.mse_loss(engine(x.to(torch.bfloat16)).float(), y)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
        progress.write(f"{epoch} {step}\n")
report = {"rank": rank, "pid": os.getpid(), "losses": losses, "config": config,
          "params": sum(getattr(p, "ds_numel", 0) or p.numel() for p in model.parameters())}
if mode == "spillway":
    report["node"] = {k: v for k, v in spillway.node.stats().items() if k != "text"}
with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
    json.dump(report, f)
del extra
