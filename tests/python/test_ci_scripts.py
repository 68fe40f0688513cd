"""The scripts CI depends on, run on real files and real processes.

scripts/stale-extension-locks: a build lock that a killed DeepSpeed JIT build left in torch's
extension cache made every later load of that op wait forever (a CI run stopped at its 90 minutes
in `install-deps --ops-only`, on a lock a minute old). The script removes a lock that no process
holds open, whatever its age; leaves the lock of a build that runs (torch's FileBaton keeps it open
while it builds); and waits for a killed build's orphaned ninja or compiler before it removes one."""
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "stale-extension-locks"


def _lock(root, op, age_s, layer="py311_cpu"):
    directory = root / layer / op if layer else root / op
    directory.mkdir(parents=True)
    lock = directory / "lock"
    lock.touch()
    stamp = time.time() - age_s
    os.utime(lock, (stamp, stamp))
    return lock


def _sweep(root, *args, check=True, env=None):
    argv = [sys.executable, str(SCRIPT), *args] + ([str(root)] if root is not None else [])
    return subprocess.run(argv, capture_output=True, text=True, timeout=60, check=check, env=env)


def test_a_lock_a_killed_build_left_a_minute_ago_is_removed(tmp_path):
    lock = _lock(tmp_path, "cpu_adam", age_s=60)
    out = _sweep(tmp_path).stdout
    assert not lock.exists(), out
    assert f"{lock}: removed" in out


def test_the_lock_a_running_build_holds_open_is_left_whatever_its_age(tmp_path):
    lock = _lock(tmp_path, "async_io", age_s=3600)
    # As torch's FileBaton: the builder keeps the lock file open until it releases it.
    build = subprocess.Popen(["bash", "-c", 'exec 3<"$0"; sleep 60', str(lock)])
    try:
        time.sleep(0.5)
        out = _sweep(tmp_path).stdout
    finally:
        build.kill()
        build.wait()
    assert lock.exists(), out
    assert f"held by a running build (pid {build.pid})" in out


def test_a_killed_builds_orphaned_compiler_is_waited_for_then_the_lock_goes(tmp_path):
    lock = _lock(tmp_path, "shm_comm", age_s=3600)
    orphan = subprocess.Popen(["sleep", "2"], cwd=lock.parent)  # ninja runs in the build directory
    start = time.monotonic()
    out = _sweep(tmp_path, "--wait", "30").stdout
    orphan.wait()
    assert time.monotonic() - start >= 1.5, out
    assert not lock.exists(), out


def test_an_orphan_that_outlives_the_wait_fails_the_sweep_by_name(tmp_path):
    lock = _lock(tmp_path, "cpu_adagrad", age_s=3600)
    orphan = subprocess.Popen(["sleep", "60"], cwd=lock.parent)
    try:
        out = _sweep(tmp_path, "--wait", "1", check=False)
    finally:
        orphan.kill()
        orphan.wait()
    assert out.returncode == 1
    assert lock.exists()
    assert f"pids [{orphan.pid}] still work in" in out.stderr and "kill them" in out.stderr


def test_torch_extensions_dir_holds_the_ops_directly(tmp_path):
    lock = _lock(tmp_path, "cpu_adam", age_s=60, layer=None)  # TORCH_EXTENSIONS_DIR/<op>/lock
    out = _sweep(None, env=dict(os.environ, TORCH_EXTENSIONS_DIR=str(tmp_path))).stdout
    assert not lock.exists(), out


def test_no_cache_is_nothing_to_do_and_a_file_in_its_place_is_named(tmp_path):
    assert _sweep(tmp_path / "absent").stdout == ""
    (tmp_path / "file").write_text("")
    out = _sweep(tmp_path / "file", check=False)
    assert out.returncode != 0
    assert "is not a directory" in out.stderr and "TORCH_EXTENSIONS_DIR" in out.stderr
