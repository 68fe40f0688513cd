"""One ZeRO-Infinity run (the real DeepSpeed on its CPU accelerator, bf16, optimizer state and
parameters on NVMe above DeepSpeed's swap threshold) after spillway.deepspeed.install(), in a
process of its own, for the swap store's tests (tests/python/test_deepspeed_swap.py):

    python ds_infinity.py corrupt SWAP OUT.json        flip a byte of a swapped Adam moment on disk,
                                                       with a metrics exporter started before the
                                                       engine and one after (their scrapes in OUT)
    python ds_infinity.py run SWAP arena|files         train, printing "step N", until killed
    python ds_infinity.py save SWAP CKPT OUT.json      3 steps, save_checkpoint, 2 more steps
    python ds_infinity.py load SWAP CKPT OUT.json      load_checkpoint, 2 steps

Each step's batch comes from a generator seeded with the step's number, so a run that loads a
checkpoint saved after step 3 sees the batches the saving run saw at steps 4 and 5.
"""
import json
import os
import sys

os.environ.setdefault("DS_ACCELERATOR", "cpu")
import torch  # noqa: E402
import deepspeed  # noqa: E402
import spillway  # noqa: E402
from _dist import infinity_offload, world_from_env_or_single  # noqa: E402

mode, swap = sys.argv[1], sys.argv[2]
swap_mode = sys.argv[3] if mode == "run" else os.environ.get("DS_INFINITY_SWAP", "arena")
if swap_mode != "plain":  # "plain": DeepSpeed without Spillway (the control)
    spillway.deepspeed.install(nvme_swap=swap_mode)
world_from_env_or_single()
exporters = [spillway.metrics.serve("127.0.0.1:0")] if mode == "corrupt" else []  # before any swap store
deepspeed.init_distributed(dist_backend="gloo", auto_mpi_discovery=False)
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(64, 1024), torch.nn.GELU(), torch.nn.Linear(1024, 1024), torch.nn.GELU(),
                            torch.nn.Linear(1024, 1024), torch.nn.GELU(), torch.nn.Linear(1024, 8))
zero, aio = infinity_offload(swap)  # the equivalence test's settings (_dist.py)
config = {
    "train_micro_batch_size_per_gpu": 16,
    "optimizer": {"type": "AdamW", "params": {"lr": 3e-3}},
    "bf16": {"enabled": True},
    "zero_optimization": {"stage": 3, **zero},
    "aio": aio,
}
engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
teacher = torch.randn(64, 8, generator=torch.Generator().manual_seed(1))


def step(n):
    g = torch.Generator().manual_seed(100 + n)
    x = torch.randn(16, 64, generator=g).to(torch.bfloat16)
    y = (x.float() @ teacher).argmax(dim=1)
    loss = torch.nn.functional.cross_entropy(engine(x).float(), y)
    engine.backward(loss)
    engine.step()
    return loss.item()


def scrape(exporter):
    import urllib.request  # noqa: PLC0415

    with urllib.request.urlopen(f"http://127.0.0.1:{exporter.port}/metrics", timeout=30) as r:
        return r.read().decode()


def store_and_paths():
    if not spillway.deepspeed.swap_stats():  # nvme_swap="files": DeepSpeed's own files
        return None, []
    (root,) = spillway.deepspeed.swap_stats()
    from spillway.deepspeed import _swap as _deepspeed_swap

    store = _deepspeed_swap._stores[(os.getpid(), root)]
    return store, store.paths(root)


if mode == "corrupt":
    step(1)
    step(2)
    store, paths = store_and_paths()
    exporters.append(spillway.metrics.serve("127.0.0.1:0"))  # after the store exists
    target = next(p for p in paths if os.path.basename(p).startswith("exp_avg_sq-"))
    store._corrupt_for_testing(target, 100)
    out = {"target": target, "error": None, "type": None, "root": next(iter(spillway.deepspeed.swap_stats()))}
    try:
        for n in range(3, 6):
            step(n)
    except spillway.ChecksumMismatch as e:
        out.update(error=str(e), type=type(e).__name__)
    out["scrapes"] = [scrape(e) for e in exporters]
    json.dump(out, open(sys.argv[3], "w"))
elif mode == "run":
    n = 0
    while True:
        n += 1
        step(n)
        print(f"step {n}", flush=True)
elif mode == "save":
    losses = [step(n) for n in (1, 2, 3)]
    engine.save_checkpoint(sys.argv[3], tag="t3")
    store, paths = store_and_paths()
    left = [p for p in paths if os.path.exists(p)]  # the files written out for DeepSpeed's copy
    losses += [step(n) for n in (4, 5)]
    json.dump({"losses": losses, "left_in_swap_folder": left,
               "stats": spillway.deepspeed.swap_stats()}, open(sys.argv[4], "w"))
elif mode == "load":
    engine.load_checkpoint(sys.argv[3], tag="t3")
    store, paths = store_and_paths()
    left = [p for p in paths if os.path.exists(p)]  # the checkpoint's files, taken into the store
    losses = [step(n) for n in (4, 5)]
    json.dump({"losses": losses, "left_in_swap_folder": left,
               "stats": spillway.deepspeed.swap_stats()}, open(sys.argv[4], "w"))
else:
    sys.exit(f"unknown mode {mode!r}: corrupt, run, save or load")
