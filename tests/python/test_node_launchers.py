"""One host budget for the node whichever launcher started the ranks (spillway.node): four ranks
started by torch.multiprocessing.spawn (also inside a Slurm task), OpenMPI's mpirun, torchrun and the
deepspeed launcher, and two torchrun jobs of two ranks side by side, each rank with the one line and
nothing else, take host memory until refused (tests/python/workers/node_grab.py): under an explicit
node budget, and in a real memory cgroup under the default budget its limit gives, in the ledger of
that limit, where the cgroup's OOM killer is watched. Apart from
test_node.py, which runs alone (RUN_SERIAL, it watches the node's memory from outside): nothing here
measures memory from outside its own cgroup or ledger."""
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("deepspeed", reason="DeepSpeed is not installed (scripts/install-deps installs 0.19.8)")
import spillway  # noqa: E402
from _launch import RANKS, MiB, finish, free_port, refused_by_name, results  # noqa: E402

WORKER = Path(__file__).parent / "workers" / "node_grab.py"


def test_four_ranks_spawned_inside_a_slurm_task_share_one_node_budget(tmp_path):
    """torch.multiprocessing.spawn (and Lightning's ddp_spawn, which uses it) sets no launcher
    variable, and under srun its ranks inherit the one task's SLURM_LOCALID=0, which all four would
    claim: each took a budget of its own, 3/4 of the memory limit, and in an 8 GiB cgroup the OOM
    killer killed one. Here four such ranks, each with the one line and nothing else, under an
    explicit 512 MiB budget (a test that runs where no memory cgroup can be made; spawn, mpirun,
    torchrun and the deepspeed launcher under a cgroup's default budget are the test below), take
    32 MiB tensors until refused, at most 640 MiB each (more than the whole budget, so that even a
    rank that fills the node alone is refused). They join one job, named by the process that
    spawned them, every rank is refused by name, and what they hold together stays within the
    node budget."""
    budget, out = 512 * MiB, tmp_path / "spawn-in-srun"
    out.mkdir()
    env = dict(os.environ, SPILLWAY_NODE_BUDGET_BYTES=str(budget), OMP_NUM_THREADS="1",
               SLURM_LOCALID="0", SLURM_STEP_TASKS_PER_NODE="1", SLURM_NODEID="0", SLURM_JOB_ID="7")
    env.pop("SPILLWAY_NODE_JOB", None)
    cmd = [sys.executable, str(WORKER), str(out), "32", "640", "--spawn", str(RANKS)]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    rc, text = finish(proc, timeout=300)
    assert rc == 0, text[-6000:]
    ranks = results(out)
    held = sum(r["held_bytes"] for r in ranks)
    print(f"{RANKS} spawned ranks in a Slurm task held {[r['held_bytes'] // MiB for r in ranks]} MiB of a "
          f"{budget // MiB} MiB node budget; job {ranks[0]['job']}")
    for r in ranks:
        assert r["node"] is not None, f"rank {r['rank']} joined no node budget: {r['job']}"
        assert r["node"]["job"] == ranks[0]["node"]["job"], "one job for all four"
        assert r["node"]["job"].startswith(f"spawn-{proc.pid}-"), r["node"]["job"]
        assert len(r["node"]["ranks"]) == RANKS, r["node"]["ranks"]
        assert r["error"] is not None, f"rank {r['rank']} was never refused: it held {r['held_bytes'] // MiB} MiB"
        refused_by_name(r, budget)
    assert held <= budget, (held, budget)
    assert held >= budget // 2, (held, budget)  # the ranks really filled the node
    assert not os.path.exists(ranks[0]["node"]["path"]), "the last rank removes the segment"


CGROUP_LIMIT = 3 << 30


def _torchrun(ranks, grab):
    return [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(ranks), "--master-port",
            str(free_port()), *grab]


@pytest.mark.parametrize("launch", ["spawn", "mpirun", "torchrun", "deepspeed", "own-launcher", "two-torchrun-jobs",
                                    "control", "two-ledgers-control"])
