"""DeepSpeed's own swapping code running on Spillway through spillway.deepspeed.install()."""
import pytest
import torch

import spillway

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
        assert isinstance(op.aio_handle(1 << 20, 8, False, True, 1), spillway.aio_handle)
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
    assert isinstance(h, spillway.aio_handle)
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
