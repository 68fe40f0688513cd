"""DeepSpeed's own swapping code running on Spillway through spillway.deepspeed.install()."""
import _zygote
import pytest
import torch

import spillway

import _ds_env

deepspeed = pytest.importorskip("deepspeed", reason="DeepSpeed is not installed (scripts/install-deps installs 0.19.8)")
from deepspeed.ops.op_builder import AsyncIOBuilder  # noqa: E402
from deepspeed.runtime.swap_tensor.async_swapper import AsyncTensorSwapper  # noqa: E402
from deepspeed.runtime.swap_tensor.utils import swap_in_tensors, swap_out_tensors  # noqa: E402


@pytest.fixture(scope="module")
def ds_comm():
    """DeepSpeed's comm layer at world size 1 on Gloo (its swappers log through dist.get_rank())."""
    import os
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", LOCAL_RANK="0", WORLD_SIZE="1")
    deepspeed.init_distributed(dist_backend="gloo", auto_mpi_discovery=False)
    yield
    torch.distributed.destroy_process_group()


@pytest.fixture
def installed():
    spillway.deepspeed.install()
    yield
    spillway.deepspeed.uninstall()


def test_install_routes_the_aio_op_and_uninstall_restores_it():
    original = AsyncIOBuilder.load
    spillway.deepspeed.install()
    try:
        assert spillway.deepspeed.installed()
        op = AsyncIOBuilder().load(verbose=False)
        # Spillway's handle, with DeepSpeed's swap paths routed to its NVMe arena (Note [DeepSpeed swap])
        made = op.aio_handle(1 << 20, 8, False, True, 1)
        assert isinstance(made, spillway.deepspeed._swap.Handle)
        assert isinstance(made._inner, spillway.aio_handle)
        assert AsyncIOBuilder().is_compatible()
        with pytest.raises(spillway.FailedPrecondition, match="already called"):
            spillway.deepspeed.install()  # twice is refused, and changes nothing
        assert AsyncIOBuilder().load(verbose=False).aio_handle is spillway.deepspeed._aio_handle
    finally:
        spillway.deepspeed.uninstall()
    assert not spillway.deepspeed.installed()
    assert AsyncIOBuilder.load is original


def test_deepspeeds_swap_buffers_come_from_the_installed_pinned_arena(installed):
    """DeepSpeed makes its handles without an arena: their locked buffers must land in the arena
    spillway.install() made (its budget, its ledger, what serve() watches), not in a third one."""
    h = AsyncIOBuilder().load(verbose=False).aio_handle(1 << 20, 8, False, True, 1)
    assert isinstance(h._inner, spillway.aio_handle)
    pinned = spillway.installed().pinned
    before = pinned.stats()["live_by_kind"]["swap_buffer"]
    b = h.new_cpu_locked_tensor(1 << 16, torch.zeros(1, dtype=torch.float32))
    assert pinned.stats()["live_by_kind"]["swap_buffer"] - before == 4 << 16
    assert h.free_cpu_locked_tensor(b)
    del b  # the handle let go of it; the last reference frees it
    assert pinned.stats()["live_by_kind"]["swap_buffer"] == before


def test_swap_out_and_in_tensors_with_deepspeeds_utils(installed, tmp_path):
    h = AsyncIOBuilder().load(verbose=False).aio_handle(1 << 20, 8, False, True, 1)
    tensors = [torch.randn(4096 + 17 * i) for i in range(48)]
    paths = [str(tmp_path / f"{i}.tensor.swp") for i in range(48)]
    swap_out_tensors(h, tensors, paths)
    assert h.wait() == len(tensors)
    back = [torch.zeros_like(t) for t in tensors]
    swap_in_tensors(h, back, paths)
    assert h.wait() == len(tensors)
    assert all(torch.equal(a, b) for a, b in zip(tensors, back))


def test_async_tensor_swapper_flushes_through_locked_arena_buffers(ds_comm, installed, tmp_path):
    h = AsyncIOBuilder().load(verbose=False).aio_handle(1 << 20, 8, False, True, 1)
    example = torch.zeros(1, dtype=torch.float32)
    buffers = [h.new_cpu_locked_tensor(1 << 16, example) for _ in range(3)]
    why = _ds_env.infinity_skip_reason()
    if why:
        pytest.skip(why)
    swapper = AsyncTensorSwapper(aio_handle=h, numel_alignment=256, timers=None)
    swapper.add_buffers(buffers)  # asserts is_pinned on each
    tensors = [torch.randn(5000 + 311 * i) for i in range(40)]
    paths = [str(tmp_path / f"g{i}.swp") for i in range(40)]
    swapper.swap_out_tensors(tensors, paths)
    released = swapper.release_buffers()  # flushes and waits (asserts wait() == pending)
    assert len(released) == 3
    back = [torch.empty_like(t) for t in tensors]
    swap_in_tensors(h, back, paths)
    assert h.wait() == len(tensors)
    assert all(torch.equal(a, b) for a, b in zip(tensors, back))
    assert all(h.free_cpu_locked_tensor(b) for b in buffers)


