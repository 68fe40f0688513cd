"""HF Trainer's save_model of a ZeRO-3 model under the one line, against transformers' own
(tests/python/test_deepspeed_save.py): one rank of a Gloo group (RANK, WORLD_SIZE, MASTER_ADDR,
MASTER_PORT set by the caller), DeepSpeed's CPU accelerator, ZeRO-3 with parameters and optimizer
state offloaded to the CPU, bf16, a GPT-2 from a config (no download) built under zero.Init, one
training step, then:

    python ds_trainer_save.py OUT_DIR N_LAYER N_EMBD VOCAB [--checkpoint] [--accelerate] [--fail-rank0-save]

1. trainer.save_model(OUT_DIR/spillway): Trainer.save_model as spillway.deepspeed.install() leaves it
   (the weights streamed);
2. transformers' own Trainer.save_model (its __spillway_original__) into OUT_DIR/transformers, the
   control: Accelerate's get_state_dict gathers DeepSpeed's whole 16-bit state dict on rank 0.
Each save's peak on rank 0 is _peak.peak's (VmHWM after clear_refs less VmRSS before, after
malloc_trim). The streamed save runs first, so the control's freed gathers cannot lend it pages.
With --checkpoint the run saves a Trainer checkpoint after its step (save_strategy "steps"), whose
model half is the same save_model.
With --accelerate the run is Accelerate's instead (Accelerator with a DeepSpeedPlugin, its own loop),
and the saves are Accelerator.save_model's, streamed and Accelerate's own (the control).
With --fail-rank0-save, rank 0's Trainer._save (config, tokenizer, arguments) fails with ENOSPC in the
streamed save; then, with save_on_each_node set (which Spillway's save does not stream), the
Trainer's own save runs into OUT_DIR/each-node. Every rank records what the first raised, the saves
the second streamed and the SaveWarnings in OUT_DIR/raised.rank<R>.json, and the run ends.
Rank 0 writes OUT_DIR/result.json, with the SaveWarnings of the whole run and the number of saves
that were streamed (spillway.deepspeed._save._streams)."""
import json
import os
import sys
import warnings

os.environ.setdefault("DS_ACCELERATOR", "cpu")
import torch  # noqa: E402

import spillway.deepspeed  # noqa: E402
from spillway.deepspeed import _save as _deepspeed_save  # noqa: E402

caught = warnings.catch_warnings(record=True)
caught = caught.__enter__()  # every SaveWarning of the run, the checkpoint's during train() too
warnings.simplefilter("always", spillway.deepspeed.SaveWarning)
spillway.deepspeed.install()  # the one line

import transformers  # noqa: E402
from _dist import world_from_env_or_single  # noqa: E402
from _peak import peak  # noqa: E402

out_dir = sys.argv[1]
n_layer, n_embd, vocab = (int(a) for a in sys.argv[2:5])
checkpoint = "--checkpoint" in sys.argv[5:]
use_accelerate = "--accelerate" in sys.argv[5:]
fail_rank0 = "--fail-rank0-save" in sys.argv[5:]
world_from_env_or_single()
SEQ = 16


class Tokens(torch.utils.data.Dataset):
    def __init__(self, n):
        self.ids = torch.randint(0, vocab, (n, SEQ), generator=torch.Generator().manual_seed(1))

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


ds = {"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
      "optimizer": {"type": "AdamW", "params": {"lr": "auto"}}, "bf16": {"enabled": "auto"},
      "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu"}, "offload_param": {"device": "cpu"},
                            "stage3_gather_16bit_weights_on_model_save": True}}
torch.manual_seed(0)
cfg = transformers.GPT2Config(vocab_size=vocab, n_positions=SEQ, n_embd=n_embd, n_layer=n_layer, n_head=8,
                              bos_token_id=0, eos_token_id=0)
