"""The DeepSpeed (and FSDP2) offload tests on CUDA (DS_ACCELERATOR=cuda): the real DeepSpeed with
its model on cuda:0, NCCL, pinned host buffers that are really page-locked, copies that really run
asynchronously. Label `gpu`: on a machine where torch sees no CUDA device every test here skips,
saying so by name; scripts/gpu-check runs them on a GPU machine, where a skip is a failure.

Each test is the CPU accelerator's test of the same name with the accelerator as its parameter
(the seed scenario of test_deepspeed_host.py, the fused step of test_deepspeed_step.py, seed 000 of
test_guard.py, save_16bit_model of test_deepspeed_save.py), plus what only a GPU shows: the share
of the growth Spillway removes when the device memory is not host memory, and the pinned bytes
held for DeepSpeed's pins against torch's own pinned cache.

With SPILLWAY_GPU_RESULTS set (scripts/gpu-check sets it), each test writes its measurements there
as JSON: docs/gpu.md is generated from them (scripts/gpu-report)."""
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
deepspeed = pytest.importorskip("deepspeed", reason="DeepSpeed is not installed (scripts/install-deps installs 0.19.8)")

HERE = Path(__file__).parent
MIB = 1 << 20
CUDA = {**os.environ, "DS_ACCELERATOR": "cuda"}


@pytest.fixture(autouse=True)
def cuda_or_skip():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device visible to torch (this torch: CPU build or no GPU): "
                    "DeepSpeed's CUDA accelerator; scripts/gpu-check runs it on a GPU machine")


def record(name, data):
    where = os.environ.get("SPILLWAY_GPU_RESULTS")
    if where:
        os.makedirs(where, exist_ok=True)
        with open(os.path.join(where, f"{name}.json"), "w") as f:
            json.dump(data, f, indent=1, default=str)


@pytest.mark.parametrize("pin_memory", [True, False])
def test_gpu_seed_scenario_removes_95_percent_of_the_first_steps_growth(tmp_path, pin_memory):
    """The seed (Yi-34B's pattern) on the GPU: ZeRO-3, offload_optimizer and offload_param on cpu,
    bf16, a DataLoader re-forking 2 workers per epoch, through `python -m spillway.leak_suite
    --accelerator cuda`. On a GPU the device memory is not host memory, so DeepSpeed's host state is
    nearly all of what the first step after a fork adds: at least 95% of that growth must be gone."""
    config = json.loads((HERE / "configs" / "zero3_cpu_offload.json").read_text())
    for key in ("offload_optimizer", "offload_param"):
        config["zero_optimization"][key]["pin_memory"] = pin_memory
    cfg = tmp_path / "ds.json"
    cfg.write_text(json.dumps(config))
    out = tmp_path / "out.json"
    # 34M parameters (390 MiB of offloaded state): what the first step copies besides DeepSpeed's
    # state (the interpreter's pages, about 7 MiB on the H200) is then the small part it is at scale.
    # At 8.5M parameters with pin_memory, plain DeepSpeed's growth was 103 MiB (its pinned gradients
    # are not copied) and those 7 MiB made 6.7% of it.
    p = subprocess.run([sys.executable, "-m", "spillway.leak_suite", "--deepspeed", str(cfg), "--params", "3.4e7",
                        "--accelerator", CUDA["DS_ACCELERATOR"], "--epochs", "4", "--workers", "2", "--steps", "4", "--metrics", "--json", str(out),
                        "--png", str(tmp_path / "suite.png")],
                       capture_output=True, text=True, timeout=1200, cwd=tmp_path, env=CUDA)
    print(p.stdout)
    assert out.exists(), p.stdout[-3000:] + p.stderr[-6000:]
    r = json.loads(out.read_text())
    plain, ours = r["plain"], r["spillway"]
    grown = [(pe["first_step_growth_bytes"], se["first_step_growth_bytes"])
             for pe, se in zip(plain["epochs"][1:], ours["epochs"][1:])]
    shares = [(pg - sg) / pg for pg, sg in grown if pg > 0]
    removed = statistics.median(shares) if shares else 0.0
    record(f"seed_scenario_pin_{str(pin_memory).lower()}", {
        "accelerator": ours["accelerator"], "params": ours["params"], "offloaded_by_kind": ours["offloaded_by_kind"],
        "growth_mib": [[pg / MIB, sg / MIB] for pg, sg in grown], "removed_fraction": removed,
        "plain_steps_s": [[e["first_step_s"], e["median_step_s"]] for e in plain["epochs"]],
        "spillway_steps_s": [[e["first_step_s"], e["median_step_s"]] for e in ours["epochs"]],
        "spillway_pinned": ours.get("pinned"), "torch_pinned": plain.get("torch_pinned"),
        "pinned_state_bytes": {"plain": plain.get("pinned_state_bytes"), "spillway": ours.get("pinned_state_bytes")},
        "dontfork_fraction": ours["dontfork_bytes"] / max(ours["offloaded_bytes"], 1),
        "plain_dontfork_fraction": plain["dontfork_bytes"] / max(plain["offloaded_bytes"], 1),
        "losses_identical": r["losses_identical"], "ok": r["ok"]})
    assert ours["accelerator"].startswith("cuda") and plain["accelerator"].startswith("cuda")
    # The control: the Adam moments are pageable host memory in plain DeepSpeed whatever pin_memory
    # says, so its first step after every fork copies at least them.
    for e in plain["epochs"]:
        assert e["first_step_growth_bytes"] >= ours["offloaded_by_kind"]["optimizer_state"], plain["epochs"]
    assert removed >= 0.95, (removed, grown)
    assert p.returncode == 0 and r["ok"], p.stdout[-3000:] + p.stderr[-3000:]
    assert ours["dontfork_bytes"] >= 0.99 * ours["offloaded_bytes"], ours
    assert r["losses_identical"], (plain["losses"], ours["losses"])
    assert ours["last_epoch_report"]["clean"]
    if pin_memory:
        pinned = ours["pinned"]
        assert pinned["live_bytes"] >= ours["pinned_state_bytes"] > 0, (pinned, ours["pinned_state_bytes"])
        check_pinned_arena(pinned)