def test_a_forked_child_makes_its_own_aio_handle_and_the_parents_still_refuse(installed, tmp_path):
    """DeepSpeed's distributed test harness and fork-start pools fork an installed process; the
    child's own handle (through DeepSpeed's op) must work, with unpinned, accelerator-pinned and
    locked buffers, as must its tagged allocations and an arena it makes, while the parent's handle
    and arenas refuse by name. (The CPU accelerator's pin_memory is a no-op; CUDA cannot run in a
    forked child of a process that used it, so there the child's pinned buffers are moot.)"""
    import os

    parents = AsyncIOBuilder().load(verbose=False).aio_handle(1 << 20, 8, False, False, 1)
    assert parents.sync_pwrite(torch.full((8192,), 5, dtype=torch.uint8), str(tmp_path / "parent")) == 1
    pid = os.fork()
    if pid == 0:
        torch.set_num_threads(1)  # libgomp's pool hangs in a forked child (DataLoader does this too)
        code = 10
        try:
            h = AsyncIOBuilder().load(verbose=False).aio_handle(1 << 20, 8, False, False, 1)
            src = torch.arange(1 << 18, dtype=torch.float32)  # unpinned, 1 MiB
            assert h.sync_pwrite(src, str(tmp_path / "child")) == 1
            back = torch.zeros_like(src)
            assert h.sync_pread(back, str(tmp_path / "child")) == 1 and torch.equal(back, src)
            code = 11
            locked = h.new_cpu_locked_tensor(1 << 18, torch.empty(0, dtype=torch.float32))
            locked.copy_(src * 2)
            assert h.async_pwrite(locked, str(tmp_path / "child-locked")) == 0 and h.wait() == 1
            locked.zero_()
            assert h.sync_pread(locked, str(tmp_path / "child-locked")) == 1
            assert torch.equal(locked, src * 2)
            h.free_cpu_locked_tensor(locked)
            code = 16
            from deepspeed.accelerator import get_accelerator
            pinned = get_accelerator().pin_memory(torch.empty(1 << 18, dtype=torch.float32))  # the CPU's: as is
            pinned.copy_(src + 1)
            assert h.sync_pwrite(pinned, str(tmp_path / "child-pinned")) == 1
            pinned.zero_()
            assert h.sync_pread(pinned, str(tmp_path / "child-pinned")) == 1 and torch.equal(pinned, src + 1)
            code = 17
            with spillway.tag("optimizer_state"):  # a tagged allocation: the child's own arena
                state = torch.zeros(1 << 18)
            assert spillway._spillway._router_stats()["child_live_bytes"] >= state.nbytes
            own = spillway.HostArena(budget_bytes=64 << 20, pinned=False)  # a new arena of the child's
            t = own.empty((1 << 16,))
            t.fill_(4.0)
            assert h.sync_pwrite(t, str(tmp_path / "child-arena")) == 1
            del t  # the child's own block goes back to the child's own arena
            assert own.stats()["live_bytes"] == 0, own.stats()
            code = 12
            try:
                parents.sync_pwrite(src, str(tmp_path / "child-through-parent"))
            except spillway.FailedPrecondition as e:
                code = 13 if "fork" in str(e) else 14
            if code == 13:
                try:
                    spillway.installed().pinned.empty((1024,))
                except spillway.FailedPrecondition as e:
                    code = 0 if "forked child" in str(e) else 15
        except BaseException as e:  # noqa: BLE001 (the child reports by exit code)
            import sys
            print(f"child failed at {code}: {type(e).__name__}: {e}", file=sys.stderr)
        os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert not (tmp_path / "child-through-parent").exists()
    assert parents.sync_pwrite(torch.ones(4096, dtype=torch.uint8), str(tmp_path / "parent2")) == 1


