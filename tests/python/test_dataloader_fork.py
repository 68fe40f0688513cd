"""The Yi-34B mechanism in real PyTorch: torch.utils.data.DataLoader forks its workers at every
epoch (num_workers=4, persistent_workers=False, fork start method), and the first optimizer step
after the fork writes all of AdamW's state and the parameters. In ordinary torch tensors every page
written is copied (the workers still map the old ones), so the process tree's anonymous PSS grows
by the size of the state while the workers live. In Spillway's arena (MADV_DONTFORK regions) the
workers never map that memory and nothing is copied. Same model, data and detector for both.

Under the forkserver and spawn start methods (forkserver is Python 3.14's default on Linux) the
workers are fresh interpreters that share no page with the trainer: neither run copies anything,
and each worker costs an interpreter of its own and a pickled dataset instead."""
import ctypes
import gc
import os

import pytest
import torch
from torch.utils.data import DataLoader, Dataset

import spillway
from spillway.leak_suite import tree_pss_anon  # the tree's Pss_Anon, as the leak suite measures it

MIB = 1 << 20
_libc = ctypes.CDLL("libc.so.6")


class Tokens(Dataset):
    def __len__(self):
        return 64

    def __getitem__(self, i):
        g = torch.Generator().manual_seed(i)
        return torch.randn(256, generator=g), torch.randn(2048, generator=g)


