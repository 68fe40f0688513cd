"""ZeRO-Infinity's swapped tensors in Spillway's NVMe arena (spillway.deepspeed.install(), whose
nvme_swap="arena" is the default), on the real DeepSpeed 0.19.8 (CPU accelerator), each run a process
of its own (tests/python/workers/ds_infinity.py): optimizer state and parameters on NVMe above
DeepSpeed's swap threshold. The equivalence over 20 steps against plain DeepSpeed is in
test_deepspeed_step.py (bf16-infinity)."""
import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import _zygote
import pytest

pytest.importorskip("deepspeed", reason="DeepSpeed is not installed (scripts/install-deps installs 0.19.8)")
import _ds_env  # noqa: E402

if _ds_env.infinity_skip_reason():
    pytest.skip(_ds_env.infinity_skip_reason(), allow_module_level=True)

WORKER = Path(__file__).parent / "workers" / "ds_infinity.py"


def worker(*args, swap_mode=None, timeout=600):
    env = dict(os.environ)
    if swap_mode is not None:
        env["DS_INFINITY_SWAP"] = swap_mode
    p = _zygote.run([sys.executable, str(WORKER), *map(str, args)], capture_output=True, text=True,
                    timeout=timeout, env=env)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-6000:]


def files_under(folder):
    return sorted(str(Path(d, f).relative_to(folder)) for d, _, fs in os.walk(folder) for f in fs)


def test_a_byte_flipped_in_a_swapped_moment_is_caught_by_its_crc_naming_the_swap_file(tmp_path):
    out = tmp_path / "out.json"
    worker("corrupt", tmp_path / "swap", out)
    r = json.loads(out.read_text())
    assert r["type"] == "ChecksumMismatch", r
    assert os.path.basename(r["target"]).startswith("exp_avg_sq-")
    assert f"DeepSpeed swap file {r['target']}" in r["error"] and "checksum mismatch" in r["error"], r["error"]
    # The store is in Prometheus, through an exporter started before DeepSpeed made it and one after.
    arena = f'arena="deepspeed-swap:{r["root"]}"'
    for text in r["scrapes"]:
        samples = {}
        for line in text.splitlines():
            if arena in line and not line.startswith("#"):
                name_labels, value = line.rsplit(" ", 1)
                samples[name_labels] = float(value)

        def sample(name, *labels):
            (v,) = [v for k, v in samples.items() if k.startswith(name + "{") and all(lb in k for lb in labels)]
            return v

        assert sample("spillway_checksum_failures_total") == 1, samples
        assert sample("spillway_nvme_bytes", 'state="live"') >= 30 << 20, samples  # ~37 MiB swapped
        for kind in ("param", "master_weight", "optimizer_state"):
            assert sample("spillway_live_bytes_by_kind", 'tier="nvme"', f'kind="{kind}"') > 0, (kind, samples)
        assert sample("spillway_budget_bytes", 'tier="nvme"') > 0, samples


@pytest.mark.parametrize("swap_mode", ["arena", "files"])
def test_a_sigkilled_run_leaves_no_swap_file_behind(tmp_path, swap_mode):
    # "files" is the control: DeepSpeed's own swap files stay on disk after the kill.
    swap = tmp_path / "swap"
    p = _zygote.popen([sys.executable, str(WORKER), "run", str(swap), swap_mode], stdout=subprocess.PIPE,
                      stderr=subprocess.DEVNULL, text=True)
    try:
        for line in p.stdout:
            if line.strip() == "step 3":
                break
        else:
            pytest.fail(f"the run ended before its third step (exit {p.wait()})")
        p.send_signal(signal.SIGKILL)
    finally:
        p.kill()
        p.wait()
    left = files_under(swap)
    assert os.path.isdir(swap / "zero_stage_3" / "optimizer" / "rank0")  # the folders DeepSpeed made
    if swap_mode == "arena":
        assert left == [], left
    else:
        assert any(f.endswith(".tensor.swp") for f in left) and sum(
            (swap / f).stat().st_size for f in left) >= 20 << 20, left


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """One `save` run per mode (3 steps, save_checkpoint as t3, 2 more steps), each into a fresh
    swap folder (MODE/swap-a) and checkpoint (MODE/ckpt), shared by the round trip and by the
    stale-files test, which reuses the files run's swap folder (a copy of it) as its stale one."""
    root = tmp_path_factory.mktemp("swap-saves")
    for mode in ("arena", "files"):
        d = root / mode
        worker("save", d / "swap-a", d / "ckpt", d / "save.json", swap_mode=mode)
    return root


