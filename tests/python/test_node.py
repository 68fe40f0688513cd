"""One host budget for the whole node (spillway.node), on the real DeepSpeed 0.19.8 under torchrun:
four ranks (CPU accelerator, Gloo, ZeRO-3 cpu/cpu offload, bf16), each with a DataLoader that forks 2
workers every epoch (tests/python/workers/ds_node.py). The node's ledger is watched from outside, as
`python -m spillway.node` reads it, and so is /proc of the whole process tree.

The first run of DeepSpeed's ops on a machine JIT-builds them into ~/.cache/torch_extensions.
"""
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

pytest.importorskip("deepspeed", reason="DeepSpeed is not installed (scripts/install-deps installs 0.19.8)")
import spillway  # noqa: E402

from _launch import RANKS, MiB, finish, free_port, results, segment_path, tree_bytes  # noqa: E402

WORKER = Path(__file__).parent / "workers" / "ds_node.py"


class Watcher(threading.Thread):
    """Samples the job's node ledger (from outside, as `python -m spillway.node`) and the process
    tree's Pss every 20 ms while the job runs."""

    def __init__(self, proc):
        super().__init__(daemon=True)
        self.path, self.proc = segment_path(), proc
        self.samples, self.peak_pss, self.errors = [], 0, []
        self.stop = threading.Event()

    def run(self):
        while not self.stop.is_set() and self.proc.poll() is None:
            self.peak_pss = max(self.peak_pss, tree_bytes(self.proc.pid))
            if os.path.exists(self.path):
                try:
                    self.samples.append(spillway.node.inspect(self.path))
                except spillway.Error as e:  # the last rank removed it between exists and open
                    if os.path.exists(self.path):
                        self.errors.append(str(e))
            time.sleep(0.02)


def torchrun(tmp_path, mode, epochs, steps, hidden, env_extra, extra_mib=0, timeout=900):
    out = tmp_path / mode
    out.mkdir(exist_ok=True)
    env = dict(os.environ, DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1", **env_extra)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(RANKS), "--master-port",
           str(free_port()), "--monitor-interval", "0.1", str(WORKER), mode, str(out), str(epochs), str(steps),
           str(hidden), str(extra_mib)]
    return out, subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


BUDGET = 1024 * MiB  # holds four ranks' state (each maps 32 MiB regions) and rank 0's extra
EXTRA_MIB = 400      # rank 0's extra tensor: more than BUDGET / 4
HIDDEN = 2048        # 4.3M parameters: the state per rank is larger than one region


def test_four_ranks_three_epochs_stay_within_one_node_budget(tmp_path):
    job = f"pytest-node-{os.getpid()}-{time.monotonic_ns()}"
    out, proc = torchrun(tmp_path, "spillway", 3, 4, HIDDEN,
                         {"SPILLWAY_NODE_JOB": job, "SPILLWAY_NODE_BUDGET_BYTES": str(BUDGET)}, EXTRA_MIB)
    watcher = Watcher(proc)
    watcher.start()
    rc, text = finish(proc)
    watcher.stop.set()
    watcher.join()
    assert rc == 0, text[-8000:]
    ours = results(out)
    # From outside, at every sample: the node's committed bytes within its budget.
    samples = watcher.samples
    assert len(samples) > 20, f"{len(samples)} samples; errors {watcher.errors[:3]}"
    assert all(s["host_budget_bytes"] == BUDGET for s in samples)
    worst = max(s["host_committed_bytes"] for s in samples)
    assert worst <= BUDGET, worst
    assert max(len(s["ranks"]) for s in samples) == RANKS
    # Uneven ranks: local rank 0 held more than 1/N of the node while the others left it free.
    rank0_peak = max(r["peak_host_bytes"] for s in samples for r in s["ranks"] if r["local_rank"] == 0)
    assert rank0_peak > BUDGET // RANKS, rank0_peak
    # Every rank's state was in the ledger by kind at some sample (the last ones out may have left
    # before another wrote its report, so the samples are the record).
    for k in range(RANKS):
        assert any(r["live_by_kind"]["master_weight"] > 0 for s in samples for r in s["ranks"]
                   if r["local_rank"] == k), k
    for report in ours:  # each rank's own view at its end
        assert report["node"]["host_budget_bytes"] == BUDGET
        assert report["node"]["host_committed_bytes"] <= BUDGET
    assert not os.path.exists(segment_path()), "the last rank out removes the segment"
    # The planner's per-rank need (what admission declared) against what ranks 1-3 really booked:
    # their state, plus the arenas' region rounding (32 MiB regions, a pinned and a pageable arena).
    plan = spillway._spillway._plan_deepspeed(float(ours[0]["params"]), RANKS, 1, BUDGET,
                                              json.dumps(ours[0]["config"]), True)
    booked = [max(r["peak_host_bytes"] for s in samples for r in s["ranks"] if r["local_rank"] == k)
              for k in range(1, RANKS)]
    print(f"plan: {plan['host_per_rank'] / MiB:.1f} MiB per rank; booked by ranks 1-3: "
          f"{[round(b / MiB, 1) for b in booked]} MiB")
    for b in booked:
        assert plan["host_per_rank"] <= b <= plan["host_per_rank"] + 4 * 32 * MiB, (plan["text"], booked)
    print(f"node: committed peak {worst / MiB:.1f} MiB of {BUDGET / MiB:.0f}, rank 0 peak "
          f"{rank0_peak / MiB:.1f} MiB, tree Pss peak {watcher.peak_pss / MiB:.1f} MiB, {len(samples)} samples")
    # The same job without Spillway: the losses agree within the fused step's tolerance (1%).
    plain_out, plain_proc = torchrun(tmp_path, "plain", 3, 4, HIDDEN, {})
    rc, text = finish(plain_proc)
    assert rc == 0, text[-8000:]
    for a, b in zip(results(plain_out), ours):
        assert len(a["losses"]) == len(b["losses"]) == 12
        assert all(abs(x - y) <= 0.01 * abs(x) + 1e-6 for x, y in zip(a["losses"], b["losses"])), (a, b)


