"""aio_handle writes and reads go to the file the caller names, at the time of the call (issue: "No
byte lands in the wrong place", item 1). Each case was seen failing on the handle that cached
descriptors by fd number and by path; both backends (io_uring and the thread pool) run each."""
import os

import pytest
import torch

import spillway

BACKENDS = ["uring", "thread_pool"]


@pytest.fixture(params=BACKENDS)
def handle(request):
    h = spillway.aio_handle(block_size=1 << 16, queue_depth=8, backend=request.param)
    yield h
    h.close()


def data(value, n=1 << 16):
    return torch.full((n,), value, dtype=torch.uint8)


def contents(path):
    with open(path, "rb") as f:
        return f.read()


def test_a_reused_fd_number_writes_to_the_new_file(handle, tmp_path):
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    fa = os.open(a, os.O_RDWR | os.O_CREAT, 0o600)
    assert handle.async_pwrite(data(1), fa, 0) == 0 and handle.wait() == 1
    os.close(fa)
    fb = os.open(b, os.O_RDWR | os.O_CREAT, 0o600)
    assert fb == fa, "the kernel gave the lowest free number back (the case under test)"
    assert handle.async_pwrite(data(2), fb, 0) == 0 and handle.wait() == 1
    os.close(fb)
    assert contents(a) == bytes([1]) * (1 << 16), "B's bytes landed in A"
    assert contents(b) == bytes([2]) * (1 << 16), "B stayed empty"


def test_a_dup_of_an_fd_writes_to_the_same_file(handle, tmp_path):
    p = str(tmp_path / "f")
    fd = os.open(p, os.O_RDWR | os.O_CREAT, 0o600)
    fd2 = os.dup(fd)
    assert handle.async_pwrite(data(3), fd2, 4096) == 0 and handle.wait() == 1
    os.close(fd2)
    assert handle.async_pwrite(data(4, 4096), fd, 0) == 0 and handle.wait() == 1
    os.close(fd)
    got = contents(p)
    assert got[:4096] == bytes([4]) * 4096 and got[4096:4096 + (1 << 16)] == bytes([3]) * (1 << 16)


def test_closing_the_fd_before_wait_still_writes_the_file_it_named(handle, tmp_path):
    p = str(tmp_path / "f")
    fd = os.open(p, os.O_RDWR | os.O_CREAT, 0o600)
    assert handle.async_pwrite(data(5), fd, 0) == 0
    os.close(fd)                                  # the caller's number is gone; the I/O is not
    other = os.open(str(tmp_path / "other"), os.O_RDWR | os.O_CREAT, 0o600)
    assert handle.wait() == 1
    os.close(other)
    assert contents(p) == bytes([5]) * (1 << 16)
    assert contents(str(tmp_path / "other")) == b""


def test_a_renamed_checkpoint_is_not_overwritten(handle, tmp_path):
    tmp, ckpt = str(tmp_path / "ckpt.tmp"), str(tmp_path / "ckpt")
    assert handle.sync_pwrite(data(6), tmp) == 1
    os.replace(tmp, ckpt)
    assert handle.sync_pwrite(data(7), tmp) == 1
    assert contents(ckpt) == bytes([6]) * (1 << 16), "the renamed checkpoint was overwritten"
    assert os.path.exists(tmp) and contents(tmp) == bytes([7]) * (1 << 16)


def test_an_unlinked_and_recreated_path_gets_the_new_bytes(handle, tmp_path):
    p = str(tmp_path / "f")
    assert handle.sync_pwrite(data(8), p) == 1
    os.unlink(p)
    assert handle.sync_pwrite(data(9), p) == 1
    assert os.path.exists(p) and contents(p) == bytes([9]) * (1 << 16)


def test_a_read_after_the_path_was_replaced_reads_the_new_file(handle, tmp_path):
    p, new = str(tmp_path / "f"), str(tmp_path / "new")
    assert handle.sync_pwrite(data(10), p) == 1
    out = torch.zeros(1 << 16, dtype=torch.uint8)
    assert handle.sync_pread(out, p) == 1 and int(out[0]) == 10
    with open(new, "wb") as f:
        f.write(bytes([11]) * (1 << 16))
    os.replace(new, p)
    assert handle.sync_pread(out, p) == 1
    assert torch.equal(out, data(11)), "read the replaced file's old bytes"
