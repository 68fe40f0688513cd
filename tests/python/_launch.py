"""Launching the four local ranks of a job for the node-budget tests (test_node.py,
test_node_launchers.py): a free port, the node segment's path, waiting for the launcher, and reading
what each rank wrote. Imported by the test files, not collected (no test_ prefix)."""
import json
import os
import subprocess

import pytest

MiB = 1 << 20
RANKS = 4


def free_port():
    import socket  # noqa: PLC0415

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def tree_bytes(root, keys=("Pss:",)):
    """The sum of `keys` of /proc/<pid>/smaps_rollup over `root` and every process below it, in
    bytes (by default the summed Pss: what the node really holds); a process gone counts 0."""
    import spillway.node  # noqa: PLC0415

    total, todo = 0, [root]
    while todo:
        pid = todo.pop()
        try:
            with open(f"/proc/{pid}/smaps_rollup") as f:
                total += sum(int(line.split()[1]) * 1024 for line in f if line.startswith(keys))
        except OSError:
            continue
        todo += spillway.node.children(pid)
    return total


def segment_path():
    """The node ledger of the ranks this test file starts (conftest names one per test process)."""
    return f"/dev/shm/spillway-node-{os.geteuid()}-{os.environ['SPILLWAY_NODE_LEDGER']}"


def finish(proc, timeout=900):
    try:
        text, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        text, _ = proc.communicate()
        pytest.fail(f"the job did not finish within {timeout} s:\n{text[-6000:]}")
    return proc.returncode, text


def results(out, tag="", ranks=RANKS):
    return [json.loads((out / f"rank{tag}{r}.json").read_text()) for r in range(ranks)]


def refused_by_name(rank, budget):
    """A rank of tests/python/workers/node_grab.py was refused by the node ledger naming its job, or,
    the one rank that took the whole node budget before the others booked anything (ranks start
    unevenly on a busy machine), by its own arena, whose budget is the node's."""
    error = rank["error"]
    assert error is not None and error["type"] == "OverBudget", rank
    if rank["held_bytes"] >= budget - (32 << 20):
        assert "host budget of" in error["text"] and f"({budget} bytes)" in error["text"], error
    else:
        assert f"of job '{rank['node']['job']}'" in error["text"], error