def test_deepspeeds_checkpoint_of_swapped_state_round_trips_as_with_its_own_files(tmp_path, saved):
    """DeepSpeed's save_checkpoint copies the optimizer's swap folder as files and load_checkpoint
    copies them back: the checkpoint of an arena run holds the bytes a run on DeepSpeed's own files
    writes, and resuming from it trains as resuming a files run does."""
    runs = {}
    for mode in ("arena", "files"):
        d = saved / mode
        worker("load", tmp_path / mode / "swap-b", d / "ckpt", tmp_path / mode / "load.json", swap_mode=mode)
        runs[mode] = {"save": json.loads((d / "save.json").read_text()),
                      "load": json.loads((tmp_path / mode / "load.json").read_text()),
                      "ckpt": d / "ckpt" / "t3" / "offloaded_tensors" / "rank00"}
    arena, files = runs["arena"], runs["files"]
    names = files_under(files["ckpt"])
    assert names and files_under(arena["ckpt"]) == names
    assert any(n.startswith("exp_avg_sq-") for n in names) and not any("gradient" in n for n in names), names
    for n in names:
        assert (arena["ckpt"] / n).read_bytes() == (files["ckpt"] / n).read_bytes(), n
    assert arena["save"]["losses"] == files["save"]["losses"]
    assert arena["load"]["losses"] == files["load"]["losses"]
    # Nothing is left in the arena run's swap folders: the files written out for DeepSpeed's copy
    # were removed after it, and the checkpoint's files taken into the store when first read.
    assert arena["save"]["left_in_swap_folder"] == [] and arena["load"]["left_in_swap_folder"] == []
    assert files_under(saved / "arena" / "swap-a") == [] and files_under(tmp_path / "arena" / "swap-b") == []
    (store,) = arena["load"]["stats"].values()
    assert store["files"] >= len(names) and store["checksum_failures"] == 0


def test_the_checkpoints_swap_copy_is_in_its_manifest_and_a_damaged_one_is_refused(tmp_path, saved):
    """The swap folder's copy DeepSpeed makes into the checkpoint (offloaded_tensors/rankNN) is
    fsynced and listed, with its CRC32C, in the rank's manifest: a byte flipped in it is refused by
    the load, naming the file, before DeepSpeed copies it back."""
    ckpt = saved / "arena" / "ckpt"
    copy = files_under(ckpt / "t3" / "offloaded_tensors")
    manifest = json.loads((ckpt / "t3" / "spillway-checkpoint-rank00000.json").read_text())
    listed = sorted(f for f in manifest["files"] if f.startswith("offloaded_tensors/"))
    assert copy and listed == [f"offloaded_tensors/{n}" for n in copy], (listed, copy)
    damaged = tmp_path / "ckpt"
    shutil.copytree(ckpt, damaged)
    victim = damaged / "t3" / "offloaded_tensors" / copy[0]
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0x40
    victim.write_bytes(bytes(data))
    p = _zygote.run([sys.executable, str(WORKER), "load", str(tmp_path / "swap"), str(damaged), str(tmp_path / "o.json")],
                    capture_output=True, text=True, timeout=600, env=dict(os.environ, DS_INFINITY_SWAP="arena"))
    assert p.returncode != 0 and "ChecksumMismatch" in p.stderr and str(victim) in p.stderr, p.stderr[-3000:]


def test_bad_input_a_swap_budget_too_small_fails_naming_the_file_and_the_budget(tmp_path):
    env = dict(os.environ, SPILLWAY_NVME_BUDGET_BYTES=str(8 << 20))  # the run swaps ~37 MiB
    p = _zygote.run([sys.executable, str(WORKER), "run", str(tmp_path / "swap"), "arena"], capture_output=True,
                    text=True, timeout=600, env=env)
    assert p.returncode != 0 and "step 3" not in p.stdout
    assert "OverBudget" in p.stderr and "DeepSpeed swap file" in p.stderr, p.stderr[-3000:]
    assert "SPILLWAY_NVME_BUDGET_BYTES" in p.stderr, p.stderr[-3000:]
    assert files_under(tmp_path / "swap") == []
    env["SPILLWAY_NVME_BUDGET_BYTES"] = "lots"
    p = _zygote.run([sys.executable, str(WORKER), "run", str(tmp_path / "swap2"), "arena"], capture_output=True,
                    text=True, timeout=600, env=env)
    assert p.returncode != 0 and "SPILLWAY_NVME_BUDGET_BYTES='lots'" in p.stderr, p.stderr[-3000:]


def test_swap_files_an_earlier_run_left_in_the_folder_never_replace_this_runs_state(tmp_path, saved):
    """DeepSpeed's optimizer swapper does not empty its folder: a run on DeepSpeed's own files (or
    a killed save) leaves files there. An arena run on the same nvme_path must not read them as
    its own state (found in review: the first swap-in took the stale file). The files run and the
    arena run in a fresh folder are the shared saves; the folder the files run left is copied."""
    shared = tmp_path / "shared-swap"
    shutil.copytree(saved / "files" / "swap-a", shared)
    assert any(f.startswith("zero_stage_3/optimizer/") for f in files_under(shared))  # the stale files
    worker("save", shared, tmp_path / "ckpt-after", tmp_path / "after.json", swap_mode="arena")
    after = json.loads((tmp_path / "after.json").read_text())
    fresh = json.loads((saved / "arena" / "save.json").read_text())
    assert after["losses"] == fresh["losses"], (after["losses"], fresh["losses"])
    assert not any(f.startswith("zero_stage_3/optimizer/") for f in files_under(shared)), files_under(shared)
