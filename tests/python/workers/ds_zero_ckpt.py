"""A DeepSpeed checkpoint for spillway.zero_to_fp32's tests (tests/python/test_deepspeed_save.py): one
rank of a Gloo group (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT set by the caller), DeepSpeed's CPU
accelerator, under spillway.deepspeed.install(), a GPT-2 from a tiny config (tied embeddings) with
its first block frozen and two persistent buffers of its own (float and int64), bf16, one step, then
engine.save_checkpoint(CHECKPOINT_DIR):

    python ds_zero_ckpt.py STAGE CHECKPOINT_DIR

STAGE 2 offloads the optimizer to the CPU; STAGE 3 the parameters too."""
import os
import sys

os.environ.setdefault("DS_ACCELERATOR", "cpu")
import torch  # noqa: E402

import spillway.deepspeed  # noqa: E402

spillway.deepspeed.install()
import deepspeed  # noqa: E402
import transformers  # noqa: E402
from _dist import world_from_env_or_single  # noqa: E402

stage, ckpt = int(sys.argv[1]), sys.argv[2]
world_from_env_or_single()
deepspeed.init_distributed(dist_backend="gloo", auto_mpi_discovery=False)
torch.manual_seed(0)
cfg = transformers.GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=512, n_positions=32, bos_token_id=0,
                              eos_token_id=0)
model = transformers.GPT2LMHeadModel(cfg)
model.register_buffer("probe_scale", torch.linspace(0.5, 2.0, 7))
model.register_buffer("probe_index", torch.arange(5, dtype=torch.int64) * 3)
for p in model.transformer.h[0].parameters():
    p.requires_grad_(False)
zero = {"stage": stage, "offload_optimizer": {"device": "cpu"}}
if stage == 3:
    zero["offload_param"] = {"device": "cpu"}
config = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
          "bf16": {"enabled": True}, "zero_optimization": zero}
engine, *_ = deepspeed.initialize(model=model, model_parameters=[p for p in model.parameters() if p.requires_grad],
                                  config=config)
ids = torch.randint(0, 512, (2, 16), generator=torch.Generator().manual_seed(1))
loss = engine(input_ids=ids, labels=ids).loss
engine.backward(loss)
engine.step()
engine.save_checkpoint(ckpt)
torch.distributed.barrier()
torch.distributed.destroy_process_group()
