"""Spillway's fused host step inside DeepSpeed ZeRO-3 (spillway.deepspeed.install(), step=True), against
DeepSpeed's own DeepSpeedCPUAdam, on the real DeepSpeed 0.19.8 (CPU accelerator, bf16,
offload_optimizer cpu, two parameter groups with different weight decay, WarmupDecayLR, gradient
clipping, three sub-groups). Each run is a process of its own (tests/python/workers/ds_step.py).

The tolerance, derived rather than picked:
- After the first step both runs start from the same weights, gradients and scale, so only the
  update's float rounding differs: at most 2 ulp of the weight (the rounding of w + update on each
  side) plus 16 ulp of the lr (the update is at most lr in magnitude; the two formulas round
  differently in bias correction and eps placement).
- After 50 steps the bf16 forward amplifies those roundings (one flipped bf16 rounding changes the
  next gradient), so there is no fixed ulp bound. The control is DeepSpeed's own step with
  torch.optim.AdamW in place of DeepSpeedCPUAdam (`torch_adam`): two correct implementations of
  the same step. Spillway must stay within twice that control's distance from DeepSpeedCPUAdam (RMS
  and max per sub-group), and both must be far below how far training moved the weights.
"""
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("deepspeed", reason="DeepSpeed is not installed (scripts/install-deps installs 0.19.8)")
torch = pytest.importorskip("torch")

WORKER = Path(__file__).parent / "workers" / "ds_step.py"
STEPS = 50
ULP = torch.finfo(torch.float32).eps


def run(tmp_path, which, optimizer="AdamW", steps=STEPS):
    out = tmp_path / f"{which}-{optimizer}.pt"
    p = subprocess.run([sys.executable, str(WORKER), which, str(steps), str(out), optimizer],
                       capture_output=True, text=True, timeout=1500)
    assert p.returncode == 0, f"{which} run failed:\n{p.stdout[-3000:]}\n{p.stderr[-6000:]}"
    return torch.load(out)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    d = tmp_path_factory.mktemp("ds_step")
    return {w: run(d, w) for w in ("deepspeed", "torch-adam", "spillway")}


def rms(x, y):
    return ((x - y) ** 2).mean().sqrt().item()


def test_spillways_step_ran_on_every_sub_group_with_deepspeeds_counts_and_lrs(runs):
    ours, theirs = runs["spillway"], runs["deepspeed"]
    assert ours["kernel"] and not theirs["kernel"]
    assert not [w for w in ours["warnings"] if "own optimizer step runs" in w], ours["warnings"]
    assert ours["sub_groups"] == theirs["sub_groups"] >= 3 and set(ours["group_of"]) == {0, 1}
    assert ours["steps"] == theirs["steps"] == [STEPS] * ours["sub_groups"]  # per-group step counts
    assert ours["lrs"] == theirs["lrs"]  # the scheduler moved lr between steps, per group
    assert len(set(lr for step in ours["lrs"] for lr in step)) > 10


def test_the_first_step_matches_deepspeedcpuadam_to_the_rounding_of_the_update(runs):
    ours, theirs = runs["spillway"], runs["deepspeed"]
    lr = theirs["lrs"][0][0]
    assert lr > 0
    for i, (a, b) in enumerate(zip(theirs["first"]["masters"], ours["first"]["masters"])):
        bound = 2 * ULP * torch.maximum(a.abs(), b.abs()) + 16 * ULP * lr
        excess = ((a - b).abs() - bound).max().item()
        assert excess <= 0, f"sub-group {i}: off by {(a - b).abs().max().item()} beyond the bound"
    for i, (a, b) in enumerate(zip(theirs["first"]["params16"], ours["first"]["params16"])):
        assert torch.equal(a, b), f"sub-group {i}: the 16-bit partition differs after one step"


def test_fifty_steps_stay_within_twice_the_distance_between_deepspeeds_own_two_adams(runs):
    ours, theirs, control = runs["spillway"], runs["deepspeed"], runs["torch-adam"]
    for i, (a, b, c, start) in enumerate(zip(theirs["masters"], ours["masters"], control["masters"],
                                             theirs["first"]["masters"])):
        moved = rms(a, start)
        print(f"sub-group {i}: rms spillway-ds {rms(a, b):.3e}, torch-ds {rms(a, c):.3e}, moved {moved:.3e}; "
              f"max {(a - b).abs().max().item():.3e} vs {(a - c).abs().max().item():.3e}")
        assert rms(a, b) <= 2 * rms(a, c), i
        assert (a - b).abs().max() <= 2 * (a - c).abs().max(), i
        assert rms(a, b) < 0.05 * moved, i
    for i, (a, b) in enumerate(zip(theirs["exp_avg_sq"], ours["exp_avg_sq"])):
        assert a.shape == b.shape, i
    assert abs(ours["losses"][-1] - theirs["losses"][-1]) <= 0.01 * theirs["losses"][-1]
    assert ours["losses"][-1] < 0.8 * ours["losses"][0]  # it trained


def test_the_16_bit_partition_is_the_round_to_nearest_even_of_the_new_master(runs):
    ours = runs["spillway"]
    for i, (master, p16) in enumerate(zip(ours["masters"], ours["params16"])):
        assert torch.equal(master.to(p16.dtype), p16), f"sub-group {i}"


def test_bad_input_an_optimizer_spillway_does_not_implement_keeps_deepspeeds_and_says_why(tmp_path):
    r = run(tmp_path, "spillway", optimizer="Adagrad", steps=3)
    assert r["inner"] == "DeepSpeedCPUAdagrad" and not r["kernel"]
    said = [w for w in r["warnings"] if "own optimizer step runs" in w]
    assert len(said) == 1, r["warnings"]  # once, not per sub-group and step
    assert "DeepSpeedCPUAdagrad" in said[0] and "Adam and AdamW" in said[0], said
    assert len(r["losses"]) == 3