def check_pinned_arena(pinned):
    """The pinned arena's contract (HostArenaOptions): exact-size extents, small ones sharing regions
    of 32 MiB, and a retained cache of at most max(32 MiB, 25% of live). So what it commits beyond
    the retained cache is live bytes within 2%, plus at most one shared region not yet full."""
    region = 32 * MIB
    assert pinned["committed_bytes"] - pinned["retained_bytes"] <= 1.02 * pinned["live_bytes"] + region, pinned
    assert pinned["retained_bytes"] <= max(region, 0.25 * pinned["live_bytes"]), pinned


def run_step(tmp_path, which, variant, steps=50):
    out = tmp_path / f"{which}.pt"
    p = subprocess.run([sys.executable, str(HERE / "workers" / "ds_step.py"), which, str(steps), str(out), "AdamW",
                        variant],
                       capture_output=True, text=True, timeout=1200, env=CUDA)
    assert p.returncode == 0, f"{which} run failed:\n{p.stdout[-3000:]}\n{p.stderr[-6000:]}"
    return torch.load(out, map_location="cpu")


@pytest.mark.parametrize("variant", ["bf16-cpu", "bf16-params-on-device"])
def test_gpu_fused_step_matches_deepspeedcpuadam(tmp_path, variant):
    """test_deepspeed_step.py's assertions with the model on cuda:0: the fused pass ran on every
    sub-group, the first step is DeepSpeedCPUAdam's to the rounding of the update, and after 50
    steps Spillway is no further from DeepSpeedCPUAdam than torch's AdamW is. `bf16-cpu`: the
    16-bit partitions offloaded too (offload_param cpu); `bf16-params-on-device`: they stay on the
    GPU, the fused pass updates the master and DeepSpeed copies it to the device."""
    import test_deepspeed_step as cpu

    runs = {w: run_step(tmp_path, w, variant) for w in ("deepspeed", "torch-adam", "spillway")}
    ours, theirs, control = runs["spillway"], runs["deepspeed"], runs["torch-adam"]
    record(f"fused_step_{variant}", {
        "params16_device": ours["params16_device"],
        "median_step_s": {w: statistics.median(r["step_s"][5:]) for w, r in runs.items()},
        "final_loss": {w: r["losses"][-1] for w, r in runs.items()},
        "rms_vs_deepspeed": {w: max(cpu.rms(a, b) for a, b in zip(r["masters"], theirs["masters"]))
                             for w, r in runs.items() if w != "deepspeed"}})
    assert all(r["engine_device"] == "cuda:0" for r in runs.values()), [r["engine_device"] for r in runs.values()]
    assert ours["params16_device"] == ("cuda:0" if variant == "bf16-params-on-device" else "cpu"), ours["params16_device"]
    cpu.test_spillways_step_ran_on_every_sub_group_with_deepspeeds_counts_and_lrs(runs)
    cpu.test_the_first_step_matches_deepspeedcpuadam_to_the_rounding_of_the_update(runs)
    cpu.test_fifty_steps_stay_within_twice_the_distance_between_deepspeeds_own_two_adams(runs)
    cpu.test_the_16_bit_partition_is_the_round_to_nearest_even_of_the_new_master(runs)
    if variant == "bf16-params-on-device":
        assert not [w for w in ours["warnings"] if "own optimizer step runs" in w], ours["warnings"]
    assert ours["losses"][-1] < 0.8 * ours["losses"][0] and control["losses"][-1] < 0.8 * control["losses"][0]


