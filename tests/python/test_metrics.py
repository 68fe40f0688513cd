# spillway.metrics.serve in a process holding a library with 1 MiB of thread-local storage, the
# situation a CUDA build of torch creates (Note [Thread stack floor], metrics/src/thread_stack_floor.cc).
# CivetWeb starts its threads with a 100 KiB stack. Spillway's executables raise that to the default;
# the Python extension cannot (it is loaded RTLD_LOCAL). Each case runs in a fresh interpreter.
import os
import subprocess
import sys

import pytest

BIG_TLS = os.environ.get("SPILLWAY_BIG_TLS_LIB")
pytestmark = pytest.mark.skipif(
    not BIG_TLS, reason="SPILLWAY_BIG_TLS_LIB is not set: ctest sets it to tests/metrics' "
    "libspillway_big_tls.so (run through ctest, or set it)")

# Serves, scrapes once, and prints what happened; exits 0 either way (the process survives).
SERVE = r"""
import ctypes, sys, urllib.request
if sys.argv[1] == "dlopen":
    assert ctypes.CDLL(sys.argv[2]).BigTlsTouch(9) == 9
import spillway, spillway.metrics
try:
    e = spillway.metrics.serve("127.0.0.1:0")
except spillway.Unavailable as err:
    print("UNAVAILABLE", err)
else:
    body = urllib.request.urlopen(f"http://127.0.0.1:{e.port}/metrics", timeout=10).read().decode()
    print("SERVED", "# TYPE" in body)
"""


def run(mode, preload=None):
    env = dict(os.environ)
    if preload:
        env["LD_PRELOAD"] = preload
    p = subprocess.run([sys.executable, "-c", SERVE, mode, BIG_TLS], env=env, capture_output=True,
                       text=True, timeout=120)
    assert p.returncode == 0, p.stderr[-3000:]
    return p.stdout.strip().splitlines()[-1]


def test_a_library_loaded_after_start_leaves_the_exporter_working():
    # `import torch` with CUDA: the library comes in through dlopen, and glibc gives its TLS to each
    # thread on first use instead of carving it out of every stack.
    assert run("dlopen") == "SERVED True"


def test_static_tls_from_a_preload_is_named_instead_of_the_port():
    # The same library loaded at start: its TLS is static, CivetWeb's 100 KiB threads cannot start,
    # and the error names that and the way out, not "the port is probably in use".
    out = run("plain", preload=BIG_TLS)
    assert out.startswith("UNAVAILABLE"), out
    assert "static TLS" in out and "(102400 bytes) stack" in out and "LD_PRELOAD" in out, out
    assert "port is probably in use" not in out, out


def test_without_the_library_the_exporter_serves():
    # Control for the two above: the same script with nothing loaded.
    assert run("plain") == "SERVED True"
