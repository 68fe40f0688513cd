"""A DeepSpeed ZeRO-3 run (CPU accelerator, bf16, offload cpu) of a transformers GPT-2 built from a
tiny config (tied embeddings), saved with DeepSpeed's own engine.save_16bit_model, with
spillway.deepspeed.save_16bit_model and (under install(), into DS_DIR-engine) with
engine.save_16bit_model as install() leaves it, streamed in DeepSpeed's format; each save's peak host
memory measured.

    python ds_save.py OUT.json DS_DIR SPILLWAY_DIR [N_LAYER] [N_EMBD] [MAX_SHARD_BYTES]

World size 1 by default; with RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT set by the caller, one
rank of that world (rank 0 writes OUT.json). At world size 1 "gathering" a parameter allocates
nothing (the partition is the whole parameter), so the memory comparison runs at world size 2.

Peak memory: _peak.peak (VmHWM after clear_refs less VmRSS before, freed heap trimmed first)."""
import json
import os
import sys

os.environ.setdefault("DS_ACCELERATOR", "cpu")
import torch  # noqa: E402
import deepspeed  # noqa: E402
from _dist import backend, device, world_from_env_or_single  # noqa: E402
from _peak import peak  # noqa: E402
import transformers  # noqa: E402

import spillway  # noqa: E402

out, ds_dir, sp_dir = sys.argv[1:4]
n_layer = int(sys.argv[4]) if len(sys.argv) > 4 else 2
n_embd = int(sys.argv[5]) if len(sys.argv) > 5 else 64
max_shard = int(sys.argv[6]) if len(sys.argv) > 6 else 1 << 20
if os.environ.get("DS_SAVE_INSTALL", "1") == "1":
    spillway.deepspeed.install()
world_from_env_or_single()
deepspeed.init_distributed(dist_backend=backend(), auto_mpi_discovery=False)

torch.manual_seed(0)
cfg = transformers.GPT2Config(n_layer=n_layer, n_embd=n_embd, n_head=4, vocab_size=512, n_positions=64)
model = transformers.GPT2LMHeadModel(cfg)
config = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1,
          "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
          "bf16": {"enabled": True},
          "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu"},
                                "offload_param": {"device": "cpu"},
                                "stage3_gather_16bit_weights_on_model_save": True}}
engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
ids = torch.randint(0, 512, (2, 32), generator=torch.Generator().manual_seed(1)).to(device())
for _ in range(2):
    loss = engine(input_ids=ids, labels=ids).loss
    engine.backward(loss)
    engine.step()


# DS_SAVE_FILL_RANK0=1: rank 0's host arena is filled until a 512 KiB allocation no longer fits
# (the free space inside its regions too), so it has no room for the arena's gathers and every rank
# must fall back to torch's allocator together.
if os.environ.get("DS_SAVE_FILL_RANK0") == "1" and int(os.environ.get("RANK", "0")) == 0:
    s = spillway.installed().host.stats()
    filler = []
    with spillway.tag("transient"):
        filler.append(torch.empty(max(s["budget_bytes"] - s["committed_bytes"] - (8 << 20), 0) // 4))
        try:
            while True:
                filler.append(torch.empty((512 << 10) // 4))
        except torch.OutOfMemoryError:  # spillway.OverBudget is one too
            pass
# DS_SAVE_FAIL_RANK0=open: rank 0 cannot create the checkpoint directory (a file sits at its path);
# =write: rank 0's third tensor write fails with ENOSPC; =commit: rank 0's commit fails with EIO
# before it renames anything (fault seams on rank 0's Writer); =unverified: every rank runs as
# DeepSpeed 0.18.9, whose multi-rank gather gave wrong values. Every
# rank records what save_16bit_model raised in OUT.json.rankN, then all meet in a barrier: a rank
# still inside the save's collectives would leave the others waiting there.
fail = os.environ.get("DS_SAVE_FAIL_RANK0")
if fail:
    import errno  # noqa: E402

    from spillway import safetensors_stream  # noqa: E402

    rank = int(os.environ["RANK"])
    if fail == "unverified":  # every rank: a DeepSpeed whose multi-rank gather was never checked
        deepspeed.__version__ = "0.18.9"
    if rank == 0 and fail == "open":
        open(sp_dir, "w").close()
    if rank == 0 and fail == "write":
        real_write, calls = safetensors_stream.Writer.write, []

        def failing_write(self, name, tensor):
            calls.append(name)
            if len(calls) == 3:
                raise OSError(errno.ENOSPC, "No space left on device (injected)", name)
            return real_write(self, name, tensor)
        safetensors_stream.Writer.write = failing_write
    if rank == 0 and fail == "commit":
        def failing_commit(self):
            raise OSError(errno.EIO, "Input/output error (injected)", "fsync")
        safetensors_stream.Writer.commit = failing_commit
    try:
        spillway.deepspeed.save_16bit_model(engine, sp_dir, max_shard_size=max_shard)
        raised = None
    except Exception as e:  # noqa: BLE001 (recorded for the test to judge)
        raised = {"type": type(e).__name__, "message": str(e)}
    torch.distributed.barrier()
    json.dump({"raised": raised, "left": sorted(os.listdir(sp_dir)) if os.path.isdir(sp_dir) else None},
              open(f"{out}.rank{rank}", "w"))
    torch.distributed.destroy_process_group()
    sys.exit(0)
# DeepSpeed's own save, the control: under install() engine.save_16bit_model is Spillway's streamed
# one (DeepSpeed's format), measured after it into DS_DIR-engine.
deepspeeds = getattr(type(engine).save_16bit_model, "__spillway_original__", type(engine).save_16bit_model)
ds_peak, _ = peak(lambda: deepspeeds(engine, ds_dir))
sp_peak, files = peak(lambda: spillway.deepspeed.save_16bit_model(engine, sp_dir, max_shard_size=max_shard))
engine_peak, engine_streamed, save_warnings = None, None, []
if deepspeeds is not type(engine).save_16bit_model:
    import warnings  # noqa: E402

    from spillway.deepspeed import _save as _deepspeed_save  # noqa: E402

    streams = _deepspeed_save._streams
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", spillway.deepspeed.SaveWarning)
        engine_peak, saved = peak(lambda: engine.save_16bit_model(ds_dir + "-engine"))
    assert saved is True
    engine_streamed = _deepspeed_save._streams - streams
    save_warnings = [str(w.message) for w in caught if issubclass(w.category, spillway.deepspeed.SaveWarning)]
model.config.save_pretrained(sp_dir)
params = list(model.parameters())
if int(os.environ["RANK"]) == 0:
    json.dump({"engine_device": str(engine.device), "ds_peak": ds_peak, "spillway_peak": sp_peak, "engine_peak": engine_peak,
               "engine_streamed": engine_streamed, "warnings": save_warnings, "files": [os.path.basename(f) for f in files],
               "model_bytes": sum(p.ds_numel * p.element_size() for p in params),
               "largest_param_bytes": max(p.ds_numel * p.element_size() for p in params)}, open(out, "w"))
# The ranks leave the group together: a rank that exits while its peer's Gloo connections to it are
# open can abort that peer at exit ("terminate called without an active exception"), seen once
# rank 0's save took longer than rank 1's.
torch.distributed.barrier()
torch.distributed.destroy_process_group()
print("done")
