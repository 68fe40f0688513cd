"""spillway.node without DeepSpeed: when spillway.install() joins a node budget and when it does not,
`python -m spillway.node` reading a live job from outside, admission through
spillway.install(declare_bytes=...), and the errors for bad settings. Each rank is a process of its
own (torch's allocators are replaced once per process)."""
import json
import os
import subprocess
import sys
import time

import _zygote
import pytest

MiB = 1 << 20

RANK = r"""
import os, sys, json, torch, spillway
mode = sys.argv[1]
if mode == "hold":
    spillway.install()
    with spillway.tag("optimizer_state"):
        state = torch.zeros(8 << 20)  # 32 MiB
    plain = torch.ones(12 << 20)  # 48 MiB of torch's own
    import mmap
    stray = mmap.mmap(-1, 40 << 20, flags=mmap.MAP_PRIVATE)  # nobody's: the negative control of "unowned"
    stray.write(b"x" * (40 << 20))
    memory = spillway.node.memory()  # published to the ledger
    print("ready", flush=True)
    sys.stdin.readline()
    del plain  # what the epoch boundary publishes is read then: torch's 48 MiB are gone
    spillway.next_epoch()
    report = spillway.next_epoch()
    [row] = report["node"]["ranks"]
    print(json.dumps({"joined": spillway.node.joined(), "budget": report["node"]["host_budget_bytes"],
                      "epoch_memory": [sum(row["memory"].values()), row["memory"]["torch_cpu"]], "named": memory["named_fraction"],
                      "resident": memory["resident_bytes"]}))
elif mode == "parent":
    spillway.install()
    import subprocess
    child = subprocess.run([sys.executable, "-c", "import json, spillway; spillway.install(); "
                            "print(json.dumps(spillway.node.joined()))"], capture_output=True, text=True)
    print(json.dumps({"parent": spillway.node.joined(), "child": child.stdout.strip(), "err": child.stderr[-500:]}))
elif mode == "wait":
    spillway.install()
    print("ready", flush=True)
    sys.stdin.readline()
elif mode == "lone":
    import warnings
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        rt = spillway.install()
    s = spillway.node.stats() if spillway.node.joined() else {}
    print(json.dumps({"pid": os.getpid(), "joined": spillway.node.joined(), "job": s.get("job"), "ledger": s.get("ledger"),
                      "local_world_size": s.get("local_world_size"), "jobs": [j["name"] for j in s.get("jobs", [])],
                      "ranks": [(r["pid"], r["pageable_bytes"]) for r in s.get("ranks", [])],
                      "warnings": [[w.category.__name__, str(w.message)] for w in caught],
                      "budgets": [rt.host.stats()["budget_bytes"], rt.pinned.stats()["budget_bytes"]],
                      "default": spillway.default_host_budget()}))
elif mode == "declare":
    try:
        spillway.install(declare_bytes=int(sys.argv[2]))
        print(json.dumps({"ok": True}))
    except spillway.Error as e:
        print(json.dumps({"ok": False, "type": type(e).__name__, "text": str(e)}))
"""


def env_with(**extra):
    env = {k: v for k, v in os.environ.items()
           if k not in ("LOCAL_RANK", "LOCAL_WORLD_SIZE", "LOCAL_SIZE", "SPILLWAY_NODE_JOB", "SLURM_LOCALID")}
    env.update(extra)
    return env


def job_name(what):
    return f"pytest-{what}-{os.getpid()}-{time.monotonic_ns()}"