def test_the_rest_of_deepspeeds_aio_module_aio_read_aio_write_and_deepspeed_memcpy(installed, tmp_path):
    """What DeepSpeed's aio_basic engine (ds_io --engine aio_basic) calls: one-shot whole-file
    transfers, with DeepSpeed's validate, and its memcpy."""
    op = AsyncIOBuilder().load(verbose=False)
    src = torch.randint(0, 255, (3 << 20,), dtype=torch.uint8)  # 3 MiB: three 1 MiB blocks
    path = str(tmp_path / "basic.pt")
    assert op.aio_write(src, path, 1 << 20, 8, False, True, True) == 0
    back = torch.zeros_like(src)
    assert op.aio_read(back, path, 1 << 20, 8, False, True, True) == 0 and torch.equal(back, src)
    dest = torch.empty(1 << 10, dtype=torch.float32)
    assert op.deepspeed_memcpy(dest, torch.arange(1 << 10, dtype=torch.float32)) == 0
    assert torch.equal(dest, torch.arange(1 << 10, dtype=torch.float32))
    # Bad input: each names what is wrong, and the file and the tensors are left as they were.
    with pytest.raises(spillway.InvalidArgument, match=r"holds 3145728 bytes and the buffer 1048576"):
        op.aio_read(torch.zeros(1 << 20, dtype=torch.uint8), path, 1 << 20, 8, False, True, False)
    with pytest.raises(FileNotFoundError, match="missing.pt"):
        op.aio_read(back, str(tmp_path / "missing.pt"), 1 << 20, 8, False, True, False)
    with pytest.raises(spillway.InvalidArgument, match="dest holds 4096 bytes and src 8"):
        op.deepspeed_memcpy(dest, torch.zeros(2, dtype=torch.float32))
    with pytest.raises(spillway.InvalidArgument, match="contiguous CPU tensor"):
        op.aio_write(src[::2], path, 1 << 20, 8, False, True, False)
    assert torch.equal(dest, torch.arange(1 << 10, dtype=torch.float32))
    with open(path, "rb") as f:
        assert f.read() == src.numpy().tobytes()


def test_ds_nvme_tune_sweeps_on_spillways_op(tmp_path):
    """ds_nvme_tune runs every sweep point as a ds_io process; `python -m spillway.nvme_tune`
    installs Spillway in each (and in the workers they spawn), and each log names the op."""
    import json
    import subprocess
    import sys

    nvme = tmp_path / "nvme"
    nvme.mkdir()
    sweep = tmp_path / "sweep.json"
    sweep.write_text(json.dumps({"block_size": ["256K", "1M"], "queue_depth": [8], "sequential_requests": [False],
                                 "single_submit": [False], "io_parallel": [1]}))
    logs = tmp_path / "logs"
    p = _zygote.run([sys.executable, "-m", "spillway.nvme_tune", "--nvme_dir", str(nvme), "--sweep_config",
                     str(sweep), "--io_size", "4M", "--log_dir", str(logs)],
                    capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert "Best performance (GB/sec)" in p.stdout and '"block_size"' in p.stdout, p.stdout[-2000:]
    files = sorted(logs.rglob("*.txt"))
    assert len(files) == 4, files  # two block sizes, read and write
    for f in files:
        text = f.read_text()
        assert "aio op: spillway_async_io" in text and "Speed = " in text, (f, text[-2000:])


def test_pin_backends_and_gds_that_bypass_spillway_are_named(tmp_path):
    import subprocess
    import sys
    import textwrap

    code = textwrap.dedent("""
        import os, warnings, json, spillway
        os.environ["DS_PIN_MEMORY_BACKEND"] = "native"
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            spillway.deepspeed.install()
            spillway.deepspeed._warn_left((), {"config": {"aio": {"use_gds": True}}})
        print(json.dumps([str(x.message) for x in w if issubclass(x.category, spillway.deepspeed.AuditWarning)]))
    """)
    p = _zygote.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    import json

    said = json.loads(p.stdout.strip().splitlines()[-1])
    assert any("DS_PIN_MEMORY_BACKEND=native" in m and "not budgeted" in m and "Unset" in m for m in said), said
    assert any("aio.use_gds" in m and "GPUDirect Storage" in m and "use_gds false" in m for m in said), said


def test_deepspeeds_keyword_calls_reach_the_handle_through_the_swap_routing(installed, tmp_path):
    """The handle DeepSpeed's op makes routes swap paths to the NVMe arena and passes every other
    call on as made: DeepSpeed's fast checkpoint writer and its own aio tests write by descriptor
    with keywords (buffer=, fd=, file_offset=)."""
    import os

    h = AsyncIOBuilder().load(verbose=False).aio_handle(1 << 20, 8, False, True, 1)
    src = torch.arange(1 << 16, dtype=torch.float32)
    path = str(tmp_path / "by-fd")
    fd = os.open(path, os.O_CREAT | os.O_WRONLY, 0o600)
    try:
        assert h.async_pwrite(buffer=src, fd=fd, file_offset=0) == 0
        assert h.async_pwrite(buffer=src, fd=fd, file_offset=src.nbytes) == 0
        assert h.wait() == 2
    finally:
        os.close(fd)
    assert h.async_pwrite(buffer=src, filename=str(tmp_path / "by-name"), file_offset=0) == 0 and h.wait() == 1
    back = torch.zeros(2 << 16, dtype=torch.float32)
    assert h.sync_pread(back, path) == 1
    assert torch.equal(back[: 1 << 16], src) and torch.equal(back[1 << 16:], src)
    back = torch.zeros_like(src)
    assert h.sync_pread(buffer=back, filename=str(tmp_path / "by-name")) == 1 and torch.equal(back, src)
