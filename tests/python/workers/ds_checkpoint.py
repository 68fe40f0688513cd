"""DeepSpeed's own engine.save_checkpoint / load_checkpoint (ZeRO-3 or ZeRO-2, optimizer state and
for ZeRO-3 the parameters offloaded to the CPU, bf16; DeepSpeed's CPU accelerator and Gloo, or CUDA
and NCCL under DS_ACCELERATOR=cuda) in one process, plain or
after spillway.deepspeed.install(): test_deepspeed_checkpoint.py's worker.

    python ds_checkpoint.py OUT.json '{"stage": 3, "spillway": true, ...}'

The JSON spec's keys (all optional):
  stage 3|2; spillway (install() first); params (MLP size, the leak suite's model);
  sub_group_size (ZeRO-3); load_dir, load_tag (load into the fresh engine after pre_steps steps;
  load_tag null reads `latest`); pre_steps; steps (training steps after the load, if any);
  saves (how many saves, each after `every` steps), save_dir, tag (a fixed tag; else DeepSpeed's
  global_step<N>); kill_after_files (the fault seam: SIGKILL after this many checkpoint files of
  the last save); expect_error (the load must raise an exception whose class name is this; the
  engine's state before and after it is recorded); expect_save_error (the same for the first
  save); also_plain_dir (after the saves, save once more
  there through DeepSpeed's own TorchCheckpointEngine); node_local (DeepSpeed's
  checkpoint.use_node_local_storage, each rank its own node: local rank 0, and "{rank}" in save_dir
  and load_dir is its global rank, so each saves to and loads from a directory of its own).

OUT.json: losses (one per step, floats), digest (a SHA-256 over the offloaded fp32 master
partitions and Adam moments, in offloaded_tensors order, at the end), state_bytes, saves (per
save: RssAnon after it over before the first, and the peak over just before it), load (peak
RssAnon over just before it, what it left, and the RssFile peak), audit (after the load: bytes of
offloaded state that are not in Spillway's arenas), largest (the largest offloaded tensor's bytes),
error (the expected error's message), digest_before_error, engine_device (where DeepSpeed's
engine computes), digests (each rank's digest at the end)."""
import hashlib
import json
import os
import sys

os.environ.setdefault("DS_ACCELERATOR", "cpu")
import torch  # noqa: E402

out_path, spec = sys.argv[1], json.loads(sys.argv[2])
torch.set_num_threads(1)
if spec.get("spillway"):
    import spillway.deepspeed  # noqa: E402

    spillway.deepspeed.install()
import deepspeed  # noqa: E402
from _dist import backend, device, world_from_env_or_single  # noqa: E402

# The bench's RSS sampler (the same numbers as bench/measure_deepspeed_checkpoint.py).
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "..", "bench"))
from measure_deepspeed_checkpoint import Peak, status  # noqa: E402
from spillway.deepspeed import offloaded_tensors  # noqa: E402
from spillway.leak_suite import build_model  # noqa: E402


world_from_env_or_single()
if spec.get("node_local"):  # every rank the first of its node: each writes its node's model states
    os.environ["LOCAL_RANK"] = "0"
    for key in ("save_dir", "load_dir"):
        if key in spec:
            spec[key] = spec[key].format(rank=os.environ["RANK"])
deepspeed.init_distributed(dist_backend=backend(), auto_mpi_discovery=False)
stage = spec.get("stage", 3)
zero = {"stage": stage, "offload_optimizer": {"device": "cpu", "pin_memory": True}}
if stage == 3:
    zero["offload_param"] = {"device": "cpu", "pin_memory": True}
    zero["sub_group_size"] = spec.get("sub_group_size", 1 << 20)
config = {"train_micro_batch_size_per_gpu": 8, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
          "bf16": {"enabled": True}, "zero_optimization": zero}
if spec.get("node_local"):
    config["checkpoint"] = {"use_node_local_storage": True}
