"""End to end: DeepSpeed ZeRO-3 with offload_optimizer and offload_param on nvme trains a small
model once on DeepSpeed's own aio op (libaio, JIT-built from the installed DeepSpeed) and once on
Spillway's (spillway.deepspeed.install()), on DeepSpeed's CPU accelerator. The losses must be
identical bit for bit: the two runs do the same arithmetic and differ only in how swapped tensors
reach the disk and come back, so any difference is data that did not survive the round trip.

Each run is a process of its own (DeepSpeed's comm layer and the op patch are process-wide). The
first run on a machine JIT-builds DeepSpeed's async_io, cpu_adam and shm_comm ops into
~/.cache/torch_extensions (minutes on 2 cores); later runs load them.
"""
import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("deepspeed", reason="DeepSpeed is not installed (scripts/install-deps installs 0.19.8)")
import _ds_env  # noqa: E402

WORKER = Path(__file__).parent / "workers" / "ds_zero3.py"
STEPS = 12


def train(which, swap):
    swap.mkdir()
    out = subprocess.run([sys.executable, str(WORKER), which, str(swap), str(STEPS)],
                         capture_output=True, text=True, timeout=1500)
    assert out.returncode == 0, f"{which} run failed:\n{out.stdout[-4000:]}\n{out.stderr[-8000:]}"
    return json.loads(out.stdout.strip().splitlines()[-1])


@_ds_env.needs_infinity()
def test_zero3_nvme_offload_trains_identically_on_spillways_aio(tmp_path):
    theirs = train("deepspeed", tmp_path / "deepspeed")
    ours = train("spillway", tmp_path / "spillway")
    print("deepspeed aio:", theirs)
    print("spillway aio: ", ours)
    # Each run really used the op it was meant to: DeepSpeed's swappers hold the handle class.
    assert all(h.startswith("spillway.") for h in ours["handles"].values()), ours["handles"]
    assert not any(h.startswith("spillway.") for h in theirs["handles"].values()), theirs["handles"]
    # Both really swapped: parameter and optimizer partitions were files after the first step on
    # DeepSpeed's op, and as many extents of Spillway's NVMe arena on Spillway's (no file).
    assert theirs["swap_files"] > 0 and ours["swap_files"] == 0
    assert ours["stored_files"] == theirs["swap_files"]
    assert len(ours["losses"]) == STEPS
    assert ours["losses"] == theirs["losses"]
    assert sum(ours["losses"][-3:]) < 0.9 * sum(ours["losses"][:3])  # it trained
