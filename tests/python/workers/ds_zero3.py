"""One DeepSpeed ZeRO-3 training run with offload_optimizer and offload_param on nvme, on DeepSpeed's
CPU accelerator, in a process of its own (DeepSpeed's comm and the aio op patch are process-global).

    python ds_zero3.py {deepspeed|spillway} SWAP_DIR STEPS

Prints one JSON line: the per-step losses, which aio_handle class the swappers hold, and how many
swap files were on disk after the first step.
"""
import faulthandler
import json
import os
import sys

faulthandler.enable()  # an abort names the Python frames it came from
os.environ.setdefault("DS_ACCELERATOR", "cpu")
import torch  # noqa: E402
import deepspeed  # noqa: E402
from _dist import world_from_env_or_single  # noqa: E402

which, swap, steps = sys.argv[1], sys.argv[2], int(sys.argv[3])
if which == "spillway":
    import spillway
    spillway.deepspeed.install(step=False)  # DeepSpeed's own step: the losses compare bit for bit
elif which != "deepspeed":
    sys.exit(f"unknown aio op {which!r}: deepspeed or spillway")

world_from_env_or_single()
deepspeed.init_distributed(dist_backend="gloo", auto_mpi_discovery=False)

torch.manual_seed(0)
# DeepSpeed swaps only tensors of at least max(1 MiB, aio block_size): the two 1024 x 1024 weights
# (2 MiB in bf16, 4 MiB per fp32 optimizer state) go to NVMe, the small ones stay in host memory.
model = torch.nn.Sequential(torch.nn.Linear(64, 1024), torch.nn.GELU(), torch.nn.Linear(1024, 1024),
                            torch.nn.GELU(), torch.nn.Linear(1024, 1024), torch.nn.GELU(),
                            torch.nn.Linear(1024, 8))
config = {
    "train_micro_batch_size_per_gpu": 32,
    "gradient_accumulation_steps": 1,
    "optimizer": {"type": "AdamW", "params": {"lr": 3e-3, "weight_decay": 0.01}},
    "bf16": {"enabled": True},
    "zero_optimization": {
        "stage": 3,
        "offload_optimizer": {"device": "nvme", "nvme_path": swap, "pin_memory": True, "buffer_count": 4},
        # max_in_cpu 0 and a small buffer: every parameter partition goes to NVMe and back each step
        "offload_param": {"device": "nvme", "nvme_path": swap, "pin_memory": True, "buffer_count": 5,
                          "buffer_size": 1 << 21, "max_in_cpu": 0},
        "stage3_param_persistence_threshold": 0,
        # DeepSpeed 0.19.8 prefetching NVMe partitions asserts "param N already assigned swap buffer id
        # M" on this model with its own aio op as with ours (measured): no prefetch.
        "stage3_prefetch_bucket_size": 0,
        "sub_group_size": 1 << 20,  # about three sub-groups, each swapped in and out by the step
    },
    "aio": {"block_size": 1 << 18, "queue_depth": 8, "single_submit": False, "overlap_events": True,
            "intra_op_parallelism": 1},
}
engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)

param = next(model.parameters())
handles = {
    "optimizer": type(engine.optimizer.optimizer_swapper.aio_handle).__module__ + "." +
                 type(engine.optimizer.optimizer_swapper.aio_handle).__name__,
    "param": type(param.nvme_swapper.aio_read_handle).__module__ + "." +
             type(param.nvme_swapper.aio_read_handle).__name__,
}
g = torch.Generator().manual_seed(1)
teacher = torch.randn(64, 8, generator=g)  # a learnable target: the loss must fall
losses, swap_files = [], 0
for step in range(steps):
    x = torch.randn(32, 64, generator=g).to(torch.bfloat16)
    y = (x.float() @ teacher).argmax(dim=1)
    loss = torch.nn.functional.cross_entropy(engine(x).float(), y)
    engine.backward(loss)
    engine.step()
    losses.append(loss.item())
    if step == 0:
        swap_files = sum(len(f) for _, _, f in os.walk(swap))
        # install()'s default keeps the swapped tensors in Spillway's NVMe arena, not in files
        stored = sum(s["files"] for s in spillway.deepspeed.swap_stats().values()) if which == "spillway" else 0
print(json.dumps({"losses": losses, "handles": handles, "swap_files": swap_files, "stored_files": stored}), flush=True)
if which == "deepspeed":
    # Plain DeepSpeed's run, the reference, has aborted twice in CI after printing its results
    # ("terminate called without an active exception", exit -6), the second time with the process
    # group already destroyed at exit (_dist.py): its interpreter's teardown (DeepSpeed's libaio
    # handles, its shm comm op) is not what this test compares. Spillway's run tears down in full.
    os._exit(0)
