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

import _zygote
import pytest

deepspeed = pytest.importorskip("deepspeed", reason="DeepSpeed is not installed (scripts/install-deps installs 0.19.8)")
import _ds_env  # noqa: E402
torch = pytest.importorskip("torch")

WORKER = Path(__file__).parent / "workers" / "ds_step.py"
STEPS = 50
ULP = torch.finfo(torch.float32).eps


def run(tmp_path, which, optimizer="AdamW", steps=STEPS, variant="bf16-cpu"):
    out = tmp_path / f"{which}-{optimizer}-{variant}.pt"
    p = _zygote.run([sys.executable, str(WORKER), which, str(steps), str(out), optimizer, variant],
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
    # Masters within 2 ulp round to the same bf16 except where they straddle a rounding boundary:
    # at most a few elements, each by one bf16 ulp (the rounding itself is checked exactly below).
    for i, (a, b) in enumerate(zip(theirs["first"]["params16"], ours["first"]["params16"])):
        differ = a != b
        assert differ.float().mean().item() <= 1e-3, f"sub-group {i}: {int(differ.sum())} elements differ"
        ulp16 = torch.finfo(torch.bfloat16).eps * a.float().abs()
        assert ((a.float() - b.float()).abs() <= ulp16 + 1e-30).all(), f"sub-group {i}"


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


@_ds_env.needs_infinity()
def test_optimizer_state_on_nvme_and_two_micro_batches_per_step_stay_within_the_control(tmp_path):
    # DeepSpeed's optimizer swapper (on Spillway's aio op) moves the moments to NVMe and back around
    # every sub-group's step; the fused pass updates them in the swapped-in buffers.
    r = {w: run(tmp_path, w, steps=30, variant="bf16-nvme-ga2") for w in ("deepspeed", "torch-adam", "spillway")}
    ours, theirs, control = r["spillway"], r["deepspeed"], r["torch-adam"]
    assert ours["kernel"] and ours["steps"] == theirs["steps"] == [30] * ours["sub_groups"]
    for i, (a, b, c) in enumerate(zip(theirs["masters"], ours["masters"], control["masters"])):
        print(f"nvme sub-group {i}: rms spillway-ds {rms(a, b):.3e}, torch-ds {rms(a, c):.3e}")
        assert rms(a, b) <= 2 * rms(a, c), i
        assert (a - b).abs().max() <= 2 * (a - c).abs().max(), i
    assert abs(ours["losses"][-1] - theirs["losses"][-1]) <= 0.01 * theirs["losses"][-1]


@_ds_env.needs_infinity()
def test_zero_infinity_really_swapping_into_spillways_nvme_arena_stays_within_the_control(tmp_path):
    # Optimizer state and parameters on NVMe, sub-groups and weights above DeepSpeed's 1 MiB swap
    # threshold (parameters kept on NVMe, the optimizer state pipelined), install()'s defaults: the
    # swapped tensors live in Spillway's NVMe arena (one O_TMPFILE file, CRC per extent) and the
    # fused step updates the swapped-in state every step.
    check_zero_infinity({w: run(tmp_path, w, steps=20, variant="bf16-infinity")
                         for w in ("deepspeed", "torch-adam", "spillway")})


def check_zero_infinity(r):
    """The ZeRO-Infinity test's assertions over its three runs (also on CUDA: test_gpu_deepspeed.py)."""
    ours, theirs, control = r["spillway"], r["deepspeed"], r["torch-adam"]
    assert ours["kernel"] and not theirs["kernel"], ours["warnings"]
    assert not [w for w in ours["warnings"] if "own optimizer step runs" in w], ours["warnings"]
    # Plain DeepSpeed: one file per swapped tensor in the folder its config names.
    files = dict(theirs["swap_files"])
    assert any("/optimizer/" in f for f in files) and any("params/" in f for f in files), files
    assert any(f.startswith("zero_stage_3/optimizer/") and "exp_avg_sq-" in f for f in files), files
    swapped = sum(files.values())
    assert swapped >= 20 << 20, files  # tens of MiB of state live on NVMe, not a token file
    # Spillway: the folders exist and hold no file; the same tensors are extents of its arena.
    assert ours["swap_files"] == [], ours["swap_files"]
    (store,) = ours["swap_stats"].values()
    assert store["files"] == len(files) and swapped <= store["live_bytes"] < swapped + len(files) * 4096, (store, files)
    assert store["checksum"] and store["checksum_failures"] == 0
    assert {k for k, v in store["live_by_kind"].items() if v} == {"param", "master_weight", "optimizer_state", "grad"}
    # Bytes really moved between memory and storage (/proc/self/io, which counts O_DIRECT; the
    # store's own counters for Spillway): every step swaps its state in and out.
    for run_ in (ours, theirs):
        assert run_["io"]["write_bytes"] >= 10 * swapped and run_["io"]["read_bytes"] >= 10 * swapped, run_["io"]
    assert store["written_bytes"] >= 10 * swapped and store["read_bytes"] >= 10 * swapped, store
    for i, (a, b, c) in enumerate(zip(theirs["masters"], ours["masters"], control["masters"])):
        print(f"infinity sub-group {i}: rms spillway-ds {rms(a, b):.3e}, torch-ds {rms(a, c):.3e}")
        assert a.shape == b.shape and a.numel() > 0, i
        assert rms(a, b) <= 2 * rms(a, c), i
        assert (a - b).abs().max() <= 2 * (a - c).abs().max(), i
    assert abs(ours["losses"][-1] - theirs["losses"][-1]) <= 0.01 * theirs["losses"][-1]


@pytest.mark.parametrize("stage", [2, 1])
def test_zero_1_and_2_with_offload_run_spillways_step_within_the_control(tmp_path, stage):
    # ZeRO-1/2's offload step: per parameter group, the unscale and clip, DeepSpeedCPUAdam's update
    # and the fp32 to 16-bit copy into the offload buffer become the fused pass; DeepSpeed's copy of
    # that buffer to the accelerator stays.
    variant = f"bf16-zero{stage}"
    r = {w: run(tmp_path, w, steps=30, variant=variant) for w in ("deepspeed", "torch-adam", "spillway")}
    ours, theirs, control = r["spillway"], r["deepspeed"], r["torch-adam"]
    assert ours["kernel"] and not theirs["kernel"], ours["warnings"]
    assert not [w for w in ours["warnings"] if "own optimizer step runs" in w or "audit" in w], ours["warnings"]
    assert ours["sub_groups"] == theirs["sub_groups"] == 2
    assert ours["steps"] == theirs["steps"] == [30, 30] and ours["lrs"] == theirs["lrs"]
    lr = theirs["lrs"][0][0]
    for i, (a, b) in enumerate(zip(theirs["first"]["masters"], ours["first"]["masters"])):
        bound = 2 * ULP * torch.maximum(a.abs(), b.abs()) + 16 * ULP * lr
        assert ((a - b).abs() - bound).max().item() <= 0, f"group {i}: first step off by {(a - b).abs().max()}"
    for i, (a, b, c, start) in enumerate(zip(theirs["masters"], ours["masters"], control["masters"],
                                             theirs["first"]["masters"])):
        print(f"zero-{stage} group {i}: rms spillway-ds {rms(a, b):.3e}, torch-ds {rms(a, c):.3e}, "
              f"moved {rms(a, start):.3e}")
        assert rms(a, b) <= 2 * rms(a, c), i
        assert (a - b).abs().max() <= 2 * (a - c).abs().max(), i
        assert rms(a, b) < 0.05 * rms(a, start), i
    # DeepSpeed's own copies were skipped at every step of every group: on the CPU accelerator the
    # fused pass wrote the 16-bit partition itself (the round to nearest even of the new master, as
    # DeepSpeed's copy_ would), so both the fp32 to 16-bit copy into the offload buffer and the
    # buffer's copy to the partition are no-ops.
    assert ours["params16_device"] == "cpu"
    assert ours["copies_skipped"] == 2 * 30 * ours["sub_groups"] and theirs["copies_skipped"] == 0
    for master, p16 in zip(ours["masters"], ours["params16"]):
        assert torch.equal(master.to(p16.dtype), p16)
    assert abs(ours["losses"][-1] - theirs["losses"][-1]) <= 0.01 * theirs["losses"][-1]
    assert ours["losses"][-1] < 0.8 * ours["losses"][0]


@pytest.mark.parametrize("variant", ["bf16-moments", "bf16-moments-zero2"])
def test_bf16_masters_and_moments_run_spillways_step_as_deepspeed_runs_its_own(tmp_path, variant):
    # DeepSpeed's bf16_optimizer_states (with bf16_master_weights_and_grads): the masters, the
    # gradients and both Adam moments in bf16, 6 bytes of state per parameter where fp32 keeps 12.
    # DeepSpeedCPUAdam widens each to fp32, updates and rounds to nearest even; so does the fused
    # pass. There is no torch-Adam control here: DeepSpeed refuses torch_adam with
    # bf16_optimizer_states under offload.
    r = {w: run(tmp_path, w, steps=30, variant=variant) for w in ("deepspeed", "spillway")}
    ours, theirs = r["spillway"], r["deepspeed"]
    assert ours["kernel"] and not theirs["kernel"], ours["warnings"]
    assert not [w for w in ours["warnings"] if "own optimizer step runs" in w], ours["warnings"]
    assert ours["steps"] == theirs["steps"] == [30] * ours["sub_groups"] and ours["lrs"] == theirs["lrs"]
    # ZeRO-2: the fused pass writes the 16-bit partition (ZeRO-3 skips its copy another way).
    assert ours["copies_skipped"] == (2 * 30 * ours["sub_groups"] if variant.endswith("zero2") else 0)
    for master, p16 in zip(ours["masters"], ours["params16"]):  # the 16-bit copy of the last update
        assert torch.equal(master.to(p16.dtype), p16)
    for run_ in (ours, theirs):
        dtypes = {t.dtype for t in run_["masters"] + run_["exp_avg"] + run_["exp_avg_sq"]}
        assert dtypes == {torch.bfloat16}, dtypes
    # The first step: the fp32 updates differ by a few fp32 ulp at most (the bound above), so the
    # stored bf16 masters are equal except where that straddles a rounding boundary.
    for i, (a, b) in enumerate(zip(theirs["first"]["masters"], ours["first"]["masters"])):
        differ = a != b
        assert differ.float().mean().item() <= 1e-3, f"sub-group {i}: {int(differ.sum())} elements differ"
        ulp16 = torch.finfo(torch.bfloat16).eps * a.float().abs()
        assert ((a.float() - b.float()).abs() <= ulp16 + 1e-30).all(), f"sub-group {i}"
    for i, (a, b, start) in enumerate(zip(theirs["masters"], ours["masters"], theirs["first"]["masters"])):
        a, b, start = a.float(), b.float(), start.float()
        print(f"{variant} sub-group {i}: rms spillway-ds {rms(a, b):.3e}, moved {rms(a, start):.3e}")
        assert rms(a, b) < 0.05 * rms(a, start), i
    assert abs(ours["losses"][-1] - theirs["losses"][-1]) <= 0.01 * theirs["losses"][-1]
    assert ours["losses"][-1] < 0.8 * ours["losses"][0]


@pytest.mark.skipif(not torch.ops.mkldnn._is_mkldnn_fp16_supported(),
                    reason="DeepSpeed's CPU accelerator refuses fp16 where mkldnn has no fp16 kernels (they need "
                           "AVX-512 FP16 or AMX): run on such a machine, or on a GPU")
@pytest.mark.parametrize("stage", [3, 2])
def test_fp16_overflow_steps_are_skipped_and_the_scale_halved_as_deepspeed_does(tmp_path, stage):
    # fp16 with DeepSpeed's dynamic loss scale; the worker makes the loss infinite at steps 3, 7, 8
    # and 20, so every gradient overflows there. DeepSpeed's overflow check runs before the fused
    # pass: the step is skipped, the scale halved (twice in a row at 7 and 8), doubled again after 4
    # good steps. The same sequence of scales and skips as plain DeepSpeed's, and the masters within
    # the control of the other step tests.
    r = {w: run(tmp_path, w, steps=30, variant=f"fp16-zero{stage}") for w in ("deepspeed", "torch-adam", "spillway")}
    ours, theirs, control = r["spillway"], r["deepspeed"], r["torch-adam"]
    assert ours["kernel"] and not theirs["kernel"], ours["warnings"]
    assert not [w for w in ours["warnings"] if "own optimizer step runs" in w or "audit" in w], ours["warnings"]
    print(f"zero-{stage} fp16 scales {theirs['scales']}, skipped {theirs['skipped']}")
    assert ours["scales"] == theirs["scales"] == control["scales"]
    assert ours["skipped"] == theirs["skipped"] and theirs["skipped"][-1] == 4
    for k in (3, 7, 8, 20):
        assert theirs["scales"][k] == theirs["scales"][k - 1] / 2, (k, theirs["scales"])
    assert len(set(theirs["scales"])) >= 4  # it also grew back after good windows
    assert [float(s) for s in ours["steps"]] == [float(s) for s in theirs["steps"]] == [26.0] * ours["sub_groups"]
    for i, (a, b, c) in enumerate(zip(theirs["masters"], ours["masters"], control["masters"])):
        print(f"zero-{stage} fp16 group {i}: rms spillway-ds {rms(a, b):.3e}, torch-ds {rms(a, c):.3e}")
        assert rms(a, b) <= 2 * rms(a, c), i
        assert (a - b).abs().max() <= 2 * (a - c).abs().max(), i
    finite = [(x, y) for x, y in zip(ours["losses"], theirs["losses"]) if x != float("inf")]
    assert len(finite) == 26 and abs(finite[-1][0] - finite[-1][1]) <= 0.01 * finite[-1][1]
    # ZeRO-2: the fused pass wrote the fp16 partition at the 26 steps taken, none at the 4 skipped.
    assert ours["copies_skipped"] == (2 * 26 * ours["sub_groups"] if stage == 2 else 0)
    if stage == 2:
        for master, p16 in zip(ours["masters"], ours["params16"]):
            assert torch.equal(master.to(p16.dtype), p16)


def test_the_16_bit_partition_is_the_round_to_nearest_even_of_the_new_master(runs):
    ours = runs["spillway"]
    for i, (master, p16) in enumerate(zip(ours["masters"], ours["params16"])):
        assert torch.equal(master.to(p16.dtype), p16), f"sub-group {i}"


def test_bad_input_an_optimizer_spillway_does_not_implement_keeps_deepspeeds_and_says_why(tmp_path):
    from deepspeed.accelerator import get_accelerator

    if type(get_accelerator().create_op_builder("CPUAdagradBuilder")).__name__ == "NotImplementedBuilder":
        pytest.skip(f"DeepSpeed {deepspeed.__version__}'s CPU accelerator has no CPU Adagrad op (plain DeepSpeed "
                    "fails at initialize with it)")
    r = run(tmp_path, "spillway", optimizer="Adagrad", steps=3)
    assert r["inner"] == "DeepSpeedCPUAdagrad" and not r["kernel"]
    said = [w for w in r["warnings"] if "own optimizer step runs" in w]
    assert len(said) == 1, r["warnings"]  # once, not per sub-group and step
    assert "DeepSpeedCPUAdagrad" in said[0] and "Adam and AdamW" in said[0], said
    assert len(r["losses"]) == 3


SEAM = """
import os
os.environ.setdefault("DS_ACCELERATOR", "cpu")
import torch, spillway
from deepspeed.ops.adam import DeepSpeedCPUAdam
from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3 as Stage3
try:  # DeepSpeed 0.18 and later
    from deepspeed.runtime.superoffload.superoffload_stage3 import SuperOffloadOptimizer_Stage3
except ImportError:
    SuperOffloadOptimizer_Stage3 = None
spillway.deepspeed.install(allocators=False)

def zero_optimizer(cls, shadow_device):
    # A ZeRO-3 optimizer's state as stage3 leaves it for one sub-group, without its __init__ (which
    # needs a model and a process group): the fp16 partition on another device stands in for a
    # GPU, where offload_param is off and DeepSpeed keeps it on the accelerator.
    o = cls.__new__(cls)
    fp32 = torch.nn.Parameter(torch.randn(1000))
    fp32.grad = torch.randn(1000)
    o.fp32_partitioned_groups_flat = [fp32]
    o.fp16_partitioned_groups_flat = [torch.empty(1000, dtype=torch.bfloat16, device=shadow_device)]
    o.sub_group_to_group_id, o.subgroup_to_device = {0: 0}, {0: "cpu"}
    o.offload_optimizer, o.torch_autocast_gradscaler, o.zenflow, o.use_muon = True, None, False, False
    o.custom_loss_scaler, o.external_loss_scale, o.clip_grad = True, 1.0, 0.0
    o.optimizer = DeepSpeedCPUAdam([fp32], lr=1e-3)
    o.optimizer.param_groups[0]["params"] = []
    return o, fp32

o, fp32 = zero_optimizer(Stage3, "meta")
before = fp32.detach().clone()
o.unscale_and_clip_grads(0, torch.tensor(1.0))
o._optimizer_step(0)
assert o.optimizer.state[fp32]["step"] == 1 and not torch.equal(fp32.detach(), before)
assert 0 not in o.__dict__.get("_spillway_copied", set()), "a partition off the CPU was marked copied"
print("OFF-CPU SHADOW: updated, copy left to DeepSpeed")
if SuperOffloadOptimizer_Stage3 is None:
    print("SUPEROFFLOAD: not in this DeepSpeed")
else:
    s, _ = zero_optimizer(SuperOffloadOptimizer_Stage3, "cpu")
    print("SUPEROFFLOAD:", spillway.deepspeed._why_not_ours(s, 0))

# ZeRO-1/2 with the 16-bit partition off the CPU (meta stands in for a GPU): the fused pass writes
# the host staging buffer, and of step()'s two copies only the buffer's is skipped.
import socket
import deepspeed
from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer as Zero12
from spillway.deepspeed import _step
with socket.socket() as sock:
    sock.bind(("127.0.0.1", 0))
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(sock.getsockname()[1]), RANK="0", LOCAL_RANK="0",
                      WORLD_SIZE="1")
deepspeed.init_distributed(dist_backend="gloo", auto_mpi_discovery=False)
z = Zero12.__new__(Zero12)
fp32 = torch.nn.Parameter(torch.randn(1000))
fp32.grad = torch.randn(1000)
buffer = torch.zeros(1000, dtype=torch.bfloat16)
partition = torch.empty(1000, dtype=torch.bfloat16, device="meta")
z.single_partition_of_fp32_groups, z.param_buffer_of_bit16_for_cpu_offload_groups = [fp32], [buffer]
z.parallel_partitioned_bit16_groups, z.real_dp_process_group = [[partition]], [None]
z.cpu_offload, z.partition_gradients, z.torch_autocast_gradscaler, z.zenflow = True, True, None, False
z.custom_loss_scaler, z.external_loss_scale, z.clip_grad = True, 1.0, 0.0
z.optimizer = DeepSpeedCPUAdam([fp32], lr=1e-3)
z._lazy_init_hp_params_optimizer_state = lambda: None
z.unscale_and_clip_grads([fp32.grad], torch.tensor(1.0))
z._optimizer_step(0)
assert z.optimizer.state[fp32]["step"] == 1 and torch.equal(buffer, fp32.detach().to(torch.bfloat16))
assert z._spillway_written == {(buffer.data_ptr(), fp32.data_ptr())}, z._spillway_written
with _step._WrittenCopies(z):  # step()'s two copies, as 0.19.8 writes them
    buffer.data.copy_(fp32.data)  # the fused pass wrote it: skipped
    partition.data.copy_(buffer.data, non_blocking=True)  # to the device: runs
assert z._spillway_copies_skipped == 1 and not z._spillway_written
assert torch.equal(buffer, fp32.detach().to(torch.bfloat16))
print("ZERO-2 OFF-CPU PARTITION: the buffer's copy skipped, the device's ran")
z._spillway_written = {(buffer.data_ptr(), fp32.data_ptr())}
with _step._WrittenCopies(z):
    buffer.data.copy_(torch.zeros(1000))  # another source: runs
assert not buffer.any() and z._spillway_copies_skipped == 1 and z._spillway_written
print("ZERO-2 OFF-CPU PARTITION: a copy from another source ran")

# Bad input: a parameter group DeepSpeed's optimizer does not have, a moment of another shape.
for what in ("group", "state"):
    b, fp32 = zero_optimizer(Stage3, "cpu")
    if what == "group":
        b.sub_group_to_group_id = {0: 3}
    else:
        b.optimizer.state[fp32] = {"step": 4, "exp_avg": torch.zeros(999), "exp_avg_sq": torch.zeros(1000)}
    before = fp32.detach().clone()
    b.unscale_and_clip_grads(0, torch.tensor(1.0))
    try:
        b._optimizer_step(0)
    except spillway.InvalidArgument as e:
        print("REFUSED", what, str(e).splitlines()[0])
    assert torch.equal(fp32.detach(), before)
    assert what == "group" or b.optimizer.state[fp32]["step"] == 4
"""


def test_a_16_bit_partition_off_the_cpu_a_subclass_and_bad_groups_or_states():
    p = subprocess.run([sys.executable, "-c", SEAM], capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-4000:]
    assert "OFF-CPU SHADOW: updated, copy left to DeepSpeed" in p.stdout
    assert "ZERO-2 OFF-CPU PARTITION: the buffer's copy skipped, the device's ran" in p.stdout
    assert "ZERO-2 OFF-CPU PARTITION: a copy from another source ran" in p.stdout
    import importlib.util  # noqa: PLC0415

    superoffload = importlib.util.find_spec("deepspeed.runtime.superoffload") is not None
    assert ("SUPEROFFLOAD: SuperOffloadOptimizer_Stage3 overrides _optimizer_step" if superoffload
            else "SUPEROFFLOAD: not in this DeepSpeed") in p.stdout, p.stdout
    assert "REFUSED group spillway.deepspeed: sub-group 0 belongs to parameter group 3, and the optimizer has 1" \
        in p.stdout, p.stdout
    assert "REFUSED state spillway.deepspeed: sub-group 0: optimizer state 'exp_avg' has shape (999,) and the " \
        "fp32 partition (1000,)" in p.stdout, p.stdout
