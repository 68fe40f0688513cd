"""One host budget for the whole node (spillway.node), on the real DeepSpeed 0.19.8 under torchrun:
four ranks (CPU accelerator, Gloo, ZeRO-3 cpu/cpu offload, bf16), each with a DataLoader that forks 2
workers every epoch (tests/python/workers/ds_node.py). The node's ledger is watched from outside, as
`python -m spillway.node` reads it, and so is /proc of the whole process tree.

The first run of DeepSpeed's ops on a machine JIT-builds them into ~/.cache/torch_extensions.
"""
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

pytest.importorskip("deepspeed", reason="DeepSpeed is not installed (scripts/install-deps installs 0.19.8)")
import spillway  # noqa: E402

WORKER = Path(__file__).parent / "workers" / "ds_node.py"
MiB = 1 << 20
RANKS = 4


def free_port():
    import socket  # noqa: PLC0415

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def segment_path(job):
    return f"/dev/shm/spillway-node-{os.geteuid()}-{job}"


def tree_pss(root):
    """Summed Pss (bytes) of `root` and every process below it: what the node really holds."""
    total, todo = 0, [root]
    while todo:
        pid = todo.pop()
        try:
            with open(f"/proc/{pid}/smaps_rollup") as f:
                total += sum(int(line.split()[1]) * 1024 for line in f if line.startswith("Pss:"))
        except OSError:
            continue
        todo += spillway.node.children(pid)
    return total


class Watcher(threading.Thread):
    """Samples the job's node ledger (from outside, as `python -m spillway.node`) and the process
    tree's Pss every 20 ms while the job runs."""

    def __init__(self, job, proc):
        super().__init__(daemon=True)
        self.path, self.proc = segment_path(job), proc
        self.samples, self.peak_pss, self.errors = [], 0, []
        self.stop = threading.Event()

    def run(self):
        while not self.stop.is_set() and self.proc.poll() is None:
            self.peak_pss = max(self.peak_pss, tree_pss(self.proc.pid))
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


def finish(proc, timeout=900):
    try:
        text, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        text, _ = proc.communicate()
        pytest.fail(f"the job did not finish within {timeout} s:\n{text[-6000:]}")
    return proc.returncode, text


def results(out):
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(RANKS)]


BUDGET = 1024 * MiB  # holds four ranks' state (each maps 32 MiB regions) and rank 0's extra
EXTRA_MIB = 400      # rank 0's extra tensor: more than BUDGET / 4
HIDDEN = 2048        # 4.3M parameters: the state per rank is larger than one region


def test_four_ranks_three_epochs_stay_within_one_node_budget(tmp_path):
    job = f"pytest-node-{os.getpid()}-{time.monotonic_ns()}"
    out, proc = torchrun(tmp_path, "spillway", 3, 4, HIDDEN,
                         {"SPILLWAY_NODE_JOB": job, "SPILLWAY_NODE_BUDGET_BYTES": str(BUDGET)}, EXTRA_MIB)
    watcher = Watcher(job, proc)
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
    assert not os.path.exists(segment_path(job)), "the last rank out removes the segment"
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
    path = segment_path(job)
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


