"""One rank that takes host memory until Spillway's node budget refuses it, for the node-budget
tests that need no DeepSpeed engine (tests/python/test_node.py, tests/python/test_gpu_deepspeed.py
on CUDA):

    torchrun --nproc-per-node N node_grab.py OUT_DIR CHUNK_MIB [MAX_MIB]    # or mpirun -np N, deepspeed
    RANK=R WORLD_SIZE=N python node_grab.py OUT_DIR CHUNK_MIB [MAX_MIB]     # a launcher of one's own
    python node_grab.py OUT_DIR CHUNK_MIB MAX_MIB --spawn N    # N ranks by torch.multiprocessing.spawn

`spillway.deepspeed.install()` (the one line) joins the node budget: the one the launcher's
environment names, or under spawn the one of the process that started the ranks, which sets no
variable. The rank then takes CHUNK_MIB tensors as fast as it can, each one touched, at most MAX_MIB
(unbounded when 0 or absent): where torch sees a CUDA device, every other one pinned
(torch.empty(pin_memory=True), which install() makes Spillway's pinned arena, page-locked by
cudaHostRegister), the rest pageable optimizer state under spillway.tag. The first refusal ends the
grab; the rank then waits until every local rank is full (files in OUT_DIR), reads the node's
ledger while all of them hold what they got, writes OUT_DIR/rank<R>.json, and waits until every rank
has written before it lets go. Several jobs may share OUT_DIR: NODE_GRAB_TAG names this job's files
(rank<TAG><R>.json) and NODE_GRAB_RANKS counts the ranks of every job, which all wait for each other."""
import json
import os
import sys
import time

import torch
import spillway


def wait_for(out_dir, prefix, suffix, rank, everyone):
    limit = float(os.environ.get("NODE_GRAB_WAIT", "300"))  # a control whose other job was killed waits less
    deadline = time.monotonic() + limit
    while sum(n.startswith(prefix) and n.endswith(suffix) for n in os.listdir(out_dir)) < everyone:
        if time.monotonic() > deadline:
            sys.exit(f"rank {rank}: not every rank wrote {prefix}*{suffix} within {limit:.0f} s")
        time.sleep(0.02)


def grab(rank, world, out_dir, chunk, max_bytes):
    spillway.deepspeed.install()
    pin = torch.cuda.is_available()
    held, error, pinned_bytes = [], None, 0
    try:
        while len(held) < 4096 and not (max_bytes and (len(held) + 1) * chunk > max_bytes):
            if pin and len(held) % 2:
                t = torch.empty(chunk, dtype=torch.uint8, pin_memory=True)
                pinned_bytes += chunk
            else:
                with spillway.tag("optimizer_state"):
                    t = torch.empty(chunk, dtype=torch.uint8)
            t.fill_(1)
            held.append(t)
    except Exception as e:  # noqa: BLE001 (the test reads the class and the message)
        error = {"type": type(e).__name__, "text": str(e).split("\nException raised from")[0]}

    tag, everyone = os.environ.get("NODE_GRAB_TAG", ""), int(os.environ.get("NODE_GRAB_RANKS", world))
    open(os.path.join(out_dir, f"full{tag}{rank}"), "w").close()
    wait_for(out_dir, "full", "", rank, everyone)
    node = ({k: v for k, v in spillway.node.stats().items() if k != "text"} if spillway.node.joined() else None)
    runtime = spillway.installed().stats()
    report = {"rank": rank, "pid": os.getpid(), "held_bytes": len(held) * chunk, "pinned_bytes": pinned_bytes,
              "error": error, "node": node, "job": spillway.node.job(), "pin_mode": runtime["pinned"].get("pin_mode"),
              "pinned_arena": runtime["pinned"], "cuda": pin}
    with open(os.path.join(out_dir, f"rank{tag}{rank}.json.tmp"), "w") as f:
        json.dump(report, f)
    os.rename(os.path.join(out_dir, f"rank{tag}{rank}.json.tmp"), os.path.join(out_dir, f"rank{tag}{rank}.json"))
    wait_for(out_dir, "rank", ".json", rank, everyone)


def main():
    argv = [a for a in sys.argv if not a.startswith("--local_rank")]  # the deepspeed launcher adds it
    out_dir, chunk = argv[1], int(argv[2]) << 20
    max_bytes = int(argv[3]) << 20 if len(argv) > 3 else 0
    if len(argv) > 5 and argv[4] == "--spawn":
        import torch.multiprocessing as mp  # noqa: PLC0415

        world = int(argv[5])
        mp.spawn(grab, args=(world, out_dir, chunk, max_bytes), nprocs=world, join=True)
    else:
        # torchrun's variables (the deepspeed launcher's LOCAL_SIZE), else mpirun's (OpenMPI sets
        # no LOCAL_RANK), else a launcher's of the user's own that sets only RANK and WORLD_SIZE
        env = os.environ.get
        rank = env("LOCAL_RANK", env("OMPI_COMM_WORLD_LOCAL_RANK", env("RANK")))
        world = env("LOCAL_WORLD_SIZE", env("LOCAL_SIZE", env("OMPI_COMM_WORLD_LOCAL_SIZE", env("WORLD_SIZE"))))
        grab(int(rank), int(world), out_dir, chunk, max_bytes)


if __name__ == "__main__":
    main()