def test_install_joins_the_named_job_and_the_viewer_reads_it_from_outside():
    job = job_name("api")
    p = _zygote.popen([sys.executable, "-c", RANK, "hold"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                      stderr=subprocess.PIPE, text=True,
                      env=env_with(SPILLWAY_NODE_JOB=job, SPILLWAY_NODE_BUDGET_BYTES=str(256 * MiB)))
    try:
        assert p.stdout.readline().strip() == "ready", p.stderr.read()
        out = _zygote.run([sys.executable, "-m", "spillway.node", "--job", job, "--json"],
                          capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr
        [ledger] = json.loads(out.stdout)
        assert [j["name"] for j in ledger["jobs"]] == [job] and ledger["host_budget_bytes"] == 256 * MiB
        assert ledger["ledger"] == os.environ["SPILLWAY_NODE_LEDGER"], ledger  # conftest's, for this file
        assert ledger["budget_explicit"]  # SPILLWAY_NODE_BUDGET_BYTES
        [rank] = ledger["ranks"]
        assert rank["pid"] == p.pid and rank["job"] == job
        assert rank["pageable_bytes"] >= 32 * MiB  # the tagged tensor's region, booked
        assert rank["live_by_kind"]["optimizer_state"] >= 32 * MiB
        # Every byte named: the tagged state is the arenas', the plain tensor torch's, the stray
        # mapping nobody's (Note [Every byte named]).
        memory = rank["memory"]
        assert memory["arenas"] >= 31 * MiB and memory["torch_cpu"] >= 47 * MiB, memory
        assert memory["unowned"] >= 38 * MiB, memory
        text = _zygote.run([sys.executable, "-m", "spillway.node", "--job", job], capture_output=True,
                           text=True, timeout=120)
        assert text.returncode == 0 and f"job {job}" in text.stdout and "by kind" in text.stdout, text
        assert f"{job} rank 0 resident" in text.stdout and "% named)" in text.stdout, text.stdout
        p.stdin.write("\n")
        p.stdin.flush()
        done = json.loads(p.stdout.readline())
        # the epoch report carries the ledger, with the rank's memory published at the boundary
        assert (done["joined"], done["budget"]) == (True, 256 * MiB), done
        resident, torch_cpu = done["epoch_memory"]
        assert resident > 0 and torch_cpu < 8 * MiB, done  # published anew at the boundary
        assert done["named"] <= 1 - 38 * MiB / done["resident"], done  # the stray mapping is not named
    finally:
        p.stdin.close()
        p.wait(timeout=120)
    assert p.returncode == 0, p.stderr.read()
    gone = _zygote.run([sys.executable, "-m", "spillway.node", "--job", job], capture_output=True, text=True,
                       timeout=120)
    assert gone.returncode == 1 and "no node segment" in gone.stderr  # the last rank out removed it


def test_the_viewer_names_a_segment_it_cannot_read(tmp_path):
    """Reading a ledger that is not there (a path mistyped, or a job that ended between the listing
    and the read) is an error that names the path, not a crash: the binding raised without the GIL."""
    missing = tmp_path / "spillway-node-0-limit-0000000000000000"
    out = _zygote.run([sys.executable, "-m", "spillway.node", str(missing)], capture_output=True, text=True,
                      timeout=120)
    assert out.returncode == 1, (out.returncode, out.stderr)
    assert f"spillway node: {missing}: " in out.stderr and "Traceback" not in out.stderr, out.stderr


FULL_DIR = """
import spillway, sys
try:
    spillway.node.join(job_id="tiny", directory=sys.argv[1], ledger_name="tiny")
    print("joined")
except spillway.Error as e:
    print(type(e).__name__, e)
"""


def test_a_ledger_directory_too_full_for_the_segment_is_an_error_not_a_crash(tmp_path):
    """A tmpfs with less room than the segment (a container's small /dev/shm that DataLoader
    filled): the join fails with an error that says so, not a SIGBUS at the first write to a page
    the tmpfs cannot back. A tmpfs of 256 KiB of the kernel's own, mounted in a user and mount
    namespace of the test's (skipped by name where none can be made)."""
    import shutil

    unshare = shutil.which("unshare")
    if unshare is None:
        pytest.skip("unshare (util-linux) is not installed")
    probe = subprocess.run([unshare, "--user", "--map-root-user", "--mount", "true"], capture_output=True,
                           text=True, timeout=60)
    if probe.returncode != 0:
        pytest.skip(f"no user and mount namespace can be made here: {probe.stderr.strip()}")
    shm = tmp_path / "shm"
    shm.mkdir()
    out = subprocess.run([unshare, "--user", "--map-root-user", "--mount", "sh", "-c",
                          'mount -t tmpfs -o size=256k tmpfs "$1" && exec "$2" -c "$3" "$1"', "sh", str(shm),
                          sys.executable, FULL_DIR], capture_output=True, text=True, timeout=120, env=env_with())
    assert out.returncode == 0, (out.returncode, out.stdout, out.stderr[-3000:])
    assert out.stdout.startswith("OutOfMemory") and "is /dev/shm full or too small?" in out.stdout, out.stdout
    assert "No space left on device" in out.stdout, out.stdout


def test_a_child_of_a_rank_that_inherits_its_variables_is_not_a_rank():
    out = _zygote.run([sys.executable, "-c", RANK, "parent"], capture_output=True, text=True, timeout=120,
                      env=env_with(SPILLWAY_NODE_JOB=job_name("child"), LOCAL_RANK="0", LOCAL_WORLD_SIZE="1"))
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout.splitlines()[-1])
    assert result["parent"] is True and result["child"] == "false", result


def _holders(count, **env):
    procs = []
    try:
        for _ in range(count):
            procs.append(_zygote.popen([sys.executable, "-c", RANK, "wait"], stdin=subprocess.PIPE,
                                       stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                       env=env_with(**env)))
        for p in procs:
            assert p.stdout.readline().strip() == "ready", p.communicate(timeout=60)[1]
    except BaseException:
        for p in procs:
            p.kill()
        raise
    return procs


def _release(procs):
    errors = [p.communicate(input="\n", timeout=120)[1] for p in procs]
    for p, err in zip(procs, errors):
        assert p.returncode == 0, err


@pytest.mark.parametrize("env", [{}, {"LOCAL_RANK": "0"}, {"RANK": "3", "WORLD_SIZE": "4"}],
                         ids=["plain", "local-rank-alone", "own-launcher"])
def test_a_process_no_launcher_describes_is_a_job_of_its_own_in_its_limits_ledger(env):
    """A plain `python`, LOCAL_RANK without a count (which two such processes would both claim), or a
    launcher of the user's own that sets only RANK and WORLD_SIZE: each process joins the ledger of
    its memory limit from its first byte as a job of its own, so processes that no launcher ties
    together still share one budget, and none takes a silent budget of its own."""
    holders = _holders(1, **env)
    try:
        out = _zygote.run([sys.executable, "-c", RANK, "lone"], capture_output=True, text=True, timeout=120,
                          env=env_with(**env))
    finally:
        _release(holders)
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout.splitlines()[-1])
    assert result["joined"] and result["warnings"] == [], result
    assert result["ledger"] == os.environ["SPILLWAY_NODE_LEDGER"], result  # conftest's, for this file
    assert result["job"] == f"process-{result['pid']}" and result["local_world_size"] == 1, result
    assert f"process-{holders[0].pid}" in result["jobs"] and result["job"] in result["jobs"], result
    assert holders[0].pid in [pid for pid, _ in result["ranks"]], result


