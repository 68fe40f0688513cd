"""The scripts CI depends on, run on real files and real processes.

scripts/stale-extension-locks: a build lock that a killed DeepSpeed JIT build left in torch's
extension cache made every later load of that op wait forever (a CI run stopped at its 90 minutes
in `install-deps --ops-only`, on a lock a minute old). The script removes a lock that no running
build holds, whatever its age, and leaves the lock of a build that runs."""
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "stale-extension-locks"


def _lock(root, op, age_s):
    directory = root / "py311_cpu" / op
    directory.mkdir(parents=True)
    lock = directory / "lock"
    lock.touch()
    stamp = time.time() - age_s
    os.utime(lock, (stamp, stamp))
    return lock


def _sweep(root, *args):
    return subprocess.run([sys.executable, str(SCRIPT), *args, str(root)], capture_output=True,
                          text=True, timeout=60, check=True).stdout


def test_a_lock_a_killed_build_left_a_minute_ago_is_removed(tmp_path):
    lock = _lock(tmp_path, "cpu_adam", age_s=60)
    out = _sweep(tmp_path)
    assert not lock.exists(), out
    assert f"{lock}: removed" in out


def test_the_lock_of_a_running_build_is_left_whatever_its_age(tmp_path):
    lock = _lock(tmp_path, "async_io", age_s=3600)
    build = subprocess.Popen(["sleep", "60"], cwd=lock.parent)  # ninja runs in the build directory
    try:
        out = _sweep(tmp_path)
    finally:
        build.kill()
        build.wait()
    assert lock.exists(), out
    assert f"a build is running there (pid {build.pid})" in out


def test_a_file_open_in_the_build_directory_holds_it(tmp_path):
    lock = _lock(tmp_path, "shm_comm", age_s=3600)
    with open(lock.parent / "build.ninja", "w"):
        out = _sweep(tmp_path)
    assert lock.exists(), out
    assert _sweep(tmp_path) and not lock.exists()


def test_a_lock_taken_a_moment_ago_is_judged_once_its_grace_has_passed(tmp_path):
    young = _lock(tmp_path, "cpu_adagrad", age_s=0)
    start = time.monotonic()
    out = _sweep(tmp_path, "--grace", "2")
    assert time.monotonic() - start >= 1.5
    assert not young.exists(), out


def test_no_cache_is_nothing_to_do_and_a_file_in_its_place_is_named(tmp_path):
    assert _sweep(tmp_path / "absent") == ""
    (tmp_path / "file").write_text("")
    out = subprocess.run([sys.executable, str(SCRIPT), str(tmp_path / "file")], capture_output=True,
                         text=True, timeout=60)
    assert out.returncode != 0
    assert "is not a directory" in out.stderr and "TORCH_EXTENSIONS_DIR" in out.stderr
