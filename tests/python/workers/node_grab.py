"""One rank that takes host memory until Spillway's node budget refuses it, for the node-budget
tests that need no DeepSpeed engine (tests/python/test_gpu_deepspeed.py on CUDA):

    torchrun --nproc-per-node N node_grab.py OUT_DIR CHUNK_MIB

`spillway.deepspeed.install()` (the one line) joins the node budget the launcher's environment
names. The rank then takes CHUNK_MIB tensors as fast as it can, each one touched: where torch sees
a CUDA device, every other one pinned (torch.empty(pin_memory=True), which install() makes
Spillway's pinned arena, page-locked by cudaHostRegister), the rest pageable optimizer state under
spillway.tag. The first refusal ends the grab; the rank then waits until every local rank is full
(files in OUT_DIR), reads the node's ledger while all of them hold what they got, writes
OUT_DIR/rank<R>.json, and waits until every rank has written before it lets go."""
import json
import os
import sys
import time

import torch
import spillway

out_dir, chunk = sys.argv[1], int(sys.argv[2]) << 20
spillway.deepspeed.install()
rank, world = int(os.environ["LOCAL_RANK"]), int(os.environ["LOCAL_WORLD_SIZE"])
pin = torch.cuda.is_available()
held, error, pinned_bytes = [], None, 0
try:
    while len(held) < 4096:
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


def wait_for(name):
    deadline = time.monotonic() + 300
    while not all(os.path.exists(os.path.join(out_dir, name.format(r))) for r in range(world)):
        if time.monotonic() > deadline:
            sys.exit(f"rank {rank}: not every rank wrote {name} within 300 s")
        time.sleep(0.02)


open(os.path.join(out_dir, f"full{rank}"), "w").close()
wait_for("full{}")
node = {k: v for k, v in spillway.node.stats().items() if k != "text"}
runtime = spillway.installed().stats()
report = {"rank": rank, "pid": os.getpid(), "held_bytes": len(held) * chunk, "pinned_bytes": pinned_bytes,
          "error": error, "node": node, "pin_mode": runtime["pinned"].get("pin_mode"),
          "pinned_arena": runtime["pinned"], "cuda": pin}
with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
    json.dump(report, f)
wait_for("rank{}.json")