def test_a_node_too_small_for_four_ranks_fails_every_rank_at_initialize(tmp_path):
    job = f"pytest-admit-{os.getpid()}-{time.monotonic_ns()}"
    budget = 200 * MiB  # the model's partitions fit; four ranks' optimizer state does not
    out, proc = torchrun(tmp_path, "spillway", 1, 2, 4096,
                         {"SPILLWAY_NODE_JOB": job, "SPILLWAY_NODE_BUDGET_BYTES": str(budget),
                          "SPILLWAY_NODE_ADMIT_TIMEOUT": "240"})
    started = time.monotonic()
    rc, text = finish(proc, timeout=400)
    took = time.monotonic() - started
    assert rc != 0, text[-6000:]
    assert "Killed" not in text and "exitcode  : -9" not in text, "nothing may be OOM-killed"
    # Every rank failed in admission with the one message, before it allocated the state.
    assert text.count("node admission: the 4 local ranks of job") >= RANKS, text[-8000:]
    assert "more than the node budget of 200.00 MiB" in text
    assert "local rank 3" in text and "Nothing was allocated" in text
    assert not any((out / f"rank{r}.progress").read_text().count("initialized") for r in range(RANKS))
    print(f"all {RANKS} ranks refused at initialize in {took:.1f} s")


def test_kill_9_of_one_rank_gives_its_lease_back(tmp_path):
    job = f"pytest-kill-{os.getpid()}-{time.monotonic_ns()}"
    out, proc = torchrun(tmp_path, "spillway", 50, 4, 256,
                         {"SPILLWAY_NODE_JOB": job, "SPILLWAY_NODE_BUDGET_BYTES": str(BUDGET)})
    path = segment_path()
    victim = None
    try:
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline and proc.poll() is None:
            progress = [(out / f"rank{r}.progress") for r in range(RANKS)]
            lines = [p.read_text().splitlines() if p.exists() else [] for p in progress]
            if all(len(ls) >= 4 for ls in lines):  # every rank is stepping in its first epoch
                victim = int(lines[2][0].split()[1])
                break
            time.sleep(0.05)
        assert victim is not None, f"the ranks never started stepping:\n{proc.stdout.read()[-6000:]}"
        before = spillway.node.inspect(path)
        held = next(r for r in before["ranks"] if r["pid"] == victim)
        assert held["host_bytes"] > 0
        os.kill(victim, signal.SIGKILL)
        killed = time.monotonic()
        after = None
        while time.monotonic() - killed < 2.0:
            after = spillway.node.inspect(path)
            if all(r["pid"] != victim for r in after["ranks"]):
                break
            time.sleep(0.01)
        back = time.monotonic() - killed
        assert all(r["pid"] != victim for r in after["ranks"]), after["text"]
        assert after["host_committed_bytes"] == sum(r["host_bytes"] for r in after["ranks"])
        assert after["reaped_ranks"] >= 1
        print(f"killed rank 2 held {held['host_bytes'] / MiB:.1f} MiB; back in the ledger after {back * 1000:.0f} ms")
    finally:
        rc, text = finish(proc, timeout=300)
    assert rc != 0  # torchrun reports the killed rank
    # torchrun ended the other ranks too; whatever they left, a look from outside reaps.
    if os.path.exists(path):
        assert spillway.node.inspect(path)["ranks"] == []
        os.unlink(path)
