"""One rank of a whole HF Trainer run with the one line, in phases, for the planner's phase peaks
(tests/python/test_plan_phases.py): the model loaded with from_pretrained, under ZeRO-3's zero.Init
or whole on every rank, from safetensors or a torch .bin; then, with --train, HF Trainer's run
(ZeRO-3, optimizer state and parameters offloaded to the CPU, bf16, DeepSpeed's CPU accelerator,
Gloo): a DataLoader that forks 2 workers at every epoch, a checkpoint at every epoch's end, and the
final save_model.

    torchrun --nproc-per-node N ds_phases.py OUT_DIR MODEL_DIR {zero-init|whole} [--train]

Each rank writes OUT_DIR/rank<R>.json: the wall-clock interval of each phase and the rank's own
anonymous and shared PSS at its end ("load": HF's TrainingArguments under zero.Init, and from_pretrained;
"initialize": Trainer.train up to its first step, deepspeed.initialize inside; "boundary": the
first epoch after the first, from its start to the end of its first optimizer step, the step that
writes the state after the DataLoader forked; "checkpoint": each epoch's checkpoint; "final save":
Trainer.save_model) and, with --train, the phases admission planned at deepspeed.initialize
(spillway.node.planned_phases()). The caller samples the node's memory (the tree's anonymous and
shared PSS) and takes the level before loading and each phase's peak from its samples."""
import json
import os
import sys
import time

os.environ.setdefault("DS_ACCELERATOR", "cpu")
import torch  # noqa: E402

import spillway.deepspeed  # noqa: E402
import spillway.node  # noqa: E402

spillway.deepspeed.install()  # the one line

import deepspeed  # noqa: E402
import transformers  # noqa: E402
from _dist import world_from_env_or_single  # noqa: E402
from _launch import tree_bytes  # noqa: E402

out_dir, model_dir, init = sys.argv[1:4]
train = "--train" in sys.argv[4:]
if train and init != "zero-init":
    sys.exit("--train loads under zero.Init (HF Trainer's path); 'whole' is a load alone")
world_from_env_or_single()
EPOCHS, STEPS, MICRO, SEQ = 3, 3, 2, 32
phases = []


def phase(name, start):
    # The rank's own anonymous and shared PSS as the phase ends: the load's memory still rises in
    # its last tenth of a second, faster than the caller's sampler sweeps the node (~80 ms).
    held = tree_bytes(os.getpid(), ("Pss_Anon:", "Pss_Shmem:"))
    phases.append({"name": name, "start": start, "end": time.time(), "end_bytes": held})


def ds_config():
    return {
        "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
        "optimizer": {"type": "AdamW", "params": {"lr": 3e-4, "weight_decay": 0.0}},
        "bf16": {"enabled": True},
        "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu", "pin_memory": True},
                              "offload_param": {"device": "cpu", "pin_memory": True},
                              "stage3_gather_16bit_weights_on_model_save": True},
    }


class Tokens(torch.utils.data.Dataset):
    def __init__(self, n, vocab):
        self.ids = torch.randint(0, vocab, (n, SEQ), generator=torch.Generator().manual_seed(1))

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


class Phases(transformers.TrainerCallback):
    def __init__(self, started):
        self.started, self.epoch_start, self.first = started, None, False

    def on_train_begin(self, args, state, control, **kw):
        phase("initialize", self.started)

    def on_epoch_begin(self, args, state, control, **kw):
        self.epoch_start, self.first = time.time(), round(state.epoch or 0) >= 1

    def on_step_end(self, args, state, control, **kw):
        if self.first:
            phase("boundary", self.epoch_start)
            self.first = False

    def on_epoch_end(self, args, state, control, **kw):
        self.save_start = time.time()  # the checkpoint follows (save_strategy "epoch")

    def on_save(self, args, state, control, **kw):
        phase("checkpoint", self.save_start)


deepspeed.init_distributed(dist_backend="gloo", auto_mpi_discovery=False)
rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
torch.distributed.barrier()
time.sleep(0.2)  # the caller's sampler reads the level before loading
start = time.time()
args = None
if init == "zero-init":  # TrainingArguments(deepspeed=...) before the model: zero.Init
    args = transformers.TrainingArguments(
        output_dir=os.path.join(out_dir, "trainer"), deepspeed=ds_config(), per_device_train_batch_size=MICRO,
        num_train_epochs=EPOCHS, learning_rate=3e-4, bf16=True, use_cpu=True, logging_steps=1,
        save_strategy="epoch", report_to=[], dataloader_num_workers=2, dataloader_persistent_workers=False,
        disable_tqdm=True, seed=0)
model = transformers.AutoModelForCausalLM.from_pretrained(model_dir)
phase("load", start)
torch.distributed.barrier()
if train:
    start = time.time()
    trainer = transformers.Trainer(model=model, args=args, callbacks=[Phases(start)],
                                   train_dataset=Tokens(STEPS * MICRO * world, model.config.vocab_size))
    trainer.train()
    torch.distributed.barrier()
    start = time.time()
    trainer.save_model(os.path.join(out_dir, "final"))
    phase("final save", start)
    torch.distributed.barrier()
os.makedirs(out_dir, exist_ok=True)
with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
    json.dump({"rank": rank, "world": world, "phases": phases, "pid": os.getpid(),
               "admission": spillway.node.planned_phases()}, f)
