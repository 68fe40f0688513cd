"""The Yi-34B mechanism in real PyTorch: torch.utils.data.DataLoader forks its workers at every
epoch (num_workers=4, persistent_workers=False, fork start method), and the first optimizer step
after the fork writes all of AdamW's state and the parameters. In ordinary torch tensors every page
written is copied (the workers still map the old ones), so the process tree's anonymous PSS grows
by the size of the state while the workers live. In Spillway's arena (MADV_DONTFORK regions) the
workers never map that memory and nothing is copied. Same model, data and detector for both."""
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


def run(arena, epochs=3):
    """Trains 3 epochs; returns (what each epoch's first step added to the tree's PSS while the
    workers were alive, tree PSS at each boundary, the last loss)."""
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
    loader = DataLoader(Tokens(), batch_size=8, num_workers=4, persistent_workers=False,
                        multiprocessing_context="fork")
    growth, boundaries = [], []
    for epoch in range(epochs):
        for i, (x, y) in enumerate(loader):
            if i == 0:
                # The workers are alive and have done their own copying (Python refcounts touch
                # their inherited heap): measure what the first step adds on top.
                before = tree_pss_anon()
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
    return growth, boundaries, loss.item()


@pytest.mark.skipif(not os.path.exists("/proc/self/smaps_rollup"), reason="needs /proc/<pid>/smaps_rollup")
def test_the_first_step_after_the_fork_copies_nothing_in_the_arena():
    state_bytes = 4 * 4 * (256 * 2048 + 2048 + 2048 * 2048 + 2048)  # params, grads, exp_avg, exp_avg_sq: 72 MiB
    arena = spillway.HostArena(budget_bytes=256 * MIB, pinned=False)
    spill_growth, spill_bounds, spill_loss = run(arena)
    ctrl_growth, ctrl_bounds, ctrl_loss = run(None)
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
