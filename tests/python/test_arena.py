"""spillway.HostArena from Python: arena-backed tensors, boundaries, errors, the live exporter."""
import gc
import urllib.request

import pytest
import torch

import spillway


def test_tensors_over_arena_memory_are_freed_with_their_last_reference():
    a = spillway.HostArena(budget_bytes=32 << 20, pinned=False)
    t = a.empty((256, 1024), torch.float32, kind="optimizer_state", lifetime="persistent", owner=7)
    assert t.shape == (256, 1024) and t.dtype == torch.float32 and a.owns(t)
    t.fill_(2.0)
    view = t[3:5]
    del t
    gc.collect()
    assert a.stats()["live_bytes"] == 1 << 20          # the view keeps the storage
    assert view.sum().item() == 2.0 * 2 * 1024
    del view
    assert a.stats()["live_bytes"] == 0
    z = a.zeros((3,), torch.bfloat16)
    assert z.dtype == torch.bfloat16 and z.abs().sum().item() == 0
    assert a.empty_like(z).dtype == torch.bfloat16


def test_boundaries_report_escapes_as_python_objects():
    a = spillway.HostArena(budget_bytes=16 << 20, pinned=False)
    keep = []
    with a.epoch(0) as epoch:
        with a.step(0) as step:
            keep.append(a.empty((1024,), lifetime="step"))   # outlives its step: an escape
            tmp = a.empty((1024,), lifetime="step")
            del tmp
        persistent = a.empty((10,), lifetime="persistent")
    assert step.report["escape_count"] == 1 and not step.report["clean"]
    assert step.report["escaped_bytes"] == 4096
    assert "escape" in step.report["text"]
    assert epoch.report["kind"] == "epoch" and epoch.report["live_bytes"] >= 4096 * 2
    del persistent
    keep.clear()
    with a.epoch(1) as clean:
        x = a.empty((1024,), lifetime="epoch")
        del x
    assert clean.report["clean"]


def test_errors_are_python_exceptions_with_the_status_message():
    a = spillway.HostArena(budget_bytes=4 << 20, pinned=False)
    with pytest.raises(spillway.OverBudget, match="budget") as e:
        a.empty((8 << 20,), torch.uint8)
    assert isinstance(e.value, MemoryError) and isinstance(e.value, spillway.Error)
    with pytest.raises(spillway.InvalidArgument, match="kind"):
        a.empty((4,), kind="no-such-kind")
    with pytest.raises(spillway.InvalidArgument, match="negative dimension"):
        a.empty((-1, 4))
    # Products that wrap 64 bits are refused, not allocated small (the item-12 numel checks).
    with pytest.raises(spillway.InvalidArgument, match="element count overflows 64 bits"):
        a.empty((1 << 32, 1 << 32, 2), torch.uint8)
    with pytest.raises(spillway.InvalidArgument, match="size in bytes overflows 64 bits"):
        a.empty((1 << 62,), torch.float64)
    with pytest.raises(spillway.InvalidArgument):
        spillway.HostArena(policy="sometimes")
    for slack, shown in ((-0.01, "-0.01"), (1.5, "1.5"), (float("nan"), "nan")):  # install() passes 0.05
        with pytest.raises(spillway.InvalidArgument, match=rf"peak_slack must be in \[0, 1\], not {shown}\b"):
            spillway.HostArena(pinned=False, peak_slack=slack)
    with pytest.raises(spillway.FailedPrecondition):
        a._end_epoch()  # no epoch began
    t = a.empty((1024,), torch.uint8)  # and the arena still works
    assert a.owns(t)


def test_the_exporter_serves_the_arena_and_a_taken_port_is_unavailable():
    a = spillway.HostArena(budget_bytes=16 << 20, pinned=False, name="pyarena")
    t = a.empty((1 << 18,), torch.float32, kind="optimizer_state", lifetime="persistent")
    e = spillway.metrics.serve("127.0.0.1:0", [a])
    body = urllib.request.urlopen(f"http://127.0.0.1:{e.port}/metrics", timeout=10).read().decode()
    assert 'arena="pyarena"' in body and 'spillway_host_bytes{' in body, body[:2000]
    with pytest.raises(spillway.Unavailable, match="could not listen"):
        spillway.metrics.serve(f"127.0.0.1:{e.port}")
    del t