def run(arena, epochs=3, start_method="fork", workers=4):
    """Trains 3 epochs; returns (what each epoch's first step added to the tree's PSS while the
    workers were alive, tree PSS at each boundary, the last loss, what starting the workers added
    to the tree's PSS at each epoch)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 2048), torch.nn.Tanh(), torch.nn.Linear(2048, 2048))
    # The fused CPU AdamW updates in place (DeepSpeed's CPU Adam does too): no temporaries of the
    # parameters' size, whose malloc'd pages would be copied on write in either setup.
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)

    def zeros(p, kind):
        if arena is None:
            return torch.zeros_like(p)
        return arena.zeros(tuple(p.shape), p.dtype, kind=kind, lifetime="persistent")

    # Parameters, gradients (accumulated in place: zero_grad(set_to_none=False)) and AdamW's
    # state, in arena tensors or in ordinary ones; torch's AdamW uses the state it finds.
    for p in model.parameters():
        if arena is not None:
            a = zeros(p, "param")
            a.copy_(p.data)
            p.data = a
        p.grad = zeros(p, "grad")
        opt.state[p] = {"step": torch.tensor(0.0), "exp_avg": zeros(p, "optimizer_state"),
                        "exp_avg_sq": zeros(p, "optimizer_state")}
    loader = DataLoader(Tokens(), batch_size=8, num_workers=workers, persistent_workers=False,
                        multiprocessing_context=start_method)
    growth, boundaries, started = [], [], []
    for epoch in range(epochs):
        unstarted = tree_pss_anon()
        for i, (x, y) in enumerate(loader):
            if i == 0:
                # The workers are alive and have done their own copying (Python refcounts touch
                # their inherited heap): measure what the first step adds on top.
                before = tree_pss_anon()
                started.append(before - unstarted)
            loss = torch.nn.functional.mse_loss(model(x), y)
            opt.zero_grad(set_to_none=False)
            loss.backward()
            opt.step()
            if i == 0:
                growth.append(tree_pss_anon() - before)
        # At the boundary the workers are gone. glibc keeps freed heap pages (backward's
        # temporaries) until trimmed, and how many depends on the heap's history, not on what is
        # live; trim in both runs so the boundary measures live memory.
        gc.collect()
        _libc.malloc_trim(0)
        boundaries.append(tree_pss_anon())
    return growth, boundaries, loss.item(), started


@pytest.mark.skipif(not os.path.exists("/proc/self/smaps_rollup"), reason="needs /proc/<pid>/smaps_rollup")
def test_the_first_step_after_the_fork_copies_nothing_in_the_arena():
    state_bytes = 4 * 4 * (256 * 2048 + 2048 + 2048 * 2048 + 2048)  # params, grads, exp_avg, exp_avg_sq: 72 MiB
    arena = spillway.HostArena(budget_bytes=256 * MIB, pinned=False)
    spill_growth, spill_bounds, spill_loss, _ = run(arena)
    ctrl_growth, ctrl_bounds, ctrl_loss, _ = run(None)
    print(f"\nstate {state_bytes / MIB:.1f} MiB; first-step growth per epoch: spillway "
          f"{[round(g / MIB, 2) for g in spill_growth]} MiB, torch tensors {[round(g / MIB, 2) for g in ctrl_growth]} MiB")
    assert abs(spill_loss - ctrl_loss) < 1e-4 * abs(ctrl_loss), "the same training either way"
    # The control shows the mechanism: the state copied at every epoch's first step.
    assert min(ctrl_growth) > 0.9 * state_bytes, ctrl_growth
    # The arena removes exactly that copy. What is left in both runs is torch's own backward:
    # each weight's new gradient is a fresh temporary (then added into .grad) in recycled malloc
    # pages the workers still share, about one copy of the parameters' size.
    param_bytes = state_bytes // 4
    for s_g, c_g in zip(spill_growth, ctrl_growth):
        assert c_g - s_g > 0.9 * state_bytes, (spill_growth, ctrl_growth)
    assert max(spill_growth) < 1.5 * param_bytes, spill_growth
    # And the tree is flat across epoch boundaries (workers reaped each time).
    assert max(spill_bounds) - min(spill_bounds) < 4 * MIB, spill_bounds
    print(f"tree PSS at the boundaries: spillway {[round(b / MIB, 1) for b in spill_bounds]} MiB, "
          f"torch tensors {[round(b / MIB, 1) for b in ctrl_bounds]} MiB")


@pytest.mark.skipif(not os.path.exists("/proc/self/smaps_rollup"), reason="needs /proc/<pid>/smaps_rollup")
@pytest.mark.parametrize("start_method", ["forkserver", "spawn"])
def test_forkserver_and_spawn_workers_copy_nothing_either_way_and_cost_an_interpreter_each(start_method):
    """The same training under the other start methods: the first step copies nothing, plain or in
    the arena (the workers never mapped the trainer's pages), the two runs train alike, and what the
    workers cost instead is an interpreter each, at every epoch: the tree's PSS grows by more than
    the fork's page tables when they start. The fork control of the test above is the one that
    grows."""
    state_bytes = 4 * 4 * (256 * 2048 + 2048 + 2048 * 2048 + 2048)
    arena = spillway.HostArena(budget_bytes=256 * MIB, pinned=False)
    # One worker, two epochs (epoch 1 is judged): each start is an interpreter that imports torch,
    # seconds of CI per start.
    spill_growth, _, spill_loss, spill_started = run(arena, epochs=2, start_method=start_method, workers=1)
    ctrl_growth, _, ctrl_loss, ctrl_started = run(None, epochs=2, start_method=start_method, workers=1)
    print(f"\n{start_method}: state {state_bytes / MIB:.1f} MiB; first-step growth per epoch: spillway "
          f"{[round(g / MIB, 2) for g in spill_growth]} MiB, torch tensors {[round(g / MIB, 2) for g in ctrl_growth]} "
          f"MiB; starting the worker added {[round(g / MIB, 1) for g in spill_started]} / "
          f"{[round(g / MIB, 1) for g in ctrl_started]} MiB")
    assert abs(spill_loss - ctrl_loss) < 1e-4 * abs(ctrl_loss), "the same training either way"
    # After epoch 0 (whose first step makes AdamW's buffers in both runs) the first step adds only
    # backward's fresh temporaries (about the parameters' size, in heap pages trimmed at the
    # boundary), the same in both runs: nothing of the state is copied.
    param_bytes = state_bytes // 4
    for s_g, c_g in zip(spill_growth[1:], ctrl_growth[1:]):
        assert max(s_g, c_g) < 1.5 * param_bytes and abs(s_g - c_g) < 0.1 * state_bytes, (spill_growth, ctrl_growth)
    # The worker is an interpreter that imported torch: far more than a fork's page tables.
    for g in spill_started + ctrl_started:
        assert g > 40 * MIB, (spill_started, ctrl_started)


WORKER_READS_STATE = r"""
import sys, torch, spillway
from torch.utils.data import DataLoader, Dataset
spillway.install()
with spillway.tag("optimizer_state"):
    state = torch.ones(1 << 20)  # 4 MiB of "optimizer state" in Spillway's arena
plain = torch.ones(1 << 20)      # the same made outside spillway.tag: torch's, copied on write

class Reads(Dataset):
    def __init__(self, t):
        self.t = t
    def __len__(self):
        return 4
    def __getitem__(self, i):
        if sys.argv[1] == "elsewhere":
            import ctypes
            ctypes.string_at(16)  # a fault on the null page, nothing of Spillway's
        return self.t[i * 1000].clone()

which = state if sys.argv[1] == "tagged" else plain
try:
    for _ in DataLoader(Reads(which), num_workers=1, multiprocessing_context="fork"):
        pass
    print("read", flush=True)
except RuntimeError as e:
    print("worker died:", str(e).splitlines()[0], flush=True)
"""


@pytest.mark.parametrize("made", ["tagged", "plain", "elsewhere"])
def test_a_dataloader_worker_that_reads_spillway_state_is_told_why_it_dies(made):
    """A fork-context DataLoader worker whose dataset holds a tensor made under spillway.tag reads
    a page Spillway keeps out of forked children (MADV_DONTFORK): the worker still dies with
    SIGSEGV, as it always did, and DataLoader says so, but first the worker's stderr names the
    arena, the kind, why the page is not there and what to do. The controls: the same data made
    outside spillway.tag is copied into the worker and read, and nothing is said; a worker that
    faults elsewhere dies as before, with torch's word and none of Spillway's."""
    import sys

    import _zygote

    p = _zygote.run([sys.executable, "-c", WORKER_READS_STATE, made], capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    if made == "plain":
        assert p.stdout.strip().endswith("read"), p.stdout + p.stderr[-3000:]
        assert "spillway: process" not in p.stderr, p.stderr[-3000:]
        return
    assert "worker died:" in p.stdout, p.stdout + p.stderr[-3000:]
    if made == "elsewhere":
        assert "Unexpected segmentation fault encountered in worker" in p.stderr, p.stderr[-3000:]
        assert "spillway: process" not in p.stderr, p.stderr[-3000:]
        return
    lines = p.stderr.splitlines()
    said = [i for i, line in enumerate(lines) if line.startswith("spillway: process")]
    torchs = [i for i, line in enumerate(lines) if "Unexpected segmentation fault encountered in worker" in line]
    assert len(said) == 1 and torchs and said[0] < torchs[0], p.stderr[-3000:]  # ours, then torch's as before
    said = [lines[said[0]]]
    assert "host arena 'host'" in said[0] and "first mapped for optimizer_state" in said[0], said[0]
    assert "MADV_DONTFORK" in said[0] and "Read this state in the parent" in said[0], said[0]
