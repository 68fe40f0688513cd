"""One training run through a client users launch DeepSpeed with (tests/python/test_deepspeed_clients.py):

    python ds_client.py configs DIR                                     writes DIR/zero3.json, DIR/accelerate.yaml
    python ds_client.py trainer OUT_DIR                                 HF Trainer, TrainingArguments(deepspeed=...)
    torchrun --nproc_per_node 2 ds_client.py trainer OUT_DIR            the same on two ranks
    accelerate launch --config_file DIR/accelerate.yaml ds_client.py accelerate OUT_DIR
    deepspeed --num_gpus 1 ds_client.py engine OUT_DIR                 deepspeed.initialize, its own loop
    torchrun --nproc_per_node 2 ds_client.py engine OUT_DIR            the same under torchrun

With SPILLWAY_CLIENT_INSTALL=1 the script carries the one line, spillway.deepspeed.install(); without
it, it is the control. The model is a GPT-2 from a small config (no download), ZeRO-3 with optimizer
state and parameters offloaded to the CPU, bf16, DeepSpeed's CPU accelerator. The DataLoader forks 2
workers at every epoch (persistent_workers=False). Each rank writes OUT_DIR/rank<R>.json: per epoch, what the
first optimizer step after the fork added to the anonymous PSS of that rank's process tree (the
copy-on-write the issue is about, measured as spillway.leak_suite does), and the losses. The trainer
also saves a checkpoint at each epoch and the model at the end; with the one line it records, at each
epoch's end and after each save, the rank's memory by owner (spillway.node.memory())."""
import json
import os
import sys
import time

os.environ.setdefault("DS_ACCELERATOR", "cpu")
client, out_dir = [a for a in sys.argv[1:] if not a.startswith("--local_rank")]  # the deepspeed launcher adds it
INSTALL = os.environ.get("SPILLWAY_CLIENT_INSTALL") == "1"

import torch  # noqa: E402

if INSTALL:
    import spillway.deepspeed  # noqa: E402

    spillway.deepspeed.install()  # the one line

import transformers  # noqa: E402
from _dist import world_from_env_or_single  # noqa: E402
from spillway.leak_suite import tree_pss_anon  # noqa: E402

world_from_env_or_single()  # a launcher's world, else rank 0 of 1 (`python ds_client.py trainer`)

EPOCHS, STEPS, MICRO, SEQ, SETTLE, LR = 3, 4, 4, 32, 1.0, 3e-4


def model():
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(vocab_size=4096, n_positions=SEQ, n_embd=384, n_layer=4, n_head=4, bos_token_id=0, eos_token_id=0)
    return transformers.GPT2LMHeadModel(cfg)


class Tokens(torch.utils.data.Dataset):
    def __init__(self, n):
        self.ids = torch.randint(0, 4096, (n, SEQ), generator=torch.Generator().manual_seed(1))

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def ds_config(auto):
    """ZeRO-3 cpu/cpu. HF Trainer and Accelerate fill "auto" from their own arguments."""
    return {
        "train_micro_batch_size_per_gpu": "auto" if auto else MICRO,
        "gradient_accumulation_steps": "auto" if auto else 1,
        "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.0}},
        "bf16": {"enabled": True},
        "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu", "pin_memory": True},
                              "offload_param": {"device": "cpu", "pin_memory": True}},
    }


class ForkGrowth:
    """The first optimizer step of each epoch, after the DataLoader's workers are up: the tree's
    anonymous PSS before it and after it."""

    def __init__(self):
        self.epochs, self.losses, self.before, self.owners = [], [], None, []

    def first_step_begins(self):
        time.sleep(SETTLE)  # the workers finish prefetching (their own writes copy pages too)
        self.before = tree_pss_anon()

    def step_ended(self, loss):
        if self.before is not None:
            self.epochs.append({"first_step_growth_bytes": tree_pss_anon() - self.before})
            self.before = None
        if loss is not None:
            self.losses.append(float(loss))

    def memory(self, when):
        if INSTALL:
            import spillway.node  # noqa: PLC0415

            m = spillway.node.memory()
            self.owners.append({"when": when, **{k: m[k] for k in ("owners", "named_fraction", "resident_bytes",
                                                                    "counted_beyond_resident_bytes", "text")}})

    def write(self, rank, engine, **extra):
        import spillway.deepspeed  # noqa: PLC0415 (the control imports it here, after training)

        os.makedirs(out_dir, exist_ok=True)
        state = sum(t.untyped_storage().nbytes() for _n, _k, t in spillway.deepspeed.offloaded_tensors(engine))
        out = {"client": client, "installed": INSTALL, "epochs": self.epochs, "losses": self.losses,
               "offloaded_bytes": state, "memory": self.owners, **extra}
        if INSTALL:
            out["host_live_by_kind"] = spillway.installed().host.stats()["live_by_kind"]
        with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
            json.dump(out, f)


