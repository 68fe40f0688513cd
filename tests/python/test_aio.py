"""spillway.aio_handle against DeepSpeed's aio_handle contract (FIELD.md §2), on real files."""
import os
import threading
import time

import pytest
import torch

import spillway


@pytest.fixture
def handle():
    h = spillway.aio_handle(block_size=1 << 20, queue_depth=8)
    yield h
    h.close()


def test_settings_and_defaults():
    h = spillway.aio_handle()
    assert (h.get_block_size(), h.get_queue_depth(), h.get_single_submit(), h.get_overlap_events(),
            h.get_intra_op_parallelism(), h.get_alignment()) == (1048576, 128, False, False, 1, 512)
    h = spillway.aio_handle(65536, 4, True, True, 2)
    assert (h.get_block_size(), h.get_queue_depth(), h.get_single_submit(), h.get_overlap_events(),
            h.get_intra_op_parallelism(), h.get_alignment()) == (65536, 4, True, True, 2, 1024)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.uint8])
@pytest.mark.parametrize("numel", [1, 1023, 1_000_003])
def test_round_trip_every_dtype_and_odd_sizes(handle, tmp_path, dtype, numel):
    src = (torch.randn(numel) * 100).to(dtype)
    dst = torch.full_like(src, 7)
    path = str(tmp_path / "t.swp")
    assert handle.sync_pwrite(src, path) == 1
    assert os.path.getsize(path) == src.numel() * src.element_size()
    assert handle.sync_pread(dst, path) == 1
    assert torch.equal(src, dst)


def test_file_offsets_place_and_read_back_each_piece(handle, tmp_path):
    path = str(tmp_path / "pieces.swp")
    pieces = [torch.randn(n) for n in (5, 1000, 77)]
    offset = 0
    offsets = []
    for p in pieces:
        assert handle.pwrite(p, path, False, False, offset) == 1
        offsets.append(offset)
        offset += p.numel() * 4 + 12  # gaps between pieces
    for p, off in zip(pieces, offsets):
        back = torch.empty_like(p)
        assert handle.pread(back, path, False, False, off) == 1
        assert torch.equal(back, p)


def test_whole_file_read_and_write(handle, tmp_path):
    path = str(tmp_path / "whole.swp")
    src = torch.randn(4097)
    assert handle.write(src, path, False) == 0
    dst = torch.empty_like(src)
    assert handle.read(dst, path, False) == 0
    assert torch.equal(src, dst)


def test_a_read_past_the_end_returns_minus_one_and_says_why(handle, tmp_path):
    path = str(tmp_path / "short.swp")
    assert handle.sync_pwrite(torch.zeros(10), path) == 1
    assert handle.sync_pread(torch.empty(11), path) == -1
    assert "runs past the end of the file (40 bytes)" in handle.get_last_error()
    assert handle.sync_pread(torch.empty(5), path, 24) == -1  # 24 + 20 > 40
    assert handle.sync_pread(torch.empty(4), path, 24) == 1


def test_intra_op_parallelism_needs_divisible_sizes(tmp_path):
    h = spillway.aio_handle(intra_op_parallelism=4)
    path = str(tmp_path / "p.swp")
    assert h.sync_pwrite(torch.zeros(1001, dtype=torch.uint8), path) == -1
    assert "not divisible by intra_op_parallelism=4" in h.get_last_error()
    assert h.sync_pwrite(torch.zeros(1000, dtype=torch.uint8), path) == 1


def test_pinned_and_pageable_buffers_both_work(handle, tmp_path):
    example = torch.empty(0, dtype=torch.float32)
    locked = handle.new_cpu_locked_tensor(300_000, example)
    assert handle.is_pinned(locked) and handle.is_pinned(locked.narrow(0, 10, 100))
    pageable = torch.randn(300_000)
    assert not handle.is_pinned(pageable)
    locked.copy_(pageable)
    path = str(tmp_path / "b.swp")
    assert handle.sync_pwrite(pageable, path) == 1  # staged through the bounce pool
    locked.zero_()
    assert handle.sync_pread(locked, path) == 1     # straight into registered memory
    assert torch.equal(locked, pageable)
    assert handle.free_cpu_locked_tensor(locked) is True
    assert handle.free_cpu_locked_tensor(locked) is False  # not ours any more
    assert handle.free_cpu_locked_tensor(pageable) is False


