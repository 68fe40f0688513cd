"""spillway.trainer: Spillway's ZeRO-3 reference trainer (C++, trainer/trainer.h) driven from Python.
spillway.engine is its old name, kept as an alias (engine.py).

Its reason to exist is the process group. The trainer's collectives are c10d's ProcessGroupGloo
from libtorch, but the torch wheels ship c10d's headers without gloo's, so C++ cannot construct one
itself. It can use one that Python made:

    torch.distributed.init_process_group("gloo")        # torchrun's RANK, WORLD_SIZE, MASTER_*
    out = spillway.trainer.train_gpt(ds_config, steps=50, micro_batches=2,
                                     group=torch.distributed.group.WORLD)

On GPUs, give the group an NCCL backend for CUDA as well; the trainer then all-gathers parameters
and reduce-scatters gradients on the device (only each rank's shard crosses PCIe) while the
gradient norm and loss sums stay on gloo:

    torch.distributed.init_process_group("cpu:gloo,cuda:nccl")
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    out = spillway.trainer.train_gpt(ds_config, steps=50, device="cuda", group=torch.distributed.group.WORLD)

Run it multi-process with `torchrun --nproc-per-node 2 -m spillway.trainer --steps 20` (or across
nodes with torchrun's usual flags). See docs/engine.md, Note [Process groups].
"""
import json
import os

import torch  # noqa: F401  (loads libtorch before the extension)

from . import _spillway

DEFAULT_MODEL = {"vocab": 32, "d_model": 32, "n_layer": 2, "n_head": 2, "seq_len": 16, "seed": 7}


def train_gpt(config, *, steps, micro_batches=1, batch_rows=4, model=None, data_seed=10_000,
              device="cpu", group=None, save=None, resume=None):
    """Trains the reference GPT for `steps` optimizer steps and returns a dict: `losses` (one per
    step, the mean over every rank's micro-batches), `params` (each unit's full parameters after the
    last step, gathered), `backend` ("single" or the group's, e.g. "gloo" or "cpu:gloo,cuda:nccl"),
    `compute_device` (where forward and backward ran), `collectives_device` (where the per-unit
    all-gather and reduce-scatter ran), `rank`, `world_size`, and the host/NVMe bytes still live and
    the host arena's escapes when it finished.

    `config` is a DeepSpeed config (a dict or a JSON string): zero_optimization.offload_param and
    offload_optimizer place the states, `optimizer` and `gradient_clipping` set the step. Each step
    every rank trains on `micro_batches` micro-batches of `batch_rows` sequences; they are global
    micro-batches rank*micro_batches .. rank*micro_batches+micro_batches-1 of a deterministic stream,
    so world size W with M micro-batches sees the batch world size 1 sees with W*M.

    `device`: "cpu", "cuda" (this LOCAL_RANK's GPU), "cuda:N" or "auto".
    `group`: a torch.distributed ProcessGroup with a CPU backend (gloo), and a CUDA one (nccl) for
    collectives on the GPU; or None for one process.
    `resume`: a checkpoint directory (what `save` was given, or one of its step-N directories): the
    trainer starts from it and trains `steps` more steps, from the checkpoint's step on (the
    result's `start_step`), on the micro-batches an uninterrupted run would see there.
    `save`: a directory; after the last step every rank writes its partitions there and the result's
    `checkpoint` names the new checkpoint (docs/checkpoint.md).
    Errors are spillway exceptions naming what to change; every rank must call this together.
    """
    if not isinstance(config, str):
        config = json.dumps(config)
    return _spillway._train_gpt(config, dict(model or DEFAULT_MODEL), int(steps), int(micro_batches),
                                int(batch_rows), int(data_seed), str(device), group,
                                "" if save is None else os.fspath(save),
                                "" if resume is None else os.fspath(resume))


def _main(argv=None):
    """`torchrun --nproc-per-node N -m spillway.trainer` (or spillway.engine, its old name): the trainer on
    torchrun's process group."""
    import argparse
    import os
    import tempfile

    import torch.distributed as dist

    p = argparse.ArgumentParser(prog="python -m spillway.trainer", description=_main.__doc__)
    p.add_argument("--config", help="DeepSpeed config JSON file (default: optimizer on pinned host, "
                                    "parameters on NVMe in a temporary directory)")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--micro-batches", type=int, default=2, help="per rank, per step")
    p.add_argument("--device", default="cpu",
                   help="cpu, or cuda: each rank on its LOCAL_RANK's GPU, collectives on NCCL")
    a = p.parse_args(argv)
    distributed = "WORLD_SIZE" in os.environ
    if distributed:
        if a.device.startswith("cuda"):
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")) if a.device == "cuda" else a.device)
            dist.init_process_group("cpu:gloo,cuda:nccl")
        else:
            dist.init_process_group("gloo")
    with tempfile.TemporaryDirectory(prefix="spillway-engine-") as swap:
        if a.config:
            with open(a.config) as f:
                config = json.load(f)
        else:
            config = {"zero_optimization": {"stage": 3,
                                            "offload_optimizer": {"device": "cpu", "pin_memory": True},
                                            "offload_param": {"device": "nvme", "nvme_path": swap}},
                      "optimizer": {"type": "AdamW", "params": {"lr": 3e-3, "weight_decay": 0.01}},
                      "gradient_clipping": 1.0,
                      "spillway": {"host_budget_bytes": "1GiB", "nvme_budget_bytes": "1GiB"}}
        out = train_gpt(config, steps=a.steps, micro_batches=a.micro_batches, device=a.device,
                        group=dist.group.WORLD if distributed else None)
    if out["rank"] == 0:
        for i, loss in enumerate(out["losses"]):
            print(f"step {i:4d}  loss {loss:.6f}")
        print(json.dumps({"backend": out["backend"], "world_size": out["world_size"],
                          "compute_device": out["compute_device"],
                          "collectives_device": out["collectives_device"],
                          "final_loss": out["losses"][-1], "host_live_bytes": out["host_live_bytes"],
                          "host_escapes": out["host_escapes"]}))
    if distributed:
        dist.destroy_process_group()


if __name__ == "__main__":
    _main()
