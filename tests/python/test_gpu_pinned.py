"""Spillway's pinned host allocator under real non_blocking copies (GPU only; label `gpu`, every
test skips with the reason where torch sees no CUDA device).

The stress: a D2H copy into a pinned block is queued behind a long kernel, the block's tensor is
dropped at once, and a new pinned block of the same size is taken and written by the host. Without
the deferred free (record_event holding the block), the new block is the old one and the pending
copy overwrites the host's bytes afterwards; every byte is checked."""
import json
import subprocess
import sys
import textwrap

import pytest
import torch


def cuda_or_skip():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device visible to torch (this torch: CPU build or no GPU)")


STRESS = """
import torch, spillway
rt = spillway.install()
dev = torch.device("cuda")
n = 1 << 22
src = torch.full((n,), 7, dtype=torch.uint8, device=dev)
bad = 0
for i in range(200):
    big = torch.randn(4096, 4096, device=dev)
    for _ in range(4):
        big = big @ big                               # keeps the stream busy
    out = src.to("cpu", non_blocking=True)            # pinned output, copy queued behind the matmuls
    assert rt.pinned.contains(out.data_ptr(), n), "the D2H output is not Spillway's"
    del out                                           # freed while the copy is pending
    mine = torch.empty(n, dtype=torch.uint8, pin_memory=True)
    mine.fill_(i % 5)
    torch.cuda.synchronize()
    bad += int((mine != i % 5).sum())
print("BAD", bad, "DEFERRED", spillway._spillway._pinned_stats()["deferred_frees_total"])
"""


def test_gpu_freed_pinned_blocks_are_not_reused_under_a_pending_copy():
    cuda_or_skip()
    p = subprocess.run([sys.executable, "-c", textwrap.dedent(STRESS)], capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-4000:]
    last = p.stdout.split()
    assert last[last.index("BAD") + 1] == "0", p.stdout
    assert int(last[last.index("DEFERRED") + 1]) > 0, p.stdout


def test_gpu_spillway_holds_at_most_1_02x_the_pinned_bytes_requested():
    cuda_or_skip()
    code = """
import torch, spillway
rt = spillway.install()
sizes = [(4 << 20) + 12345 * i for i in range(1, 100)]   # awkward partition sizes (ZeRO partitions are MBs)
keep = [torch.empty(s, dtype=torch.uint8, pin_memory=True) for s in sizes]
asked = sum(sizes)
held = rt.pinned.stats()["committed_bytes"]
print("RATIO", held / asked, "TORCH", torch.cuda.host_memory_stats().get("allocated_bytes.current", 0) / asked)
"""
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-4000:]
    words = p.stdout.split()
    print(p.stdout)
    assert float(words[words.index("RATIO") + 1]) <= 1.02, p.stdout


def test_gpu_every_byte_named_places_torchs_pinned_cache_and_spillways_once():
    # Note [Every byte named] on a GPU, where it is unverified on the CPU: 256 MiB pinned by torch's
    # own caching host allocator (no install()) must be named once, as torch_pinned or cuda_driver
    # but not both; 256 MiB pinned after install() are the arenas'. Prints both tables.
    cuda_or_skip()
    code = """
import json, sys, torch, spillway, spillway.node
mode = sys.argv[1]
if mode == "installed":
    spillway.install()
torch.cuda.init()
before = spillway.node.memory(publish=False)
keep = torch.ones(64 << 20, pin_memory=True)  # 256 MiB, touched
after = spillway.node.memory(publish=False)
print(json.dumps({"before": before, "after": after}))
"""
    for mode in ("torch", "installed"):
        p = subprocess.run([sys.executable, "-c", code, mode], capture_output=True, text=True, timeout=600)
        assert p.returncode == 0, p.stderr[-4000:]
        r = json.loads(p.stdout.strip().splitlines()[-1])
        before, after = r["before"]["owners"], r["after"]["owners"]
        grew = {k: after[k] - before[k] for k in after}
        print(mode, r["after"]["text"], {k: round(v / (1 << 20), 1) for k, v in grew.items() if abs(v) >= 1 << 20})
        assert r["after"]["named_fraction"] >= 0.95, r["after"]["text"]
        if mode == "torch":
            assert 250 << 20 <= grew["torch_pinned"] + grew["cuda_driver"] <= 280 << 20, grew
        else:
            assert grew["arenas"] >= 250 << 20 and grew["torch_pinned"] + grew["cuda_driver"] < 16 << 20, grew


def test_gpu_the_dataloaders_pin_memory_thread_pins_batches_in_the_arena_and_reads_them():
    # A row of docs/allocator.md's "Which children read what": DataLoader(pin_memory=True) pins each
    # batch on a thread of the parent (its pin-memory thread), so the pinned arena's MADV_DONTFORK
    # pages are its to write: the batches land in the pinned arena, their values intact, and reach
    # the GPU; the fork workers that made them never touch the pinned pages.
    cuda_or_skip()
    code = """
import torch, spillway
from torch.utils.data import DataLoader, TensorDataset
rt = spillway.install()
data = TensorDataset(torch.arange(64 * 1024, dtype=torch.float32).reshape(64, 1024))
ok = 0
for (b,) in DataLoader(data, batch_size=8, num_workers=2, pin_memory=True, multiprocessing_context="fork"):
    assert b.is_pinned() and rt.pinned.contains(b.data_ptr(), b.nbytes), "the batch is not in the pinned arena"
    d = b.to("cuda", non_blocking=True)
    torch.cuda.synchronize()
    assert torch.equal(d.cpu(), b)
    ok += 1
print("PINNED BATCHES", ok)
"""
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-4000:]
    assert "PINNED BATCHES 8" in p.stdout, p.stdout + p.stderr[-3000:]
    assert "spillway: process" not in p.stderr, p.stderr[-3000:]
