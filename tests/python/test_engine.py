"""spillway.engine: the C++ ZeRO-3 trainer on a c10d Gloo process group made by torch.distributed.

World size 2 (two processes, Gloo on loopback) must equal world size 1 at the same global batch, for
offload none, cpu and nvme. Tolerance: the two runs differ only in summation order (the reduce-scatter
adds two ranks' partial sums where one process accumulates all four micro-batches in turn), which
moves float32 losses by a few ulps per step (measured: 6.5e-8 relative after 30 steps); 1e-5 leaves
room for that and is far below the effect of a wrong shard, batch split or lost gradient (the control
below shows the size of one). Parameters are compared relative to each unit's largest weight, 1e-4 as
in the C++ trainer test: the attention key bias has an exactly zero gradient (softmax ignores a
constant added to a row of scores), so Adam divides rounding noise by its own size and moves those
few elements by up to ~3e-5 differently in each run (measured), while the rest agree to 1e-7.
"""
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import _zygote
import pytest
import torch

import spillway

WORKER = Path(__file__).parent / "workers" / "engine_rank.py"
STEPS = 30
GLOBAL_MICRO = 4


def config(offload, swap):
    zero = {"stage": 3}
    if offload != "none":
        zero["offload_optimizer"] = {"device": offload, "nvme_path": str(swap)}
        zero["offload_param"] = {"device": offload, "nvme_path": str(swap)}
    return {"zero_optimization": zero,
            "optimizer": {"type": "AdamW", "params": {"lr": 3e-3, "betas": [0.9, 0.99], "weight_decay": 0.01}},
            "gradient_clipping": 0.5,
            "spillway": {"host_budget_bytes": "256MiB", "nvme_budget_bytes": "256MiB"}}


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_ranks(cfg, world, out, device="cpu", backend="gloo", micro=None, steps=STEPS, save=None, resume=None):
    port = free_port()
    procs = []
    for rank in range(world):
        env = dict(os.environ, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world),
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        procs.append(_zygote.popen(
            [sys.executable, str(WORKER), json.dumps(cfg), str(steps),
             str(micro if micro is not None else GLOBAL_MICRO // world), str(out), device, backend,
             str(save or "-"), str(resume or "-")],
            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    logs = [p.communicate(timeout=300)[0] for p in procs]
    for rank, (p, log) in enumerate(zip(procs, logs)):
        assert p.returncode == 0, f"rank {rank} of {world} failed:\n{log}"
    return torch.load(out)


@pytest.mark.parametrize("offload", ["none", "cpu", "nvme"])
def test_world_size_two_equals_world_size_one(offload, tmp_path):
    (tmp_path / "w1").mkdir()
    (tmp_path / "w2").mkdir()
    one = spillway.engine.train_gpt(config(offload, tmp_path / "w1"), steps=STEPS, micro_batches=GLOBAL_MICRO)
    two = run_ranks(config(offload, tmp_path / "w2"), 2, tmp_path / "two.pt")
    assert one["backend"] == "single" and one["world_size"] == 1
    assert two["backend"] == "gloo" and two["world_size"] == 2
    assert two["collectives_device"] == "cpu" and two["compute_device"] == "cpu"
    assert len(two["losses"]) == STEPS
    worst = max(abs(a - b) / abs(a) for a, b in zip(one["losses"], two["losses"]))
    print(f"offload {offload}: losses {one['losses'][0]:.4f} -> {one['losses'][-1]:.4f}, "
          f"worst relative loss difference world 2 vs 1: {worst:.2e}")
    assert worst < 1e-5
    for u, (a, b) in enumerate(zip(one["params"], two["params"])):
        assert a.shape == b.shape
        rel = float((a - b).abs().max() / a.abs().max())
        assert rel < 1e-4, f"unit {u}: parameters differ by {rel:.2e} of the unit's largest weight"
    assert one["losses"][-1] < 0.8 * one["losses"][0]  # it trained (ln 32 = 3.47 -> about 1.8)
    assert two["host_escapes"] == 0


@pytest.mark.parametrize("offload", ["none", "cpu", "nvme"])
def test_a_resumed_two_rank_run_equals_an_uninterrupted_one_bit_for_bit(offload, tmp_path):
    """Two ranks train 4 steps and save (each rank writes its own partitions); two new ranks resume
    and train 2 more: losses and parameters equal a 6-step run's exactly. World size 1 and the
    failure cases run in tests/trainer/trainer_checkpoint_test.cc."""
    for d in ("w", "a", "b"):
        (tmp_path / d).mkdir()
    whole = run_ranks(config(offload, tmp_path / "w"), 2, tmp_path / "whole.pt", steps=6)
    first = run_ranks(config(offload, tmp_path / "a"), 2, tmp_path / "first.pt", steps=4,
                      save=tmp_path / "ckpt")
    assert first["checkpoint"] == str(tmp_path / "ckpt" / "step-00000004")
    assert sorted(p.name for p in (tmp_path / "ckpt" / "step-00000004").iterdir()) == [
        "manifest.json", "rank-00000-of-00002.safetensors", "rank-00001-of-00002.safetensors"]
    rest = run_ranks(config(offload, tmp_path / "b"), 2, tmp_path / "rest.pt", steps=2,
                     resume=tmp_path / "ckpt")
    assert rest["start_step"] == 4
    assert first["losses"] + rest["losses"] == whole["losses"]
    for u, (a, b) in enumerate(zip(rest["params"], whole["params"])):
        assert torch.equal(a, b), f"unit {u}"
    # A checkpoint of two ranks is refused by one, naming the fix; nothing was trained.
    with pytest.raises(spillway.InvalidArgument, match="written by 2 rank"):
        spillway.engine.train_gpt(config(offload, tmp_path / "b"), steps=1, resume=tmp_path / "ckpt")


def test_a_group_of_one_runs_its_collectives_on_gloo_and_changes_nothing(tmp_path):
    """A torch.distributed group of size 1 is used as given: the all-gathers and reduce-scatters go
    through ProcessGroupGloo (copies at world size 1), not around it, so the losses and parameters
    equal the group-less run's bit for bit."""
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    alone = spillway.engine.train_gpt(config("cpu", tmp_path / "a"), steps=5, micro_batches=2)
    grouped = run_ranks(config("cpu", tmp_path / "b"), 1, tmp_path / "one.pt", micro=2, steps=5)
    assert alone["backend"] == "single" and grouped["backend"] == "gloo"
    assert grouped["losses"] == alone["losses"]
    for a, b in zip(alone["params"], grouped["params"]):
        assert torch.equal(a, b)


def test_a_group_with_only_a_cpu_backend_is_used_as_it_is(tmp_path):
    """init_process_group("cpu:gloo") registers no backend for CUDA: the trainer asks for one
    through torch_compat::BackendFor (the query that also builds against torch 2.11) and gets none."""
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    alone = spillway.engine.train_gpt(config("cpu", tmp_path / "a"), steps=3, micro_batches=2)
    grouped = run_ranks(config("cpu", tmp_path / "b"), 1, tmp_path / "one.pt", micro=2, steps=3,
                        backend="cpu:gloo")
    assert grouped["backend"] == "gloo" and grouped["collectives_device"] == "cpu"
    assert grouped["losses"] == alone["losses"]


def test_the_comparison_sees_a_different_batch(tmp_path):
    """Control: two ranks that each see only their half of the batch (world size 1 with half the
    micro-batches stands in for a wrong split) are far outside the tolerance above."""
    full = spillway.engine.train_gpt(config("cpu", tmp_path), steps=5, micro_batches=GLOBAL_MICRO)
    half = spillway.engine.train_gpt(config("cpu", tmp_path), steps=5, micro_batches=GLOBAL_MICRO // 2)
    worst = max(abs(a - b) / abs(a) for a, b in zip(full["losses"][1:], half["losses"][1:]))
    assert worst > 1e-3


def test_torchrun_runs_the_module_on_two_ranks():
    out = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", str(free_port()),
         "-m", "spillway.engine", "--steps", "3"],
        capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    summary = json.loads(out.stdout.strip().splitlines()[-1])
    assert summary["backend"] == "gloo" and summary["world_size"] == 2
    assert summary["host_escapes"] == 0


def test_bad_input_is_refused_with_what_to_change(tmp_path):
    with pytest.raises(spillway.InvalidArgument, match="ProcessGroup"):
        spillway.engine.train_gpt(config("none", tmp_path), steps=1, group=object())
    with pytest.raises(spillway.InvalidArgument, match="unknown key 'layers'"):
        spillway.engine.train_gpt(config("none", tmp_path), steps=1, model={"layers": 2})
    with pytest.raises(spillway.InvalidArgument, match="multiple of n_head"):
        spillway.engine.train_gpt(config("none", tmp_path), steps=1,
                                  model={"vocab": 8, "d_model": 10, "n_layer": 1, "n_head": 3, "seq_len": 4})
    with pytest.raises(spillway.InvalidArgument, match="at least 1"):
        spillway.engine.train_gpt(config("none", tmp_path), steps=0)
    with pytest.raises(spillway.InvalidArgument, match="offload_param"):
        bad = config("cpu", tmp_path)
        bad["zero_optimization"]["offload_param"]["device"] = "disk"
        spillway.engine.train_gpt(bad, steps=1)