def test_locked_tensors_are_exact_size_swap_buffers_in_the_arena(tmp_path):
    arena = spillway.HostArena(budget_bytes=64 << 20, pinned=False)
    h = spillway.aio_handle(arena=arena)
    before = arena.stats()["live_bytes"]
    t = h.new_cpu_locked_tensor(3 * 4096 // 2, torch.empty(0, dtype=torch.bfloat16))
    assert t.dtype == torch.bfloat16 and t.numel() == 6144
    assert arena.stats()["live_bytes"] - before == 3 * 4096  # exact pages, no power-of-two rounding
    assert h.free_cpu_locked_tensor(t)
    del t
    assert arena.stats()["live_bytes"] == before  # back when the last reference died
    h.close()


def async_round_trip(handle, tensors, paths):
    """Every tensor written with async_pwrite, one wait() counting them all, then read back the
    same way; returns the tensors read."""
    for t, p in zip(tensors, paths):
        assert handle.async_pwrite(t, p) == 0
    assert handle.wait() == len(tensors)
    back = [torch.empty_like(t) for t in tensors]
    for b, p in zip(back, paths):
        assert handle.async_pread(b, p) == 0
    assert handle.wait() == len(tensors)
    return back


def test_many_async_ops_then_one_wait(handle, tmp_path):
    tensors = [torch.randn(1000 + i) for i in range(64)]
    back = async_round_trip(handle, tensors, [str(tmp_path / f"{i}.swp") for i in range(64)])
    assert all(torch.equal(a, b) for a, b in zip(tensors, back))
    assert handle.wait() == 0


def test_page_aligned_requests_take_o_direct_and_stay_coherent_with_buffered_ones(handle, tmp_path):
    """An aligned locked tensor at an aligned offset goes through O_DIRECT; an unaligned read of the
    same file (buffered) sees the same bytes, and so does the direct read after a buffered write."""
    path = str(tmp_path / "direct.swp")
    locked = handle.new_cpu_locked_tensor(1 << 20, torch.empty(0, dtype=torch.float32))
    locked.copy_(torch.randn(1 << 20))
    assert handle.sync_pwrite(locked, path, 8192) == 1          # direct
    part = torch.empty(1001)
    assert handle.sync_pread(part, path, 8192 + 4 * 7) == 1     # buffered, unaligned
    assert torch.equal(part, locked[7:1008])
    patch = torch.arange(1001, dtype=torch.float32)
    assert handle.sync_pwrite(patch, path, 8192 + 4 * 7) == 1   # buffered write into the middle
    back = handle.new_cpu_locked_tensor(1 << 20, locked)
    assert handle.sync_pread(back, path, 8192) == 1             # direct read sees it
    expect = locked.clone()
    expect[7:1008] = patch
    assert torch.equal(back, expect)
    assert os.path.getsize(path) == 8192 + 4 * (1 << 20)


def test_more_files_than_descriptors_kept_open(handle, tmp_path):
    """300 files in flight at once: the handle keeps at most 128 open, completing the least
    recently used one's ops before closing it; wait() still counts and checks every op."""
    tensors = [torch.full((257,), float(i)) for i in range(300)]
    back = async_round_trip(handle, tensors, [str(tmp_path / f"many{i}.swp") for i in range(300)])
    assert all(torch.equal(a, b) for a, b in zip(tensors, back))
    assert len(os.listdir(f"/proc/{os.getpid()}/fd")) < 200


def test_the_fd_overload_writes_through_an_open_descriptor(handle, tmp_path):
    path = str(tmp_path / "fd.swp")
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        src = torch.randn(10_000)
        assert handle.async_pwrite(src, fd, 4096) == 0
        assert handle.wait() == 1
        dst = torch.empty_like(src)
        assert handle.async_pread(dst, fd, 4096) == 0
        assert handle.wait() == 1
        assert torch.equal(src, dst)
    finally:
        os.close(fd)


def test_wait_releases_the_gil(handle, tmp_path):
    """A thread that needs the GIL runs while wait() blocks; nothing deadlocks."""
    big = torch.randn(16 << 20)  # 64 MiB
    path = str(tmp_path / "big.swp")
    ticks = []
    stop = threading.Event()

    def spin():
        while not stop.is_set():
            ticks.append(time.monotonic())  # needs the GIL

    t = threading.Thread(target=spin)
    t.start()
    try:
        for _ in range(4):
            assert handle.async_pwrite(big, path) == 0
        start = time.monotonic()
        assert handle.wait() == 4
        end = time.monotonic()
    finally:
        stop.set()
        t.join(timeout=10)
    assert not t.is_alive()
    assert any(start < x < end for x in ticks), "no Python code ran while wait() blocked"


def test_bad_input_raises_or_returns_minus_one_and_the_process_survives(handle, tmp_path):
    path = str(tmp_path / "bad.swp")
    with pytest.raises(spillway.InvalidArgument, match="not contiguous"):
        handle.sync_pwrite(torch.randn(10, 10).t(), path)
    with pytest.raises(spillway.InvalidArgument, match="is on meta"):
        handle.sync_pwrite(torch.empty(10, device="meta"), path)
    assert handle.sync_pwrite(torch.randn(10), path, -8) == -1
    assert "negative file offset" in handle.get_last_error()
    assert handle.sync_pread(torch.empty(10), str(tmp_path / "missing.swp")) == -1
    assert "cannot open" in handle.get_last_error()
    assert handle.sync_pwrite(torch.randn(10), str(tmp_path / "no_dir" / "x.swp")) == -1
    with pytest.raises(spillway.InvalidArgument, match="must be positive"):
        spillway.aio_handle(block_size=0)
    with pytest.raises(spillway.InvalidArgument, match=r"aio_handle\(bounce_buffers=0\): use 1\.\.1024"):
        spillway.aio_handle(bounce_buffers=0)
    with pytest.raises(spillway.InvalidArgument, match=r"aio_handle\(bounce_buffers=-1\): use 1\.\.1024"):
        spillway.aio_handle(bounce_buffers=-1)
    with pytest.raises(spillway.InvalidArgument, match="num_elem"):
        handle.new_cpu_locked_tensor(-1, torch.empty(0))
    handle.close()
    with pytest.raises(spillway.FailedPrecondition, match="closed"):
        handle.sync_pread(torch.empty(10), path)
    # Everything written before is intact.
    h2 = spillway.aio_handle()
    assert h2.sync_pwrite(torch.arange(10.0), path) == 1
    back = torch.empty(10)
    assert h2.sync_pread(back, path) == 1 and torch.equal(back, torch.arange(10.0))