if use_accelerate:
    import accelerate  # noqa: E402
    from accelerate.utils import DeepSpeedPlugin, DummyOptim  # noqa: E402

    ds.update(train_micro_batch_size_per_gpu=1, gradient_accumulation_steps=1, bf16={"enabled": True})
    ds["optimizer"]["params"]["lr"] = 1e-3
    os.environ["ACCELERATE_USE_DEEPSPEED"] = "true"  # what `accelerate launch` sets for a DeepSpeed config
    acc = accelerate.Accelerator(deepspeed_plugin=DeepSpeedPlugin(hf_ds_config=ds, zero3_init_flag=True))
    model = transformers.AutoModelForCausalLM.from_config(cfg)
    engine, opt = acc.prepare(model, DummyOptim(model.parameters()))
    batch = Tokens(1)[0]
    acc.backward(engine(input_ids=batch["input_ids"][None], labels=batch["labels"][None]).loss)
    opt.step()
    rank0 = acc.is_main_process
    ours_dir, original = os.path.join(out_dir, "spillway"), accelerate.Accelerator.save_model.__spillway_original__

    def save_ours():
        acc.save_model(engine, ours_dir)

    def save_theirs():
        original(acc, engine, os.path.join(out_dir, "transformers"))
else:
    args = transformers.TrainingArguments(
        output_dir=os.path.join(out_dir, "run"), deepspeed=ds, per_device_train_batch_size=1, max_steps=1,
        learning_rate=1e-3, bf16=True, use_cpu=True, report_to=[], disable_tqdm=True, seed=0,
        save_strategy="steps" if checkpoint else "no", save_steps=1)
    model = transformers.AutoModelForCausalLM.from_config(cfg)  # zero.Init: TrainingArguments set HfDeepSpeedConfig
    trainer = transformers.Trainer(model=model, args=args, train_dataset=Tokens(2))
    trainer.train()
    engine, rank0 = trainer.model_wrapped, args.process_index == 0

    def save_ours():
        trainer.save_model(os.path.join(out_dir, "spillway"))

    def save_theirs():
        transformers.Trainer.save_model.__spillway_original__(trainer, os.path.join(out_dir, "transformers"))

    if fail_rank0:
        import errno  # noqa: E402

        real_save = transformers.Trainer._save
        if rank0:
            def failing_save(self, output_dir=None, state_dict=None):
                raise OSError(errno.ENOSPC, "No space left on device (injected)", output_dir)
            transformers.Trainer._save = failing_save
        try:
            trainer.save_model(os.path.join(out_dir, "spillway"))
            raised = None
        except Exception as e:  # noqa: BLE001 (recorded for the test to judge)
            raised = {"type": type(e).__name__, "message": str(e)}
        transformers.Trainer._save = real_save
        # Then a save that cannot be streamed (save_on_each_node): the Trainer's own, with one
        # SaveWarning naming the setting.
        trainer.args.save_on_each_node = True
        before = _deepspeed_save._streams
        trainer.save_model(os.path.join(out_dir, "each-node"))
        with open(os.path.join(out_dir, f"raised.rank{args.process_index}.json"), "w") as f:
            json.dump({"raised": raised, "streamed_after": _deepspeed_save._streams - before,
                       "warnings": [str(w.message) for w in caught
                                    if issubclass(w.category, spillway.deepspeed.SaveWarning)]}, f)
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()
        sys.exit(0)


ours, _ = peak(save_ours)
streams = _deepspeed_save._streams
theirs, _ = peak(save_theirs)
if rank0:
    params = {id(p): p for p in engine.module.parameters()}.values()
    json.dump({"spillway_peak": ours, "transformers_peak": theirs,
               "model_bytes": sum(p.ds_numel * p.element_size() for p in params),
               "largest_param_bytes": max(p.ds_numel * p.element_size() for p in params),
               "parameters": sum(p.ds_numel for p in params),
               "warnings": [str(w.message) for w in caught if issubclass(w.category, spillway.deepspeed.SaveWarning)],
               "streamed": streams},
              open(os.path.join(out_dir, "result.json"), "w"))
# The ranks leave the group together (ds_save.py): a rank that exits while its peer's Gloo
# connections are open can abort that peer at exit ("terminate called without an active exception").
torch.distributed.barrier()
torch.distributed.destroy_process_group()
print("done")