def loader(dataset, batch_size):
    return torch.utils.data.DataLoader(dataset, batch_size=batch_size, num_workers=2, persistent_workers=False,
                                       multiprocessing_context="fork")


def train_loop(engine, data, backward, optimizer_step):
    """The user's loop: EPOCHS passes over a DataLoader that forks its workers at each."""
    for _epoch in range(EPOCHS):
        for i, batch in enumerate(data):
            if i == 0:
                growth.first_step_begins()
            loss = engine(**batch).loss
            backward(loss)
            optimizer_step()
            growth.step_ended(loss.item())


growth = ForkGrowth()
if client == "configs":  # what `accelerate launch` reads
    os.makedirs(out_dir, exist_ok=True)
    ds = os.path.join(out_dir, "zero3.json")
    with open(ds, "w") as f:
        json.dump(ds_config(auto=True), f)
    with open(os.path.join(out_dir, "accelerate.yaml"), "w") as f:
        f.write("compute_environment: LOCAL_MACHINE\ndistributed_type: DEEPSPEED\n"
                f"deepspeed_config:\n  deepspeed_config_file: {ds}\n  zero3_init_flag: false\n"
                "machine_rank: 0\nnum_machines: 1\nnum_processes: 1\nuse_cpu: true\n"
                "main_process_ip: 127.0.0.1\nrdzv_backend: static\nsame_network: true\n")
elif client == "trainer":
    class Measure(transformers.TrainerCallback):
        def on_epoch_begin(self, args, state, control, **kw):
            self.first = True

        def on_step_begin(self, args, state, control, **kw):
            if self.first:
                growth.first_step_begins()
                self.first = False

        def on_step_end(self, args, state, control, **kw):
            growth.step_ended(None)

        def on_epoch_end(self, args, state, control, **kw):
            growth.memory(f"end of epoch {round(state.epoch or 0)}")

        def on_save(self, args, state, control, **kw):
            growth.memory(f"after the checkpoint of step {state.global_step}")

        def on_log(self, args, state, control, logs=None, **kw):
            if logs and "loss" in logs:
                growth.losses.append(logs["loss"])

    args = transformers.TrainingArguments(
        output_dir=os.path.join(out_dir, "trainer"), deepspeed=ds_config(auto=True), per_device_train_batch_size=MICRO,
        num_train_epochs=EPOCHS, learning_rate=LR, bf16=True, use_cpu=True, logging_steps=1, save_strategy="epoch", report_to=[],
        dataloader_num_workers=2, dataloader_persistent_workers=False, disable_tqdm=True, seed=0)
    trainer = transformers.Trainer(model=model(), args=args, train_dataset=Tokens(STEPS * MICRO * int(os.environ["WORLD_SIZE"])),
                                 callbacks=[Measure()])  # STEPS steps per rank, as the other clients take
    trainer.train()
    trainer.save_model(os.path.join(out_dir, "final"))
    growth.memory("after the final save_model")
    growth.write(args.process_index, trainer.model_wrapped, world=args.world_size)
elif client == "accelerate":
    import accelerate  # noqa: E402
    from accelerate.utils import DummyOptim  # noqa: E402

    acc = accelerate.Accelerator()  # the DeepSpeed plugin comes from `accelerate launch`'s config
    m = model()
    engine, opt, data = acc.prepare(m, DummyOptim(m.parameters()), loader(Tokens(STEPS * MICRO), MICRO))

    def optimizer_step():
        opt.step()
        opt.zero_grad()

    train_loop(engine, data, acc.backward, optimizer_step)
    growth.write(acc.process_index, engine, world=acc.num_processes)
elif client == "engine":
    import deepspeed  # noqa: E402

    deepspeed.init_distributed(dist_backend="gloo", auto_mpi_discovery=False)
    m = model()
    engine, *_ = deepspeed.initialize(model=m, model_parameters=m.parameters(), config=ds_config(auto=False))
    train_loop(engine, loader(Tokens(STEPS * MICRO), MICRO), engine.backward, engine.step)
    growth.write(int(os.environ["RANK"]), engine, world=int(os.environ["WORLD_SIZE"]))
else:
    sys.exit(f"unknown client {client!r}: trainer, accelerate or engine")