SPAWNER = r"""
import json, os, sys
import torch.multiprocessing as mp
import spillway
spillway.install()  # at module level: each rank that mp.spawn starts runs it too, importing this file


def rank(i, out):
    s = spillway.node.stats() if spillway.node.joined() else {}
    with open(os.path.join(out, f"{i}.json"), "w") as f:
        json.dump({"pid": os.getpid(), "job": s.get("job"), "ledger": s.get("ledger"),
                   "jobs": [j["name"] for j in s.get("jobs", [])]}, f)


if __name__ == "__main__":
    mp.spawn(rank, args=(sys.argv[1],), nprocs=2, join=True)
    s = spillway.node.stats()
    print(json.dumps({"pid": os.getpid(), "job": s["job"], "ledger": s["ledger"]}))
"""


def test_the_ranks_a_process_of_its_own_spawns_join_a_job_of_theirs_beside_it(tmp_path):
    """A script that calls install() at module level and then mp.spawn: the parent is a job of its own
    and its spawned ranks (which run the module level again) are one job beside it, in the same ledger.
    Were the parent's children marked as its workers, the ranks would join nothing and each take a
    budget of its own."""
    script = tmp_path / "spawner.py"
    script.write_text(SPAWNER)
    out = _zygote.run([sys.executable, str(script), str(tmp_path)], capture_output=True, text=True, timeout=300,
                      env=env_with())
    assert out.returncode == 0, out.stderr[-3000:]
    parent = json.loads(out.stdout.splitlines()[-1])
    assert parent["job"] == f"process-{parent['pid']}", parent
    ranks = [json.loads((tmp_path / f"{i}.json").read_text()) for i in range(2)]
    for r in ranks:
        assert r["job"] is not None and r["job"].startswith(f"spawn-{parent['pid']}-"), (r, parent)
        assert r["job"] == ranks[0]["job"] and r["ledger"] == parent["ledger"], (r, parent)
        assert parent["job"] in r["jobs"], r