def test_four_ranks_in_a_memory_cgroup_hold_its_default_budget_and_no_oom_kill(tmp_path, launch):
    """The failure Spillway exists to end, as a container or a Slurm job meets it: four ranks in a
    cgroup of 3 GiB, each with the one line and nothing else, no budget set, take 32 MiB tensors as
    fast as they can, at most the whole default budget each. Without one budget for the memory limit
    each would take a budget of its own (3/4 of the limit), or each job one, and the cgroup's OOM
    killer would kill one. Here, started by torch.multiprocessing.spawn, OpenMPI's mpirun, torchrun,
    the deepspeed launcher or a launcher of the user's own that sets only RANK and WORLD_SIZE (each
    process a job of its own), or as two torchrun jobs of two ranks side by side: the ledger of the
    cgroup's limit, the default budget from it (the limit less a reserve of half of it), every rank
    refused by name, every process exits 0, and the OOM killer never fires. The controls: the same
    spawned ranks with SPILLWAY_NODE=0 (each its own budget), and the two torchrun jobs each in a
    ledger of its own (SPILLWAY_NODE_LEDGER: a budget per job, as before the ledger was the limit's),
    where the cgroup's OOM killer kills a rank: the limit is real and the count sees it."""
    import _cgroup

    try:
        cg = _cgroup.MemoryCgroup.make(f"spillway-test-{os.getpid()}-{launch}", CGROUP_LIMIT)
    except _cgroup.Unavailable as e:
        pytest.skip(f"no memory cgroup for the test: {e}")
    jobs = {"a": 2, "b": 2} if launch.startswith("two-") else {"": RANKS}
    try:
        out = tmp_path / launch
        out.mkdir()
        budget = spillway._spillway._node_default_budget(CGROUP_LIMIT)[0]
        env = dict(os.environ, OMP_NUM_THREADS="1", NODE_GRAB_RANKS=str(RANKS))
        for name in ("SPILLWAY_NODE_JOB", "SPILLWAY_NODE_BUDGET_BYTES", "SPILLWAY_NODE_LEDGER"):
            env.pop(name, None)  # the ledger is the cgroup's limit's
        grab = [str(WORKER), str(out), "32", str(budget // MiB + 32)]
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
        elif launch == "own-launcher":  # a shell that starts four plain processes: no launcher variable
            loop = " ".join(f'RANK={r} "$@" & pids="$pids $!";' for r in range(RANKS))
            cmd = ["sh", "-c", f'pids=; {loop} rc=0; for p in $pids; do wait $p || rc=1; done; exit $rc', "sh",
                   sys.executable, *grab]
            env["WORLD_SIZE"] = str(RANKS)
        elif launch == "torchrun" or launch.startswith("two-"):
            cmd = _torchrun(RANKS // len(jobs), grab)
        else:
            cmd = [sys.executable, "-m", "deepspeed.launcher.runner", "--num_gpus", str(RANKS), "--master_port",
                   str(free_port()), *grab]
        own = launch == "two-ledgers-control"
        procs = [subprocess.Popen(cg.wrap(cmd if i == 0 else _torchrun(jobs[tag], grab)),
                                  env=dict(env, NODE_GRAB_TAG=tag,
                                           **({"SPILLWAY_NODE_LEDGER": f"control-{os.getpid()}-{tag}",
                                               "NODE_GRAB_WAIT": "30"} if own else {})),
                                  stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
                 for i, tag in enumerate(jobs)]
        ended = [finish(proc, timeout=300) for proc in procs]
        kills, peak = cg.oom_kills(), cg.peak()
    finally:
        cg.remove()
    rc, text = max(rc for rc, _ in ended), "\n".join(text for _, text in ended)
    if launch.endswith("control"):
        print(f"{launch} in a {CGROUP_LIMIT >> 30} GiB cgroup: exit {rc}, OOM kills {kills}")
        assert kills >= 1 and rc != 0 and "SIGKILL" in text, text[-4000:]
        return
    assert kills == 0, f"the cgroup's OOM killer killed {kills} process(es)\n" + text[-4000:]
    assert rc == 0, text[-6000:]
    by_job = {tag: results(out, tag, n) for tag, n in jobs.items()}
    ranks = [r for rs in by_job.values() for r in rs]
    held = sum(r["held_bytes"] for r in ranks)
    print(f"{RANKS} ranks by {launch} in a {CGROUP_LIMIT >> 30} GiB cgroup held "
          f"{[r['held_bytes'] // MiB for r in ranks]} MiB of the default {budget // MiB} MiB budget; the cgroup's "
          f"peak {peak / MiB if peak else float('nan'):.0f} MiB, OOM kills {kills}; "
          f"jobs {sorted({r['node']['job'] for r in ranks})}; ledger of {ranks[0]['node']['scope']}")
    for tag, rs in by_job.items():
        for r in rs:
            assert r["node"] is not None, f"rank {r['rank']} joined no node budget: {r['job']}"
            assert launch == "own-launcher" or r["node"]["job"] == rs[0]["node"]["job"], "one job per launch"
            assert r["node"]["ledger"] == ranks[0]["node"]["ledger"], "one ledger for the memory limit"
            assert cg.path in r["node"]["scope"], r["node"]["scope"]
            assert sorted(j["name"] for j in r["node"]["jobs"]) == sorted({x["node"]["job"] for x in ranks})
            if launch == "spawn":  # named by the process that spawned them (sh execs it: the same pid)
                assert r["node"]["job"].startswith(f"spawn-{procs[0].pid}-"), r["node"]["job"]
            elif launch == "own-launcher":  # nothing ties them together: each is a job of its own
                assert r["node"]["job"] == f"process-{r['pid']}" and r["node"]["local_world_size"] == 1, r["node"]
            else:
                assert r["node"]["job"].startswith("launcher-"), r["node"]["job"]
                assert r["job"]["local_rank"] == r["rank"] and r["job"]["local_world_size"] == jobs[tag], r["job"]
            assert r["node"]["host_budget_bytes"] == budget and not r["node"]["budget_explicit"], r["node"]
            assert len(r["node"]["ranks"]) == RANKS, r["node"]["ranks"]
            refused_by_name(r, budget)
    assert len({r["node"]["job"] for r in ranks}) == (RANKS if launch == "own-launcher" else len(jobs))
    assert budget // 2 <= held <= budget, (held, budget)


LEARNS = r"""
import json, os, sys, torch, spillway
import torch.distributed as dist
where = sys.argv[1]
if where == "deepspeed.initialize":  # a group made before the one line: learned at initialize
    dist.init_process_group("gloo")  # env://: RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT
spillway.deepspeed.install()
before = spillway.node.stats()["job"]
if where == "init_process_group":  # after the one line: learned as the group is made
    dist.init_process_group("gloo")
    after_group = spillway.node.stats()["job"]
else:
    import deepspeed
    after_group = spillway.node.stats()["job"]
    os.environ["LOCAL_RANK"] = os.environ["RANK"]  # DeepSpeed asserts it; the script sets it after the one line
    model = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.Linear(256, 8))
    config = {"train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
              "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu"},
                                    "offload_param": {"device": "cpu"}}}
    deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
s = spillway.node.stats()
me = [r for r in s["ranks"] if r["pid"] == os.getpid()][0]
print(json.dumps({"before": before, "after_group": after_group, "job": s["job"], "local_rank": me["local_rank"],
                  "lws": s["local_world_size"], "mates": sorted(r["local_rank"] for r in s["ranks"] if r["job"] == s["job"]),
                  "declared": me["declared_bytes"], "jobs": sorted(j["name"] for j in s["jobs"])}), flush=True)
dist.barrier()
"""


@pytest.mark.parametrize("where", ["init_process_group", "deepspeed.initialize"])
def test_ranks_a_launcher_of_ones_own_started_learn_their_job_from_their_process_group(where):
    """Two processes a launcher of the user's own started with RANK, WORLD_SIZE and MASTER_* only (no
    LOCAL_RANK: the own-launcher case above, where each stays a job of its own) join as jobs of
    their own, then learn from their process group that they share one memory limit and move into
    one job (named by the lowest rank's process) as local ranks 0 and 1 of 2, with what each booked:
    as init_process_group makes the group after the one line, or, for a group made before it, at
    deepspeed.initialize (the script sets LOCAL_RANK itself, which DeepSpeed asserts), where
    admission then judges them together: each declared its need in that job."""
    import _zygote

    port, ledger = free_port(), f"learn-{os.getpid()}-{where}"
    env = dict(os.environ, DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
               WORLD_SIZE="2", SPILLWAY_NODE_LEDGER=ledger)
    for name in ("SPILLWAY_NODE_JOB", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "SPILLWAY_NODE_BUDGET_BYTES"):
        env.pop(name, None)
    procs = [_zygote.popen([sys.executable, "-c", LEARNS, where], env=dict(env, RANK=str(r)), stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE, text=True) for r in range(2)]
    outs = []
    for p in procs:
        out, err = p.communicate(timeout=300)
        assert p.returncode == 0, out[-2000:] + err[-6000:]
        outs.append(json.loads(out.strip().splitlines()[-1]))
    print(outs)
    assert [o["before"] for o in outs] == [f"process-{p.pid}" for p in procs], outs
    job = outs[0]["job"]
    assert outs[1]["job"] == job and job.startswith(f"dist-{procs[0].pid}-"), outs
    assert [o["after_group"] for o in outs] == ([job, job] if where == "init_process_group" else
                                                [o["before"] for o in outs]), outs
    assert [o["local_rank"] for o in outs] == [0, 1] and all(o["lws"] == 2 for o in outs), outs
    assert all(o["mates"] == [0, 1] and o["jobs"] == [job] for o in outs), outs
    if where == "deepspeed.initialize":
        assert all(o["declared"] > 0 for o in outs), outs