def test_gpu_zero2_fused_pass_writes_the_staging_buffer_deepspeed_copies_to_the_device(tmp_path):
    """ZeRO-2 with the 16-bit partition on cuda:0: the fused pass writes the host staging buffer
    (one of step()'s copies skipped per group and step) and DeepSpeed's own copy takes it to the
    device, where it is the round to nearest even of the new master."""
    import test_deepspeed_step as cpu

    runs = {w: run_step(tmp_path, w, "bf16-zero2", steps=30) for w in ("deepspeed", "torch-adam", "spillway")}
    ours, theirs, control = runs["spillway"], runs["deepspeed"], runs["torch-adam"]
    record("fused_step_bf16-zero2", {
        "params16_device": ours["params16_device"], "copies_skipped": ours["copies_skipped"],
        "median_step_s": {w: statistics.median(r["step_s"][5:]) for w, r in runs.items()},
        "rms_vs_deepspeed": {w: max(cpu.rms(a, b) for a, b in zip(r["masters"], theirs["masters"]))
                             for w, r in runs.items() if w != "deepspeed"}})
    assert ours["params16_device"] == "cuda:0" and ours["kernel"], ours["params16_device"]
    assert ours["copies_skipped"] == 30 * ours["sub_groups"] and theirs["copies_skipped"] == 0
    for master, p16 in zip(ours["masters"], ours["params16"]):
        assert torch.equal(master.to(p16.dtype), p16)
    for i, (a, b, c) in enumerate(zip(theirs["masters"], ours["masters"], control["masters"])):
        assert cpu.rms(a, b) <= 2 * cpu.rms(a, c), i


@pytest.mark.parametrize("stage", [3, 2])
def test_gpu_seed_000_scale_on_cuda_0_is_named_by_the_guard(stage):
    """Seed 000 as users met it: DeepSpeed on CUDA, the combined scale made on cuda:0 while the fp32
    gradients of offload_optimizer live on the CPU. torch's bare error names no tensor; the guard
    names the gradient, the scale, the device and the caller."""
    import test_guard

    test_guard.check_seed_000_is_named(stage, "cuda")


def test_gpu_save_16bit_model_writes_deepspeeds_tensors(tmp_path):
    """spillway.deepspeed.save_16bit_model with the engine on cuda:0: the same tensors under the same
    names as DeepSpeed's own engine.save_16bit_model."""
    from spillway import safetensors_stream

    out = tmp_path / "out.json"
    p = subprocess.run([sys.executable, str(HERE / "workers" / "ds_save.py"), str(out), str(tmp_path / "ds"),
                        str(tmp_path / "sp"), "2", "64", str(64 * 1024)],
                       capture_output=True, text=True, timeout=1200, env=CUDA)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-6000:]
    r = json.loads(out.read_text())
    assert r["engine_device"] == "cuda:0", r
    theirs = torch.load(tmp_path / "ds" / "pytorch_model.bin", weights_only=True, map_location="cpu")
    ours = safetensors_stream.load(tmp_path / "sp")
    record("save_16bit_model", {"files": len(r["files"]), "tensors": len(theirs),
                                "ds_peak_mib": r["ds_peak"] / MIB, "spillway_peak_mib": r["spillway_peak"] / MIB})
    assert set(ours) == set(theirs) and len(theirs) > 10
    for name, t in theirs.items():
        assert ours[name].dtype == t.dtype and torch.equal(ours[name], t), name


def test_gpu_fsdp2_pinned_cpu_offload_is_spillways_and_trains_identically():
    """test_fsdp2.py's check on cuda:0 with CPUOffloadPolicy(pin_memory=True): the sharded parameters
    are pinned by torch's host allocator, which install() makes Spillway's pinned arena; the run
    equals the plain one bit for bit. Held against requested pinned bytes, beside torch's cache."""
    import test_fsdp2

    plain, ours = test_fsdp2.check_fsdp2_offload("cuda", pin=True)
    record("fsdp2_pinned", {"spillway_pinned": ours["pinned"], "torch_pinned": plain.get("torch_pinned"),
                            "losses_identical": plain["losses"] == ours["losses"]})
    assert ours["pinned"]["live_bytes"] > 0, ours["pinned"]
    check_pinned_arena(ours["pinned"])


