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
    print("ready", flush=True)
    sys.stdin.readline()
    spillway.next_epoch()
    report = spillway.next_epoch()
    print(json.dumps({"joined": spillway.node.joined(), "budget": report["node"]["host_budget_bytes"]}))
elif mode == "parent":
    spillway.install()
    import subprocess
    child = subprocess.run([sys.executable, "-c", "import json, spillway; spillway.install(); "
                            "print(json.dumps(spillway.node.joined()))"], capture_output=True, text=True)
    print(json.dumps({"parent": spillway.node.joined(), "child": child.stdout.strip(), "err": child.stderr[-500:]}))
elif mode == "lone":
    spillway.install()
    print(json.dumps({"joined": spillway.node.joined()}))
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
        text = _zygote.run([sys.executable, "-m", "spillway.node", "--job", job], capture_output=True,
                           text=True, timeout=120)
        assert text.returncode == 0 and f"job {job}" in text.stdout and "by kind" in text.stdout, text
        p.stdin.write("\n")
        p.stdin.flush()
        done = json.loads(p.stdout.readline())
        assert done == {"joined": True, "budget": 256 * MiB}  # the epoch report carries the ledger
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


def test_a_child_of_a_rank_that_inherits_its_variables_is_not_a_rank():
    out = _zygote.run([sys.executable, "-c", RANK, "parent"], capture_output=True, text=True, timeout=120,
                      env=env_with(SPILLWAY_NODE_JOB=job_name("child"), LOCAL_RANK="0", LOCAL_WORLD_SIZE="1"))
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout.splitlines()[-1])
    assert result["parent"] is True and result["child"] == "false", result


def test_a_lone_process_with_local_rank_set_joins_nothing():
    out = _zygote.run([sys.executable, "-c", RANK, "lone"], capture_output=True, text=True, timeout=120,
                      env=env_with(LOCAL_RANK="0"))
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout.splitlines()[-1]) == {"joined": False}


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


@pytest.mark.parametrize("env, declare, expect", [
    ({"SPILLWAY_NODE_BUDGET_BYTES": "lots"}, None, "SPILLWAY_NODE_BUDGET_BYTES='lots'"),
    ({"SPILLWAY_NODE_JOB": "../x"}, None, "SPILLWAY_NODE_JOB='../x'"),
    ({}, 1 << 20, "declare_bytes=...) needs a node budget"),
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
