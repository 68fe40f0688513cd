"""The planner's phase peaks against a measured multi-rank run (Note [Phase peaks] in docs/offload.md):
two ranks under torchrun, each with spillway.deepspeed.install(), real DeepSpeed 0.19.8 (CPU
accelerator, Gloo), HF Trainer, ZeRO-3 with optimizer state and parameters offloaded to the CPU,
bf16, a GPT-2 of 34M parameters saved with save_pretrained (safetensors) and as a torch .bin
(tests/python/workers/ds_phases.py). The test samples the node's memory, the ranks' and their
DataLoader workers' anonymous and shared PSS summed, a sweep every ~80 ms (and each rank reads its
own as each phase ends), and takes each phase's peak: loading the model (from_pretrained under
zero.Init and whole on every rank, from each format), the epoch boundary (the first step after the
DataLoader forked), the epoch checkpoint and the final save_model. Each must be within 10% of
`spillway plan`'s figure for the same run (a .bin loaded under zero.Init within 20%: what glibc's
heap keeps of it moves between runs), computed from the level the ranks held before loading (the
interpreter and its libraries, which the plan takes as given: `--rank-baseline`)."""
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from _launch import free_port, tree_bytes
from spillway import node as _node

pytest.importorskip("deepspeed", reason="DeepSpeed is not installed (scripts/install-deps installs 0.19.8)")
transformers = pytest.importorskip("transformers", reason="transformers is not installed (scripts/install-deps installs it)")

WORKER = Path(__file__).parent / "workers" / "ds_phases.py"
MIB = 1 << 20
RANKS = 2
BARRIER_AFTER = ("load", "final save")  # ds_phases.py: torch.distributed.barrier() after these


def node_bytes(root):
    """{rank's pid: its tree's bytes} under root (not root itself: the launcher)."""
    return {pid: tree_bytes(pid, ("Pss_Anon:", "Pss_Shmem:")) for pid in _node.children(root)}


def run(out, model_dir, init, train):
    """(samples [(time, node bytes)], [rank records]) of one torchrun of ds_phases.py."""
    env = dict(os.environ, DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1")
    env["PYTHONPATH"] = os.pathsep.join([str(WORKER.parent), str(WORKER.parent.parent), env.get("PYTHONPATH", "")])
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(RANKS), "--master-port",
           str(free_port()), str(WORKER), str(out), str(model_dir), init] + (["--train"] if train else [])
    p = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    samples, done = [], threading.Event()

    def sample():
        while not done.is_set():
            taken = node_bytes(p.pid)
            samples.append((time.time(), taken))  # stamped after the sweep: no read after its time
            time.sleep(0.005)

    sampler = threading.Thread(target=sample)
    sampler.start()
    try:
        text, _ = p.communicate(timeout=900)
    finally:
        done.set()
        sampler.join()
    assert p.returncode == 0, text[-8000:]
    return samples, [json.loads((out / f"rank{r}.json").read_text()) for r in range(RANKS)]


def peaks(samples, ranks):
    """({phase: node peak}, the node's level before loading). A phase's peak is the largest sum over
    the ranks in the union of their intervals of it (the k-th occurrence on every rank is one
    phase, named "<phase> <k>" where it recurs), or the first sample after it when it was shorter
    than the sampling period; at least the sum of what each rank held as its interval ended (the
    load's memory rises to its last instant: a sweep of the node every ~80 ms caught its top
    anywhere from 0 to 110 MiB short, which read as a plan 6% to 21% over), for the phases a
    barrier follows. The epoch phases have none, so their readings at the ranks' different ends need
    not add up to a level the node held (a clean run with them counted measured a boundary at 3130
    MiB against 2335 planned; which of the two measurements gave it was not recorded)."""
    out = {}
    names = [p["name"] for p in ranks[0]["phases"]]
    for i, name in enumerate(names):
        k = names[:i].count(name)
        spans = [[p for p in r["phases"] if p["name"] == name][k] for r in ranks]
        lo, hi = min(s["start"] for s in spans), max(s["end"] for s in spans)
        inside = [sum(b.values()) for t, b in samples if lo <= t <= hi] or \
            [sum(b.values()) for t, b in samples if t > hi][:1]
        # The ranks' readings at their ends add up to a level the node held only where a barrier
        # follows the phase (each rank holds still until the last one ends): the load, the final save.
        ends = sum(s["end_bytes"] for s in spans) if name in BARRIER_AFTER else 0
        out[f"{name} {k}" if names.count(name) > 1 else name] = max(max(inside), ends)
    load = min(r["phases"][0]["start"] for r in ranks)
    before = [b for t, b in samples if t <= load]
    assert before and len(before[-1]) == len(ranks), ("no sample of the ranks before loading", samples[:3])
    return out, sum(before[-1].values())


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    """A GPT-2 of 34M parameters saved as safetensors (save_pretrained) and as a torch .bin."""
    root = tmp_path_factory.mktemp("models")
    import torch

    torch.manual_seed(0)
    vocab, embd, layers = (int(x) for x in os.environ.get("SPILLWAY_PHASES_MODEL", "16384,512,8").split(","))
    cfg = transformers.GPT2Config(vocab_size=vocab, n_positions=64, n_embd=embd, n_layer=layers, n_head=8,
                                  bos_token_id=0, eos_token_id=0)
    model = transformers.GPT2LMHeadModel(cfg)
    model.save_pretrained(root / "safetensors")
    (root / "bin").mkdir()
    cfg.save_pretrained(root / "bin")
    torch.save(model.state_dict(), root / "bin" / "pytorch_model.bin")
    return root, sum(p.numel() for p in model.parameters()), max(p.numel() for p in model.parameters())