@pytest.mark.parametrize("launch", ["spawn", "spawn-in-srun", "mpirun"])
def test_four_ranks_started_without_torchrun_share_one_node_budget(tmp_path, launch):
    """torch.multiprocessing.spawn (and Lightning's ddp_spawn, which uses it) sets no launcher
    variable (under srun its ranks inherit the one task's SLURM_LOCALID=0, which all four would
    claim), and OpenMPI's mpirun sets its own (OMPI_COMM_WORLD_LOCAL_RANK): the ranks of either
    took a budget each, 3/4 of the memory limit, and in an 8 GiB cgroup the OOM killer killed one.
    Here four ranks, each with the one line and nothing else, take 32 MiB tensors until refused, at
    most 640 MiB each (more than the whole budget, so that even a rank that fills the node alone is
    refused; what four would hold unrefused is safe on any CI machine). They join one job,
    named by the process that started them, every rank is refused by name, and what they hold
    together stays within the node budget."""
    budget, out = 512 * MiB, tmp_path / launch
    out.mkdir()
    env = dict(os.environ, SPILLWAY_NODE_BUDGET_BYTES=str(budget), OMP_NUM_THREADS="1")
    env.pop("SPILLWAY_NODE_JOB", None)
    grab = [str(WORKER.parent / "node_grab.py"), str(out), "32", "640"]
    if launch.startswith("spawn"):
        cmd = [sys.executable, *grab, "--spawn", str(RANKS)]
        if launch == "spawn-in-srun":  # one task that spawns: its ranks inherit SLURM_LOCALID=0
            env.update(SLURM_LOCALID="0", SLURM_STEP_TASKS_PER_NODE="1", SLURM_NODEID="0", SLURM_JOB_ID="7")
    else:
        mpirun = shutil.which("mpirun")
        if mpirun is None:
            pytest.skip("mpirun is not installed (scripts/install-deps installs Debian's openmpi-bin)")
        env.update(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
        cmd = [mpirun, "--oversubscribe", "-np", str(RANKS), sys.executable, *grab]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    rc, text = finish(proc, timeout=300)
    assert rc == 0, text[-6000:]
    ranks = results(out)
    held = sum(r["held_bytes"] for r in ranks)
    print(f"{RANKS} ranks by {launch} held {[r['held_bytes'] // MiB for r in ranks]} MiB of a {budget // MiB} MiB "
          f"node budget; job {ranks[0]['job']}")
    for r in ranks:
        assert r["node"] is not None, f"rank {r['rank']} joined no node budget: {r['job']}"
        assert r["node"]["job"] == ranks[0]["node"]["job"], "one job for all four"
        if launch.startswith("spawn"):
            assert r["node"]["job"].startswith(f"spawn-{proc.pid}-"), r["node"]["job"]
        else:
            assert r["node"]["job"].startswith("launcher-"), r["node"]["job"]
            assert r["job"]["local_rank"] == r["rank"] and r["job"]["local_world_size"] == RANKS, r["job"]
        assert len(r["node"]["ranks"]) == RANKS, r["node"]["ranks"]
        assert r["error"] is not None, f"rank {r['rank']} was never refused: it held {r['held_bytes'] // MiB} MiB"
        assert r["error"]["type"] == "OverBudget", r["error"]
        assert f"of job '{r['node']['job']}'" in r["error"]["text"], r["error"]
    assert held <= budget, (held, budget)
    assert held >= budget // 2, (held, budget)  # the ranks really filled the node
    assert not os.path.exists(segment_path(ranks[0]["node"]["job"])), "the last rank removes the segment"


CGROUP_LIMIT = 3 << 30


@pytest.mark.parametrize("launch", ["spawn", "mpirun", "torchrun", "deepspeed", "control"])
def test_four_ranks_in_a_memory_cgroup_hold_its_default_budget_and_no_oom_kill(tmp_path, launch):
    """The failure Spillway exists to end, as a container or a Slurm job meets it: four ranks in a
    cgroup of 3 GiB, each with the one line and nothing else, no budget set, take 32 MiB tensors as
    fast as they can, at most the whole default budget each. Without one budget for the node each
    would take a budget of its own (3/4 of the limit) and the cgroup's OOM killer would kill one.
    Here, started by torch.multiprocessing.spawn, OpenMPI's mpirun, torchrun or the deepspeed
    launcher: one job, the default budget from the cgroup's limit (the limit less a reserve of half
    of it), every rank refused by name, every process exits 0, and the OOM killer never fires.
    The control: the same spawned ranks with SPILLWAY_NODE=0 (each its own budget, as before),
    where the cgroup's OOM killer kills a rank: the limit is real and the count sees it."""
    import _cgroup

    try:
        cg = _cgroup.MemoryCgroup.make(f"spillway-test-{os.getpid()}-{launch}", CGROUP_LIMIT)
    except _cgroup.Unavailable as e:
        pytest.skip(f"no memory cgroup for the test: {e}")
    try:
        out = tmp_path / launch
        out.mkdir()
        budget = spillway._spillway._node_default_budget(CGROUP_LIMIT)[0]
        env = dict(os.environ, OMP_NUM_THREADS="1")
        for name in ("SPILLWAY_NODE_JOB", "SPILLWAY_NODE_BUDGET_BYTES"):
            env.pop(name, None)
        grab = [str(WORKER.parent / "node_grab.py"), str(out), "32", str(budget // MiB + 32)]
        if launch == "control":
            env["SPILLWAY_NODE"] = "0"
        if launch in ("spawn", "control"):
            cmd = [sys.executable, *grab, "--spawn", str(RANKS)]
        elif launch == "mpirun":
            mpirun = shutil.which("mpirun")
            if mpirun is None:
                pytest.skip("mpirun is not installed (scripts/install-deps installs Debian's openmpi-bin)")
            env.update(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
            cmd = [mpirun, "--oversubscribe", "-np", str(RANKS), sys.executable, *grab]
        elif launch == "torchrun":
            cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(RANKS), "--master-port",
                   str(free_port()), *grab]
        else:
            cmd = [sys.executable, "-m", "deepspeed.launcher.runner", "--num_gpus", str(RANKS), "--master_port",
                   str(free_port()), *grab]
        proc = subprocess.Popen(cg.wrap(cmd), env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        rc, text = finish(proc, timeout=300)
        kills, peak = cg.oom_kills(), cg.peak()
    finally:
        cg.remove()
    if launch == "control":
        print(f"control (SPILLWAY_NODE=0) in a {CGROUP_LIMIT >> 30} GiB cgroup: exit {rc}, OOM kills {kills}")
        assert kills >= 1 and rc != 0 and "SIGKILL" in text, text[-4000:]
        return
    assert kills == 0, f"the cgroup's OOM killer killed {kills} process(es)\n" + text[-4000:]
    assert rc == 0, text[-6000:]
    ranks = results(out)
    held = sum(r["held_bytes"] for r in ranks)
    print(f"{RANKS} ranks by {launch} in a {CGROUP_LIMIT >> 30} GiB cgroup held "
          f"{[r['held_bytes'] // MiB for r in ranks]} MiB of the default {budget // MiB} MiB budget; the cgroup's "
          f"peak {peak / MiB if peak else float('nan'):.0f} MiB, OOM kills {kills}; job {ranks[0]['node']['job']}")
    for r in ranks:
        assert r["node"] is not None, f"rank {r['rank']} joined no node budget: {r['job']}"
        assert r["node"]["job"] == ranks[0]["node"]["job"], "one job for all four"
        assert r["node"]["host_budget_bytes"] == budget and not r["node"]["budget_explicit"], r["node"]
        assert len(r["node"]["ranks"]) == RANKS, r["node"]["ranks"]
        assert r["error"] is not None and r["error"]["type"] == "OverBudget", r
        assert f"of job '{r['node']['job']}'" in r["error"]["text"], r["error"]
    assert budget // 2 <= held <= budget, (held, budget)