def test_a_process_no_ledger_can_take_warns_once_by_name_and_keeps_budgets_of_its_own():
    """The ledger of its memory limit cannot be opened (here a segment file of the wrong mode at its
    path, as another user's or a hand-made one would be): the process warns once (a
    spillway.node.NodeWarning naming it, the reason and what to set) and keeps the budgets of its own,
    3/4 of the memory limit between its two arenas, as before there was a node ledger."""
    ledger = f"pytest-unreadable-{os.getpid()}-{time.monotonic_ns()}"
    path = f"/dev/shm/spillway-node-{os.geteuid()}-{ledger}"
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
    try:
        os.fchmod(fd, 0o644)
        os.write(fd, b"\0" * 4096)
        os.close(fd)
        out = _zygote.run([sys.executable, "-c", RANK, "lone"], capture_output=True, text=True, timeout=120,
                          env=env_with(SPILLWAY_NODE_LEDGER=ledger))
        assert os.path.exists(path), "the file that is not a ledger is left as it was"
    finally:
        os.unlink(path)
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout.splitlines()[-1])
    assert not result["joined"], result
    [(category, text)] = result["warnings"]
    assert category == "NodeWarning", result
    for part in (f"process {result['pid']} ", "joined no node ledger", "FailedPrecondition", "mode 0644", path,
                 "SPILLWAY_NODE_LEDGER", "SPILLWAY_NODE=0"):
        assert part in text, (part, text)
    assert abs(sum(result["budgets"]) - result["default"]) <= 2 * 4096, result


def test_declared_needs_past_the_node_budget_fail_every_rank_with_one_message():
    job = job_name("declare")
    ranks = [_zygote.popen([sys.executable, "-c", RANK, "declare", str(60 * MiB)], stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE, text=True,
                           env=env_with(SPILLWAY_NODE_JOB=job, SPILLWAY_NODE_BUDGET_BYTES=str(100 * MiB),
                                        LOCAL_RANK=str(r), LOCAL_WORLD_SIZE="2"))
             for r in range(2)]
    results = []
    for p in ranks:
        out, err = p.communicate(timeout=300)
        assert p.returncode == 0, err
        results.append(json.loads(out.splitlines()[-1]))
    assert [r["ok"] for r in results] == [False, False]
    assert {r["type"] for r in results} == {"OverBudget"}
    assert results[0]["text"] == results[1]["text"]
    assert "the 2 local ranks of job" in results[0]["text"] and "Nothing was allocated" in results[0]["text"]


def test_admission_counts_what_a_rank_holds_outside_the_arenas_against_the_memory_limit():
    """A budget set just under the memory limit leaves no room for what the rank holds outside the
    arenas (the interpreter, torch, libraries' heaps): a need within that budget is still refused,
    naming what the rank holds by owner, because admission measures it (spillway.node.memory(),
    published before the declaration) instead of trusting the reserve. The control: a need 2 GiB
    smaller fits."""
    import spillway

    limit = spillway.memory_limit_bytes()
    budget = limit - 64 * MiB
    results = []
    for need in (budget, budget - 2048 * MiB):
        out = _zygote.run([sys.executable, "-c", RANK, "declare", str(need)], capture_output=True, text=True,
                          timeout=300, env=env_with(SPILLWAY_NODE_JOB=job_name("outside"), LOCAL_RANK="0",
                                                    LOCAL_WORLD_SIZE="1", SPILLWAY_NODE_BUDGET_BYTES=str(budget)))
        assert out.returncode == 0, out.stderr[-3000:]
        results.append(json.loads(out.stdout.splitlines()[-1]))
    refused, control = results
    assert control == {"ok": True}, control
    assert refused["type"] == "OverBudget", refused
    text = refused["text"]
    assert "outside Spillway's arenas, as each last published it (local rank 0 " in text, text
    assert "python " in text and "though within the node budget" in text, text


@pytest.mark.parametrize("env, declare, expect", [
    ({"SPILLWAY_NODE_BUDGET_BYTES": "lots"}, None, "SPILLWAY_NODE_BUDGET_BYTES='lots'"),
    ({"SPILLWAY_NODE_JOB": "../x"}, None, "SPILLWAY_NODE_JOB='../x'"),
    ({"SPILLWAY_NODE": "0"}, 1 << 20, "declare_bytes=...) needs a node budget"),
])
def test_bad_node_settings_are_refused_by_name(env, declare, expect):
    if "SPILLWAY_NODE_JOB" not in env:
        env = dict(env, **({"SPILLWAY_NODE_JOB": job_name("bad")} if declare is None else {}))
    script = ("import spillway\ntry:\n    spillway.install(declare_bytes=%r)\n    print('installed')\n"
              "except spillway.Error as e:\n    print(type(e).__name__, e)\n" % declare)
    out = _zygote.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                      env=env_with(**env))
    assert out.returncode == 0, out.stderr
    assert expect in out.stdout, out.stdout
    assert out.stdout.startswith(("InvalidArgument", "FailedPrecondition")), out.stdout