def test_gpu_zero_infinity_swaps_into_spillways_nvme_arena_within_the_control(tmp_path):
    """test_deepspeed_step.py's ZeRO-Infinity check with the model on cuda:0: optimizer state and
    parameters on NVMe, DeepSpeed's swappers really page-locked, the swapped tensors extents of
    Spillway's NVMe arena, the fused step within twice the torch-AdamW control's distance from
    DeepSpeedCPUAdam over 20 steps. Plain DeepSpeed's runs swap through its own async_io op."""
    import test_deepspeed_step as cpu

    runs = {w: run_step(tmp_path, w, "bf16-infinity", steps=20) for w in ("deepspeed", "torch-adam", "spillway")}
    ours = runs["spillway"]
    (store,) = ours["swap_stats"].values()
    record("zero_infinity", {
        "median_step_s": {w: statistics.median(r["step_s"][3:]) for w, r in runs.items()},
        "final_loss": {w: r["losses"][-1] for w, r in runs.items()},
        "rms_vs_deepspeed": {w: max(cpu.rms(a, b) for a, b in zip(r["masters"], runs["deepspeed"]["masters"]))
                             for w, r in runs.items() if w != "deepspeed"},
        "store": {k: store[k] for k in ("files", "live_bytes", "written_bytes", "read_bytes", "checksum_failures")}})
    assert all(r["engine_device"] == "cuda:0" for r in runs.values()), [r["engine_device"] for r in runs.values()]
    cpu.check_zero_infinity(runs)


@pytest.mark.parametrize("stage", [3, 2])
def test_gpu_deepspeeds_checkpoints_resume_bit_for_bit_and_load_both_ways(tmp_path, stage, monkeypatch):
    """test_deepspeed_checkpoint.py's checks with the engine on cuda:0 (NCCL): a load into the
    arena's tensors holds at most the largest tensor more (plain DeepSpeed's holds the state, the
    control), a resumed run continues the uninterrupted one bit for bit, and plain DeepSpeed and
    Spillway each load the other's files."""
    import test_deepspeed_checkpoint as cpu

    monkeypatch.setenv("DS_ACCELERATOR", "cuda")
    where = cpu.run(tmp_path, "where", {"stage": stage, "spillway": True, "steps": 1})
    assert where["engine_device"] == "cuda:0", where
    (tmp_path / "load").mkdir()
    cpu.test_a_load_copies_into_the_arena_tensors_and_leaves_nothing_behind(tmp_path / "load", stage)
    (tmp_path / "resume").mkdir()
    cpu.test_a_resumed_run_continues_the_uninterrupted_one_bit_for_bit(tmp_path / "resume", stage)
    (tmp_path / "cross").mkdir()
    cpu.test_plain_deepspeed_loads_spillways_checkpoint_and_spillway_loads_plain_deepspeeds(
        tmp_path / "cross", stage, cpu.SharedSaves(tmp_path / "saves"))
    record(f"checkpoint_zero{stage}", {"engine_device": where["engine_device"], "checks": ["load", "resume", "cross"]})


def test_gpu_four_ranks_grabbing_pinned_and_pageable_memory_hold_one_node_budget(tmp_path):
    """The node budget with CUDA's page-locked memory in it: four torchrun ranks, each with the one
    line and nothing else, each taking 64 MiB tensors (every other one pinned by cudaHostRegister)
    until refused. Every rank is refused by name, the node's committed bytes and the sum the ranks
    hold stay within the budget, and the pinned arena really pinned through CUDA."""
    import test_node

    budget = 4096 * MIB
    out = tmp_path / "grab"
    out.mkdir()
    job = f"pytest-gpu-grab-{os.getpid()}"
    env = dict(os.environ, SPILLWAY_NODE_JOB=job, SPILLWAY_NODE_BUDGET_BYTES=str(budget), OMP_NUM_THREADS="1")
    p = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "4", "--master-port",
                        str(test_node.free_port()), str(HERE / "workers" / "node_grab.py"), str(out), "64"],
                       capture_output=True, text=True, timeout=600, env=env)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-6000:]
    ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in range(4)]
    held = sum(r["held_bytes"] for r in ranks)
    record("node_budget_grab", {"budget_mib": budget / MIB, "held_mib": [r["held_bytes"] / MIB for r in ranks],
                                "pinned_mib": [r["pinned_bytes"] / MIB for r in ranks],
                                "committed_mib": [r["node"]["host_committed_bytes"] / MIB for r in ranks],
                                "pin_mode": [r["pin_mode"] for r in ranks],
                                "errors": [r["error"] and r["error"]["text"][:300] for r in ranks]})
    for r in ranks:
        assert r["cuda"] and r["pin_mode"] == "cuda", r
        assert r["pinned_bytes"] > 0, r
        assert r["error"] is not None and r["error"]["type"] in ("OverBudget", "OutOfMemoryError"), r["error"]
        assert f"node budget: local rank {r['rank']} of job '{job}'" in r["error"]["text"], r["error"]
        assert r["node"]["host_committed_bytes"] <= budget, r["node"]
    assert held <= budget, (held, budget)
    assert held >= budget // 2, (held, budget)  # the ranks really filled the node
