"""Launching a worker as the ranks of a Gloo group on localhost, for the multi-rank DeepSpeed tests.
Imported by the test files, not collected (no test_ prefix)."""
import os
import socket
import subprocess

import _zygote


def run_ranks(argv, world=2, timeout=1200, cwd=None, env=None, fresh=False):
    """Runs `argv` once per rank (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT set; `env` added) and
    fails the test, with each rank's output, when a rank does not finish in `timeout` seconds (left
    waiting in a collective?) or exits non-zero. The ranks start from the zygote (_zygote.py), or as
    fresh processes with `fresh` (a test that measures their memory)."""
    import pytest

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = [_zygote.popen(argv, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, fresh=fresh,
                           env={**os.environ, "RANK": str(r), "WORLD_SIZE": str(world),
                                "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), **(env or {})})
             for r in range(world)]
    try:
        logs = [p.communicate(timeout=timeout) for p in procs]
    except subprocess.TimeoutExpired:
        for p in procs:
            p.kill()
        logs = [p.communicate() for p in procs]
        pytest.fail("a rank did not finish (left waiting in a collective?):\n" +
                    "\n".join(o[-1500:] + quiet(e)[-3000:] for o, e in logs))
    if any(p.returncode != 0 for p in procs):
        pytest.fail("\n".join(f"rank {r}: exit {p.returncode}\n" + o[-2000:] + quiet(e)[-4000:]
                              for r, (p, (o, e)) in enumerate(zip(procs, logs))))


def quiet(log):
    """A worker's stderr without DeepSpeed's log lines and torch's deprecation warnings."""
    return "\n".join(line for line in log.splitlines()
                     if not line.startswith("[20") and "FutureWarning" not in line and "return func(" not in line)