torch.manual_seed(0)
model = build_model(int(float(spec.get("params", 2e6))), torch)
engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
out = {"losses": [], "saves": [], "engine_device": str(engine.device)}


def step():
    # The batch depends on the global step only, so a resumed run sees the batches the
    # uninterrupted one saw.
    g = torch.Generator().manual_seed(1000 + engine.global_steps)
    x = torch.randn(8, 64, generator=g).to(device(), torch.bfloat16)
    loss = engine(x).float().square().mean()
    engine.backward(loss)
    engine.step()
    out["losses"].append(loss.item())


def digest():
    h = hashlib.sha256()
    for _name, kind, t in offloaded_tensors(engine):
        if kind in ("master_weight", "optimizer_state"):
            h.update(t.detach().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def raised(fn, expected):
    """fn()'s exception, as "Class: message", where its class is named `expected`; any other
    exception goes on, and none at all ends the worker with an error."""
    try:
        fn()
    except Exception as e:  # noqa: BLE001 (the test names the class it expects)
        if type(e).__name__ != expected:
            raise
        return f"{type(e).__name__}: {e}"
    raise SystemExit(f"{fn} did not raise {expected}")


def finish():
    """Writes OUT.json (rank 0) and leaves the process group together with the other ranks (a rank
    that exits while Gloo's connections to it are open can abort its peer at exit)."""
    if int(os.environ.get("RANK", "0")) == 0:
        with open(out_path, "w") as f:
            json.dump(out, f)
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()
    sys.exit(0)


for _ in range(spec.get("pre_steps", 0)):
    step()
if "load_dir" in spec:
    if "expect_error" in spec:
        out["digest_before_error"] = digest()
        out["error"] = raised(lambda: engine.load_checkpoint(spec["load_dir"], tag=spec.get("load_tag")),
                              spec["expect_error"])
        out["digest"] = digest()
        finish()
    with Peak() as p:
        path, _client = engine.load_checkpoint(spec["load_dir"], tag=spec.get("load_tag"))
    assert path is not None, "load_checkpoint found no checkpoint"
    out["load"] = {"peak_over_before": p.peak - p.before, "left": p.after - p.before,
                   "file_peak_over_before": p.file_peak - p.file_before}
    if spec.get("spillway"):
        report = spillway.deepspeed.audit(engine)
        out["audit"] = {"missed": report["missed"], "total_bytes": report["total_bytes"]}
tensors = list(offloaded_tensors(engine))
out["state_bytes"] = sum(t.untyped_storage().nbytes() for _n, _k, t in tensors)
out["largest"] = max(t.untyped_storage().nbytes() for _n, _k, t in tensors)
for _ in range(spec.get("steps", 0)):
    step()
saves = spec.get("saves", 0)
base = status("RssAnon")
for i in range(saves):
    for _ in range(spec.get("every", 0)):
        step()
    if i == saves - 1 and "kill_after_files" in spec:
        os.environ["SPILLWAY_TESTING_CHECKPOINT_KILL_AFTER_FILES"] = str(spec["kill_after_files"])
    if "expect_save_error" in spec:
        out["error"] = raised(lambda: engine.save_checkpoint(spec["save_dir"], tag=spec.get("tag")),
                              spec["expect_save_error"])
        finish()
    with Peak() as p:
        engine.save_checkpoint(spec["save_dir"], tag=spec.get("tag"))
    out["saves"].append({"after": p.after - base, "peak_over_before": p.peak - p.before})
if "also_plain_dir" in spec:
    from deepspeed.runtime.checkpoint_engine.torch_checkpoint_engine import TorchCheckpointEngine

    engine.checkpoint_engine = TorchCheckpointEngine(engine._config)
    engine.save_checkpoint(spec["also_plain_dir"], tag=spec.get("tag"))
out["digest"] = digest()
out["digests"] = [out["digest"]]
if torch.distributed.get_world_size() > 1:
    out["digests"] = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(out["digests"], out["digest"])
finish()