CONFIG = {"train_micro_batch_size_per_gpu": 2, "bf16": {"enabled": True},
          "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu", "pin_memory": True},
                                "offload_param": {"device": "cpu", "pin_memory": True},
                                "stage3_gather_16bit_weights_on_model_save": True}}  # ds_phases.py's


def plan(cli, tmp_path, params, largest, baseline, init, fmt):
    """{phase: node 0's bytes} of `spillway plan --json` for the run."""
    config = tmp_path / "ds.json"
    config.write_text(json.dumps(CONFIG))
    p = subprocess.run([cli, "plan", "--params", str(params), "--nproc-per-node", str(RANKS), "--host-mem", "64GiB",
                        "--config", str(config), "--accelerator", "cpu", "--gpu-mem", "0",
                        "--rank-baseline", str(baseline), "--load", init, "--checkpoint-format", fmt,
                        "--checkpoint-dtype", "fp32", "--largest-tensor", str(largest), "--dataloader-workers", "2",
                        "--json"], capture_output=True, text=True)
    assert p.returncode == 0, p.stdout + p.stderr
    return {ph["name"]: ph["node"] for ph in json.loads(p.stdout)["phases"]}


@pytest.mark.parametrize("init,fmt,train", [("zero-init", "safetensors", True), ("whole", "safetensors", False),
                                            ("zero-init", "bin", False), ("whole", "bin", False)])
def test_each_phase_peak_is_within_ten_percent_of_the_plan(tmp_path, model_dirs, init, fmt, train):
    cli = os.environ.get("SPILLWAY_CLI")
    if not cli:
        pytest.skip("SPILLWAY_CLI (the spillway command, which ctest names) is not set")
    root, params, largest = model_dirs
    samples, ranks = run(tmp_path / "out", root / fmt, init, train)
    got, level = peaks(samples, ranks)
    planned = plan(cli, tmp_path, params, largest, level // RANKS, init, fmt)
    rows = [(name, got[name], planned[PLANNED[name.rsplit(" ", 1)[0] if name[-1].isdigit() else name]])
            for name in got]
    print(f"\n{init} {fmt}: {params} parameters (largest tensor {largest}), {RANKS} ranks, level before "
          f"loading {level / MIB:.1f} MiB")
    for name, measured, p in rows:
        print(f"  {name:14} measured {measured / MIB:8.1f} MiB  planned {p / MIB:8.1f} MiB  {p / measured - 1:+.1%}")
    assert len(rows) == (1 + 1 + 2 + 3 + 1 if train else 1), rows
    # A phase that recurs (the boundary of epochs 1 and 2, the checkpoints of epochs 0 to 2) is
    # judged by the median of its occurrences: which instant the two ranks' transients meet in moves
    # a single occurrence by several percent from run to run.
    judged = {}
    for name, measured, p in rows:
        judged.setdefault(PLANNED[name.rsplit(" ", 1)[0] if name[-1].isdigit() else name], ([], p))[0].append(measured)
    judged = {name: (statistics.median(m), p) for name, (m, p) in judged.items()}
    if train:
        # Admission at deepspeed.initialize planned the phases ahead from each rank's level then
        # (with no DataLoader workers, which it cannot know: 2 x 2 x 20 MiB fewer here).
        assert ranks[0]["admission"], "admission at deepspeed.initialize planned nothing"
        print("  admission at deepspeed.initialize planned, from rank 0's level then:")
        for ph in ranks[0]["admission"]:
            if ph["name"] in judged and ph["name"] != "load":
                measured = judged[ph["name"]][0]
                print(f"  {ph['name']:14} measured {measured / MIB:8.1f} MiB  planned {ph['node'] / MIB:8.1f} MiB  "
                      f"{ph['node'] / measured - 1:+.1%}")
                judged[f"{ph['name']} (admission)"] = (measured, ph["node"])
        assert len(judged) == 5 + 4, judged
    # A .bin under zero.Init: what glibc's heap keeps of it moves between runs (949 to 1038 MiB in
    # six runs with the end readings; its mmap threshold moves with what was freed before): the
    # plan counts the middle, and that one phase is held within 20%.
    tolerance = 0.20 if (init, fmt) == ("zero-init", "bin") else 0.10
    assert all(abs(p - measured) <= tolerance * measured for measured, p in judged.values()), judged


PLANNED = {"load": "load", "initialize": "initialize", "boundary": "epoch boundary", "checkpoint": "checkpoint",
           "final save": "final save"}
