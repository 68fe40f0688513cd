"""Smaller data-safety items of the Python edge (issue "No byte lands in the wrong place"): each
test was seen failing on the code before its fix."""
import os
import warnings

import pytest
import torch

import spillway


def test_reclaim_is_refused_for_arenas_whose_memory_python_tensors_view():
    # At a boundary `reclaim` frees escaped allocations; a tensor still viewing one would read freed
    # (and later reused) memory. Python arenas hand out tensors, so the policy is refused by name.
    with pytest.raises(spillway.InvalidArgument, match="reclaim"):
        spillway.HostArena(pinned=False, policy="reclaim")


def test_is_pinned_is_false_for_a_pageable_arenas_memory():
    arena = spillway.HostArena(pinned=False)
    h = spillway.aio_handle(arena=arena)
    t = h.new_cpu_locked_tensor(4096, torch.empty(0, dtype=torch.uint8))
    assert arena.owns(t)
    assert not h.is_pinned(t), "pageable arena memory reported as pinned"
    h.close()


def test_an_aio_handle_refuses_every_call_in_a_forked_child(tmp_path):
    h = spillway.aio_handle(block_size=1 << 16, queue_depth=4)
    src = torch.full((4096,), 3, dtype=torch.uint8)
    assert h.sync_pwrite(src, str(tmp_path / "parent")) == 1
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            h.sync_pwrite(src, str(tmp_path / "child"))
        except spillway.FailedPrecondition as e:
            code = 0 if "fork" in str(e) else 2
        except BaseException:  # noqa: BLE001
            code = 3
        os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert not (tmp_path / "child").exists()
    assert h.sync_pwrite(src, str(tmp_path / "parent2")) == 1   # the parent's handle still works
    h.close()


def test_a_boundary_under_fail_does_not_hide_the_users_exception():
    arena = spillway.HostArena(pinned=False, policy="fail")
    keep = []
    with pytest.raises(KeyError, match="mine"):
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            with arena.epoch(0):
                with arena.step(0):
                    keep.append(arena.empty((1024,), lifetime="step"))   # escapes
                    raise KeyError("mine")
    assert any("Escaped" in str(x.message) or "escape" in str(x.message) for x in w), [str(x.message) for x in w]


@pytest.mark.parametrize("block_size", [512, 1024, 3000])
def test_block_sizes_deepspeeds_op_accepts_are_accepted(tmp_path, block_size):
    h = spillway.aio_handle(block_size=block_size, queue_depth=4)
    assert h.get_block_size() == block_size
    src = torch.arange(10_000, dtype=torch.int32)
    dst = torch.zeros_like(src)
    assert h.sync_pwrite(src, str(tmp_path / "f")) == 1
    assert h.sync_pread(dst, str(tmp_path / "f")) == 1
    assert torch.equal(src, dst)
    h.close()
