"""spillway.engine with two NCCL ranks (Note [Device collectives] in docs/engine.md). Label `gpu`;
it needs two CUDA devices (NCCL refuses two ranks on one device) and skips, saying so, on fewer:
scripts/gpu-check reports that skip as a skip with its reason on a one-GPU machine, never as a pass.
One NCCL rank against the host path: test_gpu_engine.py."""
import pytest
import torch

from test_engine import config, run_ranks


def test_gpu_two_nccl_ranks_equal_one_process(tmp_path):
    if not torch.cuda.is_available() or not torch.distributed.is_nccl_available():
        pytest.skip("needs CUDA devices visible to torch and a torch with NCCL")
    if torch.cuda.device_count() < 2:
        pytest.skip(f"needs two CUDA devices (NCCL refuses two ranks on one device); found {torch.cuda.device_count()}")
    for d in ("host", "nccl2"):
        (tmp_path / d).mkdir()
    host = run_ranks(config("cpu", tmp_path / "host"), 1, tmp_path / "host.pt", device="cuda")
    two = run_ranks(config("cpu", tmp_path / "nccl2"), 2, tmp_path / "nccl2.pt", device="cuda",
                    backend="cpu:gloo,cuda:nccl")
    assert two["backend"] == "cpu:gloo,cuda:nccl" and two["collectives_device"].startswith("cuda")
    worst = max(abs(a - b) / abs(a) for a, b in zip(host["losses"], two["losses"]))
    assert worst < 1e-5  # the tolerance of two gloo ranks against one process (test_engine.py)
