"""Quiet by default: a healthy import and use of spillway prints nothing on stderr. Informational
lines (which pinning an arena uses, where an NVMe budget came from) print with SPILLWAY_LOG=info or
spillway.set_log_level("info")."""
import os
import subprocess
import sys

import pytest

USE = """
import spillway, torch, sys
if len(sys.argv) > 1:
    spillway.set_log_level(sys.argv[1])
a = spillway.HostArena(budget_bytes=1 << 22)
t = a.empty((16,), torch.float32, kind="param", lifetime="persistent")
rt = spillway.install()
with spillway.tag("param"):
    x = torch.zeros(1 << 20)
h = spillway.aio_handle()
"""


def run(*args, env=None):
    e = {k: v for k, v in os.environ.items() if k != "SPILLWAY_LOG"}
    e.update(env or {})
    return subprocess.run([sys.executable, "-c", USE, *args], capture_output=True, text=True, env=e, timeout=300)


def test_import_and_use_print_nothing_on_stderr():
    p = run()
    assert p.returncode == 0, p.stderr
    assert p.stderr == ""


def test_info_lines_print_when_asked_for():
    for p in (run(env={"SPILLWAY_LOG": "info"}), run("info")):
        assert p.returncode == 0, p.stderr
        assert "spillway info: host arena" in p.stderr


def test_bad_input_an_unknown_level_is_refused_by_name():
    import spillway
    with pytest.raises(spillway.InvalidArgument, match="use error, warning, info or debug"):
        spillway.set_log_level("loud")
