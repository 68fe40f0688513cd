"""spillway.engine on a GPU: collectives on NCCL (Note [Device collectives] in docs/engine.md).
Label `gpu`; every test skips, with the reason, where torch sees no CUDA device.
"""
import pytest
import torch

from test_engine import config, run_ranks


def cuda_or_skip():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device visible to torch (this torch: CPU build or no GPU)")
    if not torch.distributed.is_nccl_available():
        pytest.skip("this torch has no NCCL")


def test_gpu_collectives_on_nccl_equal_the_host_path(tmp_path):
    """Note [Device collectives]: with a "cpu:gloo,cuda:nccl" group the trainer all-gathers and
    reduce-scatters on the GPU (NCCL); without one it does both on the host. One GPU allows one NCCL
    rank (NCCL refuses two ranks on a device), where the collectives are NCCL copies: the losses must
    equal the host path's bit for bit. Two NCCL ranks: test_gpu_engine_two_ranks.py."""
    cuda_or_skip()
    for d in ("host", "nccl1"):
        (tmp_path / d).mkdir()
    host = run_ranks(config("cpu", tmp_path / "host"), 1, tmp_path / "host.pt", device="cuda")
    nccl = run_ranks(config("cpu", tmp_path / "nccl1"), 1, tmp_path / "nccl1.pt", device="cuda",
                     backend="cpu:gloo,cuda:nccl")
    assert host["collectives_device"] == "cpu" and host["compute_device"] == "cuda:0"
    assert nccl["backend"] == "cpu:gloo,cuda:nccl" and nccl["collectives_device"] == "cuda:0"
    assert nccl["losses"] == host["losses"]
    assert nccl["losses"][-1] < 0.8 * nccl["losses"][0]
