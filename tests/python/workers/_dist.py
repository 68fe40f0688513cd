"""The environment of a one-process torch.distributed world for the workers (a free port on
localhost, rank 0 of 1), unless the caller set up a larger world in the environment."""
import atexit
import os
import socket


def _leave_the_group():
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        # Every rank leaves together: a rank that destroyed its group while another was still in
        # its last collective (HF Trainer's final save ends at different times on the two ranks)
        # left Gloo's threads to abort at static destruction. A launcher kills the others when
        # one rank fails, so no rank waits here for a dead one.
        if dist.get_world_size() > 1:
            dist.barrier()
        dist.destroy_process_group()


def world_from_env_or_single():
    # The process group is destroyed before the interpreter finalizes: left to static destruction,
    # Gloo's threads sometimes aborted the process at exit ("terminate called without an active
    # exception", exit -6) after it had printed its results (in two-rank runs whose ranks finished
    # at different times). Plain DeepSpeed's ds_zero3.py run aborted so with the group destroyed
    # too; it leaves with os._exit after its result (ds_zero3.py says why).
    atexit.register(_leave_the_group)
    if "WORLD_SIZE" not in os.environ:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1")
    os.environ["LOCAL_RANK"] = os.environ["RANK"]


def backend():
    """The process group's backend for the DeepSpeed accelerator the worker runs on: NCCL on CUDA
    (DS_ACCELERATOR=cuda, where ZeRO-3 gathers device tensors), Gloo on DeepSpeed's CPU accelerator."""
    return "nccl" if os.environ.get("DS_ACCELERATOR") == "cuda" else "gloo"


def device():
    """Where DeepSpeed's engine computes: cuda:LOCAL_RANK under DS_ACCELERATOR=cuda, else cpu. The
    workers put their batches there (DeepSpeed moves the model, not the inputs)."""
    import torch

    if os.environ.get("DS_ACCELERATOR") == "cuda":
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    return torch.device("cpu")


def infinity_offload(swap):
    """The ZeRO-Infinity settings the equivalence test (ds_step.py bf16-infinity) and the swap-store
    tests (ds_infinity.py) share: (zero_optimization keys, aio section) for optimizer state and
    parameters on NVMe under `swap`, with 1M-element sub-groups and 1024x1024 weights above
    DeepSpeed's 1 MiB swap threshold, parameters kept on NVMe (max_in_cpu 0) and rewritten after
    every step, the optimizer state swapped in ahead and out behind the step (pipeline_read,
    pipeline_write). Parameter prefetch is off: with it, plain DeepSpeed 0.19.8 stops at the second
    forward ("AssertionError: param 6 already assigned swap buffer id 4" in
    partitioned_param_swapper._allocate_and_return_buffers_for_swap_in, whatever buffer_count)."""
    os.makedirs(swap, exist_ok=True)
    zero = {
        "sub_group_size": 1 << 20,
        "stage3_prefetch_bucket_size": 0,
        "offload_optimizer": {"device": "nvme", "nvme_path": swap, "pin_memory": True, "buffer_count": 12,
                              "pipeline_read": True, "pipeline_write": True},
        "offload_param": {"device": "nvme", "nvme_path": swap, "pin_memory": True, "buffer_size": 1100000,
                          "buffer_count": 6, "max_in_cpu": 0},
    }
    return zero, {"block_size": 1 << 20, "queue_depth": 8, "intra_op_parallelism": 1}
